// tutel-jax native CPU kernel: a dense linear layer for a few rows, as an XLA FFI custom call.
//
//   y [R, N] = x [R, K] @ W (+ b [N], float32 or bfloat16)
//
// W float32 / bfloat16 [K, N] ([in, out]), or [N, K] rows: packed FP8 block / MXFP4 / NVFP4 (the checkpoint's
// [out, in], decoded in registers) or float (an lm_head as stored); see weights.h. Every weight byte is read
// once: the layer runs at the speed of memory, not at XLA:CPU's (which converts a bfloat16 or packed weight to
// float32 in memory before its matmul). Work over XLA's intra-op thread pool: rows by blocks of outputs; a
// [K, N] kernel whose [R, N] output fits in L2 by blocks of its input rows (each block a contiguous stretch of
// memory, summed into its own partial output, the partials added up in block order), a wider one by blocks of
// 2048 columns (4 KB of each bfloat16 row). With `int8_activations`, rows times an FP4 weight take the int8 path
// (q8_rows.h); a few rows of exactly bfloat16 values times bfloat16 rows take AVX-512 BF16 dot products where the
// build has them (bf16_rows.h).

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "weights.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFloatColsPerItem = 2048;       // a wide [K, N] kernel: columns per item
constexpr int64_t kSplitMaxOutBytes = 256 << 10;  // [R, N] partial outputs up to this size: split K instead
constexpr int64_t kSplitBlocks = 32;              // input-row blocks of a split kernel

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_data, ffi::AnyBuffer w_scale,
                     ffi::AnyBuffer w_global, ffi::AnyBuffer b, ffi::Result<ffi::Buffer<ffi::F32>> y,
                     int64_t format, bool int8_activations, int64_t max_workers) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("dense: expected x [R, K]");
  tj::Weight w;
  std::string err = tj::parse_weight("weight", format, w_data, w_scale, w_global, &w);
  if (!err.empty()) return ffi::Error::InvalidArgument("dense: " + err);
  const int64_t R = xd[0], K = xd[1], N = w.N;
  if (w.E != 1 || w.K != K) return ffi::Error::InvalidArgument("dense: weight must be [1, K, N] or packed [1, N, K']");
  const tj::Bias bias(b);
  if ((bias.present() && bias.size != N) || !bias.valid())
    return ffi::Error::InvalidArgument("dense: bias must be float32 or bfloat16 [N]");
  if (y->dimensions()[0] != R || y->dimensions()[1] != N)
    return ffi::Error::InvalidArgument("dense: output must be [R, N]");
  if (R == 0 || N == 0) return ffi::Error::Success();

  // the rows as the kernel reads them: int8 (q8_rows.h) when asked for and taken, else arranged float32
  const bool q8 = int8_activations && w.takes_q8();
  const int64_t block = tj::fp4_block(w.fmt), ldq = tj::q8_row_bytes(K, block);
  std::vector<uint8_t> xq(q8 ? R * ldq : 0);
  std::vector<float> xa(q8 ? 0 : R * K);
  for (int64_t r = 0; r < R; ++r) {
    if (q8)
      tj::quantize_q8(x.typed_data() + r * K, K, block, xq.data() + r * ldq);
    else
      tj::arrange(w.fmt, x.typed_data() + r * K, K, xa.data() + r * K);
  }
  // rows of a bfloat16 model (exactly bfloat16) times bfloat16 rows: its dot products (bf16_rows.h)
  std::vector<uint16_t> xb;
  if (!q8 && w.takes_bf16(xa.data(), int(R), K)) {
    xb.resize(R * tj::bf16_row_len(K));
    tj::to_bf16_rows(xa.data(), int(R), K, K, xb.data());
  }
  float* out = y->typed_data();
  if (!tj::is_rows(w.fmt) && R * N * int64_t(sizeof(float)) <= kSplitMaxOutBytes) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(kSplitBlocks, K / 16));
    const int64_t step = (K + blocks - 1) / blocks;
    std::vector<float> partial(blocks * R * N, 0.0f);
    tj::run_items(pool, blocks, max_workers, [&](int64_t i) {
      const int64_t k0 = i * step, k1 = std::min(K, k0 + step);
      if (k0 < k1) w.kernel_part(0, xa.data(), int(R), K, k0, k1, 0, N, partial.data() + i * R * N, N);
    });
    constexpr int64_t kSumCols = 1024;
    tj::run_items(pool, (N + kSumCols - 1) / kSumCols, max_workers, [&](int64_t j) {
      const int64_t n0 = j * kSumCols, n1 = std::min(N, n0 + kSumCols);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = n0; n < n1; ++n) {
          float acc = 0.0f;
          if (bias.present()) bias.add_to(&acc, n, 1);  // the bias first, as XLA's bias add orders it
          for (int64_t i = 0; i < blocks; ++i) acc += partial[(i * R + r) * N + n];
          out[r * N + n] = acc;
        }
    });
    return ffi::Error::Success();
  }
  const int64_t width = w.item_width(kFloatColsPerItem);
  tj::run_items(pool, (N + width - 1) / width, max_workers, [&](int64_t i) {
    const int64_t n0 = i * width, n1 = std::min(N, n0 + width);
    w.rows(0, xa.data(), int(R), K, n0, n1, out + n0, N, q8 ? xq.data() : nullptr, ldq,
           xb.empty() ? nullptr : xb.data());
    if (bias.present())
      for (int64_t r = 0; r < R; ++r) bias.add_to(out + r * N + n0, n0, n1 - n0);
  });
  return ffi::Error::Success();
}

}  // namespace

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
