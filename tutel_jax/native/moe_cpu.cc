// tutel-jax native CPU kernel: the routed SwiGLU experts of one MoE layer, as an XLA FFI custom call.
//
//   y[s] = sum_k dec[k, s] * expert_{ids[k, s]}(enc[k, s] * x[s])
//   expert_e(r) = (silu(r @ Wg_e) * (r @ Wu_e)) @ Wd_e
//
// x [S, M] f32, ids [K, S] s32, enc / dec [K, S] f32, gate_up [E, M, 2I] (first I columns the gate, the last I
// the up projection; f32 or bf16), down [E, I, Mo] (f32 or bf16) -> y [S, Mo] f32.
// An assignment whose expert id is outside [0, E) (another device's expert) or whose enc or dec is 0 (dropped)
// costs nothing. Only the experts that received tokens are read, each once: up to 8 rows stream its weights in
// memory order (decode), more rows go through register tiles of 4 rows x 64 columns (prefill). The used experts
// are shared out over XLA's intra-op thread pool (the calling thread is one of the workers); each worker sums
// into its own [S, Mo] buffer and the buffers are added up at the end.
// max_workers (attribute): at most this many workers (the pool's size when larger).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;                   // floats per vector
constexpr int kTileVectors = 4;              // vectors per column tile
constexpr int kTileCols = kLanes * kTileVectors;
constexpr int kMaxTileRows = 4;             // rows per register tile
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) {
  uint32_t bits = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline Vec load_vec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Vec load_vec(const uint16_t* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = load_scalar(p + i);
  return v;
}

// out[r, c0:c0+64] = sum_k a[r, k] * w[k, c0:c0+64] for R rows, accumulated in registers (a: [R, depth], row
// stride lda; w: [depth, *], row stride ldw; out: row stride ldo). For many rows: the 64-column slice of w is
// read from memory by the first row tile and from cache by the others.
template <int R, typename W>
void tile_matmul(const float* a, int lda, const W* w, int ldw, int depth, int c0, float* out, int ldo) {
  Vec acc[R][kTileVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVectors; ++v) acc[r][v] = Vec{};
  for (int k = 0; k < depth; ++k) {
    const W* row = w + size_t(k) * ldw + c0;
    Vec wv[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) wv[v] = load_vec(row + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec s = Vec{} + a[size_t(r) * lda + k];
      for (int v = 0; v < kTileVectors; ++v) acc[r][v] += s * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVectors; ++v)
      std::memcpy(out + size_t(r) * ldo + c0 + v * kLanes, &acc[r][v], sizeof(Vec));
}

// out[r, c0:c1] = sum_k a[r, k] * w[k, c0:c1] for R rows, streaming w row by row in memory order (each weight
// row is used by all R rows while it is in registers; the R output rows stay in L1). The decode form: a used
// expert's weights are read once, sequentially, which is what bounds a decode step.
template <int R, typename W>
void stream_matmul(const float* a, int lda, const W* w, int ldw, int depth, int c0, int c1, float* out, int ldo) {
  const int vec_end = c0 + (c1 - c0) / kLanes * kLanes;
  for (int r = 0; r < R; ++r) std::memset(out + size_t(r) * ldo + c0, 0, sizeof(float) * (c1 - c0));
  for (int k = 0; k < depth; ++k) {
    const W* row = w + size_t(k) * ldw;
    float s[R];
    for (int r = 0; r < R; ++r) s[r] = a[size_t(r) * lda + k];
    for (int c = c0; c < vec_end; c += kLanes) {
      const Vec wv = load_vec(row + c);
      for (int r = 0; r < R; ++r) {
        Vec o;
        std::memcpy(&o, out + size_t(r) * ldo + c, sizeof(Vec));
        o += s[r] * wv;
        std::memcpy(out + size_t(r) * ldo + c, &o, sizeof(Vec));
      }
    }
    for (int c = vec_end; c < c1; ++c) {
      const float wc = load_scalar(row + c);
      for (int r = 0; r < R; ++r) out[size_t(r) * ldo + c] += s[r] * wc;
    }
  }
}

constexpr int kStreamRows = 8;

// stream_matmul for 1 <= rows <= kStreamRows.
template <typename W>
void stream_rows(const float* a, int lda, int rows, const W* w, int ldw, int depth, int c0, int c1, float* out,
                 int ldo) {
  switch (rows) {
    case 1: return stream_matmul<1>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 2: return stream_matmul<2>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 3: return stream_matmul<3>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 4: return stream_matmul<4>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 5: return stream_matmul<5>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 6: return stream_matmul<6>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 7: return stream_matmul<7>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    default: return stream_matmul<8>(a, lda, w, ldw, depth, c0, c1, out, ldo);
  }
}

// out [rows, cols] = a [rows, depth] @ w [depth, cols] (w rows of stride ldw; a and out of strides lda, ldo).
template <typename W>
void matmul_rows(const float* a, int lda, int rows, const W* w, int ldw, int depth, int cols, float* out, int ldo) {
  if (rows <= kStreamRows) return stream_rows(a, lda, rows, w, ldw, depth, 0, cols, out, ldo);
  const int tiled = cols / kTileCols * kTileCols;
  for (int c0 = 0; c0 < tiled; c0 += kTileCols) {
    int r0 = 0;
    for (; r0 + kMaxTileRows <= rows; r0 += kMaxTileRows)
      tile_matmul<kMaxTileRows>(a + size_t(r0) * lda, lda, w, ldw, depth, c0, out + size_t(r0) * ldo, ldo);
    switch (rows - r0) {
      case 3: tile_matmul<3>(a + size_t(r0) * lda, lda, w, ldw, depth, c0, out + size_t(r0) * ldo, ldo); break;
      case 2: tile_matmul<2>(a + size_t(r0) * lda, lda, w, ldw, depth, c0, out + size_t(r0) * ldo, ldo); break;
      case 1: tile_matmul<1>(a + size_t(r0) * lda, lda, w, ldw, depth, c0, out + size_t(r0) * ldo, ldo); break;
      default: break;
    }
  }
  if (tiled < cols)
    for (int r0 = 0; r0 < rows; r0 += kStreamRows)
      stream_rows(a + size_t(r0) * lda, lda, std::min(kStreamRows, rows - r0), w, ldw, depth, tiled, cols,
                  out + size_t(r0) * ldo, ldo);
}

struct Assignment {
  int token;
  float enc, dec;
};

// Everything the workers share; held by shared_ptr so a pool task that starts late never touches freed memory.
template <typename W>
struct Job {
  const float* x;
  const W* gate_up;
  const W* down;
  int model_dim, hidden, out_dim;
  std::vector<int> experts;                     // the used experts
  std::vector<std::vector<Assignment>> rows;    // per used expert
  std::vector<std::vector<float>> partial;      // per worker [S, Mo]
  std::atomic<int> next{0};
  std::atomic<int> running{0};

  void work(int worker) {
    running.fetch_add(1);
    std::vector<float> xin, h, act, out;
    float* y = partial[worker].data();
    for (int j; (j = next.fetch_add(1)) < int(experts.size());) run_expert(experts[j], rows[j], xin, h, act, out, y);
    running.fetch_sub(1);
  }

  void run_expert(int e, const std::vector<Assignment>& assigned, std::vector<float>& xin, std::vector<float>& h,
                  std::vector<float>& act, std::vector<float>& out, float* y) {
    const int n = int(assigned.size()), M = model_dim, I = hidden, O = out_dim;
    xin.resize(size_t(n) * M);
    h.resize(size_t(n) * 2 * I);
    act.resize(size_t(n) * I);
    out.resize(size_t(n) * O);
    for (int r = 0; r < n; ++r) {
      const float* src = x + size_t(assigned[r].token) * M;
      for (int m = 0; m < M; ++m) xin[size_t(r) * M + m] = assigned[r].enc * src[m];
    }
    matmul_rows(xin.data(), M, n, gate_up + size_t(e) * M * 2 * I, 2 * I, M, 2 * I, h.data(), 2 * I);
    for (int r = 0; r < n; ++r) {
      const float* g = h.data() + size_t(r) * 2 * I;
      for (int i = 0; i < I; ++i) act[size_t(r) * I + i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    }
    matmul_rows(act.data(), I, n, down + size_t(e) * I * O, O, I, O, out.data(), O);
    for (int r = 0; r < n; ++r) {
      float* dst = y + size_t(assigned[r].token) * O;
      const float d = assigned[r].dec;
      for (int o = 0; o < O; ++o) dst[o] += d * out[size_t(r) * O + o];
    }
  }
};

template <typename W>
ffi::Error run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> enc,
               ffi::Buffer<ffi::F32> dec, ffi::AnyBuffer gate_up, ffi::AnyBuffer down, ffi::Result<ffi::Buffer<ffi::F32>> y,
               int64_t max_workers) {
  auto xd = x.dimensions(), idd = ids.dimensions(), gud = gate_up.dimensions(), dd = down.dimensions();
  const int S = int(xd[0]), M = int(xd[1]), K = int(idd[0]), E = int(gud[0]), I = int(dd[1]), O = int(dd[2]);
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  job->gate_up = static_cast<const W*>(gate_up.untyped_data());
  job->down = static_cast<const W*>(down.untyped_data());
  job->model_dim = M;
  job->hidden = I;
  job->out_dim = O;

  // Group the kept assignments by expert (in token order within an expert).
  std::vector<int> slot(E, -1);
  const int32_t* id = ids.typed_data();
  const float* en = enc.typed_data();
  const float* de = dec.typed_data();
  for (int s = 0; s < S; ++s) {
    for (int k = 0; k < K; ++k) {
      const size_t a = size_t(k) * S + s;
      const int e = id[a];
      if (e < 0 || e >= E || en[a] == 0.0f || de[a] == 0.0f) continue;
      if (slot[e] < 0) {
        slot[e] = int(job->experts.size());
        job->experts.push_back(e);
        job->rows.emplace_back();
      }
      job->rows[slot[e]].push_back({s, en[a], de[a]});
    }
  }

  const int used = int(job->experts.size());
  const int64_t pool_size = std::max<int64_t>(1, pool.num_threads());
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>({int64_t(used), max_workers, pool_size})));
  job->partial.assign(workers, std::vector<float>(size_t(S) * O, 0.0f));
  for (int w = 1; w < workers; ++w) pool.Schedule([job, w] { job->work(w); });
  job->work(0);
  // Every expert has been claimed; wait for the ones other workers are still running.
  while (job->running.load() != 0) std::this_thread::yield();

  float* out = y->typed_data();
  std::memcpy(out, job->partial[0].data(), sizeof(float) * size_t(S) * O);
  for (int w = 1; w < workers; ++w) {
    const float* p = job->partial[w].data();
    for (size_t i = 0; i < size_t(S) * O; ++i) out[i] += p[i];
  }
  return ffi::Error::Success();
}

ffi::Error MoeSwigluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> enc, ffi::Buffer<ffi::F32> dec, ffi::AnyBuffer gate_up,
                         ffi::AnyBuffer down, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t max_workers) {
  auto xd = x.dimensions(), idd = ids.dimensions(), gud = gate_up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || gud.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("moe_swiglu: expected x [S, M], ids [K, S], gate_up [E, M, 2I], down [E, I, Mo]");
  if (idd[1] != xd[0] || !(enc.dimensions() == idd) || !(dec.dimensions() == idd))
    return ffi::Error::InvalidArgument("moe_swiglu: ids, enc and dec must be [K, S] with S = x.shape[0]");
  if (gud[1] != xd[1] || gud[2] != 2 * dd[1] || dd[0] != gud[0])
    return ffi::Error::InvalidArgument("moe_swiglu: gate_up must be [E, M, 2I] and down [E, I, Mo]");
  if (gate_up.element_type() != down.element_type())
    return ffi::Error::InvalidArgument("moe_swiglu: gate_up and down must have the same dtype");
  switch (gate_up.element_type()) {
    case ffi::DataType::F32: return run<float>(pool, x, ids, enc, dec, gate_up, down, y, max_workers);
    case ffi::DataType::BF16: return run<uint16_t>(pool, x, ids, enc, dec, gate_up, down, y, max_workers);
    default: return ffi::Error::InvalidArgument("moe_swiglu: weights must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TutelJaxMoeSwiglu, MoeSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_workers"));
