#pragma once
// Attention RMSNorm (kernels/rmsnorm.hpp) on the CPU backend, and the double-precision row
// RMSNorm helpers the q/kv projection shares. The sum of squares (sequential), r_t and the
// products run in double and the result is rounded to BF16 via FP32: double costs nothing here
// (D values per token) and keeps x_n on the reference's side of every BF16 rounding boundary (see
// backend/cpu/hyper_connection.hpp for why that matters downstream). One task per token row; the
// tiers share the code (the order is fixed, so every tier gives the same bits).

#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/rmsnorm.hpp"

namespace tiledecode::kernels {

// Σ x[i]^2 of n FP32 values in double, sequential (n <= a few thousand: the order is fixed so
// the fast path and the golden twin produce the same bits).
inline double sum_squares_f64(const float* x, std::int64_t n, cpu::Isa /*isa*/) {
  double ss = 0.0;
  for (std::int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  return ss;
}

// x[i] ← float(x[i] * r * w[i]) with r = 1/sqrt(mean(x^2) + eps), in double, over n FP32 values;
// returns r (the q-latent's rounding check repairs values with it).
inline double rmsnorm_row_f64(float* x, const bf16* w, std::int64_t n, float eps, cpu::Isa isa) {
  const double r = 1.0 / std::sqrt(sum_squares_f64(x, n, isa) / double(n) + double(eps));
  for (std::int64_t i = 0; i < n; ++i) x[i] = float(double(x[i]) * r * double(w[i].to_float()));
  return r;
}

}  // namespace tiledecode::kernels

namespace tiledecode::cpu {

template <Isa I>
struct backend_ops_rmsnorm {
  struct Lane {};
  template <class Body>
  static void for_rows(const Cpu<I>& be, const kernels::RmsNormArgs& a, Body&& body) {
    be.tasks(a.tokens(), [&](std::int64_t t) {
      Lane lane;
      body(lane, t);
    });
  }
  static void rms_norm_row(Lane&, const kernels::RmsNormArgs& a, index_t t) {
    const index_t D = a.x.extent(1);
    const bf16* xr = a.x.data() + t * a.x.stride(0);
    bf16* dst = a.x_n.data() + t * a.x_n.stride(0);
    double ss = 0.0;
    for (index_t i = 0; i < D; ++i) ss += double(xr[i].to_float()) * double(xr[i].to_float());
    const double r = 1.0 / std::sqrt(ss / double(D) + double(a.eps));
    for (index_t i = 0; i < D; ++i)
      dst[i] = bf16(float(double(xr[i].to_float()) * r * double(a.w(i).to_float())));
  }
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::RmsNorm, cpu::Cpu<I>> : cpu::backend_ops_rmsnorm<I> {};
}  // namespace tiledecode
