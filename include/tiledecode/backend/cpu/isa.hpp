#pragma once
// Instruction-set selection for the CPU backend. The library is compiled for baseline x86-64;
// AVX2+FMA code lives in functions marked TILEDECODE_TARGET_AVX2 and is reached through one
// runtime check per decode step (`detect_isa`), so a binary built without -march=native still
// runs the AVX2 path on an AVX2 machine and the scalar path elsewhere. The scalar path is always
// compiled and tested.

#include <string_view>

#include "tiledecode/core/error.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#define TILEDECODE_X86 1
#include <immintrin.h>
#define TILEDECODE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define TILEDECODE_X86 0
#define TILEDECODE_TARGET_AVX2
#endif

namespace tiledecode::cpu {

enum class Isa { scalar, avx2 };

constexpr std::string_view to_string(Isa isa) {
  return isa == Isa::avx2 ? "avx2" : "scalar";
}

inline bool cpu_has_avx2() {
#if TILEDECODE_X86 && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// The best ISA this machine runs.
inline Isa detect_isa() {
  return cpu_has_avx2() ? Isa::avx2 : Isa::scalar;
}

// Validates an explicitly requested ISA (tests force both paths).
inline Isa checked_isa(Isa requested) {
  if (requested == Isa::avx2 && !cpu_has_avx2()) {
    throw Error(
        "cpu::checked_isa: argument 'isa' = avx2 is not supported by this CPU; allowed scalar");
  }
  return requested;
}

}  // namespace tiledecode::cpu
