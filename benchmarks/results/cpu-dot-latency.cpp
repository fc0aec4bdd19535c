// Cycles a vdpbf16ps, a vpdpbusd and a vfmadd231ps (512-bit) take on one thread, with 1 to 12 independent chains of
// each: with one chain, the instruction's latency; with enough chains, its throughput. The clock from a chain of
// dependent scalar adds (cpu-which-core.cpp's). For the int4 products' sums (benchmarks/RESULTS.md, "Int4 products in
// integers on AVX-512"). Needs AVX-512 BF16 and VNNI.
//
//     g++ -O2 -march=native benchmarks/results/cpu-dot-latency.cpp -o /tmp/dot-latency && /tmp/dot-latency
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <int C, typename W, typename T, typename Op>
double cycles_per_op(Op op, W w, T start, double hz) {
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
  return s * hz / (double(N) * C);
}

double clock_hz() {  // 4 dependent adds an iteration: 4 cycles
  const long N = 500000000;
  long x = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < N; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4 * N / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (dependent scalar adds)\n", hz / 1e9);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512bh wb = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512i wi = _mm512_set1_epi8(1), zi = _mm512_setzero_si512();
  const auto dp = [](__m512bh w, __m512 a) { return _mm512_dpbf16_ps(a, w, w); };
  const auto vn = [](__m512i w, __m512i a) { return _mm512_dpbusd_epi32(a, w, w); };
  const auto fm = [](__m512 w, __m512 a) { return _mm512_fmadd_ps(a, w, w); };
  std::printf("cycles an instruction, by independent chains:   1     2     4     8    12\n");
  std::printf("vdpbf16ps zmm                                 %5.2f %5.2f %5.2f %5.2f %5.2f\n",
              cycles_per_op<1>(dp, wb, one, hz), cycles_per_op<2>(dp, wb, one, hz), cycles_per_op<4>(dp, wb, one, hz),
              cycles_per_op<8>(dp, wb, one, hz), cycles_per_op<12>(dp, wb, one, hz));
  std::printf("vpdpbusd zmm                                  %5.2f %5.2f %5.2f %5.2f %5.2f\n",
              cycles_per_op<1>(vn, wi, zi, hz), cycles_per_op<2>(vn, wi, zi, hz), cycles_per_op<4>(vn, wi, zi, hz),
              cycles_per_op<8>(vn, wi, zi, hz), cycles_per_op<12>(vn, wi, zi, hz));
  std::printf("vfmadd231ps zmm                               %5.2f %5.2f %5.2f %5.2f %5.2f\n",
              cycles_per_op<1>(fm, one, one, hz), cycles_per_op<2>(fm, one, one, hz), cycles_per_op<4>(fm, one, one, hz),
              cycles_per_op<8>(fm, one, one, hz), cycles_per_op<12>(fm, one, one, hz));
}
