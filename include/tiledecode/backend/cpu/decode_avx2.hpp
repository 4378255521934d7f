#pragma once
// AVX2 + FMA inner loops of the decode-step front-end (hyper-connections, RMSNorm, the q/kv
// projections). Every function is TILEDECODE_TARGET_AVX2 and is reached only after the caller's
// ISA choice (cpu::Context::isa), never by detecting the machine here.
//
// The projections at decode time are weight-bandwidth bound (T = 8 rows against megabytes of
// weights), so both matmuls use the "axpy" order: each weight row k is read once and multiplied
// into the accumulators of all T tokens, in blocks of 8 rows (BF16) or 4 row pairs (INT8) so an
// accumulator is loaded and stored once per block rather than once per row. The BF16 matmul sums
// each block in FP32 and the blocks in double (matmul_bf16_axpy); its scalar twin follows the
// same order, so the AVX2 and scalar paths give the same FP32 bits for the BF16 matmul (BF16 ×
// BF16 products are exact in FP32, FMA or not) and the same integers for the INT8 one.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/backend/cpu/simd/avx_vnni.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// dst[t, n] = float(Σ_k x[t, k] * w[k, n]) for t < T <= 8 and n in [n0, n1); n1 - n0 must be a
// multiple of 8. x holds BF16 values widened to FP32 (x_ld floats per row), so every product is
// exact in FP32; w is BF16 with w_ld elements per row; dst is FP32 with dst_ld per row and is
// overwritten. Summation order (two-level, for accuracy: cq is rounded to INT8 and kv to BF16
// downstream, where an FP32 ulp of error flips roundings): the rows are taken in groups of
// kBf16GroupRows consecutive k (the last group may be shorter); a group's products are summed in
// FP32 in ascending k, the group partial is added to a double accumulator (groups ascending, from
// +0.0), and the result is rounded once to FP32. The scalar twin
// (kernels::detail::matmul_bf16_axpy_scalar) follows the same order, so the tiers agree bit for
// bit. Measured (tests/test_rounding.cpp, kv of 64 tokens at flash shapes against golden's
// double): BF16 roundings of kv that differ from rounding the exact value: 2.4e-4 with one FP32
// sum in ascending k (the previous order), 3.1e-5 in groups of 32, 6.1e-5 in groups of 64; 0 of
// 65536 qr values flip. All-double would be exact but doubles the FMA work of a kernel that is
// FMA-bound at T = 8; groups of 8 cost +16 %, of 32 +7 %, of 64 +4.9 % on qkv_projection at T = 8
// (Xeon, Sapphire Rapids): 64 is the group inside the 5 % budget.
// The accumulators live in an L1 stack tile of up to 256 columns (padded row stride, so the
// tokens' rows do not alias 4 KB apart); each weight row is then read as one contiguous run of
// up to 512 bytes — with 64-column tiles every row of a 2 KB-stride matrix touched a new page
// every two rows and the prefetchers could not follow (measured 2 GB/s instead of 6).
inline constexpr std::int64_t kBf16Ahead = 16;  // rows of software prefetch distance
// Weight rows per pass over the L1 tile: each token's accumulator vector is loaded and stored
// once per kBf16Rows FMAs.
inline constexpr int kBf16Rows = 8;
// Rows per FP32 group partial (a multiple of kBf16Rows): the FP32 tile is added to the double
// tile and restarts from +0 every kBf16GroupRows rows.
inline constexpr int kBf16GroupRows = 64;

// acc[0..8) (double) += the FP32 lanes of s.
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void add_to_f64(double* acc,
                                                                             __m256 s) {
  _mm256_store_pd(acc,
                  _mm256_add_pd(_mm256_load_pd(acc), _mm256_cvtps_pd(_mm256_castps256_ps128(s))));
  _mm256_store_pd(acc + 4, _mm256_add_pd(_mm256_load_pd(acc + 4),
                                         _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1))));
}

// The FP32 group partials acc (T rows of width, stride ld) are added to dacc; acc restarts at +0.
TILEDECODE_TARGET_AVX2 inline void flush_group(float* acc, double* dacc, std::int64_t ld, int T,
                                               std::int64_t width) {
  for (int t = 0; t < T; ++t)
    for (std::int64_t n = 0; n < width; n += 8) {
      add_to_f64(dacc + t * ld + n, _mm256_load_ps(acc + t * ld + n));
      _mm256_store_ps(acc + t * ld + n, _mm256_setzero_ps());
    }
}

TILEDECODE_TARGET_AVX2 inline void matmul_bf16_axpy(float* dst, std::int64_t dst_ld, const float* x,
                                                    std::int64_t x_ld, int T, const bf16* w,
                                                    std::int64_t w_ld, std::int64_t K,
                                                    std::int64_t n0, std::int64_t n1) {
  constexpr std::int64_t kTile = 256, kLd = kTile + 8;
  alignas(32) float acc[8 * kLd];
  alignas(32) double dacc[8 * kLd];
  for (std::int64_t c0 = n0; c0 < n1; c0 += kTile) {
    const std::int64_t width = std::min(kTile, n1 - c0);
    for (int t = 0; t < T; ++t)
      for (std::int64_t n = 0; n < width; n += 8) {
        _mm256_store_ps(acc + t * kLd + n, _mm256_setzero_ps());
        _mm256_store_pd(dacc + t * kLd + n, _mm256_setzero_pd());
        _mm256_store_pd(dacc + t * kLd + n + 4, _mm256_setzero_pd());
      }
    std::int64_t k = 0;
    for (; k + kBf16Rows <= K; k += kBf16Rows) {
      const bf16* w0 = w + k * w_ld + c0;
      // Software prefetch kBf16Ahead rows ahead, one line per row every 32 columns: the row
      // segments are w_ld apart, so the hardware prefetchers see short runs only.
      const bool ahead = k + kBf16Ahead + kBf16Rows <= K;
      for (std::int64_t n = 0; n < width; n += 8) {
        if (ahead && (n & 31) == 0) {
          const bf16* pf = w0 + kBf16Ahead * w_ld + n;
          for (int r = 0; r < kBf16Rows; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(pf + r * w_ld), _MM_HINT_T0);
        }
        // (kBf16Rows rows, 8 columns) of weights, widened once and reused by every token.
        __m256 a[kBf16Rows];
        for (int r = 0; r < kBf16Rows; ++r) a[r] = load_bf16x8(w0 + r * w_ld + n);
        for (int t = 0; t < T; ++t) {
          const float* xt = x + t * x_ld + k;
          float* d = acc + t * kLd + n;
          __m256 s = _mm256_load_ps(d);
          for (int r = 0; r < kBf16Rows; ++r)
            s = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + r), a[r], s);
          _mm256_store_ps(d, s);
        }
      }
      if ((k + kBf16Rows) % kBf16GroupRows == 0) flush_group(acc, dacc, kLd, T, width);
    }
    for (; k < K; ++k) {
      for (std::int64_t n = 0; n < width; n += 8) {
        const __m256 a0 = load_bf16x8(w + k * w_ld + c0 + n);
        for (int t = 0; t < T; ++t) {
          float* d = acc + t * kLd + n;
          _mm256_store_ps(
              d, _mm256_fmadd_ps(_mm256_broadcast_ss(x + t * x_ld + k), a0, _mm256_load_ps(d)));
        }
      }
    }
    if (K % kBf16GroupRows != 0) flush_group(acc, dacc, kLd, T, width);
    for (int t = 0; t < T; ++t)
      for (std::int64_t n = 0; n < width; n += 8) {
        const __m128 lo = _mm256_cvtpd_ps(_mm256_load_pd(dacc + t * kLd + n));
        const __m128 hi = _mm256_cvtpd_ps(_mm256_load_pd(dacc + t * kLd + n + 4));
        _mm256_storeu_ps(dst + t * dst_ld + c0 + n, _mm256_set_m128(hi, lo));
      }
  }
}

// Rows r and r+1 (16 INT8 columns each, at p and p + ld) widened to int16 and interleaved into
// (w[r][n], w[r+1][n]) pairs: lo = columns {0-3, 8-11}, hi = {4-7, 12-15} (per-lane unpack).
TILEDECODE_TARGET_AVX2 inline void i8_row_pairs(const std::int8_t* p, std::int64_t ld, __m256i& lo,
                                                __m256i& hi) {
  const __m256i r0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i r1 =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + ld)));
  lo = _mm256_unpacklo_epi16(r0, r1);
  hi = _mm256_unpackhi_epi16(r0, r1);
}

// acc[t, j] = Σ_k a[t, k] * w[k, n0 + j] exactly in INT32 (acc_ld should not be a multiple of
// 1 KB: see matmul_bf16_axpy on 4K aliasing), for j < n1 - n0 (a multiple of 16) and
// K even. `a_pairs[t, k/2]` packs the INT8 activations (a[t,k], a[t,k+1]) as two int16 in one
// int32 (low half = k). Rows k and k+1 of w are widened to int16 and interleaved so that one
// vpmaddwd multiplies 8 column pairs and adds each pair: |a·w| ≤ 127·127 per product, so a pair
// sum ≤ 32258 and the INT32 sum over K ≤ 1024·16129 < 2^31 for every preset (exact; checked by
// the caller against K). vpunpck works per 128-bit lane, so a 16-column chunk comes out as
// columns {0-3, 8-11} and {4-7, 12-15}; the accumulators keep that order and `acc` is written
// back in natural order at the end.
inline constexpr std::int64_t kI8Ahead = 16;  // rows of software prefetch distance

TILEDECODE_TARGET_AVX2 inline void matmul_i8_axpy(std::int32_t* acc, std::int64_t acc_ld,
                                                  const std::int32_t* a_pairs, std::int64_t a_ld,
                                                  int T, const std::int8_t* w, std::int64_t w_ld,
                                                  std::int64_t K, std::int64_t n0,
                                                  std::int64_t n1) {
  const std::int64_t width = n1 - n0;
  // Permuted accumulators live in acc itself while the k loop runs.
  for (int t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < width; j += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + t * acc_ld + j), _mm256_setzero_si256());
  std::int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    // Prefetch the slab rows kI8Ahead ahead: rows are w_ld apart, 32 KB for wq_b, so every row
    // segment sits on its own 4 KB page and the hardware prefetchers, which stop at page
    // boundaries, never run ahead (measured ~2 GB/s without this).
    const bool ahead = k + kI8Ahead + 8 <= K;
    for (std::int64_t j = 0; j < width; j += 16) {
      if (ahead && (j & 63) == 0) {
        const std::int8_t* pf = w + (k + kI8Ahead) * w_ld + n0 + j;
        for (int r = 0; r < 8; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * w_ld), _MM_HINT_T0);
      }
      __m256i l0, h0, l1, h1, l2, h2, l3, h3;
      i8_row_pairs(w + k * w_ld + n0 + j, w_ld, l0, h0);
      i8_row_pairs(w + (k + 2) * w_ld + n0 + j, w_ld, l1, h1);
      i8_row_pairs(w + (k + 4) * w_ld + n0 + j, w_ld, l2, h2);
      i8_row_pairs(w + (k + 6) * w_ld + n0 + j, w_ld, l3, h3);
      for (int t = 0; t < T; ++t) {
        const std::int32_t* ap = a_pairs + t * a_ld + k / 2;
        const __m256i b0 = _mm256_set1_epi32(ap[0]), b1 = _mm256_set1_epi32(ap[1]);
        const __m256i b2 = _mm256_set1_epi32(ap[2]), b3 = _mm256_set1_epi32(ap[3]);
        __m256i* d = reinterpret_cast<__m256i*>(acc + t * acc_ld + j);
        __m256i x = _mm256_loadu_si256(d), y = _mm256_loadu_si256(d + 1);
        x = _mm256_add_epi32(
            x, _mm256_add_epi32(_mm256_madd_epi16(l0, b0), _mm256_madd_epi16(l1, b1)));
        x = _mm256_add_epi32(
            x, _mm256_add_epi32(_mm256_madd_epi16(l2, b2), _mm256_madd_epi16(l3, b3)));
        y = _mm256_add_epi32(
            y, _mm256_add_epi32(_mm256_madd_epi16(h0, b0), _mm256_madd_epi16(h1, b1)));
        y = _mm256_add_epi32(
            y, _mm256_add_epi32(_mm256_madd_epi16(h2, b2), _mm256_madd_epi16(h3, b3)));
        _mm256_storeu_si256(d, x);
        _mm256_storeu_si256(d + 1, y);
      }
    }
  }
  for (; k + 2 <= K; k += 2) {
    for (std::int64_t j = 0; j < width; j += 16) {
      __m256i l0, h0;
      i8_row_pairs(w + k * w_ld + n0 + j, w_ld, l0, h0);
      for (int t = 0; t < T; ++t) {
        const __m256i b0 = _mm256_set1_epi32(a_pairs[t * a_ld + k / 2]);
        __m256i* d = reinterpret_cast<__m256i*>(acc + t * acc_ld + j);
        _mm256_storeu_si256(d, _mm256_add_epi32(_mm256_loadu_si256(d), _mm256_madd_epi16(l0, b0)));
        _mm256_storeu_si256(d + 1,
                            _mm256_add_epi32(_mm256_loadu_si256(d + 1), _mm256_madd_epi16(h0, b0)));
      }
    }
  }
  // Undo the in-lane interleave: x holds columns {0-3, 8-11}, y holds {4-7, 12-15}.
  for (int t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < width; j += 16) {
      __m256i* d = reinterpret_cast<__m256i*>(acc + t * acc_ld + j);
      const __m256i x = _mm256_loadu_si256(d), y = _mm256_loadu_si256(d + 1);
      _mm256_storeu_si256(d, _mm256_permute2x128_si256(x, y, 0x20));
      _mm256_storeu_si256(d + 1, _mm256_permute2x128_si256(x, y, 0x31));
    }
  }
}

// Σ_i a[i] * b[i] over n FP32 values, accumulated in double (4 + 4 lanes, fixed order, then a
// fixed horizontal sum; scalar tail). FP32 × FP32 products are exact in double, so the result
// differs from a sequential double sum only by double rounding (~1e-16 relative).
TILEDECODE_TARGET_AVX2 inline double dot_f32_f64(const float* a, const float* b, std::int64_t n) {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i), y = _mm256_loadu_ps(b + i);
    s0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                         _mm256_cvtps_pd(_mm256_castps256_ps128(y)), s0);
    s1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)),
                         _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)), s1);
  }
  alignas(32) double l[4];
  _mm256_store_pd(l, _mm256_add_pd(s0, s1));
  double s = (l[0] + l[1]) + (l[2] + l[3]);
  for (; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// sums[r * NT + t] = dot_f32_f64(w + r * ld_w, x + t * ld_x, n) for r < NR, t < NT, bit for bit
// (the same two 4-lane accumulators per pair, the same final sum). One dot alone is bound by the
// FMA latency (two dependent chains) and converts both operands; the NR × NT tile runs 2·NR·NT
// chains and converts each 8-value slice of a row or token once for NT (or NR) dots.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 inline void dot_f32_f64_tile(double* sums, const float* w, std::int64_t ld_w,
                                                    const float* x, std::int64_t ld_x,
                                                    std::int64_t n) {
  __m256d s0[NR][NT], s1[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s0[r][t] = s1[r][t] = _mm256_setzero_pd();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256d wl[NR], wh[NR];
    for (int r = 0; r < NR; ++r) {
      const __m256 v = _mm256_loadu_ps(w + r * ld_w + i);
      wl[r] = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      wh[r] = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    }
    for (int t = 0; t < NT; ++t) {
      const __m256 v = _mm256_loadu_ps(x + t * ld_x + i);
      const __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d xh = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      for (int r = 0; r < NR; ++r) {
        s0[r][t] = _mm256_fmadd_pd(wl[r], xl, s0[r][t]);
        s1[r][t] = _mm256_fmadd_pd(wh[r], xh, s1[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      alignas(32) double l[4];
      _mm256_store_pd(l, _mm256_add_pd(s0[r][t], s1[r][t]));
      double s = (l[0] + l[1]) + (l[2] + l[3]);
      for (std::int64_t k = i; k < n; ++k) s += double(w[r * ld_w + k]) * double(x[t * ld_x + k]);
      sums[r * NT + t] = s;
    }
}

// y[o, i] = a[i] * post[o] + Σ_s x[s, i] * comb[s, o] for 4 output streams (hc_post), FP32.
// The sum runs a·post first, then s = 0..3, matching the scalar path.
TILEDECODE_TARGET_AVX2 inline void hc_post_row(float* y, std::int64_t y_ld, const bf16* a,
                                               const float* x, std::int64_t x_ld,
                                               const float post[4], const float comb[16],
                                               std::int64_t n) {
  for (int o = 0; o < 4; ++o) {
    const __m256 p = _mm256_set1_ps(post[o]);
    const __m256 c0 = _mm256_set1_ps(comb[0 * 4 + o]), c1 = _mm256_set1_ps(comb[1 * 4 + o]);
    const __m256 c2 = _mm256_set1_ps(comb[2 * 4 + o]), c3 = _mm256_set1_ps(comb[3 * 4 + o]);
    float* yo = y + o * y_ld;
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 s = _mm256_mul_ps(load_bf16x8(a + i), p);
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(x + i), c0));
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(x + x_ld + i), c1));
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(x + 2 * x_ld + i), c2));
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(x + 3 * x_ld + i), c3));
      _mm256_storeu_ps(yo + i, s);
    }
    for (; i < n; ++i) {
      float s = a[i].to_float() * post[o];
      s += x[i] * comb[0 * 4 + o];
      s += x[x_ld + i] * comb[1 * 4 + o];
      s += x[2 * x_ld + i] * comb[2 * 4 + o];
      s += x[3 * x_ld + i] * comb[3 * 4 + o];
      yo[i] = s;
    }
  }
}

}  // namespace tiledecode::cpu::avx2

namespace tiledecode::cpu::avx2_vnni {

// Rows p, p + ld, p + 2ld, p + 3ld (32 INT8 columns each) offset to u8 (w + 128) and interleaved
// into dwords (w[r][n], w[r+1][n], w[r+2][n], w[r+3][n]); per-lane unpacks leave the columns as
// q[0] = {0-3, 16-19}, q[1] = {4-7, 20-23}, q[2] = {8-11, 24-27}, q[3] = {12-15, 28-31}.
TILEDECODE_TARGET_AVX2_VNNI inline void u8_row_quads(const std::int8_t* p, std::int64_t ld,
                                                     __m256i q[4]) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * ld)), offset);
  const __m256i t0 = _mm256_unpacklo_epi8(r[0], r[1]), t1 = _mm256_unpackhi_epi8(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi8(r[2], r[3]), t3 = _mm256_unpackhi_epi8(r[2], r[3]);
  q[0] = _mm256_unpacklo_epi16(t0, t2);
  q[1] = _mm256_unpackhi_epi16(t0, t2);
  q[2] = _mm256_unpacklo_epi16(t1, t3);
  q[3] = _mm256_unpackhi_epi16(t1, t3);
}

// avx2::matmul_i8_axpy's contract on vpdpbusd: acc[t, j] = Σ_k a[t, k] * w[k, n0 + j] exactly in
// INT32, for j < n1 - n0 (a multiple of 32) and K a multiple of 8. `a` holds the INT8
// activations (row stride a_ld bytes), a_sum[t] = Σ_k a[t, k]. The weights become the unsigned
// operand (w + 128, four consecutive rows interleaved per column), the activation dword
// (a[t,k..k+3]) is broadcast signed, and the accumulators start at -128·a_sum[t]:
//   Σ_k (w_k + 128)·a_k - 128·Σ_k a_k = Σ_k w_k·a_k.
// Bound: partial sums stay within 255·128·K + 128·127·K < 2^31 for K <= 65536 (the caller
// checks). Two 4-row groups per pass: 8 weight vectors, 4 accumulators and 2 broadcasts live.
TILEDECODE_TARGET_AVX2_VNNI inline void matmul_i8_axpy(std::int32_t* acc, std::int64_t acc_ld,
                                                       const std::int8_t* a, std::int64_t a_ld,
                                                       const std::int32_t* a_sum, int T,
                                                       const std::int8_t* w, std::int64_t w_ld,
                                                       std::int64_t K, std::int64_t n0,
                                                       std::int64_t n1) {
  const std::int64_t width = n1 - n0;
  for (int t = 0; t < T; ++t) {
    const __m256i start = _mm256_set1_epi32(-128 * a_sum[t]);
    for (std::int64_t j = 0; j < width; j += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + t * acc_ld + j), start);
  }
  for (std::int64_t k = 0; k + 8 <= K; k += 8) {
    // Software prefetch kI8Ahead rows ahead (rows are w_ld apart: see avx2::matmul_i8_axpy).
    const bool ahead = k + avx2::kI8Ahead + 8 <= K;
    for (std::int64_t j = 0; j < width; j += 32) {
      if (ahead && (j & 63) == 0) {
        const std::int8_t* pf = w + (k + avx2::kI8Ahead) * w_ld + n0 + j;
        for (int r = 0; r < 8; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * w_ld), _MM_HINT_T0);
      }
      __m256i q[8];
      u8_row_quads(w + k * w_ld + n0 + j, w_ld, q);
      u8_row_quads(w + (k + 4) * w_ld + n0 + j, w_ld, q + 4);
      for (int t = 0; t < T; ++t) {
        std::int32_t a0, a1;
        std::memcpy(&a0, a + t * a_ld + k, 4);
        std::memcpy(&a1, a + t * a_ld + k + 4, 4);
        const __m256i b0 = _mm256_set1_epi32(a0), b1 = _mm256_set1_epi32(a1);
        __m256i* d = reinterpret_cast<__m256i*>(acc + t * acc_ld + j);
        for (int c = 0; c < 4; ++c) {
          const __m256i x = _mm256_loadu_si256(d + c);
          _mm256_storeu_si256(d + c, dpbusd(dpbusd(x, q[c], b0), q[4 + c], b1));
        }
      }
    }
  }
  // Undo the in-lane interleave (see u8_row_quads) into natural column order.
  for (int t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < width; j += 32) {
      __m256i* d = reinterpret_cast<__m256i*>(acc + t * acc_ld + j);
      const __m256i x0 = _mm256_loadu_si256(d), x1 = _mm256_loadu_si256(d + 1);
      const __m256i x2 = _mm256_loadu_si256(d + 2), x3 = _mm256_loadu_si256(d + 3);
      _mm256_storeu_si256(d, _mm256_permute2x128_si256(x0, x1, 0x20));
      _mm256_storeu_si256(d + 1, _mm256_permute2x128_si256(x2, x3, 0x20));
      _mm256_storeu_si256(d + 2, _mm256_permute2x128_si256(x0, x1, 0x31));
      _mm256_storeu_si256(d + 3, _mm256_permute2x128_si256(x2, x3, 0x31));
    }
  }
}

// The packed operand of matmul_i8_packed: for every 8-column vector v (columns 8v..8v+7) and
// k-quad q (rows 4q..4q+3), 32 bytes with byte 4j + i = u8(w[4q + i][8v + j] + 128), the
// vpdpbusd lane j operand as it is; vector v's K/4 quads are consecutive (K·8 bytes), so a
// column range [8v0, 8v1) of all K rows is one contiguous run. kernels::pack_qkv_wq_b builds it.
inline constexpr int kPackedTileTokens = 4;  // tokens per register tile
inline constexpr int kPackedTileVecs = 3;    // 8-column vectors per register tile

// One register tile: TT tokens × NC column vectors over the whole K (KQ quads), accumulators
// in registers from the start value -128·a_sum[t] to the store (TT·NC + NC + 1 <= 16 ymm).
// Each iteration also prefetches pf + q·pf_step (its share of the next slab, at most 128 bytes
// per quad; see matmul_i8_packed).
template <int TT, int NC>
TILEDECODE_TARGET_AVX2_VNNI inline void packed_tile(std::int32_t* acc, std::int64_t acc_ld,
                                                    const std::int8_t* a, std::int64_t a_ld,
                                                    const std::int32_t* a_sum,
                                                    const std::uint8_t* wp, std::int64_t KQ,
                                                    std::uintptr_t pf, std::int64_t pf_step) {
  __m256i s[TT][NC];
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < NC; ++c) s[t][c] = _mm256_set1_epi32(-128 * a_sum[t]);
  const std::int64_t vstride = KQ * 32;
  for (std::int64_t q = 0; q < KQ; ++q) {
    const std::uintptr_t p = pf + std::uintptr_t(q * pf_step);
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    if (pf_step > 64)  // one token tile: 96 bytes per quad, two lines
      _mm_prefetch(reinterpret_cast<const char*>(p + 64), _MM_HINT_T0);
    __m256i w[NC];
    for (int c = 0; c < NC; ++c)
      w[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + c * vstride + q * 32));
    for (int t = 0; t < TT; ++t) {
      std::int32_t av;
      std::memcpy(&av, a + t * a_ld + 4 * q, 4);
      const __m256i b = _mm256_set1_epi32(av);
      for (int c = 0; c < NC; ++c) s[t][c] = dpbusd(s[t][c], w[c], b);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + t * acc_ld + 8 * c), s[t][c]);
}

// packed_tile<tt, nc> for run-time tt <= TT, nc <= NC.
template <int TT, int NC>
TILEDECODE_TARGET_AVX2_VNNI inline void packed_tile_dispatch(
    int tt, int nc, std::int32_t* acc, std::int64_t acc_ld, const std::int8_t* a, std::int64_t a_ld,
    const std::int32_t* a_sum, const std::uint8_t* wp, std::int64_t KQ, std::uintptr_t pf,
    std::int64_t pf_step) {
  if constexpr (NC > 1) {
    if (nc < NC)
      return packed_tile_dispatch<TT, NC - 1>(tt, nc, acc, acc_ld, a, a_ld, a_sum, wp, KQ, pf,
                                              pf_step);
  }
  if constexpr (TT > 1) {
    if (tt < TT)
      return packed_tile_dispatch<TT - 1, NC>(tt, nc, acc, acc_ld, a, a_ld, a_sum, wp, KQ, pf,
                                              pf_step);
  }
  packed_tile<TT, NC>(acc, acc_ld, a, a_ld, a_sum, wp, KQ, pf, pf_step);
}

// matmul_i8_axpy's contract on pre-packed weights: acc[t, j] = Σ_k a[t, k] * w[k, j] exactly in
// INT32 for t < T, j < width (a multiple of 8), K a multiple of 4; `wp` points at the packed
// vector of column 0 (layout above, 32-byte aligned), a / a_sum as in matmul_i8_axpy. The loads
// are the vpdpbusd operands (no offset, no shuffle, no accumulator traffic); per slab of
// kPackedTileVecs vectors (24 KB at K = 1024) the token tiles run one after the other and the
// later ones find the slab in L1. Each tile software-prefetches its share of the next slab (the
// packed stream continues there), so the memory stream runs evenly under all tiles: without
// it, T = 8 ran at 2.4 ms per 64 heads against 1.9 for matmul_i8_axpy; with it 1.25-1.35 ms
// (T0, NTA and two slabs ahead measured the same). Same start value as matmul_i8_axpy
// (-128·a_sum[t]); exact: partial sums stay within 255·128·K + 128·128·K < 2^31 for
// K <= 65536 (the caller checks).
TILEDECODE_TARGET_AVX2_VNNI inline void matmul_i8_packed(std::int32_t* acc, std::int64_t acc_ld,
                                                         const std::int8_t* a, std::int64_t a_ld,
                                                         const std::int32_t* a_sum, int T,
                                                         const std::uint8_t* wp, std::int64_t K,
                                                         std::int64_t width) {
  if (T <= 0) return;
  const std::int64_t KQ = K / 4, nv = width / 8;
  const int tiles = (T + kPackedTileTokens - 1) / kPackedTileTokens;
  for (std::int64_t v0 = 0; v0 < nv; v0 += kPackedTileVecs) {
    const int nc = int(std::min<std::int64_t>(kPackedTileVecs, nv - v0));
    const std::uint8_t* w = wp + v0 * KQ * 32;
    // The next slab, spread over this slab's token tiles; past the last head it runs beyond the
    // buffer, hence integer addresses (a prefetch never faults).
    const std::int64_t next = kPackedTileVecs * KQ * 32, share = next / tiles;
    for (int t0 = 0, i = 0; t0 < T; t0 += kPackedTileTokens, ++i) {
      const int tt = std::min(kPackedTileTokens, T - t0);
      packed_tile_dispatch<kPackedTileTokens, kPackedTileVecs>(
          tt, nc, acc + t0 * acc_ld + v0 * 8, acc_ld, a + t0 * a_ld, a_ld, a_sum + t0, w, KQ,
          std::uintptr_t(w) + std::uintptr_t(nc * KQ * 32 + i * share), share / KQ);
    }
  }
}

}  // namespace tiledecode::cpu::avx2_vnni
#endif
