#pragma once
// Attention RMSNorm (spec §4 step 2):
//   x_n[t, :] = bf16( x[t, :] * r_t * w )   with r_t = 1 / sqrt(mean(x[t, :]^2) + eps)
// x and w are BF16; the sum of squares (sequential), r_t and the products run in double and the
// result is rounded to BF16 via FP32. Double costs nothing here (D values per token) and keeps x_n
// on the reference's side of every BF16 rounding boundary (see kernels/hyper_connection.hpp for why
// that matters downstream). eps = cfg.rms_eps (1e-6). One task per token row. Also the in-place
// RMSNorm with weight used inside qkv_projection (`rmsnorm_row_f64`).

#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::kernels {

// Σ x[i]^2 of n FP32 values in double, sequential (n <= a few thousand: the order is fixed so
// the fast path and the golden twin produce the same bits).
inline double sum_squares_f64(const float* x, std::int64_t n, cpu::Isa /*isa*/) {
  double ss = 0.0;
  for (std::int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  return ss;
}

// x[i] ← float(x[i] * r * w[i]) with r = 1/sqrt(mean(x^2) + eps), in double, over n FP32 values.
inline void rmsnorm_row_f64(float* x, const bf16* w, std::int64_t n, float eps, cpu::Isa isa) {
  const double r = 1.0 / std::sqrt(sum_squares_f64(x, n, isa) / double(n) + double(eps));
  for (std::int64_t i = 0; i < n; ++i) x[i] = float(double(x[i]) * r * double(w[i].to_float()));
}

// x_n (T, D) BF16 ← x (T, D) BF16, weight w (D) BF16. Rows contiguous; x_n may alias x.
inline void rmsnorm(const cpu::Context& ctx, View<bf16, 2> x_n, ConstView<bf16, 2> x,
                    ConstView<bf16, 1> w, float eps) {
  constexpr std::string_view where = "rmsnorm";
  const index_t T = x.extent(0), D = x.extent(1);
  check_at_least<index_t>(where, "x.extent(1)", D, 1);
  check_equal<index_t>(where, "x_n.extent(0)", x_n.extent(0), T);
  check_equal<index_t>(where, "x_n.extent(1)", x_n.extent(1), D);
  check_equal<index_t>(where, "w.extent(0)", w.extent(0), D);
  check_equal<index_t>(where, "x.stride(1)", x.stride(1), 1);
  check_equal<index_t>(where, "x_n.stride(1)", x_n.stride(1), 1);
  check_equal<index_t>(where, "w.stride(0)", w.stride(0), 1);
  if (!(eps > 0.0f)) throw_arg(where, "eps", eps, "> 0");
  ctx.parallel_for(0, T, 1, [&](std::int64_t t) {
    const bf16* xr = x.data() + t * x.stride(0);
    bf16* dst = x_n.data() + t * x_n.stride(0);
    double ss = 0.0;
    for (index_t i = 0; i < D; ++i) ss += double(xr[i].to_float()) * double(xr[i].to_float());
    const double r = 1.0 / std::sqrt(ss / double(D) + double(eps));
    for (index_t i = 0; i < D; ++i)
      dst[i] = bf16(float(double(xr[i].to_float()) * r * double(w(i).to_float())));
  });
}

}  // namespace tiledecode::kernels
