#pragma once
// AVX2 + FMA micro-kernel shared by the compressor projections (kernels/compressor.hpp) and the
// wo_a stage of the output projection (kernels/output_projection.hpp): a few tokens against many
// BF16 weight rows, both stored along the reduction dimension,
//   out[t, r] (= or +=) Σ_k x[t, k] · w[r, k]      FP32 x and accumulation, BF16 weights.
// Reached only through the runtime dispatch on ctx.isa; the scalar twin bf16_row_dot_scalar (below,
// compiled on every target) has the same summation order, so the tiers agree bit for bit.
//
// Summation order (two-level, for accuracy: the results are rounded to BF16 or INT8 downstream,
// where one FP32 ulp of error can become a whole BF16 ulp or INT8 step). x must hold BF16 values
// widened to FP32, so every product x·w is exact in FP32 (8 + 8 significant bits) and FMA or
// multiply-then-add give the same bits. For each output, lane l (k ≡ l mod 8) sums its products
// in FP32, in ascending k, over one block of kBf16DotBlock consecutive k (128 products per lane);
// the lane partial is then added to a double accumulator of that lane; at the end the eight
// double lanes are summed in ascending l and rounded once to FP32. Measured (tests/
// test_rounding.cpp: 131072 outputs, x ~ N(0,1), w ~ N(0, 1/64), D = 4096) — BF16 roundings of
// the result that differ from rounding the exact dot: 8 FP32 lanes over the whole row (the
// previous order) 1.9e-4; blocks of 1024: 7.6e-5; blocks of 256: 5.3e-5; all-double: 0. The
// flush of a block costs the FMA-bound tile a pipeline drain plus 2 conversions and 2 double
// adds per accumulator: on a Xeon (Sapphire Rapids) at T = 8 blocks of 256 made the compressors
// 16-18 % slower, blocks of 1024 2.6-4.2 % (o-proj 1.9 %), inside the 5 % budget.

#include <algorithm>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

inline constexpr int kBf16TileRows = 3;
inline constexpr int kBf16TileTokens = 4;
inline constexpr int kBf16PrefetchTriples = 2;  // the stream runs this many row triples ahead
inline constexpr int kBf16SelfPrefetch = 512;   // BF16 elements ahead (1 KB), first triples only
inline constexpr int kBf16DotBlock = 1024;      // k per FP32 lane partial (128 products per lane)

// Σ_{k<d} x[k] · w[k] in the two-level order above (d % 8 == 0), in double (the caller rounds).
inline double bf16_row_dot_scalar(const float* x, const bf16* w, index_t d) {
  double lanes[8] = {};
  for (index_t k0 = 0; k0 < d; k0 += kBf16DotBlock) {
    const index_t k1 = std::min<index_t>(d, k0 + kBf16DotBlock);
    float part[8] = {};
    for (index_t k = k0; k < k1; ++k) part[k % 8] += x[k] * w[k].to_float();
    for (int l = 0; l < 8; ++l) lanes[l] += double(part[l]);
  }
  double s = 0.0;
  for (double v : lanes) s += v;
  return s;
}

// The scalar twin of avx2::bf16_rows_dot (same results on every tier).
template <bool kAccumulate>
inline void bf16_rows_dot_scalar(float* out, index_t ld_out, const float* x, index_t ld_x,
                                 index_t n_tok, const bf16* w, index_t ld_w, index_t n_rows,
                                 index_t d) {
  for (index_t t = 0; t < n_tok; ++t)
    for (index_t r = 0; r < n_rows; ++r) {
      const double s = bf16_row_dot_scalar(x + t * ld_x, w + r * ld_w, d);
      float& o = out[t * ld_out + r];
      o = kAccumulate ? float(double(o) + s) : float(s);
    }
}

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

namespace bf16_rows_detail {

// Software prefetch issued by one pass of the register tile: rows [0, n_rows) of `w` (leading
// dimension ld_w), columns [k0, k1) spread evenly over the pass. n_rows == 0: none.
struct Prefetch {
  const bf16* w = nullptr;
  index_t ld_w = 0;
  int n_rows = 0;
  index_t k0 = 0, k1 = 0;
};

// One k-step of 8 of the NR × NT register tile.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void step(__m256 (&c)[NR][NT],
                                                                       const bf16* w, index_t ld_w,
                                                                       const float* x, index_t ld_x,
                                                                       index_t k) {
  __m256 v[NR];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r) v[r] = load_bf16x8(w + r * ld_w + k);
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    const __m256 xv = _mm256_loadu_ps(x + t * ld_x + k);
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r) c[r][t] = _mm256_fmadd_ps(v[r], xv, c[r][t]);
  }
}

// Issues the prefetches of `pf` that belong to k-step k of a pass over n.
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void prefetch_at(const Prefetch& pf,
                                                                              index_t k,
                                                                              index_t n) {
  const index_t pk = pf.k0 + k * (pf.k1 - pf.k0) / n;
  for (int r = 0; r < pf.n_rows; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(pf.w + r * pf.ld_w + pk), _MM_HINT_T0);
}

// Adds the FP32 lanes of c to the double lanes d[0..7] (one block's partials, see the top).
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void flush(__m256& c, double* d) {
  _mm256_store_pd(d, _mm256_add_pd(_mm256_load_pd(d), _mm256_cvtps_pd(_mm256_castps256_ps128(c))));
  _mm256_store_pd(
      d + 4, _mm256_add_pd(_mm256_load_pd(d + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1))));
  c = _mm256_setzero_ps();
}

// One block [k0, k1) of the register tile (k1 - k0 <= kBf16DotBlock, a multiple of 8): FP32 lane
// partials from +0 in registers, added to the double lanes at the end (the hot loop is the code
// of a whole-row pass). The prefetch schedule is that of the whole pass over n (k is absolute).
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 inline void tile_block(double (*lanes)[NT][8], const bf16* w, index_t ld_w,
                                              const float* x, index_t ld_x, index_t k0, index_t k1,
                                              index_t n, const Prefetch& ahead,
                                              const Prefetch& self) {
  __m256 c[NR][NT];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) c[r][t] = _mm256_setzero_ps();
  index_t k = k0;
  for (; k + 32 <= k1; k += 32) {
    prefetch_at(ahead, k, n);
    prefetch_at(self, k, n);
    step<NR, NT>(c, w, ld_w, x, ld_x, k);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 8);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 16);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 24);
  }
  for (; k < k1; k += 8) step<NR, NT>(c, w, ld_w, x, ld_x, k);
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) flush(c[r][t], lanes[r][t]);
}

// sums[r][t] = Σ_k w[r*ld_w + k] * x[t*ld_x + k], k < n (n % 8 == 0), in the two-level order
// (top of file). Meanwhile prefetches `ahead` (rows further on) and `self` (this tile's own rows,
// when nobody prefetched them) into L1.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 inline void tile(double (*sums)[kBf16TileTokens], const bf16* w,
                                        index_t ld_w, const float* x, index_t ld_x, index_t n,
                                        const Prefetch& ahead, const Prefetch& self) {
  alignas(32) double lanes[NR][NT][8] = {};
  for (index_t k = 0; k < n; k += kBf16DotBlock)
    tile_block<NR, NT>(lanes, w, ld_w, x, ld_x, k, std::min<index_t>(n, k + kBf16DotBlock), n,
                       ahead, self);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      double s = 0.0;
      for (int l = 0; l < 8; ++l) s += lanes[r][t][l];
      sums[r][t] = s;
    }
}

template <int NR>
TILEDECODE_TARGET_AVX2 inline void tile_nt(double (*sums)[kBf16TileTokens], int nt, const bf16* w,
                                           index_t ld_w, const float* x, index_t ld_x, index_t n,
                                           const Prefetch& ahead, const Prefetch& self) {
  switch (nt) {
    case 4:
      tile<NR, 4>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    case 3:
      tile<NR, 3>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    case 2:
      tile<NR, 2>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    default:
      tile<NR, 1>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
  }
}

// The pass shared by the tiers' bf16_rows_dot (x: float here, bf16 on the avx512 tier): row
// triples in order, each against every token group of kBf16TileTokens while its rows are in L1,
// with the software prefetch of the rows kBf16PrefetchTriples triples on (spread over the
// groups) and of the first triples' own rows; tile(sums, nr, nt, wr, xg, ahead, self) computes
// the nr × nt register tile into sums (double), which is then rounded once into out.
template <bool kAccumulate, class X, class Tile>
inline void bf16_rows_pass(float* out, index_t ld_out, const X* x, index_t ld_x, index_t n_tok,
                           const bf16* w, index_t ld_w, index_t n_rows, index_t d,
                           index_t n_rows_pf, Tile&& tile) {
  constexpr int NR = kBf16TileRows, G = kBf16TileTokens;
  const index_t n_groups = (n_tok + G - 1) / G;
  for (index_t r0 = 0; r0 < n_rows; r0 += NR) {
    const int nr = static_cast<int>(std::min<index_t>(NR, n_rows - r0));
    const bf16* wr = w + r0 * ld_w;
    const index_t r_pf = r0 + kBf16PrefetchTriples * NR;  // first row this triple prefetches
    const int n_pf = static_cast<int>(std::clamp<index_t>(n_rows_pf - r_pf, 0, NR));
    for (index_t g = 0; g < n_groups; ++g) {
      const index_t tg = g * G;
      const int nt = static_cast<int>(std::min<index_t>(G, n_tok - tg));
      const Prefetch ahead{w + r_pf * ld_w, ld_w, n_pf, g * d / n_groups, (g + 1) * d / n_groups};
      Prefetch self;  // the first triples of a call: nobody prefetched their rows
      if (r0 < kBf16PrefetchTriples * NR && g == 0)
        self = {wr, ld_w, nr, kBf16SelfPrefetch, d + kBf16SelfPrefetch};
      double sums[NR][G];
      tile(sums, nr, nt, wr, x + tg * ld_x, ahead, self);
      for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) {
          float& o = out[(tg + t) * ld_out + r0 + r];
          o = kAccumulate ? float(double(o) + sums[r][t]) : float(sums[r][t]);
        }
    }
  }
}

}  // namespace bf16_rows_detail

// out[t*ld_out + r] = float(Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k]) (with kAccumulate:
// float(double(out) + Σ)) for t < n_tok, r < n_rows, d % 8 == 0, in the two-level order. Rows
// [n_rows, n_rows_pf) of w exist and may be prefetched (the rows the caller's next call reads);
// pass n_rows_pf = n_rows when there are none.
template <bool kAccumulate>
TILEDECODE_TARGET_AVX2 inline void bf16_rows_dot(float* out, index_t ld_out, const float* x,
                                                 index_t ld_x, index_t n_tok, const bf16* w,
                                                 index_t ld_w, index_t n_rows, index_t d,
                                                 index_t n_rows_pf) {
  using namespace bf16_rows_detail;
  bf16_rows_pass<kAccumulate>(
      out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, n_rows_pf,
      [d, ld_w, ld_x](double(*sums)[kBf16TileTokens], int nr, int nt, const bf16* wr,
                      const float* xg, const Prefetch& ahead, const Prefetch& self)
          TILEDECODE_TARGET_AVX2 {
            if (nr == 3) {
              tile_nt<3>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
            } else if (nr == 2) {
              tile_nt<2>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
            } else {
              tile_nt<1>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
            }
          });
}

}  // namespace tiledecode::cpu::avx2
#endif
