#pragma once
// AVX-VNNI primitives (Isa::avx2_vnni). Compiled with TILEDECODE_TARGET_AVX2_VNNI; call only
// after the runtime check in isa.hpp (cpu_has_avx2_vnni).

#include "tiledecode/backend/cpu/isa.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2_vnni {

// acc += Σ_4 u8(a) * s8(b) per int32 lane: the VEX vpdpbusd, non-saturating (wraps only past
// INT32, which the callers' bounds exclude). GCC 12 compiles the intrinsic with a register copy
// or a reload around every use (the indexer score loop ran at 60 % of the instruction's
// throughput); the one-instruction asm leaves allocation to the compiler and runs at clang's
// speed. Clang takes the intrinsic.
TILEDECODE_TARGET_AVX2_VNNI inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
#else
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
}

}  // namespace tiledecode::cpu::avx2_vnni
#endif
