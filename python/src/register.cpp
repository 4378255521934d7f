// The torch.ops.tiledecode library: the holder classes (torch.classes.tiledecode.*) and every op's
// schema, in one place (a schema that names a class needs the class registered first; static
// initialisation order across translation units is unspecified). The kernels are registered by
// their family's TU with TORCH_LIBRARY_IMPL(tiledecode, CompositeImplicitAutograd): every device
// and autograd key (meta included: torch 1.13 has no AutogradMeta fallthrough) reaches the
// binding, which rejects a non-CPU tensor with a clear ValueError instead of the dispatcher's
// "could not run ... with arguments from the 'CUDA' backend". The ops record no autograd graph
// (decode is inference; outputs are written in place).
//
// Conventions (PyTorch's): outputs and caches written in place are `Tensor(a!)`, optional ones
// `Tensor(a!)?`; every op returns nothing (destination first, as in the library). `config` is
// "flash", "pro" or a preset with overrides ("flash:hidden=512,n_heads=8").
#include <torch/library.h>

#include "binding.hpp"
#include "ops.hpp"

namespace tdpy {

namespace {
std::int64_t get_num_threads() {
  return num_threads();
}
void set_isa_op(const std::string& name) {
  set_isa(name);
}
std::string get_isa() {
  return isa_name();
}
std::vector<std::string> weight_names_op(std::int64_t kind) {
  return weight_names(layer_kind("weight_names", kind));
}
}  // namespace

#define TD_CLS(name) "__torch__.torch.classes.tiledecode." name

TORCH_LIBRARY(tiledecode, m) {
  m.class_<StepMetadata>("StepMetadata")
      .def(torch::init<std::int64_t, std::int64_t, std::string>())
      .def("built", [](const c10::intrusive_ptr<StepMetadata>& s) { return s->md.built(); })
      .def("batch",
           [](const c10::intrusive_ptr<StepMetadata>& s) {
             return std::int64_t(s->md.built() ? s->md.shape().batch : 0);
           })
      .def("seq",
           [](const c10::intrusive_ptr<StepMetadata>& s) {
             return std::int64_t(s->md.built() ? s->md.shape().seq : 0);
           })
      .def("config", [](const c10::intrusive_ptr<StepMetadata>& s) { return s->config; })
      .def("tensors", &metadata_tensors)
      .def("check_disjoint_rows",
           [](const c10::intrusive_ptr<StepMetadata>& s) { s->md.check_disjoint_rows(); });
  m.class_<Workspace>("Workspace")
      .def(torch::init<std::int64_t, std::int64_t, std::string>())
      .def("bytes",
           [](const c10::intrusive_ptr<Workspace>& w) { return std::int64_t(w->ws->bytes()); })
      .def("config", [](const c10::intrusive_ptr<Workspace>& w) { return w->config; })
      .def("tensors", &workspace_tensors);
  m.class_<LayerWeights>("LayerWeights")
      .def(torch::init<std::int64_t, c10::Dict<std::string, at::Tensor>, std::string>())
      .def("kind", [](const c10::intrusive_ptr<LayerWeights>& w) { return std::int64_t(w->kind); })
      .def("config", [](const c10::intrusive_ptr<LayerWeights>& w) { return w->config; })
      .def("tensors", [](const c10::intrusive_ptr<LayerWeights>& w) { return w->tensors; })
      .def("enable_compressor_rounding_check", &LayerWeights::enable_compressor_rounding_check)
      .def("compressor_rounding_check",
           [](const c10::intrusive_ptr<LayerWeights>& w) { return w->cmp_row_norms.size() > 0; });

  // ---- runtime
  m.def("set_num_threads(int n) -> ()", &set_num_threads);
  m.def("get_num_threads() -> int", &get_num_threads);
  m.def("set_isa(str name) -> ()", &set_isa_op);
  m.def("get_isa() -> str", &get_isa);
  m.def("weight_names(int kind) -> str[]", &weight_names_op);
  m.def("rope_table(int kind, int length, str config=\"flash\") -> (Tensor cos, Tensor sin)",
        &rope_table);

  // ---- metadata and paged caches (spec §3)
  m.def("build_metadata(" TD_CLS("StepMetadata") " md, Tensor starts, int seq, int commit_tokens, "
        "Tensor block_table, Tensor cmp_block_table, Tensor idx_block_table, "
        "Tensor hca_state_table, Tensor csa_state_table, Tensor csa_inner_state_table, "
        "int[] pools, int layout=0, Tensor? hca_cmp_block_table=None, "
        "Tensor? csa_cmp_block_table=None, Tensor? block_counts=None) -> ()");
  m.def("write_cache(Tensor(a!) pool, Tensor rows, Tensor slot_mapping) -> ()");
  m.def("gather_rows(Tensor(a!) dst, Tensor(b!) valid, Tensor pool, Tensor slots) -> ()");
  m.def(
      "gather_windows(Tensor(a!) dst, Tensor(b!) valid, Tensor pool, Tensor window_indices) -> "
      "()");
  m.def(
      "gather_logical_rows(Tensor(a!) dst, Tensor(b!) valid, Tensor pool, Tensor table_row, "
      "Tensor rows, int page) -> ()");

  // ---- front end (spec §4)
  m.def(
      "hc_pre(Tensor(a!) x_mixed, Tensor(b!) post, Tensor(c!) comb, Tensor x_hc, Tensor hc_fn, "
      "Tensor hc_scale, Tensor hc_base, str config=\"flash\") -> ()");
  m.def("rmsnorm(Tensor(a!) x_n, Tensor x, Tensor weight, float eps=1e-06) -> ()");
  m.def(
      "qkv_projection(Tensor(a!) q, Tensor(b!) kv, Tensor(c!) qr, Tensor(d!) qr_scale, "
      "Tensor x_n, Tensor wq_a, Tensor gamma_cq, Tensor wq_b, Tensor wq_b_scale, Tensor wkv, "
      "Tensor gamma_ckv, Tensor rope_cos, Tensor rope_sin, Tensor position_ids, "
      "str config=\"flash\", Tensor? wq_a_norm=None, Tensor? wkv_norm=None) -> ()");
  m.def(
      "hc_post(Tensor(a!) x_out, Tensor attn_out, Tensor x_hc, Tensor post, Tensor comb, "
      "str config=\"flash\") -> ()");

  // ---- compressors (spec §6)
  m.def(
      "compressor(Tensor(a!) state, Tensor(b!) cmp_kv, Tensor(c!)? kv_out, Tensor x_n, "
      "Tensor wkv, Tensor wgate, Tensor ape, Tensor norm_w, Tensor positions, "
      "Tensor state_slot_mapping, Tensor cmp_slot_mapping, Tensor state_table, Tensor rope_cos, "
      "Tensor rope_sin, int ratio, int seq, str config=\"flash\", Tensor? row_norms=None) -> ()");
  m.def(
      "indexer_compressor(Tensor(a!) state, Tensor(b!) idx_kv_cache, Tensor(c!) idx_kv_scale, "
      "Tensor(d!)? kv_out, Tensor x_n, Tensor wkv, Tensor wgate, Tensor ape, Tensor norm_w, "
      "Tensor hadamard, Tensor positions, Tensor state_slot_mapping, Tensor idx_slot_mapping, "
      "Tensor state_table, Tensor rope_cos, Tensor rope_sin, int seq, int rope_rule=0, "
      "str config=\"flash\", Tensor? row_norms=None) -> ()");
  m.def("compressor_row_norms(Tensor(a!) norm, Tensor wkv, Tensor wgate) -> ()");

  // ---- lightning indexer (spec §7)
  m.def(
      "indexer_query(Tensor(a!) q_i8, Tensor(b!) q_scale, Tensor qr, Tensor qr_scale, "
      "Tensor wq_b, Tensor wq_b_scale, Tensor hadamard, Tensor rope_pos, Tensor rope_cos, "
      "Tensor rope_sin, str config=\"flash\") -> ()");
  m.def(
      "indexer_weights(Tensor(a!) weights, Tensor x_n, Tensor weights_proj, "
      "str config=\"flash\") -> ()");
  m.def(
      "indexer_score(Tensor(a!) score, Tensor q_i8, Tensor q_scale, Tensor weights, "
      "Tensor idx_kv_cache, Tensor idx_kv_scale, Tensor idx_block_table, Tensor positions, "
      "Tensor kv_seq_lens, int seq, str config=\"flash\") -> ()");
  m.def(
      "indexer_topk(Tensor(a!) topk_idxs, Tensor score, Tensor positions, Tensor kv_seq_lens, "
      "int seq, int topk, int offset=0, str config=\"flash\") -> ()");

  // ---- attention and output projection (spec §8)
  m.def(
      "sparse_attention(Tensor(a!) o_packed, Tensor q, Tensor kv_cache, Tensor? cmp_kv, "
      "Tensor window_indices, Tensor window_lens, Tensor? topk_idxs, Tensor? cmp_block_table, "
      "Tensor positions, Tensor kv_seq_lens, int seq, Tensor attn_sink, Tensor rope_cos, "
      "Tensor rope_sin, int kind, str config=\"flash\") -> ()");
  m.def(
      "output_projection(Tensor(a!) attn_out, Tensor o_packed, Tensor wo_a, Tensor wo_b, "
      "Tensor wo_b_scale, str config=\"flash\", Tensor? wo_a_norm=None) -> ()");
  // The rounding checks' norms (issue 17): pass them to qkv_projection / output_projection to get
  // the layer step's bits (LayerWeights makes them at load time).
  m.def("qkv_wq_a_norms(Tensor(a!) norm, Tensor wq_a) -> ()");
  m.def("qkv_wkv_norms(Tensor(a!) norm, Tensor wkv) -> ()");
  m.def("output_projection_row_norms(Tensor(a!) norm, Tensor wo_a) -> ()");

  // ---- one whole layer (spec §4, §9.2)
  m.def("layer_step(Tensor(a!) x_out, Tensor x_hc, " TD_CLS("LayerWeights") " weights, "
        "Tensor(b!) kv_cache, Tensor(c!)? cmp_kv, Tensor(d!)? state, Tensor(e!)? idx_kv_cache, "
        "Tensor(f!)? idx_kv_scale, Tensor(g!)? inner_state, " TD_CLS("StepMetadata") " md, "
        "Tensor rope_cos, Tensor rope_sin, " TD_CLS("Workspace") " ws, int indexer_rope=0, "
        "Tensor(h!)? times=None) -> ()");
  // Test helper: the same layer for every step of `starts` [steps, B], run by a C++ loop calling
  // decode::layer_step directly (own StepMetadata and Workspace); x_hc / x_out [steps, T, 4, D].
  m.def("_cpp_decode_loop(Tensor(a!) x_out, Tensor x_hc, " TD_CLS("LayerWeights") " weights, "
        "Tensor(b!) kv_cache, Tensor(c!)? cmp_kv, Tensor(d!)? state, Tensor(e!)? idx_kv_cache, "
        "Tensor(f!)? idx_kv_scale, Tensor(g!)? inner_state, Tensor starts, int seq, "
        "int commit_tokens, Tensor block_table, Tensor cmp_block_table, Tensor idx_block_table, "
        "Tensor hca_state_table, Tensor csa_state_table, Tensor csa_inner_state_table, "
        "int[] pools, Tensor rope_cos, Tensor rope_sin, int indexer_rope=0) -> ()");
}

#undef TD_CLS

}  // namespace tdpy
