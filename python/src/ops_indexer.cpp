// torch.ops.tiledecode: the compressors (CSA ratio 4, HCA ratio 128, the indexer's inner one) and
// the lightning indexer — query, head weights, fused INT8 score, top-k (spec §6, §7). CPU tiers
// only (cpu::Context); per-call scratch, the caller's outputs and pools.
#include <torch/library.h>

#include "binding.hpp"
#include "ops.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/kernels/indexer.hpp"

namespace tdpy {

namespace tk = td::kernels;

namespace {

tk::CompressorMetadata compressor_meta(std::string_view op, const at::Tensor& positions,
                                       const at::Tensor& state_slot_mapping,
                                       const at::Tensor& cmp_slot_mapping,
                                       const at::Tensor& state_table, std::int64_t seq) {
  const auto pos = cview_of<std::int32_t, 1>(positions, op, "positions");
  td::check_range<std::int64_t>(op, "seq", seq, 1, 1 << 10);
  if (pos.extent(0) % seq != 0)
    td::throw_arg(op, "positions.extent(0)", pos.extent(0),
                  "a multiple of seq = " + std::to_string(seq) + " (T = B * S)");
  // Commit masking is already in cmp_slot_mapping (-1 on uncommitted boundaries).
  const td::paged::StepShape sh{int(pos.extent(0) / seq), int(seq), -1};
  return {sh, pos, cview_of<std::int64_t, 1>(state_slot_mapping, op, "state_slot_mapping"),
          cview_of<std::int64_t, 1>(cmp_slot_mapping, op, "cmp_slot_mapping"),
          cview_of<std::int32_t, 2>(state_table, op, "state_table")};
}

tk::CompressorWeights compressor_weights(std::string_view op, const at::Tensor& wkv,
                                         const at::Tensor& wgate, const at::Tensor& ape,
                                         const at::Tensor& norm_w,
                                         const c10::optional<at::Tensor>& row_norms) {
  // row_norms: the opt-in rounding check's (compressor_row_norms; docs/compressors.md).
  return {cview_of<td::bf16, 2>(wkv, op, "wkv"), cview_of<td::bf16, 2>(wgate, op, "wgate"),
          cview_of<float, 2>(ape, op, "ape"), cview_of<td::bf16, 1>(norm_w, op, "norm_w"),
          opt_view_of<const float, 1>(row_norms, op, "row_norms")};
}

}  // namespace

void compressor(const at::Tensor& state, const at::Tensor& cmp_kv,
                const c10::optional<at::Tensor>& kv_out, const at::Tensor& x_n,
                const at::Tensor& wkv, const at::Tensor& wgate, const at::Tensor& ape,
                const at::Tensor& norm_w, const at::Tensor& positions,
                const at::Tensor& state_slot_mapping, const at::Tensor& cmp_slot_mapping,
                const at::Tensor& state_table, const at::Tensor& rope_cos,
                const at::Tensor& rope_sin, std::int64_t ratio, std::int64_t seq,
                const std::string& config, const c10::optional<at::Tensor>& row_norms) {
  constexpr std::string_view op = "compressor";
  const td::ModelConfig cfg = parse_config(op, config);
  if (ratio != 4 && ratio != 128)
    value_error(op, "ratio", "= " + std::to_string(ratio) + "; allowed 4 (CSA) or 128 (HCA)");
  const tk::CompressorSpec spec =
      ratio == 4 ? tk::csa_compressor_spec(cfg) : tk::hca_compressor_spec(cfg);
  const auto meta =
      compressor_meta(op, positions, state_slot_mapping, cmp_slot_mapping, state_table, seq);
  td::Buffer<float> ws(std::size_t(tk::compressor_workspace_size(cfg, spec, meta.shape.tokens())));
  tk::compressor_step(
      cpu_context(), cfg, spec, state_rows(state, op, "state"), bf16_rows(cmp_kv, op, "cmp_kv"),
      opt_view_of<float, 2>(kv_out, op, "kv_out"), cview_of<td::bf16, 2>(x_n, op, "x_n"),
      compressor_weights(op, wkv, wgate, ape, norm_w, row_norms), meta,
      rope_of(rope_cos, rope_sin, op), td::View<float, 1>(ws.data(), {index_t(ws.size())}));
}

void indexer_compressor(const at::Tensor& state, const at::Tensor& idx_kv_cache,
                        const at::Tensor& idx_kv_scale, const c10::optional<at::Tensor>& kv_out,
                        const at::Tensor& x_n, const at::Tensor& wkv, const at::Tensor& wgate,
                        const at::Tensor& ape, const at::Tensor& norm_w, const at::Tensor& hadamard,
                        const at::Tensor& positions, const at::Tensor& state_slot_mapping,
                        const at::Tensor& idx_slot_mapping, const at::Tensor& state_table,
                        const at::Tensor& rope_cos, const at::Tensor& rope_sin, std::int64_t seq,
                        std::int64_t rope_rule, const std::string& config,
                        const c10::optional<at::Tensor>& row_norms) {
  constexpr std::string_view op = "indexer_compressor";
  const td::ModelConfig cfg = parse_config(op, config);
  if (rope_rule != 0 && rope_rule != 1)
    value_error(op, "rope_rule",
                "= " + std::to_string(rope_rule) +
                    "; allowed 0 (window start) or 1 (request "
                    "start)");
  const auto meta =
      compressor_meta(op, positions, state_slot_mapping, idx_slot_mapping, state_table, seq);
  td::Buffer<float> ws(std::size_t(
      tk::compressor_workspace_size(cfg, tk::indexer_compressor_spec(cfg), meta.shape.tokens())));
  tk::indexer_compressor_step(
      cpu_context(), cfg, state_rows(state, op, "state"),
      int8_rows(idx_kv_cache, op, "idx_kv_cache"), scale_rows(idx_kv_scale, op, "idx_kv_scale"),
      opt_view_of<float, 2>(kv_out, op, "kv_out"), cview_of<td::bf16, 2>(x_n, op, "x_n"),
      compressor_weights(op, wkv, wgate, ape, norm_w, row_norms),
      cview_of<td::bf16, 2>(hadamard, op, "hadamard"), meta, rope_of(rope_cos, rope_sin, op),
      td::View<float, 1>(ws.data(), {index_t(ws.size())}),
      rope_rule == 0 ? tk::InnerRopePosition::window_start : tk::InnerRopePosition::request_start);
}

// The compressors' opt-in rounding-check norms (a load-time preparation): each row of wkv, then of
// wgate, bounded from above (FP32, +Inf for one with a NaN).
void compressor_row_norms(const at::Tensor& norm, const at::Tensor& wkv, const at::Tensor& wgate) {
  constexpr std::string_view op = "compressor_row_norms";
  const auto k = cview_of<td::bf16, 2>(wkv, op, "wkv");
  const auto g = cview_of<td::bf16, 2>(wgate, op, "wgate");
  const auto nv = view_of<float, 1>(norm, op, "norm");
  td::check_extents(op, "norm", nv, {2 * k.extent(0)});
  const td::Tensor<float, 1> n = tk::compressor_row_norms(k, g);
  for (index_t i = 0; i < 2 * k.extent(0); ++i) nv(i) = n.data()[i];
}

void indexer_query(const at::Tensor& q_i8, const at::Tensor& q_scale, const at::Tensor& qr,
                   const at::Tensor& qr_scale, const at::Tensor& wq_b, const at::Tensor& wq_b_scale,
                   const at::Tensor& hadamard, const at::Tensor& rope_pos,
                   const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                   const std::string& config) {
  constexpr std::string_view op = "indexer_query";
  const td::ModelConfig cfg = parse_config(op, config);
  // The CPU query path reads the load-time packed layout; a standalone call packs per call
  // (layer_step uses the copy LayerWeights made once).
  const tk::IndexerQueryWeights w =
      tk::pack_indexer_query_weights(cfg, cview_of<std::int8_t, 2>(wq_b, op, "wq_b"),
                                     cview_of<float, 1>(wq_b_scale, op, "wq_b_scale"),
                                     cview_of<td::bf16, 2>(hadamard, op, "hadamard"));
  tk::indexer_query(
      cpu_context(), cfg, view_of<std::int8_t, 3>(q_i8, op, "q_i8"),
      view_of<float, 2>(q_scale, op, "q_scale"), cview_of<std::int8_t, 2>(qr, op, "qr"),
      cview_of<float, 1>(qr_scale, op, "qr_scale"), w,
      cview_of<std::int32_t, 1>(rope_pos, op, "rope_pos"), rope_of(rope_cos, rope_sin, op));
}

void indexer_weights(const at::Tensor& weights, const at::Tensor& x_n,
                     const at::Tensor& weights_proj, const std::string& config) {
  constexpr std::string_view op = "indexer_weights";
  const td::ModelConfig cfg = parse_config(op, config);
  tk::indexer_weights(cpu_context(), cfg, view_of<float, 2>(weights, op, "weights"),
                      cview_of<td::bf16, 2>(x_n, op, "x_n"),
                      cview_of<td::bf16, 2>(weights_proj, op, "weights_proj"));
}

void indexer_score(const at::Tensor& score, const at::Tensor& q_i8, const at::Tensor& q_scale,
                   const at::Tensor& weights, const at::Tensor& idx_kv_cache,
                   const at::Tensor& idx_kv_scale, const at::Tensor& idx_block_table,
                   const at::Tensor& positions, const at::Tensor& kv_seq_lens, std::int64_t seq,
                   const std::string& config) {
  constexpr std::string_view op = "indexer_score";
  const td::ModelConfig cfg = parse_config(op, config);
  td::check_range<std::int64_t>(op, "seq", seq, 1, 1 << 10);
  tk::indexer_score(
      cpu_context(), cfg, view_of<float, 2>(score, op, "score"),
      cview_of<std::int8_t, 3>(q_i8, op, "q_i8"), cview_of<float, 2>(q_scale, op, "q_scale"),
      cview_of<float, 2>(weights, op, "weights"), int8_rows(idx_kv_cache, op, "idx_kv_cache"),
      scale_rows(idx_kv_scale, op, "idx_kv_scale"),
      cview_of<std::int32_t, 2>(idx_block_table, op, "idx_block_table"),
      cview_of<std::int32_t, 1>(positions, op, "positions"),
      cview_of<std::int32_t, 1>(kv_seq_lens, op, "kv_seq_lens"), int(seq));
}

void indexer_topk(const at::Tensor& topk_idxs, const at::Tensor& score, const at::Tensor& positions,
                  const at::Tensor& kv_seq_lens, std::int64_t seq, std::int64_t topk,
                  std::int64_t offset, const std::string& config) {
  constexpr std::string_view op = "indexer_topk";
  const td::ModelConfig cfg = parse_config(op, config);
  td::check_range<std::int64_t>(op, "seq", seq, 1, 1 << 10);
  td::check_range<std::int64_t>(op, "topk", topk, 1, std::int64_t(1) << 30);
  td::check_range<std::int64_t>(op, "offset", offset, 0, std::int64_t(1) << 31);
  tk::indexer_topk(cpu_context(), cfg, view_of<std::int32_t, 2>(topk_idxs, op, "topk_idxs"),
                   cview_of<float, 2>(score, op, "score"),
                   cview_of<std::int32_t, 1>(positions, op, "positions"),
                   cview_of<std::int32_t, 1>(kv_seq_lens, op, "kv_seq_lens"), int(seq), int(topk),
                   std::int32_t(offset));
}

TORCH_LIBRARY_IMPL(tiledecode, CompositeImplicitAutograd, m) {
  m.impl("compressor", TORCH_FN(compressor));
  m.impl("indexer_compressor", TORCH_FN(indexer_compressor));
  m.impl("compressor_row_norms", TORCH_FN(compressor_row_norms));
  m.impl("indexer_query", TORCH_FN(indexer_query));
  m.impl("indexer_weights", TORCH_FN(indexer_weights));
  m.impl("indexer_score", TORCH_FN(indexer_score));
  m.impl("indexer_topk", TORCH_FN(indexer_topk));
}

}  // namespace tdpy
