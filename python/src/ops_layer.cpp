// torch.ops.tiledecode.layer_step: one whole attention layer of the decode step
// (decode::layer_step, spec §4, §9.2) on the caller's tensors, with the LayerWeights / StepMetadata
// / Workspace holders; the workspace's intermediates as tensors; and _cpp_decode_loop, the same
// layer run for many steps by a plain C++ loop (the tests' bit-for-bit reference of the Python
// route). Built with TILEDECODE_SEPARATE_STEP: the stack itself is compiled once, in
// step_instance.cpp.
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "binding.hpp"
#include "ops.hpp"
#include "tiledecode/decode/step.hpp"

namespace tdpy {

namespace {

template <class T, std::size_t R, class F>
td::View<T, R> opt_pool(const c10::optional<at::Tensor>& t, F&& rows) {
  if (!t.has_value() || !t->defined() || t->numel() == 0) return {};
  return rows(*t);
}

td::decode::LayerCaches caches_of(std::string_view op, const at::Tensor& kv_cache,
                                  const c10::optional<at::Tensor>& cmp_kv,
                                  const c10::optional<at::Tensor>& state,
                                  const c10::optional<at::Tensor>& idx_kv_cache,
                                  const c10::optional<at::Tensor>& idx_kv_scale,
                                  const c10::optional<at::Tensor>& inner_state) {
  td::decode::LayerCaches c;
  c.kv_cache = bf16_rows(kv_cache, op, "kv_cache");
  c.cmp_kv = opt_pool<td::bf16, 2>(cmp_kv,
                                   [&](const at::Tensor& t) { return bf16_rows(t, op, "cmp_kv"); });
  c.state =
      opt_pool<float, 2>(state, [&](const at::Tensor& t) { return state_rows(t, op, "state"); });
  c.idx_kv_cache = opt_pool<std::int8_t, 2>(
      idx_kv_cache, [&](const at::Tensor& t) { return int8_rows(t, op, "idx_kv_cache"); });
  c.idx_kv_scale = opt_pool<float, 1>(
      idx_kv_scale, [&](const at::Tensor& t) { return scale_rows(t, op, "idx_kv_scale"); });
  c.inner_state = opt_pool<float, 2>(
      inner_state, [&](const at::Tensor& t) { return state_rows(t, op, "inner_state"); });
  return c;
}

td::decode::LayerOptions options_of(std::string_view op, std::int64_t indexer_rope) {
  if (indexer_rope != 0 && indexer_rope != 1)
    value_error(op, "indexer_rope",
                "= " + std::to_string(indexer_rope) + "; allowed 0 (absolute) or 1 (reference)");
  return {indexer_rope == 0 ? td::decode::IndexerRope::absolute
                            : td::decode::IndexerRope::reference};
}

void same_config(std::string_view op, std::string_view arg, const std::string& got,
                 const std::string& want) {
  if (got != want)
    value_error(op, arg,
                "was made for config '" + got + "'; allowed the weights' config '" + want + "'");
}

}  // namespace

void layer_step(const at::Tensor& x_out, const at::Tensor& x_hc,
                const c10::intrusive_ptr<LayerWeights>& weights, const at::Tensor& kv_cache,
                const c10::optional<at::Tensor>& cmp_kv, const c10::optional<at::Tensor>& state,
                const c10::optional<at::Tensor>& idx_kv_cache,
                const c10::optional<at::Tensor>& idx_kv_scale,
                const c10::optional<at::Tensor>& inner_state,
                const c10::intrusive_ptr<StepMetadata>& md, const at::Tensor& rope_cos,
                const at::Tensor& rope_sin, const c10::intrusive_ptr<Workspace>& ws,
                std::int64_t indexer_rope, const c10::optional<at::Tensor>& times) {
  constexpr std::string_view op = "layer_step";
  same_config(op, "md", md->config, weights->config);
  same_config(op, "ws", ws->config, weights->config);
  const auto out = view_of<float, 3>(x_out, op, "x_out");
  const auto in = cview_of<float, 3>(x_hc, op, "x_hc");
  const td::decode::LayerCaches c =
      caches_of(op, kv_cache, cmp_kv, state, idx_kv_cache, idx_kv_scale, inner_state);
  td::View<double, 2> tv;
  if (times.has_value()) {
    tv = view_of<double, 2>(*times, op, "times");
    td::check_rows(op, "times", tv, {2, td::decode::kNumKernels});
  }
  const auto rope = rope_of(rope_cos, rope_sin, op);
  const auto opt = options_of(op, indexer_rope);
  std::lock_guard lk(ws->m);
  td::decode::KernelTimes kt;
  td::decode::layer_step(cpu_backend(), out, in, weights->w, c, md->md, rope, *ws->ws, weights->cfg,
                         opt, times.has_value() ? &kt : nullptr);
  if (times.has_value())
    for (int k = 0; k < td::decode::kNumKernels; ++k) {
      tv(0, k) += kt.seconds[k];
      tv(1, k) += double(kt.calls[k]);
    }
}

void cpp_decode_loop(const at::Tensor& x_out, const at::Tensor& x_hc,
                     const c10::intrusive_ptr<LayerWeights>& weights, const at::Tensor& kv_cache,
                     const c10::optional<at::Tensor>& cmp_kv,
                     const c10::optional<at::Tensor>& state,
                     const c10::optional<at::Tensor>& idx_kv_cache,
                     const c10::optional<at::Tensor>& idx_kv_scale,
                     const c10::optional<at::Tensor>& inner_state, const at::Tensor& starts,
                     std::int64_t seq, std::int64_t commit_tokens, const at::Tensor& block_table,
                     const at::Tensor& cmp_block_table, const at::Tensor& idx_block_table,
                     const at::Tensor& hca_state_table, const at::Tensor& csa_state_table,
                     const at::Tensor& csa_inner_state_table, std::vector<std::int64_t> pools,
                     const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                     std::int64_t indexer_rope) {
  constexpr std::string_view op = "_cpp_decode_loop";
  const td::ModelConfig& cfg = weights->cfg;
  const auto out = view_of<float, 4>(x_out, op, "x_out");
  const auto in = cview_of<float, 4>(x_hc, op, "x_hc");
  const auto st = cview_of<std::int32_t, 2>(starts, op, "starts");
  if (!starts.is_contiguous()) value_error(op, "starts", "is not contiguous");
  td::check_equal<index_t>(op, "x_hc.extent(0)", in.extent(0), st.extent(0));
  td::check_equal<index_t>(op, "x_out.extent(0)", out.extent(0), st.extent(0));
  const td::decode::LayerCaches c =
      caches_of(op, kv_cache, cmp_kv, state, idx_kv_cache, idx_kv_scale, inner_state);
  const td::paged::StepTables tb =
      step_tables_of(op, block_table, cmp_block_table, idx_block_table, hca_state_table,
                     csa_state_table, csa_inner_state_table);
  const td::paged::PoolSizes ps = pool_sizes(op, pools);
  const int B = int(st.extent(1)), S = int(seq);
  const auto be = cpu_backend();
  td::paged::StepMetadata md(B, S, cfg);
  td::decode::Workspace ws(cfg, B, S, be);
  const auto rope = rope_of(rope_cos, rope_sin, op);
  const auto opt = options_of(op, indexer_rope);
  for (index_t step = 0; step < st.extent(0); ++step) {
    md.build(std::span<const std::int32_t>(&st(step, 0), std::size_t(B)),
             {B, S, int(commit_tokens)}, tb, ps, cfg);
    td::decode::layer_step(be, out.row(step), in.row(step), weights->w, c, md, rope, ws, cfg, opt);
  }
}

c10::Dict<std::string, at::Tensor> workspace_tensors(const c10::intrusive_ptr<Workspace>& ws,
                                                     std::int64_t batch, std::int64_t seq) {
  c10::Dict<std::string, at::Tensor> d;
  td::decode::StepViews v = ws->ws->views(int(batch), int(seq));
  auto add = [&]<class T, std::size_t R>(const char* name, td::View<T, R> t) {
    std::vector<std::int64_t> sizes(R), strides(R);
    for (std::size_t i = 0; i < R; ++i) sizes[i] = t.extent(i), strides[i] = t.stride(i);
    c10::intrusive_ptr<Workspace> keep = ws;
    d.insert(name, at::from_blob(
                       t.data(), sizes, strides, [keep](void*) {},
                       at::TensorOptions().dtype(Dtype<T>::value)));
  };
  add("x_mixed", v.x_mixed);
  add("post", v.post);
  add("comb", v.comb);
  add("x_n", v.x_n);
  add("q", v.q);
  add("kv", v.kv);
  add("qr", v.qr);
  add("qr_scale", v.qr_scale);
  add("cmp_kv_out", v.cmp_kv_out);
  add("idx_kv_out", v.idx_kv_out);
  add("idx_q_i8", v.idx_q_i8);
  add("idx_q_scale", v.idx_q_scale);
  add("idx_weights", v.idx_weights);
  add("idx_rope_pos", v.idx_rope_pos);
  add("score", v.score);
  add("topk_idxs", v.topk_idxs);
  add("o_packed", v.o_packed);
  add("attn_out", v.attn_out);
  return d;
}

TORCH_LIBRARY_IMPL(tiledecode, CompositeImplicitAutograd, m) {
  m.impl("layer_step", TORCH_FN(layer_step));
  m.impl("_cpp_decode_loop", TORCH_FN(cpp_decode_loop));
}

}  // namespace tdpy
