#pragma once
// The q/kv projection at real shapes, for the kernel tests (test_layer) and the rounding-accuracy
// tests (test_rounding): synthetic weights at the layer's statistics, positions spread over the
// canonical starts, and one call of kernels::qkv_projection on a CPU context.
#include <cstdint>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdtest {

namespace td = tiledecode;
using td::bf16;
using td::index_t;

struct QkvFixture {
  td::ModelConfig cfg;
  index_t T;
  td::Tensor<bf16, 2> x_n, wq_a, wkv;
  td::Tensor<bf16, 1> gamma_cq, gamma_ckv;
  td::Tensor<std::int8_t, 2> wq_b;
  td::Tensor<float, 1> wq_b_scale;
  td::Tensor<std::int32_t, 1> pos;
  td::RopeTable rope;
  QkvFixture(const td::ModelConfig& c, index_t t, std::uint64_t seed)
      : cfg(c),
        T(t),
        x_n({T, c.hidden}),
        wq_a({c.hidden, c.q_lora}),
        wkv({c.hidden, c.head_dim}),
        gamma_cq({c.q_lora}),
        gamma_ckv({c.head_dim}),
        wq_b({c.q_lora, index_t(c.n_heads) * c.head_dim}),
        wq_b_scale({index_t(c.n_heads) * c.head_dim}),
        pos({T}),
        rope(td::make_rope_table(c, td::LayerKind::csa, 8200)) {
    // Counter-based synthetic fills (fast, parallel-safe) at the weight statistics of the layer.
    namespace sy = td::decode::synthetic;
    const td::cpu::Context ctx{};
    sy::fill_normal(ctx, x_n.flat(), sy::tensor_key(seed, 0, 1), 0.0f, 1.0f);
    sy::fill_normal(ctx, wq_a.flat(), sy::tensor_key(seed, 0, 2), 0.0f, 1.0f / 64.0f);
    sy::fill_normal(ctx, wkv.flat(), sy::tensor_key(seed, 0, 3), 0.0f, 1.0f / 64.0f);
    sy::fill_normal(ctx, gamma_cq.flat(), sy::tensor_key(seed, 0, 4), 1.0f, 0.2f);
    sy::fill_normal(ctx, gamma_ckv.flat(), sy::tensor_key(seed, 0, 5), 1.0f, 0.2f);
    sy::fill_int8(ctx, wq_b.flat(), sy::tensor_key(seed, 0, 6));
    sy::fill_scale(ctx, wq_b_scale.flat(), sy::tensor_key(seed, 0, 7), 2e-4f);
    const std::int32_t starts[4] = {8192, 0, 2, 3};
    for (index_t i = 0; i < T; ++i) pos.data()[i] = starts[(i / 2) % 4] + std::int32_t(i % 2);
  }
  td::QkvWeights weights() const {
    return {wq_a.view(),       gamma_cq.view(), wq_b.view(),
            wq_b_scale.view(), wkv.view(),      gamma_ckv.view()};
  }
};

struct QkvOut {
  td::Tensor<bf16, 3> q;
  td::Tensor<bf16, 2> kv;
  td::Tensor<std::int8_t, 2> qr;
  td::Tensor<float, 1> qr_scale;
  QkvOut(const td::ModelConfig& c, index_t T)
      : q({T, c.n_heads, c.head_dim}), kv({T, c.head_dim}), qr({T, c.q_lora}), qr_scale({T}) {}
};

// Tokens [t0, t1) of the fixture (t1 < 0: to the end) into the same rows of o, in one call:
// `packed`, `bf16_rows` and `wq_a_norm` are the optional load-time preparations of QkvWeights.
inline void run_qkv(const QkvFixture& f, QkvOut& o, const td::cpu::Context& ctx,
                    const td::QkvPackedWqB* packed = nullptr,
                    const td::QkvBf16Rows* bf16_rows = nullptr, index_t t0 = 0, index_t t1 = -1,
                    td::ConstView<float, 1> wq_a_norm = {}, td::ConstView<float, 1> wkv_norm = {}) {
  const auto& c = f.cfg;
  if (t1 < 0) t1 = f.T;
  const index_t n = t1 - t0;
  td::Tensor<float, 2> x({n, c.hidden}), cq({n, c.q_lora}), kvf({n, c.head_dim});
  td::Tensor<std::int32_t, 2> pairs({n, c.q_lora / 2});
  td::QkvWeights w = f.weights();
  w.wq_b_packed = packed;
  w.bf16_rows = bf16_rows;
  w.wq_a_norm = wq_a_norm;
  w.wkv_norm = wkv_norm;
  td::kernels::qkv_projection(
      ctx, o.q.view().slice(0, t0, t1), o.kv.view().slice(0, t0, t1), o.qr.view().slice(0, t0, t1),
      o.qr_scale.view().slice(0, t0, t1), td::ConstView<bf16, 2>(f.x_n.view()).slice(0, t0, t1), w,
      f.rope.view(), td::ConstView<std::int32_t, 1>(f.pos.view()).slice(0, t0, t1),
      {x.view(), cq.view(), kvf.view(), pairs.view()}, c);
}

}  // namespace tdtest
