#pragma once
// AVX2 + FMA vector primitives shared by the CPU kernels. Every function here is compiled with
// TILEDECODE_TARGET_AVX2 and must only be called after the runtime check in isa.hpp.

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// 8 BF16 values → 8 floats (exact: BF16 is the upper half of binary32).
TILEDECODE_TARGET_AVX2 inline __m256 load_bf16x8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats → 8 BF16, round to nearest even; NaN stays NaN (quiet bit set), as bf16(float).
TILEDECODE_TARGET_AVX2 inline __m128i round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan_bits = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, nan_bits, _mm256_castps_si256(is_nan));
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
  // Pack 8 × u32 (each < 65536) to 8 × u16: packus works per 128-bit lane, then fix lane order.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

TILEDECODE_TARGET_AVX2 inline void store_bf16x8(bf16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16x8(v));
}

// Horizontal sum of 8 floats (fixed order: deterministic).
TILEDECODE_TARGET_AVX2 inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Horizontal sum of 8 int32.
TILEDECODE_TARGET_AVX2 inline std::int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The 8 horizontal sums of v[0..7] in one vector (lane i = Σ lanes of v[i]), exact in int32:
// six vphaddd and a cross-lane add instead of eight hsum_epi32 (7 instructions each).
TILEDECODE_TARGET_AVX2 inline __m256i hsum8_epi32(const __m256i (&v)[8]) {
  const __m256i s0 = _mm256_hadd_epi32(v[0], v[1]), s1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i s2 = _mm256_hadd_epi32(v[4], v[5]), s3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(s0, s1), u1 = _mm256_hadd_epi32(s2, s3);
  // u0 = [v0..v3 sums of the low 128-bit halves | of the high halves], u1 likewise for v4..v7.
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Signed INT8 × INT8 dot of 32 pairs accumulated into 8 int32 lanes, exactly.
// vpmaddubsw takes u8 × s8 and saturates to s16; with a = |x| (u8 ≤ 128) and b = sign(y, x)
// (|b| ≤ 128, and b = -128 only when y = -128), each pair sum is ≤ 2·128·128 = 32768 in
// magnitude... except that |x| ≤ 127 for x ≠ -128 inputs. All library INT8 data comes from Q8,
// which clamps to [-127, 127], so |pair| ≤ 2·127·127 = 32258 < 32767: no saturation. vpmaddwd
// with ones then widens pairs to int32 exactly.
TILEDECODE_TARGET_AVX2 inline __m256i dot_i8x32(__m256i acc, __m256i x, __m256i y) {
  const __m256i ax = _mm256_sign_epi8(x, x);
  const __m256i sy = _mm256_sign_epi8(y, x);
  const __m256i p16 = _mm256_maddubs_epi16(ax, sy);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// Q8 of one row of n values, n a multiple of 32 (spec §2), bit-identical to core quantize_q8
// (its header states the policy for non-finite rows): amax is the integer maximum of the bit
// patterns of |x| (the float order for non-negative values, every NaN above +Inf: a NaN in the
// row makes amax NaN, with the same payload as the scalar twin's), x * sq rounded half to even
// (MXCSR default, as nearbyint) and clamped to [-127, 127] (a NaN product converts to INT_MIN and
// clamps to -127, as fmax(NaN, -127) does). Returns dq = 1 / (127 / amax). The scalar twin calls
// fmin/fmax per element (library calls without -ffast-math); this is one pass for amax and one
// for q.
TILEDECODE_TARGET_AVX2 inline float quantize_q8_avx2(std::int8_t* q, const float* x,
                                                     std::int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;  // two chains (n % 32 == 0)
  for (std::int64_t d = 0; d < n; d += 16) {
    const __m256i* p = reinterpret_cast<const __m256i*>(x + d);
    m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_loadu_si256(p), abs_mask));
    m1 = _mm256_max_epi32(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), abs_mask));
  }
  const __m256i m = _mm256_max_epi32(m0, m1);
  __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
  m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
  float amax = _mm_cvtss_f32(_mm_castsi128_ps(m4));
  amax = amax < 1e-4f ? 1e-4f : amax;  // NaN stays NaN
  const float sq = 127.0f / amax;
  const __m256 sv = _mm256_set1_ps(sq);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (std::int64_t d = 0; d < n; d += 32) {
    __m256i v[4];
    for (int u = 0; u < 4; ++u) {
      v[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8 * u), sv));
      v[u] = _mm256_min_epi32(_mm256_max_epi32(v[u], lo), hi);
    }
    const __m256i p =
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + d), _mm256_permutevar8x32_epi32(p, perm));
  }
  return 1.0f / sq;
}

}  // namespace tiledecode::cpu::avx2
#endif
