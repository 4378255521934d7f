#pragma once
// The output projection's INT8 stage (wo_b) on the AVX-512 tier (Isa::avx512): the 512-bit
// vpdpbusd tile. Exact INT32 like the avx2 and avx2_vnni tiles, so outputs are bit-identical to
// those tiers'. The wo_a stage runs the AVX2 kernel on this tier. Reached only through
// backend/cpu/output_projection.hpp after the runtime ISA check.

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/output_projection_avx2.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// One 64-byte step r of oproj_b_tile through the byte mask m (all ones, or the low 32 bytes for
// the last half step): the weight rows offset to u8 (w + 128), the activations signed; a masked
// activation byte is zero and adds nothing whatever the weight.
template <int NT>
TILEDECODE_TARGET_AVX512 inline void oproj_b_step(__m512i (&acc)[NT][2], const std::int8_t* a,
                                                  std::int64_t lda, const std::int8_t* w,
                                                  std::int64_t ldw, int r, __mmask64 m) {
  // The next pair of weight rows, non-temporal (see avx2_vnni::oproj_b_tile).
  _mm_prefetch(reinterpret_cast<const char*>(w + 2 * ldw + r), _MM_HINT_NTA);
  _mm_prefetch(reinterpret_cast<const char*>(w + 3 * ldw + r), _MM_HINT_NTA);
  const __m512i offset = u8_offset();
  const __m512i w0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + r), offset);
  const __m512i w1 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + ldw + r), offset);
  for (int t = 0; t < NT; ++t) {
    const __m512i av = _mm512_maskz_loadu_epi8(m, a + t * lda + r);
    acc[t][0] = dpbusd(acc[t][0], w0, av);
    acc[t][1] = dpbusd(acc[t][1], w1, av);
  }
}

// avx2_vnni::oproj_b_tile's contract on 64-byte steps:
//   p[t * ldp + c] = Σ_{r < kr} a[t * lda + r] · w[c * ldw + r]   (exact INT32), t < NT, c < 2,
// with the weight offset to u8 (w + 128) and a_sum[t * ld_sum] = Σ_{r < kr} a[t * lda + r]
// cancelling the offset. kr % 32 == 0 (as for the 256-bit tiles); a last half step reads 32 bytes
// through a zeroing mask. Exact: a lane sums kr / 16 products of magnitude <= 255·128 and the
// caller bounds kr <= 65536. The reduction folds each register to 8 lanes (integer sums: any
// order gives the same result) and then reduces as the 256-bit tile does.
template <int NT>
TILEDECODE_TARGET_AVX512 inline void oproj_b_tile(std::int32_t* p, std::int64_t ldp,
                                                  const std::int8_t* a, std::int64_t lda,
                                                  const std::int8_t* w, std::int64_t ldw, int kr,
                                                  const std::int32_t* a_sum, std::int64_t ld_sum) {
  __m512i acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
  int r = 0;
  for (; r + 64 <= kr; r += 64) oproj_b_step<NT>(acc, a, lda, w, ldw, r, ~__mmask64{0});
  if (r < kr) oproj_b_step<NT>(acc, a, lda, w, ldw, r, __mmask64{0xFFFFFFFFu});
  if constexpr (NT == 4) {
    if (ldp == 2) {  // p is 8 consecutive int32 (t-major, c-minor): one reduction, one store
      const __m256i v[8] = {fold_epi32(acc[0][0]), fold_epi32(acc[0][1]), fold_epi32(acc[1][0]),
                            fold_epi32(acc[1][1]), fold_epi32(acc[2][0]), fold_epi32(acc[2][1]),
                            fold_epi32(acc[3][0]), fold_epi32(acc[3][1])};
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
    p[t * ldp] = avx2::hsum_epi32(fold_epi32(acc[t][0])) - bias;
    p[t * ldp + 1] = avx2::hsum_epi32(fold_epi32(acc[t][1])) - bias;
  }
}

// Two weight rows (w, w + ldw) against nt activation rows (avx2_vnni::oproj_b_pair's contract).
TILEDECODE_TARGET_AVX512 inline void oproj_b_pair(std::int32_t* p, std::int64_t ldp,
                                                  const std::int8_t* a, std::int64_t lda, int nt,
                                                  const std::int8_t* w, std::int64_t ldw, int kr,
                                                  const std::int32_t* a_sum, std::int64_t ld_sum) {
  const auto tile = [&]<int NT>(int t) {
    oproj_b_tile<NT>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum, ld_sum);
  };
  int t = 0;
  for (; t + 4 <= nt; t += 4) tile.template operator()<4>(t);
  if (t < nt) with_static_count<3>(nt - t, [&]<int NT>() { tile.template operator()<NT>(t); });
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
