#pragma once
// AVX2 + FMA primitives of the grouped W8A8 output projection (kernels/output_projection.hpp).
//   wo_a stage  o_r[t, r] += Σ_k o[t, k] · wo_a[r, k]   BF16 weights widened in registers,
//               FP32 activations, reduction over k in 8-lane partial sums, one K chunk at a time
//               (the micro-kernel shared with the compressors, bf16_rows_avx2.hpp)
//   wo_b stage  P[t, n] = Σ_r a[t, r] · wo_b[n, r]      exact INT8 dot (sign trick, simd/avx2.hpp;
//               vpdpbusd on Isa::avx2_vnni, end of file)
// Must only be called after the runtime ISA check (cpu::has_avx2(ctx.isa); the VNNI tile only
// for Isa::avx2_vnni).

#include <cstdint>

#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/backend/cpu/simd/avx_vnni.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// out (nt tokens, ldout) += o (nt, ldo) · w (nr rows, ldw)ᵀ over kc inputs (kc % 8 == 0): the
// shared BF16 micro-kernel (bf16_rows_avx2.hpp). Rows [nr, nr_pf) of w may be prefetched.
TILEDECODE_TARGET_AVX2 inline void oproj_a_chunk(float* out, std::int64_t ldout, const float* o,
                                                 std::int64_t ldo, int nt, const bf16* w,
                                                 std::int64_t ldw, int nr, int kc, int nr_pf) {
  bf16_rows_dot<true>(out, ldout, o, ldo, nt, w, ldw, nr, kc, nr_pf);
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
    // The next pair of weight rows, same offset, non-temporal: wo_b is read once per call and
    // must not evict the activations and the caller's data (vs _MM_HINT_T0: o-proj 8.37 -> 7.9-8.15
    // ms on the VNNI tier, interleaved A/B; the same hint did nothing for wq_b or the BF16 rows).
    if ((r & 63) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * ldw + r), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(w + 3 * ldw + r), _MM_HINT_NTA);
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

namespace tiledecode::cpu::avx2_vnni {

// The wo_b tile on vpdpbusd (avx2::oproj_b_tile's contract plus the activation sums):
//   p[t * ldp + c] = Σ_{r < kr} a[t * lda + r] · w[c * ldw + r]   (exact INT32), t < NT, c < 2.
// The weight becomes the unsigned operand by the offset w + 128 (XOR 0x80, once per weight
// vector, shared by the NT tokens); the activation stays signed:
//   Σ_r (w_r + 128) a_r = a·w + 128 Σ_r a_r,  a_sum[t * ld_sum] = Σ_{r < kr} a[t * lda + r].
// One vpdpbusd per 32 pairs per token (the sign-trick tile needs two vpsignb, vpmaddubsw,
// vpmaddwd and vpaddd). Exact for any int8 weight and activation: a lane sums kr / 8 products of
// magnitude <= 255·128 and the caller bounds kr <= 65536, so no INT32 overflow.
template <int NT>
TILEDECODE_TARGET_AVX2_VNNI inline void oproj_b_tile(std::int32_t* p, std::int64_t ldp,
                                                     const std::int8_t* a, std::int64_t lda,
                                                     const std::int8_t* w, std::int64_t ldw, int kr,
                                                     const std::int32_t* a_sum,
                                                     std::int64_t ld_sum) {
  __m256i acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int r = 0; r < kr; r += 32) {
    // The next pair of weight rows, same offset, non-temporal: wo_b is read once per call and
    // must not evict the activations and the caller's data (vs _MM_HINT_T0: o-proj 8.37 -> 7.9-8.15
    // ms on the VNNI tier, interleaved A/B; the same hint did nothing for wq_b or the BF16 rows).
    if ((r & 63) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * ldw + r), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(w + 3 * ldw + r), _MM_HINT_NTA);
    }
    const __m256i w0 =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r)), offset);
    const __m256i w1 =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ldw + r)), offset);
    for (int t = 0; t < NT; ++t) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + t * lda + r));
      acc[t][0] = dpbusd(acc[t][0], w0, av);
      acc[t][1] = dpbusd(acc[t][1], w1, av);
    }
  }
  if constexpr (NT == 4) {
    if (ldp == 2) {  // p is 8 consecutive int32 (t-major, c-minor): one reduction, one store
      const __m256i v[8] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1],
                            acc[2][0], acc[2][1], acc[3][0], acc[3][1]};
      const std::int32_t b0 = 128 * a_sum[0], b1 = 128 * a_sum[ld_sum];
      const std::int32_t b2 = 128 * a_sum[2 * ld_sum], b3 = 128 * a_sum[3 * ld_sum];
      const __m256i bias = _mm256_setr_epi32(b0, b0, b1, b1, b2, b2, b3, b3);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                          _mm256_sub_epi32(avx2::hsum8_epi32(v), bias));
      return;
    }
  }
  for (int t = 0; t < NT; ++t) {
    const std::int32_t bias = 128 * a_sum[t * ld_sum];
    p[t * ldp] = avx2::hsum_epi32(acc[t][0]) - bias;
    p[t * ldp + 1] = avx2::hsum_epi32(acc[t][1]) - bias;
  }
}

// Two weight rows (w, w + ldw) against nt activation rows (avx2::oproj_b_pair's contract).
TILEDECODE_TARGET_AVX2_VNNI inline void oproj_b_pair(std::int32_t* p, std::int64_t ldp,
                                                     const std::int8_t* a, std::int64_t lda, int nt,
                                                     const std::int8_t* w, std::int64_t ldw, int kr,
                                                     const std::int32_t* a_sum,
                                                     std::int64_t ld_sum) {
  int t = 0;
  for (; t + 4 <= nt; t += 4)
    oproj_b_tile<4>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum, ld_sum);
  switch (nt - t) {
    case 3:
      oproj_b_tile<3>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum, ld_sum);
      break;
    case 2:
      oproj_b_tile<2>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum, ld_sum);
      break;
    case 1:
      oproj_b_tile<1>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum, ld_sum);
      break;
    default:
      break;
  }
}

}  // namespace tiledecode::cpu::avx2_vnni
#endif
