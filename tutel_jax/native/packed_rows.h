// tutel-jax native CPU kernels: weight rows (FP8 block, MXFP4, NVFP4, float32 / bfloat16) times a few activation
// rows.
//
// A weight in rows is the checkpoint's [N, K] ([out, in]) tensor of one expert (or one dense layer):
//   FP8 block  e4m3 codes [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]      w = f32(code) * scale_inv
//   MXFP4      E2M1 nibbles [N, K/2] (low nibble = even element), E8M0 scales [N, K/32]  w = LUT[c] * 2^(s-127)
//   NVFP4      E2M1 nibbles [N, K/2], e4m3 scales [N, K/16], float32 global g          w = LUT[c] * (f32(s) / g)
//              (ModelOpt's multiplying global scale: w = LUT[c] * (f32(s) * g))
//   compact bf16 bfloat16 values in 12 bits, losslessly (tutel_jax/native/_compact_bf16.py): per group of 32
//              elements 48 bytes, 32 low bytes of the bfloat16 codes (the exponent's last bit and the mantissa),
//              then 16 bytes of 4-bit codes for the high bytes (byte j: element j in the low nibble, element
//              j + 16 in the high one); index [16 + N + 1] int32: each code's high byte << 24 (the float32 bits
//              of sign and exponent but its last bit), then each row's first patch; patches [P, 3] int32 (row,
//              column, float32 bits): the elements no code holds, zero in the groups. Activations are arranged
//              in the order in which byte unpacks within 128-bit lanes pair low and high bytes
//              (`compact_position`).
// `packed_rows` computes out[r, n] = sum_k x[r, k] * w[n, k] for n in [n0, n1). For a few activation rows
// (`kFloatRows` per register pass, up to `kFloatPassLimit`: the ISA's register budget, simd.h) each weight row is
// decoded in registers (the dequantized weight never exists in memory) and multiplied by a pass's rows at once;
// more rows decode a few weight rows into a buffer in cache and multiply it by register tiles. The dequantized
// values are bit-identical to the float32 reference dequantizers (pallas_kernels.quant); only the summation order
// differs.
//
// Written once over registers of the target (`Native`, simd.h): FP4 codes decode with the ISA's E2M1 table
// (`e2m1`), FP8 with integer bit moves; activations are laid out once per call (`arrange`, the same layout for
// every register width) so that the nibbles of each 4-byte lane meet their elements without a shuffle.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tj {

// The weight formats, as the Python side numbers them (tutel_jax/native/_weights.py). Every weight is [N, K]
// rows ([out, in], as checkpoints store linear weights): float32 / bfloat16, or packed; kNvfp4Mul is NVFP4 whose
// global scale multiplies (ModelOpt's weight_scale_2); kInt8Channel / kFp8Channel are int8 / e4m3 codes with a
// float32 scale per row.
enum Format : int { kFloat32 = 0, kBFloat16 = 1, kFp8Block = 2, kMxfp4 = 3, kNvfp4 = 4, kNvfp4Mul = 5,
                    kCompactBf16 = 6, kInt8Channel = 7, kFp8Channel = 8 };

inline bool is_nv(int fmt) { return fmt == kNvfp4 || fmt == kNvfp4Mul; }
inline bool is_fp4(int fmt) { return fmt == kMxfp4 || is_nv(fmt); }
inline bool is_packed(int fmt) { return fmt == kFp8Block || is_fp4(fmt); }

// Elements per block scale of an FP4 format (MXFP4 32, NVFP4 16).
inline int64_t fp4_block(int fmt) { return fmt == kMxfp4 ? 32 : 16; }

constexpr int kChunk = 32;      // elements per decoded chunk (kChunkVectors registers)
constexpr int kFp8Tile = 128;   // FP8 scale block (both axes)
constexpr int kCompactGroup = 48;  // bytes per 32 elements of a compact bfloat16 row

// Where the generic float32 path decodes compact bfloat16 rows with byte table lookups and unpacks (AVX2, and
// AVX-512 without the BF16 dot products, whose own path takes bfloat16 rows: `bf16_rows.h`).
#if defined(TJ_ISA_AVX2) || (defined(TJ_ISA_AVX512) && !defined(__AVX512BF16__))
#define TJ_COMPACT_UNPACKS 1
#endif

// A compact bfloat16 row's arranged position of element k, and the element at arranged position q, within each
// group of 32: with TJ_COMPACT_UNPACKS (byte unpacks, then word unpacks to float32) runs of 4 as elements 0-3,
// 16-19, 4-7, 20-23, 8-11, 24-27, 12-15, 28-31; in every other build (byte unpacks to bfloat16, or the generic
// decode) runs 8-15 and 16-23 swapped.
TJ_INLINE int64_t compact_position(int64_t k) {
#if defined(TJ_COMPACT_UNPACKS)
  return (k & ~int64_t(31)) | ((k & 12) << 1) | ((k >> 2) & 4) | (k & 3);
#else
  return k ^ ((((k >> 3) ^ (k >> 4)) & 1) * 24);
#endif
}
TJ_INLINE int64_t compact_element(int64_t q) {
#if defined(TJ_COMPACT_UNPACKS)
  return (q & ~int64_t(31)) | ((q & 4) << 2) | ((q >> 1) & 12) | (q & 3);
#else
  return compact_position(q);  // an involution
#endif
}

// e4m3fn -> float32 with no subnormal float32 on the way (a denormals-are-zero thread would read one as 0).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7F;
  if (mag == 0x7F) return NAN;
  const float v = (mag >> 3) == 0 ? float(mag) * 0x1p-9f : bits_to_float((mag << 20) + (120u << 23));
  return (b & 0x80) ? -v : v;
}

inline float e8m0_to_float(uint8_t s) { return s == 0 ? bits_to_float(0x00400000u) : bits_to_float(uint32_t(s) << 23); }

// e8m0_to_float of each lane's code (the low 8 bits, the rest zero).
TJ_INLINE Native e8m0(UNative e) { return (Native)select((UNative)(e == splat_u(0)), splat_u(0x00400000u), e << 23); }

// One packed [N, K] weight (pointers at its first row).
struct PackedWeight {
  int fmt = kFp8Block;
  int64_t N = 0, K = 0;
  const uint8_t* data = nullptr;   // codes: [N, K] (FP8, int8, FP8 per channel) or [N, K/2] (FP4)
  const uint8_t* scale = nullptr;  // [N, K/32] E8M0, [N, K/16] e4m3, float32 [ceil(N/128), ceil(K/128)] (FP8)
                                   // or float32 [N] (int8, FP8 per channel) (compact bf16: its index)
  float global = 1.0f;             // NVFP4's global scale
  const int32_t* patches = nullptr;  // compact bf16: [P, 3]

  int64_t scales_per_row() const { return K / fp4_block(fmt); }

  // compact bf16: the float32 bits (high byte << 24) of the 16 codes, and row n's patches [first, last)
  const uint32_t* high_bytes() const { return reinterpret_cast<const uint32_t*>(scale); }
  const int32_t* patch_index() const { return reinterpret_cast<const int32_t*>(scale) + 16; }
};

// sums[r] += w[n, k] * x_r[k] for the patches (n, k) of a compact bfloat16 row: the elements its codes do not
// hold (`x_at(r, p)`: the activation at arranged position p).
template <int R, typename XAt>
TJ_INLINE void add_patches(const PackedWeight& w, int64_t n, XAt&& x_at, float* sums) {
  const int32_t* index = w.patch_index();
  for (int32_t p = index[n]; p < index[n + 1]; ++p) {
    const float v = bits_to_float(uint32_t(w.patches[3 * p + 2]));
    const int64_t at = compact_position(w.patches[3 * p + 1]);
    for (int r = 0; r < R; ++r) sums[r] += v * x_at(r, at);
  }
}

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
  if (w.fmt == kFloat32) return reinterpret_cast<const float*>(w.data)[n * w.K + k];
  if (w.fmt == kBFloat16) return bf16_to_float(reinterpret_cast<const uint16_t*>(w.data)[n * w.K + k]);
  if (w.fmt == kFp8Block) {
    const float* s = reinterpret_cast<const float*>(w.scale);
    const int64_t cols = (w.K + kFp8Tile - 1) / kFp8Tile;
    return e4m3_to_float(w.data[n * w.K + k]) * s[(n / kFp8Tile) * cols + k / kFp8Tile];
  }
  if (w.fmt == kInt8Channel) return float(int8_t(w.data[n * w.K + k])) * reinterpret_cast<const float*>(w.scale)[n];
  if (w.fmt == kFp8Channel) return e4m3_to_float(w.data[n * w.K + k]) * reinterpret_cast<const float*>(w.scale)[n];
  const uint8_t byte = w.data[n * (w.K / 2) + k / 2];
  const int code = (k & 1) ? byte >> 4 : byte & 15;
  const int64_t block = fp4_block(w.fmt);
  return kE2M1[code] * table[w.scale[n * w.scales_per_row() + k / block]];
}

constexpr int kWide = 128;  // FP4 elements per wide chunk (one 64-byte load)

// Activations laid out for `fmt` (FP8 and float rows: x as it is; compact bfloat16: `compact_position`). FP4
// rows are read in wide chunks of 128 elements: 16 lanes of 4 bytes, nibble j of lane l being element 8l + j, so
// x's wide chunk is laid out as xa[16j + l] = x[8l + j]. The rest (K % 128) goes in chunks of 32 as [16 even, 16
// odd elements], and what remains after those (K % 32) keeps its order. x [K] -> xa [K].
inline void arrange(int fmt, const float* x, int64_t K, float* xa) {
  if (fmt == kCompactBf16) {  // K a multiple of 32
    for (int64_t k = 0; k < K; k += 4) std::memcpy(xa + compact_position(k), x + k, sizeof(float) * 4);
    return;
  }
  if (!is_fp4(fmt)) {
    std::memcpy(xa, x, sizeof(float) * K);
    return;
  }
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
}

constexpr int kChunkVectors = kChunk / kNativeLanes;  // registers per 32-element chunk
constexpr int kGroups = 16 / kNativeLanes;             // registers per 16 lanes of 4 bytes (a wide FP4 chunk)
static_assert(kNativeLanes <= 16 && 16 % kNativeLanes == 0, "a wide chunk is whole registers");

// Chunk c (elements 32c .. 32c+31) of an FP4 row as kChunkVectors registers in the arranged order: the 16 even
// elements, then the 16 odd ones.
struct Fp4Chunks {
  const uint8_t* codes;   // row's bytes
  const uint8_t* scales;  // row's scale codes
  const float* table;
  bool nv;

  TJ_INLINE void get(int64_t c, Native* w) const {
    for (int g = 0; g < kGroups; ++g) {
      const UNative b = load_bytes(codes + 16 * c + g * kNativeLanes);
      Native s;
      if (nv) {  // bytes 0-7: elements 32c .. 32c+15 (block 2c), bytes 8-15: block 2c+1
        for (int l = 0; l < kNativeLanes; ++l) s[l] = table[scales[2 * c + (g * kNativeLanes + l) / 8]];
      } else {
        s = splat(table[scales[c]]);
      }
      w[g] = e2m1(b) * s;
      w[kGroups + g] = e2m1(b >> 4) * s;
    }
  }
};

struct Fp8Chunks {
  const uint8_t* codes;  // row's codes
  const float* scales;   // row block's scale_inv row
  TJ_INLINE void get(int64_t c, Native* w) const {
    prefetch_stream(codes + c * kChunk);
    const Native s = splat(scales[(c * kChunk) / kFp8Tile] * 0x1p8f);  // codes decode times 2^-8
    for (int v = 0; v < kChunkVectors; ++v) w[v] = e4m3_bytes_2m8(codes + c * kChunk + v * kNativeLanes) * s;
  }
};

// Chunk c of an int8 or e4m3 row with one scale: its codes times the row's scale (the products the reference's
// dequantized values are; e4m3 codes decode times 2^-8, which the scale takes back).
struct ChannelChunks {
  const uint8_t* codes;  // row's codes
  float scale;
  bool e4m3;
  TJ_INLINE void get(int64_t c, Native* w) const {
    prefetch_stream(codes + c * kChunk);
    const uint8_t* p = codes + c * kChunk;
    if (e4m3) {
      const Native s = splat(scale * 0x1p8f);
      for (int v = 0; v < kChunkVectors; ++v) w[v] = e4m3_bytes_2m8(p + v * kNativeLanes) * s;
      return;
    }
    const Native s = splat(scale);
    for (int v = 0; v < kChunkVectors; ++v) w[v] = int8_values(p + v * kNativeLanes) * s;
  }
};

#if defined(TJ_ISA_AVX2) || defined(TJ_ISA_AVX512)
// The 16 codes' high bytes in both 128-bit lanes (the `vpshufb` table).
inline __m256i compact_table(const uint32_t* high) {
  uint8_t bytes[16];
  for (int c = 0; c < 16; ++c) bytes[c] = uint8_t(high[c] >> 24);
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
}

// A group of a compact bfloat16 row as 32 bfloat16 codes in two registers of 16 (elements 0-7 | 16-23 and 8-15 |
// 24-31, by 128-bit lane): the code nibbles as bytes (low nibbles in the low lane, high ones in the high lane) look
// up their high bytes (`vpshufb`), and byte unpacks pair them with the low bytes, all within 128-bit lanes.
TJ_INLINE void compact_group_words(const uint8_t* g, __m256i table, __m256i words[2]) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 32)));
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(15));
  const __m256i high = _mm256_shuffle_epi8(table, codes);
  words[0] = _mm256_unpacklo_epi8(low, high);
  words[1] = _mm256_unpackhi_epi8(low, high);
}
#endif

// Chunk c of a compact bfloat16 row in the arranged order (its patches aside: zero here), as float32: each
// element's bfloat16 code << 16. x86: `compact_group_words`, widened (AVX-512 BF16 builds: in their bfloat16
// order; TJ_COMPACT_UNPACKS: by word unpacks); else a register of up to 8 lanes holds one run of 8 elements, its
// low bytes << 16 or-ed with its codes' float32 high bits.
struct CompactChunks {
  const uint8_t* groups;  // the row's
  const uint32_t* high;   // the codes' float32 bits
#if defined(TJ_ISA_AVX2) || defined(TJ_ISA_AVX512)
  __m256i table;
  CompactChunks(const uint8_t* g, const uint32_t* h) : groups(g), high(h), table(compact_table(h)) {}
#else
  CompactChunks(const uint8_t* g, const uint32_t* h) : groups(g), high(h) {}
#endif
  TJ_INLINE void get(int64_t c, Native* w) const {
    const uint8_t* g = groups + kCompactGroup * c;
    prefetch_stream(g);
#if defined(TJ_ISA_AVX2) || defined(TJ_ISA_AVX512)
    __m256i words[2];
    compact_group_words(g, table, words);
#if defined(TJ_COMPACT_UNPACKS)
    const __m256i zero = _mm256_setzero_si256();
    __m256i f[4];  // 8 float32 bit patterns each, in the arranged order
    for (int h = 0; h < 2; ++h) {
      f[2 * h] = _mm256_unpacklo_epi16(zero, words[h]);
      f[2 * h + 1] = _mm256_unpackhi_epi16(zero, words[h]);
    }
#if defined(TJ_ISA_AVX512)
    for (int v = 0; v < 2; ++v)
      w[v] = (Native)_mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(f[2 * v]), f[2 * v + 1], 1));
#else
    for (int v = 0; v < 4; ++v) w[v] = (Native)_mm256_castsi256_ps(f[v]);
#endif
#else  // AVX-512 BF16: the bfloat16 path's order
    for (int v = 0; v < 2; ++v)
      w[v] = (Native)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words[v]), 16));
#endif
#else
    for (int v = 0; v < kChunkVectors; ++v) {
      const int e0 = int(compact_element(v * kNativeLanes));
      const UNative low = load_bytes(g + e0);
      UNative code = load_bytes(g + 32 + (e0 & 15));
      if (e0 >= 16) code = code >> 4;
      w[v] = (Native)((low << 16) | lookup16(code, high));
    }
#endif
  }
};

struct FloatRowChunks {
  const float* f32;    // or
  const uint16_t* bf16;
  TJ_INLINE void get(int64_t c, Native* w) const {
    if (f32) {
      prefetch_stream(f32 + c * kChunk);
      prefetch_stream(f32 + c * kChunk + 16);
      for (int v = 0; v < kChunkVectors; ++v) w[v] = load(f32 + c * kChunk + v * kNativeLanes);
      return;
    }
    prefetch_stream(bf16 + c * kChunk);
    for (int v = 0; v < kChunkVectors; ++v) w[v] = load(bf16 + c * kChunk + v * kNativeLanes);
  }
};

// NVFP4 scale codes [count] -> out [count] floats equal to the scale table's (e4m3 decoded exactly, NaN for the
// NaN codes, then divided, or with `mul` multiplied, by the global scale as `scale_table` does): a register of
// codes at a time instead of a table lookup each.
inline void nv_decode_scales(const uint8_t* codes, int64_t count, float global, bool mul, const float* table,
                             float* out) {
  const Native g = splat(global);
  int64_t i = 0;
  for (; i + kNativeLanes <= count; i += kNativeLanes) {
    const UNative b = load_bytes(codes + i);
    const UNative nan = (UNative)((b & 0x7Fu) == splat_u(0x7F));
    const Native v = (Native)select(nan, (UNative)splat(NAN), (UNative)e4m3(b));
    store(out + i, mul ? v * g : v / g);
  }
  for (; i < count; ++i) out[i] = table[codes[i]];
}

// The E8M0 scales of register g of a wide MXFP4 chunk whose 4 scale codes are `four`: lane l of the chunk holds
// elements 8l .. 8l+7, in block l/4 (`shift` [g]: 8 * block for each lane of register g).
TJ_INLINE Native mx_wide_scale(uint32_t four, UNative shift) {
  return e8m0((splat_u(four) >> shift) & 255u);
}

struct MxShifts {
  UNative shift[kGroups];
  MxShifts() {
    for (int g = 0; g < kGroups; ++g)
      for (int l = 0; l < kNativeLanes; ++l) shift[g][l] = 8 * ((g * kNativeLanes + l) / 4);
  }
};

// Wide chunks whose NVFP4 scales are decoded at a time (on the stack: 8 floats each).
constexpr int64_t kNvScaleChunks = 64;

// One FP4 row (codes [K/2], scale codes) read by wide chunks: `start(c)` once per chunk, then each register g's
// codes (`codes_of`) and scales (`scale_of`); the 32-element chunks after them (`narrow`).
struct Fp4Row {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* table;
  bool nv, global_mul;
  float global;
  int64_t wide, narrow_count;  // wide chunks in the row, then 32-element chunks
  MxShifts mx;
  uint32_t four = 0;  // MXFP4: the chunk's 4 scale codes
  float nv_scales[8 * kNvScaleChunks + kNativeLanes];  // + a register: spread_blocks reads whole registers

  Fp4Row(const PackedWeight& w, const float* table_, int64_t n)
      : codes(w.data + n * (w.K / 2)), scales(w.scale + n * w.scales_per_row()), table(table_), nv(is_nv(w.fmt)),
        global_mul(w.fmt == kNvfp4Mul), global(w.global), wide(w.K / kWide),
        narrow_count(w.K % kWide / kChunk) {}

  TJ_INLINE void start(int64_t c) {
    if (nv && c % kNvScaleChunks == 0)
      nv_decode_scales(scales + 8 * c, 8 * std::min(kNvScaleChunks, wide - c), global, global_mul, table, nv_scales);
    if (!nv) std::memcpy(&four, scales + 4 * c, 4);
  }
  TJ_INLINE UNative codes_of(int64_t c, int g) const { return load_words(codes + 64 * c + 4 * kNativeLanes * g); }
  TJ_INLINE Native scale_of(int64_t c, int g) const {
    return nv ? spread_blocks<2>(nv_scales + 8 * (c % kNvScaleChunks) + g * kNativeLanes / 2)
              : mx_wide_scale(four, mx.shift[g]);
  }
  Fp4Chunks narrow() const {
    const int64_t base = wide * kWide;
    return Fp4Chunks{codes + base / 2, scales + base / (nv ? 16 : 32), table, nv};
  }
};

// fn(chunks) with the chunk reader of row n of an FP8, per-channel (int8, FP8) or float-rows weight.
template <typename Fn>
TJ_INLINE void with_row_chunks(const PackedWeight& w, int64_t n, Fn&& fn) {
  const int64_t K = w.K;
  if (w.fmt == kFp8Block) {
    const int64_t cols = (K + kFp8Tile - 1) / kFp8Tile;
    fn(Fp8Chunks{w.data + n * K, reinterpret_cast<const float*>(w.scale) + (n / kFp8Tile) * cols});
  } else if (w.fmt == kInt8Channel || w.fmt == kFp8Channel) {
    fn(ChannelChunks{w.data + n * K, reinterpret_cast<const float*>(w.scale)[n], w.fmt == kFp8Channel});
  } else if (w.fmt == kCompactBf16) {
    fn(CompactChunks{w.data + n * (K / kChunk) * kCompactGroup, w.high_bytes()});
  } else if (w.fmt == kFloat32) {
    fn(FloatRowChunks{reinterpret_cast<const float*>(w.data) + n * K, nullptr});
  } else {
    fn(FloatRowChunks{nullptr, reinterpret_cast<const uint16_t*>(w.data) + n * K});
  }
}

// Partial sums per activation row in a float32 register pass of R rows: up to one per register of a chunk
// (independent multiply-add chains: one chain would wait on its latency), within the ISA's budget (more would
// spill).
template <int R>
constexpr int partials_per_row() {
  return std::clamp(kBudget.float_partials / R, 1, kChunkVectors);
}

// out[r] += dot of the 32-element chunks [0, count) with xa[r * ldx] for R rows: each chunk decoded once, its
// registers spread over `partials_per_row` partial sums per row.
template <int R, typename Chunks>
TJ_INLINE void add_chunk_dots(const Chunks& chunks, int64_t count, const float* xa, int64_t ldx, Native* acc) {
  constexpr int P = partials_per_row<R>();
  Native part[R][P];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) part[r][v] = Native{};
  for (int64_t c = 0; c < count; ++c) {
    Native w[kChunkVectors];
    chunks.get(c, w);
    const float* xc = xa + c * kChunk;
    for (int v = 0; v < kChunkVectors; ++v)
      for (int r = 0; r < R; ++r) part[r][v % P] += load(xc + r * ldx + v * kNativeLanes) * w[v];
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) acc[r] += part[r][v];
}

// One FP4 row times R arranged rows: wide chunks first (8 table decodes per register of codes, one scale
// register applied to its partial sums), then 32-element chunks; the rest is the caller's.
template <int R>
inline void fp4_dot_row(Fp4Row& row, const float* xa, int64_t ldx, Native* acc) {
  for (int64_t c = 0; c < row.wide; ++c) {
    row.start(c);
    // a few lines ahead (into the next rows): memory and arithmetic overlap instead of taking turns
    prefetch_stream(row.codes + 64 * c);
    const float* xc = xa + c * kWide;
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      const UNative v = row.codes_of(c, g);
      const float* xg = xc + g * kNativeLanes;
      Native part[R];
      {
        const Native w = e2m1(v);
        for (int r = 0; r < R; ++r) part[r] = load(xg + r * ldx) * w;
      }
#pragma GCC unroll 7
      for (int j = 1; j < 8; ++j) {
        const Native w = e2m1(v >> (4 * j));
        for (int r = 0; r < R; ++r) part[r] += load(xg + r * ldx + 16 * j) * w;
      }
      const Native s = row.scale_of(c, g);
      for (int r = 0; r < R; ++r) acc[r] += part[r] * s;
    }
  }
  add_chunk_dots<R>(row.narrow(), row.narrow_count, xa + row.wide * kWide, ldx, acc);
}

// Row n's dot with R (<= kFloatRows; FP4: <= kMaxRows) arranged activation rows, the K tail (K % 32) included.
template <int R>
inline void packed_row_dots(const PackedWeight& w, const float* table, int64_t n, const float* x, int64_t ldx,
                            float* sums) {
  const int64_t K = w.K, full = K / kChunk;
  Native acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Native{};
  if (is_fp4(w.fmt)) {
    Fp4Row row(w, table, n);
    fp4_dot_row<R>(row, x, ldx, acc);
  } else {
    with_row_chunks(w, n, [&](const auto& chunks) { add_chunk_dots<R>(chunks, full, x, ldx, acc); });
  }
  for (int r = 0; r < R; ++r) sums[r] = reduce_add(acc[r]);
  if (w.fmt == kCompactBf16) add_patches<R>(w, n, [&](int r, int64_t k) { return x[r * ldx + k]; }, sums);
  for (int64_t k = full * kChunk; k < K; ++k) {
    const float v = decode_one(w, table, n, k);
    for (int r = 0; r < R; ++r) sums[r] += v * x[r * ldx + k];
  }
}

// Row n of w decoded to float32 in the arranged order (dst [K]: dst[k] pairs with xa[k]).
inline void decode_row(const PackedWeight& w, const float* table, int64_t n, float* dst) {
  const int64_t K = w.K;
  int64_t done = 0;
  auto store_chunks = [&](const auto& ch, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {
      Native v[kChunkVectors];
      ch.get(c, v);
      for (int i = 0; i < kChunkVectors; ++i) store(dst + done + c * kChunk + i * kNativeLanes, v[i]);
    }
    done += count * kChunk;
  };
  if (is_fp4(w.fmt)) {
    Fp4Row row(w, table, n);
    for (int64_t c = 0; c < row.wide; ++c) {
      row.start(c);
      for (int g = 0; g < kGroups; ++g) {
        const UNative v = row.codes_of(c, g);
        const Native s = row.scale_of(c, g);
        for (int j = 0; j < 8; ++j) store(dst + c * kWide + 16 * j + g * kNativeLanes, e2m1(v >> (4 * j)) * s);
      }
    }
    done = row.wide * kWide;
    store_chunks(row.narrow(), row.narrow_count);
  } else {
    with_row_chunks(w, n, [&](const auto& chunks) { store_chunks(chunks, K / kChunk); });
  }
  for (int64_t k = done; k < K; ++k) dst[k] = decode_one(w, table, n, k);
  if (w.fmt == kCompactBf16)
    for (int32_t p = w.patch_index()[n]; p < w.patch_index()[n + 1]; ++p)
      dst[compact_position(w.patches[3 * p + 1])] = bits_to_float(uint32_t(w.patches[3 * p + 2]));
}

// out[i, j] = dot(x[i], wd[j]) for RX x rows and RW decoded weight rows, accumulated in registers.
template <int RX, int RW>
inline void dot_tile(const float* x, int64_t ldx, const float* wd, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  Native acc[RX][RW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) acc[i][j] = Native{};
  const int64_t vec = K / kNativeLanes * kNativeLanes;
  for (int64_t k = 0; k < vec; k += kNativeLanes) {
    Native wv[RW];
    for (int j = 0; j < RW; ++j) wv[j] = load<Native>(wd + j * ldw + k);
    for (int i = 0; i < RX; ++i) {
      const Native xv = load<Native>(x + i * ldx + k);
      for (int j = 0; j < RW; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) {
      float s = reduce_add(acc[i][j]);
      for (int64_t k = vec; k < K; ++k) s += x[i * ldx + k] * wd[j * ldw + k];
      out[i * ldo + j] = s;
    }
}

// dot_tile over all `rows` activation rows: kTileX at a time, then the remainder (fewer than kTileX <= 4).
template <int RW>
inline void dot_tiles_x(const float* x, int64_t ldx, int rows, const float* wd, int64_t ldw, int64_t K, float* out,
                        int64_t ldo) {
  static_assert(kTileX <= 4, "the remainder below covers up to 3 rows");
  int i = 0;
  for (; i + kTileX <= rows; i += kTileX) dot_tile<kTileX, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
  switch (rows - i) {
    case 3: return dot_tile<3, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    case 2: return dot_tile<2, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    case 1: return dot_tile<1, RW>(x + i * ldx, ldx, wd, ldw, K, out + i * ldo, ldo);
    default: return;
  }
}

constexpr int kDecodedRows = 8;  // weight rows decoded at once for many activation rows

// The many-rows form: weight rows decoded kDecodedRows at a time into a float buffer (L2), then register tiles
// of kTileX activation rows x kTileW weight rows: each weight decoded once per call whatever the number of rows.
inline void decoded_rows(const PackedWeight& w, const float* table, const float* xa, int R, int64_t ldx,
                         int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t K = w.K;
  std::vector<float> wd(kDecodedRows * K);
  for (int64_t b0 = n0; b0 < n1; b0 += kDecodedRows) {
    const int nw = int(std::min<int64_t>(kDecodedRows, n1 - b0));
    for (int j = 0; j < nw; ++j) decode_row(w, table, b0 + j, wd.data() + j * K);
    float* o = out + (b0 - n0);
    int j = 0;
    for (; j + kTileW <= nw; j += kTileW) dot_tiles_x<kTileW>(xa, ldx, R, wd.data() + j * K, K, K, o + j, ldo);
    for (; j < nw; ++j) dot_tiles_x<1>(xa, ldx, R, wd.data() + j * K, K, K, o + j, ldo);
  }
}

// fn(std::integral_constant<int, R>{}) for 1 <= R <= Max: a register pass's row count as a constant.
template <int Max = kMaxRows, typename Fn>
inline void with_row_count(int R, Fn&& fn) {
  static_assert(Max == 4 || Max == 8, "the cases below");
  switch (R) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    default: break;
  }
  if constexpr (Max == 8) {
    switch (R) {
      case 5: return fn(std::integral_constant<int, 5>{});
      case 6: return fn(std::integral_constant<int, 6>{});
      case 7: return fn(std::integral_constant<int, 7>{});
      default: return fn(std::integral_constant<int, 8>{});
    }
  }
}

// out[r, n - n0] = sum_k xa[r, k] * w[n, k] for r < R, n in [n0, n1). xa: `arrange`d rows (stride ldx);
// out: row stride ldo. Register passes of up to kFloatRows rows (FP4: kMaxRows; a pass reads the weight rows
// again, from cache) for up to kFloatPassLimit rows (FP4: kMaxRows); more rows: decoded tiles.
inline void packed_rows(const PackedWeight& w, const float* xa, int R, int64_t ldx, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
  float table[256];
  const bool fp4 = is_fp4(w.fmt);  // its row loop keeps a scaled sum per row beside the partials
  if (fp4) scale_table(w, table);
  const int pass = fp4 ? kMaxRows : kFloatRows;
  if (R > (fp4 ? kMaxRows : kFloatPassLimit)) return decoded_rows(w, table, xa, R, ldx, n0, n1, out, ldo);
  for (int r0 = 0; r0 < R; r0 += pass) {
    const float* x = xa + r0 * ldx;
    float* o = out + r0 * ldo;
    with_row_count<kFloatRows>(std::min(pass, R - r0), [&](auto rows) {
      constexpr int kR = decltype(rows)::value;
      for (int64_t n = n0; n < n1; ++n) {
        float sums[kR];
        packed_row_dots<kR>(w, table, n, x, ldx, sums);
        for (int r = 0; r < kR; ++r) o[r * ldo + (n - n0)] = sums[r];
      }
    });
  }
}

}  // namespace tj
