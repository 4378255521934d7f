#pragma once
// Seeded generators for test and benchmark fixtures. std::mt19937_64 with explicit
// distributions written here (the standard distributions are implementation-defined, so a seed
// would not give the same data on every standard library).

#include <cmath>
#include <cstdint>
#include <random>
#include <span>

#include "tiledecode/core/bf16.hpp"

namespace tdtest {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : g_(seed) {}
  // Uniform in [0, 1) with 24 random bits.
  float uniform() { return float(g_() >> 40) * (1.0f / 16777216.0f); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box–Muller).
  float normal() {
    const double u1 = (double(g_() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    const double u2 = double(g_() >> 11) * (1.0 / 9007199254740992.0);
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {  // inclusive
    return lo + std::int64_t(g_() % std::uint64_t(hi - lo + 1));
  }
  std::int8_t int8() { return std::int8_t(integer(-127, 127)); }

  void fill_uniform(std::span<float> v, float lo, float hi) {
    for (auto& x : v) x = uniform(lo, hi);
  }
  void fill_normal(std::span<float> v, float stddev = 1.0f) {
    for (auto& x : v) x = normal() * stddev;
  }
  void fill_uniform(std::span<tiledecode::bf16> v, float lo, float hi) {
    for (auto& x : v) x = tiledecode::bf16(uniform(lo, hi));
  }
  void fill_normal(std::span<tiledecode::bf16> v, float stddev = 1.0f) {
    for (auto& x : v) x = tiledecode::bf16(normal() * stddev);
  }
  void fill_int8(std::span<std::int8_t> v) {
    for (auto& x : v) x = int8();
  }

 private:
  std::mt19937_64 g_;
};

}  // namespace tdtest
