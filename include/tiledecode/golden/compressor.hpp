#pragma once
// Golden compressors (spec §6), plain loops in double written from the formulas, with the same
// argument order as kernels/compressor.hpp (minus the context and the workspace):
//   kv_t = x_n[t] @ wkv^T ; g_t = x_n[t] @ wgate^T + ape[pos_t % R]         (double dot → FP32)
//   per request b in order: state rows of all its tokens, then each committed boundary:
//     pooled[d] = Σ_j exp(g_j[d] - m) kv_j[d] / Σ_j exp(g_j[d] - m), m = max_j g_j[d] (IEEE:
//       a NaN or +Inf score, or a NaN kv, gives NaN; every score -Inf gives 0/0 = NaN)
//       candidates read through the state table by absolute position (unmapped → kv 0,
//       score kNegBig); ratio 4: previous window's front halves (absent for c = 0) and the
//       current window's back halves; ratio 128: the 128 positions of the window
//     y = pooled / sqrt(mean(pooled²) + eps) * norm_w ; rope_fwd(y[last 64], rope position)
//     main: cmp_kv[slot] = bf16(y) ; inner: Q8(bf16(bf16(y) @ H)) → idx cache + scale
//     kv_out[b] = y (FP32)
// Every element access is bounds-checked (View::at), so bad metadata throws instead of
// corrupting memory; it does not re-implement the kernel's up-front validation.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/golden/rope.hpp"
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::golden {

using kernels::CompressorMetadata;
using kernels::CompressorSpec;
using kernels::CompressorWeights;
using kernels::InnerRopePosition;

namespace detail {

// Runs the compressor; `store(slot, y)` writes one emitted FP32 row y (head_dim).
template <class Store>
void compressor(const ModelConfig& cfg, const CompressorSpec& spec, View<float, 2> state_pool,
                View<float, 2> kv_out, ConstView<bf16, 2> x_n, const CompressorWeights& w,
                const CompressorMetadata& meta, const RopeTableView& rope,
                InnerRopePosition rope_rule, Store&& store) {
  const long B = meta.shape.batch, S = meta.shape.seq, T = B * S;
  const long D = cfg.hidden, R = spec.ratio, HD = spec.head_dim;
  const long OUT = spec.overlap ? 2 * HD : HD;
  const long page = R == 4 ? cfg.c4_state_page : cfg.c128_state_page;

  // Projections.
  std::vector<float> kv(static_cast<std::size_t>(T * OUT)), g(static_cast<std::size_t>(T * OUT));
  // The corners are bounds-checked once; the dot products then index inside them.
  (void)x_n.at(T - 1, D - 1);
  (void)w.wkv.at(OUT - 1, D - 1);
  (void)w.wgate.at(OUT - 1, D - 1);
  for (long t = 0; t < T; ++t) {
    const long pos = meta.positions.at(t);
    for (long o = 0; o < OUT; ++o) {
      double a = 0, b = 0;
      for (long k = 0; k < D; ++k) {
        const double x = x_n(t, k).to_float();
        a += x * double(w.wkv(o, k).to_float());
        b += x * double(w.wgate(o, k).to_float());
      }
      kv[t * OUT + o] = float(a);
      g[t * OUT + o] = float(b) + w.ape.at(pos % R, o);
    }
  }

  // State value (kv or score) of absolute position p, column col, of request b.
  const long cols = meta.state_table.extent(1);
  auto state = [&](long b, long p, long col, bool is_score) -> double {
    const long tc = p / page;
    const long blk = tc < cols ? long(meta.state_table.at(b, tc)) : -1;
    if (blk < 0) return is_score ? double(kNegBig) : 0.0;
    return state_pool.at(blk * page + p % page, col);
  };

  for (long b = 0; b < B; ++b) {
    for (long s = 0; s < S; ++s) {
      const long t = b * S + s, slot = meta.state_slot_mapping.at(t);
      if (slot < 0) continue;
      for (long o = 0; o < OUT; ++o) {
        state_pool.at(slot, o) = kv[t * OUT + o];
        state_pool.at(slot, OUT + o) = g[t * OUT + o];
      }
    }
    for (long s = 0; s < S; ++s) {
      const long t = b * S + s, slot = meta.cmp_slot_mapping.at(t);
      if (slot < 0) continue;
      const long c = meta.positions.at(t) / R;
      std::vector<double> pooled(static_cast<std::size_t>(HD));
      for (long d = 0; d < HD; ++d) {
        std::vector<double> sc, v;
        if (spec.overlap) {
          if (c > 0) {
            for (long p = (c - 1) * R; p < c * R; ++p) {
              v.push_back(state(b, p, d, false));
              sc.push_back(state(b, p, OUT + d, true));
            }
          }
          for (long p = c * R; p < (c + 1) * R; ++p) {
            v.push_back(state(b, p, HD + d, false));
            sc.push_back(state(b, p, OUT + HD + d, true));
          }
        } else {
          for (long p = c * R; p < (c + 1) * R; ++p) {
            v.push_back(state(b, p, d, false));
            sc.push_back(state(b, p, OUT + d, true));
          }
        }
        const double m = *std::max_element(sc.begin(), sc.end());
        double num = 0, den = 0;
        for (std::size_t j = 0; j < sc.size(); ++j) {
          const double e = std::exp(sc[j] - m);
          num += e * v[j];
          den += e;
        }
        pooled[d] = num / den;
      }
      double ms = 0;
      for (double p : pooled) ms += p * p;
      ms /= double(HD);
      const double inv = 1.0 / std::sqrt(ms + double(cfg.rms_eps));
      std::vector<double> y(static_cast<std::size_t>(HD));
      for (long i = 0; i < HD; ++i) y[i] = pooled[i] * inv * double(w.norm_w.at(i).to_float());
      const long rope_pos =
          rope_rule == InnerRopePosition::request_start ? long(meta.positions.at(b * S)) : c * R;
      (void)rope.cos.at(rope_pos, 0);  // bounds check of the table row
      rope_forward(std::span<double>(y.data() + HD - cfg.rope_dim, std::size_t(cfg.rope_dim)),
                   rope.cos_row(rope_pos), rope.sin_row(rope_pos));
      std::vector<float> yf(static_cast<std::size_t>(HD));
      for (long i = 0; i < HD; ++i) yf[i] = float(y[i]);
      store(slot, yf);
      if (kv_out.data() != nullptr && kv_out.size() > 0) {
        for (long i = 0; i < HD; ++i) kv_out.at(b, i) = yf[i];
      }
    }
  }
}

}  // namespace detail

// Golden main compressor (CSA ratio 4 overlapping or HCA ratio 128); see kernels::compressor_step.
inline void compressor_step(const ModelConfig& cfg, const CompressorSpec& spec,
                            View<float, 2> state_pool, View<bf16, 2> cmp_kv, View<float, 2> kv_out,
                            ConstView<bf16, 2> x_n, const CompressorWeights& w,
                            const CompressorMetadata& meta, const RopeTableView& rope) {
  detail::compressor(cfg, spec, state_pool, kv_out, x_n, w, meta, rope,
                     InnerRopePosition::window_start, [&](long slot, const std::vector<float>& y) {
                       for (long i = 0; i < long(y.size()); ++i) cmp_kv.at(slot, i) = bf16(y[i]);
                     });
}

// Golden indexer inner compressor; see kernels::indexer_compressor_step.
inline void indexer_compressor_step(const ModelConfig& cfg, View<float, 2> state_pool,
                                    View<std::int8_t, 2> idx_kv_cache, View<float, 1> idx_kv_scale,
                                    View<float, 2> kv_out, ConstView<bf16, 2> x_n,
                                    const CompressorWeights& w, ConstView<bf16, 2> hadamard,
                                    const CompressorMetadata& meta, const RopeTableView& rope,
                                    InnerRopePosition rope_rule = InnerRopePosition::window_start) {
  const CompressorSpec spec = kernels::indexer_compressor_spec(cfg);
  detail::compressor(cfg, spec, state_pool, kv_out, x_n, w, meta, rope, rope_rule,
                     [&](long slot, const std::vector<float>& y) {
                       const long n = long(y.size());
                       std::vector<float> z(static_cast<std::size_t>(n));
                       for (long j = 0; j < n; ++j) {
                         double a = 0;
                         for (long i = 0; i < n; ++i) {
                           a += double(round_bf16(y[i])) * double(hadamard.at(i, j).to_float());
                         }
                         z[j] = round_bf16(float(a));
                       }
                       // Q8 (spec §2, core/quant.hpp, whose header states the NaN / Inf rule):
                       // amax floor 1e-4, sq = 127/amax, q = round-half-even(z*sq), dq = 1/sq.
                       std::vector<std::int8_t> q(static_cast<std::size_t>(n));
                       idx_kv_scale.at(slot) = quantize_q8(q, z);
                       for (long j = 0; j < n; ++j) idx_kv_cache.at(slot, j) = q[std::size_t(j)];
                     });
}

}  // namespace tiledecode::golden
