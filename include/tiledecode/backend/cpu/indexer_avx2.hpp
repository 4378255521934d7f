#pragma once
// AVX2 + FMA micro-kernels of the lightning indexer (spec §7), and the AVX-VNNI score and query
// GEMM kernels of Isa::avx2_vnni (end of file). Reached only through kernels/indexer.hpp after the
// caller chose the ISA; every function here has a scalar twin in kernels/indexer.hpp that performs
// the same floating-point operations in the same order, so the two paths produce bit-identical
// outputs.
//
// INT8 dot choice: both operands are widened to int16 and multiplied with vpmaddwd (16 MACs per
// instruction, pairs summed into int32 lanes). This is exact for every int8 input, -128
// included: |a*b| <= 128*128 = 2^14 and a pair sum <= 2^15 is representable in the int32 lane
// (vpmaddwd only wraps for (-32768)*(-32768)*2, impossible with operands in [-128, 127]).
// The sign trick (vpsignb + vpmaddubsw + vpmaddwd) is *not* exact when both operands of a pair
// are -128 (|x| = 128 becomes the u8 operand and sign(-128, x) wraps back to -128), and it needs
// the same two multiplier uops per 32 MACs as two vpmaddwd; the widening cost is amortised
// (keys are widened once per 16-row block and reused by all 64 heads, queries once per task).
//
// INT32 bound (score): a head dot sums 128 products, |sum| <= 128 * 2^14 = 2^21 < 2^31.
// INT32 bound (query GEMM): K = Q_LORA products, |sum| <= K * 2^14 <= 2^31 - 1 for K < 2^17;
// the API requires Q_LORA <= kIndexerMaxQLora = 4096.

#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/backend/cpu/simd/avx_vnni.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// Transposes 8 rows of 8 int32 in place: r[i] lane j  ->  r[j] lane i.
TILEDECODE_TARGET_AVX2 inline void transpose8x8_epi32(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Loads the 32-byte quarter `part` of 8 rows (row stride `stride` bytes) as dword columns:
// r[c] lane i = dword (part*8 + c) of row i.
TILEDECODE_TARGET_AVX2 inline void load_dword_columns(__m256i r[8], const std::int8_t* rows,
                                                      std::int64_t stride, int part) {
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + i * stride + part * 32));
  transpose8x8_epi32(r);
}

// Packs 16 key rows of 128 INT8 (row stride `stride` bytes) for the row-lane score kernel.
// kp[j*2 + g], j = 2c + e (c = 0..31 the 4-byte group of the row, e = 0/1), g = row group of 8:
// int32 lane i holds the int16 pair (k[8g+i][4c+e], k[8g+i][4c+e+2]). The query side packs the
// same pairing (kernels::detail::pack_query_pairs), so Σ_j madd(kp[j], q[j]) is the full dot.
TILEDECODE_TARGET_AVX2 inline void pack_key_block16(__m256i* kp, const std::int8_t* rows,
                                                    std::int64_t stride) {
  for (int g = 0; g < 2; ++g) {
    for (int part = 0; part < 4; ++part) {  // 32-byte quarter of the 128-byte row
      __m256i r[8];
      load_dword_columns(r, rows + g * 8 * stride, stride, part);
      for (int c = 0; c < 8; ++c) {
        const int j = (part * 8 + c) * 2;
        // Sign-extend bytes 0,2 (even) and 1,3 (odd) of every dword into int16 pairs.
        kp[j * 2 + g] = _mm256_srai_epi16(_mm256_slli_epi16(r[c], 8), 8);
        kp[(j + 1) * 2 + g] = _mm256_srai_epi16(r[c], 8);
      }
    }
  }
}

// s += c * max(float(a), 0) for both row groups (one head of the fused score epilogue).
TILEDECODE_TARGET_AVX2 inline void score_head_epilogue(__m256& s0, __m256& s1, __m256i a0,
                                                       __m256i a1, float c) {
  const __m256 cv = _mm256_set1_ps(c), zero = _mm256_setzero_ps();
  s0 = _mm256_fmadd_ps(cv, _mm256_max_ps(_mm256_cvtepi32_ps(a0), zero), s0);
  s1 = _mm256_fmadd_ps(cv, _mm256_max_ps(_mm256_cvtepi32_ps(a1), zero), s1);
}

// Scores of 16 key rows for one token (spec §7.2), lanes = rows:
//   out[r] = ksc[r] * Σ_h coef[h] * max(float(q[h] · k[r]), 0),  coef[h] = q_sc[h] * w[h],
// head sum in ascending h with one FMA per head (the scalar twin does the same std::fma chain).
// kp: pack_key_block16 output (128 vectors); qp: (n_heads, 64) packed query pairs;
// n_heads % 4 == 0.
TILEDECODE_TARGET_AVX2 inline void score_rows16(float* out, const __m256i* kp,
                                                const std::int32_t* qp, const float* coef,
                                                const float* ksc, int n_heads) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 s0 = zero, s1 = zero;
  for (int h = 0; h < n_heads; h += 4) {
    const std::int32_t* q = qp + h * 64;
    // (2 row groups, 4 heads) INT32 accumulators: 8 registers, + 2 keys + 1 broadcast.
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a03 = a00;
    __m256i a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    for (int j = 0; j < 64; ++j) {
      const __m256i k0 = _mm256_load_si256(kp + 2 * j), k1 = _mm256_load_si256(kp + 2 * j + 1);
      __m256i b = _mm256_set1_epi32(q[j]);
      a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(k0, b));
      a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(k1, b));
      b = _mm256_set1_epi32(q[64 + j]);
      a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(k0, b));
      a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(k1, b));
      b = _mm256_set1_epi32(q[128 + j]);
      a02 = _mm256_add_epi32(a02, _mm256_madd_epi16(k0, b));
      a12 = _mm256_add_epi32(a12, _mm256_madd_epi16(k1, b));
      b = _mm256_set1_epi32(q[192 + j]);
      a03 = _mm256_add_epi32(a03, _mm256_madd_epi16(k0, b));
      a13 = _mm256_add_epi32(a13, _mm256_madd_epi16(k1, b));
    }
    // Epilogue while the dots are in registers: dequant·weight, ReLU, head sum.
    score_head_epilogue(s0, s1, a00, a10, coef[h]);
    score_head_epilogue(s0, s1, a01, a11, coef[h + 1]);
    score_head_epilogue(s0, s1, a02, a12, coef[h + 2]);
    score_head_epilogue(s0, s1, a03, a13, coef[h + 3]);
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(s0, _mm256_loadu_ps(ksc)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(s1, _mm256_loadu_ps(ksc + 8)));
}

// One 16-row key block for one token: pack (stack tile, 4 KB) then score. `rows` points at the
// first of 16 consecutive pool rows (row stride `stride`), ksc at their 16 scales; out gets 16
// scores (rows past the caller's visible range are computed from whatever the page holds and
// must be discarded by the caller).
TILEDECODE_TARGET_AVX2 inline void score_block16(float* out, const std::int8_t* rows,
                                                 std::int64_t stride, const float* ksc,
                                                 const std::int32_t* qp, const float* coef,
                                                 int n_heads) {
  alignas(32) __m256i kp[128];  // (64 pair columns, 2 row groups) int16 pairs
  pack_key_block16(kp, rows, stride);
  score_rows16(out, kp, qp, coef, ksc, n_heads);
}

// INT32 query GEMM tile: TT tokens × the 128 columns of one head.
//   out (TT, 128) int32; a16 (TT, K) int16 (widened q-latent, row stride K);
//   wpk: the head's 8 column blocks of 16, each (K/2, 32) int8 with bytes
//        [c*2 + (k&1)] for column c of the block and k = 2*kp + (k&1).
template <int TT>
TILEDECODE_TARGET_AVX2 inline void query_head_tile(std::int32_t* out, const std::int16_t* a16,
                                                   std::int64_t K, const std::int8_t* wpk) {
  const std::int64_t KP = K / 2;
  for (int nb = 0; nb < 8; ++nb) {
    const std::int8_t* wp = wpk + nb * KP * 32;
    __m256i acc[TT][2];
    for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = _mm256_setzero_si256();
    for (std::int64_t kp = 0; kp < KP; ++kp) {
      const __m256i w0 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + kp * 32)));
      const __m256i w1 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + kp * 32 + 16)));
      for (int tt = 0; tt < TT; ++tt) {
        std::int32_t pair;
        std::memcpy(&pair, a16 + tt * K + 2 * kp, sizeof pair);
        const __m256i b = _mm256_set1_epi32(pair);
        acc[tt][0] = _mm256_add_epi32(acc[tt][0], _mm256_madd_epi16(w0, b));
        acc[tt][1] = _mm256_add_epi32(acc[tt][1], _mm256_madd_epi16(w1, b));
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + tt * 128 + nb * 16), acc[tt][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + tt * 128 + nb * 16 + 8), acc[tt][1]);
    }
  }
}

// Query epilogue, part 1, one token of one head: x = bf16(dequant + interleaved forward RoPE),
// in double so that the value rounded to BF16 is the exact one rounded once to FP32 (the INT32
// dot is exact; the dequant and the rotation are a few products, so double costs little):
//   v[d] = double(acc[d]) * qs * ws[d]; for d >= 64 (pairs e = v[2i], o = v[2i+1]):
//   e' = e*cos + o*(-sin), o' = o*cos + e*sin (two products and one add, no FMA); then
//   x[d] = bf16(float(v[d])).
// rc / rs: 64 entries, rc[2i] = rc[2i+1] = cos_i, rs[2i] = -sin_i, rs[2i+1] = sin_i. The scalar
// twin (kernels::detail::query_dequant_rope_scalar) performs the same double operations.
TILEDECODE_TARGET_AVX2 inline void query_dequant_rope(float* x, const std::int32_t* acc, float qs,
                                                      const float* ws, const float* rc,
                                                      const float* rs) {
  const __m256d qv = _mm256_set1_pd(double(qs));
  for (int d = 0; d < 128; d += 8) {
    __m256d v[2];
    for (int h = 0; h < 2; ++h) {
      const int dd = d + 4 * h;
      v[h] = _mm256_mul_pd(
          _mm256_mul_pd(
              _mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + dd))), qv),
          _mm256_cvtps_pd(_mm_loadu_ps(ws + dd)));
      if (d >= 64) {
        const __m256d sw = _mm256_permute_pd(v[h], 0x5);  // (o, e) swapped within each pair
        v[h] = _mm256_add_pd(_mm256_mul_pd(v[h], _mm256_cvtps_pd(_mm_loadu_ps(rc + dd - 64))),
                             _mm256_mul_pd(sw, _mm256_cvtps_pd(_mm_loadu_ps(rs + dd - 64))));
      }
    }
    const __m256 f = _mm256_set_m128(_mm256_cvtpd_ps(v[1]), _mm256_cvtpd_ps(v[0]));
    const __m128i h = round_bf16x8(f);
    _mm256_storeu_ps(x + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}

// Query epilogue, part 2: qh (TT, 128) = x (TT, 128) @ had (128, 128), FP32 FMA chain over i in
// ascending order per output (the scalar twin's std::fma chain).
template <int TT>
TILEDECODE_TARGET_AVX2 inline void hadamard_tile(float* qh, const float* x, const float* had) {
  for (int cb = 0; cb < 128; cb += 16) {
    __m256 acc[TT][2];
    for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = _mm256_setzero_ps();
    for (int i = 0; i < 128; ++i) {
      const __m256 h0 = _mm256_loadu_ps(had + i * 128 + cb),
                   h1 = _mm256_loadu_ps(had + i * 128 + cb + 8);
      for (int tt = 0; tt < TT; ++tt) {
        const __m256 b = _mm256_set1_ps(x[tt * 128 + i]);
        acc[tt][0] = _mm256_fmadd_ps(b, h0, acc[tt][0]);
        acc[tt][1] = _mm256_fmadd_ps(b, h1, acc[tt][1]);
      }
    }
    for (int tt = 0; tt < TT; ++tt) {
      _mm256_storeu_ps(qh + tt * 128 + cb, acc[tt][0]);
      _mm256_storeu_ps(qh + tt * 128 + cb + 8, acc[tt][1]);
    }
  }
}

// Query epilogue, part 2 for a Sylvester rotation (H = s·(-1)^popcount(i&j)): qh = s·FWHT(x),
// the in-place butterfly of kernels::detail::fwht_128_scalar (stride 1, 2, 4 inside a vector,
// 8…64 across vectors; a+b / a-b per element in the same order), then × s.
TILEDECODE_TARGET_AVX2 inline void fwht_128(float* qh, const float* x, float s) {
  __m256 v[16];
  for (int k = 0; k < 16; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  for (int k = 0; k < 16; ++k) {
    __m256 sw = _mm256_permute_ps(v[k], 0xB1);  // stride 1: (a, b) pairs in lanes (2i, 2i+1)
    v[k] = _mm256_blend_ps(_mm256_add_ps(v[k], sw), _mm256_sub_ps(sw, v[k]), 0xAA);
    sw = _mm256_permute_ps(v[k], 0x4E);  // stride 2
    v[k] = _mm256_blend_ps(_mm256_add_ps(v[k], sw), _mm256_sub_ps(sw, v[k]), 0xCC);
    sw = _mm256_permute2f128_ps(v[k], v[k], 0x01);  // stride 4
    v[k] = _mm256_blend_ps(_mm256_add_ps(v[k], sw), _mm256_sub_ps(sw, v[k]), 0xF0);
  }
  for (int d = 1; d < 16; d <<= 1)  // strides 8, 16, 32, 64
    for (int k = 0; k < 16; k += 2 * d)
      for (int i = k; i < k + d; ++i) {
        const __m256 a = v[i], b = v[i + d];
        v[i] = _mm256_add_ps(a, b);
        v[i + d] = _mm256_sub_ps(a, b);
      }
  const __m256 sv = _mm256_set1_ps(s);
  for (int k = 0; k < 16; ++k) _mm256_storeu_ps(qh + 8 * k, _mm256_mul_ps(v[k], sv));
}

// Q8 of one 128-wide row (spec §2): quantize_q8_avx2 (simd/avx2.hpp) at n = 128.
TILEDECODE_TARGET_AVX2 inline float quantize_q8_128(std::int8_t* q, const float* x) {
  return quantize_q8_avx2(q, x, 128);
}

// Head-weight tile: out (TT, 16) = Σ_d x[tt, d] * wp[d, 0..15] (FP32 FMA chain over ascending d),
// then × scale. x rows have stride x_stride (BF16), wp rows stride wp_stride (BF16).
template <int TT>
TILEDECODE_TARGET_AVX2 inline void weights_tile(float* out, std::int64_t out_stride, const bf16* x,
                                                std::int64_t x_stride, const bf16* wp,
                                                std::int64_t wp_stride, std::int64_t D,
                                                float scale) {
  __m256 acc[TT][2];
  for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = _mm256_setzero_ps();
  for (std::int64_t d = 0; d < D; ++d) {
    const __m256 w0 = load_bf16x8(wp + d * wp_stride), w1 = load_bf16x8(wp + d * wp_stride + 8);
    for (int tt = 0; tt < TT; ++tt) {
      const __m256 b = _mm256_set1_ps(x[tt * x_stride + d].to_float());
      acc[tt][0] = _mm256_fmadd_ps(b, w0, acc[tt][0]);
      acc[tt][1] = _mm256_fmadd_ps(b, w1, acc[tt][1]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int tt = 0; tt < TT; ++tt) {
    _mm256_storeu_ps(out + tt * out_stride, _mm256_mul_ps(acc[tt][0], sv));
    _mm256_storeu_ps(out + tt * out_stride + 8, _mm256_mul_ps(acc[tt][1], sv));
  }
}

}  // namespace tiledecode::cpu::avx2

// ---- AVX-VNNI tier (Isa::avx2_vnni): the score's and the query GEMM's INT8 dots on vpdpbusd --
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32
// lane: 32 pairs per instruction and no separate add, twice vpmaddwd's 16 (plus vpaddd). The
// key becomes the unsigned operand by the offset k + 128 (XOR 0x80), the query stays signed:
//   Σ_d (k_d + 128) q_d = q·k + 128 Σ_d q_d,
// so each head's accumulators start at -128 Σ_d q_d (kernels::detail::pack_query_vnni) and end
// at exactly q·k. Exact for every int8 input, -128 included: each product is at most 255·128 in
// magnitude, a 128-term head dot plus the start value stays below 2^23, and vpdpbusd (unlike
// vpdpbusds) neither saturates nor can wrap at these magnitudes. The epilogue is the avx2 tier's,
// so the two tiers' scores are bit-identical. Keys need no int16 widening: the packed block is
// half the size (2 KB) of the avx2 tier's. The query GEMM (query_head_tile, below) uses the same
// offset on the other side: the weights are offset, the q-latent stays signed.
namespace tiledecode::cpu::avx2_vnni {

// Packs 16 key rows of 128 INT8 (row stride `stride` bytes): kq[c*2 + g], c = 0..31 the 4-byte
// group, g = row group of 8; int32 lane i holds bytes 4c..4c+3 of row 8g+i, each + 128 (u8).
TILEDECODE_TARGET_AVX2_VNNI inline void pack_key_block16(__m256i* kq, const std::int8_t* rows,
                                                         std::int64_t stride) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int g = 0; g < 2; ++g) {
    for (int part = 0; part < 4; ++part) {  // 32-byte quarter of the 128-byte row
      __m256i r[8];
      avx2::load_dword_columns(r, rows + g * 8 * stride, stride, part);
      for (int c = 0; c < 8; ++c) kq[(part * 8 + c) * 2 + g] = _mm256_xor_si256(r[c], offset);
    }
  }
}

// Scores of 16 key rows for one token, lanes = rows (the avx2 tier's score_rows16 contract):
//   out[r] = ksc[r] * Σ_h coef[h] * max(float(q[h] · k[r]), 0), head sum in ascending h.
// kq: pack_key_block16 output (64 vectors); qd: (n_heads, 32) query dwords; q_bias: (n_heads)
// start values -128 Σ_d q[h][d]; n_heads % 4 == 0.
TILEDECODE_TARGET_AVX2_VNNI inline void score_rows16(float* out, const __m256i* kq,
                                                     const std::int32_t* qd,
                                                     const std::int32_t* q_bias, const float* coef,
                                                     const float* ksc, int n_heads) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 s0 = zero, s1 = zero;
  for (int h = 0; h < n_heads; h += 4) {
    const std::int32_t* q = qd + h * 32;
    // (2 row groups, 4 heads) INT32 accumulators: 8 registers, + 2 keys + 1 broadcast.
    __m256i a00 = _mm256_set1_epi32(q_bias[h]), a10 = a00;
    __m256i a01 = _mm256_set1_epi32(q_bias[h + 1]), a11 = a01;
    __m256i a02 = _mm256_set1_epi32(q_bias[h + 2]), a12 = a02;
    __m256i a03 = _mm256_set1_epi32(q_bias[h + 3]), a13 = a03;
    for (int c = 0; c < 32; ++c) {
      const __m256i k0 = _mm256_load_si256(kq + 2 * c), k1 = _mm256_load_si256(kq + 2 * c + 1);
      __m256i b = _mm256_set1_epi32(q[c]);
      a00 = dpbusd(a00, k0, b);
      a10 = dpbusd(a10, k1, b);
      b = _mm256_set1_epi32(q[32 + c]);
      a01 = dpbusd(a01, k0, b);
      a11 = dpbusd(a11, k1, b);
      b = _mm256_set1_epi32(q[64 + c]);
      a02 = dpbusd(a02, k0, b);
      a12 = dpbusd(a12, k1, b);
      b = _mm256_set1_epi32(q[96 + c]);
      a03 = dpbusd(a03, k0, b);
      a13 = dpbusd(a13, k1, b);
    }
    avx2::score_head_epilogue(s0, s1, a00, a10, coef[h]);
    avx2::score_head_epilogue(s0, s1, a01, a11, coef[h + 1]);
    avx2::score_head_epilogue(s0, s1, a02, a12, coef[h + 2]);
    avx2::score_head_epilogue(s0, s1, a03, a13, coef[h + 3]);
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(s0, _mm256_loadu_ps(ksc)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(s1, _mm256_loadu_ps(ksc + 8)));
}

// One 16-row key block for one token (avx2::score_block16's contract, VNNI operands).
TILEDECODE_TARGET_AVX2_VNNI inline void score_block16(float* out, const std::int8_t* rows,
                                                      std::int64_t stride, const float* ksc,
                                                      const std::int32_t* qd,
                                                      const std::int32_t* q_bias, const float* coef,
                                                      int n_heads) {
  alignas(32) __m256i kq[64];  // (32 dword columns, 2 row groups) offset bytes
  pack_key_block16(kq, rows, stride);
  score_rows16(out, kq, qd, q_bias, coef, ksc, n_heads);
}

// Σ_i a[i] over n INT8 values (exact: |sum| <= 128 n): vpdpbusd with u8 ones into four
// independent accumulators (one chain would be bound by the instruction's latency), scalar tail.
TILEDECODE_TARGET_AVX2_VNNI inline std::int32_t i8_sum(const std::int8_t* a, std::int64_t n) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  std::int64_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (int u = 0; u < 4; ++u)
      s[u] =
          dpbusd(s[u], ones, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i + 32 * u)));
  for (; i + 32 <= n; i += 32)
    s[0] = dpbusd(s[0], ones, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)));
  std::int32_t r = avx2::hsum_epi32(
      _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])));
  for (; i < n; ++i) r += a[i];
  return r;
}

// The query GEMM tile on vpdpbusd: avx2::query_head_tile's contract and packed weights (wpk, the
// head's 8 column blocks of 16, each (K/2, 32) int8 pairs), with the q-latent read as INT8 rows
// (a + tt * lda, no int16 widening) and a_sum[tt] = Σ_k a[tt][k] (i8_sum):
//   out (TT, 128) int32, out[tt][c] = Σ_k a[tt][k] · W[k][c] exactly.
// Two consecutive pair rows kp, kp + 1 of a block become dwords by a 16-bit unpack:
// unpacklo_epi16 holds (W[4q..4q+3][c]) for c = 0-3 | 8-11, unpackhi for c = 4-7 | 12-15, so
// the stored layout serves as is (nothing changes at load time). The weight is the unsigned
// operand, offset to W + 128 (XOR 0x80, once per weight vector, shared by the TT tokens); the
// token dword a[tt][4q..4q+3] is broadcast signed and the accumulators start at -128·a_sum:
//   -128 Σ_k a_k + Σ_k (W_k + 128) a_k = Σ_k W_k a_k.
// K % 4 == 2: the last pair row is unpacked with itself against the dword (a[K-2], a[K-1], 0, 0).
// Exact for every int8 input, -128 included: the start value is at most 128·128·K in magnitude
// and each product at most 255·128, so every partial sum (vpdpbusd adds its four products and the
// lane without saturation) stays within (2^14 + 255·128)·K = 49024·K <= 49024·4096 < 2^28 for
// K <= kernels::kIndexerMaxQLora = 4096 (the bound holds up to K = 43804; static_assert in
// indexer_query): no INT32 wrap, the result is the exact dot, and the avx2 tier's epilogue then
// makes q_i8 / q_sc bit-identical to that tier's.
template <int TT>
TILEDECODE_TARGET_AVX2_VNNI inline void query_head_tile(std::int32_t* out, const std::int8_t* a,
                                                        std::int64_t lda, const std::int32_t* a_sum,
                                                        std::int64_t K, const std::int8_t* wpk) {
  const std::int64_t KP = K / 2, KQ = K / 4;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int nb = 0; nb < 8; ++nb) {
    const std::int8_t* wp = wpk + nb * KP * 32;
    __m256i acc[TT][2];
    for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = _mm256_set1_epi32(-128 * a_sum[tt]);
    for (std::int64_t q = 0; q < KQ; ++q) {
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 64));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 64 + 32));
      const __m256i w0 = _mm256_xor_si256(_mm256_unpacklo_epi16(r0, r1), offset);
      const __m256i w1 = _mm256_xor_si256(_mm256_unpackhi_epi16(r0, r1), offset);
      for (int tt = 0; tt < TT; ++tt) {
        std::int32_t quad;
        std::memcpy(&quad, a + tt * lda + 4 * q, sizeof quad);
        const __m256i b = _mm256_set1_epi32(quad);
        acc[tt][0] = dpbusd(acc[tt][0], w0, b);
        acc[tt][1] = dpbusd(acc[tt][1], w1, b);
      }
    }
    if (K % 4 != 0) {  // the last pair row: k = K-2, K-1
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + KQ * 64));
      const __m256i w0 = _mm256_xor_si256(_mm256_unpacklo_epi16(r0, r0), offset);
      const __m256i w1 = _mm256_xor_si256(_mm256_unpackhi_epi16(r0, r0), offset);
      for (int tt = 0; tt < TT; ++tt) {
        std::uint16_t pair;
        std::memcpy(&pair, a + tt * lda + K - 2, sizeof pair);
        const __m256i b = _mm256_set1_epi32(std::int32_t(pair));
        acc[tt][0] = dpbusd(acc[tt][0], w0, b);
        acc[tt][1] = dpbusd(acc[tt][1], w1, b);
      }
    }
    for (int tt = 0; tt < TT; ++tt) {  // columns 0-7 and 8-15 from the (0-3|8-11, 4-7|12-15) lanes
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + tt * 128 + nb * 16),
                          _mm256_permute2x128_si256(acc[tt][0], acc[tt][1], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + tt * 128 + nb * 16 + 8),
                          _mm256_permute2x128_si256(acc[tt][0], acc[tt][1], 0x31));
    }
  }
}

}  // namespace tiledecode::cpu::avx2_vnni
#endif
