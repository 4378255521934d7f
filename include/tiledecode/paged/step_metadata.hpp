#pragma once
// The per-step metadata bundle of spec §3.7 / addendum §2.1: built ONCE per decode step from the
// start positions and the engine's block tables, then shared (read-only) by every layer; each
// layer reads its own slice of every pool through the same slots.
//
//   paged::FixtureTables fx(4);                                    // spec fixture tables
//   paged::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, cfg);
//
// An engine constructs StepMetadata once for its max batch and calls build() every step: the
// buffers are sized up front and build() never allocates. build() validates every input
// (starts, shape, every table entry any builder reads, pool sizes) before writing anything, so
// a failed build leaves the previous step's metadata intact.
//
// Three layouts (StepTables::layout, rules/paging.hpp):
//   base            spec §3 (default; unchanged): shared cmp table, cfg.page rows per page.
//   device_ring     addendum §2 (#862, [DSP]): base tables + block_counts [B, 6], ring writers.
//   prefix_caching  addendum §3 (#955, [MTP]): cfg.page (= 128) source tokens per column of the
//                   ori, HCA cmp, CSA cmp and index tables; storage rows per page cfg.page / R
//                   (HCA 1, CSA 32, index 32); separate HCA / CSA tables and pools;
//                   block_counts [B, 7] (0 ori, 1 HCA cmp, 2 CSA cmp, 3 index, 4 HCA state,
//                   5 CSA state, 6 CSA inner state).
// The ring rules and their [AMBIGUOUS] decisions (periodic tables required, exactly -1, S > R) are
// documented in paged/metadata.hpp. A kernel reads compressed row c of request b at
//   rules::slot_of(md.table(Table::csa_cmp), b, c, md.rows_per_page(Table::csa_cmp))
// (= table[b, c / rows] * rows + c % rows) in every layout.
//
// [AMBIGUOUS addendum §3.5 / §14(5)] non-injective tables: the fixture generators (spec §3.2) are
// not injective for pools coprime to B (e.g. the CSA state pool of 65 pages: b = 0, p = 8319 and
// b = 1, p = 127 both write state row 255). build() reproduces the reference's numbers (it does
// not reject them: the base-spec fixtures collide too, spec §3.8, and kernel and golden agree by
// writing in token order, the later token winning). A production allocator must hand out
// disjoint pages; check_disjoint_rows() is that assertion (the mapped-pool comparator's "no
// duplicate physical rows", addendum §12.1), opt-in and read-only.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"

namespace tiledecode::paged {

// The engine's block tables for one step (non-owning, INT32, row b = request b; more rows than
// B are allowed). -1 = unmapped page. Widths of the spec deployment (§1.3, addendum §1.2) in
// brackets. Base layout: a narrower table is allowed (columns past it map to -1). Ring layouts:
// every column a step touches must lie inside the table (paged/metadata.hpp); a table with zero
// columns (a default view) is a group the deployment does not serve (its slots are all -1).
struct StepTables {
  ConstView<std::int32_t, 2> block_table;  // [B, 128] ori / SWA KV, page cfg.page; no ring wrap
  // [B, 32] compressed KV shared by CSA and HCA, cfg.page rows per page (base, device_ring;
  // ignored by prefix_caching)
  ConstView<std::int32_t, 2> cmp_block_table;
  // [B, 64] CSA index cache, cfg.page rows per page ([B, 128], cfg.page / 4 rows: prefix_caching)
  ConstView<std::int32_t, 2> idx_block_table;
  ConstView<std::int32_t, 2> hca_state_table;  // [B, 2048] HCA compressor state, page 8
  ConstView<std::int32_t, 2> csa_state_table;  // [B, 4096] CSA main compressor state, page 4
  ConstView<std::int32_t, 2>
      csa_inner_state_table;  // [B, 4096] CSA indexer compressor state, page 4
  // --- addendum §2 / §3 (ignored by the base layout)
  Layout layout = Layout::base;
  ConstView<std::int32_t, 2> hca_cmp_block_table{};  // prefix_caching: [B, 128] HCA cmp, 1 row/page
  ConstView<std::int32_t, 2> csa_cmp_block_table{};  // prefix_caching: [B, 128] CSA cmp, 32 rows
  // Ring layouts: live columns per table and request, INT32 [>= B, 6] (device_ring, #862 groups)
  // or [>= B, 7] (prefix_caching, §3.1 groups = int(Table)).
  ConstView<std::int32_t, 2> block_counts{};
};

// Physical block (page) counts of each pool (per layer). Defaults = the spec fixture deployment
// (§1.3, addendum §1.2 [MTP]), whatever B. A page holds rows_per_page rows of its table (ori
// cfg.page; cmp / idx cfg.page, or cfg.page / R in the prefix-caching layout; states SB).
struct PoolSizes {
  index_t ori = 128;
  index_t cmp = 32;  // shared compressed pool (base, device_ring)
  index_t idx = 64;
  index_t hca_state = 64;
  index_t csa_state = 65;
  index_t csa_inner_state = 65;
  index_t hca_cmp = 32;  // prefix_caching: HCA compressed pool (1-row pages)
  index_t csa_cmp = 32;  // prefix_caching: CSA compressed pool (cfg.page / 4-row pages)

  // Pools for a larger batch: the spec pools scaled by f = ceil(B / 4), so with the fixture
  // tables every request keeps the same per-request ring as at B = 4 (ori: 32 blocks = 4096
  // tokens; cmp: 8 blocks; idx: 16; HCA state: 16 = one 128-token window) instead of requests
  // sharing blocks. The CSA state pools stay 64 f + 1 (gcd(4, 64 f + 1) = 1: the spec's
  // deliberately non-partitioned pool). B <= 4 gives the spec defaults.
  static PoolSizes for_batch(int batch) {
    const index_t f = std::max<index_t>(1, (index_t(batch) + 3) / 4);
    return PoolSizes{128 * f, 32 * f, 64 * f, 64 * f, 64 * f + 1, 64 * f + 1, 32 * f, 32 * f};
  }

  // [AMBIGUOUS addendum §3.4 / §14(4)] pools in the layout's own page units, sized so that every
  // request owns a private page per column of every fixture table (no aliasing anywhere; with the
  // fixture generator, table[b, j] = j * B + b, all slots of a step are disjoint). The recommended
  // sizing; PoolSizes{} keeps the reference's unscaled pools (which alias). E.g. prefix caching,
  // B = 4, 16k: ori / HCA cmp / CSA cmp / index 512 pages each (addendum §3.4), HCA state 8192,
  // CSA states 16384.
  static PoolSizes per_request(int batch, Layout layout, const ModelConfig& cfg = flash_config());
};

class StepMetadata {
 public:
  StepMetadata() = default;

  // Allocates every buffer for up to `max_batch` requests of up to `max_seq` tokens.
  StepMetadata(int max_batch, int max_seq, const ModelConfig& cfg = flash_config()) {
    constexpr std::string_view where = "StepMetadata";
    check_range(where, "max_batch", max_batch, 1, 1 << 20);
    check_range(where, "max_seq", max_seq, 1, 1 << 10);
    check_range(where, "cfg.window", cfg.window, 1, 1 << 20);
    max_batch_ = max_batch;
    max_seq_ = max_seq;
    window_ = cfg.window;
    const auto T = std::size_t(max_batch) * std::size_t(max_seq);
    scratch_pos_ = Buffer<std::int32_t>(T);
    pos_ = Buffer<std::int32_t>(T);
    kv_lens_ = Buffer<std::int32_t>(std::size_t(max_batch));
    win_idx_ = Buffer<std::int32_t>(T * std::size_t(window_));
    win_lens_ = Buffer<std::int32_t>(T);
    for (auto& m : slots_) m = Buffer<std::int64_t>(T);
    dup_scratch_ = Buffer<std::int64_t>(T);
  }

  // Sized for this step, then built.
  StepMetadata(std::span<const std::int32_t> starts, const StepShape& sh, const StepTables& tables,
               const PoolSizes& pools, const ModelConfig& cfg = flash_config())
      : StepMetadata(sh.batch, sh.seq, cfg) {
    build(starts, sh, tables, pools, cfg);
  }

  // Builds every tensor of spec §3.7 / addendum §2.1 for one step (no allocation):
  //   starts [B] INT32 (start position of each request; 0 <= start, start + S <= max_seq_len,
  //     cfg.max_seq_len up to 2^20 and beyond: positions INT32, slots INT64),
  //   sh (B <= max_batch, S <= max_seq, commit_tokens: -1 = all S (the device builder), 0..S),
  //   tables (engine-owned, must outlive the use of tables(); tables.layout picks the layout),
  //   pools (page counts), cfg (page, c4_state_page / c128_state_page: the deployment's page
  //     sizes, e.g. 128 + 4/8 [MTP], 32 + 2/8 [DSP HEAD], 128 + 8/32 (#909), addendum §7).
  // Throws tiledecode::Error naming the argument on any bad input; nothing changes then.
  void build(std::span<const std::int32_t> starts, const StepShape& sh, const StepTables& tables,
             const PoolSizes& pools, const ModelConfig& cfg = flash_config()) {
    constexpr std::string_view where = "StepMetadata::build";
    if (max_batch_ == 0)
      throw Error("StepMetadata::build: metadata was default-constructed (no buffers)");
    detail::check_shape(where, sh);
    check_range(where, "shape.batch", sh.batch, 1, max_batch_ + 1);
    check_range(where, "shape.seq", sh.seq, 1, max_seq_ + 1);
    check_equal(where, "cfg.window", cfg.window, window_);
    // Divisors of every formula below (a zero page would divide by zero).
    check_range(where, "cfg.page", cfg.page, 1, 1 << 30);
    check_range(where, "cfg.c4_state_page", cfg.c4_state_page, 1, 1 << 30);
    check_range(where, "cfg.c128_state_page", cfg.c128_state_page, 1, 1 << 30);
    const Layout layout = tables.layout;
    if (layout != Layout::base && layout != Layout::device_ring &&
        layout != Layout::prefix_caching) {
      throw_arg(where, "tables.layout", int(layout),
                "0 (base), 1 (device_ring) or 2 (prefix_caching)");
    }
    // Prefix caching: a column holds cfg.page source tokens = cfg.page / R rows of each ratio.
    if (layout == Layout::prefix_caching && cfg.page % 128 != 0) {
      throw_arg(where, "cfg.page", cfg.page,
                "a multiple of 128 (prefix caching stores cfg.page / R rows per page, R = 4, 128)");
    }
    detail::check_starts(where, starts, sh, cfg);
    detail::check_num_blocks(where, "pools.ori", pools.ori, cfg.page, index_t(1) << 31);
    if (layout == Layout::base) {
      detail::check_num_blocks(where, "pools.cmp", pools.cmp, cfg.page);
      detail::check_num_blocks(where, "pools.idx", pools.idx, cfg.page);
      detail::check_num_blocks(where, "pools.hca_state", pools.hca_state, cfg.c128_state_page);
      detail::check_num_blocks(where, "pools.csa_state", pools.csa_state, cfg.c4_state_page);
      detail::check_num_blocks(where, "pools.csa_inner_state", pools.csa_inner_state,
                               cfg.c4_state_page);
    } else {
      const index_t need = rules::block_counts_width(layout);
      if (tables.block_counts.extent(0) < sh.batch)
        check_at_least(where, "tables.block_counts.extent(0)", tables.block_counts.extent(0),
                       index_t(sh.batch));
      check_equal(where, "tables.block_counts.extent(1)", tables.block_counts.extent(1), need);
      for (int g = 1; g < rules::kNumTables; ++g) {
        const RingTable r = ring_of(Table(g), tables, pools, cfg);
        if (r.served())
          detail::check_num_blocks(where, pool_name(Table(g), layout), r.num_blocks,
                                   r.rows_per_page);
      }
    }

    // Validate every table entry read, against positions computed into private scratch.
    const index_t T = sh.tokens();
    View<std::int32_t, 1> scratch(scratch_pos_.data(), {T});
    detail::fill_position_ids(scratch, starts, sh);
    const ConstView<std::int32_t, 1> pos = scratch;
    auto slot_view = [&](Slot s) { return View<std::int64_t, 1>(slots_[s].data(), {T}); };
    View<std::int32_t, 2> win(win_idx_.data(), {T, index_t(window_)});
    View<std::int32_t, 1> win_lens(win_lens_.data(), {T});
    detail::validate_paged_slots(where, "block_table", slot_view(kOri), pos, tables.block_table,
                                 pools.ori, cfg.page, sh);
    detail::validate_window_indices(where, win, win_lens, pos, tables.block_table, pools.ori, sh,
                                    cfg);
    if (layout == Layout::base) {
      detail::validate_compressed_slots(where, "cmp_block_table", slot_view(kHcaCmp), pos,
                                        tables.cmp_block_table, pools.cmp, 128, cfg.page, sh);
      detail::validate_compressed_slots(where, "cmp_block_table", slot_view(kCsaCmp), pos,
                                        tables.cmp_block_table, pools.cmp, 4, cfg.page, sh);
      detail::validate_compressed_slots(where, "idx_block_table", slot_view(kCsaIdx), pos,
                                        tables.idx_block_table, pools.idx, 4, cfg.page, sh);
      detail::validate_paged_slots(where, "hca_state_table", slot_view(kHcaState), pos,
                                   tables.hca_state_table, pools.hca_state, cfg.c128_state_page,
                                   sh);
      detail::validate_paged_slots(where, "csa_state_table", slot_view(kCsaState), pos,
                                   tables.csa_state_table, pools.csa_state, cfg.c4_state_page, sh);
      detail::validate_paged_slots(where, "csa_inner_state_table", slot_view(kCsaInnerState), pos,
                                   tables.csa_inner_state_table, pools.csa_inner_state,
                                   cfg.c4_state_page, sh);
    } else {
      for (int g = 1; g < rules::kNumTables; ++g) {
        detail::validate_ring_slots(where, ring_of(Table(g), tables, pools, cfg),
                                    slot_view(Slot(g)), pos, sh);
      }
    }

    // Everything is valid: fill (never throws).
    shape_ = sh;
    tables_ = tables;
    pools_ = pools;
    page_ = cfg.page;
    c4_state_page_ = cfg.c4_state_page;
    c128_state_page_ = cfg.c128_state_page;
    std::copy_n(scratch_pos_.data(), T, pos_.data());
    detail::fill_kv_seq_lens(View<std::int32_t, 1>(kv_lens_.data(), {index_t(sh.batch)}), starts,
                             sh);
    detail::fill_ori_slot_mapping(slot_view(kOri), pos, tables.block_table, sh, cfg.page);
    detail::fill_window_indices(win, win_lens, pos, tables.block_table, sh, cfg);
    if (layout == Layout::base) {
      detail::fill_compressed_slot_mapping(slot_view(kHcaCmp), pos, tables.cmp_block_table, 128, sh,
                                           cfg.page);
      detail::fill_compressed_slot_mapping(slot_view(kCsaCmp), pos, tables.cmp_block_table, 4, sh,
                                           cfg.page);
      detail::fill_compressed_slot_mapping(slot_view(kCsaIdx), pos, tables.idx_block_table, 4, sh,
                                           cfg.page);
      detail::fill_ori_slot_mapping(slot_view(kHcaState), pos, tables.hca_state_table, sh,
                                    cfg.c128_state_page);
      detail::fill_ori_slot_mapping(slot_view(kCsaState), pos, tables.csa_state_table, sh,
                                    cfg.c4_state_page);
      detail::fill_ori_slot_mapping(slot_view(kCsaInnerState), pos, tables.csa_inner_state_table,
                                    sh, cfg.c4_state_page);
    } else {
      for (int g = 1; g < rules::kNumTables; ++g)
        detail::fill_ring_slots(slot_view(Slot(g)), pos, ring_of(Table(g), tables, pools, cfg), sh);
    }
    built_ = true;
  }

  // Throws tiledecode::Error if two tokens of the built step write the same physical row of one
  // pool (any of the seven write mappings), naming the mapping, both tokens and the row; returns
  // normally otherwise (and for an unbuilt bundle). Read-only on the metadata (sorts a private
  // scratch: not for concurrent calls on one object), O(T log T), no allocation unless it throws.
  // See the [AMBIGUOUS addendum §3.5] note at the top: build() accepts colliding fixture tables;
  // an engine with its own allocator calls this to assert disjoint pages.
  void check_disjoint_rows() {
    constexpr std::string_view where = "StepMetadata::check_disjoint_rows";
    static constexpr std::string_view kNames[kNumSlots] = {"ori_slot_mapping",
                                                           "hca_cmp_slot_mapping",
                                                           "csa_cmp_slot_mapping",
                                                           "csa_idx_slot_mapping",
                                                           "hca_state_slot_mapping",
                                                           "csa_state_slot_mapping",
                                                           "csa_inner_state_slot_mapping"};
    const index_t T = tokens();
    for (int m = 0; m < kNumSlots; ++m) {
      const std::int64_t* slot = slots_[m].data();
      std::int64_t* tmp = dup_scratch_.data();
      index_t n = 0;
      for (index_t t = 0; t < T; ++t)
        if (slot[t] >= 0) tmp[n++] = slot[t];
      std::sort(tmp, tmp + n);
      const std::int64_t* dup = std::adjacent_find(tmp, tmp + n);
      if (dup == tmp + n) continue;
      index_t first = 0;
      while (slot[first] != *dup) ++first;
      index_t second = first + 1;
      while (slot[second] != *dup) ++second;
      throw_arg(where, detail::idx_name(kNames[m], second), *dup,
                "a row no other token of the step writes (" + detail::idx_name(kNames[m], first) +
                    " = " + std::to_string(*dup) + " too; requests " +
                    std::to_string(first / shape_.seq) + " and " +
                    std::to_string(second / shape_.seq) +
                    ": the tables are not injective, addendum §3.5)");
    }
  }

  bool built() const { return built_; }
  int max_batch() const { return max_batch_; }
  int max_seq() const { return max_seq_; }
  const StepShape& shape() const { return shape_; }
  const StepTables& tables() const { return tables_; }
  const PoolSizes& pools() const { return pools_; }
  Layout layout() const { return tables_.layout; }

  // --- what a kernel needs to read a table (every layout) -------------------------------------
  // The table that addresses `g`'s pool: base / device_ring map hca_cmp and csa_cmp to the shared
  // cmp_block_table, prefix_caching to its own HCA / CSA tables.
  ConstView<std::int32_t, 2> table(Table g) const {
    switch (g) {
      case Table::ori:
        return tables_.block_table;
      case Table::hca_cmp:
        return layout() == Layout::prefix_caching ? tables_.hca_cmp_block_table
                                                  : tables_.cmp_block_table;
      case Table::csa_cmp:
        return layout() == Layout::prefix_caching ? tables_.csa_cmp_block_table
                                                  : tables_.cmp_block_table;
      case Table::idx:
        return tables_.idx_block_table;
      case Table::hca_state:
        return tables_.hca_state_table;
      case Table::csa_state:
        return tables_.csa_state_table;
      default:
        return tables_.csa_inner_state_table;
    }
  }
  ConstView<std::int32_t, 2> ori_block_table() const { return table(Table::ori); }
  ConstView<std::int32_t, 2> hca_cmp_block_table() const { return table(Table::hca_cmp); }
  ConstView<std::int32_t, 2> csa_cmp_block_table() const { return table(Table::csa_cmp); }
  ConstView<std::int32_t, 2> idx_block_table() const { return table(Table::idx); }
  ConstView<std::int32_t, 2> block_counts() const { return tables_.block_counts; }
  // Storage rows per page of `g`'s pool (= rows per table column): a kernel reads row c of
  // request b at table(g)[b, c / rows] * rows + c % rows (rules::slot_of); ori and compressed
  // rows are cfg.page except prefix caching's cfg.page / R (HCA 1, CSA / index 32), states SB.
  index_t rows_per_page(Table g) const {
    if (rules::is_state_table(g)) return g == Table::hca_state ? c128_state_page_ : c4_state_page_;
    if (g == Table::ori) return page_;
    return rules::compressed_rows_per_page(layout(), page_, rules::table_ratio(g));
  }
  // Pages of `g`'s pool (PoolSizes field of the layout) and its rows (a kernel's pool extent(0)
  // must be at least this).
  index_t pool_blocks(Table g) const { return pool_pages(g, layout(), pools_); }
  index_t pool_rows(Table g) const { return pool_blocks(g) * rows_per_page(g); }

  // INT32 [T]: start[b] + s.
  ConstView<std::int32_t, 1> position_ids() const { return {pos_.data(), {tokens()}}; }
  // INT32 [B]: start[b] + committed tokens.
  ConstView<std::int32_t, 1> kv_seq_lens() const {
    return {kv_lens_.data(), {index_t(shape_.batch)}};
  }
  // INT64 [T], ori KV rows (page cfg.page). The SWA layers' swa_slot_mapping is the same tensor.
  ConstView<std::int64_t, 1> ori_slot_mapping() const { return slots(kOri); }
  ConstView<std::int64_t, 1> swa_slot_mapping() const { return slots(kOri); }
  // INT32 [T, WIN] / [T]: physical ori rows of each token's window, oldest → newest, -1 padded.
  // Serves as swa_indices/swa_lens (SWA) and window_swa_indices/lens (CSA, HCA).
  ConstView<std::int32_t, 2> window_indices() const {
    return {win_idx_.data(), {tokens(), index_t(window_)}};
  }
  ConstView<std::int32_t, 1> window_lens() const { return {win_lens_.data(), {tokens()}}; }
  ConstView<std::int32_t, 2> swa_indices() const { return window_indices(); }
  ConstView<std::int32_t, 1> swa_lens() const { return window_lens(); }
  // INT64 [T] compressed-cache slots (-1 = no committed boundary / unmapped / not served), rows
  // of pool_rows(Table::hca_cmp / csa_cmp / idx).
  ConstView<std::int64_t, 1> hca_cmp_slot_mapping() const { return slots(kHcaCmp); }  // ratio 128
  ConstView<std::int64_t, 1> csa_cmp_slot_mapping() const { return slots(kCsaCmp); }  // ratio 4
  ConstView<std::int64_t, 1> csa_idx_slot_mapping() const { return slots(kCsaIdx); }  // ratio 4
  // INT64 [T] compressor-state slots (every token).
  ConstView<std::int64_t, 1> hca_state_slot_mapping() const { return slots(kHcaState); }  // SB 8
  ConstView<std::int64_t, 1> csa_state_slot_mapping() const { return slots(kCsaState); }  // SB 4
  ConstView<std::int64_t, 1> csa_inner_state_slot_mapping() const {
    return slots(kCsaInnerState);  // SB 4
  }
  // The write mapping of `g`'s pool (ori_slot_mapping, ..., csa_inner_state_slot_mapping).
  ConstView<std::int64_t, 1> slot_mapping(Table g) const { return slots(Slot(int(g))); }

 private:
  // Slot order = Table order (= the prefix-caching block_counts columns).
  enum Slot { kOri, kHcaCmp, kCsaCmp, kCsaIdx, kHcaState, kCsaState, kCsaInnerState, kNumSlots };
  static_assert(int(kNumSlots) == rules::kNumTables);
  index_t tokens() const { return built_ ? index_t(shape_.tokens()) : 0; }
  ConstView<std::int64_t, 1> slots(Slot s) const { return {slots_[s].data(), {tokens()}}; }

  static index_t pool_pages(Table g, Layout layout, const PoolSizes& p) {
    const bool prefix = layout == Layout::prefix_caching;
    switch (g) {
      case Table::ori:
        return p.ori;
      case Table::hca_cmp:
        return prefix ? p.hca_cmp : p.cmp;
      case Table::csa_cmp:
        return prefix ? p.csa_cmp : p.cmp;
      case Table::idx:
        return p.idx;
      case Table::hca_state:
        return p.hca_state;
      case Table::csa_state:
        return p.csa_state;
      default:
        return p.csa_inner_state;
    }
  }
  static std::string_view pool_name(Table g, Layout layout) {
    const bool prefix = layout == Layout::prefix_caching;
    switch (g) {
      case Table::ori:
        return "pools.ori";
      case Table::hca_cmp:
        return prefix ? "pools.hca_cmp" : "pools.cmp";
      case Table::csa_cmp:
        return prefix ? "pools.csa_cmp" : "pools.cmp";
      case Table::idx:
        return "pools.idx";
      case Table::hca_state:
        return "pools.hca_state";
      case Table::csa_state:
        return "pools.csa_state";
      default:
        return "pools.csa_inner_state";
    }
  }
  // How the ring builders read table `g` (not ori) in a ring layout.
  static RingTable ring_of(Table g, const StepTables& tb, const PoolSizes& pools,
                           const ModelConfig& cfg) {
    const Layout layout = tb.layout;
    const bool prefix = layout == Layout::prefix_caching;
    RingTable r;
    r.block_counts = tb.block_counts;
    r.count_col = rules::count_column(layout, g);
    r.num_blocks = pool_pages(g, layout, pools);
    r.ratio = rules::table_ratio(g);
    r.state = rules::is_state_table(g);
    r.rows_per_page = r.state ? (g == Table::hca_state ? cfg.c128_state_page : cfg.c4_state_page)
                              : rules::compressed_rows_per_page(layout, cfg.page, r.ratio);
    switch (g) {
      case Table::hca_cmp:
        r.name = prefix ? "hca_cmp_block_table" : "cmp_block_table";
        r.table = prefix ? tb.hca_cmp_block_table : tb.cmp_block_table;
        break;
      case Table::csa_cmp:
        r.name = prefix ? "csa_cmp_block_table" : "cmp_block_table";
        r.table = prefix ? tb.csa_cmp_block_table : tb.cmp_block_table;
        // #862 shares one table between HCA and CSA. The ratio-4 rows are written (and read)
        // only where the CSA family is served, i.e. where its main compressor has a state table:
        // an HCA-only deployment at 1M (addendum §5.2; no 1M CSA, §1.3) then needs no cmp table
        // wide enough for 2^20 / 4 ratio-4 rows.
        if (!prefix && tb.csa_state_table.extent(1) == 0) r.table = {};
        break;
      case Table::idx:
        r.name = "idx_block_table";
        r.table = tb.idx_block_table;
        break;
      case Table::hca_state:
        r.name = "hca_state_table";
        r.table = tb.hca_state_table;
        break;
      case Table::csa_state:
        r.name = "csa_state_table";
        r.table = tb.csa_state_table;
        break;
      default:
        r.name = "csa_inner_state_table";
        r.table = tb.csa_inner_state_table;
        break;
    }
    return r;
  }

  int max_batch_ = 0, max_seq_ = 0, window_ = 0;
  index_t page_ = 0, c4_state_page_ = 0, c128_state_page_ = 0;
  bool built_ = false;
  StepShape shape_{};
  StepTables tables_{};
  PoolSizes pools_{};
  Buffer<std::int32_t> scratch_pos_, pos_, kv_lens_, win_idx_, win_lens_;
  Buffer<std::int64_t> slots_[kNumSlots];
  Buffer<std::int64_t> dup_scratch_;
};

// The spec fixture tables (§3.2 plain or permuted: table[b, c] = (phys(c) * B + b) mod P) for B
// requests, owning. Widths cover cfg.max_seq_len: ori ceil(max_seq / page); base / device_ring cmp
// ceil(score_len / page) and idx twice that (flash: 128, 32, 64); prefix caching ceil(max_seq /
// page) for all four scheduler tables (128); states ceil(max_seq / SB) (addendum §7: 2048 / 4096
// at 4 / 8, 8192 / 2048 at 2 / 8, 2048 / 512 at 8 / 32). `FixtureTables(B)` uses
// PoolSizes::for_batch(B) (= the spec pools for B <= 4) and the base layout.
//
// Ring layouts also fill block_counts with the decode-forward convention of addendum §3.5:
// compressed and index tables n = P / gcd(B, P) (= P / B when B divides P: the generator's period,
// so the table is periodic as option (a) requires), state tables n = P, ori n = P (never read);
// each clamped to the table width (a table without repetition inside its width is trivially
// periodic). With P coprime to 4 (CSA states, 65) requests collide (spec §3.8, addendum §3.5).
struct FixtureTables {
  explicit FixtureTables(int batch, const ModelConfig& cfg = flash_config())
      : FixtureTables(batch, PoolSizes::for_batch(batch), false, cfg) {}
  FixtureTables(int batch, const PoolSizes& pool_sizes, bool permuted = false,
                const ModelConfig& cfg = flash_config())
      : FixtureTables(batch, pool_sizes, Layout::base, permuted, cfg) {}
  FixtureTables(int batch, const PoolSizes& pool_sizes, Layout table_layout, bool permuted = false,
                const ModelConfig& cfg = flash_config())
      : pools(pool_sizes), layout(table_layout) {
    constexpr std::string_view where = "FixtureTables";
    check_range(where, "batch", batch, 1, 1 << 20);
    check_range(where, "cfg.page", cfg.page, 1, 1 << 30);
    check_range(where, "cfg.c4_state_page", cfg.c4_state_page, 1, 1 << 30);
    check_range(where, "cfg.c128_state_page", cfg.c128_state_page, 1, 1 << 30);
    check_range(where, "cfg.max_seq_len", cfg.max_seq_len, 1, 1 << 30);
    const index_t B = batch;
    auto ceil_div = [](index_t a, index_t b) { return (a + b - 1) / b; };
    auto make = [&](Tensor<std::int32_t, 2>& t, index_t cols, index_t blocks) {
      t = Tensor<std::int32_t, 2>({B, cols});
      build_fixture_block_table(t.view(), blocks, permuted);
    };
    const bool prefix = layout == Layout::prefix_caching;
    const index_t ori_cols = ceil_div(cfg.max_seq_len, cfg.page);
    const index_t cmp_cols = ceil_div(cfg.score_len(), cfg.page);
    make(block_table, ori_cols, pools.ori);
    if (prefix) {
      make(hca_cmp_block_table, ori_cols, pools.hca_cmp);
      make(csa_cmp_block_table, ori_cols, pools.csa_cmp);
      make(idx_block_table, ori_cols, pools.idx);
    } else {
      make(cmp_block_table, cmp_cols, pools.cmp);
      // IDX_CACHE_MAX_BLOCKS = 64 = twice the ratio-4 capacity; only the first half is reached.
      make(idx_block_table, 2 * cmp_cols, pools.idx);
    }
    make(hca_state_table, ceil_div(cfg.max_seq_len, cfg.c128_state_page), pools.hca_state);
    make(csa_state_table, ceil_div(cfg.max_seq_len, cfg.c4_state_page), pools.csa_state);
    make(csa_inner_state_table, ceil_div(cfg.max_seq_len, cfg.c4_state_page),
         pools.csa_inner_state);
    if (layout == Layout::base) return;

    block_counts = Tensor<std::int32_t, 2>({B, index_t(rules::block_counts_width(layout))});
    auto count = [&](const Tensor<std::int32_t, 2>& t, index_t P, bool period) {
      const index_t n = (period && !permuted) ? P / std::gcd(B, P) : P;
      return static_cast<std::int32_t>(std::min(n, t.extent(1)));
    };
    for (index_t b = 0; b < B; ++b) {
      auto set = [&](Table g, std::int32_t n) {
        const int col = rules::count_column(layout, g);
        if (col >= 0) block_counts.view()(b, col) = n;
      };
      block_counts.view()(b, 0) = count(block_table, pools.ori, false);  // never read (§2.3.1)
      if (prefix) {
        set(Table::hca_cmp, count(hca_cmp_block_table, pools.hca_cmp, true));
        set(Table::csa_cmp, count(csa_cmp_block_table, pools.csa_cmp, true));
      } else {
        set(Table::csa_cmp, count(cmp_block_table, pools.cmp, true));
      }
      set(Table::idx, count(idx_block_table, pools.idx, true));
      set(Table::hca_state, count(hca_state_table, pools.hca_state, false));
      set(Table::csa_state, count(csa_state_table, pools.csa_state, false));
      set(Table::csa_inner_state, count(csa_inner_state_table, pools.csa_inner_state, false));
    }
  }

  StepTables tables() const {
    StepTables t{block_table.view(),     cmp_block_table.view(), idx_block_table.view(),
                 hca_state_table.view(), csa_state_table.view(), csa_inner_state_table.view()};
    t.layout = layout;
    t.hca_cmp_block_table = hca_cmp_block_table.view();
    t.csa_cmp_block_table = csa_cmp_block_table.view();
    t.block_counts = block_counts.view();
    return t;
  }

  PoolSizes pools;
  Layout layout = Layout::base;
  Tensor<std::int32_t, 2> block_table, cmp_block_table, idx_block_table, hca_state_table,
      csa_state_table, csa_inner_state_table;
  Tensor<std::int32_t, 2> hca_cmp_block_table, csa_cmp_block_table;  // prefix caching
  Tensor<std::int32_t, 2> block_counts;                              // ring layouts
};

inline PoolSizes PoolSizes::per_request(int batch, Layout layout, const ModelConfig& cfg) {
  check_range("PoolSizes::per_request", "batch", batch, 1, 1 << 20);
  const index_t B = batch;
  auto ceil_div = [](index_t a, index_t b) { return (a + b - 1) / b; };
  const index_t ori_cols = ceil_div(cfg.max_seq_len, cfg.page);
  const index_t cmp_cols =
      layout == Layout::prefix_caching ? ori_cols : ceil_div(cfg.score_len(), cfg.page);
  const index_t idx_cols = layout == Layout::prefix_caching ? ori_cols : 2 * cmp_cols;
  PoolSizes p;
  p.ori = B * ori_cols;
  p.cmp = B * cmp_cols;
  p.idx = B * idx_cols;
  p.hca_cmp = B * ori_cols;
  p.csa_cmp = B * ori_cols;
  p.hca_state = B * ceil_div(cfg.max_seq_len, cfg.c128_state_page);
  p.csa_state = B * ceil_div(cfg.max_seq_len, cfg.c4_state_page);
  p.csa_inner_state = p.csa_state;
  return p;
}

}  // namespace tiledecode::paged
