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
// On AVX2 an MXFP4 call of kLaneRows or more rows takes the block-lane form instead (`q8_block_lanes`,
// `mxfp4_q8_lane_dots`): groups of eight weight blocks transposed in registers, a block per int32 lane.

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
// The block-lane form of an MXFP4 call's activation rows (AVX2, kLaneRows or more rows: `q8_block_lanes`): a
// group of four registers of codes (eight weight blocks of 32) is transposed in registers so that int32 lane l
// of every dot holds block kLaneBlock[l]: the group's four dots then add up in integers and take their scales
// with one conversion and one multiply-add per activation row, where the chunk form converts, permutes and
// scales every register. A row: per group of 256 elements four chunks of (even elements, odd elements) as
// int8, lane l's four bytes from block kLaneBlock[l] (chunk i: elements 8i .. 8i + 7 of the block); then sh
// [8 x groups] and o [8 x groups] in lane order.
#if defined(TJ_ISA_AVX2)
constexpr bool kQ8Lanes = true;
#else
constexpr bool kQ8Lanes = false;  // (AVX-512 and NEON keep the chunk form: a register holds whole blocks there
                                  // with a dot instruction, or one block)
#endif
constexpr int kLaneRows = 4;                                  // the fewest rows that take the block-lane form
constexpr int kLaneGroupElems = 256, kLaneGroupBytes = 128;  // elements, and MXFP4 code bytes, per group
constexpr int kLaneBlock[8] = {0, 2, 4, 6, 1, 3, 5, 7};      // the block of a group in each int32 lane
inline int64_t q8_lane_groups(int64_t K) { return (K + kLaneGroupElems - 1) / kLaneGroupElems; }
inline bool q8_block_lanes(int fmt, int64_t rows) { return kQ8Lanes && fmt == kMxfp4 && rows >= kLaneRows; }

// The bytes of one quantized activation row, in either form the weight format's rows may take.
inline int64_t q8_row_bytes(int64_t K, int64_t block) {
  const int64_t chunked = q8_chunks(K) * kQChunkBytes + 2 * int64_t(sizeof(float)) * q8_blocks(K, block);
  if (!kQ8Lanes || block != 32) return chunked;
  return std::max(chunked, q8_lane_groups(K) * (kLaneGroupElems + 2 * 8 * int64_t(sizeof(float))));
}

// One activation block of 32 elements quantized: q = round(x / sa) (to nearest even), sa = max |x| / 127, h =
// sa / 2 (NaN where the block is not finite) and the sums of q per 16 elements. v: 32 floats (zero past the row).
struct QBlock {
  int8_t q[kQBlock];
  float h;
  int32_t sums[2];
};
inline QBlock quantize_block(const float* v) {
  constexpr int kVecs = kQBlock / kNativeLanes;  // registers per activation block
  static_assert(kQBlock % kNativeLanes == 0, "whole registers per activation block");
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
  QBlock b;
  b.h = finite ? 0.5f * (peak / 127.0f) : NAN;  // 0.5: the table holds 2 x E2M1
  for (int i = 0; i < kVecs; ++i) {
    typedef int8_t QLanes __attribute__((vector_size(kNativeLanes)));
    const QLanes qi = __builtin_convertvector(round_even(load(v + i * kNativeLanes) * inv), QLanes);
    std::memcpy(b.q + i * kNativeLanes, &qi, sizeof(qi));
  }
  b.sums[0] = b.sums[1] = 0;
  for (int i = 0; i < kQBlock; ++i) b.sums[i / 16] += b.q[i];
  return b;
}

// x [K] -> dst [q8_row_bytes(K, block)]: int8 per activation block of 32, zero past K, and sh, o per weight
// block of `block` (32 or 16) elements; in the block-lane form when `lanes` (MXFP4 only). A non-finite
// activation block gets a NaN scale, so that the dots it enters are NaN as the float path's would be.
inline void quantize_q8(const float* x, int64_t K, int64_t block, bool lanes, uint8_t* dst) {
  std::memset(dst, 0, size_t(q8_row_bytes(K, block)));
  alignas(64) float v[kQBlock];
  auto block_at = [&](int64_t e0) {  // the activation block from element e0 (zero-padded)
    const int n = int(std::min<int64_t>(kQBlock, K - e0));
    std::fill(v + n, v + kQBlock, 0.0f);
    std::copy(x + e0, x + e0 + n, v);
    return quantize_block(v);
  };
  if (lanes) {
    const int64_t groups = q8_lane_groups(K);
    float* sh = reinterpret_cast<float*>(dst + groups * kLaneGroupElems);
    float* off = sh + 8 * groups;
    for (int64_t j = 0; j * kQBlock < K; ++j) {
      const QBlock b = block_at(j * kQBlock);
      const int64_t g = j / 8, slot = j % 8, lane = slot % 2 == 0 ? slot / 2 : 4 + slot / 2;  // kLaneBlock^-1
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) {
          uint8_t* chunk = dst + g * kLaneGroupElems + i * 64 + lane * 4 + t;
          chunk[0] = uint8_t(b.q[8 * i + 2 * t]);
          chunk[32] = uint8_t(b.q[8 * i + 2 * t + 1]);
        }
      sh[8 * g + lane] = b.h;
      off[8 * g + lane] = float(-kQOffset * (b.sums[0] + b.sums[1])) * b.h;
    }
    return;
  }
  const int64_t chunks = q8_chunks(K), nb = q8_blocks(K, block);
  float* sh = reinterpret_cast<float*>(dst + chunks * kQChunkBytes);
  float* off = sh + nb;
  const int per = int(kQBlock / block);  // weight blocks per activation block
  for (int64_t c = 0; c < chunks; ++c) {
    int8_t* half[2] = {reinterpret_cast<int8_t*>(dst + c * kQChunkBytes),
                       reinterpret_cast<int8_t*>(dst + c * kQChunkBytes + kQBytes)};
    for (int m = 0; m < kQElems / kQBlock; ++m) {
      const int64_t e0 = c * kQElems + m * kQBlock;
      if (e0 >= K) continue;  // past the row: zeros
      const QBlock b = block_at(e0);
      for (int j = 0; j < kQBlock / 2; ++j) {
        half[0][16 * m + j] = b.q[2 * j];
        half[1][16 * m + j] = b.q[2 * j + 1];
      }
      for (int j = 0; j < per; ++j) {
        const int64_t wb = e0 / block + j;
        sh[wb] = b.h;
        off[wb] = float(-kQOffset * (per == 1 ? b.sums[0] + b.sums[1] : b.sums[j])) * b.h;
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
#if defined(TJ_ISA_AVX2) && !defined(__AVXVNNI__)
  // no dot instruction: the two halves' byte-pair products summed as 16-bit lanes before the one widening
  // (table bytes <= 24: a lane stays within 2 x 2 x 24 x 127), three multiplies instead of four
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16((__m256i)w.lo, (__m256i)load_q(chunk)),
                                         _mm256_maddubs_epi16((__m256i)w.hi, (__m256i)load_q(chunk + kQBytes)));
  return __builtin_convertvector((INative)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), Native);
#else
  return __builtin_convertvector(dot4(dot4(INative{}, w.lo, load_q(chunk)), w.hi, load_q(chunk + kQBytes)), Native);
#endif
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

// A row's last, partial group: its codes at p (`rest` bytes; `read` bytes are read from there) and its `blocks`
// scale codes at s (a register of them is read). Read in place where the weight holds what is read (`codes_left`,
// `scales_left`: its bytes from p and s on; the codes after the row's meet zero activations), else from a zero-
// padded copy in `copy` [kChunksPerGroup * kQBytes + kNativeLanes]. The codes, and the scale codes with those past
// the row as 0 (2^-127: finite, times their zero sh and o).
struct PartialGroup {
  const uint8_t* codes;
  UNative scale_codes;
};
inline PartialGroup partial_group(const uint8_t* p, int64_t rest, const uint8_t* s, int64_t blocks, int64_t read,
                                  int64_t codes_left, int64_t scales_left, uint8_t* copy) {
  if (read > codes_left || kNativeLanes > scales_left) {  // past the weight's end
    copy_partial_group(p, rest, s, blocks, copy);
    p = copy;
    s = copy + kChunksPerGroup * kQBytes;
  }
  UNative lane;
  for (int l = 0; l < kNativeLanes; ++l) lane[l] = uint32_t(l);
  return {p, load_bytes(s) & (UNative)(lane < splat_u(uint32_t(blocks)))};
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
    const int64_t chunks = (rest + kQBytes - 1) / kQBytes;
    alignas(64) uint8_t copy[kGroupBytes + kNativeLanes];
    const PartialGroup part =
        partial_group(codes + groups * kGroupBytes, rest, scales + groups * kNativeLanes, rest / 16,
                      chunks * kQBytes, rows_left * bytes - groups * kGroupBytes,
                      rows_left * count - groups * kNativeLanes, copy);
    const uint8_t* p = part.codes;
    scale_group(part.scale_codes, groups);
    const int64_t c = groups * kChunksPerGroup;
    step(p, c, K0{});
    if (chunks > 1) step(p + kQBytes, c + 1, K1{});
    if (chunks > 2) step(p + 2 * kQBytes, c + 2, K2{});
    if (chunks > 3) step(p + 3 * kQBytes, c + 3, K3{});
  }
  for (int r = 0; r < R; ++r) sums[r] = reduce_add(f[r] + corr[r]);
}

#if defined(TJ_ISA_AVX2)
static_assert(kLaneGroupBytes == kChunksPerGroup * kQBytes, "a partial group's copy: copy_partial_group");
// One MXFP4 row (`bytes` of codes, its E8M0 scales) times R activation rows quantized in the block-lane form (xq,
// stride ldq; `groups` groups a row): the whole dot, offset included, into sums[r]. Per group: the four
// registers of codes transposed (64-bit then 32-bit interleaves: lane l of each holds four bytes of block
// kLaneBlock[l]), table bytes by lookup, and per activation row the 16-bit sums of four byte-pair products (at
// most 4 x 2 x 24 x 127) widened once per pair of registers. A partial last group is read whole where the
// weight's next rows hold it (rows_left: this row and those after it), else from a zero-padded copy
// (`partial_group`).
template <int R>
inline void mxfp4_q8_lane_dots(const uint8_t* codes, const uint8_t* scales, int64_t bytes, int64_t rows_left,
                               const uint8_t* xq, int64_t ldq, int64_t groups, float* sums) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Q)));
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(kLaneBlock[0], kLaneBlock[1], kLaneBlock[2], kLaneBlock[3],
                                          kLaneBlock[4], kLaneBlock[5], kLaneBlock[6], kLaneBlock[7]);
  __m256 f[R], corr[R];
  for (int r = 0; r < R; ++r) f[r] = corr[r] = _mm256_setzero_ps();
  auto group = [&](const uint8_t* p, UNative scale_codes, int64_t g) TJ_INLINE_LAMBDA {
    auto at = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i)); };
    auto words = [](__m256i a, __m256i b, int imm) {
      return imm == 0 ? _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88))
                      : _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0xDD));
    };
    const __m256i u0 = _mm256_unpacklo_epi64(at(0), at(1)), u1 = _mm256_unpackhi_epi64(at(0), at(1));
    const __m256i u2 = _mm256_unpacklo_epi64(at(2), at(3)), u3 = _mm256_unpackhi_epi64(at(2), at(3));
    const __m256i w[4] = {words(u0, u2, 0), words(u0, u2, 1), words(u1, u3, 0), words(u1, u3, 1)};
    const __m256 sw = _mm256_permutevar8x32_ps((__m256)e8m0(scale_codes), order);
    __m256i acc[R];
    for (int h = 0; h < 2; ++h) {
      auto lo = [&](__m256i c) { return _mm256_shuffle_epi8(table, _mm256_and_si256(c, low)); };
      auto hi = [&](__m256i c) { return _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(c, 4), low)); };
      const __m256i la = lo(w[2 * h]), ha = hi(w[2 * h]), lb = lo(w[2 * h + 1]), hb = hi(w[2 * h + 1]);
      for (int r = 0; r < R; ++r) {
        const uint8_t* q = xq + r * ldq + g * kLaneGroupElems + h * 128;
        auto qv = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i)); };
        const __m256i pairs = _mm256_add_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(la, qv(0)), _mm256_maddubs_epi16(ha, qv(1))),
            _mm256_add_epi16(_mm256_maddubs_epi16(lb, qv(2)), _mm256_maddubs_epi16(hb, qv(3))));
        const __m256i wide = _mm256_madd_epi16(pairs, ones);
        acc[r] = h == 0 ? wide : _mm256_add_epi32(acc[r], wide);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* sh = reinterpret_cast<const float*>(xq + r * ldq + groups * kLaneGroupElems) + 8 * g;
      corr[r] = _mm256_fmadd_ps(sw, _mm256_loadu_ps(sh + 8 * groups), corr[r]);
      f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(sw, _mm256_loadu_ps(sh)), f[r]);
    }
  };
  const int64_t full = bytes / kLaneGroupBytes;
  for (int64_t g = 0; g < full; ++g) {
    const uint8_t* p = codes + g * kLaneGroupBytes;
    prefetch_stream(p);
    prefetch_stream(p + 64);
    group(p, load_bytes(scales + 8 * g), g);
  }
  if (const int64_t rest = bytes - full * kLaneGroupBytes; rest > 0) {
    alignas(64) uint8_t copy[kLaneGroupBytes + kNativeLanes];
    const PartialGroup part = partial_group(codes + full * kLaneGroupBytes, rest, scales + 8 * full, rest / 16,
                                            kLaneGroupBytes, rows_left * bytes - full * kLaneGroupBytes,
                                            rows_left * (bytes / 16) - 8 * full, copy);
    group(part.codes, part.scale_codes, full);
  }
  for (int r = 0; r < R; ++r) sums[r] = reduce_add((Native)_mm256_add_ps(f[r], corr[r]));
}
#endif

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
// size, in the block-lane form where q8_block_lanes(w.fmt, R) (xq, row stride ldq bytes). MXFP4: that form's
// `mxfp4_q8_lane_dots`, else `mxfp4_q8_dots` (the scales decoded in the loop); NVFP4: its scales decoded per
// weight row, then `fp4_q8_dots`.
inline void fp4_q8_rows(const PackedWeight& w, const uint8_t* xq, int R, int64_t ldq, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
  const int64_t bytes = w.K / 2, count = w.scales_per_row();
#if defined(TJ_ISA_AVX2)
  if (q8_block_lanes(w.fmt, R)) {
    const int64_t groups = q8_lane_groups(w.K);
    q8_register_passes(w, xq, R, ldq, n0, n1, out, ldo, [&](auto rows, int64_t n, const uint8_t* xp, float* sums) {
      mxfp4_q8_lane_dots<decltype(rows)::value>(w.data + n * bytes, w.scale + n * count, bytes, w.N - n, xp, ldq,
                                                groups, sums);
    });
    return;
  }
#endif
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
