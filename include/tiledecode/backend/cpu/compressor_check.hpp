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
__attribute__((always_inline)) inline void pool_bound_body(
    float* __restrict bound, float* __restrict bound_r, const float* __restrict pooled,
    const float* __restrict mx, const float* __restrict ls, const Written* wr, int nw, index_t hd) {
  for (index_t d = 0; d < 2 * hd; ++d) bound[d] = 0.0f, bound_r[d] = 0.0f;
  for (int j = 0; j < nw; ++j) {
    // Restrict-qualified copies: the loop below vectorizes (no alias checks between the outputs
    // and the candidate's rows).
    const float* __restrict kv = wr[j].kv;
    const float* __restrict score = wr[j].score;
    const float* __restrict nk = wr[j].nk;
    const float* __restrict ng = wr[j].ng;
    const float* __restrict ape = wr[j].ape;
    const float ax = kKappa * wr[j].a, axr = kKappaR * wr[j].a;
    for (index_t d = 0; d < hd; ++d) {
      const float e = exp_le0(score[d] - mx[d]);
      const float rk = 0x1p-22f * std::fabs(kv[d]);
      const float rg = 0x1p-22f * (std::fabs(score[d]) + std::fabs(ape[d]));
      const float dk = std::fabs(kv[d] - pooled[d]);
      bound[d] += e * (ax * nk[d] + rk);
      bound[hd + d] += e * (dk * (ax * ng[d] + rg));
      bound_r[d] += e * (axr * nk[d] + rk);
      bound_r[hd + d] += e * (dk * (axr * ng[d] + rg));
    }
  }
  for (index_t d = 0; d < 2 * hd; ++d) {
    bound[d] = bound[d] / ls[d % hd] * kSlack;
    bound_r[d] = bound_r[d] / ls[d % hd] * kSlack;
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

}  // namespace tiledecode::cpu::compressor_check
