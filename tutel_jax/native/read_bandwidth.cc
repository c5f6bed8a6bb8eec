// A multi-threaded streaming read of a buffer: the memory roofline a bandwidth-bound CPU kernel can reach.
//
//   tutel_read_seconds(buf, bytes, threads, reps, &or_of_all_words) -> best seconds of `reps` full reads
//
// Each of `threads` threads reads one contiguous slice, OR-ing its 64-byte lines into four independent vector
// accumulators (no stores, no arithmetic dependency on memory latency), with the kernels' software prefetch of a
// weight stream (`prefetch_stream`, simd.h: a read at its best, not one the kernels could outrun); the OR of every
// 8-byte word comes back through `or_out`, so a caller can check that every byte was read (and the compiler
// cannot drop the loads).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "simd.h"

namespace {

uint64_t or_words(const uint8_t* p, size_t n) {
  size_t i = 0;
  uint64_t tail = 0;
  // 64-byte vectors (one AVX-512 register, two AVX2 or four NEON registers: whatever the target has)
  typedef uint64_t U64x8 __attribute__((vector_size(64)));
  U64x8 a0{}, a1{}, a2{}, a3{};
  for (; i + 256 <= n; i += 256) {
    for (int j = 0; j < 4; ++j) tj::prefetch_stream(p + i + 64 * j);
    U64x8 v[4];
    std::memcpy(v, p + i, sizeof(v));
    a0 |= v[0];
    a1 |= v[1];
    a2 |= v[2];
    a3 |= v[3];
  }
  const U64x8 a = (a0 | a1) | (a2 | a3);
  for (int l = 0; l < 8; ++l) tail |= a[l];
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    tail |= w;
  }
  return tail;  // bytes past the last whole word: the caller passes a multiple of 8
}

}  // namespace

extern "C" double tutel_read_seconds(const uint8_t* buf, size_t bytes, int threads, int reps, uint64_t* or_out) {
  threads = std::max(threads, 1);
  const size_t slice = (bytes / threads + 63) / 64 * 64;
  double best = 1e300;
  uint64_t all = 0;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    std::vector<uint64_t> part(threads, 0);
    std::vector<std::thread> pool;
    auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) {
      size_t lo = std::min(bytes, t * slice), hi = std::min(bytes, lo + slice);
      pool.emplace_back([&part, t, buf, lo, hi] { part[t] = or_words(buf + lo, hi - lo); });
    }
    for (auto& th : pool) th.join();
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds);
    for (uint64_t v : part) all |= v;
  }
  *or_out = all;
  return best;
}
