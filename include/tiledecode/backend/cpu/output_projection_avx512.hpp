#pragma once
// The output projection's INT8 stage (wo_b) on the AVX-512 tier (Isa::avx512): the 512-bit
// vpdpbusd tiles (2 rows × 4 tokens for small batches, 4 × 6 blocked for many tokens). Exact
// INT32 like the avx2 and avx2_vnni tiles, so outputs are bit-identical to those tiers'. The
// wo_a stage runs on vdpbf16ps (bf16_rows_avx512.hpp). Reached only through
// backend/cpu/output_projection.hpp after the runtime ISA check.

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/output_projection_avx2.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// 64 bytes at p, or (kHalf) 32 through a zeroing mask.
template <bool kHalf>
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512i load64(
    const std::int8_t* p) {
  if constexpr (kHalf) {
    return _mm512_maskz_loadu_epi8(__mmask64{0xFFFFFFFFu}, p);
  } else {
    return _mm512_loadu_si512(p);
  }
}

// One 64-byte step r of an NC-row × NT-token tile, whole or (kHalf) the low 32 bytes through a
// zeroing mask (the last half step; whole steps take plain loads, a masked load costs several
// times one on Zen 4): the weight rows offset to u8 (w + 128), the activations signed; a masked
// activation byte is zero and adds nothing whatever the weight. kPrefetchNext:
// the next NC weight rows, non-temporal (see avx2_vnni::oproj_b_tile), for the tiles that read
// each weight once.
template <int NC, int NT, bool kPrefetchNext, bool kHalf>
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline void oproj_b_step(
    __m512i (&acc)[NT][NC], const std::int8_t* a, std::int64_t lda, const std::int8_t* w,
    std::int64_t ldw, int r) {
  if constexpr (kPrefetchNext)
    for (int c = 0; c < NC; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(w + (NC + c) * ldw + r), _MM_HINT_NTA);
  const __m512i offset = u8_offset();
  __m512i wv[NC];
  for (int c = 0; c < NC; ++c) wv[c] = _mm512_xor_si512(load64<kHalf>(w + c * ldw + r), offset);
  for (int t = 0; t < NT; ++t) {
    const __m512i av = load64<kHalf>(a + t * lda + r);
    for (int c = 0; c < NC; ++c) acc[t][c] = dpbusd(acc[t][c], wv[c], av);
  }
}

// All of a tile's steps over kr bytes: whole 64-byte steps, then (kHalfStep: kr % 64 == 32) the
// masked half step. The caller picks kHalfStep from kr once per tile shape, so a tile without a
// half step has no tail code, before which GCC parks the accumulators on the stack.
template <int NC, int NT, bool kPrefetchNext, bool kHalfStep>
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline void oproj_b_steps(
    __m512i (&acc)[NT][NC], const std::int8_t* a, std::int64_t lda, const std::int8_t* w,
    std::int64_t ldw, int kr) {
  int r = 0;
  for (; r + 64 <= kr; r += 64) oproj_b_step<NC, NT, kPrefetchNext, false>(acc, a, lda, w, ldw, r);
  if constexpr (kHalfStep) oproj_b_step<NC, NT, kPrefetchNext, true>(acc, a, lda, w, ldw, r);
}

// avx2_vnni::oproj_b_tile's contract on 64-byte steps:
//   p[t * ldp + c] = Σ_{r < kr} a[t * lda + r] · w[c * ldw + r]   (exact INT32), t < NT, c < 2,
// with the weight offset to u8 (w + 128) and a_sum[t * ld_sum] = Σ_{r < kr} a[t * lda + r]
// cancelling the offset. kr % 32 == 0 (as for the 256-bit tiles); a last half step reads 32 bytes
// through a zeroing mask. Exact: a lane sums kr / 16 products of magnitude <= 255·128 and the
// caller bounds kr <= 65536. The reduction folds each register to 8 lanes (integer sums: any
// order gives the same result) and then reduces as the 256-bit tile does.
template <int NT, bool kHalfStep>
TILEDECODE_TARGET_AVX512 inline void oproj_b_tile(std::int32_t* p, std::int64_t ldp,
                                                  const std::int8_t* a, std::int64_t lda,
                                                  const std::int8_t* w, std::int64_t ldw, int kr,
                                                  const std::int32_t* a_sum, std::int64_t ld_sum) {
  __m512i acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
  oproj_b_steps<2, NT, true, kHalfStep>(acc, a, lda, w, ldw, kr);
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
    if (kr % 64 == 0) {
      oproj_b_tile<NT, false>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum,
                              ld_sum);
    } else {
      oproj_b_tile<NT, true>(p + t * ldp, ldp, a + t * lda, lda, w, ldw, kr, a_sum + t * ld_sum,
                             ld_sum);
    }
  };
  int t = 0;
  for (; t + 4 <= nt; t += 4) tile.template operator()<4>(t);
  if (t < nt) with_static_count<3>(nt - t, [&]<int NT>() { tile.template operator()<NT>(t); });
}

// ---------------------------------------------------------------------------------------------
// The wo_b stage for many tokens: oproj_b_tile's exact P_g on register tiles of 4 weight rows ×
// 6 tokens (24 accumulators; per 64-byte step 4 weight loads from L1, 6 activation loads, 24
// vpdpbusd), the weights of 4 channels of one group (4 KB) kept in L1 while every token tile of
// a chunk runs them. The 2 × 4 tiles above read each weight once per 16 tokens and the
// activations once per channel pair: at 128 tokens both stream from L2 and the stage reaches a
// quarter of the vpdpbusd ceiling.
inline constexpr int kOprojBRows = 4;          // weight rows (output channels) per tile
inline constexpr int kOprojBTileTokens = 6;    // tokens per tile
inline constexpr int kOprojBChunkTokens = 64;  // tokens per chunk of double group sums
// project_b takes project_b_blocked (oproj_b_group) from this many tokens (the same bits: P_g is
// exact).
inline constexpr std::int64_t kOprojBBlockedMinTokens = 16;

// One group's dequantised sums of output channels [0, NC) (weight rows w + c·ldw) for NT tokens,
// added to their running double sums:
//   acc[t * ld_acc + c] += double(adq[t * ld_tok]) · double(P[t, c]),
//   P[t, c] = Σ_{r < kr} a[t * lda + r] · w[c * ldw + r]   (exact INT32)
// with oproj_b_tile's offset and bounds (a_sum[t * ld_tok] = Σ_r a[t * lda + r]). The product is
// exact (24 × 24 bits) and the sum rounded once per group, in vector lanes or not: the other
// tiers' combine and golden's, bit for bit, when the caller runs the groups in ascending order.
// a, a_sum and adq point at the first token's group.
template <int NC, int NT, bool kHalfStep>
TILEDECODE_TARGET_AVX512 inline void oproj_b_tile_rows(
    double* acc, std::int64_t ld_acc, const std::int8_t* a, std::int64_t lda, const std::int8_t* w,
    std::int64_t ldw, int kr, const float* adq, const std::int32_t* a_sum, std::int64_t ld_tok) {
  __m512i c[NT][NC];
  for (int t = 0; t < NT; ++t)
    for (int n = 0; n < NC; ++n) c[t][n] = _mm512_setzero_si512();
  oproj_b_steps<NC, NT, false, kHalfStep>(c, a, lda, w, ldw, kr);
  // Eight folded accumulators per horizontal sum (integer sums: any order, the same result). The
  // loops are unrolled whole so that c stays in registers.
  constexpr int n = NT * NC, n8 = (n + 7) / 8 * 8;
  __m256i f[n8];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) f[t * NC + k] = fold_epi32(c[t][k]);
#pragma GCC unroll 8
  for (int i = n; i < n8; ++i) f[i] = _mm256_setzero_si256();
  if constexpr (NC == 4) {
    // Two tokens' four channels per sum vector: offset, convert, scale and add in lanes.
#pragma GCC unroll 3
    for (int t = 0; t < NT; t += 2) {
      const int t1 = t + 1 < NT ? t + 1 : t;  // an odd last token: its lanes are dropped
      const __m256i v[8] = {f[4 * t],     f[4 * t + 1], f[4 * t + 2], f[4 * t + 3],
                            f[4 * t + 4], f[4 * t + 5], f[4 * t + 6], f[4 * t + 7]};
      const __m256i bias = _mm256_setr_m128i(_mm_set1_epi32(128 * a_sum[t * ld_tok]),
                                             _mm_set1_epi32(128 * a_sum[t1 * ld_tok]));
      const __m256i p = _mm256_sub_epi32(avx2::hsum8_epi32(v), bias);
      double* a0 = acc + t * ld_acc;
      _mm256_storeu_pd(a0,
                       _mm256_add_pd(_mm256_loadu_pd(a0),
                                     _mm256_mul_pd(_mm256_set1_pd(double(adq[t * ld_tok])),
                                                   _mm256_cvtepi32_pd(_mm256_castsi256_si128(p)))));
      if (t + 1 < NT) {
        double* a1 = acc + t1 * ld_acc;
        _mm256_storeu_pd(
            a1, _mm256_add_pd(_mm256_loadu_pd(a1),
                              _mm256_mul_pd(_mm256_set1_pd(double(adq[t1 * ld_tok])),
                                            _mm256_cvtepi32_pd(_mm256_extracti128_si256(p, 1)))));
      }
    }
  } else {
    alignas(32) std::int32_t sums[n8];
#pragma GCC unroll 3
    for (int i0 = 0; i0 < n; i0 += 8) {
      const __m256i v[8] = {f[i0],     f[i0 + 1], f[i0 + 2], f[i0 + 3],
                            f[i0 + 4], f[i0 + 5], f[i0 + 6], f[i0 + 7]};
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + i0), avx2::hsum8_epi32(v));
    }
    for (int t = 0; t < NT; ++t) {
      const std::int32_t bias = 128 * a_sum[t * ld_tok];
      for (int k = 0; k < NC; ++k)
        acc[t * ld_acc + k] += double(adq[t * ld_tok]) * double(sums[t * NC + k] - bias);
    }
  }
}

// oproj_b_tile_rows for nc <= kOprojBRows channels and nt <= kOprojBTileTokens tokens of one
// group (R bytes).
TILEDECODE_TARGET_AVX512 inline void oproj_b_group(double* acc, std::int64_t ld_acc, int nt, int nc,
                                                   const std::int8_t* a, std::int64_t lda,
                                                   const std::int8_t* w, std::int64_t ldw,
                                                   const float* adq, const std::int32_t* a_sum,
                                                   std::int64_t ld_tok, int R) {
  with_static_count<kOprojBRows>(nc, [&]<int NC>() TILEDECODE_TARGET_AVX512 {
    with_static_count<kOprojBTileTokens>(nt, [&]<int NT>() TILEDECODE_TARGET_AVX512 {
      if (R % 64 == 0) {
        oproj_b_tile_rows<NC, NT, false>(acc, ld_acc, a, lda, w, ldw, R, adq, a_sum, ld_tok);
      } else {
        oproj_b_tile_rows<NC, NT, true>(acc, ld_acc, a, lda, w, ldw, R, adq, a_sum, ld_tok);
      }
    });
  });
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
