#pragma once
// AVX2 + FMA microkernels of the compressors (spec §6), reached only through the runtime
// dispatch on ctx.isa in kernels/compressor.hpp. Each has a scalar twin there with the same
// loop structure; both are tested against golden/compressor.hpp.
//
//   compressor_project_rows   out[t, r] = Σ_k x[t, k] * w[r, k]   (BF16 weights, FP32 x/acc)
//   compressor_pool_channels  per-channel softmax-gated pooling over a window of state rows, in
//                             double (4 lanes; the avx512 tier's 8-lane twin is
//                             compressor_avx512.hpp)
//   compressor_hadamard_row   z = y @ H for one 128-wide indexer row, in double
//
// The three work on raw pointers with explicit leading dimensions: the caller validated every
// extent and stride, the kernels never check, allocate or throw.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

// Projection tasks own kCompressorRowBlock weight rows (24 × 8 KB at D = 4096); inside a task the
// rows run through the shared 3-row × 4-token BF16 micro-kernel (backend/cpu/bf16_rows_avx2.hpp,
// which also describes its streaming schedule). Every output is one lane-wise ascending-k FMA
// chain plus a fixed-order horizontal sum, whatever the tile, so results depend on the shape only.
inline constexpr int kCompressorRowBlock = 24;
inline constexpr int kCompressorTokenGroup = kBf16TileTokens;
// The pooling's e^x, x = s - m <= 0 in double (kernels/compressor.hpp "Pooling in double"): one
// definition of the operations, evaluated lane for lane by the scalar twin (pool_exp_f64), the AVX2
// (4 lanes) and the AVX-512 (8 lanes) kernels, so every tier gives the same bits:
//   x < kPoolExpLo (-708, e^-708 = 3.3e-308) -> 0 (a masked candidate; its weight next to the
//     maximum's e^0 = 1 is below 1e-307, under half a double ulp of the sum; no denormals);
//   t = fma(x, log2(e), 1.5 * 2^52 + 1023): t's low 12 bits are n + 1023 with n = round(x log2 e)
//     (nearest even, -1022 <= n <= 0), so t << 52 is 2^n; n = t - (1.5 * 2^52 + 1023) exactly;
//   r = fma(-n, ln2, x), |r| <= ln2/2 + 1e-16: one rounding, and ln2's own error (< 2.4e-17 · |n|)
//     is at most 2.4e-14 relative in e^r, 1e-15 for the |n| <= 40 a softmax meets;
//   e^r = Taylor of degree 10 by Horner in fma: truncation <= 0.3466^11 / 11! = 2.2e-13 relative,
//     plus ~1e-16 per step.
// Degree 9 (6.9e-12) was measured too: ~5 % faster HCA pooling on AVX2, but 11 of 524288 CSA
// values (2.1e-5) then missed the correctly rounded FP32 y against 0 of 524288 at degree 10
// (tests/test_rounding.cpp, no BF16 flip either way), so degree 10 stays.
// NaN in, NaN out (the clamp keeps a NaN operand, the underflow compare is false for it). The
// clamp and the mask change only lanes with x < kPoolExpLo, so a kernel that knows no lane is
// below it may leave them out (kClamp = false) and still give the same bits.
inline constexpr double kPoolExpLo = -708.0;
inline constexpr double kPoolExpMagic = 6755399441055744.0 + 1023.0;  // 1.5 * 2^52 + bias
inline constexpr double kPoolLog2e = 1.4426950408889634;
inline constexpr double kPoolLn2 = 0.6931471805599453;
inline constexpr int kPoolExpDegree = 10;
inline constexpr double kPoolExpC[kPoolExpDegree + 1] = {
    1.0,         1.0,          1.0 / 2.0,     1.0 / 6.0,      1.0 / 24.0,     1.0 / 120.0,
    1.0 / 720.0, 1.0 / 5040.0, 1.0 / 40320.0, 1.0 / 362880.0, 1.0 / 3628800.0};

// The scalar twin of avx2::exp_pd / avx512::exp_pd (same operations, std::fma is the vector FMA).
inline double pool_exp_f64(double x) {
  const bool under = x < kPoolExpLo;
  x = kPoolExpLo > x ? kPoolExpLo : x;  // _mm256_max_pd(lo, x): keeps a NaN x
  const double t = std::fma(x, kPoolLog2e, kPoolExpMagic);
  const double n = t - kPoolExpMagic;
  const double r = std::fma(-n, kPoolLn2, x);
  double p = kPoolExpC[kPoolExpDegree];
  for (int k = kPoolExpDegree - 1; k >= 0; --k) p = std::fma(p, r, kPoolExpC[k]);
  const double y = p * std::bit_cast<double>(std::bit_cast<std::uint64_t>(t) << 52);
  return under ? 0.0 : y;
}

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// pool_exp_f64 on 4 doubles (the same operations in the same order); kClamp = false leaves out
// the clamp and the underflow mask, for lanes known to be >= kPoolExpLo (or NaN).
template <bool kClamp>
TILEDECODE_TARGET_AVX2 inline __m256d exp_pd(__m256d x) {
  const __m256d lo = _mm256_set1_pd(kPoolExpLo);
  const __m256d magic = _mm256_set1_pd(kPoolExpMagic);
  __m256d under = _mm256_setzero_pd();
  if constexpr (kClamp) {
    under = _mm256_cmp_pd(x, lo, _CMP_LT_OQ);
    x = _mm256_max_pd(lo, x);
  }
  const __m256d t = _mm256_fmadd_pd(x, _mm256_set1_pd(kPoolLog2e), magic);
  const __m256d n = _mm256_sub_pd(t, magic);
  const __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(kPoolLn2), x);
  __m256d p = _mm256_set1_pd(kPoolExpC[kPoolExpDegree]);
  for (int k = kPoolExpDegree - 1; k >= 0; --k)  // unrolled: constant trip count
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(kPoolExpC[k]));
  const __m256d y =
      _mm256_mul_pd(p, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52)));
  if constexpr (kClamp) return _mm256_andnot_pd(under, y);
  return y;
}

// out[t*ld_out + r] = Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k] for t < n_tok, r < n_rows (d % 8 == 0).
// Rows [n_rows, n_rows_pf) of w exist and may be prefetched (the next task's rows).
TILEDECODE_TARGET_AVX2 inline void compressor_project_rows(float* out, index_t ld_out,
                                                           const float* x, index_t ld_x,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows, index_t d,
                                                           index_t n_rows_pf) {
  bf16_rows_dot<false>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, n_rows_pf);
}

// The sums of compressor_pool_channels for channels c .. c+7, candidates j0 .. j1 - 1 in ascending
// order.
template <bool kClamp>
TILEDECODE_TARGET_AVX2 inline void pool_sums(__m256d& l0, __m256d& l1, __m256d& a0, __m256d& a1,
                                             const float* const* kv, const float* const* score,
                                             int j0, int j1, index_t c, __m256d m0, __m256d m1) {
  for (int j = j0; j < j1; ++j) {
    // 4-float loads widened straight to double (no 128-bit extract: 7 % faster on SPR).
    const __m256d p0 =
        exp_pd<kClamp>(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(score[j] + c)), m0));
    const __m256d p1 =
        exp_pd<kClamp>(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(score[j] + c + 4)), m1));
    l0 = _mm256_add_pd(l0, p0);
    l1 = _mm256_add_pd(l1, p1);
    a0 = _mm256_fmadd_pd(p0, _mm256_cvtps_pd(_mm_loadu_ps(kv[j] + c)), a0);
    a1 = _mm256_fmadd_pd(p1, _mm256_cvtps_pd(_mm_loadu_ps(kv[j] + c + 4)), a1);
  }
}

// hi, lo of channels c .. c + 7 from the sums: pooled = acc / l as the FP32 pair.
TILEDECODE_TARGET_AVX2 inline void pool_store(float* hi, float* lo, index_t c, __m256d l0,
                                              __m256d l1, __m256d a0, __m256d a1) {
  const __m256d q0 = _mm256_div_pd(a0, l0), q1 = _mm256_div_pd(a1, l1);
  const __m128 h0 = _mm256_cvtpd_ps(q0), h1 = _mm256_cvtpd_ps(q1);
  _mm_storeu_ps(hi + c, h0);
  _mm_storeu_ps(hi + c + 4, h1);
  _mm_storeu_ps(lo + c, _mm256_cvtpd_ps(_mm256_sub_pd(q0, _mm256_cvtps_pd(h0))));
  _mm_storeu_ps(lo + c + 4, _mm256_cvtpd_ps(_mm256_sub_pd(q1, _mm256_cvtps_pd(h1))));
}

// pooled[c] = Σ_j e^{s_j[c] - m} kv_j[c] / Σ_j e^{s_j[c] - m} for c in [c0, c1) ((c1-c0) % 8 == 0),
// candidate j read at kv[j][c] and score[j][c], in double (kernels/compressor.hpp, "Pooling in
// double"): m = the FP32 max over the candidates (_mm256_max_ps(m, s), seeded with kNegBig), then
// in ascending j: p = exp_pd(double(s) - double(m)) (the difference is exact), l += p,
// acc = fma(p, double(kv), acc); pooled = acc / l, stored as the FP32 pair hi = float(pooled),
// lo = float(pooled - hi) (48 significant bits, 2^-48 relative, for the double norm that follows).
// Non-finite inputs (docs/security.md, "Numerics policy"): a NaN score or kv, or a +Inf score
// (e^(Inf - Inf)), makes the channel NaN (a NaN score may drop out of the max, its own e^ is NaN);
// a -Inf score has weight 0; a channel whose every score is -Inf pools to 0 / 0 = NaN, as golden.
// Masked candidates score kNegBig (weight e^(kNegBig - m) = 0 unless every score is kNegBig).
// With pre (the rounding check, backend/cpu/compressor.hpp): the sums after the candidates before
// j0 are kept, pre[2c .. 2c + 16) = l0, l1, acc0, acc1 of channels c .. c + 7, and the max over
// those candidates, mp[c .. c + 8) (compressor_pool_resume).
TILEDECODE_TARGET_AVX2 inline void compressor_pool_channels(
    float* hi, float* lo, const float* const* kv, const float* const* score, int n_cand, index_t c0,
    index_t c1, float* mx = nullptr, float* ls = nullptr, double* pre = nullptr,
    float* mp = nullptr, int j0 = 0) {
  const int jp = pre ? std::min(j0, n_cand) : 0;  // the sums kept after jp candidates
  for (index_t c = c0; c < c1; c += 8) {
    __m256 m8 = _mm256_set1_ps(kNegBig), n8 = _mm256_set1_ps(INFINITY);
    for (int j = 0; j < n_cand; ++j) {  // the max in ascending j (a NaN may drop out: the order)
      if (pre && j == jp) _mm256_storeu_ps(mp + c, m8);
      const __m256 s = _mm256_loadu_ps(score[j] + c);
      m8 = _mm256_max_ps(m8, s);
      n8 = _mm256_min_ps(n8, s);
    }
    if (pre && jp == n_cand) _mm256_storeu_ps(mp + c, m8);
    const __m256d m0 = _mm256_cvtps_pd(_mm256_castps256_ps128(m8));
    const __m256d m1 = _mm256_cvtps_pd(_mm256_extractf128_ps(m8, 1));
    // Every x = s - m of these 8 channels >= kPoolExpLo: exp_pd<false>, the same bits with 3 of
    // ~24 operations fewer (a NaN lane gives the same NaN either way). A masked (kNegBig) or -Inf
    // candidate sends the 8 channels to exp_pd<true>.
    const __m256d x_lo = _mm256_set1_pd(kPoolExpLo);
    const __m256d d0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(n8)), m0);
    const __m256d d1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(n8, 1)), m1);
    const bool in_range = (_mm256_movemask_pd(_mm256_cmp_pd(d0, x_lo, _CMP_GE_OQ)) &
                           _mm256_movemask_pd(_mm256_cmp_pd(d1, x_lo, _CMP_GE_OQ))) == 0xf;
    __m256d l0 = _mm256_setzero_pd(), l1 = _mm256_setzero_pd();
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    if (in_range)
      pool_sums<false>(l0, l1, a0, a1, kv, score, 0, jp, c, m0, m1);
    else
      pool_sums<true>(l0, l1, a0, a1, kv, score, 0, jp, c, m0, m1);
    if (pre) {
      _mm256_storeu_pd(pre + 2 * c, l0);
      _mm256_storeu_pd(pre + 2 * c + 4, l1);
      _mm256_storeu_pd(pre + 2 * c + 8, a0);
      _mm256_storeu_pd(pre + 2 * c + 12, a1);
    }
    if (in_range)
      pool_sums<false>(l0, l1, a0, a1, kv, score, jp, n_cand, c, m0, m1);
    else
      pool_sums<true>(l0, l1, a0, a1, kv, score, jp, n_cand, c, m0, m1);
    pool_store(hi, lo, c, l0, l1, a0, a1);
    if (mx) {  // the rounding check's softmax max and weight sum (backend/cpu/compressor.hpp)
      _mm256_storeu_ps(mx + c, m8);
      _mm_storeu_ps(ls + c, _mm256_cvtpd_ps(l0));
      _mm_storeu_ps(ls + c + 4, _mm256_cvtpd_ps(l1));
    }
  }
}

// compressor_pool_resume's test for channels c .. c + 7: the max over every candidate, as the
// pooling's kept max over those before j0 (mp, which did not change) continued over the rest in
// the same order (the bits of a pass over all of them, which an HCA window of 128 candidates, 1-2
// of them written, would read from 128 rows), into m8; whether it is still the pooling's max mx
// (the bits).
TILEDECODE_TARGET_AVX2 inline bool pool_max_kept(const float* const* score, int n_cand, index_t c,
                                                 int j0, const float* mp, const float* mx,
                                                 __m256& m8) {
  m8 = _mm256_loadu_ps(mp + c);
  for (int j = std::min(j0, n_cand); j < n_cand; ++j)
    m8 = _mm256_max_ps(m8, _mm256_loadu_ps(score[j] + c));
  const __m256i same =
      _mm256_cmpeq_epi32(_mm256_castps_si256(m8), _mm256_castps_si256(_mm256_loadu_ps(mx + c)));
  return _mm256_movemask_epi8(same) == -1;
}

// Channels c .. c + 7 pooled again after the candidates from j0 on changed (the rounding check's
// repairs), from the sums compressor_pool_channels kept there (pre, with its max mx): where the max
// over every candidate now is mx's (the bits), the sums before j0 are the ones a new pooling would
// make, so it resumes from them with the same additions in the same order:
// compressor_pool_channels' bits (exp_pd<true> gives exp_pd<false>'s bits where it is in range).
// The max: pool_max_kept. Returns false, and writes nothing, where the max moved.
TILEDECODE_TARGET_AVX2 inline bool compressor_pool_resume(float* hi, float* lo,
                                                          const float* const* kv,
                                                          const float* const* score, int n_cand,
                                                          index_t c, int j0, const double* pre,
                                                          const float* mp, const float* mx) {
  __m256 m8;
  if (!pool_max_kept(score, n_cand, c, j0, mp, mx, m8)) return false;
  __m256d l0 = _mm256_loadu_pd(pre + 2 * c), l1 = _mm256_loadu_pd(pre + 2 * c + 4);
  __m256d a0 = _mm256_loadu_pd(pre + 2 * c + 8), a1 = _mm256_loadu_pd(pre + 2 * c + 12);
  pool_sums<true>(l0, l1, a0, a1, kv, score, std::min(j0, n_cand), n_cand, c,
                  _mm256_cvtps_pd(_mm256_castps256_ps128(m8)),
                  _mm256_cvtps_pd(_mm256_extractf128_ps(m8, 1)));
  pool_store(hi, lo, c, l0, l1, a0, a1);
  return true;
}

// z[j] = Σ_i y[i] * h[i*ld_h + j] for j < n (n % 8 == 0), i ascending (row-vector times matrix),
// in double, rounded once to FP32: y is BF16-valued (the emit rounds it first) and h is BF16, so
// each product is exact in double and every tier's sum is the same (kernels/compressor.hpp).
TILEDECODE_TARGET_AVX2 inline void compressor_hadamard_row(float* z, const float* y, const bf16* h,
                                                           index_t ld_h, index_t n) {
  for (index_t j = 0; j < n; j += 8) {
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (index_t i = 0; i < n; ++i) {
      const __m256d yi = _mm256_set1_pd(double(y[i]));
      const __m256 h8 = load_bf16x8(h + i * ld_h + j);
      acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(yi, _mm256_cvtps_pd(_mm256_castps256_ps128(h8))));
      acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(yi, _mm256_cvtps_pd(_mm256_extractf128_ps(h8, 1))));
    }
    _mm_storeu_ps(z + j, _mm256_cvtpd_ps(acc0));
    _mm_storeu_ps(z + j + 4, _mm256_cvtpd_ps(acc1));
  }
}

}  // namespace tiledecode::cpu::avx2
#endif
