#pragma once
// Machine ceilings measured in the same process as the kernels they bound. Wall clock:
//   fp32_fma_gflops()
//       register-only FMA loop, 12 independent chains, 2 FLOP per lane per FMA; 1 thread. The
//       best of the 256-bit loop and, where the CPU has AVX-512, the 512-bit one: the machine's
//       FP32 ceiling whatever tier a kernel runs (fp32_fma_kind() names the loop that set it).
//   fp32_fma_gflops_threads(n)
//       the same loop on n threads at once, aggregate GFLOP/s (does 2 cores give 2x one core?).
//   int8_gops()
//       register-only INT8 multiply-add loops (the sign-trick vpmaddubsw mix and the widening
//       vpmaddwd mix), the better of the two; 2 OP per int8 pair; 1 thread.
//   int8_vnni_gops(), int8_vnni512_gops(), int8_ceiling_gops(isa), int8_machine_gops()
//       the AVX-VNNI loop (256-bit vpdpbusd, 32 pairs per instruction; 0 without AVX-VNNI), the
//       AVX-512 VNNI loop (512-bit vpdpbusd, 64 pairs; 0 without the avx512 tier), the ceiling
//       of the INT8 instructions a kernel running with `isa` can use, and the best INT8 ceiling
//       of the machine (int8_machine_kind() names its loop) that pct_of_ceiling uses.
//   fp32_fma512_gflops(), bf16_dot_gflops(), bf16_mac_gflops()
//       the 512-bit FMA loop and the vdpbf16ps loop (BF16 pairs into FP32, 2 FLOP per pair);
//       0 without the avx512 tier; and the ceiling of BF16 × BF16 multiply-adds (the better of
//       the FMA and vdpbf16ps loops: bf16_mac_kind() names it).
//   read_gbps(n)
//       streaming read bandwidth over a 256 MiB buffer with n threads.
// CPU time of the calling thread (robust to other jobs on a shared machine; per busy core):
//   fp32_fma_gflops_cpu(), int8_sign_gops_cpu(), int8_widen_gops_cpu(),
//   int8_madd16_gops_cpu(), int8_tile_mix_gops_cpu(), read_gbps_cpu()
//       the same loops (read: the 1-thread loop), timed with thread_cpu_seconds().
//   read_gbps_cpu_threads(n)
//       the read loop on n threads, each timed by its own CPU time; the slowest reader counts.
// Each is measured once per process (median of 5) and cached.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <string_view>
#include <thread>
#include <vector>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/simd/avx_vnni.hpp"

namespace tdbench {

using clock_type = std::chrono::steady_clock;

template <class F>
double median_seconds(F&& f, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// CPU seconds consumed by the calling thread / by the whole process (all threads). The ceiling
// loops run on one thread and use the former; a kernel timed across a thread pool needs the
// latter.
inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Median thread CPU time of `reps` calls of f().
template <class F>
double median_cpu_seconds(F&& f, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = thread_cpu_seconds();
    f();
    t.push_back(thread_cpu_seconds() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

#if TILEDECODE_X86
// The compiler must not merge chains or hoist products out of the loop, yet the loop must not
// chain iterations through anything but the accumulators: an empty asm statement marks a value
// as modified without emitting an instruction. Every counted instruction is executed (checked
// with objdump: one vfmadd / vpmaddubsw / vpmaddwd per counted operation).
#define TDBENCH_OPAQUE(v) __asm__ volatile("" : "+x"(v))

// 12 independent FMA chains (4-cycle latency × 2 FMA pipes needs >= 8 in flight), each starting
// from its own value so they cannot be merged.
TILEDECODE_TARGET_AVX2 inline float fma_loop(std::int64_t iters) {
  __m256 a[12];
  for (int k = 0; k < 12; ++k) {
    a[k] = _mm256_set1_ps(0.1f + 0.01f * float(k));
    TDBENCH_OPAQUE(a[k]);
  }
  __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  TDBENCH_OPAQUE(m);
  TDBENCH_OPAQUE(c);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm256_fmadd_ps(a[k], m, c);
  }
  __m256 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm256_add_ps(s, a[k]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0];
}

// Sign-trick mix, as cpu::avx2::dot_i8x32: 2 × vpsignb, vpmaddubsw, vpmaddwd, vpaddd per 32
// pairs; 8 chains with 8 distinct inputs (no common subexpressions).
TILEDECODE_TARGET_AVX2 inline int int8_sign_loop(std::int64_t iters) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i x[8], c[8];
  __m256i y = _mm256_set1_epi8(11);
  for (int k = 0; k < 8; ++k) {
    x[k] = _mm256_set1_epi8(static_cast<char>(3 + 2 * k));
    c[k] = _mm256_setzero_si256();
  }
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 8; ++k) TDBENCH_OPAQUE(x[k]);
    TDBENCH_OPAQUE(y);
    for (int k = 0; k < 8; ++k) {
      c[k] = _mm256_add_epi32(
          c[k],
          _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(x[k], x[k]), _mm256_sign_epi8(y, x[k])), ones));
    }
  }
  __m256i s = c[0];
  for (int k = 1; k < 8; ++k) s = _mm256_add_epi32(s, c[k]);
  return _mm256_extract_epi32(s, 0);
}

// Widening mix: int8 → int16 (vpmovsxbw) for one operand per 16 pairs, vpmaddwd, vpaddd — the
// exact-for-every-int8 dot the indexer uses (the other operand is pre-widened once per tile);
// 8 chains with 8 distinct inputs.
TILEDECODE_TARGET_AVX2 inline int int8_widen_loop(std::int64_t iters) {
  __m128i k8[8];
  __m256i c[8];
  __m256i q = _mm256_set1_epi16(7);
  for (int k = 0; k < 8; ++k) {
    k8[k] = _mm_set1_epi8(static_cast<char>(3 - 2 * k));
    c[k] = _mm256_setzero_si256();
  }
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 8; ++k) TDBENCH_OPAQUE(k8[k]);
    TDBENCH_OPAQUE(q);
    for (int k = 0; k < 8; ++k) {
      c[k] = _mm256_add_epi32(c[k], _mm256_madd_epi16(_mm256_cvtepi8_epi16(k8[k]), q));
    }
  }
  __m256i s = c[0];
  for (int k = 1; k < 8; ++k) s = _mm256_add_epi32(s, c[k]);
  return _mm256_extract_epi32(s, 0);
}

// Pre-widened mix: both operands already int16, vpmaddwd + vpaddd per 16 pairs — the indexer
// score's inner loop (keys widened once per 16-row block and reused by all 64 heads, queries once
// per task, so the vpmovsxbw of int8_widen_loop is amortised away). 4 constant × 2 opaque inputs
// give 8 distinct products, none hoistable; 8 accumulator chains. Only the 2 inputs are opaqued:
// opaquing all 6 spills accumulators to the stack (16 ymm registers).
// The avx2_vnni score's instruction: vpdpbusd (u8 x s8, 4 pairs per int32 lane, accumulating).
// 8 chains (the score loop's count), 32 pairs per instruction.
TILEDECODE_TARGET_AVX2_VNNI inline int int8_vnni_loop(std::int64_t iters) {
  namespace v = tiledecode::cpu::avx2_vnni;
  const __m256i k0 = _mm256_set1_epi8(3), k1 = _mm256_set1_epi8(-5), k2 = _mm256_set1_epi8(7),
                k3 = _mm256_set1_epi8(-9);
  __m256i b0 = _mm256_set1_epi8(11), b1 = _mm256_set1_epi8(13);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
          c7 = c0;
  for (std::int64_t i = 0; i < iters; ++i) {
    TDBENCH_OPAQUE(b0);
    TDBENCH_OPAQUE(b1);
    c0 = v::dpbusd(c0, b0, k0);
    c1 = v::dpbusd(c1, b0, k1);
    c2 = v::dpbusd(c2, b0, k2);
    c3 = v::dpbusd(c3, b0, k3);
    c4 = v::dpbusd(c4, b1, k0);
    c5 = v::dpbusd(c5, b1, k1);
    c6 = v::dpbusd(c6, b1, k2);
    c7 = v::dpbusd(c7, b1, k3);
  }
  const __m256i s =
      _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                       _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
  return _mm256_extract_epi32(s, 0);
}

TILEDECODE_TARGET_AVX2 inline int int8_madd16_loop(std::int64_t iters) {
  const __m256i k0 = _mm256_set1_epi16(3), k1 = _mm256_set1_epi16(-5), k2 = _mm256_set1_epi16(7),
                k3 = _mm256_set1_epi16(-9);
  __m256i b0 = _mm256_set1_epi16(11), b1 = _mm256_set1_epi16(-13);
  // Named accumulators, not an array: with an array GCC copies every chain through a second
  // register and spills two of them each iteration.
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
          c7 = c0;
  for (std::int64_t i = 0; i < iters; ++i) {
    TDBENCH_OPAQUE(b0);
    TDBENCH_OPAQUE(b1);
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(k0, b0));
    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(k1, b0));
    c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(k2, b0));
    c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(k3, b0));
    c4 = _mm256_add_epi32(c4, _mm256_madd_epi16(k0, b1));
    c5 = _mm256_add_epi32(c5, _mm256_madd_epi16(k1, b1));
    c6 = _mm256_add_epi32(c6, _mm256_madd_epi16(k2, b1));
    c7 = _mm256_add_epi32(c7, _mm256_madd_epi16(k3, b1));
  }
  const __m256i s =
      _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                       _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
  return _mm256_extract_epi32(s, 0);
}

// The output projection's wo_b tile mix (2 weight vectors × 4 token vectors, exact s8 × s8 via
// the sign trick): per 32 pairs one vpsignb (token sign) + vpmaddubsw + vpmaddwd + vpaddd, plus
// |w| (one vpsignb) per weight vector amortised over the 4 tokens. It needs 1.25 vpsignb per 32
// pairs instead of int8_sign_loop's 2, so it bounds that tile more tightly than int8_gops().
// Every input is re-opaqued each iteration; 8 distinct products, 8 accumulator chains.
TILEDECODE_TARGET_AVX2 inline int int8_tile_mix_loop(std::int64_t iters) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(-5);
  __m256i x0 = _mm256_set1_epi8(7), x1 = _mm256_set1_epi8(-9), x2 = _mm256_set1_epi8(11),
          x3 = _mm256_set1_epi8(13);
  __m256i c[8];
  for (auto& v : c) v = _mm256_setzero_si256();
  for (std::int64_t i = 0; i < iters; ++i) {
    TDBENCH_OPAQUE(w0);
    TDBENCH_OPAQUE(w1);
    TDBENCH_OPAQUE(x0);
    TDBENCH_OPAQUE(x1);
    TDBENCH_OPAQUE(x2);
    TDBENCH_OPAQUE(x3);
    const __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
    const __m256i xs[4] = {x0, x1, x2, x3};
    for (int t = 0; t < 4; ++t) {
      c[2 * t] = _mm256_add_epi32(
          c[2 * t],
          _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xs[t], w0)), ones));
      c[2 * t + 1] = _mm256_add_epi32(
          c[2 * t + 1],
          _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xs[t], w1)), ones));
    }
  }
  __m256i s = c[0];
  for (int k = 1; k < 8; ++k) s = _mm256_add_epi32(s, c[k]);
  return _mm256_extract_epi32(s, 0);
}
// The AVX-512 loops (Isa::avx512): 12 independent chains of the 512-bit FMA and vpdpbusd (enough
// in flight for two 512-bit pipes at 4-6 cycles' latency; 16 measured no faster on Zen 5),
// 12 and 16 of vdpbf16ps (bf16_dot_loop).
TILEDECODE_AVX512_BEGIN
TILEDECODE_TARGET_AVX512 inline float fma512_loop(std::int64_t iters) {
  __m512 a[12];
  for (int k = 0; k < 12; ++k) {
    a[k] = _mm512_set1_ps(0.1f + 0.01f * float(k));
    TDBENCH_OPAQUE(a[k]);
  }
  __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  TDBENCH_OPAQUE(m);
  TDBENCH_OPAQUE(c);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm512_fmadd_ps(a[k], m, c);
  }
  __m512 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm512_add_ps(s, a[k]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  return out[0];
}

TILEDECODE_TARGET_AVX512 inline int int8_vnni512_loop(std::int64_t iters) {
  namespace v = tiledecode::cpu::avx512;
  __m512i k[4] = {_mm512_set1_epi8(3), _mm512_set1_epi8(-5), _mm512_set1_epi8(7),
                  _mm512_set1_epi8(-9)};
  __m512i b0 = _mm512_set1_epi8(11), b1 = _mm512_set1_epi8(13), b2 = _mm512_set1_epi8(17);
  __m512i c[12];
  for (auto& x : c) x = _mm512_setzero_si512();
  for (std::int64_t i = 0; i < iters; ++i) {
    TDBENCH_OPAQUE(b0);
    TDBENCH_OPAQUE(b1);
    TDBENCH_OPAQUE(b2);
    for (int j = 0; j < 4; ++j) {
      c[j] = v::dpbusd(c[j], b0, k[j]);
      c[4 + j] = v::dpbusd(c[4 + j], b1, k[j]);
      c[8 + j] = v::dpbusd(c[8 + j], b2, k[j]);
    }
  }
  __m512i s = c[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_epi32(s, c[j]);
  return _mm256_extract_epi32(v::fold_epi32(s), 0);
}

// vdpbf16ps with kChains chains: on Zen 5 12 chains ran at 481-494 GFLOP/s and 16 at 524-533
// (its latency needs more than 12 in flight; 20 spill), so the ceiling is the better of 12 and 16.
template <int kChains>
TILEDECODE_TARGET_AVX512 inline float bf16_dot_loop(std::int64_t iters) {
  __m512 a[kChains];
  for (int k = 0; k < kChains; ++k) {
    a[k] = _mm512_set1_ps(0.01f * float(k));
    TDBENCH_OPAQUE(a[k]);
  }
  __m512i x = _mm512_set1_epi16(0x3F80), y = _mm512_set1_epi16(0x3727);  // BF16 1.0, ~1e-5
  TDBENCH_OPAQUE(x);
  TDBENCH_OPAQUE(y);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < kChains; ++k) a[k] = _mm512_dpbf16_ps(a[k], (__m512bh)x, (__m512bh)y);
  }
  __m512 s = a[0];
  for (int k = 1; k < kChains; ++k) s = _mm512_add_ps(s, a[k]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  return out[0];
}
TILEDECODE_AVX512_END

#undef TDBENCH_OPAQUE
#endif

namespace detail {

// Median seconds of f(): wall clock, or CPU time of the calling thread.
template <class F>
double median_time(bool cpu_time, F&& f) {
  return cpu_time ? median_cpu_seconds(f) : median_seconds(f);
}

inline double fma_rate(bool cpu_time) {
#if TILEDECODE_X86
  if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
  const std::int64_t iters = 20'000'000;
  volatile float sink = 0;
  const double s = median_time(cpu_time, [&] { sink = sink + fma_loop(iters); });
  return double(iters) * 12 * 8 * 2 / s * 1e-9;
#else
  (void)cpu_time;
  return 0.0;
#endif
}

// The AVX-512 loops' rates (0 without the avx512 tier): FP32 FMA and vdpbf16ps in GFLOP/s
// (2 FLOP per lane per FMA, 2 per BF16 pair), vpdpbusd in GOP/s (2 OP per int8 pair).
enum class Avx512Loop { fma, vnni, bf16 };
inline double avx512_rate(Avx512Loop loop, bool cpu_time) {
#if TILEDECODE_X86
  if (!tiledecode::cpu::cpu_has_avx512()) return 0.0;
  volatile float fsink = 0;
  volatile int isink = 0;
  switch (loop) {
    case Avx512Loop::fma: {
      const std::int64_t iters = 10'000'000;
      const double s = median_time(cpu_time, [&] { fsink = fsink + fma512_loop(iters); });
      return double(iters) * 12 * 16 * 2 / s * 1e-9;
    }
    case Avx512Loop::vnni: {
      const std::int64_t iters = 5'000'000;
      const double s = median_time(cpu_time, [&] { isink = isink + int8_vnni512_loop(iters); });
      return double(iters) * 12 * 64 * 2 / s * 1e-9;
    }
    case Avx512Loop::bf16: {
      const std::int64_t iters = 10'000'000;
      const double s12 = median_time(cpu_time, [&] { fsink = fsink + bf16_dot_loop<12>(iters); });
      const double s16 =
          median_time(cpu_time, [&] { fsink = fsink + bf16_dot_loop<16>(iters * 3 / 4); });
      return double(iters) * 12 * 32 * 2 / std::min(s12, s16) * 1e-9;  // the same FLOP each
    }
  }
  return 0.0;
#else
  (void)loop;
  (void)cpu_time;
  return 0.0;
#endif
}

// Which INT8 loop: the sign-trick mix, the widening mix, the pre-widened mix, or the wo_b tile
// mix.
enum class Int8Mix { sign, widen, madd16, tile, vnni };

inline double int8_rate(Int8Mix mix, bool cpu_time) {
#if TILEDECODE_X86
  if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
  const std::int64_t iters = 10'000'000;
  volatile int sink = 0;
  double pairs_per_iter = 8 * 32;
  double s = 0;
  switch (mix) {
    case Int8Mix::sign:
      s = median_time(cpu_time, [&] { sink = sink + int8_sign_loop(iters); });
      break;
    case Int8Mix::widen:
      pairs_per_iter = 8 * 16;
      s = median_time(cpu_time, [&] { sink = sink + int8_widen_loop(iters); });
      break;
    case Int8Mix::madd16:
      pairs_per_iter = 8 * 16;
      s = median_time(cpu_time, [&] { sink = sink + int8_madd16_loop(iters); });
      break;
    case Int8Mix::tile:
      s = median_time(cpu_time, [&] { sink = sink + int8_tile_mix_loop(iters); });
      break;
    case Int8Mix::vnni:
      if (!tiledecode::cpu::cpu_has_avx2_vnni()) return 0.0;
      s = median_time(cpu_time, [&] { sink = sink + int8_vnni_loop(iters); });
      break;
  }
  return double(iters) * pairs_per_iter * 2 / s * 1e-9;
#else
  (void)mix;
  (void)cpu_time;
  return 0.0;
#endif
}

// Sums buf[lo, hi) with 4 independent chains (the streaming-read loop).
inline std::uint64_t read_sum(const std::uint64_t* buf, std::size_t lo, std::size_t hi) {
  std::uint64_t a = 0, b = 0, c = 0, d = 0;
  for (std::size_t i = lo; i + 4 <= hi; i += 4) {
    a += buf[i];
    b += buf[i + 1];
    c += buf[i + 2];
    d += buf[i + 3];
  }
  return a + b + c + d;
}

constexpr std::size_t kReadWords = (std::size_t(256) << 20) / sizeof(std::uint64_t);

// cache[threads - 1], computed by f() on first use; 0 for thread counts outside 1..8.
template <class F>
double cached_for(double (&cache)[8], int threads, F&& f) {
  if (threads < 1 || threads > 8) return 0.0;
  if (cache[threads - 1] <= 0) cache[threads - 1] = f();
  return cache[threads - 1];
}

// Runs f(0) .. f(threads - 1) concurrently, f(0) on the calling thread, and joins.
template <class F>
void run_on_threads(int threads, F&& f) {
  std::vector<std::thread> ts;
  for (int k = 1; k < threads; ++k) ts.emplace_back([&f, k] { f(k); });
  f(0);
  for (auto& th : ts) th.join();
}

}  // namespace detail

// The AVX-512 loops, measured once per process (0 without the avx512 tier): 512-bit FP32 FMA
// (GFLOP/s), vdpbf16ps (GFLOP/s, 2 per BF16 pair), 512-bit vpdpbusd (GOP/s); kCpuTime: per
// CPU-second of the calling thread.
template <bool kCpuTime = false>
double fp32_fma512_gflops() {
  static const double v = detail::avx512_rate(detail::Avx512Loop::fma, kCpuTime);
  return v;
}
template <bool kCpuTime = false>
double bf16_dot_gflops() {
  static const double v = detail::avx512_rate(detail::Avx512Loop::bf16, kCpuTime);
  return v;
}
template <bool kCpuTime = false>
double int8_vnni512_gops() {
  static const double v = detail::avx512_rate(detail::Avx512Loop::vnni, kCpuTime);
  return v;
}

// The 256-bit FMA loop alone (GFLOP/s, wall clock), measured once per process.
inline double fp32_fma256_gflops() {
  static const double v = detail::fma_rate(false);
  return v;
}

// Single-thread FP32 FMA ceiling in GFLOP/s (2 FLOP per lane per FMA), wall clock: the better of
// the 256-bit and the 512-bit loop (the machine's ceiling, whatever tier the kernel ran).
inline double fp32_fma_gflops() {
  return std::max(fp32_fma256_gflops(), fp32_fma512_gflops<false>());
}

// The same, per CPU-second of the calling thread: the per-busy-core ceiling on a shared machine.
inline double fp32_fma_gflops_cpu() {
  static const double v = std::max(detail::fma_rate(true), fp32_fma512_gflops<true>());
  return v;
}

// Which loop sets fp32_fma_gflops(): "fma512" or "fma256".
inline const char* fp32_fma_kind() {
  return fp32_fma512_gflops<false>() > fp32_fma256_gflops() ? "fma512" : "fma256";
}

// The ceiling of multiply-adds whose two operands are BF16 (the BF16 projections: x_n, o_packed
// and the compressor inputs are BF16 like their weights): the FP32 FMA ceiling, or vdpbf16ps where
// the CPU has it and it is faster (Zen 4: 229 against 113 GFLOP/s), whatever tier ran.
template <bool kCpuTime = false>
double bf16_mac_gflops() {
  return std::max(kCpuTime ? fp32_fma_gflops_cpu() : fp32_fma_gflops(),
                  bf16_dot_gflops<kCpuTime>());
}
inline const char* bf16_mac_kind() {
  return bf16_dot_gflops<false>() > fp32_fma_gflops() ? "vdpbf16ps" : fp32_fma_kind();
}

// Aggregate FP32 FMA rate (GFLOP/s, wall clock) of `threads` threads each running fma_loop at
// once (the caller is one of them). Compared with `threads` × fp32_fma_gflops() it shows what
// running more cores costs per core (clock drop, shared cores, other jobs). 0 outside 1..8.
inline double fp32_fma_gflops_threads(int threads) {
  static double cache[8] = {};
  return detail::cached_for(cache, threads, [threads]() -> double {
#if TILEDECODE_X86
    if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
    // The loop that sets fp32_fma_gflops() (512-bit where it is faster).
    const bool wide = std::string_view(fp32_fma_kind()) == "fma512";
    const std::int64_t iters = wide ? 10'000'000 : 20'000'000;
    std::vector<float> out(threads);
    volatile float sink = 0;
    const double s = median_seconds([&] {
      detail::run_on_threads(threads,
                             [&](int k) { out[k] = wide ? fma512_loop(iters) : fma_loop(iters); });
      for (float o : out) sink = sink + o;
    });
    return double(threads) * double(iters) * 12 * (wide ? 16 : 8) * 2 / s * 1e-9;
#else
    return 0.0;
#endif
  });
}

// Single-thread INT8 multiply-add ceilings in GOP/s (2 OP per int8 pair), throughput-bound
// register-only loops, one per exact signed × signed AVX2 instruction mix: the sign trick (32 pairs
// per vpmaddubsw, 2 vpsignb), the widening mix (vpmovsxbw + vpmaddwd, 16 pairs), the pre-widened
// int16 mix (vpmaddwd only: the indexer score's inner loop) and the wo_b tile mix (1.25 vpsignb
// per vpmaddubsw). `int8_gops()` is the best of them: the machine's exact AVX2 INT8 ceiling, which
// every kernel's INT8 share is measured against.
using detail::Int8Mix;

// One mix's ceiling, measured once per process and cached; kCpuTime: per CPU-second of the
// calling thread instead of wall clock.
template <Int8Mix kMix, bool kCpuTime = false>
double int8_mix_gops() {
  static const double v = detail::int8_rate(kMix, kCpuTime);
  return v;
}

template <bool kCpuTime = false>
double int8_best_gops() {
  return std::max(
      {int8_mix_gops<Int8Mix::sign, kCpuTime>(), int8_mix_gops<Int8Mix::widen, kCpuTime>(),
       int8_mix_gops<Int8Mix::madd16, kCpuTime>(), int8_mix_gops<Int8Mix::tile, kCpuTime>()});
}
inline double int8_gops() {
  return int8_best_gops<false>();
}
inline double int8_gops_cpu() {
  return int8_best_gops<true>();
}

// AVX-VNNI (vpdpbusd) ceiling; 0 on a CPU without AVX-VNNI.
template <bool kCpuTime = false>
double int8_vnni_gops() {
  return int8_mix_gops<Int8Mix::vnni, kCpuTime>();
}

// The INT8 ceiling of the instructions a kernel running with `isa` may use: the AVX2 mixes,
// 256-bit vpdpbusd on Isa::avx2_vnni and 512-bit vpdpbusd on Isa::avx512 (the tiers of the
// indexer score and query GEMM, o-proj's wo_b and the q/kv wq_b matmul VNNI paths); int8_gops()
// is the AVX2-only ceiling.
template <bool kCpuTime = false>
double int8_ceiling_gops(tiledecode::cpu::Isa isa) {
  const double avx2 = int8_best_gops<kCpuTime>();
  if (isa == tiledecode::cpu::Isa::avx512) return std::max(avx2, int8_vnni512_gops<kCpuTime>());
  return isa == tiledecode::cpu::Isa::avx2_vnni ? std::max(avx2, int8_vnni_gops<kCpuTime>()) : avx2;
}

// The best INT8 ceiling of the machine (every tier it runs), what pct_of_ceiling is measured
// against whatever tier a kernel ran: a kernel on the avx2 tier of an AVX-512 machine is held to
// the 512-bit vpdpbusd.
template <bool kCpuTime = false>
double int8_machine_gops() {
  double best = 0;
  for (tiledecode::cpu::Isa isa : tiledecode::cpu::supported_isas())
    best = std::max(best, int8_ceiling_gops<kCpuTime>(isa));
  return best;
}

// Which loop sets int8_machine_gops(): "vpdpbusd512", "vpdpbusd256" or "avx2_int8".
inline const char* int8_machine_kind() {
  const double best = int8_machine_gops<false>();
  if (best > 0 && best == int8_vnni512_gops<false>()) return "vpdpbusd512";
  if (best > 0 && best == int8_vnni_gops<false>()) return "vpdpbusd256";
  return "avx2_int8";
}

// Streaming read bandwidth (GB/s) with `threads` threads over a 256 MiB buffer, wall clock.
inline double read_gbps(int threads) {
  static double cache[8] = {};
  return detail::cached_for(cache, threads, [threads] {
    const std::size_t n = detail::kReadWords;
    std::vector<std::uint64_t> buf(n, 1);
    volatile std::uint64_t sink = 0;
    const double s = median_seconds([&] {
      std::vector<std::uint64_t> out(threads);
      detail::run_on_threads(threads, [&](int k) {
        out[k] = detail::read_sum(buf.data(), n * k / threads, n * (k + 1) / threads);
      });
      for (auto o : out) sink = sink + o;
    });
    return double(n * sizeof(std::uint64_t)) / s * 1e-9;
  });
}

// Single-thread streaming read bandwidth (GB/s) per CPU-second of the calling thread: the same
// loop as read_gbps(1), in the units of a kernel's CPU time (robust to other jobs' load).
inline double read_gbps_cpu() {
  static const double v = [] {
    const std::size_t n = detail::kReadWords;
    std::vector<std::uint64_t> buf(n, 1);
    volatile std::uint64_t sink = 0;
    const double s = median_cpu_seconds([&] { sink = sink + detail::read_sum(buf.data(), 0, n); });
    return double(n * sizeof(std::uint64_t)) / s * 1e-9;
  }();
  return v;
}

// Aggregate streaming read bandwidth (GB/s) of `threads` concurrent readers, each timed by its
// own thread CPU time; the slowest reader sets the time (median of 5). The read_gbps(threads)
// loop in CPU-time units: what `threads` busy cores can stream while sharing the memory system,
// without the time other jobs took from them. 0 outside 1..8.
inline double read_gbps_cpu_threads(int threads) {
  static double cache[8] = {};
  return detail::cached_for(cache, threads, [threads] {
    const std::size_t n = detail::kReadWords;
    std::vector<std::uint64_t> buf(n, 1);
    volatile std::uint64_t sink = 0;
    std::vector<double> t;
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<double> secs(threads);
      std::vector<std::uint64_t> out(threads);
      detail::run_on_threads(threads, [&](int k) {
        const double c0 = thread_cpu_seconds();
        out[k] = detail::read_sum(buf.data(), n * k / threads, n * (k + 1) / threads);
        secs[k] = thread_cpu_seconds() - c0;
      });
      for (auto o : out) sink = sink + o;
      t.push_back(*std::max_element(secs.begin(), secs.end()));
    }
    std::sort(t.begin(), t.end());
    return double(n * sizeof(std::uint64_t)) / t[t.size() / 2] * 1e-9;
  });
}

}  // namespace tdbench
