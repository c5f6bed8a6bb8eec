// tutel-jax native CPU kernels: float32 / bfloat16 kernels [K, N] ([in, out]) times a few activation rows.
//
// `float_cols` computes out[r, c - c0] = sum_k a[r, k] * w[k, c] for c in [c0, c1). Up to 8 rows stream the
// column slice of w in memory order, 4 weight rows per pass over the outputs, each weight vector used by all rows
// while it is in registers (decode); more rows go through register tiles of kColTileRows rows x kTileCols columns
// (prefill; the ISA's register budget, simd.h), whose column slice of w is read from memory by the first row
// tile and from cache by the others. Written once over GCC/Clang vector extensions (simd.h).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace tj {

constexpr int kTileCols = kNativeLanes * kColTileVectors;  // columns per register tile
constexpr int kMaxTileRows = kColTileRows;                  // rows per register tile
constexpr int kStreamRows = 8;
constexpr int kPrefetchRows = 8;   // weight rows the streaming form prefetches ahead

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return bf16_to_float(*p); }

// out[r, 0:kTileCols] = sum_k a[r, k] * w[k, c0:c0+kTileCols] for R rows, accumulated in registers.
template <int R, typename W>
void tile_cols(const float* a, int64_t lda, const W* w, int64_t ldw, int64_t depth, int64_t c0, float* out,
               int64_t ldo) {
  Native acc[R][kColTileVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColTileVectors; ++v) acc[r][v] = Native{};
  for (int64_t k = 0; k < depth; ++k) {
    const W* row = w + k * ldw + c0;
    Native wv[kColTileVectors];
    for (int v = 0; v < kColTileVectors; ++v) wv[v] = load(row + v * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const Native s = Native{} + a[r * lda + k];
      for (int v = 0; v < kColTileVectors; ++v) acc[r][v] += s * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColTileVectors; ++v) store(out + r * ldo + v * kNativeLanes, acc[r][v]);
}

// out[r, 0:c1-c0] = sum_k a[r, k] * w[k, c0:c1] for R rows, streaming w's rows in memory order, kDepthStep rows
// of w per pass over the outputs (each output vector loaded and stored once per pass, not once per weight row).
template <int R, typename W>
void stream_cols(const float* a, int64_t lda, const W* w, int64_t ldw, int64_t depth, int64_t c0, int64_t c1,
                 float* out, int64_t ldo) {
  constexpr int kDepthStep = 4;
  const int64_t width = c1 - c0, vec_end = width / kNativeLanes * kNativeLanes;
  for (int r = 0; r < R; ++r) std::memset(out + r * ldo, 0, sizeof(float) * width);
  for (int64_t k = 0; k < depth; k += kDepthStep) {
    const int step = int(std::min<int64_t>(kDepthStep, depth - k));
    const W* row[kDepthStep];
    float s[R][kDepthStep];
    for (int j = 0; j < kDepthStep; ++j) {
      row[j] = w + (k + std::min(j, step - 1)) * ldw + c0;
      for (int r = 0; r < R; ++r) s[r][j] = j < step ? a[r * lda + k + j] : 0.0f;  // a short last pass: zeros
    }
    // rows ahead, for a column slice of wider rows (strided: the hardware prefetcher misses it); whole rows are
    // one contiguous stream, which it follows better alone
    if (width < ldw && k + kPrefetchRows + step <= depth)
      for (int j = 0; j < step; ++j)
        for (int64_t b = 0; b < width * int64_t(sizeof(W)); b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(row[j] + kPrefetchRows * ldw) + b);
    for (int64_t c = 0; c < vec_end; c += kNativeLanes) {
      Native wv[kDepthStep];
      if (width == ldw && c % (64 / sizeof(W)) == 0)  // whole rows: each row's stream, once per line
        for (int j = 0; j < kDepthStep; ++j) prefetch_stream(row[j] + c);
      for (int j = 0; j < kDepthStep; ++j) wv[j] = load(row[j] + c);
      for (int r = 0; r < R; ++r) {
        Native o;
        std::memcpy(&o, out + r * ldo + c, sizeof(Native));
        for (int j = 0; j < kDepthStep; ++j) o += s[r][j] * wv[j];
        std::memcpy(out + r * ldo + c, &o, sizeof(Native));
      }
    }
    for (int64_t c = vec_end; c < width; ++c)
      for (int j = 0; j < step; ++j) {
        const float wc = load_scalar(row[j] + c);
        for (int r = 0; r < R; ++r) out[r * ldo + c] += s[r][j] * wc;
      }
  }
}

template <typename W>
void stream_rows(const float* a, int64_t lda, int rows, const W* w, int64_t ldw, int64_t depth, int64_t c0,
                 int64_t c1, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return stream_cols<1>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 2: return stream_cols<2>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 3: return stream_cols<3>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 4: return stream_cols<4>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 5: return stream_cols<5>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 6: return stream_cols<6>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    case 7: return stream_cols<7>(a, lda, w, ldw, depth, c0, c1, out, ldo);
    default: return stream_cols<8>(a, lda, w, ldw, depth, c0, c1, out, ldo);
  }
}

// out[r, c - c0] = sum_k a[r, k] * w[k, c] for r < rows, c in [c0, c1); w [depth, *] of row stride ldw.
template <typename W>
void float_cols(const W* w, int64_t ldw, int64_t depth, const float* a, int rows, int64_t lda, int64_t c0,
                int64_t c1, float* out, int64_t ldo) {
  if (rows <= kStreamRows) return stream_rows(a, lda, rows, w, ldw, depth, c0, c1, out, ldo);
  const int64_t tiled = c0 + (c1 - c0) / kTileCols * kTileCols;
  for (int64_t t = c0; t < tiled; t += kTileCols) {
    float* o = out + (t - c0);
    int r0 = 0;
    for (; r0 + kMaxTileRows <= rows; r0 += kMaxTileRows)
      tile_cols<kMaxTileRows>(a + r0 * lda, lda, w, ldw, depth, t, o + r0 * ldo, ldo);
    switch (rows - r0) {
      case 3: tile_cols<3>(a + r0 * lda, lda, w, ldw, depth, t, o + r0 * ldo, ldo); break;
      case 2: tile_cols<2>(a + r0 * lda, lda, w, ldw, depth, t, o + r0 * ldo, ldo); break;
      case 1: tile_cols<1>(a + r0 * lda, lda, w, ldw, depth, t, o + r0 * ldo, ldo); break;
      default: break;
    }
  }
  if (tiled < c1)
    for (int r0 = 0; r0 < rows; r0 += kStreamRows)
      stream_rows(a + r0 * lda, lda, std::min(kStreamRows, rows - r0), w, ldw, depth, tiled, c1,
                  out + r0 * ldo + (tiled - c0), ldo);
}

}  // namespace tj
