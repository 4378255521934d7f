#pragma once
// AVX2 + FMA primitives of the grouped W8A8 output projection (kernels/output_projection.hpp).
//   wo_a stage  o_r[t, r] += Σ_k o[t, k] · wo_a[r, k]   BF16 weights widened in registers,
//               FP32 activations, reduction over k in 8-lane partial sums, one K chunk at a time
//   wo_b stage  P[t, n] = Σ_r a[t, r] · wo_b[n, r]      exact INT8 dot (sign trick, simd/avx2.hpp)
// Must only be called after the runtime AVX2 check (ctx.isa == Isa::avx2).

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// out[t * ldout + r] += Σ_{k < kc} o[t * ldo + k] · float(w[r * ldw + k]) for t < NT, r < NR.
// Register tile of NT tokens × NR weight rows (≤ 12 accumulators): per 8 k, NR weight vectors are
// widened once and NT activation vectors loaded once, for NT·NR FMAs.
template <int NT, int NR>
TILEDECODE_TARGET_AVX2 inline void oproj_a_tile(float* out, std::int64_t ldout, const float* o,
                                                std::int64_t ldo, const bf16* w, std::int64_t ldw,
                                                int kc) {
  __m256 acc[NT][NR];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int k = 0; k < kc; k += 8) {
    // Pull the next row tile's weights (the same k) towards L1 while this one computes.
    if ((k & 31) == 0) {
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * ldw + k), _MM_HINT_T0);
    }
    __m256 wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) wv[r] = load_bf16x8(w + r * ldw + k);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m256 ov = _mm256_loadu_ps(o + t * ldo + k);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[t][r] = _mm256_fmadd_ps(ov, wv[r], acc[t][r]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) out[t * ldout + r] += hsum(acc[t][r]);
}

template <int NR>
TILEDECODE_TARGET_AVX2 inline void oproj_a_rows(float* out, std::int64_t ldout, const float* o,
                                                std::int64_t ldo, int nt, const bf16* w,
                                                std::int64_t ldw, int kc) {
  int t = 0;
  for (; t + 4 <= nt; t += 4)
    oproj_a_tile<4, NR>(out + t * ldout, ldout, o + t * ldo, ldo, w, ldw, kc);
  float* ot = out + t * ldout;
  const float* at = o + t * ldo;
  switch (nt - t) {
    case 3:
      oproj_a_tile<3, NR>(ot, ldout, at, ldo, w, ldw, kc);
      break;
    case 2:
      oproj_a_tile<2, NR>(ot, ldout, at, ldo, w, ldw, kc);
      break;
    case 1:
      oproj_a_tile<1, NR>(ot, ldout, at, ldo, w, ldw, kc);
      break;
    default:
      break;
  }
}

// out (nt tokens, ldout) += o (nt, ldo) · w (nr rows, ldw)ᵀ over kc inputs (kc % 8 == 0).
TILEDECODE_TARGET_AVX2 inline void oproj_a_chunk(float* out, std::int64_t ldout, const float* o,
                                                 std::int64_t ldo, int nt, const bf16* w,
                                                 std::int64_t ldw, int nr, int kc) {
  int r = 0;
  for (; r + 3 <= nr; r += 3) oproj_a_rows<3>(out + r, ldout, o, ldo, nt, w + r * ldw, ldw, kc);
  if (nr - r == 2) oproj_a_rows<2>(out + r, ldout, o, ldo, nt, w + r * ldw, ldw, kc);
  if (nr - r == 1) oproj_a_rows<1>(out + r, ldout, o, ldo, nt, w + r * ldw, ldw, kc);
}

// p[t * ldp + c] = Σ_{r < kr} a[t * lda + r] · w[c * ldw + r] (exact INT32) for t < NT, c < 2.
// |w| (unsigned side of vpmaddubsw, computed once per weight vector; -128 reads as 128) times
// sign(a, w) (|a| <= 127, Q8 activations): every pair sum is <= 2·128·127 = 32512 < 32767, exact.
template <int NT>
TILEDECODE_TARGET_AVX2 inline void oproj_b_tile(std::int32_t* p, std::int64_t ldp,
                                                const std::int8_t* a, std::int64_t lda,
                                                const std::int8_t* w, std::int64_t ldw, int kr) {
  __m256i acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < kr; r += 32) {
    if ((r & 63) == 0) {  // next pair of weight rows, same offset
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * ldw + r), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + 3 * ldw + r), _MM_HINT_T0);
    }
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ldw + r));
    const __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
    for (int t = 0; t < NT; ++t) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + t * lda + r));
      const __m256i p0 = _mm256_maddubs_epi16(aw0, _mm256_sign_epi8(av, w0));
      const __m256i p1 = _mm256_maddubs_epi16(aw1, _mm256_sign_epi8(av, w1));
      acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(p0, ones));
      acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int t = 0; t < NT; ++t) {
    p[t * ldp] = hsum_epi32(acc[t][0]);
    p[t * ldp + 1] = hsum_epi32(acc[t][1]);
  }
}

// Two weight rows (w, w + ldw) against nt activation rows.
TILEDECODE_TARGET_AVX2 inline void oproj_b_pair(std::int32_t* p, std::int64_t ldp,
                                                const std::int8_t* a, std::int64_t lda, int nt,
                                                const std::int8_t* w, std::int64_t ldw, int kr) {
  int t = 0;
  for (; t + 4 <= nt; t += 4) oproj_b_tile<4>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr);
  switch (nt - t) {
    case 3:
      oproj_b_tile<3>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr);
      break;
    case 2:
      oproj_b_tile<2>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr);
      break;
    case 1:
      oproj_b_tile<1>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr);
      break;
    default:
      break;
  }
}

}  // namespace tiledecode::cpu::avx2
#endif
