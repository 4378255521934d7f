#pragma once
// The compressors' rounding check (issue 17), its per-channel bound: how far the pooled value of a
// window can be from golden's pooled value of the same step inputs, given that some of the
// window's state values were written in this step by the default (FP32) dots. Caller and the rest
// of the check: backend/cpu/compressor.hpp ("Rounding check"). Compiled for each tier (one body:
// the compiler vectorizes its loops over channels for the tier's target); every operation is
// per channel, in a fixed order, so every tier gives the same bits.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/rounding_check.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu::compressor_check {

// The factor κ of a state value's error bound, as rounding_check::kKappa: |dot − exact| <= κ ·
// 2^-24 · max_k |x[k]| · |w| (measured at most 1.74 on the vdpbf16ps order and 2.23 on the FMA
// order, each over 4.2 million CSA compressor dots at the flash statistics).
inline constexpr float kKappa = 16.0f;
// The same factor in the RMS factor's bound (the root-sum-square of the channels' bounds,
// backend/cpu/compressor.hpp): measured |r / r_golden − 1| <= 0.42 of that bound at κ = 1 (FMA
// order; 0.30 vdpbf16ps), so κ_r = 4 leaves 9.5x above the largest.
inline constexpr float kKappaR = 4.0f;
// Relative slack on the bound for the approximate e^x below (<= 4e-4 relative), the FP32 weight
// sum, the first-order perturbation of the softmax (second-order terms ~1e-10) and the FP32 sums.
inline constexpr float kSlack = 1.0f + 0x1p-6f;

// A candidate of the window written in this step: its state values (kv[d], score[d] for channel
// d), its token's error scale a = 2^-24 · max_k |x_n[t, k]|, the norms of the weight rows that
// made them (nk[d]: wkv's, ng[d]: wgate's) and the ape term added to the score (ape[d]).
struct Written {
  const float* kv;
  const float* score;
  const float* nk;
  const float* ng;
  const float* ape;
  float a;
};

// e^x for x <= 0 within 4e-4 relative (x below -87 gives e^-87, x >= 0 and a NaN 1 or e^-87:
// such a row is not checked): 2^(x log2 e) as 2^i times the degree-5 Taylor polynomial of 2^f, i
// = trunc(x log2 e) and f in (-1, 0] (the alternating series' error <= (ln 2)^6 / 6! <= 1.6e-4,
// 3.1e-4 of 2^f >= 1/2). Only a weight for the bound (kSlack covers it). The clamps are integer
// selects on the bits and the rounding a truncation, so the tiers' loops vectorize it (a float
// compare or floor does not, under the default -ftrapping-math).
__attribute__((always_inline)) inline float exp_le0(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  u = u < 0x80000000u ? 0u : u;                           // sign clear (+0, > 0, NaN): 0
  u = u > 0xc2ae0000u ? 0xc2ae0000u : u;                  // below -87 (-Inf, a negative NaN): -87
  const float t = std::bit_cast<float>(u) * 1.44269504f;  // in [-125.6, 0]
  const std::int32_t i = std::int32_t(t);
  const float f = t - float(i);
  const float p =
      1.0f +
      f * (0.693147182f +
           f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f + f * 0.00133335581f))));
  return p * std::bit_cast<float>((i + 127) << 23);
}

// Candidate w's terms of the sums (First: the first candidate's, stored; else added).
template <bool First>
__attribute__((always_inline)) inline void pool_bound_candidate(float* __restrict bound,
                                                                float* __restrict bound_r,
                                                                const float* __restrict pooled,
                                                                const float* __restrict mx,
                                                                const Written& w, index_t hd) {
  // Restrict-qualified copies: the loop below vectorizes (no alias checks between the outputs and
  // the candidate's rows).
  const float* __restrict kv = w.kv;
  const float* __restrict score = w.score;
  const float* __restrict nk = w.nk;
  const float* __restrict ng = w.ng;
  const float* __restrict ape = w.ape;
  const float ax = kKappa * w.a, axr = kKappaR * w.a;
  for (index_t d = 0; d < hd; ++d) {
    const float e = exp_le0(score[d] - mx[d]);
    const float rk = 0x1p-22f * std::fabs(kv[d]);
    const float rg = 0x1p-22f * (std::fabs(score[d]) + std::fabs(ape[d]));
    const float dk = std::fabs(kv[d] - pooled[d]);
    const float b = e * (ax * nk[d] + rk), bg = e * (dk * (ax * ng[d] + rg));
    const float br = e * (axr * nk[d] + rk), bgr = e * (dk * (axr * ng[d] + rg));
    if constexpr (First) {
      bound[d] = b, bound[hd + d] = bg, bound_r[d] = br, bound_r[hd + d] = bgr;
    } else {
      bound[d] += b, bound[hd + d] += bg, bound_r[d] += br, bound_r[hd + d] += bgr;
    }
  }
}

// The bound of channel d < hd in two parts, its kv values' and its scores': with w_j = e^(s_j -
// m) / l the window's softmax weights of channel d (m = mx[d], the scores' largest, and l = ls[d]
// = Σ_i e^(s_i - m): the pooling's own) and p = pooled[d],
//   bound[d] = kSlack · Σ_{written j} w_j · E_kv,j,  bound[hd + d] = kSlack · Σ_{written j} w_j ·
//   |kv_j − p| · E_g,j,  E_kv,j = κ a_j · nk_j + 2^-22 |kv_j|,  E_g,j = κ a_j · ng_j + 2^-22
//   (|s_j| + |ape_j|),
// a_j = 2^-24 max_k |x_n[t_j, k]|: the first-order change of Σ w_j kv_j when each written kv_j
// moves by E_kv,j and its score by E_g,j (∂/∂kv_j = w_j, ∂/∂s_j = w_j (kv_j − p)); their sum is
// the channel's bound. E is the dot's bound plus two FP32 roundings (the kernel's and golden's;
// the score's sum with ape is rounded again). bound_r: the same with κ_r for the RMS factor's
// bound. bound and bound_r hold 2 hd values.
// The sums over the candidates, then times kSlack / ls[d] (one division a channel, its rounding
// far inside kSlack; Zen 3, 128 channels, two candidates: 540 cycles, 860 from a zeroed start
// with two divisions a value).
__attribute__((always_inline)) inline void pool_bound_body(
    float* __restrict bound, float* __restrict bound_r, const float* __restrict pooled,
    const float* __restrict mx, const float* __restrict ls, const Written* wr, int nw, index_t hd) {
  if (nw == 0) {
    for (index_t d = 0; d < 2 * hd; ++d) bound[d] = 0.0f, bound_r[d] = 0.0f;
    return;
  }
  pool_bound_candidate<true>(bound, bound_r, pooled, mx, wr[0], hd);
  for (int j = 1; j < nw; ++j) pool_bound_candidate<false>(bound, bound_r, pooled, mx, wr[j], hd);
  for (index_t d = 0; d < hd; ++d) {
    const float s = kSlack / ls[d];
    bound[d] *= s, bound[hd + d] *= s, bound_r[d] *= s, bound_r[hd + d] *= s;
  }
}

#if TILEDECODE_X86
TILEDECODE_TARGET_AVX512 inline void pool_bound_avx512(float* bound, float* bound_r,
                                                       const float* pooled, const float* mx,
                                                       const float* ls, const Written* wr, int nw,
                                                       index_t hd) {
  pool_bound_body(bound, bound_r, pooled, mx, ls, wr, nw, hd);
}
TILEDECODE_TARGET_AVX2 inline void pool_bound_avx2(float* bound, float* bound_r,
                                                   const float* pooled, const float* mx,
                                                   const float* ls, const Written* wr, int nw,
                                                   index_t hd) {
  pool_bound_body(bound, bound_r, pooled, mx, ls, wr, nw, hd);
}
#endif

inline void pool_bound(Isa isa, float* bound, float* bound_r, const float* pooled, const float* mx,
                       const float* ls, const Written* wr, int nw, index_t hd) {
#if TILEDECODE_X86
  if (isa == Isa::avx512) return pool_bound_avx512(bound, bound_r, pooled, mx, ls, wr, nw, hd);
  if (has_avx2(isa)) return pool_bound_avx2(bound, bound_r, pooled, mx, ls, wr, nw, hd);
#endif
  (void)isa;
  pool_bound_body(bound, bound_r, pooled, mx, ls, wr, nw, hd);
}

// The listing of the check (backend/cpu/compressor.hpp listed_channels, own_parts):
// rounding_check::list_bf16_row's test on the compressor's row, the same double arithmetic in the
// same order (so the same values listed), written as loops over the values that the tiers'
// targets vectorize. One value off the RoPE pairs: y = v, its scale s = |r · norm_w|, b its
// pooled value's bound (the parts counted).
__attribute__((always_inline)) inline std::int32_t value_splits(double v, double s, double b,
                                                                double rho) {
  return rounding_check::bf16_splits_i(v, s * b + std::fabs(v) * (rho + 0x1p-40));
}
// A RoPE pair (e, o): ye, yo, their scales se, so, bounds be, bo and |pooled| pe, po, rotated by
// nc = |cos|, ns = |sin|: U = s · b + |p| · s · ρ each, |cos| U_e + |sin| U_o + 2^-40 |y_e| and
// |sin| U_e + |cos| U_o + 2^-40 |y_o|. Bit 0: y_e's interval holds a boundary, bit 1: y_o's (either
// lists both values; own_parts reads which).
__attribute__((always_inline)) inline std::int32_t pair_splits(double ye, double yo, double nc,
                                                               double ns, double se, double so,
                                                               double be, double bo, double pe,
                                                               double po, double rho) {
  const double ue = se * be + pe * se * rho, uo = so * bo + po * so * rho;
  return rounding_check::bf16_splits_i(ye, nc * ue + ns * uo + std::fabs(ye) * 0x1p-40) |
         rounding_check::bf16_splits_i(yo, ns * ue + nc * uo + std::fabs(yo) * 0x1p-40) << 1;
}
// Whether a value v whose FP32 y is yf = float(v) may lie within W of a BF16 rounding boundary,
// given w, W computed in FP32 (a few FP32 roundings: w >= W / (1 + 2^-20)): the cheap first pass
// of list_row_body, in FP32 and integer operations that the tiers vectorize, and conservative.
// bf16(fp32(t)) changes only where fp32(t) passes a BF16 midpoint M (an FP32 value whose low 16
// bits are 0x8000), within half an FP32 ulp of M. In yf's binade (exponent field E, ulp 2^(E −
// 150)) the M in yf's 2^16-ulp segment is dm = |low16(yf) − 0x8000| ulps away, those of the
// segments beside it at least 2^15 ulps, and the last M of the binade below (half the ulp), where
// yf's segment is the binade's first, at least 2^14 (the binade above has twice the ulp). So
// every change point is at least min(dm, 2^14) − 1/2 ulps from yf, and v (within half an ulp of
// yf) at least min(dm, 2^14) − 1 from each: the double test (bf16_splits_i, its interval v ± W
// rounded in double, far inside an ulp) lists v only where W reaches that. Not near (0) where
// (min(dm, 2^14) − 2) ulps exceed w (1 + 2^-10) (an ulp, which also covers w's subnormal
// roundings, and 2^-10 of w to spare); near (1) otherwise, for E < 25 (the ulp below a float's
// normal range), E = 255 and a NaN w.
__attribute__((always_inline)) inline std::int32_t maybe_near(float yf, float w) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(yf) & 0x7fffffffu;
  const std::int32_t e = std::int32_t(u >> 23);
  const std::int32_t dm = std::min(std::abs(std::int32_t(u & 0xffffu) - 0x8000), 0x4000) - 2;
  const std::int32_t ok = std::int32_t(e >= 25) & std::int32_t(e < 255);  // no branches: vectors
  const float ulp = std::bit_cast<float>(std::uint32_t(std::max(e - 23, 1)) << 23);  // 2^(E − 150)
  return 1 - (ok & std::int32_t(float(dm) * ulp > w * (1.0f + 0x1p-10f)));
}

// hit[i] != 0 where value i of y (y + y_lo) is listed: own_i = |r · nw_i| · (b_i + b_{hd+i})
// (b: bound, both parts), u_i = |p_i| · |r · nw_i| (p: pooled + plo), Y_i = own_i + |y_i| (ρ +
// 2^-40) off the RoPE pairs; a pair (e, o) of the last rope values, rotated by |cos|, |sin| at
// cs[k], sn[k]: U = own + u ρ each, |cos| U_e + |sin| U_o + 2^-40 |y_e| and |sin| U_e + |cos| U_o
// + 2^-40 |y_o|, both values flagged where either splits. Two passes: maybe_near on the FP32 y
// with Y in FP32 (its few FP32 roundings, each 2^-24 relative, are inside maybe_near's 2^-10), then
// the double test (bf16_splits_i) on the values it keeps. Zen 3, 128 values (64 of them RoPE
// pairs), none near a boundary: 580 cycles in the double test alone, 290 in both passes. On
// bench_compressor's live inner windows the first pass keeps 1.56 values a listing where the double
// test lists 1.37 (7.9 when it measured twice Y in half ulps): 310 + 280 cycles a listing for the
// two passes (with the scan of the flags), from 360 + 570.
__attribute__((always_inline)) inline void list_row_body(
    std::int32_t* __restrict hit, const float* __restrict y, const float* __restrict y_lo,
    const float* __restrict pooled, const float* __restrict plo, const float* __restrict bound,
    const float* __restrict nw, double r, double rho, const bf16* __restrict cs,
    const bf16* __restrict sn, index_t hd, index_t rope) {
  const index_t nope = hd - rope;
  const float rf = float(r), rhof = float(rho) + 0x1p-40f;
  for (index_t i = 0; i < nope; ++i) {
    const float w = std::fabs(rf * nw[i]) * (bound[i] + bound[hd + i]) + std::fabs(y[i]) * rhof;
    hit[i] = maybe_near(y[i], w);
  }
  for (index_t k = 0; k < rope / 2; ++k) {
    const index_t e = nope + 2 * k, o = e + 1;
    const float nc = std::fabs(cs[k].to_float()), ns = std::fabs(sn[k].to_float());
    const float se = std::fabs(rf * nw[e]), so = std::fabs(rf * nw[o]);
    const float ue = se * (bound[e] + bound[hd + e]) + std::fabs(pooled[e]) * se * rhof;
    const float uo = so * (bound[o] + bound[hd + o]) + std::fabs(pooled[o]) * so * rhof;
    const float we = nc * ue + ns * uo + std::fabs(y[e]) * 0x1p-40f;
    const float wo = ns * ue + nc * uo + std::fabs(y[o]) * 0x1p-40f;
    const std::int32_t h = maybe_near(y[e], we) | maybe_near(y[o], wo);
    hit[e] = h;
    hit[o] = h;
  }
  // The double test of the flagged values of the block [i0, i0 + 8) (a pair: from its even value).
  const auto pass2 = [&](index_t i0) {
    for (index_t i = i0; i < i0 + 8; ++i) {
      if (!hit[i]) continue;
      if (i < nope) {
        hit[i] = value_splits(double(y[i]) + double(y_lo[i]), std::fabs(r * double(nw[i])),
                              double(bound[i]) + double(bound[hd + i]), rho);
        continue;
      }
      const index_t e = i - (i - nope) % 2, o = e + 1, k = (e - nope) / 2;
      if (e != i) continue;  // the pair's odd value: with its even one
      const double nc = std::fabs(double(cs[k].to_float())),
                   ns = std::fabs(double(sn[k].to_float()));
      const std::int32_t h = pair_splits(
          double(y[e]) + double(y_lo[e]), double(y[o]) + double(y_lo[o]), nc, ns,
          std::fabs(r * double(nw[e])), std::fabs(r * double(nw[o])),
          double(bound[e]) + double(bound[hd + e]), double(bound[o]) + double(bound[hd + o]),
          std::fabs(double(pooled[e]) + double(plo[e])),
          std::fabs(double(pooled[o]) + double(plo[o])), rho);
      hit[e] = h;
      hit[o] = h;
    }
  };
  for (index_t i0 = 0; i0 < hd; i0 += 8) {  // blocks of 8 flags (hd % 8 == 0), almost all 0
    std::int32_t any = 0;
    for (index_t i = i0; i < i0 + 8; ++i) any |= hit[i];
    if (any) pass2(i0);
  }
}

#if TILEDECODE_X86
// The AVX-512 tier runs it too (its loops are short; 256-bit vectors).
TILEDECODE_TARGET_AVX2 inline void list_row_avx2(std::int32_t* hit, const float* y,
                                                 const float* y_lo, const float* pooled,
                                                 const float* plo, const float* bound,
                                                 const float* nw, double r, double rho,
                                                 const bf16* cs, const bf16* sn, index_t hd,
                                                 index_t rope) {
  list_row_body(hit, y, y_lo, pooled, plo, bound, nw, r, rho, cs, sn, hd, rope);
}
#endif

inline void list_row(Isa isa, std::int32_t* hit, const float* y, const float* y_lo,
                     const float* pooled, const float* plo, const float* bound, const float* nw,
                     double r, double rho, const bf16* cs, const bf16* sn, index_t hd,
                     index_t rope) {
#if TILEDECODE_X86
  if (isa == Isa::avx512 || has_avx2(isa))
    return list_row_avx2(hit, y, y_lo, pooled, plo, bound, nw, r, rho, cs, sn, hd, rope);
#endif
  (void)isa;
  list_row_body(hit, y, y_lo, pooled, plo, bound, nw, r, rho, cs, sn, hd, rope);
}

// The RMS factor's sums of the check (listed_channels): ss = Σ p_i², q = Σ (p_i · (b_i +
// b_{hd+i}))² over i < hd (hd % 4 == 0; p = pooled + plo, b: bound_r), each in four chains over i
// mod 4 added as (0 + 1) + (2 + 3): a fixed order (rho_sums_avx2: the chains as one vector).
__attribute__((always_inline)) inline void rho_sums_body(const float* __restrict pooled,
                                                         const float* __restrict plo,
                                                         const float* __restrict br, index_t hd,
                                                         double* ss, double* q) {
  double s4[4] = {}, q4[4] = {};
  for (index_t i = 0; i < hd; i += 4)
    for (int l = 0; l < 4; ++l) {
      const double p = double(pooled[i + l]) + double(plo[i + l]);
      const double e = p * (double(br[i + l]) + double(br[hd + i + l]));
      s4[l] += p * p;
      q4[l] += e * e;
    }
  *ss = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  *q = (q4[0] + q4[1]) + (q4[2] + q4[3]);
}

#if TILEDECODE_X86
// rho_sums_body's chains as the lanes of one vector (the compiler keeps them scalar): the same
// operations per lane, so the same bits. The AVX-512 tier runs it too.
TILEDECODE_TARGET_AVX2 inline __m256d load4_pd(const float* x) {
  return _mm256_cvtps_pd(_mm_loadu_ps(x));
}
TILEDECODE_TARGET_AVX2 inline void rho_sums_avx2(const float* pooled, const float* plo,
                                                 const float* br, index_t hd, double* ss,
                                                 double* q) {
  __m256d s4 = _mm256_setzero_pd(), q4 = _mm256_setzero_pd();
  for (index_t i = 0; i < hd; i += 4) {
    const __m256d p = _mm256_add_pd(load4_pd(pooled + i), load4_pd(plo + i));
    const __m256d e = _mm256_mul_pd(p, _mm256_add_pd(load4_pd(br + i), load4_pd(br + hd + i)));
    s4 = _mm256_add_pd(s4, _mm256_mul_pd(p, p));
    q4 = _mm256_add_pd(q4, _mm256_mul_pd(e, e));
  }
  alignas(32) double a[4], b[4];
  _mm256_store_pd(a, s4);
  _mm256_store_pd(b, q4);
  *ss = (a[0] + a[1]) + (a[2] + a[3]);
  *q = (b[0] + b[1]) + (b[2] + b[3]);
}
#endif
inline void rho_sums(Isa isa, const float* pooled, const float* plo, const float* br, index_t hd,
                     double* ss, double* q) {
#if TILEDECODE_X86
  if (isa == Isa::avx512 || has_avx2(isa)) return rho_sums_avx2(pooled, plo, br, hd, ss, q);
#endif
  (void)isa;
  rho_sums_body(pooled, plo, br, hd, ss, q);
}

}  // namespace tiledecode::cpu::compressor_check
