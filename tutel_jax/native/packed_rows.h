// tutel-jax native CPU kernels: weight rows (FP8 block, MXFP4, NVFP4, float32 / bfloat16) times a few activation
// rows.
//
// A weight in rows is the checkpoint's [N, K] ([out, in]) tensor of one expert (or one dense layer):
//   FP8 block  e4m3 codes [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]      w = f32(code) * scale_inv
//   MXFP4      E2M1 nibbles [N, K/2] (low nibble = even element), E8M0 scales [N, K/32]  w = LUT[c] * 2^(s-127)
//   NVFP4      E2M1 nibbles [N, K/2], e4m3 scales [N, K/16], float32 global g          w = LUT[c] * (f32(s) / g)
//              (ModelOpt's multiplying global scale: w = LUT[c] * (f32(s) * g))
// `packed_rows` computes out[r, n] = sum_k x[r, k] * w[n, k] for n in [n0, n1): each weight row is read once,
// decoded in registers (the dequantized weight never exists in memory) and multiplied by up to 8 activation
// rows at a time. The dequantized values are bit-identical to the float32 reference dequantizers
// (pallas_kernels.quant); only the summation order differs.
//
// With AVX-512 (compiled with -march=native on such a CPU) a 32-element chunk decodes with a 16-entry table
// permute (FP4) or integer bit moves (FP8); activations are laid out once per call (`arrange`) so that the even
// and odd elements of each FP4 chunk meet their nibbles without a shuffle. Elsewhere a portable path decodes a
// row into a float buffer and lets the compiler vectorize the dot products.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && !defined(TUTEL_JAX_PORTABLE)
#include <immintrin.h>
#define TUTEL_JAX_AVX512 1
#endif

namespace tj {

// The weight formats, as the Python side numbers them (tutel_jax/native/weights.py).
// kFloat32 / kBFloat16: [K, N] kernels (float_cols.h). The others are [N, K] rows (this file): kNvfp4Mul is NVFP4
// whose global scale multiplies (ModelOpt's weight_scale_2); kFloat32Rows / kBFloat16Rows are float [N, K] weights
// (an lm_head or a tied embedding as stored).
enum Format : int {
  kFloat32 = 0, kBFloat16 = 1, kFp8Block = 2, kMxfp4 = 3, kNvfp4 = 4, kNvfp4Mul = 5, kFloat32Rows = 6,
  kBFloat16Rows = 7
};

inline bool is_nv(int fmt) { return fmt == kNvfp4 || fmt == kNvfp4Mul; }
inline bool is_fp4(int fmt) { return fmt == kMxfp4 || is_nv(fmt); }
inline bool is_packed(int fmt) { return fmt == kFp8Block || is_fp4(fmt); }
inline bool is_rows(int fmt) { return is_packed(fmt) || fmt == kFloat32Rows || fmt == kBFloat16Rows; }

constexpr int kChunk = 32;      // elements per decoded chunk (two 16-lane vectors)
constexpr int kMaxRows = 8;     // activation rows per register pass
constexpr int kFp8Tile = 128;   // FP8 scale block (both axes)

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// e4m3fn -> float32 with no subnormal float32 on the way (a denormals-are-zero thread would read one as 0).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7F;
  if (mag == 0x7F) return NAN;
  const float v = (mag >> 3) == 0 ? float(mag) * 0x1p-9f : bits_to_float((mag << 20) + (120u << 23));
  return (b & 0x80) ? -v : v;
}

inline float e8m0_to_float(uint8_t s) { return s == 0 ? bits_to_float(0x00400000u) : bits_to_float(uint32_t(s) << 23); }

constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// One packed [N, K] weight (pointers at its first row).
struct PackedWeight {
  int fmt = kFp8Block;
  int64_t N = 0, K = 0;
  const uint8_t* data = nullptr;   // codes: [N, K] (FP8) or [N, K/2] (FP4)
  const uint8_t* scale = nullptr;  // [N, K/32] E8M0, [N, K/16] e4m3, or float32 [ceil(N/128), ceil(K/128)]
  float global = 1.0f;             // NVFP4's global scale

  int64_t scales_per_row() const { return fmt == kMxfp4 ? K / 32 : K / 16; }
};

// The float scale of each scale code: E8M0 2^(s-127), or NVFP4's f32(e4m3 s) / global (the reference's order:
// divide first, then multiply the value).
inline void scale_table(const PackedWeight& w, float table[256]) {
  for (int s = 0; s < 256; ++s)
    table[s] = w.fmt == kMxfp4    ? e8m0_to_float(uint8_t(s))
               : w.fmt == kNvfp4Mul ? e4m3_to_float(uint8_t(s)) * w.global
                                    : e4m3_to_float(uint8_t(s)) / w.global;
}

// Weight element k of row n as float32 (the portable path and the K tails).
inline float decode_one(const PackedWeight& w, const float* table, int64_t n, int64_t k) {
  if (w.fmt == kFloat32Rows) return reinterpret_cast<const float*>(w.data)[n * w.K + k];
  if (w.fmt == kBFloat16Rows) return bf16_to_float(reinterpret_cast<const uint16_t*>(w.data)[n * w.K + k]);
  if (w.fmt == kFp8Block) {
    const float* s = reinterpret_cast<const float*>(w.scale);
    const int64_t cols = (w.K + kFp8Tile - 1) / kFp8Tile;
    return e4m3_to_float(w.data[n * w.K + k]) * s[(n / kFp8Tile) * cols + k / kFp8Tile];
  }
  const uint8_t byte = w.data[n * (w.K / 2) + k / 2];
  const int code = (k & 1) ? byte >> 4 : byte & 15;
  const int block = w.fmt == kMxfp4 ? 32 : 16;
  return kE2M1[code] * table[w.scale[n * w.scales_per_row() + k / block]];
}

constexpr int kPrefetchBytes = 2048;
constexpr int kWide = 128;  // FP4 elements per wide chunk (one 64-byte load)

// Activations laid out for `fmt` (AVX-512 only; elsewhere, and for FP8, x as it is). FP4 rows are read in wide
// chunks of 128 elements: 16 lanes of 4 bytes, nibble j of lane l being element 8l + j, so x's wide chunk is laid
// out as xa[16j + l] = x[8l + j]. The rest (K % 128) goes in chunks of 32 as [16 even, 16 odd elements], and
// what remains after those (K % 32) keeps its order. x [K] -> xa [K].
inline void arrange(int fmt, const float* x, int64_t K, float* xa) {
#ifdef TUTEL_JAX_AVX512
  if (is_fp4(fmt)) {
    const int64_t wide = K / kWide * kWide, narrow = wide + (K - wide) / kChunk * kChunk;
    for (int64_t c = 0; c < wide; c += kWide)
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 16; ++l) xa[c + 16 * j + l] = x[c + 8 * l + j];
    for (int64_t c = wide; c < narrow; c += kChunk)
      for (int j = 0; j < 16; ++j) {
        xa[c + j] = x[c + 2 * j];
        xa[c + 16 + j] = x[c + 2 * j + 1];
      }
    std::memcpy(xa + narrow, x + narrow, sizeof(float) * (K - narrow));
    return;
  }
#endif
  (void)fmt;
  std::memcpy(xa, x, sizeof(float) * K);
}

#ifdef TUTEL_JAX_AVX512

// Chunk c (elements 32c .. 32c+31) of row n as two vectors matching the arranged activations.
struct Fp4Chunks {
  const uint8_t* codes;   // row's bytes
  const uint8_t* scales;  // row's scale codes
  const float* table;
  bool nv;
  __m512 lut;

  inline void get(int64_t c, __m512& w0, __m512& w1) const {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c)));
    const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15));
    const __m512i hi = _mm512_srli_epi32(b, 4);
    __m512 s;
    if (nv) {  // lanes 0-7: elements 32c .. 32c+15 (block 2c), lanes 8-15: block 2c+1
      s = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(table[scales[2 * c]]),
                               _mm512_set1_ps(table[scales[2 * c + 1]]));
    } else {
      s = _mm512_set1_ps(table[scales[c]]);
    }
    w0 = _mm512_mul_ps(_mm512_permutexvar_ps(lo, lut), s);
    w1 = _mm512_mul_ps(_mm512_permutexvar_ps(hi, lut), s);
  }
};

inline __m512 fp8_decode16(const uint8_t* p, __m512 scale) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));  // exponent 0: m * 2^-9
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)), scale);
}

struct Fp8Chunks {
  const uint8_t* codes;  // row's codes
  const float* scales;   // row block's scale_inv row
  inline void get(int64_t c, __m512& w0, __m512& w1) const {
    _mm_prefetch(reinterpret_cast<const char*>(codes + c * kChunk + kPrefetchBytes), _MM_HINT_T0);
    const __m512 s = _mm512_set1_ps(scales[(c * kChunk) / kFp8Tile]);
    w0 = fp8_decode16(codes + c * kChunk, s);
    w1 = fp8_decode16(codes + c * kChunk + 16, s);
  }
};

// NVFP4 scale codes [count] -> out [count] floats equal to the scale table's (e4m3 decoded exactly, NaN for the
// NaN codes, then divided, or with `mul` multiplied, by the global scale as `scale_table` does): 16 codes per
// vector, where looking each chunk's codes up in the table took a gather.
inline void nv_decode_scales(const uint8_t* codes, int64_t count, float global, bool mul, const float* table,
                             float* out) {
  const __m512 g = _mm512_set1_ps(global);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i mag = _mm512_and_si512(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))), _mm512_set1_epi32(0x7F));
    __m512 v = fp8_decode16(codes + i, _mm512_set1_ps(1.0f));
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v, _mm512_set1_ps(NAN));
    _mm512_storeu_ps(out + i, mul ? _mm512_mul_ps(v, g) : _mm512_div_ps(v, g));
  }
  for (; i < count; ++i) out[i] = table[codes[i]];
}

// The scales of wide chunk c: lane l holds elements 8l .. 8l+7, in MXFP4 block l/4 (E8M0 computed in place) or
// NVFP4 block l/2 (`nv`: the chunk's 8 decoded scales, each spread over two lanes).
inline __m512 fp4_wide_scale(const uint8_t* scales, int64_t c, const float* nv) {
  if (nv) {
    const __m512i nv_lane = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_ps(nv_lane, _mm512_castps256_ps512(_mm256_loadu_ps(nv)));
  }
  const __m512i mx_shift = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
  uint32_t four;
  std::memcpy(&four, scales + 4 * c, 4);
  const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(int(four)), mx_shift), _mm512_set1_epi32(255));
  const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                               _mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(bits);
}

// Wide chunks whose NVFP4 scales are decoded at a time (on the stack: 8 floats each).
constexpr int64_t kNvScaleChunks = 64;

// One FP4 row (codes [K/2], scale codes) times R arranged rows: wide chunks first (8 table permutes per 64-byte
// load, one scale vector per chunk applied to the chunk's partial sums), then 32-element chunks, then the rest.
template <int R>
inline void fp4_dot_row(const uint8_t* codes, const uint8_t* scales, const float* table, bool nv, float global,
                        bool global_mul, int64_t K, const float* xa, int64_t ldx, float* sums) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  const int64_t wide = K / kWide, narrow = (K - wide * kWide) / kChunk;
  __m512 acc[R];
  float nv_scales[8 * kNvScaleChunks];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < wide; ++c) {
    if (nv && c % kNvScaleChunks == 0)
      nv_decode_scales(scales + 8 * c, 8 * std::min(kNvScaleChunks, wide - c), global, global_mul, table, nv_scales);
    // a few lines ahead (into the next rows): memory and arithmetic overlap instead of taking turns
    _mm_prefetch(reinterpret_cast<const char*>(codes + 64 * c + kPrefetchBytes), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(codes + 64 * c);
    const __m512 s = fp4_wide_scale(scales, c, nv ? nv_scales + 8 * (c % kNvScaleChunks) : nullptr);
    __m512 part[R];
    const float* xc = xa + c * kWide;
    {
      const __m512 w = _mm512_permutexvar_ps(v, lut);  // the permute reads the low 4 bits of each lane
      for (int r = 0; r < R; ++r) part[r] = _mm512_mul_ps(_mm512_loadu_ps(xc + r * ldx), w);
    }
#define TJ_NIBBLE(J)                                                                          \
    {                                                                                         \
      const __m512 w = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * J), lut);               \
      for (int r = 0; r < R; ++r) part[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx + 16 * J), w, part[r]); \
    }
    TJ_NIBBLE(1) TJ_NIBBLE(2) TJ_NIBBLE(3) TJ_NIBBLE(4) TJ_NIBBLE(5) TJ_NIBBLE(6) TJ_NIBBLE(7)
#undef TJ_NIBBLE
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
  }
  const int64_t base = wide * kWide;
  Fp4Chunks ch{codes + base / 2, scales + base / (nv ? 16 : 32), table, nv, lut};
  for (int64_t c = 0; c < narrow; ++c) {
    __m512 w0, w1;
    ch.get(c, w0, w1);
    const float* xc = xa + base + c * kChunk;
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx), w0, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx + 16), w1, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

inline void fp4_dot_rows(const uint8_t* codes, const uint8_t* scales, const float* table, bool nv, float global,
                         bool global_mul, int64_t K, const float* xa, int64_t ldx, int rows, float* sums) {
  switch (rows) {
    case 1: return fp4_dot_row<1>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 2: return fp4_dot_row<2>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 3: return fp4_dot_row<3>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 4: return fp4_dot_row<4>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 5: return fp4_dot_row<5>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 6: return fp4_dot_row<6>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    case 7: return fp4_dot_row<7>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
    default: return fp4_dot_row<8>(codes, scales, table, nv, global, global_mul, K, xa, ldx, sums);
  }
}

struct FloatRowChunks {
  const float* f32;    // or
  const uint16_t* bf16;
  inline void get(int64_t c, __m512& w0, __m512& w1) const {
    if (f32) {
      _mm_prefetch(reinterpret_cast<const char*>(f32 + c * kChunk) + kPrefetchBytes, _MM_HINT_T0);
      w0 = _mm512_loadu_ps(f32 + c * kChunk);
      w1 = _mm512_loadu_ps(f32 + c * kChunk + 16);
      return;
    }
    _mm_prefetch(reinterpret_cast<const char*>(bf16 + c * kChunk) + kPrefetchBytes, _MM_HINT_T0);
    const __m512i h = _mm512_loadu_si512(bf16 + c * kChunk);  // 32 bfloat16: bits << 16 are float32 bits
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  }
};

// out[r * ldo] = dot(row, xa[r * ldx]) for R rows: each chunk decoded once, used by all R rows.
template <int R, typename Chunks>
inline void dot_row(const Chunks& chunks, int64_t full_chunks, const float* xa, int64_t ldx, float* acc_out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full_chunks; ++c) {
    __m512 w0, w1;
    chunks.get(c, w0, w1);
    const float* xc = xa + c * kChunk;
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx), w0, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx + 16), w1, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}

template <typename Chunks>
inline void dot_rows(const Chunks& chunks, int64_t full_chunks, const float* xa, int64_t ldx, int rows, float* sums) {
  switch (rows) {
    case 1: return dot_row<1>(chunks, full_chunks, xa, ldx, sums);
    case 2: return dot_row<2>(chunks, full_chunks, xa, ldx, sums);
    case 3: return dot_row<3>(chunks, full_chunks, xa, ldx, sums);
    case 4: return dot_row<4>(chunks, full_chunks, xa, ldx, sums);
    case 5: return dot_row<5>(chunks, full_chunks, xa, ldx, sums);
    case 6: return dot_row<6>(chunks, full_chunks, xa, ldx, sums);
    case 7: return dot_row<7>(chunks, full_chunks, xa, ldx, sums);
    default: return dot_row<8>(chunks, full_chunks, xa, ldx, sums);
  }
}

#endif  // TUTEL_JAX_AVX512

#ifdef TUTEL_JAX_AVX512
// Row n of w decoded to float32 in the arranged order (dst [K]: dst[k] pairs with xa[k]).
inline void decode_row(const PackedWeight& w, const float* table, int64_t n, float* dst) {
  const int64_t K = w.K;
  int64_t done = 0;
  if (is_fp4(w.fmt)) {
    const uint8_t* codes = w.data + n * (K / 2);
    const uint8_t* scales = w.scale + n * w.scales_per_row();
    const bool nv = is_nv(w.fmt);
    const __m512 lut = _mm512_loadu_ps(kE2M1);
    const int64_t wide = K / kWide;
    float nv_scales[8 * kNvScaleChunks];
    for (int64_t c = 0; c < wide; ++c) {
      if (nv && c % kNvScaleChunks == 0)
        nv_decode_scales(scales + 8 * c, 8 * std::min(kNvScaleChunks, wide - c), w.global, w.fmt == kNvfp4Mul,
                         table, nv_scales);
      const __m512i v = _mm512_loadu_si512(codes + 64 * c);
      const __m512 s = fp4_wide_scale(scales, c, nv ? nv_scales + 8 * (c % kNvScaleChunks) : nullptr);
      for (int j = 0; j < 8; ++j)
        _mm512_storeu_ps(dst + c * kWide + 16 * j,
                         _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(v, _mm512_set1_epi32(4 * j)), lut), s));
    }
    done = wide * kWide;
    Fp4Chunks ch{codes + done / 2, scales + done / (nv ? 16 : 32), table, nv, lut};
    for (int64_t c = 0; c < (K - done) / kChunk; ++c) {
      __m512 w0, w1;
      ch.get(c, w0, w1);
      _mm512_storeu_ps(dst + done + c * kChunk, w0);
      _mm512_storeu_ps(dst + done + c * kChunk + 16, w1);
    }
    done += (K - done) / kChunk * kChunk;
  } else {
    const int64_t full = K / kChunk;
    auto store = [&](const auto& ch) {
      for (int64_t c = 0; c < full; ++c) {
        __m512 w0, w1;
        ch.get(c, w0, w1);
        _mm512_storeu_ps(dst + c * kChunk, w0);
        _mm512_storeu_ps(dst + c * kChunk + 16, w1);
      }
    };
    if (w.fmt == kFp8Block) {
      const int64_t cols = (K + kFp8Tile - 1) / kFp8Tile;
      store(Fp8Chunks{w.data + n * K, reinterpret_cast<const float*>(w.scale) + (n / kFp8Tile) * cols});
    } else if (w.fmt == kFloat32Rows) {
      store(FloatRowChunks{reinterpret_cast<const float*>(w.data) + n * K, nullptr});
    } else {
      store(FloatRowChunks{nullptr, reinterpret_cast<const uint16_t*>(w.data) + n * K});
    }
    done = full * kChunk;
  }
  for (int64_t k = done; k < K; ++k) dst[k] = decode_one(w, table, n, k);
}

// out[r, n] = dot(x[r], wd[n]) for RX x rows and RW decoded weight rows, accumulated in registers.
template <int RX, int RW>
inline void dot_tile(const float* x, int64_t ldx, const float* wd, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  __m512 acc[RX][RW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t vec = K / 16 * 16;
  for (int64_t k = 0; k < vec; k += 16) {
    __m512 wv[RW];
    for (int j = 0; j < RW; ++j) wv[j] = _mm512_loadu_ps(wd + j * ldw + k);
    for (int i = 0; i < RX; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t k = vec; k < K; ++k) s += x[i * ldx + k] * wd[j * ldw + k];
      out[i * ldo + j] = s;
    }
}

template <int RW>
inline void dot_tiles_x(const float* x, int64_t ldx, int rows, const float* wd, int64_t ldw, int64_t K, float* out,
                        int64_t ldo) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) dot_tile<4, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
  switch (rows - i) {
    case 3: return dot_tile<3, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    case 2: return dot_tile<2, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    case 1: return dot_tile<1, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    default: return;
  }
}

constexpr int kDecodedRows = 8;  // weight rows decoded at once for many activation rows

// The many-rows form: weight rows decoded kDecodedRows at a time into a float buffer (L2), then register tiles
// of 4 activation rows x 4 weight rows: each weight decoded once per call whatever the number of rows.
inline void decoded_rows(const PackedWeight& w, const float* table, const float* xa, int R, int64_t ldx,
                         int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t K = w.K;
  std::vector<float> wd(kDecodedRows * K);
  for (int64_t b0 = n0; b0 < n1; b0 += kDecodedRows) {
    const int nw = int(std::min<int64_t>(kDecodedRows, n1 - b0));
    for (int j = 0; j < nw; ++j) decode_row(w, table, b0 + j, wd.data() + j * K);
    float* o = out + (b0 - n0);
    int j = 0;
    for (; j + 4 <= nw; j += 4) dot_tiles_x<4>(xa, ldx, R, wd.data() + j * K, K, K, o + j, ldo);
    for (; j < nw; ++j) dot_tiles_x<1>(xa, ldx, R, wd.data() + j * K, K, K, o + j, ldo);
  }
}
#endif  // TUTEL_JAX_AVX512

// out[r, n - n0] = sum_k xa[r, k] * w[n, k] for r < R, n in [n0, n1). xa: `arrange`d rows (stride ldx);
// out: row stride ldo.
inline void packed_rows(const PackedWeight& w, const float* xa, int R, int64_t ldx, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
  float table[256];
  if (is_fp4(w.fmt)) scale_table(w, table);
  const int64_t K = w.K;
#ifdef TUTEL_JAX_AVX512
  if (R > kMaxRows) return decoded_rows(w, table, xa, R, ldx, n0, n1, out, ldo);
  const int64_t full = K / kChunk, tail0 = full * kChunk;
  const float* fp8_scales = reinterpret_cast<const float*>(w.scale);
  const int64_t fp8_cols = (K + kFp8Tile - 1) / kFp8Tile;
  for (int64_t n = n0; n < n1; ++n) {
    for (int r0 = 0; r0 < R; r0 += kMaxRows) {
      const int rows = std::min(kMaxRows, R - r0);
      float sums[kMaxRows];
      const float* x = xa + r0 * ldx;
      if (w.fmt == kFp8Block) {
        Fp8Chunks ch{w.data + n * K, fp8_scales + (n / kFp8Tile) * fp8_cols};
        dot_rows(ch, full, x, ldx, rows, sums);
      } else if (w.fmt == kFloat32Rows) {
        FloatRowChunks ch{reinterpret_cast<const float*>(w.data) + n * K, nullptr};
        dot_rows(ch, full, x, ldx, rows, sums);
      } else if (w.fmt == kBFloat16Rows) {
        FloatRowChunks ch{nullptr, reinterpret_cast<const uint16_t*>(w.data) + n * K};
        dot_rows(ch, full, x, ldx, rows, sums);
      } else {
        fp4_dot_rows(w.data + n * (K / 2), w.scale + n * w.scales_per_row(), table, is_nv(w.fmt), w.global,
                     w.fmt == kNvfp4Mul, K, x, ldx, rows, sums);
      }
      for (int64_t k = tail0; k < K; ++k) {
        const float v = decode_one(w, table, n, k);
        for (int r = 0; r < rows; ++r) sums[r] += v * x[r * ldx + k];
      }
      for (int r = 0; r < rows; ++r) out[(r0 + r) * ldo + (n - n0)] = sums[r];
    }
  }
#else
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < K; ++k) row[k] = decode_one(w, table, n, k);
    for (int r = 0; r < R; ++r) {
      const float* x = xa + r * ldx;
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += row[k] * x[k];
      out[r * ldo + (n - n0)] = s;
    }
  }
#endif
}

}  // namespace tj
