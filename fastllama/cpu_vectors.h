// The vector operations that cpu_attention.cpp and cpu_linear.cpp are written in, for two kinds of CPU, so that
// each kernel's logic is written once. With AVX-512 a Vec of 16 fp32 numbers is one register; with AVX2 (and FMA,
// F16C) it is two registers of 8, every operation done on both halves: twice the instructions for the same
// arithmetic, in the same order, so the same sums.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace {

inline __m128i load8bytes(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
inline __m128i load16bytes(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

#if defined(__AVX512F__)
using Vec = __m512;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float a) { return _mm512_set1_ps(a); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline float sum(Vec a) { return _mm512_reduce_add_ps(a); }
// a's first n lanes, zeros after them
inline Vec first_lanes(Vec a, int64_t n) {
  return _mm512_maskz_mov_ps(n >= 16 ? 0xffff : n > 0 ? (1u << n) - 1 : 0, a);
}

// 16 numbers as fp32
inline Vec load16(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load16(const at::BFloat16* p) {  // a bf16 number is the top half of an fp32 one
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec load16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16bytes(p))); }

// A dot product's running sums, whose lanes are added at its end (sums4): a Vec here
using Sum = __m512;
inline Sum fmadd_sum(Vec a, Vec b, Sum s) { return _mm512_fmadd_ps(a, b, s); }
inline Sum to_sum(Vec a) { return a; }

// the sums of each of a0 .. a3's lanes: pairs of vectors interleaved and added, so that the lanes are added to
// each other once for all four (a horizontal sum apiece costs about three times the instructions)
inline __m128 sums4(Sum a0, Sum a1, Sum a2, Sum a3) {
  const __m512d t01 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
  const __m512d t23 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
  // each 128-bit lane now holds its part of the four sums, in order
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t01, t23)), _mm512_castpd_ps(_mm512_unpackhi_pd(t01, t23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// exp(x) for x <= 0: 2^n times a polynomial over the rest (within 2 ulp); 0 below -87 (and for -inf, a masked
// score)
inline Vec exp16(Vec x) {
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  Vec p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), p, n);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline float sum(Vec a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline Vec first_lanes(Vec a, int64_t n) {
  const __m256i count = _mm256_set1_epi32(int(n < 0 ? 0 : n > 16 ? 16 : n)), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lane))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8)))))};
}

inline Vec load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec load16(const at::BFloat16* p) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16bytes(p)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16bytes(p + 8)), 16))};
}
inline Vec load16(const at::Half* p) { return {_mm256_cvtph_ps(load16bytes(p)), _mm256_cvtph_ps(load16bytes(p + 8))}; }
inline Vec load16(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8bytes(p))), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8bytes(p + 8)))};
}

// A dot product's running sums: one register, into which both halves of each product are added, so that three
// rows' sums of four keys take 12 of AVX2's 16 registers (two a sum would spill them)
using Sum = __m256;
inline Sum fmadd_sum(Vec a, Vec b, Sum s) { return _mm256_fmadd_ps(a.hi, b.hi, _mm256_fmadd_ps(a.lo, b.lo, s)); }
// ... or kept as a Vec, two chains of multiply-adds where one would wait on each one's latency, and made a Sum at
// the end: for a pass of few sums
inline Vec fmadd_sum(Vec a, Vec b, Vec s) { return fmadd(a, b, s); }
inline Sum to_sum(Vec a) { return _mm256_add_ps(a.lo, a.hi); }
inline Sum to_sum(Sum a) { return a; }

inline __m128 sums4(Sum a0, Sum a1, Sum a2, Sum a3) {
  // pairs added across vectors: in each 128-bit half, a0 .. a3's parts in order
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline __m256 exp8(__m256 x) {  // exp16's, 8 lanes; 2^n put into the exponent's bits (n >= -126 where x >= -87)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_and_ps(_mm256_castsi256_ps(scaled), _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}
inline Vec exp16(Vec x) { return {exp8(x.lo), exp8(x.hi)}; }
#else
#error "the CPU kernels need AVX-512, or AVX2 with FMA and F16C (-march=native on a CPU that has them)"
#endif

}  // namespace
