#pragma once
// The PyTorch binding's shared pieces: torch tensors seen as the library's views (zero-copy),
// the binding-level argument checks, the model configuration string, the executor that follows
// torch's thread count, and the holder classes registered as torch.classes.tiledecode.*.
//
// Zero-copy: view_of<T, R>(tensor) is View<T, R>(tensor.data_ptr(), sizes, strides) — the
// library reads and writes the caller's memory, with the caller's strides; nothing is copied and
// no cache is ever reallocated. What the library requires of the strides (unit inner stride of
// rows, ...) it validates itself and reports naming the argument.
//
// Errors: the binding checks what the library cannot see — dtype, device (CPU only), rank,
// strided layout, internal overlap of outputs — and raises ValueError (c10::ValueError) naming
// the op and the argument; every other error is the library's tiledecode::Error (validated before
// the first write: nothing changed), which reaches Python as RuntimeError with the library's
// message.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/backend.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/decode/workspace.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdpy {

namespace td = tiledecode;
using td::index_t;

// ---- errors -------------------------------------------------------------------------------------

// ValueError "tiledecode.<op>: argument '<arg>' <what>".
[[noreturn]] void value_error(std::string_view op, std::string_view arg, const std::string& what);

// ---- dtypes -------------------------------------------------------------------------------------

template <class T>
struct Dtype;
template <>
struct Dtype<td::bf16> {
  static constexpr c10::ScalarType value = c10::ScalarType::BFloat16;
};
template <>
struct Dtype<float> {
  static constexpr c10::ScalarType value = c10::ScalarType::Float;
};
template <>
struct Dtype<double> {
  static constexpr c10::ScalarType value = c10::ScalarType::Double;
};
template <>
struct Dtype<std::int8_t> {
  static constexpr c10::ScalarType value = c10::ScalarType::Char;
};
template <>
struct Dtype<std::uint8_t> {
  static constexpr c10::ScalarType value = c10::ScalarType::Byte;
};
template <>
struct Dtype<std::int32_t> {
  static constexpr c10::ScalarType value = c10::ScalarType::Int;
};
template <>
struct Dtype<std::int64_t> {
  static constexpr c10::ScalarType value = c10::ScalarType::Long;
};

// dtype, device, rank and layout of one tensor argument (ValueError naming it otherwise).
// `out` additionally rejects outputs whose elements overlap (expanded / stride-0 tensors).
void check_tensor(const at::Tensor& t, std::string_view op, std::string_view arg,
                  c10::ScalarType dtype, std::size_t rank, bool out);

// The tensor as a library view: pointer, sizes and strides (in elements) of the tensor itself.
template <class T, std::size_t R>
td::View<T, R> view_of(const at::Tensor& t, std::string_view op, std::string_view arg) {
  using E = std::remove_const_t<T>;
  check_tensor(t, op, arg, Dtype<E>::value, R, !std::is_const_v<T>);
  std::array<index_t, R> shape{}, stride{};
  for (std::size_t d = 0; d < R; ++d) {
    shape[d] = t.size(std::int64_t(d));
    stride[d] = t.stride(std::int64_t(d));
  }
  return td::View<T, R>(static_cast<T*>(t.data_ptr()), shape, stride);
}
template <class T, std::size_t R>
td::ConstView<T, R> cview_of(const at::Tensor& t, std::string_view op, std::string_view arg) {
  return view_of<const T, R>(t, op, arg);
}
// An optional tensor: an empty view when None.
template <class T, std::size_t R>
td::View<T, R> opt_view_of(const c10::optional<at::Tensor>& t, std::string_view op,
                           std::string_view arg) {
  if (!t.has_value() || !t->defined()) return {};
  return view_of<T, R>(*t, op, arg);
}

// The RoPE table of one layer from its BF16 cos / sin [L, 64] tensors.
td::RopeTableView rope_of(const at::Tensor& cos, const at::Tensor& sin, std::string_view op);

// ---- configuration ------------------------------------------------------------------------------

// "flash", "pro", or a preset with overrides: "flash:hidden=512,n_heads=8,max_seq_len=32768".
// Keys: hidden n_heads q_lora o_lora o_groups idx_n_heads idx_topk max_seq_len page c4_state_page
// c128_state_page window. ValueError on anything else.
td::ModelConfig parse_config(std::string_view op, const std::string& config);

// ---- threads ------------------------------------------------------------------------------------

// The executor every op runs on: torch's intra-op pool (at::parallel_for, so the thread count is
// torch.get_num_threads()), or a tiledecode::ThreadPool of the size given to set_num_threads(n).
td::Executor& executor();
void set_num_threads(std::int64_t n);  // n > 0: own pool of n threads; 0: follow torch again
std::int64_t num_threads();
// The CPU backend of one op call (best ISA of this machine, or the one forced by set_isa).
td::decode::Backend cpu_backend();
td::cpu::Context cpu_context();
void set_isa(const std::string& name);  // "" = detect
std::string isa_name();

// ---- holders (torch.classes.tiledecode.*)
// --------------------------------------------------------

// The metadata bundle of one decode step (paged::StepMetadata), built by
// torch.ops.tiledecode.build_metadata, shared by every layer. Keeps the table tensors it was
// built from alive (the bundle views them).
struct StepMetadata : torch::CustomClassHolder {
  StepMetadata(std::int64_t max_batch, std::int64_t max_seq, std::string config);
  std::string config;
  td::ModelConfig cfg;
  td::paged::StepMetadata md;
  std::vector<at::Tensor> tables;  // the tensors md.tables() points into
};

// The scratch of the layer step (decode::Workspace), sized once for max_batch x max_seq tokens.
struct Workspace : torch::CustomClassHolder {
  Workspace(std::int64_t max_batch, std::int64_t max_seq, std::string config);
  std::string config;
  td::ModelConfig cfg;
  std::unique_ptr<td::decode::Workspace> ws;
  std::mutex m;  // one step at a time per workspace
};

// One layer's weights: views of the caller's tensors (kept alive here) plus the load-time packed
// copies the CPU step needs (indexer query weights; wq_b for the VNNI tiers) and the rounding
// checks' norms (wq_a's and wkv's columns, wo_a's rows: the ops qkv_wq_a_norms, qkv_wkv_norms and
// output_projection_row_norms give the same, for the standalone qkv_projection and
// output_projection, as LayerWeightsStorage::pack makes them) and the transposed wq_a | wkv their
// repairs read, except on AMD with AVX-512, where the q/kv projection would run on it
// (QkvWeights::bf16_rows): the standalone ops take plain weight tensors, so the q/kv projection
// keeps the FMA order here and the step's intermediates equal the ops' outputs bit for bit
// (tests/python/test_kernels.py). The compressors' check is opt-in, as
// LayerWeightsStorage::enable_compressor_rounding_check: enable_compressor_rounding_check() makes
// their row norms (the ops' optional row_norms, compressor_row_norms).
struct LayerWeights : torch::CustomClassHolder {
  LayerWeights(std::int64_t kind, c10::Dict<std::string, at::Tensor> tensors, std::string config);
  std::string config;
  td::ModelConfig cfg;
  td::LayerKind kind = td::LayerKind::swa;
  c10::Dict<std::string, at::Tensor> tensors;
  td::kernels::IndexerQueryWeights idx_packed;
  td::QkvPackedWqB wq_b_packed;
  td::Tensor<float, 1> wq_a_norm, wkv_norm;
  td::QkvBf16Rows qkv_rows;  // empty where kernels::qkv_bf16_rows_useful (binding.cpp)
  td::Tensor<float, 2> wo_a_norm;
  td::Tensor<float, 1> cmp_row_norms, inner_row_norms;  // empty until the opt-in below
  td::decode::LayerWeights w;
  // The compressors' rounding check for this layer's compressors (none on SWA; idempotent). Not
  // while a step with these weights runs.
  void enable_compressor_rounding_check();
};

// Names of the weight tensors of a family (LayerWeights' dict keys), in the spec's order.
// The step's pool sizes from an op's `pools` list (6 entries, or 8 with the prefix-caching
// compressed pools) and its six base tables (ops_paged.cpp; shared by build_metadata and
// _cpp_decode_loop).
td::paged::PoolSizes pool_sizes(std::string_view op, const std::vector<std::int64_t>& p);
td::paged::StepTables step_tables_of(std::string_view op, const at::Tensor& block_table,
                                     const at::Tensor& cmp_block_table,
                                     const at::Tensor& idx_block_table,
                                     const at::Tensor& hca_state_table,
                                     const at::Tensor& csa_state_table,
                                     const at::Tensor& csa_inner_state_table);

std::vector<std::string> weight_names(td::LayerKind kind);
td::LayerKind layer_kind(std::string_view op, std::int64_t kind);

}  // namespace tdpy
