#pragma once
// Instruction-set selection for the CPU backend. The library is compiled for baseline x86-64;
// AVX2+FMA code lives in functions marked TILEDECODE_TARGET_AVX2 and is reached through one
// runtime check per decode step (`detect_isa`), so a binary built without -march=native still
// runs the AVX2 path on an AVX2 machine and the scalar path elsewhere. The scalar path is always
// compiled and tested.
//
// Tiers (each includes the one before):
//   scalar     portable C++; the twin every SIMD path is tested against
//   avx2       AVX2 + FMA + F16C (Haswell, Zen 1-3 and later): every kernel's fast path
//   avx2_vnni  avx2 + AVX-VNNI, the 256-bit VEX form of vpdpbusd (Zen 5, Alder Lake and later;
//              not AVX-512). Only the INT8 matmuls change -- the indexer score, the indexer
//              query's qr @ idx_wq_b, the q/kv projection's qr @ wq_b and the output
//              projection's wo_b run on vpdpbusd (32 u8 x s8 pairs per instruction instead of
//              vpmaddwd's 16); their integer dots are exact in both tiers, so outputs are
//              bit-identical to the avx2 tier. wq_b also has a load-time packed copy for this
//              tier (kernels::pack_qkv_wq_b, made by LayerWeightsStorage::pack only where the
//              CPU has AVX-VNNI; +32 MB per flash layer).
// Kernels test `has_avx2(isa)` for the AVX2 code and `isa == Isa::avx2_vnni` only where a
// VNNI kernel exists.

#include <string>
#include <string_view>
#include <vector>

#include "tiledecode/core/error.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#define TILEDECODE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TILEDECODE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TILEDECODE_TARGET_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#else
#define TILEDECODE_X86 0
#define TILEDECODE_TARGET_AVX2
#define TILEDECODE_TARGET_AVX2_VNNI
#endif

namespace tiledecode::cpu {

enum class Isa { scalar, avx2, avx2_vnni };

constexpr std::string_view to_string(Isa isa) {
  switch (isa) {
    case Isa::avx2:
      return "avx2";
    case Isa::avx2_vnni:
      return "avx2_vnni";
    case Isa::scalar:
      break;
  }
  return "scalar";
}

// Parses to_string's names; throws tiledecode::Error naming the allowed ones otherwise.
inline Isa isa_from_string(std::string_view where, std::string_view name) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx2_vnni})
    if (name == to_string(isa)) return isa;
  throw Error(std::string(where) + ": argument 'isa' = '" + std::string(name) +
              "' is not an ISA; allowed scalar, avx2, avx2_vnni");
}

// True for every tier that runs the AVX2 kernels.
constexpr bool has_avx2(Isa isa) {
  return isa != Isa::scalar;
}

inline bool cpu_has_avx2() {
#if TILEDECODE_X86 && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

inline bool cpu_has_avx2_vnni() {
#if TILEDECODE_X86 && (defined(__GNUC__) || defined(__clang__))
  // CPUID.(EAX=7, ECX=1):EAX bit 4 = AVX-VNNI (VEX). Read directly: clang 14's
  // __builtin_cpu_supports does not know "avxvnni". CPUID traps to the hypervisor on a VM
  // (microseconds), so the answer -- a constant of the machine -- is read once, like the
  // builtin's own cache. The YMM state check is cpu_has_avx2's.
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx2() || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 4) & 1u) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// False for a value that names no tier (an enum is range-checked like every argument).
inline bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::avx2:
      return cpu_has_avx2();
    case Isa::avx2_vnni:
      return cpu_has_avx2_vnni();
    case Isa::scalar:
      return true;
  }
  return false;
}

// The best ISA this machine runs.
inline Isa detect_isa() {
  return cpu_has_avx2_vnni() ? Isa::avx2_vnni : (cpu_has_avx2() ? Isa::avx2 : Isa::scalar);
}

// Every ISA this machine runs, scalar first (tests run each path).
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx2_vnni})
    if (cpu_supports(isa)) v.push_back(isa);
  return v;
}

// Validates an explicitly requested ISA (tests force every path).
inline Isa checked_isa(Isa requested) {
  if (!cpu_supports(requested)) {
    std::string allowed;
    for (Isa isa : supported_isas())
      allowed += (allowed.empty() ? "" : ", ") + std::string(to_string(isa));
    const bool named =
        requested == Isa::scalar || requested == Isa::avx2 || requested == Isa::avx2_vnni;
    throw Error("cpu::checked_isa: argument 'isa' = " +
                (named ? std::string(to_string(requested))
                       : std::to_string(static_cast<int>(requested)) + " (not a tier)") +
                " is not supported by this CPU; allowed " + allowed);
  }
  return requested;
}

}  // namespace tiledecode::cpu
