#pragma once
// Hyper-connections around one attention layer (spec §4 steps 1 and 5).
//
// The residual stream of DeepSeek-V4 is `hc_mult` = 4 parallel copies ("streams") of the hidden
// state, x_hc [T, 4, D] FP32. The spec only sketches hc_pre ("RMS-scaled linear mix, sigmoid
// gates, Sinkhorn-normalised 4×4 combine, 20 iterations, eps 1e-6"); this library fixes it as
// follows, after the DeepSeek-V4 manifold-constrained hyper-connection formulation:
//
// Weights per layer (`HcWeights`), all FP32:
//   fn    [(2+4)*4, 4*D] = [24, 16384] (flash)  rows 0..3 → pre, 4..7 → post, 8..23 → comb (i*4+o)
//   scale [3]                                    one scale for the pre, post and comb groups
//   base  [24]                                   per-mix bias, same row order as fn
//
// hc_pre, per token t (x = x_hc[t] flattened to 4*D, stream-major):
//   r          = 1 / sqrt(mean_k(x_k^2) + eps)                 eps = cfg.rms_eps (1e-6)
//   mix[j]     = (fn[j] · x) * r                                j < 24 (RMS-scaled linear mix)
//   pre[i]     = sigmoid(mix[i] * scale[0] + base[i]) + eps     i < 4
//   post[i]    = 2 * sigmoid(mix[4+i] * scale[1] + base[4+i])   i < 4 (output gate in (0, 2))
//   c[i][o]    = mix[8+4i+o] * scale[2] + base[8+4i+o]
//   Sinkhorn, 20 iterations (kHcSinkhornIters), eps = kHcEps = 1e-6:
//     iteration 1:  c = softmax_o(c) + eps ; c[i][o] /= (Σ_i c[i][o] + eps)      (rows, then
//     columns) iterations 2..20: c[i][o] /= (Σ_o c[i][o] + eps) ; c[i][o] /= (Σ_i c[i][o] + eps)
//   so the last normalisation is over the input index i: every output stream o receives a convex
//   combination of the input streams (Σ_i comb[i][o] ≈ 1).
//   x_mixed[t] = bf16( Σ_i pre[i] * x_hc[t, i, :] )             (i ascending, FP32)
//   comb[t] = c (FP32 [4,4], index [i][o]), post[t] = post (FP32 [4]).
// hc_post (spec §4 step 5), FP32, no rounding:
//   y[t, o, :] = attn_out[t, :] * post[t, o] + Σ_i x_hc[t, i, :] * comb[t, i, o]   (i ascending)
//
// Numerical contract: hc_pre runs in double — the mix dot products (FP32 × FP32 products are
// exact in double; AVX2: 8 lanes then a fixed horizontal sum, scalar: sequential), the RMS
// scale, the gates, the Sinkhorn iterations and the mix-in sum — and rounds to BF16 via FP32 at
// the end. It costs nothing at decode sizes (24 × 4D multiply-adds per token) and it matters:
// x_mixed feeds the INT8 quantisation of the q-latent, where a single BF16 rounding flip upstream
// changes a quantised value and spreads to the whole token (spec §10.2 tolerances assume the
// front-end tracks the reference). The golden twin (golden/hyper_connection.hpp) computes the
// same formulas sequentially in double, so the two agree up to double rounding. hc_post is FP32
// (spec), a·post first, then the streams i = 0..3.
// Parallel split: the 24 mix rows (8 tasks of 3 rows, all tokens), then one task per token.
// NaN/Inf in x_hc propagate into the outputs (no check; the residual stream is the engine's).

#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

inline constexpr int kHcStreams = 4;                            // hc_mult
inline constexpr int kHcMixes = (2 + kHcStreams) * kHcStreams;  // 24
inline constexpr int kHcSinkhornIters = 20;
inline constexpr float kHcEps = 1e-6f;

// Hyper-connection weights of one layer (views into the engine's weights).
struct HcWeights {
  ConstView<float, 2> fn;     // (24, 4*D)
  ConstView<float, 1> scale;  // (3)
  ConstView<float, 1> base;   // (24)
};

namespace kernels {

namespace detail {
inline void check_hc_weights(std::string_view where, const HcWeights& w, const ModelConfig& cfg) {
  check_equal(where, "cfg.hc_mult", cfg.hc_mult, kHcStreams);
  check_equal<index_t>(where, "weights.fn.extent(0)", w.fn.extent(0), kHcMixes);
  check_equal<index_t>(where, "weights.fn.extent(1)", w.fn.extent(1),
                       index_t(kHcStreams) * cfg.hidden);
  check_equal<index_t>(where, "weights.fn.stride(1)", w.fn.stride(1), 1);
  check_equal<index_t>(where, "weights.scale.extent(0)", w.scale.extent(0), 3);
  check_equal<index_t>(where, "weights.base.extent(0)", w.base.extent(0), kHcMixes);
}

// Gates and Sinkhorn of one token from its 24 RMS-scaled mixes (double; formulas above).
inline void hc_gates(double pre[4], double post[4], double comb[16], const double mix[24],
                     const HcWeights& w) {
  const auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  const double eps = kHcEps;
  const double s0 = w.scale(0), s1 = w.scale(1), s2 = w.scale(2);
  for (int i = 0; i < 4; ++i) {
    pre[i] = sigmoid(mix[i] * s0 + w.base(i)) + eps;
    post[i] = 2.0 * sigmoid(mix[4 + i] * s1 + w.base(4 + i));
  }
  for (int i = 0; i < 4; ++i) {
    double m = -INFINITY;
    for (int o = 0; o < 4; ++o) {
      comb[i * 4 + o] = mix[8 + i * 4 + o] * s2 + w.base(8 + i * 4 + o);
      m = std::fmax(m, comb[i * 4 + o]);
    }
    double sum = 0.0;
    for (int o = 0; o < 4; ++o) sum += (comb[i * 4 + o] = std::exp(comb[i * 4 + o] - m));
    for (int o = 0; o < 4; ++o) comb[i * 4 + o] = comb[i * 4 + o] / sum + eps;
  }
  const auto normalise_columns = [&] {
    for (int o = 0; o < 4; ++o) {
      const double s = comb[0 * 4 + o] + comb[1 * 4 + o] + comb[2 * 4 + o] + comb[3 * 4 + o];
      for (int i = 0; i < 4; ++i) comb[i * 4 + o] /= (s + eps);
    }
  };
  normalise_columns();
  for (int it = 1; it < kHcSinkhornIters; ++it) {
    for (int i = 0; i < 4; ++i) {
      const double s = comb[i * 4 + 0] + comb[i * 4 + 1] + comb[i * 4 + 2] + comb[i * 4 + 3];
      for (int o = 0; o < 4; ++o) comb[i * 4 + o] /= (s + eps);
    }
    normalise_columns();
  }
}
}  // namespace detail

// hc_pre: x_mixed (T, D) BF16, post (T, 4) FP32, comb (T, 4, 4) FP32 [i][o] ← x_hc (T, 4, D)
// FP32 and the layer's HcWeights. `mixes` (T, 24) double is caller scratch. All views row-major
// contiguous in their last dimension. Throws tiledecode::Error on a shape mismatch.
inline void hc_pre(const cpu::Context& ctx, View<bf16, 2> x_mixed, View<float, 2> post,
                   View<float, 3> comb, ConstView<float, 3> x_hc, const HcWeights& w,
                   View<double, 2> mixes, const ModelConfig& cfg) {
  constexpr std::string_view where = "hc_pre";
  detail::check_hc_weights(where, w, cfg);
  const index_t T = x_hc.extent(0), D = cfg.hidden;
  check_equal<index_t>(where, "x_hc.extent(1)", x_hc.extent(1), kHcStreams);
  check_equal<index_t>(where, "x_hc.extent(2)", x_hc.extent(2), D);
  check_equal<index_t>(where, "x_hc.stride(1)", x_hc.stride(1), D);
  check_equal<index_t>(where, "x_hc.stride(2)", x_hc.stride(2), 1);
  check_equal<index_t>(where, "x_mixed.extent(0)", x_mixed.extent(0), T);
  check_equal<index_t>(where, "x_mixed.extent(1)", x_mixed.extent(1), D);
  check_equal<index_t>(where, "x_mixed.stride(1)", x_mixed.stride(1), 1);
  check_equal<index_t>(where, "post.extent(0)", post.extent(0), T);
  check_equal<index_t>(where, "post.extent(1)", post.extent(1), kHcStreams);
  check_equal<index_t>(where, "comb.extent(0)", comb.extent(0), T);
  check_equal<index_t>(where, "comb.extent(1)", comb.extent(1), kHcStreams);
  check_equal<index_t>(where, "comb.extent(2)", comb.extent(2), kHcStreams);
  check_equal<index_t>(where, "mixes.extent(0)", mixes.extent(0), T);
  check_equal<index_t>(where, "mixes.extent(1)", mixes.extent(1), kHcMixes);
  const index_t n = kHcStreams * D;
  [[maybe_unused]] const bool avx2 = cpu::has_avx2(ctx.isa) && TILEDECODE_X86;

  // Pass 1: the 24 mixes of every token; one task per 3 weight rows (fn streams once), in
  // register tiles of 3 rows × 2 tokens on AVX2 (bit-identical to one dot_f32_f64 per pair).
  constexpr int kRows = 3, kToks = 2;
  static_assert(kHcMixes % kRows == 0);
  ctx.parallel_for(0, kHcMixes / kRows, 1, [&](std::int64_t task) {
    const index_t j0 = task * kRows;
    const float* f = w.fn.data() + j0 * w.fn.stride(0);
    index_t t = 0;
#if TILEDECODE_X86
    if (avx2) {
      double s[kRows * kToks];
      for (; t + kToks <= T; t += kToks) {
        cpu::avx2::dot_f32_f64_tile<kRows, kToks>(
            s, f, w.fn.stride(0), x_hc.data() + t * x_hc.stride(0), x_hc.stride(0), n);
        for (int r = 0; r < kRows; ++r)
          for (int u = 0; u < kToks; ++u) mixes(t + u, j0 + r) = s[r * kToks + u];
      }
      for (; t < T; ++t) {
        cpu::avx2::dot_f32_f64_tile<kRows, 1>(s, f, w.fn.stride(0),
                                              x_hc.data() + t * x_hc.stride(0), x_hc.stride(0), n);
        for (int r = 0; r < kRows; ++r) mixes(t, j0 + r) = s[r];
      }
    }
#endif
    for (; t < T; ++t) {
      const float* x = x_hc.data() + t * x_hc.stride(0);
      for (int r = 0; r < kRows; ++r) {
        const float* fr = f + r * w.fn.stride(0);
        double s = 0.0;
        for (index_t k = 0; k < n; ++k) s += double(fr[k]) * double(x[k]);
        mixes(t, j0 + r) = s;
      }
    }
  });
  // Pass 2: per token RMS scale, gates, Sinkhorn and the BF16 mix-in.
  ctx.parallel_for(0, T, 1, [&](std::int64_t t) {
    const float* x = x_hc.data() + t * x_hc.stride(0);
    double ss = 0.0;
#if TILEDECODE_X86
    if (avx2) {
      ss = cpu::avx2::dot_f32_f64(x, x, n);
    } else
#endif
    {
      for (index_t k = 0; k < n; ++k) ss += double(x[k]) * double(x[k]);
    }
    const double r = 1.0 / std::sqrt(ss / double(n) + double(cfg.rms_eps));
    double mix[kHcMixes], pre[4], po[4], cb[16];
    for (int j = 0; j < kHcMixes; ++j) mix[j] = mixes(t, j) * r;
    detail::hc_gates(pre, po, cb, mix, w);
    for (int i = 0; i < 4; ++i) post(t, i) = float(po[i]);
    for (int i = 0; i < 4; ++i)
      for (int o = 0; o < 4; ++o) comb(t, i, o) = float(cb[i * 4 + o]);
    bf16* dst = x_mixed.data() + t * x_mixed.stride(0);
    for (index_t k = 0; k < D; ++k) {
      double s = pre[0] * x[k];
      s += pre[1] * x[D + k];
      s += pre[2] * x[2 * D + k];
      s += pre[3] * x[3 * D + k];
      dst[k] = bf16(float(s));
    }
  });
}

// hc_post: y (T, 4, D) FP32 ← attn_out (T, D) BF16, x_hc (T, 4, D) FP32, post (T, 4),
// comb (T, 4, 4) [i][o]. y must not alias x_hc.
inline void hc_post(const cpu::Context& ctx, View<float, 3> y, ConstView<bf16, 2> attn_out,
                    ConstView<float, 3> x_hc, ConstView<float, 2> post, ConstView<float, 3> comb,
                    const ModelConfig& cfg) {
  constexpr std::string_view where = "hc_post";
  const index_t T = x_hc.extent(0), D = cfg.hidden;
  check_equal(where, "cfg.hc_mult", cfg.hc_mult, kHcStreams);
  for (auto [name, v] : {std::pair<const char*, index_t>{"y.extent(0)", y.extent(0)},
                         {"attn_out.extent(0)", attn_out.extent(0)},
                         {"post.extent(0)", post.extent(0)},
                         {"comb.extent(0)", comb.extent(0)}})
    check_equal<index_t>(where, name, v, T);
  check_equal<index_t>(where, "y.extent(1)", y.extent(1), kHcStreams);
  check_equal<index_t>(where, "y.extent(2)", y.extent(2), D);
  check_equal<index_t>(where, "y.stride(2)", y.stride(2), 1);
  check_equal<index_t>(where, "x_hc.extent(1)", x_hc.extent(1), kHcStreams);
  check_equal<index_t>(where, "x_hc.extent(2)", x_hc.extent(2), D);
  check_equal<index_t>(where, "x_hc.stride(2)", x_hc.stride(2), 1);
  check_equal<index_t>(where, "attn_out.extent(1)", attn_out.extent(1), D);
  check_equal<index_t>(where, "attn_out.stride(1)", attn_out.stride(1), 1);
  check_equal<index_t>(where, "post.extent(1)", post.extent(1), kHcStreams);
  check_equal<index_t>(where, "comb.extent(1)", comb.extent(1), kHcStreams);
  check_equal<index_t>(where, "comb.extent(2)", comb.extent(2), kHcStreams);
  if (y.data() == x_hc.data())
    throw_arg(where, "y", "x_hc's buffer", "a buffer distinct from x_hc");
  [[maybe_unused]] const bool avx2 = cpu::has_avx2(ctx.isa) && TILEDECODE_X86;
  // One task per (token, 512-column chunk): enough tasks for any thread count.
  const index_t chunk = 512, n_chunks = (D + chunk - 1) / chunk;
  ctx.parallel_for(0, T * n_chunks, 1, [&](std::int64_t task) {
    const index_t t = task / n_chunks, c0 = (task % n_chunks) * chunk;
    const index_t n = std::min(chunk, D - c0);
    float po[4], cb[16];
    for (int i = 0; i < 4; ++i) po[i] = post(t, i);
    for (int i = 0; i < 4; ++i)
      for (int o = 0; o < 4; ++o) cb[i * 4 + o] = comb(t, i, o);
    const bf16* a = attn_out.data() + t * attn_out.stride(0) + c0;
    const float* x = x_hc.data() + t * x_hc.stride(0) + c0;
    float* yt = y.data() + t * y.stride(0) + c0;
#if TILEDECODE_X86
    if (avx2) {
      cpu::avx2::hc_post_row(yt, y.stride(1), a, x, x_hc.stride(1), po, cb, n);
      return;
    }
#endif
    for (int o = 0; o < 4; ++o)
      for (index_t k = 0; k < n; ++k) {
        float s = a[k].to_float() * po[o];
        for (int i = 0; i < 4; ++i) s += x[i * x_hc.stride(1) + k] * cb[i * 4 + o];
        yt[o * y.stride(1) + k] = s;
      }
  });
}

}  // namespace kernels
}  // namespace tiledecode
