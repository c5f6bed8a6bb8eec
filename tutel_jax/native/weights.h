// tutel-jax native CPU kernels: one weight tensor as the FFI hands it over ([E, N, K] rows, [out, in] as
// checkpoints store linear weights: float, or packed with their scales), and the work pool shared by the kernels.
//
// The Python side (tutel_jax/native/_weights.py) passes every weight as three buffers and a format number:
//   float32 / bfloat16   data [E, N, K]                              (scale, global: empty)
//   FP8 block            data e4m3 (or its bytes as uint8) [E, N, K], scale float32 [E, ceil(N/128), ceil(K/128)]
//   MXFP4                data uint8 [E, N, K/2], scale uint8 [E, N, K/32]
//   NVFP4                data uint8 [E, N, K/2], scale e4m3 (or uint8) [E, N, K/16], global float32 [E]
//                        (format 5: the global scale multiplies, ModelOpt's weight_scale_2)
//   compact bfloat16     data uint8 [E, N, K/32 * 48], index int32 [E, 16 + N + 1], patches int32 [E, P, 3]
//                        (format 6, in the scale and global places; packed_rows.h)
//   int8 / FP8 per channel  data int8 / e4m3 (or its bytes as uint8) [E, N, K], scale float32 [E, N]
//                        (formats 7 and 8)
// A dense layer is the case E = 1.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bf16_rows.h"
#include "packed_rows.h"
#include "q8_rows.h"
#include "xla/ffi/api/ffi.h"

namespace tj {

namespace ffi = xla::ffi;

struct Weight {
  int fmt = kFloat32;
  int64_t E = 0, N = 0, K = 0;
  const uint8_t* data = nullptr;
  const uint8_t* scale = nullptr;
  const float* global = nullptr;
  const int32_t* patches = nullptr;  // compact bfloat16
  int64_t data_stride = 0, scale_stride = 0, patch_stride = 0;  // bytes (patches: int32s) per expert

  // Output rows per work item.
  static constexpr int64_t kItemRows = 64;

  PackedWeight packed(int64_t e) const {
    PackedWeight p;
    p.fmt = fmt;
    p.N = N;
    p.K = K;
    p.data = data + e * data_stride;
    p.scale = scale + e * scale_stride;
    p.global = is_nv(fmt) ? global[e] : 1.0f;
    p.patches = patches == nullptr ? nullptr : patches + e * patch_stride;
    return p;
  }

  // Whether activation rows take the int8 path (`quantize_q8`, q8_rows.h) when it is asked for: FP4 weights, any
  // number of rows (a prefill's too: integer dot products do four times a float FMA's work per instruction);
  // other formats multiply float32 activations.
  bool takes_q8() const { return is_fp4(fmt); }

  // Whether R rows x (stride ldx) take the bfloat16 dot products (bf16_rows.h): a bfloat16-rows weight and 2 to
  // kMaxRows rows (one row is bound by memory either way), or a compact bfloat16 weight and up to kMaxRows rows
  // (its codes decode to bfloat16 in fewer instructions than to float32), all exactly bfloat16, and the build has
  // them.
  bool takes_bf16(const float* x, int R, int64_t ldx) const {
    const bool rows_ok = fmt == kCompactBf16 || (fmt == kBFloat16 && R >= 2);
    return kBf16Dot && rows_ok && R <= kMaxRows && exactly_bf16(x, R, ldx, K);
  }

  // out[r, n - n0] = sum_k x[r, k] * W_e[n, k] for r < R, n in [n0, n1); x `arrange`d for this format, and xq
  // (row stride ldq bytes) the same rows quantized by quantize_q8 when takes_q8() and the int8 path is asked
  // for, else null; xb the same rows as `to_bf16_rows` codes where takes_bf16(), else null.
  void rows(int64_t e, const float* x, int R, int64_t ldx, int64_t n0, int64_t n1, float* out, int64_t ldo,
            const uint8_t* xq = nullptr, int64_t ldq = 0, const uint16_t* xb = nullptr) const {
    if (xq != nullptr && takes_q8()) return fp4_q8_rows(packed(e), xq, R, ldq, n0, n1, out, ldo);
    if (xb != nullptr && fmt == kBFloat16) return bf16_rows(packed(e), xb, R, n0, n1, out, ldo);
    if (xb != nullptr && fmt == kCompactBf16) return compact_bf16_rows(packed(e), xb, R, n0, n1, out, ldo);
    packed_rows(packed(e), x, R, ldx, n0, n1, out, ldo);
  }
};

template <typename Dims>
inline int64_t product(const Dims& d) {
  int64_t n = 1;
  for (int64_t v : d) n *= v;
  return n;
}

// A float32 or bfloat16 bias (or an empty buffer: none), read where it is: only the rows a call uses.
struct Bias {
  const void* data = nullptr;
  bool bf16 = false, ok = true;
  int64_t size = 0;

  explicit Bias(ffi::AnyBuffer b) : data(b.untyped_data()), bf16(b.element_type() == ffi::DataType::BF16),
                                    size(product(b.dimensions())) {
    ok = size == 0 || bf16 || b.element_type() == ffi::DataType::F32;
  }
  bool present() const { return size != 0; }
  bool valid() const { return ok; }
  // dst[i] += bias[offset + i] for i < count (float32 adds: a bfloat16 bias is exact in float32)
  void add_to(float* dst, int64_t offset, int64_t count) const {
    if (bf16) {
      const uint16_t* b = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] += bf16_to_float(b[i]);
    } else {
      const float* b = static_cast<const float*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) dst[i] += b[i];
    }
  }
};

// A compact bfloat16 weight's three arrays (see the top of this file); "" when consistent.
inline std::string parse_compact(const std::string& name, ffi::AnyBuffer data, ffi::AnyBuffer index,
                                 ffi::AnyBuffer patches, Weight* w) {
  auto d = data.dimensions(), x = index.dimensions(), p = patches.dimensions();
  if (data.element_type() != ffi::DataType::U8 || d[2] % kCompactGroup != 0)
    return name + ": compact bfloat16 data must be uint8 [E, N, K/32 * 48]";
  w->N = d[1];
  w->K = d[2] / kCompactGroup * kChunk;
  w->data_stride = d[1] * d[2];
  if (index.element_type() != ffi::DataType::S32 || x.size() != 2 || x[0] != w->E || x[1] != 17 + w->N)
    return name + ": compact bfloat16 index must be int32 [E, 16 + N + 1]";
  if (patches.element_type() != ffi::DataType::S32 || p.size() != 3 || p[0] != w->E || p[2] != 3)
    return name + ": compact bfloat16 patches must be int32 [E, P, 3]";
  w->scale = static_cast<const uint8_t*>(index.untyped_data());
  w->scale_stride = x[1] * 4;
  w->patches = static_cast<const int32_t*>(patches.untyped_data());
  w->patch_stride = p[1] * 3;
  // every row's patches lie inside the list and inside the row (a bad index must not read out of bounds)
  for (int64_t e = 0; e < w->E; ++e) {
    const int32_t* off = reinterpret_cast<const int32_t*>(w->scale + e * w->scale_stride) + 16;
    for (int c = 0; c < 16; ++c)
      if (off[c - 16] & 0x00FFFFFF) return name + ": compact bfloat16 codes must be high bytes << 24";
    const int32_t* pe = w->patches + e * w->patch_stride;
    if (off[0] != 0 || off[w->N] > p[1]) return name + ": compact bfloat16 patch index out of range";
    for (int64_t n = 0; n < w->N; ++n) {
      if (off[n + 1] < off[n]) return name + ": compact bfloat16 patch index not ascending";
      for (int32_t q = off[n]; q < off[n + 1]; ++q)
        if (pe[3 * q] != n || pe[3 * q + 1] < 0 || pe[3 * q + 1] >= w->K)
          return name + ": compact bfloat16 patch outside its row";
    }
  }
  return "";
}

// Reads one weight; an empty string when it is consistent, else what is wrong (`what` names it).
inline std::string parse_weight(const char* what, int64_t fmt, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                ffi::AnyBuffer global, Weight* w) {
  const std::string name(what);
  auto d = data.dimensions();
  if (d.size() != 3) return name + ": expected a 3-d weight";
  w->fmt = int(fmt);
  w->E = d[0];
  w->data = static_cast<const uint8_t*>(data.untyped_data());
  if (fmt == kFloat32 || fmt == kBFloat16) {  // [E, N, K] rows
    const bool f32 = fmt == kFloat32;
    if (data.element_type() != (f32 ? ffi::DataType::F32 : ffi::DataType::BF16))
      return name + ": dtype does not match its format";
    w->N = d[1];
    w->K = d[2];
    w->data_stride = d[1] * d[2] * (f32 ? 4 : 2);
    return "";
  }
  if (fmt == kCompactBf16) return parse_compact(name, data, scale, global, w);
  if (fmt == kInt8Channel || fmt == kFp8Channel) {
    auto s = scale.dimensions();
    const auto t = data.element_type();
    if (fmt == kInt8Channel ? t != ffi::DataType::S8 : t != ffi::DataType::U8 && t != ffi::DataType::F8E4M3FN)
      return name + ": per-channel codes must be int8 (or e4m3 / its bytes as uint8) [E, N, K]";
    if (scale.element_type() != ffi::DataType::F32 || s.size() != 2 || s[0] != w->E || s[1] != d[1])
      return name + ": per-channel scales must be float32 [E, N]";
    w->N = d[1];
    w->K = d[2];
    w->data_stride = d[1] * d[2];
    w->scale = static_cast<const uint8_t*>(scale.untyped_data());
    w->scale_stride = s[1] * 4;
    return "";
  }
  if (!is_packed(int(fmt))) return name + ": unknown weight format " + std::to_string(fmt);
  const auto byte_codes = [](ffi::DataType t) { return t == ffi::DataType::U8 || t == ffi::DataType::F8E4M3FN; };
  if (!byte_codes(data.element_type())) return name + ": packed codes must be uint8 (or float8_e4m3fn for FP8)";
  w->N = d[1];
  w->K = fmt == kFp8Block ? d[2] : 2 * d[2];
  w->data_stride = d[1] * d[2];
  auto s = scale.dimensions();
  w->scale = static_cast<const uint8_t*>(scale.untyped_data());
  if (fmt == kFp8Block) {
    if (scale.element_type() != ffi::DataType::F32 || s.size() != 3 || s[0] != w->E ||
        s[1] != (w->N + kFp8Tile - 1) / kFp8Tile || s[2] != (w->K + kFp8Tile - 1) / kFp8Tile)
      return name + ": FP8 scale_inv must be float32 [E, ceil(N/128), ceil(K/128)]";
    w->scale_stride = s[1] * s[2] * 4;
    return "";
  }
  const int64_t block = fp4_block(fmt);
  if (w->K % block != 0) return name + ": K must be a multiple of the scale block";
  if (!byte_codes(scale.element_type()) || s.size() != 3 || s[0] != w->E || s[1] != w->N ||
      s[2] != w->K / block)
    return name + ": FP4 scales must be uint8 or float8_e4m3fn [E, N, K/block]";
  w->scale_stride = s[1] * s[2];
  if (is_nv(int(fmt))) {
    if (global.element_type() != ffi::DataType::F32 || product(global.dimensions()) != w->E)
      return name + ": NVFP4 global scale must be float32 [E]";
    w->global = static_cast<const float*>(global.untyped_data());
  }
  return "";
}

// Runs fn(0 .. items-1) on up to `max_workers` workers of XLA's intra-op pool, the calling thread being one of
// them, and returns when every item is done. Worker w first takes the items of its own contiguous share
// [w * items / W, (w + 1) * items / W) in order, then helps with the others' shares: each worker streams one
// contiguous stretch of the weights (as a streaming read does), and a worker that starts late or runs slow loses
// nothing. A pool task that starts late finds no item left and touches only the shared state (held by shared_ptr).
inline void run_items(ffi::ThreadPool& pool, int64_t items, int64_t max_workers, std::function<void(int64_t)> fn) {
  if (items <= 0) return;
  const int64_t pool_size = std::max<int64_t>(1, pool.num_threads());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>({items, max_workers, pool_size}));
  struct State {
    std::vector<std::atomic<int64_t>> next;  // per share: its next item
    std::vector<int64_t> end;
    std::atomic<int64_t> joined{0}, done{0};
    std::function<void(int64_t)> fn;
    explicit State(int64_t w) : next(w), end(w) {}
  };
  auto st = std::make_shared<State>(workers);
  st->fn = std::move(fn);
  for (int64_t w = 0; w < workers; ++w) {
    st->next[w].store(w * items / workers);
    st->end[w] = (w + 1) * items / workers;
  }
  auto work = [st, workers] {
    const int64_t me = st->joined.fetch_add(1) % workers;
    for (int64_t j = 0; j < workers; ++j) {
      const int64_t share = (me + j) % workers;
      for (int64_t i; (i = st->next[share].fetch_add(1)) < st->end[share];) {
        st->fn(i);
        st->done.fetch_add(1);
      }
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule(std::function<void()>(work));
  work();
  while (st->done.load() != items) std::this_thread::yield();
}

}  // namespace tj
