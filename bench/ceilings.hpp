#pragma once
// Machine ceilings measured in the same process as the kernels they bound:
//   fp32_fma_gflops   register-only FMA loop, 12 independent chains (2 FLOP per lane per FMA), 1
//   thread int8_gops         register-only INT8 multiply-add loops (sign-trick vpmaddubsw mix and
//   the
//                     widening vpmaddwd mix), the better of the two; 2 OP per int8 pair, 1 thread
//   read_gbps(n)      streaming read bandwidth over a 256 MiB buffer with n threads
// Each is measured once per process (median of 5) and cached.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "tiledecode/backend/cpu/isa.hpp"

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
#undef TDBENCH_OPAQUE
#endif

// Single-thread FP32 FMA ceiling in GFLOP/s (2 FLOP per lane per FMA).
inline double fp32_fma_gflops() {
  static const double v = [] {
#if TILEDECODE_X86
    if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 20'000'000;
    volatile float sink = 0;
    const double s = median_seconds([&] { sink = sink + fma_loop(iters); });
    return double(iters) * 12 * 8 * 2 / s * 1e-9;
#else
    return 0.0;
#endif
  }();
  return v;
}

// Single-thread INT8 multiply-add ceilings in GOP/s (2 OP per int8 pair), throughput-bound
// register-only loops: the sign-trick mix (32 pairs per vpmaddubsw) and the widening mix (16 pairs
// per vpmaddwd). `int8_gops()` is the better of the two: the machine's AVX2 INT8 ceiling.
inline double int8_sign_gops() {
  static const double v = [] {
#if TILEDECODE_X86
    if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 10'000'000;
    volatile int sink = 0;
    const double s = median_seconds([&] { sink = sink + int8_sign_loop(iters); });
    return double(iters) * 8 * 32 * 2 / s * 1e-9;
#else
    return 0.0;
#endif
  }();
  return v;
}
inline double int8_widen_gops() {
  static const double v = [] {
#if TILEDECODE_X86
    if (!tiledecode::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 10'000'000;
    volatile int sink = 0;
    const double s = median_seconds([&] { sink = sink + int8_widen_loop(iters); });
    return double(iters) * 8 * 16 * 2 / s * 1e-9;
#else
    return 0.0;
#endif
  }();
  return v;
}
inline double int8_gops() {
  return std::max(int8_sign_gops(), int8_widen_gops());
}

// Streaming read bandwidth (GB/s) with `threads` threads over a 256 MiB buffer.
inline double read_gbps(int threads) {
  static double cache[8] = {};
  if (threads < 1 || threads > 8) return 0.0;
  if (cache[threads - 1] > 0) return cache[threads - 1];
  const std::size_t n = (std::size_t(256) << 20) / sizeof(std::uint64_t);
  std::vector<std::uint64_t> buf(n, 1);
  auto read_part = [&](std::size_t lo, std::size_t hi, std::uint64_t* out) {
    std::uint64_t a = 0, b = 0, c = 0, d = 0;
    for (std::size_t i = lo; i + 4 <= hi; i += 4) {
      a += buf[i];
      b += buf[i + 1];
      c += buf[i + 2];
      d += buf[i + 3];
    }
    *out = a + b + c + d;
  };
  volatile std::uint64_t sink = 0;
  const double s = median_seconds([&] {
    std::vector<std::uint64_t> out(threads);
    std::vector<std::thread> ts;
    for (int t = 1; t < threads; ++t)
      ts.emplace_back(read_part, n * t / threads, n * (t + 1) / threads, &out[t]);
    read_part(0, n / threads, &out[0]);
    for (auto& th : ts) th.join();
    for (auto o : out) sink = sink + o;
  });
  cache[threads - 1] = double(n * sizeof(std::uint64_t)) / s * 1e-9;
  return cache[threads - 1];
}

}  // namespace tdbench
