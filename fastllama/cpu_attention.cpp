// Decode attention on CPUs with AVX-512 or AVX2, over the KV cache as it is stored (bf16, fp16, fp32, or int8/fp8 with
// a scale per token and head): softmax(q k^T * scale, where mask) v for the few query rows that share a
// key/value head. cpu_decode.py builds it at first use and calls it where compiled PyTorch reads the cache
// slower (benchmarks/RESULTS.md, "A decode attention kernel of our own"); the compiled form is its fallback.
//
// What the compiled form cannot do: keep a tile of rows x keys in registers, so that each key is converted
// once for all the rows of its group and dot products are summed across lanes four at a time (inductor
// reduces each key once per row, a horizontal sum apiece); apply an int8 cache's scales to finished dot
// products; skip the keys no row sees (past a row's length, outside a window) without reading them; and
// split one head's positions into chunks, each with its own running softmax, so that both threads share
// even a single key/value head. Where the CPU has AVX-512 VNNI, an int8 cache's products are integer ones
// (dots, weigh_pairs): converting each level to fp32 cost more than reading it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vectors.h"

namespace {

constexpr int64_t CHUNK = 1024;   // positions a task reads, at most (chunk_for)
constexpr int64_t SERIAL = 1024;  // positions of all heads below which one thread reads them all (attend)
constexpr int64_t SUMS = 256;     // positions an int32 sum of products takes, their weights rounded together
// query rows that one pass over a chunk's keys and values serves, and the 16-element blocks of a value that a pass
// of Rows rows over the values weighs: their sums fit the registers, 32 with AVX-512, 16 with AVX2 (ROWS x KEYS
// Sums; Rows x WIDTH Vecs, two registers each, at most 12)
#if defined(__AVX512F__)
constexpr int ROWS = 4;
template <int Rows>
constexpr int WIDTH = 4;
#else
constexpr int ROWS = 3;
template <int Rows>
constexpr int WIDTH = std::min(4, 6 / Rows);
#endif
constexpr int64_t AHEAD = 16;     // positions ahead of the one being read that are fetched (prefetch_row)
constexpr int KEYS = 4;           // keys whose dot products are computed, and summed across lanes, together
constexpr float INF = std::numeric_limits<float>::infinity();

// 16 elements of a cache row, as fp32: load16 (cpu_vectors.h), and for fp8 through a table of all 256 values
inline Vec load16(const c10::Float8_e4m3fn* p) {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; i++) t[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
#if defined(__AVX512F__)
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(load16bytes(p)), table.data(), 4);
#else
  return {_mm256_i32gather_ps(table.data(), _mm256_cvtepu8_epi32(load8bytes(p)), 4),
          _mm256_i32gather_ps(table.data(), _mm256_cvtepu8_epi32(load8bytes(p + 8)), 4)};
#endif
}

#ifdef __AVX512VNNI__
inline __m128i sums4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {  // cpu_vectors.h's sums4, in int32
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#endif

// x where the lanes' bits are set, -inf in the others (a key that a row does not see)
inline __m128 where_seen(unsigned bits, __m128 x) {
#if defined(__AVX512F__)
  return _mm_mask_blend_ps(__mmask8(bits), _mm_set1_ps(-INF), x);
#else
  const __m128i lane = _mm_setr_epi32(1, 2, 4, 8);
  const __m128i seen = _mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32(int(bits)), lane), lane);
  return _mm_blendv_ps(_mm_set1_ps(-INF), x, _mm_castsi128_ps(seen));
#endif
}

// bit i set where byte i of p's n (at most 64) is not 0
inline uint64_t nonzero_bytes(const uint8_t* p, int64_t n) {
#if defined(__AVX512F__)
  const __m512i bytes = _mm512_maskz_loadu_epi8(n == 64 ? ~0ull : (1ull << n) - 1, p);
  return _mm512_test_epi8_mask(bytes, bytes);
#else
  uint64_t bits = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    bits |= uint64_t(~uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())))) << i;
  }
  for (; i < n; i++) bits |= uint64_t(p[i] != 0) << i;
  return bits;
#endif
}

// the cache lines of the row `ahead` positions on, fetched while this one is worked on: the hardware's own
// prefetching falls behind a loop that computes this much a row. Into L1, or (T1) into L2 for a later pass.
template <decltype(_MM_HINT_T0) Hint = _MM_HINT_T0, typename Element>
inline void prefetch_row(const Element* row, int64_t hd) {
  for (int64_t byte = 0; byte < hd * int64_t(sizeof(Element)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + byte, Hint);
}

// An int8 or fp8 cache's scales for one row and head, read where they lie (the model's dtype, a stride a
// position): no fp32 copy of them a call
struct Scales {
  const void* p = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t stride = 0;

  explicit operator bool() const { return p != nullptr; }
  // positions s0 .. s0 + n - 1's scales times `times`, in fp32, once for a chunk (not a dtype's switch a key)
  void read(int64_t s0, int64_t n, float times, float* out) const {
    const auto each = [&](const auto* x) {
      int64_t i = 0;
      if (stride == 1)  // as a cache's scales lie: 16 at a time
        for (const Vec by = set1(times); i + 16 <= n; i += 16) store(out + i, mul(by, load16(x + s0 + i)));
      for (; i < n; i++) out[i] = times * float(x[(s0 + i) * stride]);
    };
    switch (dtype) {
      case at::kBFloat16: each(static_cast<const at::BFloat16*>(p)); break;
      case at::kHalf: each(static_cast<const at::Half*>(p)); break;
      default: each(static_cast<const float*>(p));
    }
  }
};

constexpr int64_t WORDS = CHUNK / 64;  // 64-bit words of a chunk's bits, at most

// What a task shares with the rest: which positions a step position sees, and its scores.
struct Chunk {
  int64_t T, s0, n;  // T step positions a row; n positions from s0
  const uint64_t* seen;  // (T + 1, WORDS): bit i of word i / 64 of step position t's: t sees position s0 + i;
                         // then any step position's
  const float* q;    // the rows (R, hd)
  int64_t hd;
  const int16_t* q16;    // ... rounded to int16 (R, hd16), for integer products (an int8 cache), or none
  const float* q_scale;  // (R): a row is its q16 times this
  int64_t hd16;          // hd rounded up to 32
  const float* key_factor;  // (CHUNK): the scores' scale times each key's own (an int8 or fp8 cache's)
  float* scores;     // (R, CHUNK)
  float* max;        // (R)

  // step position t's bits for positions i .. i + n - 1 (i a multiple of n, n < 64); t = T: any step position's
  unsigned sees(int64_t t, int64_t i, int n = KEYS) const { return (seen[t * WORDS + i / 64] >> (i % 64)) & ((1u << n) - 1); }
};

// Rows r0 .. r0 + Rows - 1's dot products with KEYS keys, in fp32: each row's four in one vector
template <int Rows, typename Element>
inline void dots(const Chunk& c, int64_t r0, const Element* const* key, __m128* dot) {
  using Acc = std::conditional_t<Rows == 1, Vec, Sum>;  // one row's four sums fit AVX2's registers as Vecs
  Acc acc[Rows][KEYS];
  for (int r = 0; r < Rows; r++)
    for (int j = 0; j < KEYS; j++) acc[r][j] = Acc{};  // zeros
  for (int64_t d = 0; d < c.hd; d += 16) {
    if constexpr (Rows == 1 || std::is_same_v<Sum, Vec>) {  // the keys converted first, overlapping (int8's most)
      Vec kd[KEYS];
      for (int j = 0; j < KEYS; j++) kd[j] = load16(key[j] + d);
      for (int r = 0; r < Rows; r++) {
        const Vec qd = load16(c.q + (r0 + r) * c.hd + d);
        for (int j = 0; j < KEYS; j++) acc[r][j] = fmadd_sum(qd, kd[j], acc[r][j]);
      }
    } else {  // AVX2's rows: a key at a time, so that its 16 registers hold it beside the sums
      for (int j = 0; j < KEYS; j++) {
        const Vec kd = load16(key[j] + d);
        for (int r = 0; r < Rows; r++) acc[r][j] = fmadd_sum(load16(c.q + (r0 + r) * c.hd + d), kd, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < Rows; r++) dot[r] = sums4(to_sum(acc[r][0]), to_sum(acc[r][1]), to_sum(acc[r][2]), to_sum(acc[r][3]));
}

#ifdef __AVX512VNNI__
// ... and an int8 cache's, in integers: the rows rounded to int16 (c.q16), each key's 32 levels widened to int16
// in one instruction and multiplied in pairs summed into int32 lanes (vpdpwssd), exactly; scaled once finished
template <int Rows>
inline void dots(const Chunk& c, int64_t r0, const int8_t* const* key, __m128* dot) {
  __m512i acc[Rows][KEYS];
  for (int r = 0; r < Rows; r++)
    for (int j = 0; j < KEYS; j++) acc[r][j] = _mm512_setzero_si512();
  for (int64_t d = 0; d < c.hd; d += 32) {
    const __mmask32 in = d + 32 <= c.hd ? ~0u : 0xffffu;  // hd is a multiple of 16
    __m512i kd[KEYS];
    for (int j = 0; j < KEYS; j++) kd[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(in, key[j] + d));
    for (int r = 0; r < Rows; r++) {
      const __m512i qd = _mm512_loadu_si512(c.q16 + (r0 + r) * c.hd16 + d);
      for (int j = 0; j < KEYS; j++) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], qd, kd[j]);
    }
  }
  for (int r = 0; r < Rows; r++)
    dot[r] = _mm_mul_ps(_mm_cvtepi32_ps(sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])), _mm_set1_ps(c.q_scale[r0 + r]));
}
#endif

// Rows r0 .. r0 + Rows - 1's scores over the chunk's keys (times c.key_factor), and their largest. Row r is
// query head r / T of the group at the step's position r % T. The first pass, of more than one row, also fetches
// the same positions' values into L2 for the values' pass, which waited on memory that the scores' arithmetic
// left idle; one row's scores take too little arithmetic for that (benchmarks/RESULTS.md, "Values fetched while
// the keys are scored").
template <int Rows, typename Element>
void score_rows(const Chunk& c, int64_t r0, const Element* keys, int64_t key_stride, const Element* values,
                int64_t value_stride) {
  __m128 best[Rows];
  int64_t t[Rows];  // row r's step position
  for (int r = 0; r < Rows; r++) best[r] = _mm_set1_ps(-INF), t[r] = (r0 + r) % c.T;
  for (int64_t i0 = 0; i0 < c.n; i0 += KEYS) {
    if (!c.sees(c.T, i0)) {  // keys no row sees are never read
      for (int r = 0; r < Rows; r++) std::fill_n(c.scores + (r0 + r) * CHUNK + i0, KEYS, -INF);
      continue;
    }
    const Element* key[KEYS];
    for (int j = 0; j < KEYS; j++) {
      key[j] = keys + (c.s0 + std::min(i0 + j, c.n - 1)) * key_stride;  // past the chunk: its last key again, masked below
      if (i0 + j + AHEAD < c.n) {
        prefetch_row(key[j] + AHEAD * key_stride, c.hd);
        if (Rows > 1 && r0 == 0) prefetch_row<_MM_HINT_T1>(values + (c.s0 + i0 + j + AHEAD) * value_stride, c.hd);
      }
    }
    __m128 dot[Rows];
    dots<Rows>(c, r0, key, dot);
    const __m128 factors = _mm_loadu_ps(c.key_factor + i0);
    for (int r = 0; r < Rows; r++) {
      const __m128 row = where_seen(c.sees(t[r], i0), _mm_mul_ps(dot[r], factors));
      _mm_storeu_ps(c.scores + (r0 + r) * CHUNK + i0, row);
      best[r] = _mm_max_ps(best[r], row);
    }
  }
  for (int r = 0; r < Rows; r++) {
    const __m128 m = _mm_max_ps(best[r], _mm_movehl_ps(best[r], best[r]));
    c.max[r0 + r] = std::max(c.max[r0 + r], _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))));
  }
}

// Rows r0 .. r0 + Rows - 1's weighted sums of the chunk's values, in elements d0 .. d0 + 16 * Width - 1, kept
// in registers over all the positions: each value read once for those rows. weights: (R, CHUNK), each value's
// scale (an int8 or fp8 cache's) taken in.
template <int Rows, int Width, typename Element>
void weigh_values(const Chunk& c, int64_t r0, int64_t d0, const float* weights, const Element* values,
                  int64_t value_stride, float* out) {
  Vec acc[Rows][Width];
  for (int r = 0; r < Rows; r++)
    for (int x = 0; x < Width; x++) acc[r][x] = zero();
  for (int64_t i = 0; i < c.n; i++) {
    float w[Rows];
    bool any = false;
    for (int r = 0; r < Rows; r++) any |= (w[r] = weights[(r0 + r) * CHUNK + i]) != 0.f;
    if (!any) continue;  // masked for every row: not read
    const Element* value = values + (c.s0 + i) * value_stride + d0;
    if (i + AHEAD < c.n) prefetch_row(value + AHEAD * value_stride, 16 * Width);
    for (int x = 0; x < Width; x++) {  // a block at a time, so that only one is live (AVX2's registers)
      const Vec vd = load16(value + 16 * x);
      for (int r = 0; r < Rows; r++) acc[r][x] = fmadd(set1(w[r]), vd, acc[r][x]);
    }
  }
  for (int r = 0; r < Rows; r++)
    for (int x = 0; x < Width; x++) store(out + (r0 + r) * c.hd + d0 + 16 * x, acc[r][x]);
}

template <int Rows, typename Element>
void weigh_all_values(const Chunk& c, int64_t r0, const float* weights, const Element* values, int64_t value_stride,
                      float* out) {
  int64_t d0 = 0;
  constexpr int width = WIDTH<Rows>;
  for (; d0 + 16 * width <= c.hd; d0 += 16 * width) weigh_values<Rows, width>(c, r0, d0, weights, values, value_stride, out);
  switch ((c.hd - d0) / 16) {  // the blocks left, fewer than width
    case 1: weigh_values<Rows, 1>(c, r0, d0, weights, values, value_stride, out); break;
    case 2: weigh_values<Rows, 2>(c, r0, d0, weights, values, value_stride, out); break;
    case 3: weigh_values<Rows, 3>(c, r0, d0, weights, values, value_stride, out); break;
  }
}

#ifdef __AVX512VNNI__
// x (n, a multiple of 16) rounded to int16 against its largest magnitude, at most `most` levels (so that sums of
// products stay within int32); returns the scale: x is about out times it
inline float round16(const float* x, int64_t n, int16_t* out, float most) {
  __m512 big = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) big = _mm512_max_ps(big, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float largest = _mm512_reduce_max_ps(big);
  const __m512 to = _mm512_set1_ps(largest > 0.f ? most / largest : 0.f);
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), to))));
  return largest / most;
}

// An int8 cache's weighted values in integers: rows r0 .. r0 + Rows - 1's weights (times each value's scale)
// rounded to int16 (weights: (R, CHUNK); scale: (R, CHUNK / SUMS), SUMS positions' weights are these times
// it), two positions at a time: their levels interleaved and widened so that one vpdpwssd adds both positions'
// products to each element's int32 sum, which takes SUMS positions before it is added to out's fp32 (zeros at
// first). Elements d0 .. d0 + 32 * Blocks - 1 (the last block perhaps only 16, hd being a multiple of 16).
template <int Rows, int Blocks>
void weigh_pairs(const Chunk& c, int64_t r0, int64_t d0, const int16_t* weights, const float* scale,
                 const int8_t* values, int64_t value_stride, float* out) {
  const auto block_mask = [&](int x) -> __mmask32 { return d0 + 32 * x + 32 <= c.hd ? ~0u : 0xffffu; };
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int64_t i0 = 0; i0 < c.n; i0 += SUMS) {
    __m512i acc[Rows][2 * Blocks];  // a block's elements 0-7 and 16-23, then 8-15 and 24-31 (as unpacking leaves them)
    for (int r = 0; r < Rows; r++)
      for (int x = 0; x < 2 * Blocks; x++) acc[r][x] = _mm512_setzero_si512();
    for (int64_t i = i0; i < std::min(c.n, i0 + SUMS); i += 2) {
      if (!c.sees(c.T, i, 2)) continue;  // masked for every row: not read
      __m512i w[Rows];
      for (int r = 0; r < Rows; r++) {
        int32_t pair;  // positions i and i + 1 (0 past the chunk's positions: SUMS is even)
        std::memcpy(&pair, weights + (r0 + r) * CHUNK + i, sizeof pair);
        w[r] = _mm512_set1_epi32(pair);
      }
      const int8_t* a = values + (c.s0 + i) * value_stride + d0;
      const int8_t* b = i + 1 < c.n ? a + value_stride : a;  // past the chunk: read nothing new, weighed 0
      if (i + AHEAD + 1 < c.n) {
        prefetch_row(a + AHEAD * value_stride, 32 * Blocks);
        prefetch_row(b + AHEAD * value_stride, 32 * Blocks);
      }
      for (int x = 0; x < Blocks; x++) {
        const __m256i va = _mm256_maskz_loadu_epi8(block_mask(x), a + 32 * x), vb = _mm256_maskz_loadu_epi8(block_mask(x), b + 32 * x);
        const __m512i lo = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(va, vb)), hi = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(va, vb));
        for (int r = 0; r < Rows; r++) {
          acc[r][2 * x] = _mm512_dpwssd_epi32(acc[r][2 * x], lo, w[r]);
          acc[r][2 * x + 1] = _mm512_dpwssd_epi32(acc[r][2 * x + 1], hi, w[r]);
        }
      }
    }
    for (int r = 0; r < Rows; r++) {
      const __m512 to = _mm512_set1_ps(scale[(r0 + r) * (CHUNK / SUMS) + i0 / SUMS]);
      for (int x = 0; x < Blocks; x++) {
        const __m512 lo = _mm512_cvtepi32_ps(acc[r][2 * x]), hi = _mm512_cvtepi32_ps(acc[r][2 * x + 1]);
        float* o = out + (r0 + r) * c.hd + d0 + 32 * x;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, first, hi), to, _mm512_loadu_ps(o)));
        if (block_mask(x) == ~0u)
          _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, second, hi), to, _mm512_loadu_ps(o + 16)));
      }
    }
  }
}

template <int Rows>
void weigh_all_pairs(const Chunk& c, int64_t r0, const int16_t* weights, const float* scale, const int8_t* values,
                     int64_t value_stride, float* out) {
  for (int64_t d0 = 0; d0 < c.hd; d0 += 64) {
    if (d0 + 32 < c.hd) weigh_pairs<Rows, 2>(c, r0, d0, weights, scale, values, value_stride, out);
    else weigh_pairs<Rows, 1>(c, r0, d0, weights, scale, values, value_stride, out);
  }
}
#else
// declared only: attend takes integer products where the CPU has AVX-512 VNNI (`integers`), and names them anyway
float round16(const float* x, int64_t n, int16_t* out, float most);
template <int Rows>
void weigh_all_pairs(const Chunk& c, int64_t r0, const int16_t* weights, const float* scale, const int8_t* values,
                     int64_t value_stride, float* out);
#endif

// a template's instance for the rows left (at most ROWS), the count a constant so that the tiles stay in registers
#define FOR_ROWS(rows, call)              \
  switch (rows) {                         \
    case 1: call(1); break;               \
    case 2: call(2); break;               \
    case 3: call(3); break;               \
    default: call(ROWS); break;           \
  }

// row b, head h's scales (a tensor (>= B, H, >= S, 1)), or none
inline Scales scales_of(const c10::optional<at::Tensor>& scales, int64_t b, int64_t h) {
  Scales out;
  if (scales) {
    out.p = static_cast<const char*>(scales->data_ptr()) + (b * scales->stride(0) + h * scales->stride(1)) * scales->element_size();
    out.dtype = scales->scalar_type();
    out.stride = scales->stride(2);
  }
  return out;
}

// Positions a task reads, for `heads` key/value heads (of all rows) of S positions each: each head's cut into
// equal chunks of at most CHUNK and at least 256 positions, the fewest that make the tasks a multiple of the
// threads, so that each thread's run of tasks (parallel_for's share) is as long as the others' ("Equal shares of
// the cache for the threads" in benchmarks/RESULTS.md), or where none do, a task for each thread. The longer a
// run of keys or values read without a break, the faster the cache is read ("Longer chunks, and short reads in
// one thread").
inline int64_t chunk_for(int64_t heads, int64_t S) {
  const int64_t threads = at::get_num_threads(), fewest = (S + CHUNK - 1) / CHUNK, most = std::max(fewest, S / 256);
  int64_t chunks = std::clamp((threads + heads - 1) / heads, fewest, most);
  for (int64_t c = fewest; c <= most; c++)
    if ((heads * c) % threads == 0) {
      chunks = c;
      break;
    }
  return ((S + chunks - 1) / chunks + 15) / 16 * 16;
}

template <typename Element>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& k_scales,
            const c10::optional<at::Tensor>& v_scales, const at::Tensor& mask, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), hd = q.size(3), T = mask.size(2), S = mask.size(3);
  const int64_t chunk = chunk_for(B * H, S), chunks = (S + chunk - 1) / chunk, tasks = B * H * chunks;
  // what each task leaves for each row: the largest score of its chunk, the sum of exp(score - max) and
  // the values weighed by exp(score - max); the chunks are merged afterwards
  std::vector<float> maxes(tasks * R, -INF), sums(tasks * R), accs(tasks * R * hd);

#ifdef __AVX512VNNI__
  constexpr bool integers = std::is_same_v<Element, int8_t>;  // products in integers (dots, weigh_pairs)
#else
  constexpr bool integers = false;
#endif
  // int16 levels, fewer past 256 elements a sum so that a sum of products (up to 128 times as large) fits in int32
  const float levels = 32767.f * std::min<float>(1.f, 256.f / float(std::max(hd, SUMS)));
  const int64_t hd16 = (hd + 31) / 32 * 32;

  // the tasks shared among the threads, but for a read too short to pay for waking them (SERIAL)
  at::parallel_for(0, tasks, B * H * S < SERIAL ? tasks + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * CHUNK), key_factor(CHUNK, scale), value_factor(CHUNK, 1.f);
    std::vector<int16_t> q16(integers ? R * hd16 : 0), weights16(integers ? R * CHUNK : 0);
    std::vector<float> q_scale(R), weight_scale(R * (CHUNK / SUMS));
    std::vector<uint64_t> seen((T + 1) * WORDS);
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / (H * chunks), h = task / chunks % H, s0 = task % chunks * chunk, n = std::min(chunk, S - s0);
      const int64_t n16 = (n + 15) / 16 * 16, words = (n + 63) / 64;
      const float* rows = q.data_ptr<float>() + (b * H + h) * R * hd;
      if constexpr (integers)
        for (int64_t r = 0; r < R; r++) q_scale[r] = round16(rows + r * hd, hd, q16.data() + r * hd16, levels);
      const Scales key_scales = scales_of(k_scales, b, h), value_scales = scales_of(v_scales, b, h);
      if (key_scales) key_scales.read(s0, n, scale, key_factor.data());
      if (value_scales) value_scales.read(s0, n, 1.f, value_factor.data());
      for (int64_t t = 0; t < T; t++) {
        const uint8_t* sees = static_cast<const uint8_t*>(mask.data_ptr()) + b * mask.stride(0) + t * mask.stride(2) + s0 * mask.stride(3);
        for (int64_t w = 0; w < words; w++) {
          const int64_t from = w * 64, to = std::clamp<int64_t>(n, from, from + 64);
          uint64_t bits = 0;
          if (mask.stride(3) == 1)  // 64 at a time
            bits = nonzero_bytes(sees + from, to - from);
          else
            for (int64_t i = from; i < to; i++) bits |= uint64_t(sees[i * mask.stride(3)] != 0) << (i - from);
          seen[t * WORDS + w] = bits;
        }
      }
      for (int64_t w = 0; w < words; w++) {
        seen[T * WORDS + w] = 0;
        for (int64_t t = 0; t < T; t++) seen[T * WORDS + w] |= seen[t * WORDS + w];
      }
      const Chunk c{T, s0, n, seen.data(), rows, hd, q16.data(), q_scale.data(), hd16, key_factor.data(), scores.data(),
                    maxes.data() + task * R};
      const Element* keys = k.data_ptr<Element>() + b * k.stride(0) + h * k.stride(1);
      const Element* values = v.data_ptr<Element>() + b * v.stride(0) + h * v.stride(1);
      for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
#define SCORE(n) score_rows<n>(c, r0, keys, k.stride(2), values, v.stride(2))
        FOR_ROWS(std::min<int64_t>(ROWS, R - r0), SCORE)
#undef SCORE
      }
      // scores -> exp(score - max), 0 past the chunk's positions (to a multiple of 16); then the weights of the
      // values, times each value's scale (an int8 or fp8 cache's)
      for (int64_t r = 0; r < R; r++) {
        float* row = scores.data() + r * CHUNK;
        const Vec max = set1(c.max[r]);
        Vec total = zero();
        for (int64_t i = 0; i < n16; i += 16) {  // within the buffers (CHUNK long) past n too, whatever they hold there
          const Vec p = c.max[r] == -INF ? zero() : first_lanes(exp16(sub(load16(row + i), max)), n - i);
          total = add(total, p);
          store(row + i, value_scales ? mul(p, load16(value_factor.data() + i)) : p);
        }
        sums[task * R + r] = sum(total);
      }
      float* acc = accs.data() + task * R * hd;
      if constexpr (integers) {
        for (int64_t r = 0; r < R; r++)
          for (int64_t i0 = 0; i0 < n16; i0 += SUMS)
            weight_scale[r * (CHUNK / SUMS) + i0 / SUMS] = round16(scores.data() + r * CHUNK + i0, std::min(SUMS, n16 - i0),
                                                                   weights16.data() + r * CHUNK + i0, levels);
        for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
#define WEIGH(n) weigh_all_pairs<n>(c, r0, weights16.data(), weight_scale.data(), values, v.stride(2), acc)
          FOR_ROWS(std::min<int64_t>(ROWS, R - r0), WEIGH)
#undef WEIGH
        }
      } else {
        for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
#define WEIGH(n) weigh_all_values<n>(c, r0, scores.data(), values, v.stride(2), acc)
          FOR_ROWS(std::min<int64_t>(ROWS, R - r0), WEIGH)
#undef WEIGH
        }
      }
    }
  });

  // each row's chunks merged, rescaled to the largest max of all; a row that sees no key gets zeros. In this
  // thread: a few vectors a chunk, less than waking the others costs
  float* o = out.data_ptr<float>();
  for (int64_t row = 0; row < B * H * R; row++) {
    const int64_t bh = row / R, r = row % R;
    float m = -INF, sum = 0.f;
    for (int64_t c = 0; c < chunks; c++) m = std::max(m, maxes[(bh * chunks + c) * R + r]);
    float* out_row = o + row * hd;
    std::fill_n(out_row, hd, 0.f);
    if (m == -INF) continue;
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t at = (bh * chunks + c) * R + r;
      if (maxes[at] == -INF) continue;
      const float w = std::exp(maxes[at] - m);
      sum += w * sums[at];
      for (int64_t d = 0; d < hd; d++) out_row[d] += w * accs[at * hd + d];
    }
    for (int64_t d = 0; d < hd; d++) out_row[d] /= sum;
  }
}

// q (B, H, R, hd): the query rows of each of H key/value heads; k, v (>= B, H, >= S, hd) the caches, of which
// the first B rows and S slots are read; k_scales, v_scales (>= B, H, >= S, 1) for int8 and fp8 caches;
// mask (B, 1, T, S) of bools or bytes, R a multiple of T, T <= 16, hd a multiple of 16. Returns (B, H, R, hd) in fp32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && mask.dim() == 4 && (mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte),
              "decode_attention: q (B, H, R, hd), caches (B, H, S, hd), a bool or uint8 mask (B, 1, T, S)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.scalar_type() == v.scalar_type() && q.size(3) % 16 == 0,
              "decode_attention: caches of one dtype, each row contiguous, hd a multiple of 16");
  TORCH_CHECK(q.size(2) % mask.size(2) == 0 && mask.size(2) <= 16 && k.size(2) >= mask.size(3) && k_scales.has_value() == v_scales.has_value(),
              "decode_attention: shapes disagree");
  // q in fp32, a bf16 q converted here rather than by an ATen op, whose dispatch costs more than the few hundred
  // numbers of a decode step's q take to convert (30 calls a step)
  at::Tensor qf;
  if (q.scalar_type() == at::kBFloat16 && q.is_contiguous()) {
    qf = at::empty(q.sizes(), q.options().dtype(at::kFloat));
    const at::BFloat16* from = q.data_ptr<at::BFloat16>();
    float* to = qf.data_ptr<float>();
    for (int64_t i = 0; i < q.numel(); i++) to[i] = float(from[i]);
  } else {
    qf = q.to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty(qf.sizes(), qf.options());
  const float s = float(scale);
  switch (k.scalar_type()) {
    case at::kFloat: attend<float>(qf, k, v, k_scales, v_scales, mask, s, out); break;
    case at::kBFloat16: attend<at::BFloat16>(qf, k, v, k_scales, v_scales, mask, s, out); break;
    case at::kHalf: attend<at::Half>(qf, k, v, k_scales, v_scales, mask, s, out); break;
    case at::kChar: attend<int8_t>(qf, k, v, k_scales, v_scales, mask, s, out); break;
    case at::kFloat8_e4m3fn: attend<c10::Float8_e4m3fn>(qf, k, v, k_scales, v_scales, mask, s, out); break;
    default: TORCH_CHECK(false, "decode_attention: no kernel for a cache of ", k.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastllama, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? k_scales, Tensor? v_scales, Tensor mask, float scale)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(fastllama, CPU, m) { m.impl("decode_attention", &decode_attention); }
