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

// e^x for x <= 0 within 4e-4 relative (x below -87 gives e^-87): 2^(x log2 e) as 2^i times a
// degree-5 Taylor polynomial of 2^f, f in [0, 1). Only a weight for the bound (kSlack covers it).
__attribute__((always_inline)) inline float exp_le0(float x) {
  x = x > -87.0f ? x : -87.0f;  // a NaN too (its row is not checked)
  const float t = x * 1.44269504f;
  std::int32_t i = std::int32_t(t);  // toward zero; t <= 0, so floor is i or i - 1
  i -= std::int32_t(float(i) > t);
  const float f = t - float(i);
  const float p =
      1.0f +
      f * (0.693147182f +
           f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f + f * 0.00133335581f))));
  return p * std::bit_cast<float>((i + 127) << 23);
}

// bound[d] for d < hd: with w_j = e^(s_j - m) / l the window's softmax weights of channel d (m =
// mx[d], the scores' largest, and l = ls[d] = Σ_i e^(s_i - m): the pooling's own) and p =
// pooled[d],
//   bound[d] = kSlack · Σ_{written j} w_j · (E_kv,j + |kv_j − p| · E_g,j),
//   E_kv,j = κ a_j · nk_j + 2^-22 |kv_j|,  E_g,j = κ a_j · ng_j + 2^-22 (|s_j| + |ape_j|),
// a_j = 2^-24 max_k |x_n[t_j, k]|: the first-order change of Σ w_j kv_j when each written kv_j
// moves by E_kv,j and its score by E_g,j (∂/∂kv_j = w_j, ∂/∂s_j = w_j (kv_j − p)). E is the dot's
// bound plus two FP32 roundings (the kernel's and golden's; the score's sum with ape is rounded
// again). bound_r[d]: the same with κ_r for the RMS factor's bound.
__attribute__((always_inline)) inline void pool_bound_body(float* bound, float* bound_r,
                                                           const float* pooled, const float* mx,
                                                           const float* ls, const Written* wr,
                                                           int nw, index_t hd) {
  for (index_t d = 0; d < hd; ++d) bound[d] = 0.0f, bound_r[d] = 0.0f;
  for (int j = 0; j < nw; ++j) {
    const Written& w = wr[j];
    const float ax = kKappa * w.a, axr = kKappaR * w.a;
    for (index_t d = 0; d < hd; ++d) {
      const float e = exp_le0(w.score[d] - mx[d]);
      const float rk = 0x1p-22f * std::fabs(w.kv[d]);
      const float rg = 0x1p-22f * (std::fabs(w.score[d]) + std::fabs(w.ape[d]));
      const float dk = std::fabs(w.kv[d] - pooled[d]);
      bound[d] += e * ((ax * w.nk[d] + rk) + dk * (ax * w.ng[d] + rg));
      bound_r[d] += e * ((axr * w.nk[d] + rk) + dk * (axr * w.ng[d] + rg));
    }
  }
  for (index_t d = 0; d < hd; ++d) {
    bound[d] = bound[d] / ls[d] * kSlack;
    bound_r[d] = bound_r[d] / ls[d] * kSlack;
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
