#pragma once
// Attention RMSNorm (kernels/rmsnorm.hpp) on the a2a3 model: one vector block per token row —
// BF16 -> FP32, x², row sum, r = 1 / sqrt(Σ/D + eps), x·r·w, BF16 (FP32 arithmetic throughout).

#include <string>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/a2a3/tile_ops.hpp"
#include "tiledecode/kernels/rmsnorm.hpp"

namespace tiledecode::a2a3 {

struct backend_ops_rmsnorm {
  using Lane = VectorBlock;
  template <class Body>
  static void for_rows(const A2a3& be, const kernels::RmsNormArgs& a, Body&& body) {
    be.m->launch_vector("rms_norm", int(a.tokens()),
                        [&](VectorBlock& blk) { body(blk, index_t(blk.index)); });
  }
  static void rms_norm_row(VectorBlock& blk, const kernels::RmsNormArgs& a, index_t t) {
    VectorCore& v = blk.vec;
    const index_t D = a.x.extent(1);
    auto xb = v.alloc<bf16>(Space::ub, "x", 1, D);
    auto wb = v.alloc<bf16>(Space::ub, "w", 1, D);
    auto x = v.alloc<float>(Space::ub, "x_f32", 1, D);
    auto w = v.alloc<float>(Space::ub, "w_f32", 1, D);
    auto sq = v.alloc<float>(Space::ub, "x2", 1, D);
    auto r = v.alloc<float>(Space::ub, "r", 1, 1);
    v.copy_in(xb, 0, a.x.slice(0, t, t + 1), "x_in");
    v.copy_in(wb, 0, ConstView<bf16, 2>(a.w.data(), {1, D}), "w_in");
    v.vcast(Sub<float>(x), Sub<bf16>(xb), "cast_x");
    v.vcast(Sub<float>(w), Sub<bf16>(wb), "cast_w");
    a2a3::rms_scale(v, r, x, sq, a.eps);
    v.vmul_rows(x, x, r, "mul_r");
    v.vmul(x, x, w, "mul_w");
    v.vcast(Sub<bf16>(xb), Sub<float>(x), "cast_bf16");
    v.copy_out(a.x_n.slice(0, t, t + 1), xb, 0, "x_n_out");
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::RmsNorm, a2a3::A2a3> : a2a3::backend_ops_rmsnorm {};
}  // namespace tiledecode
