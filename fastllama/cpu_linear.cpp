// Weight-only products of our own on CPUs with AVX-512 BF16 or AVX2: y = x w^T for a few rows of x (bf16), with
// the weight in bf16, int8 or 4-bit levels. The lanes of a vector are 16 outputs (a tile), and each weight element
// is read once for all the rows of a pass. A pass serves up to MAX_ROWS rows; more rows take more passes, over a
// group of tiles still in cache. Each row's sums are added in one order whatever the other rows, so that a row's
// numbers are the same alone and in a batch (generate.py's promise in fp32).
//
// bf16 (bf16_rows): cpu_decode.pack gives a bf16 linear a copy of its weight in tiles (tiles_layout), where one
// vdpbf16ps adds a pair of inputs' products for all 16 outputs: 32 products an instruction (with AVX2, four fused
// multiply-adds; the vector operations below say how). Its products of a few rows (decode and verify steps, the
// server's steps, short prompts) read it faster than oneDNN's bf16 kernel over its own packed layout
// (benchmarks/RESULTS.md, "Bf16 products of our own on CPU", "The server's prompts through the tiles"). At many
// rows oneDNN's blocking wins, over the plain weight (bf16_linear chooses, for a count of rows known only when it
// runs).
//
// int4 (int4_rows): 4-bit levels q with a scale s and a min m each block of 32 inputs (w = s q + m, quantize.py's
// int4), laid out by quantize.int4_rows_layout. The products are in integers, as llama.cpp makes them against a Q4
// weight: each row's block of 32 inputs rounded to int8 against its largest magnitude (x ~ xs xq, round_blocks), and
// a block's part of y is s xs sum q xq + m xs sum xq, to fp32's precision. With AVX-512 one vpdpbusd multiplies a
// tile's 16 outputs' levels by 4 inputs' xq and adds the 4 products into each output's int32 sum (64 products an
// instruction, over levels that need no widening); with AVX2 vpmaddubsw adds pairs of products into int16, and
// vpmaddwd adds the pairs into int32 once a block. The exact forms before them were bound by their arithmetic: on
// AVX-512 (x in bf16, a level read as the bf16 number 128 + q) this takes less time at any count of rows, for a
// slightly higher perplexity (benchmarks/RESULTS.md, "Int4 products in integers on AVX-512"; on AVX2, "Int4 products
// in integers on AVX2"). A weight whose 16 levels are not 0 .. 15 (IQ4_NL's, from a GGUF file: w = s levels[q] + m)
// has them given as int8 numbers, and each 4 bits is looked up (vpshufb) into a byte as an int8 weight's level is
// read, then multiplied as int8's are ("IQ4 weights as the file holds them").
//
// int8 (int8_rows): quantize.Int8Linear's levels, a byte each, laid out as int4's (quantize.int8_rows_layout, in
// place) and multiplied in integers as int4's, x rounded alike (as llama.cpp's products against a Q8_0 weight); its
// scales applied by the caller. The exact form before (x in bf16, the levels converted to bf16 as read) was bound
// by the conversion past one row: this takes less time from two rows on and about as long at one, for a slightly
// higher perplexity (benchmarks/RESULTS.md, "Int8 products in integers"). With AVX2 too at any count of rows: past
// 128 less time than a matmul in fp32 of the levels converted ("Int8 and int4 products in integers on the AVX2
// machine").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_vectors.h"

namespace {

constexpr int64_t TILE = 16;  // outputs a tile holds, one a lane
constexpr int TILES = 4;      // tiles computed together (a group), so that the sums' chains overlap

// A pair of inputs' products for a tile's 16 outputs (dot). With AVX-512 BF16 one vdpbf16ps; with AVX2 a pair's
// weights are split into the first and the second input's as fp32, each multiplied in by a fused multiply-add: the
// same products, each exact in fp32, and sums rounded as often.
#if defined(__AVX512BF16__)
using Pairs = __m512bh;  // 16 outputs' weights for an input pair (output i's at 2i, 2i + 1)
using XPair = __m512bh;  // a row's input pair, for every lane

inline XPair x_pair(uint32_t bits) { return (XPair)_mm512_set1_epi32(int(bits)); }
inline Vec dot(Vec acc, Pairs w, XPair x) { return _mm512_dpbf16_ps(acc, w, x); }

inline Pairs pair_weights(const at::BFloat16* p) { return (Pairs)_mm512_loadu_si512(p); }
#elif !defined(__AVX512F__)
struct Pairs {
  __m256 first[2], second[2];  // each input's weights for outputs 0-7 and 8-15
};
struct XPair {
  __m256 first, second;
};

// bf16 pairs (32 bits each: the first number in the low half) as each one's fp32 numbers
inline __m256 first_of(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 second_of(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline Pairs split(__m256i lo, __m256i hi) { return {{first_of(lo), first_of(hi)}, {second_of(lo), second_of(hi)}}; }

inline XPair x_pair(uint32_t bits) {
  const __m256i all = _mm256_set1_epi32(int(bits));
  return {first_of(all), second_of(all)};
}
inline Vec dot(Vec acc, const Pairs& w, const XPair& x) {
  return {_mm256_fmadd_ps(w.second[0], x.second, _mm256_fmadd_ps(w.first[0], x.first, acc.lo)),
          _mm256_fmadd_ps(w.second[1], x.second, _mm256_fmadd_ps(w.first[1], x.first, acc.hi))};
}

inline Pairs pair_weights(const at::BFloat16* p) {
  return split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
}
#else
#error "cpu_linear.cpp needs AVX-512 BF16, or AVX2 (with FMA and F16C) without AVX-512"
#endif

// Asks for the cache lines of `bytes` bytes from p, ahead of their use
inline void fetch(const void* p, int bytes) {
  for (int i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

// A bf16 weight in tiles, each group of tiles one stream: for each input pair, for each of the group's tiles, the
// 32 weights of its 16 outputs (output i's two at 2i, 2i + 1). x's rows as bf16 pairs (32 bits each), np pairs a row.
struct PairTiles {
  static constexpr int MAX_ROWS = 8;  // 8 rows x 4 tiles of sums: one pass serves a whole server step
  const uint32_t* x;
  const at::BFloat16* w;
  int64_t np;
  float* y;
  int64_t n;  // y's row stride

  template <int R, int NT>
  void tiles(int64_t r0, int64_t t0) const {
    Vec acc[NT][R];
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) acc[t][r] = zero();
    const at::BFloat16* group = w + t0 * np * 2 * TILE;
    for (int64_t p = 0; p < np; p++) {
      XPair xs[R];
      for (int r = 0; r < R; r++) xs[r] = x_pair(x[(r0 + r) * np + p]);
      for (int t = 0; t < NT; t++) {
        const Pairs wv = pair_weights(group + (p * NT + t) * 2 * TILE);
        for (int r = 0; r < R; r++) acc[t][r] = dot(acc[t][r], wv, xs[r]);
      }
    }
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) store(y + (r0 + r) * n + (t0 + t) * TILE, acc[t][r]);
  }
};

// A piece of an int4 weight (64 bytes: a tile's 16 outputs, 4 bytes each) and its products with 4 inputs' xq:
// Levels, the low or the high nibbles of a piece as bytes; Dots, a block's sums of 16 outputs so far
inline int32_t four(const int8_t* x) {  // 4 inputs' xq, as one number to broadcast
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return x4;
}

#if defined(__AVX512BF16__)
#ifndef __AVX512VNNI__
#error "cpu_linear.cpp's AVX-512 form needs AVX-512 VNNI (every CPU with AVX-512 BF16 has it)"
#endif
using Levels = __m512i;
using Dots = __m512i;  // int32, one an output

inline void nibbles(const uint8_t* p, Levels& low, Levels& high) {
  const __m512i raw = _mm512_loadu_si512(p), nibble = _mm512_set1_epi8(0x0F);
  low = _mm512_and_si512(raw, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
}
inline Dots no_dots() { return _mm512_setzero_si512(); }
// output i's 4 levels (bytes 4i .. 4i + 3) times the 4 inputs' xq at x, added to its sum
inline Dots dot4(Dots d, Levels q, const int8_t* x) { return _mm512_dpbusd_epi32(d, q, _mm512_set1_epi32(four(x))); }
inline Vec block_sums(Dots d) { return _mm512_cvtepi32_ps(d); }

// An int8 piece: vpdpbusd takes unsigned levels, so a level is read with its top bit flipped, as the level + 128,
// and y takes LEVEL_OFFSET xs sum xq back once a row. A pass of one row is bound by the read of the weight, which
// Zen 4 streamed faster in 32-byte loads than in 64-byte ones (benchmarks/RESULTS.md, "Int8 products in integers");
// passes of more rows read it as fast either way.
using Bytes = __m512i;
using Sums = __m512i;  // int32, one an output
constexpr float LEVEL_OFFSET = 128.f;
template <bool Halves>
inline Bytes int8_piece(const uint8_t* p) {
  const __m512i raw =
      Halves ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1)
             : _mm512_loadu_si512(p);
  return _mm512_xor_si512(raw, _mm512_set1_epi8(char(0x80)));
}
inline Sums no_sums() { return _mm512_setzero_si512(); }
// A weight's 16 levels as bytes read as an int8 level is (its top bit flipped), in each 128-bit lane for vpshufb
using Table = __m512i;
inline Table level_table(const int8_t* levels) {
  return _mm512_xor_si512(_mm512_broadcast_i32x4(load16bytes(levels)), _mm512_set1_epi8(char(0x80)));
}
inline Bytes look_up(Table table, Levels q) { return _mm512_shuffle_epi8(table, q); }
#else
struct Levels {
  __m256i lo, hi;  // outputs 0-7, 8-15
};
struct Dots {
  __m256i lo, hi;  // int16, two an output: a block's sums stay within int16 (16 products of at most 15 x 127)
};

inline void nibbles(const uint8_t* p, Levels& low, Levels& high) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; h++) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    (h ? low.hi : low.lo) = _mm256_and_si256(raw, nibble);
    (h ? high.hi : high.lo) = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  }
}
inline Dots no_dots() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Dots dot4(Dots d, Levels q, const int8_t* x) {  // pairs of products added in int16
  const __m256i x4 = _mm256_set1_epi32(four(x));
  return {_mm256_add_epi16(d.lo, _mm256_maddubs_epi16(q.lo, x4)),
          _mm256_add_epi16(d.hi, _mm256_maddubs_epi16(q.hi, x4))};
}
inline Vec block_sums(Dots d) {  // each output's two int16 sums added into one int32
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_cvtepi32_ps(_mm256_madd_epi16(d.lo, ones)), _mm256_cvtepi32_ps(_mm256_madd_epi16(d.hi, ones))};
}

// An int8 piece: vpmaddubsw takes unsigned bytes, so a level's magnitude multiplies xq given the level's sign (as
// llama.cpp's Q8_0 products do); a pair of products stays within int16 (2 x 128 x 127), and is widened into the
// output's int32 sum at once
struct Bytes {
  __m256i magnitude[2], level[2];  // outputs 0-7, 8-15
};
struct Sums {
  __m256i lo, hi;  // int32
};
constexpr float LEVEL_OFFSET = 0.f;
template <bool Halves>  // AVX2's loads are of 32 bytes
inline Bytes int8_piece(const uint8_t* p) {
  Bytes q;
  for (int h = 0; h < 2; h++) {
    q.level[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    q.magnitude[h] = _mm256_abs_epi8(q.level[h]);
  }
  return q;
}
inline Sums no_sums() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Sums dot4(Sums d, const Bytes& q, const int8_t* x) {
  const __m256i x4 = _mm256_set1_epi32(four(x)), ones = _mm256_set1_epi16(1);
  const auto products = [&](int h) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q.magnitude[h], _mm256_sign_epi8(x4, q.level[h])), ones);
  };
  return {_mm256_add_epi32(d.lo, products(0)), _mm256_add_epi32(d.hi, products(1))};
}
inline Vec block_sums(Sums d) { return {_mm256_cvtepi32_ps(d.lo), _mm256_cvtepi32_ps(d.hi)}; }
using Table = __m256i;
inline Table level_table(const int8_t* levels) { return _mm256_broadcastsi128_si256(load16bytes(levels)); }
inline Bytes look_up(Table table, const Levels& q) {
  Bytes b;
  b.level[0] = _mm256_shuffle_epi8(table, q.lo);
  b.level[1] = _mm256_shuffle_epi8(table, q.hi);
  for (int h = 0; h < 2; h++) b.magnitude[h] = _mm256_abs_epi8(b.level[h]);
  return b;
}
#endif

// A weight of 4- or 8-bit levels w in tiles, nb blocks of 32 inputs a row, times x's rows rounded to int8 a block at
// a time (round_blocks). int4: each tile and block's 16 scales, then 16 mins, in sm (a block's part of y: s xs sum q xq
// + m xs sum xq), with Lookup the 4 bits of q looked up in a table of 16 int8 levels; int8: signed levels, their
// scales the caller's (a block's part: xs sum q xq). A group's tiles lie block by block, so that the group is one
// stream. A pass of up to 4 rows reads each piece's levels once for all of them: with AVX2, less time at 4 and 8
// rows than a pass a row (benchmarks/RESULTS.md, "Int4 products of several rows on AVX2").
template <int Bits, typename Scale = at::BFloat16, bool Lookup = false>
struct IntTiles {
  static constexpr int MAX_ROWS = 4;
  static constexpr int64_t BLOCK = 32;                  // inputs a scale (and a min) cover
  static constexpr int64_t TILE_BYTES = 16 * Bits * 4;  // a tile's levels for one block: 256 or 512 bytes, pieces of 64
  // Blocks fetched ahead of the one summed, past a group's end into the next group's (up to the weight's last):
  // a small model's product reads a few hundred KB, too short a stream for the hardware's prefetcher to reach
  // speed on its own (benchmarks/RESULTS.md, "Int4 weights fetched ahead, and q converted in the kernel")
  static constexpr int64_t AHEAD = 4;
  using BlockSums = std::conditional_t<Bits == 4 && !Lookup, Dots, Sums>;  // looked-up levels sum as int8's
  const uint8_t* w;
  const Scale* sm;  // int4's
  int64_t nb;
  int64_t pieces;  // the weight's tile-blocks (TILE_BYTES each), the last that may be fetched
  float* y;
  int64_t n;
  const int8_t* xq;  // (M, K): each block of each row rounded to int8
  const float* xs;   // (M, nb): the blocks' scales
  const float* sx;   // (M, nb): the rounded blocks' sums, xs sum xq
  const float* offset;  // int8's (M): LEVEL_OFFSET times the sum of a row's sx, which its sums hold beyond y
  Table table;  // Lookup's levels

  template <int NT>
  void fetch_piece(int64_t piece) const {
    piece = std::min(piece, pieces - NT);
    fetch(w + piece * TILE_BYTES, NT * TILE_BYTES);
    if constexpr (Bits == 4) fetch(sm + piece * 2 * TILE, NT * 2 * TILE * int(sizeof(Scale)));
  }
  // tile t0 + t's levels (and int4's scales and mins) for block b, in a group of NT tiles from tile t0
  const uint8_t* levels(int64_t t0, int64_t b, int NT, int t) const { return w + (t0 * nb + b * NT + t) * TILE_BYTES; }
  const Scale* scales(int64_t t0, int64_t b, int NT, int t) const { return sm + (t0 * nb + b * NT + t) * 2 * TILE; }

  template <int R, int NT>
  void tiles(int64_t r0, int64_t t0) const {
    const int64_t K = nb * BLOCK;
    Vec acc[NT][R];
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) acc[t][r] = zero();
    for (int64_t b = 0; b < nb; b++) {
      if (Bits == 4 && r0 == 0) fetch_piece<NT>(t0 * nb + (b + AHEAD) * NT);  // later passes find it in cache
      const int8_t* xb[R];  // each row's block
      for (int r = 0; r < R; r++) xb[r] = xq + (r0 + r) * K + b * BLOCK;
      for (int t = 0; t < NT; t++) {  // a tile at a time: R sums live, where AVX2 has 16 registers
        const uint8_t* piece = levels(t0, b, NT, t);
        BlockSums d[R];  // integers: each row's the same whatever the rows of the pass
        for (int r = 0; r < R; r++) {
          if constexpr (Bits == 4 && !Lookup) d[r] = no_dots();
          else d[r] = no_sums();
        }
        for (int c = 0; c < TILE_BYTES / 64; c++) {
          if constexpr (Bits == 4) {
            Levels low, high;
            nibbles(piece + 64 * c, low, high);
            if constexpr (Lookup) {
              const Bytes lo = look_up(table, low), hi = look_up(table, high);
              for (int r = 0; r < R; r++) d[r] = dot4(dot4(d[r], lo, xb[r] + 4 * c), hi, xb[r] + 16 + 4 * c);
            } else {
              for (int r = 0; r < R; r++) d[r] = dot4(dot4(d[r], low, xb[r] + 4 * c), high, xb[r] + 16 + 4 * c);
            }
          } else {
            const Bytes q = int8_piece<R == 1>(piece + 64 * c);
            for (int r = 0; r < R; r++) d[r] = dot4(d[r], q, xb[r] + 4 * c);
          }
        }
        for (int r = 0; r < R; r++) {
          const int64_t at = (r0 + r) * nb + b;
          if constexpr (Bits == 4) {
            const Scale* q = scales(t0, b, NT, t);
            const Vec s = load16(q);
            // looked-up levels are read LEVEL_OFFSET high, as int8's: the min takes it back
            const Vec m = Lookup ? sub(load16(q + TILE), mul(s, set1(LEVEL_OFFSET))) : load16(q + TILE);
            acc[t][r] = fmadd(m, set1(sx[at]), fmadd(block_sums(d[r]), mul(s, set1(xs[at])), acc[t][r]));
          } else {
            acc[t][r] = fmadd(block_sums(d[r]), set1(xs[at]), acc[t][r]);
          }
        }
      }
    }
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++)
        store(y + (r0 + r) * n + (t0 + t) * TILE, Bits == 4 ? acc[t][r] : sub(acc[t][r], set1(offset[r0 + r])));
  }
};

// 8 bf16 numbers as fp32
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16bytes(p)), 16));
}

// x's rows (M, K bf16) rounded to int8 a block of 32 at a time, against the block's largest magnitude: xq = x * (127
// / largest) rounded to the nearest (ties to even), its scale xs = largest / 127, and the rounded block's sum xs sum
// xq (0s for a block of zeros). In 256-bit vectors with either kind of CPU: a call rounds a few KB.
inline void round_blocks(const at::BFloat16* x, int64_t blocks, int8_t* xq, float* xs, float* sx) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packing's lanes back in order
  for (int64_t i = 0; i < blocks; i++) {
    __m256 parts[4], big = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      parts[j] = load8(x + 32 * i + 8 * j);
      big = _mm256_max_ps(big, _mm256_and_ps(parts[j], magnitude));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 to = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(parts[j], to));
    const __m256i p0 = _mm256_packs_epi32(q[0], q[1]), p1 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p0, p1), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * i), packed);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    xs[i] = largest / 127.f;
    sx[i] = xs[i] * float(_mm_cvtsi128_si32(t));
  }
}

// One pass: rows r0 .. r0 + rows (at most Kind::MAX_ROWS) by the nt tiles of the group from tile t0
template <typename Kind, int R = Kind::MAX_ROWS>
void pass(const Kind& kind, int rows, int nt, int64_t r0, int64_t t0) {
  if constexpr (R > 1) {
    if (rows < R) return pass<Kind, R - 1>(kind, rows, nt, r0, t0);
  }
  switch (nt) {
    case 4: return kind.template tiles<R, 4>(r0, t0);
    case 3: return kind.template tiles<R, 3>(r0, t0);
    case 2: return kind.template tiles<R, 2>(r0, t0);
    default: return kind.template tiles<R, 1>(r0, t0);
  }
}

// M rows by nt tiles: the groups split between the threads, each group's passes one after another
template <typename Kind>
void products(const Kind& kind, int64_t M, int64_t nt) {
  at::parallel_for(0, (nt + TILES - 1) / TILES, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++)
      for (int64_t r0 = 0; r0 < M; r0 += Kind::MAX_ROWS)
        pass(kind, int(std::min<int64_t>(Kind::MAX_ROWS, M - r0)), int(std::min<int64_t>(TILES, nt - g * TILES)), r0,
             g * TILES);
  });
}

const uint32_t* pairs(const at::Tensor& x) { return reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()); }

// x (M, K) bf16; w (N/16, K/2, 32) bf16 as cpu_decode.tiles_layout makes it. Returns y (M, N) fp32.
at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == 2 * TILE &&
                  w.scalar_type() == at::kBFloat16 && x.size(1) == 2 * w.size(1),
              "bf16_rows: x (M, K) bf16, w (N/16, K/2, 32) bf16");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0) * TILE}, x.options().dtype(at::kFloat));
  const PairTiles kind{pairs(xc), wc.data_ptr<at::BFloat16>(), w.size(1), y.data_ptr<float>(), y.size(1)};
  products(kind, x.size(0), w.size(0));
  return y;
}

// x's rows rounded to int8 a block of 32 inputs at a time (round_blocks), as the integer products take them
struct Rounded {
  std::vector<int8_t> xq;
  std::vector<float> xs, sx;
  Rounded(const at::Tensor& x, int64_t nb) : xq(x.size(0) * nb * 32), xs(x.size(0) * nb), sx(x.size(0) * nb) {
    round_blocks(x.data_ptr<at::BFloat16>(), x.size(0) * nb, xq.data(), xs.data(), sx.data());
  }
};

// x (M, K) bf16; w (N/16, K/32, 512) int8 as quantize.int8_rows_layout makes it. Returns y (M, N) fp32, unscaled.
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == 512 &&
                  w.scalar_type() == at::kChar && x.size(1) == 32 * w.size(1),
              "int8_rows: x (M, K) bf16, w (N/16, K/32, 512) int8");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), nb = w.size(1);
  at::Tensor y = at::empty({M, w.size(0) * TILE}, x.options().dtype(at::kFloat));
  const Rounded r(xc, nb);
  std::vector<float> offset(M);
  for (int64_t m = 0; m < M; m++)
    offset[m] = LEVEL_OFFSET * std::accumulate(r.sx.begin() + m * nb, r.sx.begin() + (m + 1) * nb, 0.f);
  const IntTiles<8> kind{reinterpret_cast<const uint8_t*>(wc.data_ptr<int8_t>()), nullptr, nb, w.size(0) * nb,
                         y.data_ptr<float>(), y.size(1), r.xq.data(), r.xs.data(), r.sx.data(), offset.data()};
  products(kind, M, w.size(0));
  return y;
}

// F.linear(x, w, bias) in bf16 through the tiles for at most max_rows rows, and through the plain weight w for more,
// where oneDNN's blocking wins: for a count of rows known only when it runs (compiled prefill's)
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& tiles,
                       const std::optional<at::Tensor>& bias, int64_t max_rows) {
  if (x.size(0) > max_rows) return at::linear(x, w, bias);
  at::Tensor y = bf16_rows(x, tiles);
  if (bias) y.add_(*bias);
  return y.to(at::kBFloat16);
}

template <typename Scale, bool Lookup>
void int4_products(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm, const int8_t* levels,
                   at::Tensor& y) {
  const int64_t nb = w.size(1);
  const Rounded r(x, nb);
  const IntTiles<4, Scale, Lookup> kind{w.data_ptr<uint8_t>(), sm.data_ptr<Scale>(), nb, w.size(0) * nb,
                                        y.data_ptr<float>(), y.size(1), r.xq.data(), r.xs.data(), r.sx.data(),
                                        nullptr, Lookup ? level_table(levels) : Table{}};
  products(kind, x.size(0), w.size(0));
}

template <typename Scale>
void int4_products(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm,
                   const std::optional<at::Tensor>& levels, at::Tensor& y) {
  if (levels) return int4_products<Scale, true>(x, w, sm, levels->data_ptr<int8_t>(), y);
  int4_products<Scale, false>(x, w, sm, nullptr, y);
}

// x (M, K) bf16; w (N/16, K/32, 256) uint8 and sm (N/16, K/32, 2, 16) bf16 or fp16 as
// quantize.int4_rows_layout makes them; levels, where given, the 16 int8 levels q stands for. Returns y (M, N) fp32.
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm,
                     const std::optional<at::Tensor>& levels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == 256 &&
                  w.scalar_type() == at::kByte && sm.dim() == 4,
              "int4_rows: x (M, K) bf16, w (N/16, K/32, 256) uint8, sm (N/16, K/32, 2, 16)");
  TORCH_CHECK(x.size(1) == w.size(1) * 32 && sm.size(0) == w.size(0) && sm.size(1) == w.size(1),
              "int4_rows: shapes disagree");
  TORCH_CHECK(!levels || (levels->dim() == 1 && levels->numel() == 16 && levels->scalar_type() == at::kChar &&
                          levels->is_contiguous() && levels->device().is_cpu()),
              "int4_rows: levels (16,) int8, on the CPU");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), smc = sm.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0) * TILE}, x.options().dtype(at::kFloat));
  switch (sm.scalar_type()) {
    case at::kBFloat16: int4_products<at::BFloat16>(xc, wc, smc, levels, y); break;
    case at::kHalf: int4_products<at::Half>(xc, wc, smc, levels, y); break;
    default: TORCH_CHECK(false, "int4_rows: scales and mins in bf16 or fp16, not ", sm.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastllama, m) {
  m.def("bf16_rows(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, Tensor tiles, Tensor? bias, int max_rows) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor w, Tensor sm, Tensor? levels=None) -> Tensor");
  m.def("int8_rows(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastllama, CPU, m) {
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int4_rows", &int4_rows);
  m.impl("int8_rows", &int8_rows);
}
