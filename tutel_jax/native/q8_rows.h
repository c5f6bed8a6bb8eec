// tutel-jax native CPU kernels: FP4 weight rows (MXFP4, NVFP4) times a few activation rows quantized to int8 per
// block of 32 elements, in integer dot products (the quantized-activation path of packed_rows.h).
//
// Each E2M1 code c becomes the byte 2 * E2M1(c) + 12, an integer in [0, 24] (one 16-byte table lookup), so that
// an unsigned x signed byte dot product of four pairs (`dot4`: AVX-512 VNNI / AVX-VNNI vpdpbusd, AVX2 vpmaddubsw,
// NEON sdot) multiplies it by the int8 activations q:
//   sum_k w[k] x[k] ~= sum_j sw_j * sh_j * sum_{k in j} (2 E2M1(c_k) + 12) q_k  +  sum_j sw_j * o_j
// over the weight's blocks j (32 elements for MXFP4, 16 for NVFP4), where q = round(x / sa) per activation block
// of 32 (sa = max |x| / 127: llama.cpp's Q8_0), sh_j = sa / 2 of the activation block holding weight block j,
// o_j = -12 sh_j sum_{k in j} q_k (the offset, per activation row), and sw_j the weight's block scale (E8M0, or
// NVFP4's e4m3 with its global scale). MXFP4 decodes its E8M0 scales in the dot loop, one register of them per
// four registers of codes (`mxfp4_q8_dots`); NVFP4 computes the products sw_j sh_j and the offset sum per weight
// row before its dots (`fp4_q8_dots`). Either way each register of codes costs two lookups, two dot products
// and one scaled accumulate per activation row, reading only the codes, the scales and the int8 activations.
// The weights are exact; the error is the activations' rounding (at most sa / 2 per element), summed in int32
// exactly within a lane and block.
//
// An activation row is quantized once per call (`quantize_q8`, for the weight's block size) into chunks of one
// register of packed bytes (kQBytes = 4 x kNativeLanes bytes of codes, 2 kQBytes elements): the kQBytes even
// elements as int8, then the odd ones, so that the low nibbles of a register of codes meet the even elements and
// the high nibbles the odd ones; weight block m of a chunk is lanes m * LPB .. (m + 1) * LPB - 1 of both halves.
// After the chunks: sh [q8_blocks] then o [q8_blocks] as floats, per weight block (zero past the row).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_rows.h"

namespace tj {

constexpr int kQElems = 2 * kQBytes;        // activation elements per chunk
constexpr int kQChunkBytes = 2 * kQBytes;   // one chunk of a quantized row: q even, q odd
constexpr int kQBlock = 32;                 // activation elements per int8 scale
constexpr int kQOffset = 12;                // 2 x E2M1 + kQOffset >= 0
static_assert(kQBytes % 16 == 0, "activation blocks are whole lanes of both halves");

// Chunks of a row of K elements (the last one zero-padded); the per-block floats of a quantized row for weight
// blocks of `block` elements (the chunks' blocks rounded up to whole registers, plus one register: the scaled
// accumulate reads a register from any chunk's first block); the bytes of one quantized activation row.
inline int64_t q8_chunks(int64_t K) { return (K + kQElems - 1) / kQElems; }
inline int64_t q8_blocks(int64_t K, int64_t block) {
  const int64_t used = q8_chunks(K) * (kQElems / block);
  return (used + kNativeLanes - 1) / kNativeLanes * kNativeLanes + kNativeLanes;
}
inline int64_t q8_row_bytes(int64_t K, int64_t block) {
  return q8_chunks(K) * kQChunkBytes + 2 * int64_t(sizeof(float)) * q8_blocks(K, block);
}

// x [K] -> dst [q8_row_bytes(K, block)]: int8 per activation block of 32 (round to nearest even), zero past K,
// and sh, o per weight block of `block` (32 or 16) elements. A non-finite activation block gets a NaN scale, so
// that the dots it enters are NaN as the float path's would be. Registers of 32 elements at a time.
inline void quantize_q8(const float* x, int64_t K, int64_t block, uint8_t* dst) {
  constexpr int kVecs = kQBlock / kNativeLanes;  // registers per activation block
  static_assert(kQBlock % kNativeLanes == 0, "whole registers per activation block");
  const int64_t chunks = q8_chunks(K), nb = q8_blocks(K, block);
  std::memset(dst, 0, size_t(q8_row_bytes(K, block)));
  float* sh = reinterpret_cast<float*>(dst + chunks * kQChunkBytes);
  float* off = sh + nb;
  const int per = int(kQBlock / block);  // weight blocks per activation block
  alignas(64) float v[kQBlock];
  for (int64_t c = 0; c < chunks; ++c) {
    int8_t* half[2] = {reinterpret_cast<int8_t*>(dst + c * kQChunkBytes),
                       reinterpret_cast<int8_t*>(dst + c * kQChunkBytes + kQBytes)};
    for (int m = 0; m < kQElems / kQBlock; ++m) {
      const int64_t e0 = c * kQElems + m * kQBlock;
      const int n = int(std::max<int64_t>(0, std::min<int64_t>(kQBlock, K - e0)));
      if (n == 0) continue;  // past the row: zeros
      std::fill(v + n, v + kQBlock, 0.0f);
      std::copy(x + e0, x + e0 + n, v);
      UNative bad{}, amax{};  // |x| as bits: ordered as the magnitudes are
      for (int i = 0; i < kVecs; ++i) {
        const UNative a = (UNative)load(v + i * kNativeLanes) & 0x7FFFFFFFu;
        bad |= (UNative)(a > splat_u(0x7F7FFFFFu));  // inf or NaN
        amax = select((UNative)(a > amax), a, amax);
      }
      for (int w = kNativeLanes / 2; w > 0; w /= 2)  // halving: lanes 0 .. w-1 take the larger of l and l + w
        for (int l = 0; l < w; ++l) {
          amax[l] = std::max(amax[l], amax[l + w]);
          bad[l] |= bad[l + w];
        }
      const float peak = bits_to_float(amax[0]);
      const bool finite = bad[0] == 0;
      const float inv = finite && peak > 0.0f ? 127.0f / peak : 0.0f;
      const float h = finite ? 0.5f * (peak / 127.0f) : NAN;  // 0.5: the table holds 2 x E2M1
      int8_t q[kQBlock];
      for (int i = 0; i < kVecs; ++i) {
        typedef int8_t QLanes __attribute__((vector_size(kNativeLanes)));
        const QLanes qi = __builtin_convertvector(round_even(load(v + i * kNativeLanes) * inv), QLanes);
        std::memcpy(q + i * kNativeLanes, &qi, sizeof(qi));
      }
      int32_t sums[2] = {0, 0};  // per 16 elements
      for (int j = 0; j < kQBlock / 2; ++j) {
        half[0][16 * m + j] = q[2 * j];
        half[1][16 * m + j] = q[2 * j + 1];
      }
      for (int i = 0; i < kQBlock; ++i) sums[i / 16] += q[i];
      for (int j = 0; j < per; ++j) {
        const int64_t b = e0 / block + j;
        sh[b] = h;
        off[b] = float(-kQOffset * (per == 1 ? sums[0] + sums[1] : sums[j])) * h;
      }
    }
  }
}

// 2 x E2M1(c) + kQOffset for the 16 codes.
alignas(16) constexpr uint8_t kE2M1Q[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// A register of FP4 codes at p as table bytes (kE2M1Q): its low nibbles' (the even elements) and its high
// nibbles' (the odd ones).
struct Fp4Bytes {
  QNative lo, hi;
};
TJ_INLINE Fp4Bytes fp4_bytes(const uint8_t* p) {
  const QNative b = load_q(p);
  return {lookup16(kE2M1Q, b & 15), lookup16(kE2M1Q, b >> 4)};
}

// Their int32 dot with one chunk of a quantized activation row (its even elements, then its odd ones), per lane.
TJ_INLINE Native fp4_chunk_dot(const Fp4Bytes& w, const uint8_t* chunk) {
  return __builtin_convertvector(dot4(dot4(INative{}, w.lo, load_q(chunk)), w.hi, load_q(chunk + kQBytes)), Native);
}

// The block scales are a second, thinner stream (K/32 or K/16 bytes a row): row n asks for row n + 8's.
inline void prefetch_scales_ahead(const PackedWeight& w, int64_t n) {
  const uint8_t* ahead = w.scale + std::min(n + 8, w.N - 1) * w.scales_per_row();
  __builtin_prefetch(ahead, 0, 3);
  __builtin_prefetch(ahead + 64, 0, 3);
}

// One NVFP4 row (`bytes` of codes) times R quantized activation rows (xq, stride ldq bytes): the scaled sums
// without the offset into sums[r]; prod: R arrays (stride nb) of sw_j * sh_j (a weight block of 16 codes is 8
// bytes: 2 int32 lanes). overread: whether a partial last chunk may be read past the row (the next row of the
// same weight: its activations are zero).
template <int R>
inline void fp4_q8_dots(const uint8_t* codes, int64_t bytes, bool overread, const float* prod, int64_t nb,
                        const uint8_t* xq, int64_t ldq, float* sums) {
  constexpr int kLanesPerBlock = 2;
  Native f[R];
  for (int r = 0; r < R; ++r) f[r] = Native{};
  auto step = [&](const uint8_t* p, int64_t c) TJ_INLINE_LAMBDA {
    const Fp4Bytes w = fp4_bytes(p);
    for (int r = 0; r < R; ++r)
      f[r] += fp4_chunk_dot(w, xq + r * ldq + c * kQChunkBytes) *
              spread_blocks<kLanesPerBlock>(prod + r * nb + c * (kNativeLanes / kLanesPerBlock));
  };
  const int64_t full = overread ? (bytes + kQBytes - 1) / kQBytes : bytes / kQBytes;
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

// MXFP4 blocks per register of codes (a block of 32 codes is 16 bytes: 4 int32 lanes of the dot products), and
// registers of codes per register of block scales (a group: kNativeLanes blocks).
constexpr int kMxfp4PerChunk = kNativeLanes / 4;
constexpr int kChunksPerGroup = 4;

// The last, partial group of an MXFP4 row where reading it whole would pass the weight's end: its codes, zero-
// padded to whole registers, then its scales, into dst [kChunksPerGroup * kQBytes + kNativeLanes].
__attribute__((noinline)) inline void copy_partial_group(const uint8_t* codes, int64_t bytes, const uint8_t* scales,
                                                         int64_t blocks, uint8_t* dst) {
  std::memset(dst, 0, size_t(kChunksPerGroup * kQBytes + kNativeLanes));
  std::memcpy(dst, codes, size_t(bytes));
  std::memcpy(dst + kChunksPerGroup * kQBytes, scales, size_t(blocks));
}

// One MXFP4 row (`bytes` of codes, its E8M0 scales) times R activation rows quantized by quantize_q8 for blocks
// of 32 (xq, stride ldq; sh and o after the chunks at float offset `off`): the whole dot, offset included, into
// sums[r]. The scales are decoded in the loop, a register of them per group of kChunksPerGroup registers of
// codes (sw * sh per block, spread over its lanes by one permute per chunk, `spread_lanes`; sum_j sw_j o_j in
// its own accumulator), so that a row needs no pass over its scales before its dots: with one activation row
// that pass cost a tenth of the row's time. rows_left: this row and the weight's rows after it (the last group
// is read whole where they hold it: their codes meet zero activations, their scales are masked off).
template <int R>
inline void mxfp4_q8_dots(const uint8_t* codes, const uint8_t* scales, int64_t bytes, int64_t rows_left,
                          const uint8_t* xq, int64_t ldq, int64_t off, float* sums) {
  constexpr int64_t kGroupBytes = kChunksPerGroup * kQBytes;
  const int64_t nb = q8_blocks(2 * bytes, 32), count = bytes / 16;  // o after sh; scales per row
  Native f[R], corr[R], prod[R];
  for (int r = 0; r < R; ++r) f[r] = corr[r] = Native{};
  auto step = [&](const uint8_t* p, int64_t c, auto k) TJ_INLINE_LAMBDA {
    const Fp4Bytes w = fp4_bytes(p);
    for (int r = 0; r < R; ++r)
      f[r] += fp4_chunk_dot(w, xq + r * ldq + c * kQChunkBytes) *
              spread_lanes<4, decltype(k)::value * kMxfp4PerChunk>(prod[r]);
  };
  // a group's scale codes: sw * sh per block for every activation row, and the offset sums
  auto scale_group = [&](UNative codes8, int64_t g) TJ_INLINE_LAMBDA {
    const Native sw = e8m0(codes8);
    for (int r = 0; r < R; ++r) {
      const float* sh = reinterpret_cast<const float*>(xq + r * ldq) + off + g * kNativeLanes;
      prod[r] = sw * load(sh);
      corr[r] += sw * load(sh + nb);
    }
  };
  using K0 = std::integral_constant<int, 0>;
  using K1 = std::integral_constant<int, 1>;
  using K2 = std::integral_constant<int, 2>;
  using K3 = std::integral_constant<int, 3>;
  static_assert(kChunksPerGroup == 4, "the unrolled group below");
  const int64_t groups = bytes / kGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = codes + g * kGroupBytes;
    const int64_t c = g * kChunksPerGroup;
    scale_group(load_bytes(scales + g * kNativeLanes), g);
    prefetch_stream(p);
    step(p, c, K0{});
    prefetch_stream(p + kQBytes);
    step(p + kQBytes, c + 1, K1{});
    prefetch_stream(p + 2 * kQBytes);
    step(p + 2 * kQBytes, c + 2, K2{});
    prefetch_stream(p + 3 * kQBytes);
    step(p + 3 * kQBytes, c + 3, K3{});
  }
  const int64_t rest = bytes - groups * kGroupBytes;
  if (rest > 0) {  // the last, partial group
    const int64_t chunks = (rest + kQBytes - 1) / kQBytes, blocks = rest / 16;
    const uint8_t* p = codes + groups * kGroupBytes;
    const uint8_t* s = scales + groups * kNativeLanes;
    alignas(64) uint8_t copy[kGroupBytes + kNativeLanes];
    if (groups * kGroupBytes + chunks * kQBytes > rows_left * bytes ||
        groups * kNativeLanes + kNativeLanes > rows_left * count) {  // past the weight's end: a zero-padded copy
      copy_partial_group(p, rest, s, blocks, copy);
      p = copy;
      s = copy + kGroupBytes;
    }
    UNative lane;
    for (int l = 0; l < kNativeLanes; ++l) lane[l] = uint32_t(l);
    // scale codes past the row as 0 (2^-127: finite, times their zero sh and o)
    scale_group(load_bytes(s) & (UNative)(lane < splat_u(uint32_t(blocks))), groups);
    const int64_t c = groups * kChunksPerGroup;
    step(p, c, K0{});
    if (chunks > 1) step(p + kQBytes, c + 1, K1{});
    if (chunks > 2) step(p + 2 * kQBytes, c + 2, K2{});
    if (chunks > 3) step(p + 3 * kQBytes, c + 3, K3{});
  }
  for (int r = 0; r < R; ++r) sums[r] = reduce_add(f[r] + corr[r]);
}

// out[r, n - n0] = sums[r] of dots(rows, n, xp, sums) for each weight row n in [n0, n1) and each register pass
// of activation rows (xp: its first row; `rows` a std::integral_constant: kMaxRows, the last pass fewer). More
// rows than a register pass (a prefill) go a pass at a time over the same weight rows, which the first pass
// leaves in cache (a work item's rows: 64 x K/2 bytes).
template <typename Dots>
inline void q8_register_passes(const PackedWeight& w, const uint8_t* xq, int R, int64_t ldq, int64_t n0, int64_t n1,
                               float* out, int64_t ldo, Dots dots) {
  for (int r0 = 0; r0 < R; r0 += kMaxRows) {
    const uint8_t* xp = xq + r0 * ldq;
    float* op = out + r0 * ldo;
    with_row_count(std::min(kMaxRows, R - r0), [&](auto rows) {
      constexpr int kR = decltype(rows)::value;
      for (int64_t n = n0; n < n1; ++n) {
        prefetch_scales_ahead(w, n);
        float sums[kR];
        dots(rows, n, xp, sums);
        for (int r = 0; r < kR; ++r) op[r * ldo + (n - n0)] = sums[r];
      }
    });
  }
}

// out[r, n - n0] = sum_k x[r, k] * w[n, k] for an FP4 weight and R rows quantized by quantize_q8 for its block
// size (xq, row stride ldq bytes). MXFP4: `mxfp4_q8_dots` (the scales decoded in the loop); NVFP4: its scales
// decoded per weight row, then `fp4_q8_dots`.
inline void fp4_q8_rows(const PackedWeight& w, const uint8_t* xq, int R, int64_t ldq, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
  const int64_t bytes = w.K / 2, count = w.scales_per_row();
  if (w.fmt == kMxfp4) {
    const int64_t off = q8_chunks(w.K) * kQChunkBytes / int64_t(sizeof(float));  // sh, o: floats after the chunks
    q8_register_passes(w, xq, R, ldq, n0, n1, out, ldo, [&](auto rows, int64_t n, const uint8_t* xp, float* sums) {
      mxfp4_q8_dots<decltype(rows)::value>(w.data + n * bytes, w.scale + n * count, bytes, w.N - n, xp, ldq, off,
                                           sums);
    });
    return;
  }
  float table[256];
  scale_table(w, table);
  const int64_t nb = q8_blocks(w.K, 16), used = nb - kNativeLanes;
  const int64_t off = q8_chunks(w.K) * kQChunkBytes;  // the floats after a quantized row's chunks
  // sw: zero past the row's blocks (the products there meet zero sh and o)
  std::vector<float> sw(static_cast<size_t>(nb), 0.0f), prod(static_cast<size_t>(kMaxRows * nb), 0.0f);
  q8_register_passes(w, xq, R, ldq, n0, n1, out, ldo, [&](auto rows, int64_t n, const uint8_t* xp, float* sums) {
    constexpr int kR = decltype(rows)::value;
    nv_decode_scales(w.scale + n * count, count, w.global, w.fmt == kNvfp4Mul, table, sw.data());
    float corr[kR];
    for (int r = 0; r < kR; ++r) {  // sw * sh per block, and the offset sum_j sw_j o_j
      const float* sh = reinterpret_cast<const float*>(xp + r * ldq + off);
      Native c{};
      for (int64_t j = 0; j < used; j += kNativeLanes) {
        const Native v = load(sw.data() + j);
        store(prod.data() + r * nb + j, v * load(sh + j));
        c += v * load(sh + nb + j);
      }
      corr[r] = reduce_add(c);
    }
    fp4_q8_dots<kR>(w.data + n * bytes, bytes, n + 1 < w.N, prod.data(), nb, xp, ldq, sums);
    for (int r = 0; r < kR; ++r) sums[r] += corr[r];
  });
}

}  // namespace tj
