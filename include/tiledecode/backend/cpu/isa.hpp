#pragma once
// Instruction-set selection for the CPU backend. The library is compiled for baseline x86-64;
// AVX2+FMA code lives in functions marked TILEDECODE_TARGET_AVX2 and is reached through one
// runtime check per decode step (`detect_isa`), so a binary built without -march=native still
// runs the AVX2 path on an AVX2 machine and the scalar path elsewhere. The scalar path is always
// compiled and tested.
//
// Tiers:
//   scalar     portable C++; the twin every SIMD path is tested against
//   avx2       AVX2 + FMA + F16C (Haswell, Zen 1-3 and later): every kernel's fast path
//   avx2_vnni  avx2 + AVX-VNNI, the 256-bit VEX form of vpdpbusd (Zen 5, Alder Lake and later;
//              not AVX-512). Only the INT8 matmuls change -- the indexer score, the indexer
//              query's qr @ idx_wq_b, the q/kv projection's qr @ wq_b and the output
//              projection's wo_b run on vpdpbusd (32 u8 x s8 pairs per instruction instead of
//              vpmaddwd's 16); their integer dots are exact in both tiers, so outputs are
//              bit-identical to the avx2 tier. wq_b also has a load-time packed copy for the
//              VNNI tiers (kernels::pack_qkv_wq_b, made by LayerWeightsStorage::pack only where
//              the CPU has a VNNI tier; +32 MB per flash layer).
//   avx512     avx2 + AVX-512 F, BW, VL, VNNI and BF16 (Ice Lake / Sapphire Rapids Xeon, Zen 4,
//              Zen 5). It does not need AVX-VNNI (Zen 4 has AVX-512 VNNI but not the VEX form).
//              The same four INT8 matmuls run on the 512-bit vpdpbusd (64 pairs per
//              instruction; backend/cpu/*_avx512.hpp), exact like the other tiers, and the
//              output projection's wo_a runs on vdpbf16ps (BF16 × BF16 pairs, FP32 lanes, twice
//              the FP32 FMA rate on Zen 4; bf16_rows_avx512.hpp): its own summation order, so
//              the output projection matches golden within tolerance but not avx2 bit for bit,
//              and subnormal inputs count as zero there (docs/security.md). Sparse attention runs
//              16-lane twins of the AVX2 tiles (sparse_attention_avx512.hpp) and the BF16 q/kv
//              matmuls a token-blocked 512-bit FMA kernel, both in the AVX2 lanes' order; the
//              compressors' projections run 512-bit FMA in that order too, or vdpbf16ps where
//              Context::bf16_dot resolves to dpbf16 (below; so do the q/kv matmuls when the
//              weights carry QkvWeights::bf16_rows); hc_pre/hc_post run the AVX2 micro-kernels.
//              Outside wo_a and the dpbf16 paths every output equals the avx2 tier's bit for
//              bit.
// Kernels test `has_avx2(isa)` for the AVX2 code, and `isa == Isa::avx2_vnni` /
// `isa == Isa::avx512` only where a kernel for that tier exists (`has_vnni(isa)`: either).

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
#define TILEDECODE_TARGET_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))
#else
#define TILEDECODE_X86 0
#define TILEDECODE_TARGET_AVX2
#define TILEDECODE_TARGET_AVX2_VNNI
#define TILEDECODE_TARGET_AVX512
#endif

namespace tiledecode::cpu {

enum class Isa { scalar, avx2, avx2_vnni, avx512 };

constexpr std::string_view to_string(Isa isa) {
  switch (isa) {
    case Isa::avx2:
      return "avx2";
    case Isa::avx2_vnni:
      return "avx2_vnni";
    case Isa::avx512:
      return "avx512";
    case Isa::scalar:
      break;
  }
  return "scalar";
}

// Every tier, in order of preference (the last one the CPU runs is detect_isa's choice).
inline constexpr Isa kAllIsas[] = {Isa::scalar, Isa::avx2, Isa::avx2_vnni, Isa::avx512};

// False for a value that names no tier (an enum is range-checked like every argument).
constexpr bool is_tier(Isa isa) {
  for (Isa t : kAllIsas)
    if (t == isa) return true;
  return false;
}

// Parses to_string's names; throws tiledecode::Error naming the allowed ones otherwise.
inline Isa isa_from_string(std::string_view where, std::string_view name) {
  for (Isa isa : kAllIsas)
    if (name == to_string(isa)) return isa;
  throw Error(std::string(where) + ": argument 'isa' = '" + std::string(name) +
              "' is not an ISA; allowed scalar, avx2, avx2_vnni, avx512");
}

// True for every tier that runs the AVX2 kernels.
constexpr bool has_avx2(Isa isa) {
  return isa != Isa::scalar;
}

// True for the tiers whose INT8 matmuls run on vpdpbusd (256-bit VEX or 512-bit EVEX).
constexpr bool has_vnni(Isa isa) {
  return isa == Isa::avx2_vnni || isa == Isa::avx512;
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

// AVX-512 F + BW + VL + VNNI + BF16 with the ZMM and opmask state enabled by the OS.
inline bool cpu_has_avx512() {
#if TILEDECODE_X86 && (defined(__GNUC__) || defined(__clang__))
  // Read from CPUID directly (clang 14's __builtin_cpu_supports lacks "avx512bf16"), once:
  //   leaf 1 ECX bit 27 OSXSAVE; XCR0 bits 1, 2 (SSE, AVX) and 5-7 (opmask, ZMM0-15 high halves,
  //   ZMM16-31) all set; leaf 7.0 EBX bits 16 (F), 30 (BW), 31 (VL), ECX bit 11 (VNNI);
  //   leaf 7.1 EAX bit 5 (BF16).
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx2() || !__get_cpuid(1, &a, &b, &c, &d) || ((c >> 27) & 1u) == 0) return false;
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0xE6u) != 0xE6u) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool f = (b >> 16) & 1u, bw = (b >> 30) & 1u, vl = (b >> 31) & 1u;
    const bool vnni = (c >> 11) & 1u;
    if (!(f && bw && vl && vnni) || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 5) & 1u) != 0;
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
    case Isa::avx512:
      return cpu_has_avx512();
    case Isa::scalar:
      return true;
  }
  return false;
}

// The best ISA this machine runs: the last tier of kAllIsas the CPU supports.
inline Isa detect_isa() {
  Isa best = Isa::scalar;
  for (Isa isa : kAllIsas)
    if (cpu_supports(isa)) best = isa;
  return best;
}

// Every ISA this machine runs, scalar first (tests run each path).
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> v;
  for (Isa isa : kAllIsas)
    if (cpu_supports(isa)) v.push_back(isa);
  return v;
}

// How the avx512 tier sums products of two BF16 rows where both operands are BF16 already (the
// compressors' x_n · wkv and x_n · wgate, and the q/kv projection's x_n · wq_a and x_n · wkv
// where the caller provides their transposed copy QkvWeights::bf16_rows; Context::bf16_dot):
//   fma        512-bit FP32 FMA in the avx2 tier's order (avx512::bf16_rows_dot_fma): the bits of
//              every other tier.
//   dpbf16     vdpbf16ps, the kernels of the o-proj's wo_a (avx512::bf16_rows_dot and
//              bf16_rows_dot_blocked): the same exact products (BF16 × BF16 is exact in FP32) in
//              another summation order, within the spec's tolerances (tested against golden and
//              for rounding rates) and with vdpbf16ps's DAZ / FTZ (docs/security.md).
//   automatic  dpbf16 where vdpbf16ps retires at least the FP32 FMA FLOP rate
//              (cpu_bf16_dot_fast), fma elsewhere.
// Other tiers have no vdpbf16ps and ignore fma / dpbf16.
//   exact      on every tier (issue 17): those dots, the q/kv projection's x_n · [wq_a | wkv]
//              and the o-proj's wo_a summed in double in ascending k (bf16_exact.hpp), so each
//              FP32 result is the exact dot rounded once (for the compressors and wo_a, golden's
//              bits) and every BF16 / INT8 rounding downstream rounds as the exact value does
//              (tests/test_rounding.cpp).
//              One double FMA per product: at decode batch sizes 1.4-2.5x the time of the
//              projections' default (docs/compressors.md, "Exact dots"), for engines that check
//              their outputs against the reference to the last bit.
enum class Bf16Dot : std::uint8_t { automatic, fma, dpbf16, exact };

constexpr std::string_view to_string(Bf16Dot b) {
  return b == Bf16Dot::fma      ? "fma"
         : b == Bf16Dot::dpbf16 ? "dpbf16"
         : b == Bf16Dot::exact  ? "exact"
                                : "automatic";
}

// True where vdpbf16ps is the faster way to multiply BF16 rows: AMD processors with the avx512
// tier (Zen 4 and later run it at twice the FP32 FMA FLOP rate: measured on an EPYC Zen 4
// 232 vs 116 GFLOP/s per core). Intel's AVX512_BF16 parts run it at half the FMA rate
// (measured on a Sapphire Rapids Xeon: 108 vs 215-240 GFLOP/s), so they keep FMA. The vendor
// is read from CPUID leaf 0, once (a constant of the machine, like the tier checks).
inline bool cpu_bf16_dot_fast() {
#if TILEDECODE_X86 && (defined(__GNUC__) || defined(__clang__))
  static const bool fast = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx512() || !__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  }();
  return fast;
#else
  return false;
#endif
}

// Parses to_string's names (a command line's --bf16-dot); throws tiledecode::Error otherwise.
inline Bf16Dot bf16_dot_from_string(std::string_view where, std::string_view name) {
  for (Bf16Dot b : {Bf16Dot::automatic, Bf16Dot::fma, Bf16Dot::dpbf16, Bf16Dot::exact})
    if (name == to_string(b)) return b;
  throw Error(std::string(where) + ": argument 'bf16_dot' = '" + std::string(name) +
              "' is not a choice; allowed automatic, fma, dpbf16, exact");
}

// The choice a tier runs with (never automatic); throws tiledecode::Error for a value that names
// no choice.
inline Bf16Dot resolved_bf16_dot(Bf16Dot requested) {
  switch (requested) {
    case Bf16Dot::fma:
    case Bf16Dot::dpbf16:
    case Bf16Dot::exact:
      return requested;
    case Bf16Dot::automatic:
      return cpu_bf16_dot_fast() ? Bf16Dot::dpbf16 : Bf16Dot::fma;
  }
  throw Error("cpu::Context: argument 'bf16_dot' = " + std::to_string(static_cast<int>(requested)) +
              " is not a choice; allowed automatic, fma, dpbf16, exact");
}

// Validates an explicitly requested ISA (tests force every path).
inline Isa checked_isa(Isa requested) {
  if (!cpu_supports(requested)) {
    std::string allowed;
    for (Isa isa : supported_isas())
      allowed += (allowed.empty() ? "" : ", ") + std::string(to_string(isa));
    const bool named = is_tier(requested);
    throw Error("cpu::checked_isa: argument 'isa' = " +
                (named ? std::string(to_string(requested))
                       : std::to_string(static_cast<int>(requested)) + " (not a tier)") +
                " is not supported by this CPU; allowed " + allowed);
  }
  return requested;
}

}  // namespace tiledecode::cpu
