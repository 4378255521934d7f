#pragma once
// The lightning indexer's INT8 kernels on the AVX-512 tier (Isa::avx512): the score (spec §7.2)
// and the query GEMM (qr @ idx_wq_b) on the 512-bit vpdpbusd. Reached only through
// backend/cpu/indexer.hpp after the caller chose the ISA. They compute the same exact integer
// dots as the avx2 (vpmaddwd) and avx2_vnni (256-bit vpdpbusd) kernels and apply the same
// floating-point epilogue lane for lane, so every output is bit-identical to those tiers'.

#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/indexer_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// Packs 16 key rows of 128 INT8 (row stride `stride` bytes): kq[c], c = 0..31 the 4-byte group;
// int32 lane i holds bytes 4c..4c+3 of row i, each + 128 (u8). The two 8-row halves are
// transposed as in the avx2 tiers (avx2::load_dword_columns) and joined into one register.
TILEDECODE_TARGET_AVX512 inline void pack_key_block16(__m512i* kq, const std::int8_t* rows,
                                                      std::int64_t stride) {
  const __m512i offset = u8_offset();
  for (int part = 0; part < 4; ++part) {  // 32-byte quarter of the 128-byte row
    __m256i lo[8], hi[8];
    avx2::load_dword_columns(lo, rows, stride, part);
    avx2::load_dword_columns(hi, rows + 8 * stride, stride, part);
    for (int c = 0; c < 8; ++c)
      kq[part * 8 + c] =
          _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo[c]), hi[c], 1), offset);
  }
}

// NH heads of the score, starting at head h (avx2::score_head_epilogue lane for lane):
//   s += coef[h'] * max(float(q[h'] · k[r]), 0) for h' = h .. h + NH - 1 in ascending order.
// The INT32 accumulators start at q_bias[h'] = -128 Σ_d q[h'][d], which cancels the keys' offset.
template <int NH>
TILEDECODE_TARGET_AVX512 inline void score_heads(__m512& s, const __m512i* kq,
                                                 const std::int32_t* qd, const std::int32_t* q_bias,
                                                 const float* coef, int h) {
  __m512i acc[NH];
  for (int i = 0; i < NH; ++i) acc[i] = _mm512_set1_epi32(q_bias[h + i]);
  const std::int32_t* q = qd + h * 32;
  for (int c = 0; c < 32; ++c) {
    const __m512i k = _mm512_load_si512(kq + c);
    for (int i = 0; i < NH; ++i) acc[i] = dpbusd(acc[i], k, _mm512_set1_epi32(q[i * 32 + c]));
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < NH; ++i)
    s = _mm512_fmadd_ps(_mm512_set1_ps(coef[h + i]),
                        _mm512_max_ps(_mm512_cvtepi32_ps(acc[i]), zero), s);
}

// Scores of 16 key rows for one token, lanes = rows (avx2::score_rows16's contract):
//   out[r] = ksc[r] * Σ_h coef[h] * max(float(q[h] · k[r]), 0), head sum in ascending h.
// kq: pack_key_block16 output (32 vectors); qd: (n_heads, 32) query dwords and q_bias (n_heads)
// as for the avx2_vnni tier (kernels::detail::pack_query_vnni); n_heads % 4 == 0. Eight heads per
// pass: 8 accumulators, one key and one broadcast live (of 32 registers).
TILEDECODE_TARGET_AVX512 inline void score_rows16(float* out, const __m512i* kq,
                                                  const std::int32_t* qd,
                                                  const std::int32_t* q_bias, const float* coef,
                                                  const float* ksc, int n_heads) {
  __m512 s = _mm512_setzero_ps();
  int h = 0;
  for (; h + 8 <= n_heads; h += 8) score_heads<8>(s, kq, qd, q_bias, coef, h);
  if (h < n_heads) score_heads<4>(s, kq, qd, q_bias, coef, h);
  _mm512_storeu_ps(out, _mm512_mul_ps(s, _mm512_loadu_ps(ksc)));
}

// One 16-row key block for one token (avx2::score_block16's contract, VNNI operands).
TILEDECODE_TARGET_AVX512 inline void score_block16(float* out, const std::int8_t* rows,
                                                   std::int64_t stride, const float* ksc,
                                                   const std::int32_t* qd,
                                                   const std::int32_t* q_bias, const float* coef,
                                                   int n_heads) {
  alignas(64) __m512i kq[32];  // (32 dword columns) × 16 rows of offset bytes: 2 KB
  pack_key_block16(kq, rows, stride);
  score_rows16(out, kq, qd, q_bias, coef, ksc, n_heads);
}

// The query GEMM tile on the 512-bit vpdpbusd: avx2_vnni::query_head_tile's contract, packed
// weights and bounds (wpk: the head's 8 column blocks of 16, each (K/2, 32) int8 pairs; a: INT8
// rows a + tt·lda; a_sum[tt] = Σ_k a[tt][k]):
//   out (TT, 128) int32, out[tt][c] = Σ_k a[tt][k] · W[k][c] exactly.
// The 64 bytes of pair rows 2q and 2q + 1 are one load; vpermw puts the 16-bit pair of column c
// from each next to each other, so int32 lane c holds (W[4q..4q+3][c]) in column order and the
// result needs no unshuffle. Two column blocks per pass: 2·TT independent accumulator chains.
// K % 4 == 2: the last pair row is paired with itself against the dword (a[K-2], a[K-1], 0, 0).
template <int TT>
TILEDECODE_TARGET_AVX512 inline void query_head_tile(std::int32_t* out, const std::int8_t* a,
                                                     std::int64_t lda, const std::int32_t* a_sum,
                                                     std::int64_t K, const std::int8_t* wpk) {
  const std::int64_t KP = K / 2, KQ = K / 4;
  const __m512i offset = u8_offset();
  alignas(64) static constexpr std::uint16_t kPairs[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  alignas(64) static constexpr std::uint16_t kSelf[32] = {
      0, 0, 1, 1, 2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,  7,
      8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  const __m512i pairs = _mm512_load_si512(kPairs), self = _mm512_load_si512(kSelf);
  for (int nb = 0; nb < 8; nb += 2) {
    const std::int8_t* wp0 = wpk + nb * KP * 32;
    const std::int8_t* wp1 = wp0 + KP * 32;
    __m512i acc[TT][2];
    for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = _mm512_set1_epi32(-128 * a_sum[tt]);
    for (std::int64_t q = 0; q < KQ; ++q) {
      const __m512i w0 = _mm512_xor_si512(
          _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(wp0 + q * 64)), offset);
      const __m512i w1 = _mm512_xor_si512(
          _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(wp1 + q * 64)), offset);
      for (int tt = 0; tt < TT; ++tt) {
        std::int32_t quad;
        std::memcpy(&quad, a + tt * lda + 4 * q, sizeof quad);
        const __m512i b = _mm512_set1_epi32(quad);
        acc[tt][0] = dpbusd(acc[tt][0], w0, b);
        acc[tt][1] = dpbusd(acc[tt][1], w1, b);
      }
    }
    if (K % 4 != 0) {  // the last pair row: k = K-2, K-1
      const __m512i r0 = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp0 + KQ * 64)));
      const __m512i r1 = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp1 + KQ * 64)));
      const __m512i w0 = _mm512_xor_si512(_mm512_permutexvar_epi16(self, r0), offset);
      const __m512i w1 = _mm512_xor_si512(_mm512_permutexvar_epi16(self, r1), offset);
      for (int tt = 0; tt < TT; ++tt) {
        std::uint16_t pair;
        std::memcpy(&pair, a + tt * lda + K - 2, sizeof pair);
        const __m512i b = _mm512_set1_epi32(std::int32_t(pair));
        acc[tt][0] = dpbusd(acc[tt][0], w0, b);
        acc[tt][1] = dpbusd(acc[tt][1], w1, b);
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      _mm512_storeu_si512(out + tt * 128 + nb * 16, acc[tt][0]);
      _mm512_storeu_si512(out + tt * 128 + nb * 16 + 16, acc[tt][1]);
    }
  }
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
