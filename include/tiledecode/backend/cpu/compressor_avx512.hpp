#pragma once
// AVX-512 pooling of the compressors (Isa::avx512): avx2::compressor_pool_channels on 8 double
// lanes instead of 4. The operations and their order per lane are those of the AVX2 kernel and of
// the scalar twin (pool_exp_f64, kernels/compressor.hpp "Pooling in double"), so the three tiers
// give the same bits; only the width differs (one 512-bit op per 8 channels where AVX2 needs two
// 256-bit ones: the double exp is the pooling's cost, docs/compressors.md has the measurements).
// Reached only through the runtime dispatch on ctx.isa; never checks, allocates or throws.

#include <cstdint>

#include "tiledecode/backend/cpu/compressor_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// pool_exp_f64 on 8 doubles (avx2::exp_pd, lane for lane; kClamp as there).
template <bool kClamp>
TILEDECODE_TARGET_AVX512 inline __m512d exp_pd(__m512d x) {
  const __m512d lo = _mm512_set1_pd(kPoolExpLo);
  const __m512d magic = _mm512_set1_pd(kPoolExpMagic);
  __mmask8 under = 0;
  if constexpr (kClamp) {
    under = _mm512_cmp_pd_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_pd(lo, x);
  }
  const __m512d t = _mm512_fmadd_pd(x, _mm512_set1_pd(kPoolLog2e), magic);
  const __m512d n = _mm512_sub_pd(t, magic);
  const __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(kPoolLn2), x);
  __m512d p = _mm512_set1_pd(kPoolExpC[kPoolExpDegree]);
  for (int k = kPoolExpDegree - 1; k >= 0; --k)  // unrolled: constant trip count
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kPoolExpC[k]));
  const __m512d y =
      _mm512_mul_pd(p, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 52)));
  if constexpr (kClamp) return _mm512_maskz_mov_pd(__mmask8(~under), y);
  return y;
}

// The sums of compressor_pool_channels for channels c .. c+7, candidates in ascending order.
template <bool kClamp>
TILEDECODE_TARGET_AVX512 inline void pool_sums(__m512d& l, __m512d& acc, const float* const* kv,
                                               const float* const* score, int n_cand, index_t c,
                                               __m512d m) {
  for (int j = 0; j < n_cand; ++j) {
    const __m512d p =
        exp_pd<kClamp>(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(score[j] + c)), m));
    l = _mm512_add_pd(l, p);
    acc = _mm512_fmadd_pd(p, _mm512_cvtps_pd(_mm256_loadu_ps(kv[j] + c)), acc);
  }
}

// avx2::compressor_pool_channels, 8 channels per double vector ((c1 - c0) % 8 == 0).
TILEDECODE_TARGET_AVX512 inline void compressor_pool_channels(float* hi, float* lo,
                                                              const float* const* kv,
                                                              const float* const* score, int n_cand,
                                                              index_t c0, index_t c1) {
  for (index_t c = c0; c < c1; c += 8) {
    __m256 m8 = _mm256_set1_ps(kNegBig), n8 = _mm256_set1_ps(INFINITY);
    for (int j = 0; j < n_cand; ++j) {
      const __m256 s = _mm256_loadu_ps(score[j] + c);
      m8 = _mm256_max_ps(m8, s);
      n8 = _mm256_min_ps(n8, s);
    }
    const __m512d m = _mm512_cvtps_pd(m8);
    // As avx2: every x >= kPoolExpLo takes the clamp-free exp (the same bits).
    const bool in_range = _mm512_cmp_pd_mask(_mm512_sub_pd(_mm512_cvtps_pd(n8), m),
                                             _mm512_set1_pd(kPoolExpLo), _CMP_GE_OQ) == 0xff;
    __m512d l = _mm512_setzero_pd(), acc = _mm512_setzero_pd();
    if (in_range)
      pool_sums<false>(l, acc, kv, score, n_cand, c, m);
    else
      pool_sums<true>(l, acc, kv, score, n_cand, c, m);
    const __m512d q = _mm512_div_pd(acc, l);
    const __m256 h = _mm512_cvtpd_ps(q);
    _mm256_storeu_ps(hi + c, h);
    _mm256_storeu_ps(lo + c, _mm512_cvtpd_ps(_mm512_sub_pd(q, _mm512_cvtps_pd(h))));
  }
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
