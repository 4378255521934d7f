#pragma once
// Golden hyper-connections (formulas in kernels/hyper_connection.hpp), plain loops in double.
//   hc_pre:  r = 1/sqrt(mean(x²)+eps); mix = (fn·x)·r; pre/post sigmoid gates; comb = Sinkhorn
//            (softmax over o + eps, columns, then 19 × rows+columns); x_mixed = bf16(Σ pre_i x_i)
//   hc_post: y[t,o,:] = a[t,:]·post[t,o] + Σ_i x_hc[t,i,:]·comb[t,i,o]

#include <cmath>
#include <cstdint>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/hyper_connection.hpp"

namespace tiledecode::golden {

inline void hc_pre(View<bf16, 2> x_mixed, View<float, 2> post, View<float, 3> comb,
                   ConstView<float, 3> x_hc, const HcWeights& w, const ModelConfig& cfg) {
  const index_t T = x_hc.extent(0), D = cfg.hidden, S = kHcStreams;
  check_equal<index_t>("golden::hc_pre", "x_hc.extent(2)", x_hc.extent(2), D);
  check_equal<index_t>("golden::hc_pre", "weights.fn.extent(1)", w.fn.extent(1), S * D);
  const double eps = kHcEps;
  for (index_t t = 0; t < T; ++t) {
    double ss = 0;
    for (index_t i = 0; i < S; ++i)
      for (index_t k = 0; k < D; ++k) ss += double(x_hc(t, i, k)) * x_hc(t, i, k);
    const double r = 1.0 / std::sqrt(ss / double(S * D) + double(cfg.rms_eps));
    double mix[kHcMixes];
    for (int j = 0; j < kHcMixes; ++j) {
      double d = 0;
      for (index_t i = 0; i < S; ++i)
        for (index_t k = 0; k < D; ++k) d += double(w.fn(j, i * D + k)) * x_hc(t, i, k);
      mix[j] = d * r;
    }
    const auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
    double pre[4], c[4][4];
    for (int i = 0; i < 4; ++i) {
      pre[i] = sigmoid(mix[i] * w.scale(0) + w.base(i)) + eps;
      post(t, i) = float(2.0 * sigmoid(mix[4 + i] * w.scale(1) + w.base(4 + i)));
    }
    for (int i = 0; i < 4; ++i) {
      double m = -INFINITY, sum = 0;
      for (int o = 0; o < 4; ++o) {
        c[i][o] = mix[8 + 4 * i + o] * w.scale(2) + w.base(8 + 4 * i + o);
        m = std::max(m, c[i][o]);
      }
      for (int o = 0; o < 4; ++o) sum += (c[i][o] = std::exp(c[i][o] - m));
      for (int o = 0; o < 4; ++o) c[i][o] = c[i][o] / sum + eps;
    }
    for (int it = 0; it < kHcSinkhornIters; ++it) {
      if (it > 0) {
        for (int i = 0; i < 4; ++i) {
          const double s = c[i][0] + c[i][1] + c[i][2] + c[i][3];
          for (int o = 0; o < 4; ++o) c[i][o] /= (s + eps);
        }
      }
      for (int o = 0; o < 4; ++o) {
        const double s = c[0][o] + c[1][o] + c[2][o] + c[3][o];
        for (int i = 0; i < 4; ++i) c[i][o] /= (s + eps);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int o = 0; o < 4; ++o) comb(t, i, o) = float(c[i][o]);
    for (index_t k = 0; k < D; ++k) {
      double v = 0;
      for (index_t i = 0; i < S; ++i) v += pre[i] * x_hc(t, i, k);
      x_mixed(t, k) = bf16(float(v));
    }
  }
}

inline void hc_post(View<float, 3> y, ConstView<bf16, 2> attn_out, ConstView<float, 3> x_hc,
                    ConstView<float, 2> post, ConstView<float, 3> comb, const ModelConfig& cfg) {
  const index_t T = x_hc.extent(0), D = cfg.hidden;
  check_equal<index_t>("golden::hc_post", "attn_out.extent(1)", attn_out.extent(1), D);
  for (index_t t = 0; t < T; ++t)
    for (index_t o = 0; o < kHcStreams; ++o)
      for (index_t k = 0; k < D; ++k) {
        double v = double(attn_out(t, k).to_float()) * post(t, o);
        for (index_t i = 0; i < kHcStreams; ++i) v += double(x_hc(t, i, k)) * comb(t, i, o);
        y(t, o, k) = float(v);
      }
}

}  // namespace tiledecode::golden
