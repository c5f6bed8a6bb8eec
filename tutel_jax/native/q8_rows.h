// tutel-jax native CPU kernels: FP4 weight rows (MXFP4, NVFP4) times a few activation rows quantized to int8 per
// block of 32 elements, in integer dot products (the quantized-activation path of packed_rows.h).
//
// Each E2M1 code c becomes the byte 2 * E2M1(c) + 12, an integer in [0, 24] (one 16-byte table lookup), so that
// an unsigned x signed byte dot product of four pairs (`dot4`: AVX-512 VNNI / AVX-VNNI vpdpbusd, AVX2 vpmaddubsw,
// NEON sdot) multiplies it by the int8 activations q:
//   sum_k w[k] x[k] ~= sum_b sw_b * sa_b / 2 * (sum_{k in b} (2 E2M1(c_k) + 12) q_k - 12 sum_{k in b} q_k)
// where q = round(x / sa) per activation block of 32 (sa = max |x| / 127: llama.cpp's Q8_0), sw the weight's
// block scale (E8M0, or NVFP4's e4m3 with its global scale). Each int32 lane's accumulator starts at its share of
// -12 sum q (computed once per activation row), so the offset costs nothing per weight. The weights are exact; the
// error is the activations' rounding (at most sa / 2 per element), summed in int32 exactly within a lane.
//
// Activations are quantized once per call (`quantize_q8`) in chunks of one register of packed bytes (kQBytes =
// 4 x kNativeLanes bytes of codes, 2 kQBytes elements): the kQBytes even elements as int8, then the odd ones, then
// each int32 lane's offset and activation scale, so that the low nibbles of a register of codes meet the even
// elements and the high nibbles the odd ones; activation block m of a chunk is lanes 4m .. 4m+3 of both halves.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_rows.h"

namespace tj {

constexpr int kQElems = 2 * kQBytes;        // activation elements per chunk
constexpr int kQChunkBytes = 4 * kQBytes;   // one chunk of a quantized row: q even, q odd, offsets, scales
constexpr int kQBlock = 32;                 // activation elements per int8 scale
constexpr int kQOffset = 12;                // 2 x E2M1 + kQOffset >= 0
static_assert(kQBytes % 16 == 0, "activation blocks are whole lanes of both halves");

// Chunks of a row of K elements (the last one zero-padded), and the bytes of one quantized activation row.
inline int64_t q8_chunks(int64_t K) { return (K + kQElems - 1) / kQElems; }
inline int64_t q8_row_bytes(int64_t K) { return q8_chunks(K) * kQChunkBytes; }

// x [K] -> dst [q8_row_bytes(K)]: int8 per block of 32 (round to nearest even), zero past K. A non-finite block
// gets a NaN scale, so that the dots it enters are NaN as the float path's would be.
inline void quantize_q8(const float* x, int64_t K, uint8_t* dst) {
  const int64_t chunks = q8_chunks(K);
  std::memset(dst, 0, size_t(chunks * kQChunkBytes));
  for (int64_t c = 0; c < chunks; ++c) {
    uint8_t* chunk = dst + c * kQChunkBytes;
    int8_t* half[2] = {reinterpret_cast<int8_t*>(chunk), reinterpret_cast<int8_t*>(chunk + kQBytes)};
    int32_t offset[kNativeLanes] = {};
    float scale[kNativeLanes] = {};
    for (int m = 0; m < kQElems / kQBlock; ++m) {
      const int64_t e0 = c * kQElems + m * kQBlock;
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(kQBlock, K - e0)));
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < n; ++i) {
        const float a = std::fabs(x[e0 + i]);
        finite = finite && std::isfinite(a);
        amax = std::max(amax, a);
      }
      const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int i = 0; i < n; ++i) half[i & 1][16 * m + i / 2] = int8_t(std::nearbyint(x[e0 + i] * inv));
      for (int l = 4 * m; l < 4 * m + 4; ++l) {
        int32_t sum = 0;
        for (int i = 0; i < 4; ++i) sum += half[0][4 * l + i] + half[1][4 * l + i];
        offset[l] = -kQOffset * sum;
        scale[l] = finite ? 0.5f * (amax / 127.0f) : NAN;  // 0.5: the table holds 2 x E2M1
      }
    }
    std::memcpy(chunk + 2 * kQBytes, offset, sizeof(offset));
    std::memcpy(chunk + 3 * kQBytes, scale, sizeof(scale));
  }
}

// 2 x E2M1(c) + kQOffset for the 16 codes.
alignas(16) constexpr uint8_t kE2M1Q[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// One FP4 row times R quantized activation rows (xq, stride ldq bytes): sums[r]. LPB: int32 lanes per weight
// block (MXFP4: 16 bytes of codes, 4 lanes; NVFP4: 8 bytes, 2 lanes); row_scale: the row's block scales as
// floats, zero-padded to whole chunks.
template <int R, int LPB>
inline void fp4_q8_dots(const uint8_t* codes, int64_t K, const float* row_scale, const uint8_t* xq, int64_t ldq,
                        float* sums) {
  const int64_t bytes = K / 2, full = bytes / kQBytes;
  Native f[R];
  for (int r = 0; r < R; ++r) f[r] = Native{};
  auto step = [&](const uint8_t* p, int64_t c) TJ_INLINE_LAMBDA {
    const QNative b = load_q(p);
    const QNative lo = lookup16(kE2M1Q, b & 15), hi = lookup16(kE2M1Q, b >> 4);
    const Native sw = spread_blocks<LPB>(row_scale + c * (kNativeLanes / LPB));
    for (int r = 0; r < R; ++r) {
      const uint8_t* chunk = xq + r * ldq + c * kQChunkBytes;
      INative acc;
      std::memcpy(&acc, chunk + 2 * kQBytes, sizeof(acc));
      acc = dot4(dot4(acc, lo, load_q(chunk)), hi, load_q(chunk + kQBytes));
      f[r] += __builtin_convertvector(acc, Native) * (sw * load(reinterpret_cast<const float*>(chunk + 3 * kQBytes)));
    }
  };
  for (int64_t c = 0; c < full; ++c) {
    prefetch_stream(codes + c * kQBytes);
    step(codes + c * kQBytes, c);
  }
  if (full * kQBytes < bytes) {  // the last partial chunk: zero codes past the row (their activations are 0)
    alignas(64) uint8_t tail[kQBytes] = {};
    std::memcpy(tail, codes + full * kQBytes, size_t(bytes - full * kQBytes));
    step(tail, full);
  }
  for (int r = 0; r < R; ++r) sums[r] = reduce_add(f[r]);
}

// The block scales of row n as floats into dst (zero-padded to whole chunks plus a register): E8M0 2^(s-127), or
// NVFP4's as `scale_table` gives them.
inline void row_scales(const PackedWeight& w, const float* table, int64_t n, float* dst, int64_t padded) {
  const int64_t count = w.scales_per_row();
  const uint8_t* s = w.scale + n * count;
  if (is_nv(w.fmt)) {
    nv_decode_scales(s, count, w.global, w.fmt == kNvfp4Mul, table, dst);
  } else {
    int64_t i = 0;
    for (; i + kNativeLanes <= count; i += kNativeLanes) store(dst + i, e8m0(load_bytes(s + i)));
    for (; i < count; ++i) dst[i] = table[s[i]];
  }
  std::fill(dst + count, dst + padded, 0.0f);
}

// out[r, n - n0] = sum_k x[r, k] * w[n, k] for an FP4 weight and R <= kMaxRows rows quantized by quantize_q8
// (xq, row stride ldq bytes).
inline void fp4_q8_rows(const PackedWeight& w, const uint8_t* xq, int R, int64_t ldq, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
  float table[256];
  scale_table(w, table);
  const int64_t block = w.fmt == kMxfp4 ? 32 : 16;
  const int64_t padded = q8_chunks(w.K) * (kQElems / block) + kNativeLanes;
  std::vector<float> scales(static_cast<size_t>(padded));
  with_row_count(R, [&](auto rows) {
    constexpr int kR = decltype(rows)::value;
    for (int64_t n = n0; n < n1; ++n) {
      row_scales(w, table, n, scales.data(), padded);
      float sums[kR];
      const uint8_t* codes = w.data + n * (w.K / 2);
      if (w.fmt == kMxfp4)
        fp4_q8_dots<kR, 4>(codes, w.K, scales.data(), xq, ldq, sums);
      else
        fp4_q8_dots<kR, 2>(codes, w.K, scales.data(), xq, ldq, sums);
      for (int r = 0; r < kR; ++r) out[r * ldo + (n - n0)] = sums[r];
    }
  });
}

}  // namespace tj
