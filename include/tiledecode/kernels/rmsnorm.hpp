#pragma once
// Attention RMSNorm (spec §4 step 2) — contract and tile program:
//   x_n[t, :] = bf16( x[t, :] * r_t * w )   with r_t = 1 / sqrt(mean(x[t, :]^2) + eps)
// x and w are BF16; eps = cfg.rms_eps (1e-6). The program is one op per token row
// (tile: rms_norm_row); the CPU computes it in double (backend/cpu/rmsnorm.hpp: it keeps x_n on
// the reference's side of every BF16 rounding boundary), the a2a3 vector unit in FP32.

#include <cstdint>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::kernels {

struct RmsNorm {
  static constexpr std::string_view kernel_name = "rms_norm";
};

struct RmsNormArgs {
  View<bf16, 2> x_n;     // (T, D) output (may alias x)
  ConstView<bf16, 2> x;  // (T, D)
  ConstView<bf16, 1> w;  // (D)
  float eps = 1e-6f;
  index_t tokens() const { return x.extent(0); }
};

inline void validate(const RmsNormArgs& a) {
  constexpr std::string_view where = "rmsnorm";
  check_view(where, "x", a.x);
  const index_t T = a.x.extent(0), D = a.x.extent(1);
  check_at_least<index_t>(where, "x.extent(1)", D, 1);
  check_inner_stride(where, "x", a.x);
  check_rows(where, "x_n", a.x_n, {T, D});
  check_extents(where, "w", a.w, {D});
  check_inner_stride(where, "w", a.w);
  if (!(a.eps > 0.0f)) throw_arg(where, "eps", a.eps, "> 0");
}

template <class B>
void rmsnorm_program(const B& be, const RmsNormArgs& a) {
  using Ops = ops_for<RmsNorm, B>;
  Ops::for_rows(be, a, [&](auto& lane, index_t t) { Ops::rms_norm_row(lane, a, t); });
}

// x_n (T, D) BF16 ← x (T, D) BF16, weight w (D) BF16, on backend `be`. Rows contiguous; x_n may
// alias x. Throws tiledecode::Error before writing anything on a bad argument.
template <class Be>
void rmsnorm(const Be& be, View<bf16, 2> x_n, ConstView<bf16, 2> x, ConstView<bf16, 1> w,
             float eps) {
  const RmsNormArgs a{x_n, x, w, eps};
  dispatch(be, [&](const auto& b) {
    validate(a);
    if (a.tokens() == 0) return;
    b.kernel(RmsNorm::kernel_name, [&] { rmsnorm_program(b, a); });
  });
}

}  // namespace tiledecode::kernels
