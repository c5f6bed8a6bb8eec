// A multi-threaded streaming read of a buffer: the memory roofline a bandwidth-bound CPU kernel can reach.
//
//   tutel_read_seconds(buf, bytes, threads, reps, &or_of_all_words) -> best seconds of `reps` full reads
//
// Each of `threads` threads reads one contiguous slice, OR-ing its 64-byte lines into four independent vector
// accumulators (no stores, no arithmetic dependency on memory latency); the OR of every 8-byte word comes back
// through `or_out`, so a caller can check that every byte was read (and the compiler cannot drop the loads).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(TUTEL_JAX_PORTABLE)
#include <immintrin.h>
#endif

namespace {

uint64_t or_words(const uint8_t* p, size_t n) {
  size_t i = 0;
  uint64_t tail = 0;
#if defined(__AVX512F__) && !defined(TUTEL_JAX_PORTABLE)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_or_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_or_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_or_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_or_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  __m512i a = _mm512_or_si512(_mm512_or_si512(a0, a1), _mm512_or_si512(a2, a3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(reinterpret_cast<__m512i*>(lanes), a);
  for (uint64_t v : lanes) tail |= v;
#elif defined(__AVX2__) && !defined(TUTEL_JAX_PORTABLE)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_or_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_or_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_or_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_or_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  for (uint64_t v : lanes) tail |= v;
#else
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    a0 |= w[0]; a1 |= w[1]; a2 |= w[2]; a3 |= w[3];
  }
  tail = a0 | a1 | a2 | a3;
#endif
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
