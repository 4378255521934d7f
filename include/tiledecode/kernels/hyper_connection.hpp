#pragma once
// Hyper-connections around one attention layer (spec §4 steps 1 and 5) — contracts and tile
// programs of hc_pre and hc_post.
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
//     iteration 1:  c = softmax_o(c) + eps ; c[i][o] /= (Σ_i c[i][o] + eps)   (rows, then columns)
//     iterations 2..20: c[i][o] /= (Σ_o c[i][o] + eps) ; c[i][o] /= (Σ_i c[i][o] + eps)
//   so the last normalisation is over the input index i: every output stream o receives a convex
//   combination of the input streams (Σ_i comb[i][o] ≈ 1).
//   x_mixed[t] = bf16( Σ_i pre[i] * x_hc[t, i, :] )             (i ascending)
//   comb[t] = c (FP32 [4,4], index [i][o]), post[t] = post (FP32 [4]).
// hc_post (spec §4 step 5), FP32, no rounding:
//   y[t, o, :] = attn_out[t, :] * post[t, o] + Σ_i x_hc[t, i, :] * comb[t, i, o]   (i ascending)
//
// Programs: hc_pre = the mix stage (the 24 dot products of every token: a tile matmul), then per
// token the RMS scale, the gates (`hc_gates` below, the one copy of the gate and Sinkhorn
// formulas both backends run: the CPU in double, the a2a3 model's scalar unit in FP32) and the
// mix-in; hc_post = per (token, column chunk) the combine. The CPU runs hc_pre in double (it keeps
// x_mixed on the reference's side of BF16 rounding boundaries, which matters because x_mixed feeds
// the q-latent's INT8 quantisation); the a2a3 vector unit in FP32.
// NaN/Inf in x_hc propagate into the outputs (no check; the residual stream is the engine's).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/tile/backend.hpp"

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

struct HcPre {
  static constexpr std::string_view kernel_name = "hc_pre";
};
struct HcPost {
  static constexpr std::string_view kernel_name = "hc_post";
};

// Gates and Sinkhorn of one token from its 24 RMS-scaled mixes (formulas above), in the
// arithmetic type R (double on the CPU, float on the a2a3 model's scalar unit).
template <class R>
void hc_gates(R pre[4], R post[4], R comb[16], const R mix[24], const R scale[3],
              const R base[24]) {
  const auto sigmoid = [](R v) { return R(1) / (R(1) + std::exp(-v)); };
  const R eps = R(kHcEps);
  for (int i = 0; i < 4; ++i) {
    pre[i] = sigmoid(mix[i] * scale[0] + base[i]) + eps;
    post[i] = R(2) * sigmoid(mix[4 + i] * scale[1] + base[4 + i]);
  }
  for (int i = 0; i < 4; ++i) {
    R m = -INFINITY;
    for (int o = 0; o < 4; ++o) {
      comb[i * 4 + o] = mix[8 + i * 4 + o] * scale[2] + base[8 + i * 4 + o];
      m = std::fmax(m, comb[i * 4 + o]);
    }
    R sum = 0;
    for (int o = 0; o < 4; ++o) sum += (comb[i * 4 + o] = std::exp(comb[i * 4 + o] - m));
    for (int o = 0; o < 4; ++o) comb[i * 4 + o] = comb[i * 4 + o] / sum + eps;
  }
  const auto normalise_columns = [&] {
    for (int o = 0; o < 4; ++o) {
      const R s = comb[0 * 4 + o] + comb[1 * 4 + o] + comb[2 * 4 + o] + comb[3 * 4 + o];
      for (int i = 0; i < 4; ++i) comb[i * 4 + o] /= (s + eps);
    }
  };
  normalise_columns();
  for (int it = 1; it < kHcSinkhornIters; ++it) {
    for (int i = 0; i < 4; ++i) {
      const R s = comb[i * 4 + 0] + comb[i * 4 + 1] + comb[i * 4 + 2] + comb[i * 4 + 3];
      for (int o = 0; o < 4; ++o) comb[i * 4 + o] /= (s + eps);
    }
    normalise_columns();
  }
}

inline void check_hc_weights(std::string_view where, const HcWeights& w, const ModelConfig& cfg) {
  check_equal(where, "cfg.hc_mult", cfg.hc_mult, kHcStreams);
  check_rows(where, "weights.fn", w.fn, {kHcMixes, index_t(kHcStreams) * cfg.hidden});
  check_extents(where, "weights.scale", w.scale, {3});
  check_extents(where, "weights.base", w.base, {kHcMixes});
}

struct HcPreArgs {
  const ModelConfig* cfg = nullptr;
  View<bf16, 2> x_mixed;     // (T, D)
  View<float, 2> post;       // (T, 4)
  View<float, 3> comb;       // (T, 4, 4) [i][o]
  ConstView<float, 3> x_hc;  // (T, 4, D)
  HcWeights w;
  std::span<std::byte> workspace;  // >= hc_pre_workspace_bytes(be, cfg, T): the mixes
  index_t tokens() const { return x_hc.extent(0); }
};

inline void validate(const HcPreArgs& a) {
  constexpr std::string_view where = "hc_pre";
  check_hc_weights(where, a.w, *a.cfg);
  check_view(where, "x_hc", a.x_hc);
  const index_t T = a.x_hc.extent(0), D = a.cfg->hidden;
  check_rows(where, "x_hc", a.x_hc, {T, kHcStreams, D});
  check_equal<index_t>(where, "x_hc.stride(1)", a.x_hc.stride(1), D);
  check_rows(where, "x_mixed", a.x_mixed, {T, D});
  check_extents(where, "post", a.post, {T, kHcStreams});
  check_extents(where, "comb", a.comb, {T, kHcStreams, kHcStreams});
}

struct HcPostArgs {
  const ModelConfig* cfg = nullptr;
  View<float, 3> y;             // (T, 4, D)
  ConstView<bf16, 2> attn_out;  // (T, D)
  ConstView<float, 3> x_hc;     // (T, 4, D)
  ConstView<float, 2> post;     // (T, 4)
  ConstView<float, 3> comb;     // (T, 4, 4)
  index_t tokens() const { return x_hc.extent(0); }
};

inline void validate(const HcPostArgs& a) {
  constexpr std::string_view where = "hc_post";
  check_equal(where, "cfg.hc_mult", a.cfg->hc_mult, kHcStreams);
  check_view(where, "x_hc", a.x_hc);
  const index_t T = a.x_hc.extent(0), D = a.cfg->hidden;
  check_rows(where, "y", a.y, {T, kHcStreams, D});
  check_rows(where, "attn_out", a.attn_out, {T, D});
  check_rows(where, "x_hc", a.x_hc, {T, kHcStreams, D});
  check_extents(where, "post", a.post, {T, kHcStreams});
  check_extents(where, "comb", a.comb, {T, kHcStreams, kHcStreams});
  if (a.y.data() != nullptr && static_cast<const void*>(a.y.data()) == a.x_hc.data())
    throw_arg(where, "y", "x_hc's buffer", "a buffer distinct from x_hc");
}

// hc_pre: the mixes of every token (a tile matmul over the 4·D inputs), then per token the RMS
// scale, hc_gates and the mix-in.
template <class B>
void hc_pre_program(const B& be, const HcPreArgs& a) {
  using Ops = ops_for<HcPre, B>;
  Ops::mixes(be, a);  // mixes[t, j] = fn[j] · x_hc[t]
  Ops::for_tokens(be, a, [&](auto& lane, index_t t) {
    Ops::rms_scale(lane, a, t);  // mix *= 1 / sqrt(mean(x²) + eps)
    Ops::gates(lane, a, t);      // pre, post, comb (hc_gates)
    Ops::mix_in(lane, a, t);     // x_mixed = bf16(Σ_i pre_i x_i)
  });
}

// hc_post: y[t, o, :] = attn_out[t]·post[t, o] + Σ_i x_hc[t, i, :]·comb[t, i, o].
template <class B>
void hc_post_program(const B& be, const HcPostArgs& a) {
  using Ops = ops_for<HcPost, B>;
  Ops::for_chunks(be, a, [&](auto& lane, index_t t, index_t c0, index_t n) {
    Ops::combine(lane, a, t, c0, n);
  });
}

// Scratch bytes hc_pre needs on backend `be` for T tokens.
template <class Be>
std::size_t hc_pre_workspace_bytes(const Be& be, const ModelConfig& cfg, index_t tokens) {
  return dispatch(be, [&](const auto& b) {
    return ops_for<HcPre, decltype(b)>::workspace_bytes(b, cfg, tokens);
  });
}

// hc_pre: x_mixed (T, D) BF16, post (T, 4) FP32, comb (T, 4, 4) FP32 [i][o] ← x_hc (T, 4, D)
// FP32 and the layer's HcWeights, on backend `be`; workspace >= hc_pre_workspace_bytes(be, cfg,
// T). All views row-major contiguous in their last dimension. Throws tiledecode::Error on a shape
// mismatch before writing anything.
template <class Be>
void hc_pre(const Be& be, View<bf16, 2> x_mixed, View<float, 2> post, View<float, 3> comb,
            ConstView<float, 3> x_hc, const HcWeights& w, std::span<std::byte> workspace,
            const ModelConfig& cfg) {
  const HcPreArgs a{&cfg, x_mixed, post, comb, x_hc, w, workspace};
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<HcPre, decltype(b)>::check(b, a);
    if (a.tokens() == 0) return;
    b.kernel(HcPre::kernel_name, [&] { hc_pre_program(b, a); });
  });
}

// The same with the mixes scratch as a (T, 24) double view (the CPU layout).
template <class Be>
void hc_pre(const Be& be, View<bf16, 2> x_mixed, View<float, 2> post, View<float, 3> comb,
            ConstView<float, 3> x_hc, const HcWeights& w, View<double, 2> mixes,
            const ModelConfig& cfg) {
  check_rows("hc_pre", "mixes", mixes, {x_hc.extent(0), kHcMixes});
  hc_pre(be, x_mixed, post, comb, x_hc, w,
         std::span<std::byte>(reinterpret_cast<std::byte*>(mixes.data()),
                              std::size_t(mixes.size()) * sizeof(double)),
         cfg);
}

// hc_post: y (T, 4, D) FP32 ← attn_out (T, D) BF16, x_hc (T, 4, D) FP32, post (T, 4),
// comb (T, 4, 4) [i][o], on backend `be`. y must not alias x_hc.
template <class Be>
void hc_post(const Be& be, View<float, 3> y, ConstView<bf16, 2> attn_out, ConstView<float, 3> x_hc,
             ConstView<float, 2> post, ConstView<float, 3> comb, const ModelConfig& cfg) {
  const HcPostArgs a{&cfg, y, attn_out, x_hc, post, comb};
  dispatch(be, [&](const auto& b) {
    validate(a);
    if (a.tokens() == 0) return;
    b.kernel(HcPost::kernel_name, [&] { hc_post_program(b, a); });
  });
}

}  // namespace kernels
}  // namespace tiledecode
