#pragma once
// BF16 dots rounded once to FP32 with golden's bits, in a faster order (issue 17: the compressors'
// rounding check's repairs, backend/cpu/compressor.hpp repair_parts).
//
// out = float(s), s = bf16_dot_exact(x, w, d): the ascending double sum of bf16_exact.hpp (the
// compressor golden's own loop), rounded to FP32. The few-token kernel there keeps that order with
// the lanes on rows, so each 8 × 8 block of weights is transposed before it is widened. Here the
// lanes are on k instead (no transpose): each dot is 4U lanes of doubles (U = 4 vectors for one or
// two tokens, 2 for three or four), lane l summing the products of k ≡ l (mod 4U) in ascending k
// by multiply-adds, then a fixed tree (the vectors pairwise, then the lanes pairwise) and the last
// d mod 4U products in ascending k. That sum s' is not golden's s, so it is certified:
//   * each product of two BF16 values (8 significant bits each) is exact in double, so s and s'
//     differ only by their additions' roundings. s has at most d − 1 of them on any product's
//     path, s' at most d / 8 + 19 (d / 4U in a lane, 4 in the tree, 4U − 1 in the tail), so
//     |s − s'| <= (d + d / 8 + 24) · 2^-53 · (1 + 2^-28) · Σ|x_k w_k| (the standard bound of a
//     summation tree: γ_h Σ|p| for h roundings on the longest path, γ_h <= h u (1 + 2^-28)
//     for h u <= 2^-30), and Σ|x_k w_k| <= ‖x‖₂ ‖w‖₂ (Cauchy–Schwarz): e below;
//   * ‖x‖₂ is bounded in the kernel (the double sum of squares, exact squares, its roundings and
//     the square root's within 2^-30), ‖w‖₂ by the caller's norms (an upper bound of each row's:
//     kernels::compressor_row_norms, +Inf where it trusts nothing);
//   * where FP32 rounding gives the same bits at both ends of [s' − e, s' + e] (widened
//     by its own endpoints' roundings), golden's float(s) is float(s') (rounding is monotone; the
//     bits are compared, so an interval across ±0 is not certified); otherwise, or where s' or e
//     is not finite (a NaN or ±Inf input, an unbounded norm), the dot is computed again in
//     golden's order (bf16_dot_exact): IEEE NaN / Inf behaviour is golden's.
// Every tier gives golden's bits. At the compressors' statistics e is ~3e-11 of |s| against a
// half FP32 ulp of ≥ 6e-8, so about 1 % of dots go to the second sum (measured on
// bench_compressor's live windows: 0.5 % of a CSA step's, 1.6 % of HCA's, 0.8 % of inner's).
//
// The cost (AVX2, Zen 3): widening the weights is the bound (vcvtps2pd is two µops there), the
// same as the few-token kernel's, without its 8 × 8 transposes: measured in docs/compressors.md.
// The AVX-512 tier runs the AVX2 kernel (a 512-bit one is left for a host where it can be
// measured). Scalar and other targets: golden's order (bf16_rows_gather_dots_exact). Neither throws
// or allocates; the AVX2 kernel's scratch is on the stack (20 KB).

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

namespace rounded_detail {
// |s − s'| <= g(d) · ‖x‖ · ‖w‖ (the header's bound).
inline double bound_factor(index_t d) {
  return (double(d) + double(d / 8) + 24.0) * 0x1p-53 * (1.0 + 0x1p-28);
}
// Whether every value within e of s rounds to FP32 as s does (the bits; s and e finite): the
// interval widened by the double roundings of its endpoints and of e's own product.
inline bool certified(double s, double e) {
  if (!(std::fabs(s) <= DBL_MAX) || !(e <= DBL_MAX)) return false;  // NaN, ±Inf
  const double m = e * (1.0 + 0x1p-40) + std::fabs(s) * 0x1p-51 + 0x1p-1022;
  return std::bit_cast<std::uint32_t>(float(s - m)) == std::bit_cast<std::uint32_t>(float(s + m));
}
}  // namespace rounded_detail

#if TILEDECODE_X86
namespace avx2 {
namespace rounded_detail {
inline constexpr index_t kBlockK = 512;  // k per block: the tokens' x as double (NT · 4 KB)
inline constexpr int kChunk = 16;        // rows whose lanes are held across the blocks

// The BF16 values 0-3 (lo) or 4-7 (hi) of c as doubles (BF16 in the high half: its FP32).
TILEDECODE_TARGET_AVX2 inline __m256d lo4(__m128i c) {
  return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), c)));
}
TILEDECODE_TARGET_AVX2 inline __m256d hi4(__m128i c) {
  return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), c)));
}

// xd[k] = x[k] as double, k < kk (a multiple of 8); with SQ, sq += the squares (exact) in its
// lanes (x's norm, on the first pass over the rows: no conversions of its own).
template <bool SQ>
TILEDECODE_TARGET_AVX2 inline void widen(double* xd, const bf16* x, index_t kk, __m256d& sq) {
  for (index_t k = 0; k < kk; k += 8) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k));
    const __m256d l = lo4(c), h = hi4(c);
    _mm256_store_pd(xd + k, l);
    _mm256_store_pd(xd + k + 4, h);
    if constexpr (SQ)
      sq = _mm256_add_pd(sq, _mm256_add_pd(_mm256_mul_pd(l, l), _mm256_mul_pd(h, h)));
  }
}
// An upper bound of ‖x‖₂ from sq (the squares of x[0 .. dm)) and the rest of x: the double sums
// of the exact squares (their roundings <= d · 2^-53 relative) and the square root's rounding
// covered by 2^-30. NaN / +Inf for a non-finite x.
TILEDECODE_TARGET_AVX2 inline double norm_bound(__m256d sq, const bf16* x, index_t dm, index_t d) {
  alignas(32) double v[4];
  _mm256_store_pd(v, sq);
  double s = (v[0] + v[1]) + (v[2] + v[3]);
  for (index_t k = dm; k < d; ++k) s += double(x[k].to_float()) * double(x[k].to_float());
  return std::sqrt(s) * (1.0 + 0x1p-30);
}

// The lanes of one row against NT tokens over kk k (a multiple of 4U): acc[(t · U + u) · 4 + l]
// += w[k] · xd[t · kBlockK + k] for k ≡ 4u + l (mod 4U), ascending. next: the row read after this
// block, prefetched a line per 32 k (nullptr: none).
template <int NT>
TILEDECODE_TARGET_AVX2 inline void lanes(double* acc, const double* xd, const bf16* w, index_t kk,
                                         const bf16* next) {
  constexpr int U = NT <= 2 ? 4 : 2;
  __m256d a[NT][U];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) a[t][u] = _mm256_load_pd(acc + (t * U + u) * 4);
  for (index_t k = 0; k < kk; k += 4 * U) {
    if (next && k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T0);
    __m256d f[U];
#pragma GCC unroll 2
    for (int h = 0; h < U / 2; ++h) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 8 * h));
      f[2 * h] = lo4(c);
      f[2 * h + 1] = hi4(c);
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u)
        a[t][u] = _mm256_fmadd_pd(f[u], _mm256_load_pd(xd + t * kBlockK + k + 4 * u), a[t][u]);
  }
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) _mm256_store_pd(acc + (t * U + u) * 4, a[t][u]);
}

// s' of row w and token t from its lanes (the header's tree) and the tail k in [dm, d).
template <int U>
inline double reduce(const double* acc, const bf16* x, const bf16* w, index_t dm, index_t d) {
  double v[4];
  for (int l = 0; l < 4; ++l)
    v[l] = U == 4 ? (acc[l] + acc[4 + l]) + (acc[8 + l] + acc[12 + l]) : acc[l] + acc[4 + l];
  double s = (v[0] + v[1]) + (v[2] + v[3]);
  for (index_t k = dm; k < d; ++k) s += double(x[k].to_float()) * double(w[k].to_float());
  return s;
}

template <int NT>
TILEDECODE_TARGET_AVX2 inline void gather(const bf16* const* xs, int n, const bf16* const* rows,
                                          const float* norms, index_t d, float* out,
                                          index_t ld_out) {
  constexpr int U = NT <= 2 ? 4 : 2;
  const index_t dm = d / (4 * U) * (4 * U);  // the lanes' k
  alignas(32) double xd[NT * kBlockK];
  alignas(32) double acc[kChunk][NT * U * 4];
  __m256d sq[NT];
  for (int t = 0; t < NT; ++t) sq[t] = _mm256_setzero_pd();
  double nx[NT];
  const double g = cpu::rounded_detail::bound_factor(d);
  for (int j0 = 0; j0 < n; j0 += kChunk) {
    const int nc = std::min(kChunk, n - j0);
    for (int j = 0; j < nc; ++j) std::fill_n(acc[j], NT * U * 4, 0.0);
    for (index_t k0 = 0; k0 < dm; k0 += kBlockK) {
      const index_t kk = std::min(kBlockK, dm - k0);
      for (int t = 0; t < NT; ++t) {
        if (j0 == 0)
          widen<true>(xd + t * kBlockK, xs[t] + k0, kk, sq[t]);
        else
          widen<false>(xd + t * kBlockK, xs[t] + k0, kk, sq[t]);
      }
      for (int j = 0; j < nc; ++j) {
        const bf16* next = j + 1 < nc          ? rows[j0 + j + 1] + k0
                           : k0 + kBlockK < dm ? rows[j0] + k0 + kBlockK
                                               : nullptr;
        lanes<NT>(acc[j], xd, rows[j0 + j] + k0, kk, next);
      }
    }
    if (j0 == 0)
      for (int t = 0; t < NT; ++t) nx[t] = norm_bound(sq[t], xs[t], dm, d);
    for (int j = 0; j < nc; ++j) {
      const bf16* w = rows[j0 + j];
      for (int t = 0; t < NT; ++t) {
        const double s = reduce<U>(acc[j] + t * U * 4, xs[t], w, dm, d);
        const double e = g * nx[t] * double(norms[j0 + j]);
        out[t * ld_out + j0 + j] = cpu::rounded_detail::certified(s, e)
                                       ? float(s)
                                       : float(bf16_dot_exact(xs[t], w, d));  // golden's order
      }
    }
  }
}
}  // namespace rounded_detail
}  // namespace avx2
#endif

// out[t·ld_out + j] = float(bf16_dot_exact(xs[t], rows[j], d)) for t < nt, j < n (any nt, n >= 0):
// golden's ascending double sum of each token row with each weight row, both by pointer, rounded
// once to FP32, with golden's bits on every tier (the header: the lanes on k, certified, golden's
// order where the certificate fails). norms[j] >= ‖rows[j]‖₂ (an upper bound; +Inf: every dot of
// that row in golden's order).
inline void bf16_rows_gather_dots_rounded(Isa isa, int nt, const bf16* const* xs, int n,
                                          const bf16* const* rows, const float* norms, index_t d,
                                          float* out, index_t ld_out) {
  for (int t0 = 0; t0 < nt; t0 += kFewTok) {
    const int m = std::min(kFewTok, nt - t0);
    float* ot = out + t0 * ld_out;
#if TILEDECODE_X86
    if (isa == Isa::avx512 || has_avx2(isa)) {
      with_static_count<kFewTok>(m, [&]<int NT>() {
        avx2::rounded_detail::gather<NT>(xs + t0, n, rows, norms, d, ot, ld_out);
      });
      continue;
    }
#endif
    constexpr int kRows = 16;  // golden's order on the gathered kernel, 16 rows at a time
    double s[kFewTok * kRows];
    for (int j0 = 0; j0 < n; j0 += kRows) {
      const int nr = std::min(kRows, n - j0);
      bf16_rows_gather_dots_exact(isa, m, xs + t0, nr, rows + j0, d, s, kRows);
      for (int t = 0; t < m; ++t)
        for (int j = 0; j < nr; ++j) ot[t * ld_out + j0 + j] = float(s[t * kRows + j]);
    }
  }
  (void)isa;
  (void)norms;
}

}  // namespace tiledecode::cpu
