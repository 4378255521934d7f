// torch.ops.tiledecode: the dense kernels of a layer — hc_pre / hc_post, RMSNorm, the q/kv
// projection, sparse attention with the packed store, the output projection (spec §4, §8).
// Each op validates through the library's entry point (before its first write) and runs on the
// binding's CPU context; scratch the kernel needs is allocated per call (outputs and caches are
// the caller's tensors). Only the CPU tiers are instantiated here (cpu::Context), not the a2a3
// model.
#include <torch/library.h>

#include "binding.hpp"
#include "ops.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/kernels/hyper_connection.hpp"
#include "tiledecode/kernels/output_projection.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"
#include "tiledecode/kernels/rmsnorm.hpp"
#include "tiledecode/kernels/sparse_attention.hpp"

namespace tdpy {

namespace tk = td::kernels;

void hc_pre(const at::Tensor& x_mixed, const at::Tensor& post, const at::Tensor& comb,
            const at::Tensor& x_hc, const at::Tensor& hc_fn, const at::Tensor& hc_scale,
            const at::Tensor& hc_base, const std::string& config) {
  constexpr std::string_view op = "hc_pre";
  const td::ModelConfig cfg = parse_config(op, config);
  const auto ctx = cpu_context();
  const auto xh = cview_of<float, 3>(x_hc, op, "x_hc");
  const td::HcWeights w{cview_of<float, 2>(hc_fn, op, "hc_fn"),
                        cview_of<float, 1>(hc_scale, op, "hc_scale"),
                        cview_of<float, 1>(hc_base, op, "hc_base")};
  td::Buffer<std::byte> ws(tk::hc_pre_workspace_bytes(ctx, cfg, xh.extent(0)));
  tk::hc_pre(ctx, view_of<td::bf16, 2>(x_mixed, op, "x_mixed"), view_of<float, 2>(post, op, "post"),
             view_of<float, 3>(comb, op, "comb"), xh, w, ws.span(), cfg);
}

void hc_post(const at::Tensor& x_out, const at::Tensor& attn_out, const at::Tensor& x_hc,
             const at::Tensor& post, const at::Tensor& comb, const std::string& config) {
  constexpr std::string_view op = "hc_post";
  const td::ModelConfig cfg = parse_config(op, config);
  tk::hc_post(cpu_context(), view_of<float, 3>(x_out, op, "x_out"),
              cview_of<td::bf16, 2>(attn_out, op, "attn_out"), cview_of<float, 3>(x_hc, op, "x_hc"),
              cview_of<float, 2>(post, op, "post"), cview_of<float, 3>(comb, op, "comb"), cfg);
}

void rmsnorm(const at::Tensor& x_n, const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr std::string_view op = "rmsnorm";
  tk::rmsnorm(cpu_context(), view_of<td::bf16, 2>(x_n, op, "x_n"),
              cview_of<td::bf16, 2>(x, op, "x"), cview_of<td::bf16, 1>(weight, op, "weight"),
              float(eps));
}

void qkv_projection(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& qr,
                    const at::Tensor& qr_scale, const at::Tensor& x_n, const at::Tensor& wq_a,
                    const at::Tensor& gamma_cq, const at::Tensor& wq_b,
                    const at::Tensor& wq_b_scale, const at::Tensor& wkv,
                    const at::Tensor& gamma_ckv, const at::Tensor& rope_cos,
                    const at::Tensor& rope_sin, const at::Tensor& position_ids,
                    const std::string& config, const c10::optional<at::Tensor>& wq_a_norm,
                    const c10::optional<at::Tensor>& wkv_norm) {
  constexpr std::string_view op = "qkv_projection";
  const td::ModelConfig cfg = parse_config(op, config);
  const auto ctx = cpu_context();
  const auto xn = cview_of<td::bf16, 2>(x_n, op, "x_n");
  td::QkvWeights w{cview_of<td::bf16, 2>(wq_a, op, "wq_a"),
                   cview_of<td::bf16, 1>(gamma_cq, op, "gamma_cq"),
                   cview_of<std::int8_t, 2>(wq_b, op, "wq_b"),
                   cview_of<float, 1>(wq_b_scale, op, "wq_b_scale"),
                   cview_of<td::bf16, 2>(wkv, op, "wkv"),
                   cview_of<td::bf16, 1>(gamma_ckv, op, "gamma_ckv"),
                   nullptr};
  // The q-latent's and the kv rounding checks (qkv_wq_a_norms, qkv_wkv_norms; the layer step's
  // LayerWeights makes both).
  w.wq_a_norm = opt_view_of<const float, 1>(wq_a_norm, op, "wq_a_norm");
  w.wkv_norm = opt_view_of<const float, 1>(wkv_norm, op, "wkv_norm");
  const auto rope = rope_of(rope_cos, rope_sin, op);
  const auto pos = cview_of<std::int32_t, 1>(position_ids, op, "position_ids");
  auto qv = view_of<td::bf16, 3>(q, op, "q");
  auto kvv = view_of<td::bf16, 2>(kv, op, "kv");
  auto qrv = view_of<std::int8_t, 2>(qr, op, "qr");
  auto qsv = view_of<float, 1>(qr_scale, op, "qr_scale");
  // Scratch sized from x_n's rows; the kernel validates every extent against the config first.
  const index_t T = xn.extent(0);
  if (xn.extent(1) != cfg.hidden)
    td::check_equal<index_t>("qkv_projection", "x_n.extent(1)", xn.extent(1), cfg.hidden);
  tk::QkvScratchStorage s(ctx, cfg, T);
  tk::qkv_projection(ctx, qv, kvv, qrv, qsv, xn, w, rope, pos, s.view(), cfg);
}

void sparse_attention(const at::Tensor& o_packed, const at::Tensor& q, const at::Tensor& kv_cache,
                      const c10::optional<at::Tensor>& cmp_kv, const at::Tensor& window_indices,
                      const at::Tensor& window_lens, const c10::optional<at::Tensor>& topk_idxs,
                      const c10::optional<at::Tensor>& cmp_block_table, const at::Tensor& positions,
                      const at::Tensor& kv_seq_lens, std::int64_t seq, const at::Tensor& attn_sink,
                      const at::Tensor& rope_cos, const at::Tensor& rope_sin, std::int64_t kind,
                      const std::string& config) {
  constexpr std::string_view op = "sparse_attention";
  const td::ModelConfig cfg = parse_config(op, config);
  const td::LayerKind k = layer_kind(op, kind);
  td::check_range<std::int64_t>("sparse_attention", "seq", seq, 1, 1 << 10);
  const auto ctx = cpu_context();
  td::Buffer<std::byte> ws(tk::sparse_attention_workspace_bytes(ctx, cfg, k, q.size(0)));
  tk::sparse_attention(
      ctx, cfg, k, view_of<td::bf16, 2>(o_packed, op, "o_packed"),
      cview_of<td::bf16, 3>(q, op, "q"), bf16_rows(kv_cache, op, "kv_cache"),
      cmp_kv.has_value() ? td::ConstView<td::bf16, 2>(bf16_rows(*cmp_kv, op, "cmp_kv"))
                         : td::ConstView<td::bf16, 2>(),
      cview_of<std::int32_t, 2>(window_indices, op, "window_indices"),
      cview_of<std::int32_t, 1>(window_lens, op, "window_lens"),
      opt_view_of<const std::int32_t, 2>(topk_idxs, op, "topk_idxs"),
      opt_view_of<const std::int32_t, 2>(cmp_block_table, op, "cmp_block_table"),
      cview_of<std::int32_t, 1>(positions, op, "positions"),
      cview_of<std::int32_t, 1>(kv_seq_lens, op, "kv_seq_lens"), int(seq),
      cview_of<float, 1>(attn_sink, op, "attn_sink"), rope_of(rope_cos, rope_sin, op), ws.span());
}

void output_projection(const at::Tensor& attn_out, const at::Tensor& o_packed,
                       const at::Tensor& wo_a, const at::Tensor& wo_b, const at::Tensor& wo_b_scale,
                       const std::string& config, const c10::optional<at::Tensor>& wo_a_norm) {
  constexpr std::string_view op = "output_projection";
  const td::ModelConfig cfg = parse_config(op, config);
  const auto ctx = cpu_context();
  const auto ov = view_of<td::bf16, 2>(attn_out, op, "attn_out");
  td::Buffer<std::byte> ws(tk::output_projection_workspace_bytes(ctx, cfg, ov.extent(0)));
  tk::output_projection(ctx, cfg, ov, cview_of<td::bf16, 2>(o_packed, op, "o_packed"),
                        cview_of<td::bf16, 3>(wo_a, op, "wo_a"),
                        cview_of<std::int8_t, 2>(wo_b, op, "wo_b"),
                        cview_of<float, 1>(wo_b_scale, op, "wo_b_scale"), ws.span(),
                        opt_view_of<const float, 2>(wo_a_norm, op, "wo_a_norm"));
}

// The rounding checks' weight norms (load-time preparations; LayerWeights makes all three): each
// column of wq_a, each column of wkv, each row of wo_a, bounded from above (FP32, +Inf for one
// with a NaN).
// norm[i] = columns(w)[i] for each column i of the BF16 weight w (named `name`).
template <class F>
void column_norms(std::string_view op, const at::Tensor& norm, const at::Tensor& weight,
                  const char* name, F columns) {
  const auto w = cview_of<td::bf16, 2>(weight, op, name);
  const auto nv = view_of<float, 1>(norm, op, "norm");
  td::check_extents(op, "norm", nv, {w.extent(1)});
  const td::Tensor<float, 1> n = columns(w);
  for (index_t i = 0; i < w.extent(1); ++i) nv(i) = n.data()[i];
}

void qkv_wq_a_norms(const at::Tensor& norm, const at::Tensor& wq_a) {
  column_norms("qkv_wq_a_norms", norm, wq_a, "wq_a",
               [](const auto& w) { return tk::qkv_wq_a_norms(w); });
}

void qkv_wkv_norms(const at::Tensor& norm, const at::Tensor& wkv) {
  column_norms("qkv_wkv_norms", norm, wkv, "wkv",
               [](const auto& w) { return tk::qkv_wkv_norms(w); });
}

void output_projection_row_norms(const at::Tensor& norm, const at::Tensor& wo_a) {
  constexpr std::string_view op = "output_projection_row_norms";
  const auto w = cview_of<td::bf16, 3>(wo_a, op, "wo_a");
  const auto nv = view_of<float, 2>(norm, op, "norm");
  td::check_extents(op, "norm", nv, {w.extent(0), w.extent(1)});
  const td::Tensor<float, 2> n = tk::output_projection_row_norms(w);
  for (index_t g = 0; g < w.extent(0); ++g)
    for (index_t r = 0; r < w.extent(1); ++r) nv(g, r) = n.data()[g * w.extent(1) + r];
}

TORCH_LIBRARY_IMPL(tiledecode, CompositeImplicitAutograd, m) {
  m.impl("hc_pre", TORCH_FN(hc_pre));
  m.impl("hc_post", TORCH_FN(hc_post));
  m.impl("rmsnorm", TORCH_FN(rmsnorm));
  m.impl("qkv_projection", TORCH_FN(qkv_projection));
  m.impl("sparse_attention", TORCH_FN(sparse_attention));
  m.impl("output_projection", TORCH_FN(output_projection));
  m.impl("qkv_wq_a_norms", TORCH_FN(qkv_wq_a_norms));
  m.impl("qkv_wkv_norms", TORCH_FN(qkv_wkv_norms));
  m.impl("output_projection_row_norms", TORCH_FN(output_projection_row_norms));
}

}  // namespace tdpy
