// tutel-jax native CPU kernels: the instruction set a library is built for, and the few operations that differ
// between instruction sets. The kernels are written once over GCC/Clang vector extensions of one register of the
// target (`Native`: 16 floats with AVX-512, 8 with AVX2, 4 with NEON, 8 in the portable build).
//
// The instruction set follows the compiler's target; tutel_jax/native/build.py picks the flags for the ISA in
// effect (the best the CPU runs, or TUTEL_JAX_NATIVE_ISA) and passes TUTEL_JAX_REQUIRE_ISA, so flags that do not
// give the intended target fail the build instead of building a slower library:
//   avx512    AVX-512 F: 16-lane table permutes
//   avx2      AVX2 + FMA (+ F16C): 8-lane permutes, two registers per Vec
//   neon      AArch64 Advanced SIMD: byte-table lookups, four registers per Vec
//   portable  C++ only (TUTEL_JAX_PORTABLE): no intrinsics, arithmetic decoders the compiler vectorizes as it can
// Everything the ISA changes is here: the E2M1 decoder `e2m1`, the horizontal sum, the spread of block scales
// over lanes, the byte table lookup and int8 dot product of the quantized-activation path (q8_rows.h), and the
// register budget (rows per register pass, tile sizes).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(TUTEL_JAX_PORTABLE)
#define TJ_ISA_PORTABLE 1
#elif defined(__AVX512F__)
#define TJ_ISA_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TJ_ISA_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define TJ_ISA_NEON 1
#include <arm_neon.h>
#else
#define TJ_ISA_PORTABLE 1
#endif

// Every helper below is forced inline (a vector that crosses a call may go through memory).
#define TJ_INLINE inline __attribute__((always_inline))
#define TJ_INLINE_LAMBDA __attribute__((always_inline))

namespace tj {

// The ids tutel_jax/native/build.py knows them by (ISAS there).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3 };

// What the register file of each ISA holds: the register width in floats, activation rows per register pass over
// a packed row (int8 and bfloat16 dots), the many-row form's register tile (activation rows x weight rows), and
// for float32 dots over decoded chunks (`packed_rows`, kFloatRows rows per register pass): the most rows that take
// register passes (more: decoded tiles) and the partial-sum registers a pass keeps (16 registers of AVX2: 8 rows
// with one partial sum each stream 1.4x faster than decoded tiles, and 4 rows with two 1.15x faster than with
// four, which spill; measured on Zen 3, one thread, compact bfloat16 rows in cache).
struct RegisterBudget {
  Isa isa;
  int lanes, max_rows, tile_x, tile_w;
  int float_pass_limit, float_partials;
};
#if defined(TJ_ISA_AVX512)
constexpr RegisterBudget kBudget{kAvx512, 16, 8, 4, 4, 8, 16};  // 32 registers of 16
#elif defined(TJ_ISA_AVX2)
constexpr RegisterBudget kBudget{kAvx2, 8, 4, 3, 3, 16, 8};  // 16 registers of 8
#elif defined(TJ_ISA_NEON)
constexpr RegisterBudget kBudget{kNeon, 4, 8, 4, 4, 8, 64};  // 32 registers of 4
#else
constexpr RegisterBudget kBudget{kPortable, 8, 4, 2, 2, 8, 8};
#endif
constexpr Isa kIsa = kBudget.isa;
constexpr int kNativeLanes = kBudget.lanes, kMaxRows = kBudget.max_rows;
constexpr int kTileX = kBudget.tile_x, kTileW = kBudget.tile_w;
constexpr int kFloatRows = 8, kFloatPassLimit = kBudget.float_pass_limit;  // rows per float32 register pass

#if defined(TUTEL_JAX_REQUIRE_ISA)
static_assert(int(kIsa) == TUTEL_JAX_REQUIRE_ISA, "the compiler flags do not target the requested instruction set");
#endif

// One register of floats, of uint32, and the bytes that widen to one register.
typedef float Native __attribute__((vector_size(kNativeLanes * sizeof(float))));
typedef uint32_t UNative __attribute__((vector_size(kNativeLanes * sizeof(uint32_t))));
typedef uint16_t HNative __attribute__((vector_size(kNativeLanes * sizeof(uint16_t))));
typedef uint8_t BNative __attribute__((vector_size(kNativeLanes)));

template <typename V = Native>
TJ_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

TJ_INLINE Native load(const uint16_t* p) {  // bfloat16: bits << 16 are the float32 bits
  HNative h;
  std::memcpy(&h, p, sizeof(h));
  return (Native)(__builtin_convertvector(h, UNative) << 16);
}

template <typename V>
TJ_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

TJ_INLINE Native splat(float s) { return Native{} + s; }
TJ_INLINE UNative splat_u(uint32_t s) { return UNative{} + s; }
TJ_INLINE UNative select(UNative mask, UNative a, UNative b) { return (a & mask) | (b & ~mask); }  // mask ? a : b

// kNativeLanes bytes, one per lane: one widening load where the ISA has it (compilers turn the generic
// conversion of a byte vector into a byte-by-byte insert sequence)
TJ_INLINE UNative load_bytes(const uint8_t* p) {
#if defined(TJ_ISA_AVX512)
  return (UNative)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(TJ_ISA_AVX2)
  return (UNative)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(TJ_ISA_NEON)
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(word))));
#else
  BNative b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, UNative);
#endif
}

// kNativeLanes int8 values as float32: `load_bytes`, each byte's sign extended by a shift to the top and back
TJ_INLINE Native int8_values(const uint8_t* p) {
  typedef int32_t SNative __attribute__((vector_size(sizeof(Native))));
  return __builtin_convertvector(((SNative)(load_bytes(p) << 24)) >> 24, Native);
}

TJ_INLINE UNative load_words(const uint8_t* p) {  // 4 bytes per lane
  UNative v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The software prefetch of a weight stream that is read once (a decode step): called once per 64-byte line at p,
// it asks for the line kStreamNear bytes ahead into L2 and the one kStreamFar bytes ahead into L3, so that the
// stream is in flight from two distances while the arithmetic runs. Rows of bfloat16 on 2 cores (AVX-512, cold):
// one L1 prefetch 8 KB ahead streamed at 0.92x of a plain multi-threaded read, these two at 1.06-1.12x; the read
// bandwidth benchmark (read_bandwidth.cc) prefetches the same way, so a kernel is measured against a read at its best.
constexpr int kStreamNear = 8192;
constexpr int kStreamFar = 16384;
TJ_INLINE void prefetch_stream(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kStreamNear, 0, 2);
  __builtin_prefetch(static_cast<const char*>(p) + kStreamFar, 0, 1);
}

// The sum of a vector's lanes, halving.
template <typename V>
TJ_INLINE float reduce_add(V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  float t[n];
  std::memcpy(t, &v, sizeof(v));
  for (int w = n / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}
#if defined(TJ_ISA_AVX512)
template <>
TJ_INLINE float reduce_add<Native>(Native v) { return _mm512_reduce_add_ps(v); }
#endif

// exp of each lane (Cephes' single-precision polynomial after a split into 2^n e^r, |r| <= ln2 / 2: within 1.01
// ulp of exp over [-87, 0]) for x <= 0, and 0 below -87 (where expf's result is no longer a normal float: XLA:CPU
// flushes those to 0 as well). A softmax's exponentials and a GLU's sigmoids otherwise cost more than the
// products around them.
TJ_INLINE Native exp_lanes(Native x) {
  typedef int32_t SNative __attribute__((vector_size(sizeof(Native))));
  const SNative keep = x >= splat(-87.0f);
  x = (Native)select((UNative)keep, (UNative)x, (UNative)splat(-87.0f));
  const Native n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const Native r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Native p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const UNative scaled = (UNative)p + ((UNative)__builtin_convertvector(n, SNative) << 23);
  return (Native)(scaled & (UNative)keep);
}

// Each lane rounded to the nearest integer, ties to even (the default rounding mode's nearbyint).
TJ_INLINE Native round_even(Native v) {
#if defined(TJ_ISA_AVX512)
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(TJ_ISA_AVX2)
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(TJ_ISA_NEON)
  return vrndnq_f32(v);
#else
  Native r;
  for (int l = 0; l < kNativeLanes; ++l) r[l] = __builtin_nearbyintf(v[l]);
  return r;
#endif
}

// 1 / (1 + exp(-z)) of each lane, from e = exp(-|z|) (exp_lanes' domain): 1 / (1 + e) for z >= 0, e / (1 + e)
// below (|z| > 87: exactly 1 or 0). NaN stays NaN.
TJ_INLINE Native sigmoid_lanes(Native z) {
  const UNative magnitude = (UNative)z & 0x7FFFFFFFu;
  const Native e = exp_lanes(-(Native)magnitude);
  const Native inv = 1.0f / (1.0f + e);
  const UNative nonneg = (UNative)(z >= splat(0.0f));
  const Native s = (Native)select(nonneg, (UNative)inv, (UNative)(e * inv));
  return (Native)select((UNative)(z == z), (UNative)s, (UNative)z);
}

constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The E2M1 value of the low 4 bits of each lane (the bits above are ignored), exactly kE2M1[bits & 15].
TJ_INLINE Native e2m1(UNative v) {
#if defined(TJ_ISA_AVX512)
  return _mm512_permutexvar_ps((__m512i)v, _mm512_loadu_ps(kE2M1));
#elif defined(TJ_ISA_AVX2)
  // An 8-entry permute reads the low 3 bits c; the table holds E2M1(c) with c xor-ed into bits 28-30, so xor-ing
  // v << 28 (c at bits 28-30, bit 3 at the sign) gives E2M1(c) back with bit 3 as its sign: 4 operations.
  const __m256i table = _mm256_setr_epi32(0x00000000, 0x3F000000 ^ (1 << 28), 0x3F800000 ^ (2 << 28),
                                          0x3FC00000 ^ (3 << 28), 0x40000000 ^ (4 << 28), 0x40400000 ^ (5 << 28),
                                          0x40800000 ^ (6 << 28), 0x40C00000 ^ (7 << 28));
  const __m256i h = (__m256i)v;
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(_mm256_castsi256_ps(table), h),
                       _mm256_castsi256_ps(_mm256_slli_epi32(h, 28)));
#elif defined(TJ_ISA_NEON)
  // a 64-byte table lookup: bytes 4c .. 4c+3 of the table are value c's float32
  const uint8x16x4_t table = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(kE2M1));
  const uint32x4_t idx = vmlaq_n_u32(vdupq_n_u32(0x03020100u), vandq_u32(v, vdupq_n_u32(15)), 0x04040404u);
  return vreinterpretq_f32_u8(vqtbl4q_u8(table, vreinterpretq_u8_u32(idx)));
#else
  // E2M1 magnitude c = eem: e > 0: 2^(e-1) * (1 + m/2); e = 0: m / 2
  const UNative c = v & 7u, e = c >> 1, m = c & 1u;
  const UNative normal = ((e + 126u) << 23) | (m << 22), sub = m * 0x3F000000u;
  return (Native)(select((UNative)(c >= splat_u(2)), normal, sub) | ((v & 8u) << 28));
#endif
}

// table[v & 15] of each lane: a 16-entry lookup of 32-bit values (the bits above the low 4 are ignored).
TJ_INLINE UNative lookup16(UNative v, const uint32_t table[16]) {
#if defined(TJ_ISA_AVX512)
  return (UNative)_mm512_permutexvar_epi32((__m512i)v, _mm512_loadu_si512(table));
#elif defined(TJ_ISA_AVX2)
  // two 8-entry permutes (they read the low 3 bits), bit 3 (moved to the sign) picks one
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(table)), (__m256i)v);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(table + 8)),
                                             (__m256i)v);
  return (UNative)_mm256_castps_si256(_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32((__m256i)v, 28))));
#elif defined(TJ_ISA_NEON)
  // a 64-byte table lookup: bytes 4c .. 4c+3 of the table are entry c
  const uint8x16x4_t t = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(table));
  const uint32x4_t idx = vmlaq_n_u32(vdupq_n_u32(0x03020100u), vandq_u32(v, vdupq_n_u32(15)), 0x04040404u);
  return vreinterpretq_u32_u8(vqtbl4q_u8(t, vreinterpretq_u8_u32(idx)));
#else
  UNative out;
  for (int l = 0; l < kNativeLanes; ++l) out[l] = table[v[l] & 15u];
  return out;
#endif
}

// e4m3fn codes (one per lane, the low 8 bits) -> float32, with no subnormal float32 on the way (a
// denormals-are-zero thread would read one as 0); the NaN code 0x7F decodes as 480 (callers that meet NaN codes
// check for them).
TJ_INLINE Native e4m3(UNative b) {
  const UNative mag = b & 0x7Fu;
  const UNative normal = (mag << 20) + (120u << 23);
  const UNative sub = (UNative)(__builtin_convertvector(mag, Native) * 0x1p-9f);  // exponent 0: m * 2^-9
  return (Native)(select((UNative)(mag < splat_u(8)), sub, normal) | ((b & 0x80u) << 24));
}

// kNativeLanes e4m3fn codes at p -> float32 times 2^-8, exactly (callers fold 2^8 into their scale). The bits
// (c + (c & 0x80)) << 7 of a code c are the half-precision bits of that value (the sign carried up to bit 15,
// exponent and mantissa landing in half's fields; subnormal codes give subnormal halves), so the ISA's half-to-
// float conversion decodes in one instruction where `e4m3` takes eight. The NaN code 0x7F gives 480 * 2^-8.
TJ_INLINE Native e4m3_bytes_2m8(const uint8_t* p) {
#if defined(TJ_ISA_AVX512) || (defined(TJ_ISA_AVX2) && defined(__F16C__))
#if defined(TJ_ISA_AVX512)
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(c, _mm256_and_si256(c, _mm256_set1_epi16(0x80))), 7);
  return (Native)_mm512_cvtph_ps(h);
#else
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_slli_epi16(_mm_add_epi16(c, _mm_and_si128(c, _mm_set1_epi16(0x80))), 7);
  return (Native)_mm256_cvtph_ps(h);
#endif
#elif defined(TJ_ISA_NEON)
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  const uint16x4_t c = vget_low_u16(vmovl_u8(vcreate_u8(word)));
  const uint16x4_t h = vshl_n_u16(vadd_u16(c, vand_u16(c, vdup_n_u16(0x80))), 7);
  return (Native)vcvt_f32_f16(vreinterpret_f16_u16(h));
#else
  return e4m3(load_bytes(p)) * 0x1p-8f;
#endif
}

// Lane l = v[first + l / LPB]: a value per block of LPB lanes, from a register (one permute on x86).
template <int LPB, int first = 0>
TJ_INLINE Native spread_lanes(Native v) {
  static_assert(LPB >= 1 && kNativeLanes % LPB == 0 && first + (kNativeLanes - 1) / LPB < kNativeLanes,
                "whole blocks of lanes from within the register");
#if defined(TJ_ISA_AVX512) || defined(TJ_ISA_AVX2)
  UNative index;
  for (int l = 0; l < kNativeLanes; ++l) index[l] = uint32_t(first + l / LPB);  // a constant after inlining
#if defined(TJ_ISA_AVX512)
  return _mm512_permutexvar_ps((__m512i)index, v);
#else
  return _mm256_permutevar8x32_ps(v, (__m256i)index);
#endif
#else
  Native r;
  for (int l = 0; l < kNativeLanes; ++l) r[l] = v[first + l / LPB];
  return r;
#endif
}

// Lane l = s[l / LPB]: a scale per block of LPB lanes, from kNativeLanes / LPB floats (s is read a whole
// register wide: kNativeLanes floats must be readable).
template <int LPB>
TJ_INLINE Native spread_blocks(const float* s) {
  return spread_lanes<LPB>(load(s));
}

// ---- int8 dot products (q8_rows.h): one register of bytes and one of int32 lanes.
constexpr int kQBytes = 4 * kNativeLanes;
typedef uint8_t QNative __attribute__((vector_size(kQBytes)));
typedef int8_t SQNative __attribute__((vector_size(kQBytes)));
typedef int32_t INative __attribute__((vector_size(kQBytes)));

TJ_INLINE QNative load_q(const uint8_t* p) {
  QNative v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// table[idx] per byte, for idx < 16 (a 16-byte table).
TJ_INLINE QNative lookup16(const uint8_t* table, QNative idx) {
#if defined(TJ_ISA_AVX512)
  return (QNative)_mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table)), (__m512i)idx);
#elif defined(TJ_ISA_AVX2)
  return (QNative)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table)),
                                      (__m256i)idx);
#elif defined(TJ_ISA_NEON)
  return vqtbl1q_u8(vld1q_u8(table), idx);
#else
  QNative r;
  for (int i = 0; i < kQBytes; ++i) r[i] = table[idx[i] & 15];
  return r;
#endif
}

// acc[l] + sum_{i < 4} u[4l + i] * s[4l + i], u unsigned bytes up to 127 (so NEON's signed dot takes them too),
// s signed: AVX-512 VNNI / AVX-VNNI vpdpbusd, else vpmaddubsw + vpmaddwd (no saturation for u <= 127 and
// |s| <= 127: pairs stay within 2 x 127 x 127), NEON sdot, portable integer arithmetic.
TJ_INLINE INative dot4(INative acc, QNative u, QNative s) {
#if defined(TJ_ISA_AVX512) && defined(__AVX512VNNI__)
  return (INative)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#elif defined(TJ_ISA_AVX512)
  return acc + (INative)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)u, (__m512i)s), _mm512_set1_epi16(1));
#elif defined(TJ_ISA_AVX2) && defined(__AVXVNNI__)
  return (INative)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif defined(TJ_ISA_AVX2)
  return acc + (INative)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
#elif defined(TJ_ISA_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, vreinterpretq_s8_u8(u), vreinterpretq_s8_u8(s));
#elif defined(TJ_ISA_NEON)
  // no dot product (ARMv8.0): 8 x 8 -> 16-bit products, pairs to 32 bits, then pairs of pairs
  const int8x16_t a = vreinterpretq_s8_u8(u), b = vreinterpretq_s8_u8(s);
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  const int32x4_t hi = vpaddlq_s16(vmull_s8(vget_high_s8(a), vget_high_s8(b)));
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
#else
  const SQNative sv = (SQNative)s;
  INative r = acc;
  for (int l = 0; l < kNativeLanes; ++l)
    for (int i = 0; i < 4; ++i) r[l] += int32_t(u[4 * l + i]) * int32_t(sv[4 * l + i]);
  return r;
#endif
}

// Whether dot4 is one instruction (VNNI / dot product) here: `native.isa()` reports it.
constexpr bool kDotInstruction =
#if (defined(TJ_ISA_AVX512) && defined(__AVX512VNNI__)) || (defined(TJ_ISA_AVX2) && defined(__AVXVNNI__)) || \
    (defined(TJ_ISA_NEON) && defined(__ARM_FEATURE_DOTPROD))
    true;
#else
    false;
#endif

}  // namespace tj

// Which instruction set this library was built for (the Python side's `native.isa()`).
extern "C" __attribute__((used, visibility("default"))) int TutelJaxIsa() { return int(tj::kIsa); }
// Whether its int8 dot product is one instruction (AVX-512 VNNI, AVX-VNNI, NEON dotprod): `build.dot_instruction()`.
extern "C" __attribute__((used, visibility("default"))) int TutelJaxDotInstruction() { return tj::kDotInstruction; }
