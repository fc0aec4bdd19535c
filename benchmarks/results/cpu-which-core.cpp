// Which core this is, by what it does: the clock, from a chain of dependent scalar adds (one a cycle on any x86
// core), and how many 256-bit vpmaddubsw, vpmaddwd, vpaddw and vfmadd231ps a cycle one thread issues, from 8
// independent chains of each. A core with 256-bit units (Zen 2 and later, Intel's since Haswell) issues about two
// multiply-adds a cycle; a first-generation Zen, which splits a 256-bit operation into two 128-bit halves, at most
// one. Beside /proc/cpuinfo's family and model (benchmarks/RESULTS.md, "Which core the AVX2 machine is").
//
//     g++ -O2 -march=native benchmarks/results/cpu-which-core.cpp -o /tmp/which-core && /tmp/which-core
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <typename T, typename Op>
double per_second(Op op, T w, T start) {  // operations a second, 8 chains of N each
  T a0 = start, a1 = start, a2 = start, a3 = start, a4 = start, a5 = start, a6 = start, a7 = start;
  const long N = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < N; i++) {
    a0 = op(w, a0), a1 = op(w, a1), a2 = op(w, a2), a3 = op(w, a3);
    a4 = op(w, a4), a5 = op(w, a5), a6 = op(w, a6), a7 = op(w, a7);
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile T keep = a0;
  (void)keep;
  return 8 * N / s;
}

double clock_hz() {  // 4 dependent adds an iteration: 4 cycles
  const long N = 1000000000;
  long x = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < N; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4 * N / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  const __m256i wi = _mm256_set1_epi8(3), zi = _mm256_setzero_si256();
  const __m256 wf = _mm256_set1_ps(1.0000001f), one = _mm256_set1_ps(1.f);
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (dependent scalar adds)\n", hz / 1e9);
  const struct {
    const char* name;
    double ops;
  } rows[] = {
      {"vpmaddubsw ymm", per_second([](__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }, wi, zi)},
      {"vpmaddwd ymm", per_second([](__m256i w, __m256i a) { return _mm256_madd_epi16(w, a); }, wi, zi)},
      {"vpaddw ymm", per_second([](__m256i w, __m256i a) { return _mm256_add_epi16(w, a); }, wi, zi)},
      {"vfmadd231ps ymm", per_second([](__m256 w, __m256 a) { return _mm256_fmadd_ps(a, w, w); }, wf, one)},
  };
  for (const auto& r : rows) std::printf("%-16s %.2f G/s, %.2f a cycle\n", r.name, r.ops / 1e9, r.ops / hz);
}
