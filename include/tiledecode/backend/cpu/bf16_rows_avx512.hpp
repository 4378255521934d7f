#pragma once
// The BF16-row micro-kernel on the AVX-512 tier (Isa::avx512): avx2::bf16_rows_dot's contract
// with the activations in BF16 as well, on vdpbf16ps (AVX512_BF16: 32 BF16 pairs per instruction,
// 2 FLOP per pair, twice the FP32 FMA rate on Zen 4 where 512-bit FMA is double-pumped),
//   out[t, r] (= or +=) Σ_k x[t, k] · w[r, k]      BF16 x and w, FP32 then double accumulation.
// Used by the output projection's wo_a stage (its activations are o_packed, BF16 already).
//
// Summation order (two-level, as avx2::bf16_rows_dot; it is not that kernel's order, so this tier
// is not bit-identical to avx2 here: tested against golden and for rounding accuracy instead).
// Lane l (16 lanes) of an accumulator gets the pairs k = 32j + 2l, 32j + 2l + 1: vdpbf16ps adds
// the two products to the lane one after the other (each product of two BF16 values is exact in
// FP32, each addition rounds to nearest even), over one block of kBf16DotBlock k (64 products
// per lane); the lane partial is then added to a double accumulator of that lane, and at the end
// the 16 double lanes are summed in ascending l and rounded once to FP32. Unlike the FMA tiers
// vdpbf16ps treats subnormal inputs and results as zero (DAZ / FTZ, a documented difference of
// this tier: docs/security.md); NaN and ±Inf propagate as in IEEE arithmetic. Reached only after
// the runtime ISA check.

#include <algorithm>
#include <cstdint>

#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

namespace bf16_rows_detail {

using avx2::bf16_rows_detail::Prefetch;
using avx2::bf16_rows_detail::prefetch_at;

// The BF16 elements [k, k + 32) of a row, zero past n (the masked tail; a zero pair adds +0).
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512bh load32(const bf16* p,
                                                                               index_t k,
                                                                               index_t n) {
  const __mmask32 m = k + 32 <= n ? ~__mmask32{0} : __mmask32((1u << (n - k)) - 1u);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p + k);
}

// One block [k0, k1) of the NR × NT register tile (k1 - k0 <= kBf16DotBlock): FP32 lane partials
// from +0, added to the double lanes at the end. The prefetch schedule is that of the pass over n.
template <int NR, int NT>
TILEDECODE_TARGET_AVX512 inline void tile_block(double (*lanes)[NT][16], const bf16* w,
                                                index_t ld_w, const bf16* x, index_t ld_x,
                                                index_t k0, index_t k1, index_t n,
                                                const Prefetch& ahead, const Prefetch& self) {
  __m512 c[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) c[r][t] = _mm512_setzero_ps();
  for (index_t k = k0; k < k1; k += 32) {
    prefetch_at(ahead, k, n);  // once per 32 k, as the avx2 kernel
    prefetch_at(self, k, n);
    __m512bh v[NR];
    for (int r = 0; r < NR; ++r) v[r] = load32(w + r * ld_w, k, k1);
    for (int t = 0; t < NT; ++t) {
      const __m512bh xv = load32(x + t * ld_x, k, k1);
      for (int r = 0; r < NR; ++r) c[r][t] = _mm512_dpbf16_ps(c[r][t], v[r], xv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      double* d = lanes[r][t];
      _mm512_storeu_pd(
          d, _mm512_add_pd(_mm512_loadu_pd(d), _mm512_cvtps_pd(_mm512_castps512_ps256(c[r][t]))));
      _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8),
                                            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                                                _mm512_castps_pd(c[r][t]), 1)))));
    }
}

// sums[r][t] = Σ_k w[r*ld_w + k] * x[t*ld_x + k], k < n, in the order at the top.
template <int NR, int NT>
TILEDECODE_TARGET_AVX512 inline void tile(double (*sums)[kBf16TileTokens], const bf16* w,
                                          index_t ld_w, const bf16* x, index_t ld_x, index_t n,
                                          const Prefetch& ahead, const Prefetch& self) {
  alignas(64) double lanes[NR][NT][16] = {};
  for (index_t k = 0; k < n; k += kBf16DotBlock)
    tile_block<NR, NT>(lanes, w, ld_w, x, ld_x, k, std::min<index_t>(n, k + kBf16DotBlock), n,
                       ahead, self);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      double s = 0.0;
      for (int l = 0; l < 16; ++l) s += lanes[r][t][l];
      sums[r][t] = s;
    }
}

}  // namespace bf16_rows_detail

// out[t*ld_out + r] = float(Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k]) (with kAccumulate:
// float(double(out) + Σ)) for t < n_tok, r < n_rows, d even, in the order at the top; rows
// [n_rows, n_rows_pf) of w may be prefetched (avx2::bf16_rows_dot's contract, BF16 x).
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot(float* out, index_t ld_out, const bf16* x,
                                                   index_t ld_x, index_t n_tok, const bf16* w,
                                                   index_t ld_w, index_t n_rows, index_t d,
                                                   index_t n_rows_pf) {
  using namespace bf16_rows_detail;
  avx2::bf16_rows_detail::bf16_rows_pass<kAccumulate>(
      out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, n_rows_pf,
      [d, ld_w, ld_x](double(*sums)[kBf16TileTokens], int nr, int nt, const bf16* wr,
                      const bf16* xg, const Prefetch& ahead, const Prefetch& self)
          TILEDECODE_TARGET_AVX512 {
            with_static_count<kBf16TileRows>(nr, [&]<int R>() TILEDECODE_TARGET_AVX512 {
              with_static_count<kBf16TileTokens>(nt, [&]<int N>() TILEDECODE_TARGET_AVX512 {
                tile<R, N>(sums, wr, ld_w, xg, ld_x, d, ahead, self);
              });
            });
          });
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
