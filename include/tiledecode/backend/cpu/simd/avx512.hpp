#pragma once
// AVX-512 primitives (Isa::avx512: F + BW + VL + VNNI + BF16). Compiled with
// TILEDECODE_TARGET_AVX512; call only after the runtime check in isa.hpp (cpu_has_avx512).

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"

#if TILEDECODE_X86
// GCC 12 reports -W(maybe-)uninitialized inside its own AVX-512 intrinsics once they are inlined
// (the self-initialised _mm512_undefined_* pass-through operand of the unmasked forms: casts,
// inserts, conversions, max). The AVX-512 kernel headers open their code with
// TILEDECODE_AVX512_BEGIN and close it with TILEDECODE_AVX512_END, which silence exactly these two
// warnings there and nowhere else.
#if defined(__GNUC__) && !defined(__clang__)
#define TILEDECODE_AVX512_BEGIN                                                        \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define TILEDECODE_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define TILEDECODE_AVX512_BEGIN
#define TILEDECODE_AVX512_END
#endif

TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// acc += Σ_4 u8(a) * s8(b) per int32 lane (16 lanes): the EVEX vpdpbusd, non-saturating (wraps
// only past INT32, which the callers' bounds exclude).
// GCC 12 lowers the intrinsic through a copy of the accumulator and, in tiles of many
// accumulators, a store of every result to the stack (one 512-bit store per vpdpbusd: the INT8
// tiles ran at half the instruction's rate); the accumulator tied in place by asm has neither.
// AT&T order: vpdpbusd s8 (register or memory), u8, accumulator.
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512i dpbusd(__m512i acc,
                                                                              __m512i a,
                                                                              __m512i b) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, a, b);
#endif
}

// 0x80 in every byte: XOR with it maps int8 w to the u8 w + 128 (the vpdpbusd unsigned operand).
TILEDECODE_TARGET_AVX512 inline __m512i u8_offset() {
  return _mm512_set1_epi8(static_cast<char>(0x80));
}

// (lo, hi) += double(s[0..8)), double(s[8..16)) lane for lane: the widening add of an FP32
// partial into its double accumulator held in registers (the conversion is exact; one rounding
// per lane, in the add).
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline void add_to_f64(__m512d& lo,
                                                                               __m512d& hi,
                                                                               __m512 s) {
  const __m256 shi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
  lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(s)));
  hi = _mm512_add_pd(hi, _mm512_cvtps_pd(shi));
}

// d[0..16) += double(s[0..16)) lane for lane (d unaligned): the flush of an FP32 partial into its
// double accumulator in the two-level summation orders (one rounding per lane, as avx2's
// add_to_f64 / flush per 8 lanes).
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline void add_to_f64(double* d,
                                                                               __m512 s) {
  __m512d lo = _mm512_loadu_pd(d), hi = _mm512_loadu_pd(d + 8);
  add_to_f64(lo, hi, s);
  _mm512_storeu_pd(d, lo);
  _mm512_storeu_pd(d + 8, hi);
}

// The sum of the two 256-bit halves, lane for lane (int32; exact up to INT32).
TILEDECODE_TARGET_AVX512 inline __m256i fold_epi32(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Σ_i a[i] over n INT8 values (exact: |sum| <= 128 n): vpdpbusd with u8 ones into four
// independent accumulators, a 32-byte step, then a scalar tail (the integer result does not
// depend on the order).
TILEDECODE_TARGET_AVX512 inline std::int32_t i8_sum(const std::int8_t* a, std::int64_t n) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                  _mm512_setzero_si512()};
  std::int64_t i = 0;
  for (; i + 256 <= n; i += 256)
    for (int u = 0; u < 4; ++u) s[u] = dpbusd(s[u], ones, _mm512_loadu_si512(a + i + 64 * u));
  for (; i + 64 <= n; i += 64) s[0] = dpbusd(s[0], ones, _mm512_loadu_si512(a + i));
  const __m512i t = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
  std::int32_t r = avx2::hsum_epi32(fold_epi32(t));
  for (; i < n; ++i) r += a[i];
  return r;
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
