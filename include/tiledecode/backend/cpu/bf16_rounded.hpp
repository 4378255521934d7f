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
//     bits are compared, so an interval across ±0 is not certified);
//   * otherwise, where no addition of either sum rounds, s' = s (sums_exact: every product is a
//     multiple of 2^m, m from the least significant bits of the two rows' values, and where
//     Σ|x_k w_k| <= 2^(m + 53) every partial sum, in any order, is an integer of at most 53 bits
//     times 2^m: a double), so float(s') is golden's again;
//   * otherwise, or where s', e or the norms are not finite (a NaN or ±Inf input, an unbounded
//     norm), the dot is computed again in golden's order (bf16_dot_exact): IEEE NaN / Inf
//     behaviour is golden's.
// Every tier gives golden's bits. At the compressors' statistics e is ~3e-11 of |s| against a
// half FP32 ulp of ≥ 6e-8, so about 1 % of dots miss the certificate (measured on
// bench_compressor's live windows: 0.5 % of a CSA step's, 1.5 % of HCA's, 0.8 % of inner's); the
// exactness test (a pass over both rows' exponent fields, against golden's chain of d dependent
// additions, ~12k cycles at d = 4096) keeps every one of those (0.64, 0.57 and 0.29 dots a step:
// none went to golden's order in 400 steps each; the products span far less than 2^53 there).
//
// The cost (AVX2, Zen 3): widening the weights is the bound. They are widened by moving their bits
// into a double's fields (a sign extension, a shift and a mask, no vcvtps2pd: two µops there),
// which gives w · 2^-896 exactly (below); x is widened once per block as x · 2^895 (from the
// caller's FP32 copy where it passes one: no unpacking), so each product
// is x w / 2, exact, and s' is twice the lanes' tree, bit for bit the sum of the unscaled products
// in the same order (halving commutes with each rounding: every nonzero partial sum is a multiple
// of 2^-267, the smallest BF16 product halved, so none is subnormal; |x| 2^895 < 2^1023). The
// fields of a non-finite w give a finite double, so the certificate needs finite norms to trust s'
// (the contract below: a row with an Inf or a NaN has norm +Inf, as bf16_norm_bound gives it). The
// AVX-512 tier runs the AVX2 kernel: a 512-bit port (8U lanes, the same widening) measured slower
// on Zen 4, which splits 512-bit operations in two (2 tokens × 4 rows of 4096, in cache: 9.8k
// cycles against 7.2k; 16 rows 23.4k against 22.6k; 2026-12-08, docs/compressors.md); a CPU with
// full-width AVX-512 units may gain, and that is left for one where it can be measured.
// Scalar and other targets: golden's order (bf16_rows_gather_dots_exact). Neither throws or
// allocates; the AVX2 kernel's scratch is on the stack (20 KB).

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
// w[0 .. 4) · 2^-896 as doubles, exactly, for finite w: BF16 bits s|e|m (8 exponent bits, 7
// fraction bits) become the double s|000e|m·2^45 (the value sign-extended, shifted left by 45,
// the three copies of the sign above the exponent cleared): a normal BF16 2^(e−127) (1 + m/128)
// becomes 2^(e−1023) (1 + m/128), a subnormal m 2^-133 becomes the subnormal double m 2^-1029.
TILEDECODE_TARGET_AVX2 inline __m256d scaled4(const bf16* w) {
  const __m256i v = _mm256_cvtepi16_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_pd(
      _mm256_and_si256(_mm256_slli_epi64(v, 45), _mm256_set1_epi64x(0x8fffffffffffffffLL)));
}
inline constexpr double kXScale = 0x1p895;  // x's scale in xd: x · 2^895 · w · 2^-896 = x w / 2

// Eight values of each token's x from k, widened into xd (x · 2^895, the tokens kBlockK apart),
// with SQ their squares (exact, unscaled) added to chains c, c + 1 of sq (x's norm). F32: read
// from the FP32 copies xf (the same values: two conversions from memory, no unpacking; Zen 3,
// 2 tokens, 5 rows of 4096: 10.2k cycles a call against 11.1k from the BF16 rows), else from xs.
template <int NT, bool SQ, bool F32>
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void widen8(double* xd,
                                                                         const float* const* xf,
                                                                         const bf16* const* xs,
                                                                         index_t k, int c,
                                                                         __m256d (&sq)[NT][4]) {
  const __m256d scale = _mm256_set1_pd(kXScale);
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    __m256d l, h;
    if constexpr (F32) {
      l = _mm256_cvtps_pd(_mm_loadu_ps(xf[t] + k));
      h = _mm256_cvtps_pd(_mm_loadu_ps(xf[t] + k + 4));
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[t] + k));
      l = lo4(v), h = hi4(v);
    }
    _mm256_store_pd(xd + t * kBlockK + k, _mm256_mul_pd(l, scale));
    _mm256_store_pd(xd + t * kBlockK + k + 4, _mm256_mul_pd(h, scale));
    if constexpr (SQ) {
      sq[t][c] = _mm256_fmadd_pd(l, l, sq[t][c]);
      sq[t][c + 1] = _mm256_fmadd_pd(h, h, sq[t][c + 1]);
    }
  }
}
// x_t[k0 .. k0 + kk) of every token widened (kk a multiple of 8; xd[t · kBlockK + k] = x_t[k0 +
// k] · 2^895); with SQ, the squares in four chains of multiply-adds a token (one chain would wait
// on the multiply-add's latency): sq[t][0 .. 2) for k / 8 even, [2 .. 4) odd.
template <int NT, bool SQ, bool F32>
TILEDECODE_TARGET_AVX2 inline void widen(double* xd, const float* const* xf, const bf16* const* xs,
                                         index_t k0, index_t kk, __m256d (&sq)[NT][4]) {
  const float* f[NT];
  const bf16* b[NT];
  for (int t = 0; t < NT; ++t) f[t] = F32 ? xf[t] + k0 : nullptr, b[t] = xs[t] + k0;
  index_t k = 0;
  for (; k + 16 <= kk; k += 16) {
    widen8<NT, SQ, F32>(xd, f, b, k, 0, sq);
    widen8<NT, SQ, F32>(xd, f, b, k + 8, 2, sq);
  }
  if (k < kk) widen8<NT, SQ, F32>(xd, f, b, k, 0, sq);
}
// An upper bound of ‖x‖₂ from sq (the four chains of the squares of x[0 .. dm)) and the rest of
// x: the double sums of the exact squares (their roundings <= d · 2^-53 relative, in any order)
// and the square root's rounding covered by 2^-30. NaN / +Inf for a non-finite x.
TILEDECODE_TARGET_AVX2 inline double norm_bound(const __m256d (&sq)[4], const bf16* x, index_t dm,
                                                index_t d) {
  alignas(32) double v[4];
  _mm256_store_pd(v, _mm256_add_pd(_mm256_add_pd(sq[0], sq[1]), _mm256_add_pd(sq[2], sq[3])));
  double s = (v[0] + v[1]) + (v[2] + v[3]);
  for (index_t k = dm; k < d; ++k) s += double(x[k].to_float()) * double(x[k].to_float());
  return std::sqrt(s) * (1.0 + 0x1p-30);
}

// The lanes of one row against NT tokens over kk k (a multiple of 4U): acc[(t · U + u) · 4 + l]
// += w[k] · 2^-896 · xd[t · kBlockK + k] (x w / 2) for k ≡ 4u + l (mod 4U), ascending. next: the
// row read after this block, prefetched a line per 32 k (nullptr: none).
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
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) f[u] = scaled4(w + k + 4 * u);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u)
        a[t][u] = _mm256_fmadd_pd(f[u], _mm256_load_pd(xd + t * kBlockK + k + 4 * u), a[t][u]);
  }
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) _mm256_store_pd(acc + (t * U + u) * 4, a[t][u]);
}

// The exactness test (header): each finite nonzero BF16 v is a multiple of 2^(max(E, 1) − 134),
// E its exponent field (the leading bit's 2^(E − 127), 7 fraction bits below it; subnormals as
// E = 1), so x_k · w_k is a multiple of 2^(Ex + Ew − 268). min_lsb_fields: the least Ex + Ew
// (each field at least 1) over the k where neither value is ±0 (their products add nothing);
// kNoProducts where there is none. Infinite and NaN values count by their field (255): the caller
// asks only where every product is finite.
inline constexpr int kNoProducts = 0x4000;
TILEDECODE_TARGET_AVX2 inline int min_lsb_fields(const bf16* x, const bf16* w, index_t d) {
  const __m256i mag = _mm256_set1_epi16(0x7FFF), one = _mm256_set1_epi16(1),
                none = _mm256_set1_epi16(kNoProducts), zero = _mm256_setzero_si256();
  __m256i mn = none;
  index_t k = 0;
  for (; k + 16 <= d; k += 16) {
    const __m256i a =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)), mag);
    const __m256i b =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)), mag);
    const __m256i e = _mm256_add_epi16(_mm256_max_epi16(_mm256_srli_epi16(a, 7), one),
                                       _mm256_max_epi16(_mm256_srli_epi16(b, 7), one));
    const __m256i z = _mm256_or_si256(_mm256_cmpeq_epi16(a, zero), _mm256_cmpeq_epi16(b, zero));
    mn = _mm256_min_epi16(mn, _mm256_or_si256(e, _mm256_and_si256(z, none)));  // e <= 510
  }
  const __m128i m8 = _mm_min_epi16(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1));
  int r = _mm_extract_epi16(_mm_minpos_epu16(m8), 0);
  for (; k < d; ++k) {
    const int a = x[k].bits & 0x7FFF, b = w[k].bits & 0x7FFF;
    if (a != 0 && b != 0) r = std::min(r, std::max(a >> 7, 1) + std::max(b >> 7, 1));
  }
  return r;
}
// Whether every partial sum of x_k · w_k (k < d, in any order, from +0) is exact in double, given
// sum_abs >= Σ|x_k w_k| (the header's second case): each is a multiple of 2^m, m = f − 268, of
// magnitude at most Σ|x_k w_k| <= 2^(m + 53). A finite sum_abs makes every product finite.
TILEDECODE_TARGET_AVX2 inline bool sums_exact(const bf16* x, const bf16* w, index_t d,
                                              double sum_abs) {
  if (!(sum_abs <= DBL_MAX)) return false;  // NaN, +Inf: an unbounded norm or input
  const int f = min_lsb_fields(x, w, d);
  return f >= kNoProducts || sum_abs <= std::ldexp(1.0, f - 268 + 53);
}

// s' of row w and token t from its lanes (the header's tree, of the halved products: doubled,
// exactly) and the tail k in [dm, d).
template <int U>
inline double reduce(const double* acc, const bf16* x, const bf16* w, index_t dm, index_t d) {
  double v[4];
  for (int l = 0; l < 4; ++l)
    v[l] = U == 4 ? (acc[l] + acc[4 + l]) + (acc[8 + l] + acc[12 + l]) : acc[l] + acc[4 + l];
  double s = 2.0 * ((v[0] + v[1]) + (v[2] + v[3]));
  for (index_t k = dm; k < d; ++k) s += double(x[k].to_float()) * double(w[k].to_float());
  return s;
}

template <int NT>
TILEDECODE_TARGET_AVX2 inline void gather(const bf16* const* xs, const float* const* xf, int n,
                                          const bf16* const* rows, const float* norms, index_t d,
                                          float* out, index_t ld_out) {
  constexpr int U = NT <= 2 ? 4 : 2;
  const index_t dm = d / (4 * U) * (4 * U);  // the lanes' k
  alignas(32) double xd[NT * kBlockK];
  alignas(32) double acc[kChunk][NT * U * 4];
  __m256d sq[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < 4; ++c) sq[t][c] = _mm256_setzero_pd();
  double nx[NT];
  const double g = cpu::rounded_detail::bound_factor(d);
  for (int j0 = 0; j0 < n; j0 += kChunk) {
    const int nc = std::min(kChunk, n - j0);
    for (int j = 0; j < nc; ++j) std::fill_n(acc[j], NT * U * 4, 0.0);
    for (index_t k0 = 0; k0 < dm; k0 += kBlockK) {
      const index_t kk = std::min(kBlockK, dm - k0);
      if (j0 == 0 && xf)
        widen<NT, true, true>(xd, xf, xs, k0, kk, sq);
      else if (j0 == 0)
        widen<NT, true, false>(xd, xf, xs, k0, kk, sq);
      else if (xf)
        widen<NT, false, true>(xd, xf, xs, k0, kk, sq);
      else
        widen<NT, false, false>(xd, xf, xs, k0, kk, sq);
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
        const double nn = nx[t] * double(norms[j0 + j]);  // >= Σ|x_k w_k| but its rounding
        out[t * ld_out + j0 + j] = cpu::rounded_detail::certified(s, g * nn) ||
                                           sums_exact(xs[t], w, d, nn * (1.0 + 0x1p-50))
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
// order where the certificates fail). norms[j] >= ‖rows[j]‖₂ (an upper bound; +Inf, as
// bf16_norm_bound gives for a row with an Inf or a NaN: every dot of that row in golden's order).
// xf: nullptr, or per token an FP32 copy of xs[t] (xf[t][k] == xs[t][k].to_float(), e.g. the
// compressor's x32), which the AVX2 kernel widens instead (cheaper; the same bits).
inline void bf16_rows_gather_dots_rounded(Isa isa, int nt, const bf16* const* xs, int n,
                                          const bf16* const* rows, const float* norms, index_t d,
                                          float* out, index_t ld_out,
                                          const float* const* xf = nullptr) {
  for (int t0 = 0; t0 < nt; t0 += kFewTok) {
    const int m = std::min(kFewTok, nt - t0);
    float* ot = out + t0 * ld_out;
#if TILEDECODE_X86
    if (isa == Isa::avx512 || has_avx2(isa)) {
      with_static_count<kFewTok>(m, [&]<int NT>() {
        avx2::rounded_detail::gather<NT>(xs + t0, xf ? xf + t0 : nullptr, n, rows, norms, d, ot,
                                         ld_out);
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
  (void)xf;
}

}  // namespace tiledecode::cpu
