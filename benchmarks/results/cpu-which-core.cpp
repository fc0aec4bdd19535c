// Which core this is, by what it does: the clock, from a chain of dependent scalar adds (one a cycle on any x86
// core), and how many 256-bit vpmaddubsw, vpmaddwd, vpaddw and vfmadd231ps a cycle one thread issues, from 8
// independent chains of each. A core with 256-bit units (Zen 2 and later, Intel's since Haswell) issues about two
// multiply-adds a cycle; a first-generation Zen, which splits a 256-bit operation into two 128-bit halves, at most
// one. Beside /proc/cpuinfo's family and model (benchmarks/RESULTS.md, "Which core the AVX2 machine is"). Where the
// CPU has AVX-512 BF16 and VNNI, also the cycles a 512-bit vdpbf16ps, vpdpbusd and vfmadd231ps take with 1 to 12
// independent chains: with one, the instruction's latency; with enough, its issue rate ("Int4 products in integers
// on AVX-512").
//
//     g++ -O2 -march=native benchmarks/results/cpu-which-core.cpp -o /tmp/which-core && /tmp/which-core
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <int C, typename W, typename T, typename Op>
double per_second(Op op, W w, T start) {  // operations a second, C chains of N each (C at most 12)
  T a0 = start, a1 = start, a2 = start, a3 = start, a4 = start, a5 = start, a6 = start, a7 = start, a8 = start,
    a9 = start, a10 = start, a11 = start;
  const long N = 50000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < N; i++) {
    a0 = op(w, a0);
    if (C > 1) a1 = op(w, a1);
    if (C > 2) a2 = op(w, a2), a3 = op(w, a3);
    if (C > 4) a4 = op(w, a4), a5 = op(w, a5), a6 = op(w, a6), a7 = op(w, a7);
    if (C > 8) a8 = op(w, a8), a9 = op(w, a9), a10 = op(w, a10), a11 = op(w, a11);
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                     "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile T keep = a0;
  (void)keep;
  return double(C) * N / s;
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
      {"vpmaddubsw ymm", per_second<8>([](__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }, wi, zi)},
      {"vpmaddwd ymm", per_second<8>([](__m256i w, __m256i a) { return _mm256_madd_epi16(w, a); }, wi, zi)},
      {"vpaddw ymm", per_second<8>([](__m256i w, __m256i a) { return _mm256_add_epi16(w, a); }, wi, zi)},
      {"vfmadd231ps ymm", per_second<8>([](__m256 w, __m256 a) { return _mm256_fmadd_ps(a, w, w); }, wf, one)},
  };
  for (const auto& r : rows) std::printf("%-16s %.2f G/s, %.2f a cycle\n", r.name, r.ops / 1e9, r.ops / hz);
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const __m512 one16 = _mm512_set1_ps(1.f);
  const __m512bh wb = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512i wb8 = _mm512_set1_epi8(1), z16 = _mm512_setzero_si512();
  const auto dp = [](__m512bh w, __m512 a) { return _mm512_dpbf16_ps(a, w, w); };
  const auto vn = [](__m512i w, __m512i a) { return _mm512_dpbusd_epi32(a, w, w); };
  const auto fm = [](__m512 w, __m512 a) { return _mm512_fmadd_ps(a, w, w); };
  const auto cycles = [&](double ops) { return hz / ops; };
  std::printf("512-bit, cycles an instruction by independent chains:  1     2     4     8    12\n");
  std::printf("vdpbf16ps zmm   %40.2f %5.2f %5.2f %5.2f %5.2f\n", cycles(per_second<1>(dp, wb, one16)),
              cycles(per_second<2>(dp, wb, one16)), cycles(per_second<4>(dp, wb, one16)),
              cycles(per_second<8>(dp, wb, one16)), cycles(per_second<12>(dp, wb, one16)));
  std::printf("vpdpbusd zmm    %40.2f %5.2f %5.2f %5.2f %5.2f\n", cycles(per_second<1>(vn, wb8, z16)),
              cycles(per_second<2>(vn, wb8, z16)), cycles(per_second<4>(vn, wb8, z16)),
              cycles(per_second<8>(vn, wb8, z16)), cycles(per_second<12>(vn, wb8, z16)));
  std::printf("vfmadd231ps zmm %40.2f %5.2f %5.2f %5.2f %5.2f\n", cycles(per_second<1>(fm, one16, one16)),
              cycles(per_second<2>(fm, one16, one16)), cycles(per_second<4>(fm, one16, one16)),
              cycles(per_second<8>(fm, one16, one16)), cycles(per_second<12>(fm, one16, one16)));
#endif
}
