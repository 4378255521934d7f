#pragma once
// The rounding check of the default BF16 dots (issue 17): per row of values that a Q8 rounding
// follows (the o-proj's o_r[t, g, :], the q-latent cq[t, :]; FP32 sums a few FP32 ulps from the
// exact dots), the values whose rounding that error could change, listed for recomputation in
// golden's order (repair). The scan of a row is compiled for each tier (one body: the compiler
// vectorizes it for the tier's target). Callers: backend/cpu/output_projection.hpp ("Rounding
// check"), backend/cpu/qkv_projection.hpp (q_latent). list_bf16_row (below) lists the values of a
// BF16 row after an RMS norm and the RoPE: the kv check (qkv_projection.hpp check_kv) and the
// compressors' (compressor.hpp "Rounding check").

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu::rounding_check {

inline constexpr int kTokens = 8;  // rows per list (the o-proj: a task's tokens of one group)
// The bound's factor κ: |dot − exact| <= κ · 2^-24 · max_k |x[k]| · |w| (see the note in
// output_projection.hpp), measured at most 1.9 on every tier's FP32 sums (64-k blocks).
inline constexpr float kKappa = 16.0f;
inline constexpr int kRowRepairs = 16;  // repairs listed per row at most
inline constexpr int kChunk = 64;       // values per vector compare of the scan
inline constexpr float kFltMax = 3.40282347e38f;

struct Repairs {  // (row t of the list, index r in it) of the values to recompute
  static constexpr int kMax = kTokens * kRowRepairs;
  int n = 0;
  int per[kTokens] = {};  // listed per row: a row's list does not depend on the others
  std::int32_t t[kMax], r[kMax];
  void add(int tt, index_t rr) {
    if (per[tt] == kRowRepairs) return;
    ++per[tt];
    t[n] = tt, r[n] = std::int32_t(rr), ++n;
  }
};

// Recomputes the listed values, kPairDots at a time: store(t, r, s) takes the exact dot s of
// x_of(t, r) · w_of(t, r) (bf16_pair_dots_exact: golden's ascending-k double sum, unrounded; the
// weights ws apart: 1 a row, the row pitch a column). Weight rows of one x go to
// bf16_rows_gather_dots_exact instead (the same sums, x widened once).
template <class XOf, class WOf, class Store>
void repair(Isa isa, const Repairs& rep, index_t d, XOf x_of, WOf w_of, Store store,
            index_t ws = 1) {
  for (int i = 0; i < rep.n; i += kPairDots) {
    const int n = std::min(kPairDots, rep.n - i);
    const bf16* xp[kPairDots] = {};
    const bf16* wp[kPairDots] = {};
    double s[kPairDots];
    for (int j = 0; j < n; ++j) {
      xp[j] = x_of(rep.t[i + j], rep.r[i + j]);
      wp[j] = w_of(rep.t[i + j], rep.r[i + j]);
    }
    bool one_x = ws == 1;
    for (int j = 1; j < n && one_x; ++j) one_x = xp[j] == xp[0];
    if (one_x)
      bf16_rows_gather_dots_exact(isa, n, xp[0], wp, d, s);
    else
      bf16_pair_dots_exact(isa, n, xp, wp, d, s, ws);
    for (int j = 0; j < n; ++j) store(rep.t[i + j], rep.r[i + j], s[j]);
  }
}

// max_i |v[i]| (for finite v; a NaN gives a value above +Inf): the bit patterns' maximum, an
// integer reduction the compiler vectorizes (a float one it may not reorder).
__attribute__((always_inline)) inline float abs_max(const float* v, index_t n) {
  std::int32_t m = 0;
  for (index_t i = 0; i < n; ++i) m = std::max(m, std::bit_cast<std::int32_t>(v[i]) & 0x7fffffff);
  return std::bit_cast<float>(m);
}

// Lists (as row t) the values of the row o[0 .. R) to recompute, a row that Q8 (core/quant.hpp)
// rounds next: x is its activations (K; the o-proj: the token's o_packed row; the q-latent: x_n),
// nrm[r] bounds the error factor of o_r (the o-proj: wo_a's row norm; the q-latent: r · |gamma|
// times wq_a's column norm), nmax is their largest. A row with a non-finite x or o is not checked
// (Q8's non-finite policy applies to it unchanged).
//
// The interval around o_r that holds the value golden rounds: half-width w_r = a · nrm[r] (the
// FP32 sums' error, a = κ · 2^-24 · max_k |x[k]|) + 2^-22 |o_r| (two FP32 ulps: the final
// roundings, golden's and the kernel's). A value is listed
//   * if its interval, scaled by any sq the repaired amax can give (within a relative d of this
//     one), holds a rounding midpoint of q = rint(o · sq): |o · sq| <= 127 up to the FP32
//     product's rounding (2^-17; 2^-15 covers it), and the distance to the nearest midpoint comes
//     from the truncation (a conversion; std::floor is a libm call per value on baseline x86);
//   * if it can be the row's largest after repair: its interval reaches the interval of the
//     largest before (bounded below with the row's largest factor nmax), so the Q8 scale sq = 127 /
//     max(amax, 1e-4) (core/quant.hpp) is golden's after the repairs (none where amax cannot
//     reach the floor 1e-4: the scale is then 127 / 1e-4 whatever it is). With exact_scale (the
//     o-proj: its dequant scale amax / 127 is a factor of the BF16 attn_out, so it must be
//     golden's) always; without (the q-latent: qr_scale is an FP32 output that the per-head
//     RMSNorm of q undoes) only in a row with a value of the first kind, the only one whose
//     decision the exact scale changes: the first test already holds every other value's
//     decision for every scale the repairs could give, the largest's included (|q| = 127).
// Each test is a vector compare over a chunk of kChunk values, searched one by one on a hit; a
// row that lists its largest only with others is scanned for the first kind first (a pass that
// usually finds none and lists nothing).
__attribute__((always_inline)) inline void check_row_body(const bf16* x, index_t K, const float* o,
                                                          const float* nrm, index_t R, float nmax,
                                                          int t, Repairs& rep, bool exact_scale) {
  std::int16_t m = 0;  // the largest |x| as bits (every non-finite one >= 0x7f80)
  for (index_t k = 0; k < K; ++k) m = std::max(m, std::int16_t(x[k].bits & 0x7fff));
  const float amax = abs_max(o, R);
  if (m >= 0x7f80 || !(amax <= kFltMax)) return;
  const float a = kKappa * 0x1p-24f * bf16::from_bits(std::uint16_t(m)).to_float();
  const float wmax = a * nmax + 0x1p-22f * amax, lo = amax - wmax;
  const float den = amax < kInt8AmaxEps ? kInt8AmaxEps : amax, sq = kInt8ScaleMax / den;
  // The repaired amax is within wmax of this one: its scale within a relative wmax / (den - wmax)
  // <= 2 · wmax / den while wmax / den <= 1/4 (beyond, every value of the row is in doubt: d so
  // large that it lists them all, up to the quota).
  const float dl = wmax / den, d = dl <= 0.25f ? 2.0f * dl + 0x1p-20f : 1e30f;
  const float sqd = sq * (1.0f + d);
  // Below the floor 1e-4 the scale does not depend on amax: no candidates (an all-zero row).
  const std::int32_t scaled = amax + wmax >= kInt8AmaxEps;
  std::int32_t hit[kChunk];
  // Pass 0 (without exact_scale): the midpoint test alone, to the first hit; pass 1 lists.
  for (int pass = exact_scale ? 1 : 0; pass < 2; ++pass) {
    const std::int32_t largest = scaled & std::int32_t(pass == 1);
    bool found = false;
    for (index_t r0 = 0; r0 < R && !found; r0 += kChunk) {
      const index_t n = std::min<index_t>(kChunk, R - r0);
      std::int32_t any = 0;
      for (index_t i = 0; i < n; ++i) {
        const float ao = std::fabs(o[r0 + i]), w = a * nrm[r0 + i] + 0x1p-22f * ao;
        const float v = o[r0 + i] * sq, f = std::fabs(v - float(std::int32_t(v)));
        hit[i] = (largest & (ao + w >= lo)) |
                 (std::fabs(f - 0.5f) <= w * sqd + std::fabs(v) * d + 0x1p-15f);
        any |= hit[i];
      }
      if (!any) continue;
      if (pass == 0) {
        found = true;
      } else {
        for (index_t i = 0; i < n; ++i)
          if (hit[i]) rep.add(t, r0 + i);
      }
    }
    if (pass == 0 && !found) return;
  }
}

// The largest |x| of a BF16 row, as a float (+Inf or a NaN for a non-finite one): the scale
// max_k |x[k]| of the dots' bound in the BF16-row checks.
// The magnitudes' bits (bits & 0x7fff) are nonnegative int16 values, ordered as the magnitudes
// (a NaN above +Inf), so the signed 16-bit max (one SSE2 instruction) finds them, in 32 lanes
// that the compiler keeps in four vectors (one chain of maxima per 8 values otherwise).
inline float bf16_abs_max(const bf16* x, index_t k) {
  constexpr int L = 32;
  std::int16_t m[L] = {};
  index_t i = 0;
  for (; i + L <= k; i += L)
    for (int l = 0; l < L; ++l)
      m[l] = std::max<std::int16_t>(m[l], std::int16_t(x[i + l].bits & 0x7fff));
  for (; i < k; ++i) m[0] = std::max<std::int16_t>(m[0], std::int16_t(x[i].bits & 0x7fff));
  std::int16_t r = 0;
  for (int l = 0; l < L; ++l) r = std::max(r, m[l]);
  return bf16::from_bits(std::uint16_t(r)).to_float();
}
#if TILEDECODE_X86
// The same maximum in two 16-lane AVX2 vectors (64 values an iteration; the order of the maxima
// does not matter: the result is the same bits).
TILEDECODE_TARGET_AVX2 inline float bf16_abs_max_avx2(const bf16* x, index_t k) {
  const __m256i mag = _mm256_set1_epi16(0x7fff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  index_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const auto* p = reinterpret_cast<const __m256i*>(x + i);
    m0 = _mm256_max_epi16(m0, _mm256_and_si256(_mm256_loadu_si256(p), mag));
    m1 = _mm256_max_epi16(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), mag));
  }
  const __m256i m = _mm256_max_epi16(m0, m1);
  // The largest of 8 nonnegative int16 values as 0x7fff minus the smallest of 0x7fff − v.
  const __m128i h = _mm_max_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  int r = 0x7fff - _mm_extract_epi16(_mm_minpos_epu16(_mm_sub_epi16(_mm_set1_epi16(0x7fff), h)), 0);
  for (; i < k; ++i) r = std::max(r, int(x[i].bits & 0x7fff));
  return bf16::from_bits(std::uint16_t(r)).to_float();
}
#endif
// bf16_abs_max on the tier's vectors (the same bits).
inline float bf16_abs_max(Isa isa, const bf16* x, index_t k) {
#if TILEDECODE_X86
  if (isa == Isa::avx512 || has_avx2(isa)) return bf16_abs_max_avx2(x, k);
#endif
  (void)isa;
  return bf16_abs_max(x, k);
}

// bf16::round_bits without its NaN case, branch-free (the loops that call bf16_splits_i
// vectorize): only compared, between v − w and v + w, which are the same NaN where either is one
// (v NaN; w NaN is listed by its own test).
__attribute__((always_inline)) inline std::uint32_t bf16_bits_rne(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// Whether golden's value, within w of v (w >= 0), can round to another BF16 value than v through
// FP32: bf16(fp32(v − w)) != bf16(fp32(v + w)) (both roundings are monotone), or w is NaN or huge;
// as an int (0 / 1) for the vectorized listings.
__attribute__((always_inline)) inline std::int32_t bf16_splits_i(double v, double w) {
  return std::int32_t(!(w <= 1e300)) |
         std::int32_t(bf16_bits_rne(float(v - w)) != bf16_bits_rne(float(v + w)));
}
inline bool bf16_splits(double v, double w) {
  return bf16_splits_i(v, w) != 0;
}

// The BF16 rows (the compressors' y, kv): a row u (hd values, the last rope_dim rotated by the
// interleaved RoPE pairs at cos/sin into y) that a BF16 rounding follows, whose values are within
// own(i) + |u_i| · rho of golden's before the rotation (own: the value's own bound; rho: the
// shared relative bound of the row's RMS factor). Lists in ch (at most max, then max + 1 is
// returned) the channels of the values whose interval, rotated (|cos| Y_even + |sin| Y_odd and
// back), plus 2^-40 |y_i| for the double arithmetic, times (1 + slack), holds a BF16 rounding
// boundary: bf16(fp32(y − Y)) != bf16(fp32(y + Y)) (both roundings are monotone, so golden's
// value, within Y, rounds as y does otherwise; a NaN bound lists its value). A rotated pair lists
// both channels. Returns the number listed.
template <class Own, class U, class Y>
int list_bf16_row(index_t hd, index_t rope_dim, const bf16* cos, const bf16* sin, double rho,
                  double slack, Own own, U u_abs, Y y, int* ch, int max) {
  const auto boundary = [&](double v, double w) { return bf16_splits(v, w * (1.0 + slack)); };
  int n = 0;
  const auto add = [&](index_t i) {
    if (n <= max) ch[std::min(n, max)] = int(i);
    n = std::min(n + 1, max + 1);
  };
  const index_t nope = hd - rope_dim;
  for (index_t i = 0; i < nope; ++i) {
    const double v = y(i);
    if (boundary(v, own(i) + std::fabs(v) * (rho + 0x1p-40))) add(i);
  }
  for (index_t k = 0; k < rope_dim / 2; ++k) {
    const index_t e = nope + 2 * k, o = e + 1;
    const double nc = std::fabs(double(cos[k].to_float())),
                 ns = std::fabs(double(sin[k].to_float()));
    const double ue = own(e) + u_abs(e) * rho, uo = own(o) + u_abs(o) * rho;
    const double ye = y(e), yo = y(o);
    if (boundary(ye, nc * ue + ns * uo + std::fabs(ye) * 0x1p-40) ||
        boundary(yo, ns * ue + nc * uo + std::fabs(yo) * 0x1p-40))
      add(e), add(o);
  }
  return n;
}

#if TILEDECODE_X86
TILEDECODE_TARGET_AVX512 inline void check_row_avx512(const bf16* x, index_t K, const float* o,
                                                      const float* nrm, index_t R, float nmax,
                                                      int t, Repairs& rep, bool exact_scale) {
  check_row_body(x, K, o, nrm, R, nmax, t, rep, exact_scale);
}
TILEDECODE_TARGET_AVX2 inline void check_row_avx2(const bf16* x, index_t K, const float* o,
                                                  const float* nrm, index_t R, float nmax, int t,
                                                  Repairs& rep, bool exact_scale) {
  check_row_body(x, K, o, nrm, R, nmax, t, rep, exact_scale);
}
#endif

// The row's scan compiled for the tier (the same tests on every one; a value listed on one tier
// and not on another is, where the bound holds, one whose rounding is golden's either way).
inline void check_row(Isa isa, const bf16* x, index_t K, const float* o, const float* nrm,
                      index_t R, float nmax, int t, Repairs& rep, bool exact_scale) {
#if TILEDECODE_X86
  if (isa == Isa::avx512) return check_row_avx512(x, K, o, nrm, R, nmax, t, rep, exact_scale);
  if (has_avx2(isa)) return check_row_avx2(x, K, o, nrm, R, nmax, t, rep, exact_scale);
#endif
  (void)isa;
  check_row_body(x, K, o, nrm, R, nmax, t, rep, exact_scale);
}

}  // namespace tiledecode::cpu::rounding_check
