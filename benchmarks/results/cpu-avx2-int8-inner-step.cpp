// Built and run as: for r in 1 2 4 8; do g++ -O3 -march=native -DROWS=$r cpu-avx2-int8-inner-step.cpp -o /tmp/i8_$r && /tmp/i8_$r; done
// (output: cpu-avx2-int8-inner-step.txt)
// Hot-cache throughput of the inner step of an int8 product of R rows on AVX2: 16 outputs x 2 inputs (32 levels,
// output i's two at 2i, 2i+1) a unit. fp32: levels to fp32 once, then per row 4 FMAs (as cpu_linear.cpp's
// PairTiles<int8_t> does); int16: levels widened to int16 once, then per row 2 vpmaddwd + 2 adds (x as int16 pairs).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
constexpr int R = ROWS;
constexpr int UNITS = 2048;  // 64 KB of levels: L2
float fp32_form(const int8_t* w, const float* x, int reps) {
  __m256 acc[4][R][2];
  for (auto& a : acc) for (auto& b : a) b[0] = b[1] = _mm256_setzero_ps();
  for (int rep = 0; rep < reps; rep++)
    for (int u = 0; u < UNITS; u += 4)
      for (int t = 0; t < 4; t++) {
        const int8_t* p = w + (u + t) * 32;
        __m256 first[2], second[2];
        for (int h = 0; h < 2; h++) {
          const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
          first[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(wide, 16), 16));
          second[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(wide, 16));
        }
        for (int r = 0; r < R; r++) {
          const __m256 x0 = _mm256_set1_ps(x[r * 2 * UNITS + 2 * u]), x1 = _mm256_set1_ps(x[r * 2 * UNITS + 2 * u + 1]);
          for (int h = 0; h < 2; h++) acc[t][r][h] = _mm256_fmadd_ps(second[h], x1, _mm256_fmadd_ps(first[h], x0, acc[t][r][h]));
        }
      }
  float s = 0; for (auto& a : acc) for (auto& b : a) s += _mm256_cvtss_f32(_mm256_add_ps(b[0], b[1]));
  return s;
}
float int16_form(const int8_t* w, const int32_t* x, int reps) {
  __m256i acc[4][R][2];
  for (auto& a : acc) for (auto& b : a) b[0] = b[1] = _mm256_setzero_si256();
  for (int rep = 0; rep < reps; rep++)
    for (int u = 0; u < UNITS; u += 4)
      for (int t = 0; t < 4; t++) {
        const int8_t* p = w + (u + t) * 32;
        __m256i wide[2];
        for (int h = 0; h < 2; h++) wide[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        for (int r = 0; r < R; r++) {
          const __m256i xp = _mm256_set1_epi32(x[r * UNITS + u]);  // a pair of int16 inputs
          for (int h = 0; h < 2; h++) acc[t][r][h] = _mm256_add_epi32(acc[t][r][h], _mm256_madd_epi16(wide[h], xp));
        }
      }
  int s = 0; for (auto& a : acc) for (auto& b : a) s += _mm256_extract_epi32(_mm256_add_epi32(b[0], b[1]), 0);
  return float(s);
}
int main() {
  std::vector<int8_t> w(UNITS * 32, 3);
  std::vector<float> xf(R * 2 * UNITS, 0.5f);
  std::vector<int32_t> xi(R * UNITS, 0x00010002);
  const int reps = 2000;
  for (int round = 0; round < 5; round++) {
    auto t0 = std::chrono::steady_clock::now();
    volatile float a = fp32_form(w.data(), xf.data(), reps);
    auto t1 = std::chrono::steady_clock::now();
    volatile float b = int16_form(w.data(), xi.data(), reps);
    auto t2 = std::chrono::steady_clock::now();
    double f = std::chrono::duration<double>(t1 - t0).count(), i = std::chrono::duration<double>(t2 - t1).count();
    printf("R=%d fp32 %.2f ns/unit, int16 %.2f ns/unit, fp32/int16 %.2fx\n", R, f / (reps * double(UNITS)) * 1e9,
           i / (reps * double(UNITS)) * 1e9, f / i);
    (void)a; (void)b;
  }
}
