// torch.ops.tiledecode: the metadata build, paged cache write / gather, RoPE tables, and the
// tensors of a built StepMetadata (spec §3, §5).
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "binding.hpp"
#include "ops.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdpy {

namespace {

// Rows of a pool or row tensor without a copy: all dimensions but the last collapsed into one
// (the engine's [blocks, page, 1, W] pool is [blocks * page, W]); size-1 dimensions are ignored.
// R = 1 collapses every dimension ([blocks, page, 1, 1] scales → [blocks * page]).
template <class T, std::size_t R>
td::View<T, R> rows_of(const at::Tensor& t, std::string_view op, std::string_view arg) {
  static_assert(R == 1 || R == 2);
  using E = std::remove_const_t<T>;
  if (t.dim() == std::int64_t(R)) return view_of<T, R>(t, op, arg);
  if (t.dim() < std::int64_t(R))
    value_error(
        op, arg,
        "has " + std::to_string(t.dim()) + " dimensions; allowed at least " + std::to_string(R));
  check_tensor(t, op, arg, Dtype<E>::value, std::size_t(t.dim()), !std::is_const_v<T>);
  const std::int64_t keep = R == 2 ? t.dim() - 1 : t.dim();  // dimensions collapsed into rows
  index_t rows = 1, row_stride = 0;
  bool first = true;
  for (std::int64_t d = keep - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (first) {
      row_stride = t.stride(d);
      first = false;
    } else if (t.stride(d) != rows * row_stride) {
      value_error(op, arg,
                  "cannot be seen as rows without a copy (dimension " + std::to_string(d) +
                      " has stride " + std::to_string(t.stride(d)) + ", collapsing needs " +
                      std::to_string(rows * row_stride) + ")");
    }
    rows *= t.size(d);
  }
  if (first) row_stride = R == 2 ? t.size(t.dim() - 1) : 1;
  T* p = static_cast<T*>(t.data_ptr());
  if constexpr (R == 1) {
    return td::View<T, 1>(p, {rows}, {row_stride});
  } else {
    return td::View<T, 2>(p, {rows, t.size(t.dim() - 1)}, {row_stride, t.stride(t.dim() - 1)});
  }
}

td::ConstView<std::int32_t, 2> table_of(const c10::optional<at::Tensor>& t, std::string_view op,
                                        std::string_view arg) {
  if (!t.has_value() || !t->defined()) return {};
  return cview_of<std::int32_t, 2>(*t, op, arg);
}

}  // namespace

td::paged::PoolSizes pool_sizes(std::string_view op, const std::vector<std::int64_t>& p) {
  if (p.size() != 6 && p.size() != 8)
    value_error(op, "pools",
                "has " + std::to_string(p.size()) +
                    " entries; allowed 6 [ori, cmp, idx, hca_state, csa_state, csa_inner_state] "
                    "or 8 (+ hca_cmp, csa_cmp for prefix caching)");
  td::paged::PoolSizes s;
  s.ori = p[0];
  s.cmp = p[1];
  s.idx = p[2];
  s.hca_state = p[3];
  s.csa_state = p[4];
  s.csa_inner_state = p[5];
  if (p.size() == 8) {
    s.hca_cmp = p[6];
    s.csa_cmp = p[7];
  }
  return s;
}

td::paged::StepTables step_tables_of(std::string_view op, const at::Tensor& block_table,
                                     const at::Tensor& cmp_block_table,
                                     const at::Tensor& idx_block_table,
                                     const at::Tensor& hca_state_table,
                                     const at::Tensor& csa_state_table,
                                     const at::Tensor& csa_inner_state_table) {
  return td::paged::StepTables{
      cview_of<std::int32_t, 2>(block_table, op, "block_table"),
      cview_of<std::int32_t, 2>(cmp_block_table, op, "cmp_block_table"),
      cview_of<std::int32_t, 2>(idx_block_table, op, "idx_block_table"),
      cview_of<std::int32_t, 2>(hca_state_table, op, "hca_state_table"),
      cview_of<std::int32_t, 2>(csa_state_table, op, "csa_state_table"),
      cview_of<std::int32_t, 2>(csa_inner_state_table, op, "csa_inner_state_table")};
}

void build_metadata(const c10::intrusive_ptr<StepMetadata>& md, const at::Tensor& starts,
                    std::int64_t seq, std::int64_t commit_tokens, const at::Tensor& block_table,
                    const at::Tensor& cmp_block_table, const at::Tensor& idx_block_table,
                    const at::Tensor& hca_state_table, const at::Tensor& csa_state_table,
                    const at::Tensor& csa_inner_state_table, std::vector<std::int64_t> pools,
                    std::int64_t layout, const c10::optional<at::Tensor>& hca_cmp_block_table,
                    const c10::optional<at::Tensor>& csa_cmp_block_table,
                    const c10::optional<at::Tensor>& block_counts) {
  constexpr std::string_view op = "build_metadata";
  const auto st = cview_of<std::int32_t, 1>(starts, op, "starts");
  if (st.stride(0) != 1 && st.extent(0) > 1)
    value_error(op, "starts", "is not contiguous; allowed a contiguous INT32 [B] tensor");
  if (layout < 0 || layout > 2)
    value_error(
        op, "layout",
        "= " + std::to_string(layout) + "; allowed 0 (base), 1 (device_ring), 2 (prefix_caching)");
  td::paged::StepTables tb =
      step_tables_of(op, block_table, cmp_block_table, idx_block_table, hca_state_table,
                     csa_state_table, csa_inner_state_table);
  tb.layout = td::paged::Layout(layout);
  tb.hca_cmp_block_table = table_of(hca_cmp_block_table, op, "hca_cmp_block_table");
  tb.csa_cmp_block_table = table_of(csa_cmp_block_table, op, "csa_cmp_block_table");
  tb.block_counts = table_of(block_counts, op, "block_counts");
  const td::paged::PoolSizes ps = pool_sizes(op, pools);
  td::check_range<std::int64_t>("StepMetadata::build", "shape.seq", seq, 1, 1 << 10);
  td::check_range<std::int64_t>("StepMetadata::build", "shape.commit_tokens", commit_tokens, -1,
                                seq + 1);
  const td::paged::StepShape sh{int(st.extent(0)), int(seq), int(commit_tokens)};
  md->md.build(std::span<const std::int32_t>(st.data(), std::size_t(st.extent(0))), sh, tb, ps,
               md->cfg);
  // Built: the bundle now views these tables (kept alive until the next build).
  std::vector<at::Tensor> keep = {block_table,     cmp_block_table, idx_block_table,
                                  hca_state_table, csa_state_table, csa_inner_state_table};
  for (const auto* o : {&hca_cmp_block_table, &csa_cmp_block_table, &block_counts})
    if (o->has_value()) keep.push_back(**o);
  md->tables = std::move(keep);
}

c10::Dict<std::string, at::Tensor> metadata_tensors(const c10::intrusive_ptr<StepMetadata>& md) {
  c10::Dict<std::string, at::Tensor> d;
  if (!md->md.built()) return d;
  const auto& m = md->md;
  // Zero-copy views of the bundle's buffers; each holds a reference to the bundle, so the memory
  // outlives the tensor (its contents are the last build's).
  auto add = [&]<class T, std::size_t R>(const char* name, td::ConstView<T, R> v) {
    std::vector<std::int64_t> sizes(R), strides(R);
    for (std::size_t i = 0; i < R; ++i) sizes[i] = v.extent(i), strides[i] = v.stride(i);
    c10::intrusive_ptr<StepMetadata> keep = md;
    d.insert(name, at::from_blob(
                       const_cast<T*>(v.data()), sizes, strides, [keep](void*) {},
                       at::TensorOptions().dtype(Dtype<T>::value)));
  };
  add("position_ids", m.position_ids());
  add("kv_seq_lens", m.kv_seq_lens());
  add("ori_slot_mapping", m.ori_slot_mapping());
  add("window_indices", m.window_indices());
  add("window_lens", m.window_lens());
  add("hca_cmp_slot_mapping", m.hca_cmp_slot_mapping());
  add("csa_cmp_slot_mapping", m.csa_cmp_slot_mapping());
  add("csa_idx_slot_mapping", m.csa_idx_slot_mapping());
  add("hca_state_slot_mapping", m.hca_state_slot_mapping());
  add("csa_state_slot_mapping", m.csa_state_slot_mapping());
  add("csa_inner_state_slot_mapping", m.csa_inner_state_slot_mapping());
  return d;
}

namespace {

template <class E>
void write_cache_as(const at::Tensor& pool, const at::Tensor& rows, const at::Tensor& slots) {
  constexpr std::string_view op = "write_cache";
  const auto p = rows_of<E, 2>(pool, op, "pool");
  const auto r = rows_of<const E, 2>(rows, op, "rows");
  const auto s = cview_of<std::int64_t, 1>(slots, op, "slot_mapping");
  td::paged::write_cache<E>(p, r, s);
}

template <class E>
void gather_rows_as(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                    const at::Tensor& slots) {
  constexpr std::string_view op = "gather_rows";
  const auto d = rows_of<E, 2>(dst, op, "dst");
  const auto v = view_of<std::uint8_t, 1>(valid, op, "valid");
  const auto p = rows_of<const E, 2>(pool, op, "pool");
  if (slots.scalar_type() == c10::ScalarType::Int)
    td::paged::gather_rows<E>(d, v, p, cview_of<std::int32_t, 1>(slots, op, "slots"));
  else
    td::paged::gather_rows<E>(d, v, p, cview_of<std::int64_t, 1>(slots, op, "slots"));
}

template <class E>
void gather_windows_as(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                       const at::Tensor& idx) {
  constexpr std::string_view op = "gather_windows";
  td::paged::gather_windows<E>(view_of<E, 3>(dst, op, "dst"),
                               view_of<std::uint8_t, 2>(valid, op, "valid"),
                               rows_of<const E, 2>(pool, op, "pool"),
                               cview_of<std::int32_t, 2>(idx, op, "window_indices"), cpu_context());
}

template <class E>
void gather_logical_rows_as(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                            const at::Tensor& table_row, const at::Tensor& rows,
                            std::int64_t page) {
  constexpr std::string_view op = "gather_logical_rows";
  td::paged::gather_logical_rows<E>(
      rows_of<E, 2>(dst, op, "dst"), view_of<std::uint8_t, 1>(valid, op, "valid"),
      rows_of<const E, 2>(pool, op, "pool"), cview_of<std::int32_t, 1>(table_row, op, "table_row"),
      cview_of<std::int32_t, 1>(rows, op, "rows"), page);
}

// Calls f.template operator()<E>() for the pool's element type.
template <class F>
void by_element(std::string_view op, const at::Tensor& pool, F&& f) {
  check_tensor(pool, op, "pool", pool.defined() ? pool.scalar_type() : c10::ScalarType::Float,
               std::size_t(std::max<std::int64_t>(pool.defined() ? pool.dim() : 1, 1)), false);
  switch (pool.scalar_type()) {
    case c10::ScalarType::BFloat16:
      return f.template operator()<td::bf16>();
    case c10::ScalarType::Float:
      return f.template operator()<float>();
    case c10::ScalarType::Char:
      return f.template operator()<std::int8_t>();
    case c10::ScalarType::Byte:
      return f.template operator()<std::uint8_t>();
    default:
      value_error(op, "pool",
                  std::string("has dtype ") + c10::toString(pool.scalar_type()) +
                      "; allowed bfloat16, float32, int8 or uint8");
  }
}

}  // namespace

void write_cache(const at::Tensor& pool, const at::Tensor& rows, const at::Tensor& slot_mapping) {
  by_element("write_cache", pool, [&]<class E>() { write_cache_as<E>(pool, rows, slot_mapping); });
}

void gather_rows(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                 const at::Tensor& slots) {
  if (slots.defined() && slots.scalar_type() != c10::ScalarType::Int)
    check_tensor(slots, "gather_rows", "slots", c10::ScalarType::Long, 1, false);
  by_element("gather_rows", pool, [&]<class E>() { gather_rows_as<E>(dst, valid, pool, slots); });
}

void gather_windows(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                    const at::Tensor& window_indices) {
  by_element("gather_windows", pool,
             [&]<class E>() { gather_windows_as<E>(dst, valid, pool, window_indices); });
}

void gather_logical_rows(const at::Tensor& dst, const at::Tensor& valid, const at::Tensor& pool,
                         const at::Tensor& table_row, const at::Tensor& rows, std::int64_t page) {
  by_element("gather_logical_rows", pool, [&]<class E>() {
    gather_logical_rows_as<E>(dst, valid, pool, table_row, rows, page);
  });
}

std::tuple<at::Tensor, at::Tensor> rope_table(std::int64_t kind, std::int64_t length,
                                              const std::string& config) {
  constexpr std::string_view op = "rope_table";
  const td::ModelConfig cfg = parse_config(op, config);
  const td::LayerKind k = layer_kind(op, kind);
  td::check_range<std::int64_t>("make_rope_table", "length", length, 1, td::kRopeMaxLength + 1);
  const auto opts = at::TensorOptions().dtype(c10::ScalarType::BFloat16);
  at::Tensor cos = at::empty({length, td::kRopeDim}, opts);
  at::Tensor sin = at::empty({length, td::kRopeDim}, opts);
  td::fill_rope_table(view_of<td::bf16, 2>(cos, op, "cos"), view_of<td::bf16, 2>(sin, op, "sin"),
                      cfg, td::rope_profile(k), td::kDefaultRopeAngles, &executor());
  return {cos, sin};
}

td::View<float, 2> state_rows(const at::Tensor& t, std::string_view op, std::string_view arg) {
  return rows_of<float, 2>(t, op, arg);
}
td::View<td::bf16, 2> bf16_rows(const at::Tensor& t, std::string_view op, std::string_view arg) {
  return rows_of<td::bf16, 2>(t, op, arg);
}
td::View<std::int8_t, 2> int8_rows(const at::Tensor& t, std::string_view op, std::string_view arg) {
  return rows_of<std::int8_t, 2>(t, op, arg);
}
td::View<float, 1> scale_rows(const at::Tensor& t, std::string_view op, std::string_view arg) {
  return rows_of<float, 1>(t, op, arg);
}

TORCH_LIBRARY_IMPL(tiledecode, CompositeImplicitAutograd, m) {
  m.impl("build_metadata", TORCH_FN(build_metadata));
  m.impl("write_cache", TORCH_FN(write_cache));
  m.impl("gather_rows", TORCH_FN(gather_rows));
  m.impl("gather_windows", TORCH_FN(gather_windows));
  m.impl("gather_logical_rows", TORCH_FN(gather_logical_rows));
}

}  // namespace tdpy
