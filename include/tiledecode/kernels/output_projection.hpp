#pragma once
// Grouped W8A8 output projection (spec §8.5) — the contract and the ONE tile program both backends
// run:
//   o_r[t,g,:]    = o_packed[g*T+t, :] @ wo_a[g]^T          FP32 accumulate, BF16 weights
//   a_i8, a_dq    = Q8(o_r[t,g,:])                          per (token, group) over O_LORA
//   P_g[t,n]      = Σ_r a_i8[t,g,r] · wo_b[n, g*O_LORA + r]  exact INT32
//   attn_out[t,n] = bf16(wo_b_scale[n] · Σ_g a_dq[t,g] · P_g[t,n])   (groups summed in order g)
// The program is a chain per group range — project_a (the BF16 tile matmul), quantise (Q8 rows),
// project_b (the INT8 tile matmul) — and a final combine (the dequantised group sum). The
// backends choose the ranges and the fusion (backend_ops<OutputProjection, B>):
//   CPU   one chain over all groups, each op one parallel stage; project_b keeps every P_g in
//         registers and folds the combine into it (no INT32 partials in memory);
//   a2a3  one chain per group (spec §8.6 item 5: proj_a -> quant -> proj_b launches per group,
//         chained so groups pipeline), INT32 partials (T padded to 16, O_GROUPS x D) to GM, and a
//         proj_b_act vector launch for the combine.
// NaN policy: inputs are not scanned; a NaN in o_r makes Q8 of that (token, group) unspecified
// (core/quant.hpp), so the corresponding outputs are unspecified but finite-typed.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::kernels {

struct OutputProjection {
  static constexpr std::string_view kernel_name = "o_proj";
};

struct OutputProjectionArgs {
  const ModelConfig* cfg = nullptr;
  View<bf16, 2> attn_out;          // (T, D)
  ConstView<bf16, 2> o_packed;     // (O_GROUPS*T, O_GROUP_IN)
  ConstView<bf16, 3> wo_a;         // (O_GROUPS, O_LORA, O_GROUP_IN)
  ConstView<std::int8_t, 2> wo_b;  // (D, O_GROUPS*O_LORA)
  ConstView<float, 1> wo_b_scale;  // (D)
  // Optional (empty: none): per wo_a row an upper bound of its Euclidean norm
  // (output_projection_row_norms), the scale of the CPU backend's rounding check (its quantize
  // stage repairs the o_r values whose Q8 rounding the FP32 sums cannot decide).
  ConstView<float, 2> wo_a_norm;  // (O_GROUPS, O_LORA)
  index_t tokens() const { return attn_out.extent(0); }
};

inline void validate(const OutputProjectionArgs& a) {
  constexpr std::string_view where = "output_projection";
  const ModelConfig& cfg = *a.cfg;
  const index_t G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(), N = cfg.hidden;
  check_view(where, "attn_out", a.attn_out);
  const index_t T = a.attn_out.extent(0);
  check_rows(where, "attn_out", a.attn_out, {T, N});
  check_rows(where, "o_packed", a.o_packed, {G * T, K});
  check_rows(where, "wo_a", a.wo_a, {G, R, K});
  check_rows(where, "wo_b", a.wo_b, {N, G * R});
  check_extents(where, "wo_b_scale", a.wo_b_scale, {N});
  if (R % 32 != 0 || R > 65536)
    throw_arg(where, "cfg.o_lora", R, "a multiple of 32 in [32, 65536] (INT32 bound of wo_b)");
  if (K % 8 != 0) throw_arg(where, "cfg.o_group_in()", K, "a multiple of 8");
  if (a.wo_a_norm.data() != nullptr) {
    check_rows(where, "wo_a_norm", a.wo_a_norm, {G, R});
    check_nonnegative(where, "wo_a_norm", a.wo_a_norm,
                      "a value >= 0 (output_projection_row_norms)");
  }
}

// Per wo_a row (g, r) an upper bound of its Euclidean norm (bf16_norm_bound: FP32, rounded up;
// +Inf past FLT_MAX or for a row with a NaN). A load-time preparation (decode/layer.hpp
// LayerWeightsStorage::pack) that reads wo_a once.
inline Tensor<float, 2> output_projection_row_norms(ConstView<bf16, 3> wo_a) {
  const index_t G = wo_a.extent(0), R = wo_a.extent(1), K = wo_a.extent(2);
  Tensor<float, 2> n({G, R});
  for (index_t g = 0; g < G; ++g)
    for (index_t r = 0; r < R; ++r)
      n.data()[g * R + r] = bf16_norm_bound(&wo_a(g, r, 0), K, wo_a.stride(2));
  return n;
}

// The tile program (both backends).
template <class B>
void output_projection_program(const B& be, const OutputProjectionArgs& a,
                               std::span<std::byte> workspace) {
  using Ops = ops_for<OutputProjection, B>;
  auto s = Ops::schedule(be, a, workspace);
  const int G = a.cfg->o_groups;
  for (int g0 = 0; g0 < G; g0 += Ops::groups_per_chain(G)) {
    const int g1 = g0 + Ops::groups_per_chain(G);
    Ops::project_a(s, a, g0, g1);  // o_r = o_packed[g] · wo_a[g]ᵀ   (FP32, BF16 × BF16)
    Ops::quantize(s, a, g0, g1);   // a_i8, a_dq = Q8(o_r[t, g, :])
    Ops::project_b(s, a, g0, g1);  // P_g = a_i8[:, g] · wo_b[:, g]ᵀ  (exact INT32)
  }
  Ops::combine(s, a);  // attn_out = bf16(wo_b_scale · Σ_g a_dq[g] · P_g)
}

template <class Be>
std::size_t output_projection_workspace_bytes(const Be& be, const ModelConfig& cfg,
                                              index_t tokens) {
  return dispatch(be, [&](const auto& b) {
    return ops_for<OutputProjection, decltype(b)>::workspace_bytes(b, cfg, tokens);
  });
}

// Grouped W8A8 output projection of T tokens on backend `be`.
//   attn_out    BF16 [T, D]                    output
//   o_packed    BF16 [O_GROUPS·T, O_GROUP_IN]  from kernels::sparse_attention
//   wo_a        BF16 [O_GROUPS, O_LORA, O_GROUP_IN]   (used as x @ wo_a[g]^T); rows contiguous
//   wo_b        INT8 [D, O_GROUPS·O_LORA], rows contiguous; any int8 value (the AVX2 dot puts
//               |w| on vpmaddubsw's unsigned side, where -128 reads as 128, and the Q8
//               activations are in [-127, 127], so every pair sum stays < 32767: exact)
//   wo_b_scale  FP32 [D] per output channel
//   workspace   >= output_projection_workspace_bytes(be, cfg, T) bytes, any alignment
//   wo_a_norm   FP32 [O_GROUPS, O_LORA], optional: output_projection_row_norms(wo_a), each >= 0
//               (+Inf allowed: nothing of that row is trusted). With it the CPU backend's default
//               BF16 dots (not Bf16Dot::exact, which needs no check) give golden's Q8 activations,
//               so golden's attn_out: see backend/cpu/output_projection.hpp, "Rounding check".
// Throws tiledecode::Error on invalid arguments before writing anything.
template <class Be>
void output_projection(const Be& be, const ModelConfig& cfg, View<bf16, 2> attn_out,
                       ConstView<bf16, 2> o_packed, ConstView<bf16, 3> wo_a,
                       ConstView<std::int8_t, 2> wo_b, ConstView<float, 1> wo_b_scale,
                       std::span<std::byte> workspace, ConstView<float, 2> wo_a_norm = {}) {
  const OutputProjectionArgs a{&cfg, attn_out, o_packed, wo_a, wo_b, wo_b_scale, wo_a_norm};
  dispatch(be, [&](const auto& b) {
    using Ops = ops_for<OutputProjection, decltype(b)>;
    validate(a);
    Ops::check(b, a, workspace);
    if (a.tokens() == 0) return;
    b.kernel(OutputProjection::kernel_name, [&] { output_projection_program(b, a, workspace); });
  });
}

}  // namespace tiledecode::kernels
