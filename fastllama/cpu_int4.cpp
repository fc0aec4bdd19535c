// Weight-only int4 products on CPUs with AVX-512 BF16: y = x w^T for a few rows of x (bf16) and a weight of
// 4-bit levels q with a scale s and a min m each block of 32 inputs (w = s q + m, quantize.py's int4).
// quantize.py lays the weight out for it (int4_rows_layout) and chooses it over PyTorch's int4 kernel for
// CPUs, against which it takes 1.9x less time at many rows (prefill), 1.5x at six (a verify step) and about
// the same at one (benchmarks/RESULTS.md, "Int4 products of our own on CPU").
//
// How: the lanes of a vector are 16 outputs, and one vdpbf16ps adds a pair of inputs' products for all 16,
// 32 products an instruction. A level becomes a bf16 number without a conversion: 0x4300 | q is 128 + q
// exactly, so a block's sum is d = sum x (128 + q), and its part of y is s d + (m - 128 s) sum x, the sums of
// x a block computed once a call. The levels of two input pairs share a byte (low and high nibble), so one
// widening load and two bit operations unpack 64 of them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

#ifndef __AVX512BF16__
#error "cpu_int4.cpp needs AVX-512 BF16 (-march=native on a CPU that has it)"
#endif

namespace {

constexpr int64_t BLOCK = 32;        // inputs a scale and a min cover
constexpr int64_t TILE = 16;         // outputs a vector holds, one a lane
constexpr int64_t TILE_BYTES = 256;  // a tile's levels for one block: 8 chunks of 32 bytes
constexpr int MAX_ROWS = 4;          // rows a pass over the weight serves; more rows take more passes
constexpr int TILES = 4;             // tiles computed together, so that the sums' chains overlap

// 16 numbers as fp32: scales or mins, in the dtype the checkpoint holds them in (exact), or x
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// y[r, t * 16 + i] for the NT tiles of the group from tile t0 and R rows: levels w, scales and mins sm (each
// tile and block: 16 scales, then 16 mins), x's rows as bf16 pairs (32 bits each), sums of x's blocks sx (R
// rows of nb). A group's tiles lie block by block, so that the group is one stream through memory.
template <int R, int NT, typename Scale>
void tiles(const uint32_t* x, int64_t x_stride, const float* sx, const uint8_t* w, const Scale* sm, int64_t nb,
           int64_t t0, float* y, int64_t y_stride) {
  const __m512i low = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  __m512 acc[NT][R];
  for (int t = 0; t < NT; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    // one sum a tile and row, added in the same order however many rows there are: a row's numbers are
    // the same alone and in a batch (generate.py's promise in fp32)
    __m512 d[NT][R];
    for (int t = 0; t < NT; t++)
      for (int r = 0; r < R; r++) d[t][r] = _mm512_setzero_ps();
    for (int c = 0; c < 8; c++) {  // input pairs 2c (low nibbles) and 2c + 1 (high nibbles) of the block
      __m512i xs[R][2];
      for (int r = 0; r < R; r++) {
        xs[r][0] = _mm512_set1_epi32(x[r * x_stride + b * 16 + 2 * c]);
        xs[r][1] = _mm512_set1_epi32(x[r * x_stride + b * 16 + 2 * c + 1]);
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
        acc[t][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), _mm512_fmadd_ps(d[t][r], s, acc[t][r]));
    }
  }
  for (int t = 0; t < NT; t++)
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * y_stride + (t0 + t) * TILE, acc[t][r]);
}

template <int R, typename Scale>
void tiles_of(int nt, const uint32_t* x, int64_t x_stride, const float* sx, const uint8_t* w, const Scale* sm,
              int64_t nb, int64_t t0, float* y, int64_t y_stride) {
  switch (nt) {
    case 4: return tiles<R, 4>(x, x_stride, sx, w, sm, nb, t0, y, y_stride);
    case 3: return tiles<R, 3>(x, x_stride, sx, w, sm, nb, t0, y, y_stride);
    case 2: return tiles<R, 2>(x, x_stride, sx, w, sm, nb, t0, y, y_stride);
    default: return tiles<R, 1>(x, x_stride, sx, w, sm, nb, t0, y, y_stride);
  }
}

template <typename Scale>
void products(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), nt = w.size(0), nb = w.size(1), N = nt * TILE;
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb);
  std::vector<float> sx(M * nb);  // each row's sum of each block of x
  for (int64_t i = 0; i < M * nb; i++)
    sx[i] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xb + i * BLOCK), load16(xb + i * BLOCK + 16)));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const Scale* smp = sm.data_ptr<Scale>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (nt + TILES - 1) / TILES, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      const int64_t t0 = g * TILES;
      const int n = int(std::min<int64_t>(TILES, nt - t0));
      for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const uint32_t* xr = xp + r0 * (K / 2);
        const float* sxr = sx.data() + r0 * nb;
        float* yr = yp + r0 * N;
        switch (std::min<int64_t>(MAX_ROWS, M - r0)) {
          case 4: tiles_of<4>(n, xr, K / 2, sxr, wp, smp, nb, t0, yr, N); break;
          case 3: tiles_of<3>(n, xr, K / 2, sxr, wp, smp, nb, t0, yr, N); break;
          case 2: tiles_of<2>(n, xr, K / 2, sxr, wp, smp, nb, t0, yr, N); break;
          default: tiles_of<1>(n, xr, K / 2, sxr, wp, smp, nb, t0, yr, N);
        }
      }
    }
  });
}

// x (M, K) bf16; w (N/16, K/32, 256) uint8 and sm (N/16, K/32, 2, 16) bf16 or fp16 as
// quantize.int4_rows_layout makes them. Returns y (M, N) fp32.
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.size(2) == TILE_BYTES &&
                  w.scalar_type() == at::kByte && sm.dim() == 4,
              "int4_rows: x (M, K) bf16, w (N/16, K/32, 256) uint8, sm (N/16, K/32, 2, 16)");
  TORCH_CHECK(x.size(1) == w.size(1) * BLOCK && sm.size(0) == w.size(0) && sm.size(1) == w.size(1),
              "int4_rows: shapes disagree");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), smc = sm.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0) * TILE}, x.options().dtype(at::kFloat));
  switch (sm.scalar_type()) {
    case at::kBFloat16: products<at::BFloat16>(xc, wc, smc, y); break;
    case at::kHalf: products<at::Half>(xc, wc, smc, y); break;
    default: TORCH_CHECK(false, "int4_rows: scales and mins in bf16 or fp16, not ", sm.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastllama, m) { m.def("int4_rows(Tensor x, Tensor w, Tensor sm) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastllama, CPU, m) { m.impl("int4_rows", &int4_rows); }
