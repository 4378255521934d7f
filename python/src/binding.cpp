// The binding's shared pieces (binding.hpp): checks, configuration, executor, holder classes.
#include "binding.hpp"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <utility>

#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/core/error.hpp"

namespace tdpy {

void value_error(std::string_view op, std::string_view arg, const std::string& what) {
  TORCH_CHECK_VALUE(false, "tiledecode.", std::string(op), ": argument '", std::string(arg), "' ",
                    what);
  std::abort();  // not reached: TORCH_CHECK_VALUE(false, ...) throws
}

void check_tensor(const at::Tensor& t, std::string_view op, std::string_view arg,
                  c10::ScalarType dtype, std::size_t rank, bool out) {
  if (!t.defined()) value_error(op, arg, "is an undefined tensor; allowed a CPU tensor");
  if (!t.device().is_cpu())
    value_error(
        op, arg,
        "is on device '" + t.device().str() +
            "'; allowed CPU tensors only (tiledecode runs on the CPU; move it with .cpu())");
  if (t.layout() != c10::kStrided)
    value_error(op, arg, "has a non-strided layout; allowed a dense (strided) tensor");
  if (t.scalar_type() != dtype)
    value_error(op, arg,
                std::string("has dtype ") + c10::toString(t.scalar_type()) + "; allowed " +
                    c10::toString(dtype));
  if (std::size_t(t.dim()) != rank)
    value_error(
        op, arg,
        "has " + std::to_string(t.dim()) + " dimensions; allowed exactly " + std::to_string(rank));
  if (out && t.numel() > 1 && at::has_internal_overlap(t) == at::MemOverlap::Yes)
    value_error(op, arg,
                "has overlapping elements (an expanded / stride-0 output); allowed an output "
                "whose elements are distinct memory");
  if (t.numel() > 0 && t.data_ptr() == nullptr)
    value_error(op, arg, "has no storage; allowed a tensor with data");
}

td::RopeTableView rope_of(const at::Tensor& cos, const at::Tensor& sin, std::string_view op) {
  return {cview_of<td::bf16, 2>(cos, op, "rope_cos"), cview_of<td::bf16, 2>(sin, op, "rope_sin")};
}

// ---- configuration ------------------------------------------------------------------------------

td::ModelConfig parse_config(std::string_view op, const std::string& config) {
  const std::string_view s = config;
  const std::size_t colon = s.find(':');
  const std::string_view preset = s.substr(0, colon);
  td::ModelConfig c;
  if (preset == "flash")
    c = td::flash_config();
  else if (preset == "pro")
    c = td::pro_config();
  else
    value_error(op, "config",
                "= '" + config +
                    "' does not name a preset; allowed flash or pro, "
                    "optionally followed by ':key=value,...'");
  if (colon == std::string_view::npos) return c;
  std::string_view rest = s.substr(colon + 1);
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const std::size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    int value = 0;
    const std::string_view num = eq == std::string_view::npos ? "" : item.substr(eq + 1);
    const auto r = std::from_chars(num.data(), num.data() + num.size(), value);
    if (num.empty() || r.ec != std::errc() || r.ptr != num.data() + num.size() || value <= 0)
      value_error(op, "config", "item '" + std::string(item) + "' is not key=<positive integer>");
    int* field = nullptr;
    if (key == "hidden") field = &c.hidden;
    if (key == "n_heads") field = &c.n_heads;
    if (key == "q_lora") field = &c.q_lora;
    if (key == "o_lora") field = &c.o_lora;
    if (key == "o_groups") field = &c.o_groups;
    if (key == "idx_n_heads") field = &c.idx_n_heads;
    if (key == "idx_topk") field = &c.idx_topk;
    if (key == "max_seq_len") field = &c.max_seq_len;
    if (key == "page") field = &c.page;
    if (key == "c4_state_page") field = &c.c4_state_page;
    if (key == "c128_state_page") field = &c.c128_state_page;
    if (key == "window") field = &c.window;
    if (field == nullptr)
      value_error(op, "config",
                  "key '" + std::string(key) +
                      "' is unknown; allowed hidden, n_heads, q_lora, o_lora, o_groups, "
                      "idx_n_heads, idx_topk, max_seq_len, page, c4_state_page, c128_state_page, "
                      "window");
    *field = value;
  }
  return c;
}

// ---- threads ------------------------------------------------------------------------------------

namespace {

// Runs the tasks on torch's intra-op pool: the thread count is torch.get_num_threads().
// at::parallel_for hands each thread a contiguous range of task indices; the library's kernels
// split their work by shape only, so results do not depend on how tasks map to threads.
class TorchExecutor final : public td::Executor {
 public:
  void run(std::size_t n_tasks, td::FunctionRef body) override {
    if (n_tasks == 0) return;
    if (n_tasks == 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
      for (std::size_t i = 0; i < n_tasks; ++i) body(i);
      return;
    }
    at::parallel_for(0, std::int64_t(n_tasks), 1, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) body(std::size_t(i));
    });
  }
  std::size_t concurrency() const override {
    return std::size_t(std::max(1, at::get_num_threads()));
  }
};

struct Threads {
  std::mutex m;
  TorchExecutor torch_exec;
  std::unique_ptr<td::ThreadPool> pool;  // set_num_threads(n > 0)
  bool isa_forced = false;
  td::cpu::Isa isa = td::cpu::Isa::scalar;
};
Threads& threads() {
  static Threads t;
  return t;
}

}  // namespace

td::Executor& executor() {
  Threads& t = threads();
  std::lock_guard lk(t.m);
  if (t.pool) return *t.pool;
  return t.torch_exec;
}

void set_num_threads(std::int64_t n) {
  if (n < 0 || n > 4096)
    value_error("set_num_threads", "n", "= " + std::to_string(n) + "; allowed [0, 4096]");
  Threads& t = threads();
  std::lock_guard lk(t.m);
  t.pool.reset();
  if (n > 0) t.pool = std::make_unique<td::ThreadPool>(std::size_t(n));
}

std::int64_t num_threads() {
  return std::int64_t(executor().concurrency());
}

td::cpu::Context cpu_context() {
  Threads& t = threads();
  td::Executor* ex = &executor();
  std::lock_guard lk(t.m);
  return t.isa_forced ? td::cpu::Context{ex, t.isa} : td::cpu::make_context(ex);
}

td::decode::Backend cpu_backend() {
  const td::cpu::Context c = cpu_context();
  return td::decode::Backend::cpu(c.exec, c.isa);
}

void set_isa(const std::string& name) {
  Threads& t = threads();
  if (name.empty()) {
    std::lock_guard lk(t.m);
    t.isa_forced = false;
    return;
  }
  const td::cpu::Isa isa = td::cpu::checked_isa(td::cpu::isa_from_string("set_isa", name));
  std::lock_guard lk(t.m);
  t.isa_forced = true;
  t.isa = isa;
}

std::string isa_name() {
  return std::string(td::cpu::to_string(cpu_context().isa));
}

// ---- holders ------------------------------------------------------------------------------------

td::LayerKind layer_kind(std::string_view op, std::int64_t kind) {
  if (kind == 0) return td::LayerKind::swa;
  if (kind == 4) return td::LayerKind::csa;
  if (kind == 128) return td::LayerKind::hca;
  value_error(op, "kind", "= " + std::to_string(kind) + "; allowed 0 (swa), 4 (csa), 128 (hca)");
}

StepMetadata::StepMetadata(std::int64_t max_batch, std::int64_t max_seq, std::string config_)
    : config(std::move(config_)), cfg(parse_config("StepMetadata", config)) {
  td::check_range<std::int64_t>("StepMetadata", "max_batch", max_batch, 1, 1 << 20);
  td::check_range<std::int64_t>("StepMetadata", "max_seq", max_seq, 1, 1 << 10);
  md = td::paged::StepMetadata(int(max_batch), int(max_seq), cfg);
}

Workspace::Workspace(std::int64_t max_batch, std::int64_t max_seq, std::string config_)
    : config(std::move(config_)), cfg(parse_config("Workspace", config)) {
  td::check_range<std::int64_t>("Workspace", "max_batch", max_batch, 1, 1 << 16);
  td::check_range<std::int64_t>("Workspace", "max_seq", max_seq, 1, 1 << 10);
  ws = std::make_unique<td::decode::Workspace>(cfg, int(max_batch), int(max_seq), cpu_backend());
}

std::vector<std::string> weight_names(td::LayerKind kind) {
  std::vector<std::string> n = {"hc_fn",     "hc_scale", "hc_base",    "attn_norm", "wq_a",
                                "gamma_cq",  "wq_b",     "wq_b_scale", "wkv",       "gamma_ckv",
                                "attn_sink", "wo_a",     "wo_b",       "wo_b_scale"};
  if (kind == td::LayerKind::swa) return n;
  for (const char* s : {"cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w"}) n.emplace_back(s);
  if (kind == td::LayerKind::hca) return n;
  for (const char* s : {"idx_wq_b", "idx_wq_b_scale", "weights_proj", "hadamard", "inner_wkv",
                        "inner_wgate", "inner_ape", "inner_norm_w"})
    n.emplace_back(s);
  return n;
}

LayerWeights::LayerWeights(std::int64_t kind_, c10::Dict<std::string, at::Tensor> tensors_,
                           std::string config_)
    : config(std::move(config_)),
      cfg(parse_config("LayerWeights", config)),
      kind(layer_kind("LayerWeights", kind_)),
      tensors(std::move(tensors_)) {
  constexpr std::string_view op = "LayerWeights";
  const std::vector<std::string> names = weight_names(kind);
  for (const auto& e : tensors)
    if (std::find(names.begin(), names.end(), e.key()) == names.end())
      value_error(op, e.key(),
                  "is not a weight of " + std::string(td::to_string(kind)) +
                      " layers (tiledecode.weight_names(kind) lists them)");
  auto get = [&](const char* name) -> at::Tensor {
    if (!tensors.contains(name))
      value_error(op, name, "is missing; " + std::string(td::to_string(kind)) + " layers need it");
    return tensors.at(name);  // the dict holds the tensor: its data outlives this view
  };
  auto bf = [&]<std::size_t R>(const char* n) { return cview_of<td::bf16, R>(get(n), op, n); };
  auto f32 = [&]<std::size_t R>(const char* n) { return cview_of<float, R>(get(n), op, n); };
  auto i8 = [&](const char* n) { return cview_of<std::int8_t, 2>(get(n), op, n); };
  w.kind = kind;
  w.hc = {f32.operator()<2>("hc_fn"), f32.operator()<1>("hc_scale"), f32.operator()<1>("hc_base")};
  w.attn_norm = bf.operator()<1>("attn_norm");
  w.qkv = {bf.operator()<2>("wq_a"),
           bf.operator()<1>("gamma_cq"),
           i8("wq_b"),
           f32.operator()<1>("wq_b_scale"),
           bf.operator()<2>("wkv"),
           bf.operator()<1>("gamma_ckv"),
           nullptr};
  w.attn_sink = f32.operator()<1>("attn_sink");
  w.wo_a = bf.operator()<3>("wo_a");
  w.wo_b = i8("wo_b");
  w.wo_b_scale = f32.operator()<1>("wo_b_scale");
  // The rounding checks' norms (the step validates their shapes against the config).
  wq_a_norm = td::kernels::qkv_wq_a_norms(w.qkv.wq_a);
  w.qkv.wq_a_norm = wq_a_norm.view();
  wkv_norm = td::kernels::qkv_wkv_norms(w.qkv.wkv);
  w.qkv.wkv_norm = wkv_norm.view();
  // The transposed wq_a | wkv that those two checks' repairs read (a row per dot instead of a
  // cache line per k of a column: 10-21 % of the q/kv projection on an Intel Xeon, T = 8-128), as
  // LayerWeightsStorage::pack makes it, except where the projection's own dots would run on it
  // (kernels::qkv_bf16_rows_useful: AMD with AVX-512): there the step keeps the standalone ops'
  // FMA order and bits, and the repairs read the columns (+4 % on Zen 5, docs/compressors.md).
  if (!td::kernels::qkv_bf16_rows_useful()) {
    qkv_rows = td::kernels::pack_qkv_bf16_rows(cfg, w.qkv.wq_a, w.qkv.wkv);
    w.qkv.bf16_rows = &qkv_rows;
  }
  wo_a_norm = td::kernels::output_projection_row_norms(w.wo_a);
  w.wo_a_norm = wo_a_norm.view();
  if (td::cpu::cpu_supports(td::cpu::Isa::avx2_vnni) ||
      td::cpu::cpu_supports(td::cpu::Isa::avx512)) {
    wq_b_packed = td::kernels::pack_qkv_wq_b(cfg, w.qkv.wq_b);
    w.qkv.wq_b_packed = &wq_b_packed;
  }
  if (kind == td::LayerKind::swa) return;
  w.compressor = {bf.operator()<2>("cmp_wkv"), bf.operator()<2>("cmp_wgate"),
                  f32.operator()<2>("cmp_ape"), bf.operator()<1>("cmp_norm_w")};
  if (kind == td::LayerKind::hca) return;
  w.indexer.wq_b = i8("idx_wq_b");
  w.indexer.wq_b_scale = f32.operator()<1>("idx_wq_b_scale");
  w.indexer.weights_proj = bf.operator()<2>("weights_proj");
  w.indexer.hadamard = bf.operator()<2>("hadamard");
  w.indexer.compressor = {bf.operator()<2>("inner_wkv"), bf.operator()<2>("inner_wgate"),
                          f32.operator()<2>("inner_ape"), bf.operator()<1>("inner_norm_w")};
  idx_packed = td::kernels::pack_indexer_query_weights(cfg, w.indexer.wq_b, w.indexer.wq_b_scale,
                                                       w.indexer.hadamard);
  w.indexer.packed_query = &idx_packed;
}

void LayerWeights::enable_compressor_rounding_check() {
  if (kind == td::LayerKind::swa || cmp_row_norms.size() > 0) return;
  cmp_row_norms = td::kernels::compressor_row_norms(w.compressor.wkv, w.compressor.wgate);
  w.compressor.row_norms = cmp_row_norms.view();
  if (kind != td::LayerKind::csa) return;
  inner_row_norms =
      td::kernels::compressor_row_norms(w.indexer.compressor.wkv, w.indexer.compressor.wgate);
  w.indexer.compressor.row_norms = inner_row_norms.view();
}

}  // namespace tdpy
