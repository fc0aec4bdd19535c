// Weight-only products of our own on CPUs with AVX-512 BF16: y = x w^T for a few rows of x (bf16), with the
// weight in bf16, int8 or 4-bit levels. The lanes of a vector are 16 outputs (a tile), and one vdpbf16ps adds a
// pair of inputs' products for all 16: 32 products an instruction, each weight element read once for all the
// rows of a pass. A pass serves up to MAX_ROWS rows; more rows take more passes, over a group of tiles still in
// cache. Each row's sums are added in one order whatever the other rows, so that a row's numbers are the same
// alone and in a batch (generate.py's promise in fp32).
//
// bf16 (bf16_rows): cpu_decode.pack gives a bf16 linear a copy of its weight in tiles (tiles_layout), whose
// products of a few rows (decode and verify steps, the server's steps, short prompts) read it faster than
// oneDNN's bf16 kernel over its own packed layout (benchmarks/RESULTS.md, "Bf16 products of our own on CPU",
// "The server's prompts through the tiles"). At many rows oneDNN's blocking wins, over the plain weight
// (bf16_linear chooses, for a count of rows known only when it runs).
//
// int8 (int8_rows): quantize.Int8Linear's levels laid out in the same tiles as bf16's, in place, and converted to
// bf16 as read; its scales applied by the caller. At one row it reads the weight 1.8x faster than the loop compiled
// code makes, and at 512 rows it is about as fast as a bf16 matmul of the converted weight (benchmarks/RESULTS.md,
// "Int8 products of our own on CPU"), so prefill takes it too, and the plain layout is not kept.
//
// int4 (int4_rows): 4-bit levels q with a scale s and a min m each block of 32 inputs (w = s q + m, quantize.py's
// int4), laid out by quantize.int4_rows_layout. Against PyTorch's int4 kernel it takes 1.9x less time at many
// rows (prefill), 1.5x at six (a verify step) and about the same at one (benchmarks/RESULTS.md, "Int4 products
// of our own on CPU"). A level becomes a bf16 number without a conversion: 0x4300 | q is 128 + q exactly, so a
// block's sum is d = sum x (128 + q), and its part of y is s d + (m - 128 s) sum x, the sums of x a block
// computed once a call. The levels of two input pairs share a byte (low and high nibble), so one widening load
// and two bit operations unpack 64 of them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#ifndef __AVX512BF16__
#error "cpu_linear.cpp needs AVX-512 BF16 (-march=native on a CPU that has it)"
#endif

namespace {

constexpr int64_t TILE = 16;  // outputs a vector holds, one a lane
constexpr int TILES = 4;      // tiles computed together (a group), so that the sums' chains overlap

// 16 numbers as fp32: scales or mins, in the dtype the checkpoint holds them in (exact), or x
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Asks for the cache lines of `bytes` bytes from p, ahead of their use
inline void fetch(const void* p, int bytes) {
  for (int i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

// A weight in tiles, each group of tiles one stream: for each input pair, for each of the group's tiles, the
// 32 weights of its 16 outputs (output i's two at 2i, 2i + 1, as vdpbf16ps pairs them): bf16, or int8 levels
// converted to bf16 as read, exactly (a level has 8 significant bits), the scales the caller's. x's rows as
// bf16 pairs (32 bits each), np pairs a row.
inline __m512bh pair_weights(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pair_weights(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <typename W>
struct PairTiles {
  static constexpr int MAX_ROWS = 8;  // 8 rows x 4 tiles of sums: one pass serves a whole server step
  const uint32_t* x;
  const W* w;
  int64_t np;
  float* y;
  int64_t n;  // y's row stride

  template <int R, int NT>
  void tiles(int64_t r0, int64_t t0) const {
    __m512 acc[NT][R];
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const W* group = w + t0 * np * 2 * TILE;
    for (int64_t p = 0; p < np; p++) {
      __m512i xs[R];
      for (int r = 0; r < R; r++) xs[r] = _mm512_set1_epi32(x[(r0 + r) * np + p]);
      for (int t = 0; t < NT; t++) {
        const __m512bh wv = pair_weights(group + (p * NT + t) * 2 * TILE);
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wv, (__m512bh)xs[r]);
      }
    }
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * n + (t0 + t) * TILE, acc[t][r]);
  }
};

// 4-bit levels w, scales and mins sm (each tile and block: 16 scales, then 16 mins), x's rows as bf16 pairs,
// sums of x's blocks sx (nb a row). A group's tiles lie block by block, so that the group is one stream.
template <typename Scale>
struct Int4Tiles {
  static constexpr int MAX_ROWS = 4;
  static constexpr int64_t BLOCK = 32;        // inputs a scale and a min cover
  static constexpr int64_t TILE_BYTES = 256;  // a tile's levels for one block: 8 chunks of 32 bytes
  // Blocks fetched ahead of the one summed, past a group's end into the next group's (up to the weight's last):
  // a small model's product reads a few hundred KB, too short a stream for the hardware's prefetcher to reach
  // speed on its own (benchmarks/RESULTS.md, "Int4 weights fetched ahead, and q converted in the kernel")
  static constexpr int64_t AHEAD = 4;
  const uint32_t* x;
  const float* sx;
  const uint8_t* w;
  const Scale* sm;
  int64_t nb;
  int64_t pieces;  // the weight's tile-blocks (TILE_BYTES each), the last that may be fetched
  float* y;
  int64_t n;

  template <int NT>
  void fetch_piece(int64_t piece) const {
    piece = std::min(piece, pieces - NT);
    fetch(w + piece * TILE_BYTES, NT * TILE_BYTES);
    fetch(sm + piece * 2 * TILE, NT * 2 * TILE * int(sizeof(Scale)));
  }

  template <int R, int NT>
  void tiles(int64_t r0, int64_t t0) const {
    const __m512i low = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
    const __m512 minus128 = _mm512_set1_ps(-128.f);
    const uint32_t* xr = x + r0 * nb * 16;
    const float* sxr = sx + r0 * nb;
    __m512 acc[NT][R];
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      if (r0 == 0) fetch_piece<NT>(t0 * nb + (b + AHEAD) * NT);  // later passes of a group find it in cache
      __m512 d[NT][R];  // a block's sums, each row's added in the same order whatever the rows
      for (int t = 0; t < NT; t++)
        for (int r = 0; r < R; r++) d[t][r] = _mm512_setzero_ps();
      for (int c = 0; c < 8; c++) {  // input pairs 2c (low nibbles) and 2c + 1 (high nibbles) of the block
        __m512i xs[R][2];
        for (int r = 0; r < R; r++) {
          xs[r][0] = _mm512_set1_epi32(xr[r * nb * 16 + b * 16 + 2 * c]);
          xs[r][1] = _mm512_set1_epi32(xr[r * nb * 16 + b * 16 + 2 * c + 1]);
        }
        for (int t = 0; t < NT; t++) {
          const uint8_t* p = w + (t0 * nb + b * NT + t) * TILE_BYTES + c * 32;
          const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
          const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(raw, low, bias, 0xEA);  // (raw & low) | bias
          const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 4), bias);
          for (int r = 0; r < R; r++) {
            d[t][r] = _mm512_dpbf16_ps(d[t][r], lo, (__m512bh)xs[r][0]);
            d[t][r] = _mm512_dpbf16_ps(d[t][r], hi, (__m512bh)xs[r][1]);
          }
        }
      }
      for (int t = 0; t < NT; t++) {
        const Scale* q = sm + (t0 * nb + b * NT + t) * 2 * TILE;
        const __m512 s = load16(q), m = _mm512_fmadd_ps(minus128, s, load16(q + TILE));
        for (int r = 0; r < R; r++)
          acc[t][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sxr[r * nb + b]), _mm512_fmadd_ps(d[t][r], s, acc[t][r]));
      }
    }
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * n + (t0 + t) * TILE, acc[t][r]);
  }
};

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

// x (M, K) bf16; w (N/16, K/2, 32) bf16 or int8 as cpu_decode.tiles_layout makes it. Returns y (M, N) fp32 (for
// int8, unscaled).
template <typename W>
at::Tensor pair_rows(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == 2 * TILE &&
                  w.scalar_type() == dtype && x.size(1) == 2 * w.size(1),
              what, ": x (M, K) bf16, w (N/16, K/2, 32) ", dtype);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0) * TILE}, x.options().dtype(at::kFloat));
  const PairTiles<W> kind{pairs(xc), reinterpret_cast<const W*>(wc.data_ptr()), w.size(1), y.data_ptr<float>(),
                          y.size(1)};
  products(kind, x.size(0), w.size(0));
  return y;
}

at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& w) {
  return pair_rows<at::BFloat16>(x, w, at::kBFloat16, "bf16_rows");
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w) { return pair_rows<int8_t>(x, w, at::kChar, "int8_rows"); }

// F.linear(x, w, bias) in bf16 through the tiles for at most max_rows rows, and through the plain weight w for more,
// where oneDNN's blocking wins: for a count of rows known only when it runs (compiled prefill's)
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& tiles,
                       const std::optional<at::Tensor>& bias, int64_t max_rows) {
  if (x.size(0) > max_rows) return at::linear(x, w, bias);
  at::Tensor y = bf16_rows(x, tiles);
  if (bias) y.add_(*bias);
  return y.to(at::kBFloat16);
}

template <typename Scale>
void int4_products(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm, at::Tensor& y) {
  const int64_t M = x.size(0), nb = w.size(1);
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  std::vector<float> sx(M * nb);  // each row's sum of each block of x
  for (int64_t i = 0; i < M * nb; i++)
    sx[i] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xb + i * 32), load16(xb + i * 32 + 16)));
  const Int4Tiles<Scale> kind{pairs(x), sx.data(), w.data_ptr<uint8_t>(), sm.data_ptr<Scale>(), nb,
                              w.size(0) * nb, y.data_ptr<float>(), y.size(1)};
  products(kind, M, w.size(0));
}

// x (M, K) bf16; w (N/16, K/32, 256) uint8 and sm (N/16, K/32, 2, 16) bf16 or fp16 as
// quantize.int4_rows_layout makes them. Returns y (M, N) fp32.
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == 256 &&
                  w.scalar_type() == at::kByte && sm.dim() == 4,
              "int4_rows: x (M, K) bf16, w (N/16, K/32, 256) uint8, sm (N/16, K/32, 2, 16)");
  TORCH_CHECK(x.size(1) == w.size(1) * 32 && sm.size(0) == w.size(0) && sm.size(1) == w.size(1),
              "int4_rows: shapes disagree");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), smc = sm.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0) * TILE}, x.options().dtype(at::kFloat));
  switch (sm.scalar_type()) {
    case at::kBFloat16: int4_products<at::BFloat16>(xc, wc, smc, y); break;
    case at::kHalf: int4_products<at::Half>(xc, wc, smc, y); break;
    default: TORCH_CHECK(false, "int4_rows: scales and mins in bf16 or fp16, not ", sm.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastllama, m) {
  m.def("bf16_rows(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, Tensor tiles, Tensor? bias, int max_rows) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor w, Tensor sm) -> Tensor");
  m.def("int8_rows(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastllama, CPU, m) {
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int4_rows", &int4_rows);
  m.impl("int8_rows", &int8_rows);
}
