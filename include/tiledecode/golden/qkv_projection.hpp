#pragma once
// Golden q/kv projection (spec §4 step 3), written from the formulas with plain loops: the BF16
// matmuls accumulate in double (at least the spec's FP32 accumulation; the nearest to the exact
// dot, against which the fast path's rounding accuracy is measured), the INT8 one in int64, every
// RMSNorm, dequant and rotation in double; cq is stored as FP32, q and kv are rounded to BF16 via
// FP32.
//   cq  = float(rmsnorm(x_n @ wq_a) * gamma_cq) ; qr, qr_scale = Q8(cq)
//   qf  = (qr @ wq_b) * qr_scale * wq_b_scale ; per-head RMSNorm (no weight)
//   q   = bf16([qf[:448], rope_fwd(qf[448:], pos_t)])
//   kv  = bf16([kvf[:448], rope_fwd(kvf[448:], pos_t)]),  kvf = rmsnorm(x_n @ wkv) * gamma_ckv

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::golden {

namespace detail {
// Forward interleaved rotation in double with the BF16 table row of `pos` (spec §5).
inline void rope_forward_d(double* x, const RopeTableView& rope, index_t pos, index_t rd) {
  for (index_t i = 0; i < rd / 2; ++i) {
    const double c = rope.cos(pos, i).to_float(), s = rope.sin(pos, i).to_float();
    const double e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * s;
    x[2 * i + 1] = e * s + o * c;
  }
}
}  // namespace detail

inline void qkv_projection(View<bf16, 3> q, View<bf16, 2> kv, View<std::int8_t, 2> qr,
                           View<float, 1> qr_scale, ConstView<bf16, 2> x_n, const QkvWeights& w,
                           RopeTableView rope, ConstView<std::int32_t, 1> position_ids,
                           const ModelConfig& cfg) {
  const index_t T = x_n.extent(0), D = cfg.hidden, QL = cfg.q_lora, H = cfg.n_heads;
  const index_t HD = cfg.head_dim, NOPE = cfg.nope_dim(), RD = cfg.rope_dim;
  check_equal<index_t>("golden::qkv_projection", "x_n.extent(1)", x_n.extent(1), D);
  check_equal<index_t>("golden::qkv_projection", "w.wq_b.extent(1)", w.wq_b.extent(1), H * HD);
  const double eps = cfg.rms_eps;
  std::vector<double> acc(static_cast<std::size_t>(std::max(QL, H * HD)));
  std::vector<std::int64_t> iacc(static_cast<std::size_t>(H * HD));
  std::vector<float> cq(static_cast<std::size_t>(QL));
  for (index_t t = 0; t < T; ++t) {
    const index_t pos = position_ids(t);
    check_range<index_t>("golden::qkv_projection", "position_ids[t]", pos, 0, rope.length());
    // cq
    std::vector<double> facc(static_cast<std::size_t>(QL), 0.0);
    for (index_t k = 0; k < D; ++k) {
      const double a = x_n(t, k).to_float();
      for (index_t n = 0; n < QL; ++n) facc[n] += a * double(w.wq_a(k, n).to_float());
    }
    double ss = 0;
    for (index_t n = 0; n < QL; ++n) ss += facc[n] * facc[n];
    double r = 1.0 / std::sqrt(ss / double(QL) + eps);
    for (index_t n = 0; n < QL; ++n) cq[n] = float(facc[n] * r * w.gamma_cq(n).to_float());
    std::int8_t* qrt = &qr(t, 0);
    qr_scale(t) = quantize_q8(std::span<std::int8_t>(qrt, std::size_t(QL)), cq);
    // q
    std::fill(iacc.begin(), iacc.end(), 0);
    for (index_t k = 0; k < QL; ++k) {
      const std::int64_t a = qr(t, k);
      for (index_t n = 0; n < H * HD; ++n) iacc[n] += a * w.wq_b(k, n);
    }
    for (index_t h = 0; h < H; ++h) {
      double* qf = acc.data();
      double s2 = 0;
      for (index_t n = 0; n < HD; ++n) {
        qf[n] = double(iacc[h * HD + n]) * double(qr_scale(t)) * double(w.wq_b_scale(h * HD + n));
        s2 += qf[n] * qf[n];
      }
      const double rq = 1.0 / std::sqrt(s2 / double(HD) + eps);
      for (index_t n = 0; n < HD; ++n) qf[n] *= rq;
      detail::rope_forward_d(qf + NOPE, rope, pos, RD);
      for (index_t n = 0; n < HD; ++n) q(t, h, n) = bf16(float(qf[n]));
    }
    // kv
    std::vector<double> kacc(static_cast<std::size_t>(HD), 0.0);
    for (index_t k = 0; k < D; ++k) {
      const double a = x_n(t, k).to_float();
      for (index_t n = 0; n < HD; ++n) kacc[n] += a * double(w.wkv(k, n).to_float());
    }
    ss = 0;
    for (index_t n = 0; n < HD; ++n) ss += kacc[n] * kacc[n];
    r = 1.0 / std::sqrt(ss / double(HD) + eps);
    for (index_t n = 0; n < HD; ++n) acc[n] = kacc[n] * r * w.gamma_ckv(n).to_float();
    detail::rope_forward_d(acc.data() + NOPE, rope, pos, RD);
    for (index_t n = 0; n < HD; ++n) kv(t, n) = bf16(float(acc[n]));
  }
}

}  // namespace tiledecode::golden
