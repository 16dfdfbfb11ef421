// VPDPBUSD's throughput on this CPU: 12 independent chains of the instruction per thread, nothing else, so the
// figure is the ceiling the 4-bit op's rows are measured against (docs/benchmarks.md). Needs AVX-512 VNNI.
//   g++ -O2 -march=native tools/vnni_peak.cpp -o build/vnni_peak -lpthread && build/vnni_peak 1 && build/vnni_peak 2
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

constexpr int CHAINS = 12;  // more than the instruction's latency x its issue rate: the ports never wait
constexpr long STEPS = 200000000 / CHAINS;

int chains() {
  __m512i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (long n = 0; n < STEPS; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a));  // keeps the loop from being folded away
  }
  int sum = 0;
  for (int i = 0; i < CHAINS; ++i) sum += _mm512_reduce_add_epi32(acc[i]);
  return sum;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  std::vector<int> sums(threads);
  for (int t = 0; t < threads; ++t) pool.emplace_back([&sums, t] { sums[t] = chains(); });
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double instructions = double(threads) * STEPS * CHAINS;
  std::printf("%d thread(s): %.1f G multiply-adds a second (%.2f G VPDPBUSD a second; checksum %d)\n", threads,
              instructions * 64 / seconds / 1e9, instructions / seconds / 1e9, sums[0]);
}
