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
// order over 1.6 million compressor dots, flash statistics).
inline constexpr float kKappa = 16.0f;
// Relative slack on the bound for the approximate e^x below (<= 4e-4 relative), the first-order
// perturbation of the softmax (the weights' second-order terms are ~1e-10) and the FP32 sums.
inline constexpr float kSlack = 1.0f + 0x1p-6f;

// A candidate of the window written in this step: its state values (kv[d], score[d] for channel
// d), its token's error scale ax = κ · 2^-24 · max_k |x_n[t, k]|, the norms of the weight rows that
// made them (nk[d]: wkv's, ng[d]: wgate's) and the ape term added to the score (ape[d]).
struct Written {
  const float* kv;
  const float* score;
  const float* nk;
  const float* ng;
  const float* ape;
  float ax;
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

// bound[d] for d < hd: with w_j = e^(s_j - m) / Σ_i e^(s_i - m) the window's softmax weights of
// channel d (scores sc[0 .. n), m their largest) and p = pooled[d],
//   bound[d] = kSlack · Σ_{written j} w_j · (E_kv,j + |kv_j − p| · E_g,j),
//   E_kv,j = ax_j · nk_j + 2^-22 |kv_j|,  E_g,j = ax_j · ng_j + 2^-22 (|s_j| + |ape_j|):
// the first-order change of Σ w_j kv_j when each written kv_j moves by E_kv,j and its score by
// E_g,j (∂/∂kv_j = w_j, ∂/∂s_j = w_j (kv_j − p)). E is the dot's bound plus two FP32 roundings
// (the kernel's and golden's; the score's sum with ape is rounded again).
__attribute__((always_inline)) inline void pool_bound_body(float* bound, const float* pooled,
                                                           const float* const* sc, int n,
                                                           const Written* wr, int nw, index_t hd) {
  constexpr index_t kB = 64;
  for (index_t d0 = 0; d0 < hd; d0 += kB) {
    const index_t m = std::min(kB, hd - d0);
    float mx[kB], l[kB], acc[kB];
    for (index_t i = 0; i < m; ++i) mx[i] = -3.40282347e38f, l[i] = 0.0f, acc[i] = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float* s = sc[j] + d0;
      for (index_t i = 0; i < m; ++i) mx[i] = mx[i] > s[i] ? mx[i] : s[i];
    }
    for (int j = 0; j < n; ++j) {
      const float* s = sc[j] + d0;
      for (index_t i = 0; i < m; ++i) l[i] += exp_le0(s[i] - mx[i]);
    }
    for (int j = 0; j < nw; ++j) {
      const Written& w = wr[j];
      for (index_t i = 0; i < m; ++i) {
        const index_t d = d0 + i;
        const float e = exp_le0(w.score[d] - mx[i]);
        const float ek = w.ax * w.nk[d] + 0x1p-22f * std::fabs(w.kv[d]);
        const float eg = w.ax * w.ng[d] + 0x1p-22f * (std::fabs(w.score[d]) + std::fabs(w.ape[d]));
        acc[i] += e * (ek + std::fabs(w.kv[d] - pooled[d]) * eg);
      }
    }
    for (index_t i = 0; i < m; ++i) bound[d0 + i] = acc[i] / l[i] * kSlack;
  }
}

#if TILEDECODE_X86
TILEDECODE_TARGET_AVX512 inline void pool_bound_avx512(float* bound, const float* pooled,
                                                       const float* const* sc, int n,
                                                       const Written* wr, int nw, index_t hd) {
  pool_bound_body(bound, pooled, sc, n, wr, nw, hd);
}
TILEDECODE_TARGET_AVX2 inline void pool_bound_avx2(float* bound, const float* pooled,
                                                   const float* const* sc, int n, const Written* wr,
                                                   int nw, index_t hd) {
  pool_bound_body(bound, pooled, sc, n, wr, nw, hd);
}
#endif

inline void pool_bound(Isa isa, float* bound, const float* pooled, const float* const* sc, int n,
                       const Written* wr, int nw, index_t hd) {
#if TILEDECODE_X86
  if (isa == Isa::avx512) return pool_bound_avx512(bound, pooled, sc, n, wr, nw, hd);
  if (has_avx2(isa)) return pool_bound_avx2(bound, pooled, sc, n, wr, nw, hd);
#endif
  (void)isa;
  pool_bound_body(bound, pooled, sc, n, wr, nw, hd);
}

// The largest |x| of a BF16 row, as a float (+Inf or NaN bits for a non-finite one).
inline float bf16_abs_max(const std::uint16_t* x, index_t k) {
  std::uint16_t m = 0;
  for (index_t i = 0; i < k; ++i) m = std::max<std::uint16_t>(m, x[i] & 0x7fff);
  return std::bit_cast<float>(std::uint32_t(m) << 16);
}

}  // namespace tiledecode::cpu::compressor_check
