// tutel-jax native CPU kernel: a dense linear layer for a few rows, as an XLA FFI custom call.
//
//   y [R, N] = x [R, K] @ W.T (+ b [N], float32 or bfloat16)
//   y [H, R, N] = x [H, R, K] @ W[h].T per head h (a weight stack [H, N, K]: e.g. MLA's absorbed kv_b_proj)
//
// W [N, K] rows ([out, in], as checkpoints store linear weights): float32 / bfloat16, or packed FP8 block / MXFP4
// / NVFP4 decoded in registers; see weights.h. Every weight byte is read once: the layer runs at the speed of
// memory, not at XLA:CPU's (which converts a bfloat16 or packed weight to float32 in memory before its matmul).
// Work over XLA's intra-op thread pool by blocks of 64 output rows. With `int8_activations`, rows times an FP4
// weight take the int8 path (q8_rows.h); a few rows of exactly bfloat16 values times bfloat16 rows take AVX-512
// BF16 dot products where the build has them (bf16_rows.h).

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "weights.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_data, ffi::AnyBuffer w_scale,
                     ffi::AnyBuffer w_global, ffi::AnyBuffer b, ffi::Result<ffi::Buffer<ffi::F32>> y,
                     int64_t format, bool int8_activations, int64_t max_workers) {
  auto xd = x.dimensions();
  if (xd.size() != 2 && xd.size() != 3) return ffi::Error::InvalidArgument("dense: expected x [R, K] or [H, R, K]");
  tj::Weight w;
  std::string err = tj::parse_weight("weight", format, w_data, w_scale, w_global, &w);
  if (!err.empty()) return ffi::Error::InvalidArgument("dense: " + err);
  const bool heads = xd.size() == 3;
  const int64_t H = heads ? xd[0] : 1, R = xd[heads ? 1 : 0], K = xd[heads ? 2 : 1], N = w.N;
  if (w.E != H || w.K != K)
    return ffi::Error::InvalidArgument("dense: weight must be [1, N, K] rows for x [R, K], [H, N, K] for x [H, R, K]");
  const tj::Bias bias(b);
  if ((bias.present() && bias.size != N) || !bias.valid())
    return ffi::Error::InvalidArgument("dense: bias must be float32 or bfloat16 [N]");
  auto yd = y->dimensions();
  if (yd.size() != xd.size() || (heads && yd[0] != H) || yd[yd.size() - 2] != R || yd[yd.size() - 1] != N)
    return ffi::Error::InvalidArgument("dense: output must be [R, N] ([H, R, N] for heads)");
  if (H == 0 || R == 0 || N == 0) return ffi::Error::Success();

  // the rows as the kernel reads them (each head's R rows after the previous head's): int8 (q8_rows.h) when asked
  // for and taken, else arranged float32
  const bool q8 = int8_activations && w.takes_q8();
  const int64_t block = tj::fp4_block(w.fmt), ldq = tj::q8_row_bytes(K, block), rows = H * R;
  std::vector<uint8_t> xq(q8 ? rows * ldq : 0);
  std::vector<float> xa(q8 ? 0 : rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    if (q8)
      tj::quantize_q8(x.typed_data() + r * K, K, block, tj::q8_block_lanes(w.fmt, R), xq.data() + r * ldq);
    else
      tj::arrange(w.fmt, x.typed_data() + r * K, K, xa.data() + r * K);
  }
  // rows of a bfloat16 model (exactly bfloat16) times bfloat16 rows: its dot products (bf16_rows.h)
  std::vector<uint16_t> xb;
  bool bf16 = !q8;
  for (int64_t h = 0; bf16 && h < H; ++h) bf16 = w.takes_bf16(xa.data() + h * R * K, int(R), K);
  const int64_t ldb = tj::bf16_row_len(K);
  if (bf16) {
    xb.resize(rows * ldb);
    tj::to_bf16_rows(xa.data(), int(rows), K, K, xb.data());
  }
  float* out = y->typed_data();
  const int64_t width = tj::Weight::kItemRows, blocks = (N + width - 1) / width;
  tj::run_items(pool, H * blocks, max_workers, [&](int64_t i) {
    const int64_t h = i / blocks, n0 = (i % blocks) * width, n1 = std::min(N, n0 + width);
    float* o = out + h * R * N;
    w.rows(h, xa.data() + (q8 ? 0 : h * R * K), int(R), K, n0, n1, o + n0, N, q8 ? xq.data() + h * R * ldq : nullptr,
           ldq, xb.empty() ? nullptr : xb.data() + h * R * ldb);
    if (bias.present())
      for (int64_t r = 0; r < R; ++r) bias.add_to(o + r * N + n0, n0, n1 - n0);
  });
  return ffi::Error::Success();
}

// A compact bfloat16 weight [N, K] (packed_rows.h) -> its bfloat16 codes [N, K], exactly: the weight XLA's matmuls
// take for many rows (a prefill), decoded at the memory's speed over the pool.
ffi::Error CompactDecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer groups, ffi::AnyBuffer index, ffi::AnyBuffer patches,
                             ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  tj::Weight w;
  std::string err = tj::parse_weight("compact weight", tj::kCompactBf16, groups, index, patches, &w);
  if (!err.empty()) return ffi::Error::InvalidArgument("compact decode: " + err);
  auto od = out->dimensions();
  if (w.E != 1 || od.size() != 2 || od[0] != w.N || od[1] != w.K)
    return ffi::Error::InvalidArgument("compact decode: output must be [N, K] of a [1, N, K] weight");
  const tj::PackedWeight p = w.packed(0);
  uint16_t* dst = reinterpret_cast<uint16_t*>(out->untyped_data());
  const int64_t width = tj::Weight::kItemRows;
  tj::run_items(pool, (w.N + width - 1) / width, int64_t(1) << 30, [&](int64_t i) {
    for (int64_t n = i * width; n < std::min(w.N, (i + 1) * width); ++n) tj::compact_row_bf16(p, n, dst + n * w.K);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TutelJaxCompactDecode, CompactDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // groups [1, N, K/32 * 48]
                                  .Arg<ffi::AnyBuffer>()          // index [1, 17 + N]
                                  .Arg<ffi::AnyBuffer>()          // patches [1, P, 3]
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TutelJaxDense, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::AnyBuffer>()          // weight: data, scale, global
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()          // b
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int64_t>("format")
                                  .Attr<bool>("int8_activations")
                                  .Attr<int64_t>("max_workers"));

// Compact bfloat16 encoding (tutel_jax/native/_compact_bf16.py; the layout: packed_rows.h), called through ctypes
// at load. counts [128]: elements per value of the bfloat16 code's high byte but its sign (the exponent but its last
// bit).
extern "C" __attribute__((used, visibility("default"))) void TutelJaxBf16HighCounts(const uint16_t* w, int64_t count,
                                                                                  int64_t* counts) {
  int64_t local[128] = {};
  for (int64_t i = 0; i < count; ++i) ++local[(w[i] >> 8) & 0x7F];
  for (int i = 0; i < 128; ++i) counts[i] = local[i];
}

// w [N, K] bfloat16 codes (K a multiple of 32) -> groups [N, K/32, 48], offsets [N + 1] (each row's first patch)
// and patches [capacity, 3]; slot_of [128]: the table slot (0-7) of each high byte but its sign, 255 where none (the
// element is a patch, zero in the groups: slot 0 is always the high byte 0). An element's code is its sign << 3 |
// its slot. Returns the patch count, or -1 when more than `capacity`.
extern "C" __attribute__((used, visibility("default"))) int64_t TutelJaxCompactBf16Encode(
    const uint16_t* w, int64_t N, int64_t K, const uint8_t* slot_of, uint8_t* groups, int32_t* offsets,
    int32_t* patches, int64_t capacity) {
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) {
    offsets[n] = int32_t(count);
    for (int64_t c = 0; c < K / tj::kChunk; ++c) {
      const uint16_t* src = w + n * K + c * tj::kChunk;
      uint8_t* g = groups + (n * (K / tj::kChunk) + c) * tj::kCompactGroup;
      uint8_t codes[32];
      for (int j = 0; j < 32; ++j) {
        const uint16_t u = src[j];
        const uint8_t slot = slot_of[(u >> 8) & 0x7F];
        if (slot != 255) {
          g[j] = uint8_t(u & 0xFF);
          codes[j] = uint8_t((u >> 15) << 3 | slot);
          continue;
        }
        if (count == capacity) return -1;
        patches[3 * count] = int32_t(n);
        patches[3 * count + 1] = int32_t(c * tj::kChunk + j);
        patches[3 * count + 2] = int32_t(uint32_t(u) << 16);
        ++count;
        g[j] = 0;
        codes[j] = 0;
      }
      for (int j = 0; j < 16; ++j) g[32 + j] = uint8_t(codes[j] | codes[j + 16] << 4);
    }
  }
  offsets[N] = int32_t(count);
  return count;
}
