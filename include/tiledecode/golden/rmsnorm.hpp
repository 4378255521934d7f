#pragma once
// Golden attention RMSNorm (spec §4 step 2): x_n = bf16(x · 1/sqrt(mean(x²) + eps) · w), double.

#include <cmath>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::golden {

inline void rmsnorm(View<bf16, 2> x_n, ConstView<bf16, 2> x, ConstView<bf16, 1> w, float eps) {
  const index_t T = x.extent(0), D = x.extent(1);
  check_equal<index_t>("golden::rmsnorm", "w.extent(0)", w.extent(0), D);
  for (index_t t = 0; t < T; ++t) {
    double ss = 0;
    for (index_t i = 0; i < D; ++i) ss += double(x(t, i).to_float()) * x(t, i).to_float();
    const double r = 1.0 / std::sqrt(ss / double(D) + double(eps));
    for (index_t i = 0; i < D; ++i)
      x_n(t, i) = bf16(float(double(x(t, i).to_float()) * r * w(i).to_float()));
  }
}

}  // namespace tiledecode::golden
