// tutel-jax native CPU kernel: one decode step of attention over a static KV cache, as an XLA FFI custom call.
//
//   K[b, g, slot_b] = k_new[b, g],  V[b, g, slot_b] = v_new[b, g]     slot_b = clamp(index[b], 0, L - 1)
//   o[b, h] = sum_s p[b, h, s] V[b, g(h), s]                             g(h) = h / (Hq / Hkv)
//   p[b, h, :] = softmax over the slots s of [lo, hi) (and the sink) of scale * q[b, h] . K[b, g(h), s]
//
// q [B, Hq, D] f32, k_new / v_new [B, Hkv, D / Dv] and the caches K [B, Hkv, L, D], V [B, Hkv, L, Dv] in the
// cache's dtype (float32 or bfloat16; the caches are updated in place: they are aliased to the outputs), index
// [B] s32 (each row's query slot), key_valid [B, L] bool, sinks [Hq] f32 or empty -> o [B, Hq, Dv] f32.
// Slot s is visible iff s <= index[b], key_valid[b, s] and, with a window W, index[b] - s < W; the others score
// float32's lowest value, as `tutel_jax.models.layers.attend` masks them. Without a window [lo, hi) = [0, L);
// with one, the W slots ending at the query (clamped into the cache), the only ones it can see. A sink is a
// per-head logit that joins the softmax and is then dropped (GPT-OSS).
// XLA:CPU would convert a bfloat16 cache to float32 in memory at every step (the update and the value product),
// copying each cache several times; here the caches are read once, in place, products in float32 (exact for
// bfloat16 values) and float32 sums. Work: one item per (row, kv head) over XLA's intra-op thread pool.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "weights.h"

namespace ffi = xla::ffi;

namespace {

TJ_INLINE float to_float(float v) { return v; }
TJ_INLINE float to_float(uint16_t bits) { return tj::bf16_to_float(bits); }

struct Step {
  int64_t B, Hq, Hkv, L, D, Dv, window;
  float scale;
  const float* q;
  const float* sinks;  // nullptr: none
  const int32_t* index;
  const bool* key_valid;
  float* o;
};

// q . row over D values: vector lanes, then the tail.
template <typename T>
TJ_INLINE float dot(const float* q, const T* row, int64_t D) {
  tj::Native acc = tj::Native{};
  int64_t d = 0;
  for (; d + tj::kNativeLanes <= D; d += tj::kNativeLanes) acc += tj::load(row + d) * tj::load(q + d);
  float t = tj::reduce_add(acc);
  for (; d < D; ++d) t += to_float(row[d]) * q[d];
  return t;
}

// o[0 .. Dv) += p * row
template <typename T>
TJ_INLINE void add_scaled(float* o, float p, const T* row, int64_t Dv) {
  const tj::Native pv = tj::splat(p);
  int64_t d = 0;
  for (; d + tj::kNativeLanes <= Dv; d += tj::kNativeLanes)
    tj::store(o + d, tj::load(o + d) + pv * tj::load(row + d));
  for (; d < Dv; ++d) o[d] += p * to_float(row[d]);
}

// One (row b, kv head g): write the new key and value, then every query head of the group attends.
template <typename T>
void group_step(const Step& a, const T* k_new, const T* v_new, T* K, T* V, int64_t item,
                std::vector<float>& scores) {
  const int64_t b = item / a.Hkv, g = item % a.Hkv, R = a.Hq / a.Hkv;
  K += item * a.L * a.D;
  V += item * a.L * a.Dv;
  const int64_t qs = a.index[b];
  const int64_t slot = std::clamp<int64_t>(qs, 0, a.L - 1);
  std::memcpy(K + slot * a.D, k_new + item * a.D, a.D * sizeof(T));
  std::memcpy(V + slot * a.Dv, v_new + item * a.Dv, a.Dv * sizeof(T));
  int64_t lo = 0, hi = a.L;
  if (a.window > 0 && a.window < a.L) {
    lo = std::clamp<int64_t>(qs - (a.window - 1), 0, a.L - a.window);
    hi = lo + a.window;
  }
  const bool* valid = a.key_valid + b * a.L;
  auto visible = [&](int64_t s) { return valid[s] && s <= qs && (a.window <= 0 || qs - s < a.window); };
  scores.resize(hi - lo);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = g * R + r;
    const float* qh = a.q + (b * a.Hq + h) * a.D;
    float top = -FLT_MAX;
    for (int64_t s = lo; s < hi; ++s) {
      const float x = visible(s) ? dot(qh, K + s * a.D, a.D) * a.scale : -FLT_MAX;
      scores[s - lo] = x;
      top = std::max(top, x);
    }
    const float sink = a.sinks ? a.sinks[h] : 0.0f;
    if (a.sinks) top = std::max(top, sink);
    const int64_t n = hi - lo, full = n / tj::kNativeLanes * tj::kNativeLanes;
    tj::Native sum = tj::Native{};
    for (int64_t i = 0; i < full; i += tj::kNativeLanes) {
      const tj::Native e = tj::exp_lanes(tj::load(scores.data() + i) - top);
      tj::store(scores.data() + i, e);
      sum += e;
    }
    float total = tj::reduce_add(sum);
    if (full < n) {  // the last slots: one register with its unused lanes left out
      alignas(64) float tail[tj::kNativeLanes] = {};
      std::copy(scores.begin() + full, scores.end(), tail);
      const tj::Native e = tj::exp_lanes(tj::load(tail) - top);
      tj::store(tail, e);
      for (int64_t i = full; i < n; ++i) total += (scores[i] = tail[i - full]);
    }
    if (a.sinks) total += tj::exp_lanes(tj::splat(sink - top))[0];
    float* oh = a.o + (b * a.Hq + h) * a.Dv;
    std::fill(oh, oh + a.Dv, 0.0f);
    for (int64_t s = lo; s < hi; ++s) {
      const float p = scores[s - lo] / total;
      if (p != 0.0f) add_scaled(oh, p, V + s * a.Dv, a.Dv);  // a masked slot's exp underflows to exactly 0
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                               ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::PRED> key_valid,
                               ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::Buffer<ffi::F32>> o,
                               ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float scale,
                               int64_t window, int64_t max_workers) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: expected q [B, Hq, D] and caches [B, Hkv, L, D]");
  Step a{qd[0], qd[1], kd[1], kd[2], kd[3], vd[3], window, scale, q.typed_data(), nullptr,
         index.typed_data(), key_valid.typed_data(), o->typed_data()};
  const auto dtype = k_cache.element_type();
  if (kd[0] != a.B || vd[0] != a.B || vd[1] != a.Hkv || vd[2] != a.L || qd[2] != a.D || a.Hkv == 0 ||
      a.Hq % a.Hkv != 0 || v_cache.element_type() != dtype || k_new.element_type() != dtype ||
      v_new.element_type() != dtype || k_new.element_count() != a.B * a.Hkv * a.D ||
      v_new.element_count() != a.B * a.Hkv * a.Dv || index.element_count() != a.B ||
      key_valid.element_count() != a.B * a.L || a.L == 0)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes or dtypes");
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("decode_attention: the cache must be float32 or bfloat16");
  if (sinks.element_count() == a.Hq)
    a.sinks = sinks.typed_data();
  else if (sinks.element_count() != 0)
    return ffi::Error::InvalidArgument("decode_attention: sinks must be [Hq] or empty");
  // aliased outputs are the caches themselves; otherwise (XLA kept the inputs) start from a copy
  for (auto [in, out] : {std::pair{&k_cache, &*k_out}, std::pair{&v_cache, &*v_out}})
    if (out->untyped_data() != in->untyped_data())
      std::memcpy(out->untyped_data(), in->untyped_data(), in->size_bytes());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* kn = static_cast<const T*>(k_new.untyped_data());
    const T* vn = static_cast<const T*>(v_new.untyped_data());
    T* K = static_cast<T*>(k_out->untyped_data());
    T* V = static_cast<T*>(v_out->untyped_data());
    tj::run_items(pool, a.B * a.Hkv, max_workers, [&](int64_t item) {
      thread_local std::vector<float> scores;
      group_step<T>(a, kn, vn, K, V, item, scores);
    });
  };
  if (dtype == ffi::DataType::F32)
    run(float{});
  else
    run(uint16_t{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TutelJaxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_new
                                  .Arg<ffi::AnyBuffer>()          // v_new
                                  .Arg<ffi::AnyBuffer>()          // k cache
                                  .Arg<ffi::AnyBuffer>()          // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // index
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // key_valid
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::AnyBuffer>()          // k cache (aliased)
                                  .Ret<ffi::AnyBuffer>()          // v cache (aliased)
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("max_workers"));
