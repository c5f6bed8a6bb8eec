// tutel-jax native CPU kernel: a dense linear layer for a few rows, as an XLA FFI custom call.
//
//   y [R, N] = x [R, K] @ W.T (+ b [N], float32 or bfloat16)
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
  if (xd.size() != 2) return ffi::Error::InvalidArgument("dense: expected x [R, K]");
  tj::Weight w;
  std::string err = tj::parse_weight("weight", format, w_data, w_scale, w_global, &w);
  if (!err.empty()) return ffi::Error::InvalidArgument("dense: " + err);
  const int64_t R = xd[0], K = xd[1], N = w.N;
  if (w.E != 1 || w.K != K) return ffi::Error::InvalidArgument("dense: weight must be [1, N, K] rows");
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
  const int64_t width = tj::Weight::kItemRows;
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
