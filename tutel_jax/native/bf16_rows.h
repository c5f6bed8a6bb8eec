// tutel-jax native CPU kernels: bfloat16 weight rows [N, K] times a few activation rows that are exactly
// bfloat16 (a bfloat16 model's: the float32 rows the kernels take hold bfloat16 values), in AVX-512 BF16 dot
// products (vdpbf16ps: 32 products per instruction, summed in float32).
//
// A product of two bfloat16 values is exact in float32, so the sums equal the float32 path's (packed_rows.h)
// up to their order; the instruction treats subnormal inputs (below 1.2e-38) as zero. Where the activations are
// not all exactly bfloat16, or the CPU (build) has no AVX-512 BF16, the float32 path runs instead. Twice the
// multiply-adds per instruction and half the activation bytes of the float32 path: a few rows (batched decode)
// stop being bound by the float32 FMAs on CPUs whose 512-bit FMAs run at half rate.

#pragma once

#include <cstdint>
#include <cstring>

#include "packed_rows.h"

namespace tj {

#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

constexpr int64_t kBf16Chunk = 32;  // bfloat16 elements per register

// Elements per bfloat16 activation row: K rounded up to whole registers (zero padded).
inline int64_t bf16_row_len(int64_t K) { return (K + kBf16Chunk - 1) / kBf16Chunk * kBf16Chunk; }

// Whether every value of the R rows x [R, K] (stride ldx) is exactly a bfloat16 (the low 16 bits zero).
inline bool exactly_bf16(const float* x, int R, int64_t ldx, int64_t K) {
  uint32_t low = 0;
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) {
      uint32_t bits;
      std::memcpy(&bits, x + r * ldx + k, 4);
      low |= bits & 0xFFFFu;
    }
  return low == 0;
}

// x [R, K] (exactly bfloat16) -> dst [R, bf16_row_len(K)] bfloat16 codes, zero past K.
inline void to_bf16_rows(const float* x, int R, int64_t ldx, int64_t K, uint16_t* dst) {
  const int64_t len = bf16_row_len(K);
  for (int r = 0; r < R; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      uint32_t bits;
      std::memcpy(&bits, x + r * ldx + k, 4);
      dst[r * len + k] = uint16_t(bits >> 16);
    }
    std::memset(dst + r * len + K, 0, sizeof(uint16_t) * (len - K));
  }
}

#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
// sums[r] = dot(w [K] bfloat16, xb[r * len ..]) for R rows: two accumulators per row (independent chains), the
// weight row read once; a partial last register is a masked load (the activations past K are zero).
template <int R>
inline void bf16_row_dots(const uint16_t* w, int64_t K, const uint16_t* xb, int64_t len, float* sums) {
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  const int64_t full = K / kBf16Chunk;
  auto step = [&](int h, int64_t c, __m512i wv) TJ_INLINE_LAMBDA {
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xb + r * len + c * kBf16Chunk);
      acc[h][r] = _mm512_dpbf16_ps(acc[h][r], (__m512bh)xv, (__m512bh)wv);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    prefetch_stream(w + c * kBf16Chunk);
    prefetch_stream(w + (c + 1) * kBf16Chunk);
    step(0, c, _mm512_loadu_si512(w + c * kBf16Chunk));
    step(1, c + 1, _mm512_loadu_si512(w + (c + 1) * kBf16Chunk));
  }
  if (c < full) {
    step(0, c, _mm512_loadu_si512(w + c * kBf16Chunk));
    ++c;
  }
  if (const int64_t rest = K - c * kBf16Chunk; rest > 0)
    step(1, c, _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << rest) - 1), w + c * kBf16Chunk));
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}
#endif

// out[r, n - n0] = sum_k x[r, k] * w[n, k] for a bfloat16-rows weight and R <= kMaxRows rows given as
// `to_bf16_rows` codes (xb, bf16_row_len(K) per row). Only where kBf16Dot.
inline void bf16_rows(const PackedWeight& w, const uint16_t* xb, int R, int64_t n0, int64_t n1, float* out,
                      int64_t ldo) {
#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
  const uint16_t* rows = reinterpret_cast<const uint16_t*>(w.data);
  const int64_t len = bf16_row_len(w.K);
  with_row_count(R, [&](auto count) {
    constexpr int kR = decltype(count)::value;
    for (int64_t n = n0; n < n1; ++n) {
      float sums[kR];
      bf16_row_dots<kR>(rows + n * w.K, w.K, xb, len, sums);
      for (int r = 0; r < kR; ++r) out[r * ldo + (n - n0)] = sums[r];
    }
  });
#else
  (void)w, (void)xb, (void)R, (void)n0, (void)n1, (void)out, (void)ldo;
#endif
}

#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
// Group c of a compact bfloat16 row (packed_rows.h) as 32 bfloat16 codes in the arranged order (elements 0-7,
// 16-23, 8-15, 24-31).
TJ_INLINE __m512i compact_group_bf16(const uint8_t* g, __m256i table) {
  __m256i words[2];
  compact_group_words(g, table, words);
  return _mm512_inserti64x4(_mm512_castsi256_si512(words[0]), words[1], 1);
}

// sums[r] = dot(row [K], xb[r * len ..]) for a compact bfloat16 row (its patches aside) and R arranged rows.
template <int R>
inline void compact_row_dots(const uint8_t* row, int64_t K, __m256i table, const uint16_t* xb, int64_t len,
                             float* sums) {
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  const int64_t groups = K / kBf16Chunk;
  auto step = [&](int h, int64_t c) TJ_INLINE_LAMBDA {
    const __m512i wv = compact_group_bf16(row + c * kCompactGroup, table);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xb + r * len + c * kBf16Chunk);
      acc[h][r] = _mm512_dpbf16_ps(acc[h][r], (__m512bh)xv, (__m512bh)wv);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= groups; c += 2) {
    prefetch_stream(row + c * kCompactGroup);
    prefetch_stream(row + c * kCompactGroup + 64);
    step(0, c);
    step(1, c + 1);
  }
  if (c < groups) step(0, c);
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}
#endif

// Row n of a compact bfloat16 weight as its bfloat16 codes (dst [K], element order), exactly, the patches
// included.
inline void compact_row_bf16(const PackedWeight& w, int64_t n, uint16_t* dst) {
  const int64_t groups = w.K / kBf16Chunk;
  const uint8_t* row = w.data + n * groups * kCompactGroup;
#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
  const __m256i table = compact_table(w.high_bytes());
  for (int64_t c = 0; c < groups; ++c) {
    prefetch_stream(row + c * kCompactGroup);
    const __m512i v = compact_group_bf16(row + c * kCompactGroup, table);
    // 128-bit blocks (8 elements) from the arranged order back to the elements'
    _mm512_storeu_si512(dst + c * kBf16Chunk, _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)));
  }
#else
  const CompactChunks chunks{row, w.high_bytes()};
  for (int64_t c = 0; c < groups; ++c) {
    Native v[kChunkVectors];
    chunks.get(c, v);
    for (int i = 0; i < kChunkVectors; ++i) {
      const UNative bits = (UNative)v[i] >> 16;  // exact: the low 16 bits of a decoded bfloat16 are zero
      for (int l = 0; l < kNativeLanes; ++l)
        dst[c * kBf16Chunk + compact_element(i * kNativeLanes + l)] = uint16_t(bits[l]);
    }
  }
#endif
  for (int32_t p = w.patch_index()[n]; p < w.patch_index()[n + 1]; ++p)
    dst[w.patches[3 * p + 1]] = uint16_t(uint32_t(w.patches[3 * p + 2]) >> 16);
}

// out[r, n - n0] = sum_k x[r, k] * w[n, k] for a compact bfloat16 weight (K a multiple of 32) and R <= kMaxRows
// rows given as `to_bf16_rows` codes of arranged rows: each group decoded to bfloat16 codes in registers, the
// patches added in float32 after the row's dot products. Only where kBf16Dot.
inline void compact_bf16_rows(const PackedWeight& w, const uint16_t* xb, int R, int64_t n0, int64_t n1, float* out,
                              int64_t ldo) {
#if defined(TJ_ISA_AVX512) && defined(__AVX512BF16__)
  const __m256i table = compact_table(w.high_bytes());
  const int64_t len = bf16_row_len(w.K), row_bytes = w.K / kBf16Chunk * kCompactGroup;
  with_row_count(R, [&](auto count) {
    constexpr int kR = decltype(count)::value;
    for (int64_t n = n0; n < n1; ++n) {
      float sums[kR];
      compact_row_dots<kR>(w.data + n * row_bytes, w.K, table, xb, len, sums);
      add_patches<kR>(w, n, [&](int r, int64_t k) { return bf16_to_float(xb[r * len + k]); }, sums);
      for (int r = 0; r < kR; ++r) out[r * ldo + (n - n0)] = sums[r];
    }
  });
#else
  (void)w, (void)xb, (void)R, (void)n0, (void)n1, (void)out, (void)ldo;
#endif
}

}  // namespace tj

// Whether this library multiplies bfloat16 rows in AVX-512 BF16 dot products: `build.bf16_dot()`.
extern "C" __attribute__((used, visibility("default"))) int TutelJaxBf16Dot() { return tj::kBf16Dot; }
