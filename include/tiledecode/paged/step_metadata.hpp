#pragma once
// The per-step metadata bundle of spec §3.7: built ONCE per decode step from the start positions
// and the engine's block tables, then shared (read-only) by every layer; each layer reads its
// own slice of every pool through the same slots.
//
//   paged::FixtureTables fx(4);                                    // spec fixture tables
//   paged::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, cfg);
//
// An engine constructs StepMetadata once for its max batch and calls build() every step: the
// buffers are sized up front and build() never allocates. build() validates every input
// (starts, shape, every table entry any builder reads, pool sizes) before writing anything, so
// a failed build leaves the previous step's metadata intact.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"

namespace tiledecode::paged {

// The engine's block tables for one step (non-owning, INT32, row b = request b; more rows than
// B are allowed). -1 = unmapped page. Widths of the spec deployment (§1.3) in brackets; a
// narrower table is allowed (columns past it map to -1).
struct StepTables {
  ConstView<std::int32_t, 2> block_table;      // [B, 128]  ori / SWA KV, page 128
  ConstView<std::int32_t, 2> cmp_block_table;  // [B, 32]   compressed KV (CSA and HCA), page 128
  ConstView<std::int32_t, 2> idx_block_table;  // [B, 64]   CSA index cache, page 128
  ConstView<std::int32_t, 2> hca_state_table;  // [B, 2048] HCA compressor state, page 8
  ConstView<std::int32_t, 2> csa_state_table;  // [B, 4096] CSA main compressor state, page 4
  ConstView<std::int32_t, 2>
      csa_inner_state_table;  // [B, 4096] CSA indexer compressor state, page 4
};

// Physical block counts of each pool (per layer). Defaults = the spec fixture deployment
// (§1.3), whatever B.
struct PoolSizes {
  index_t ori = 128;
  index_t cmp = 32;
  index_t idx = 64;
  index_t hca_state = 64;
  index_t csa_state = 65;
  index_t csa_inner_state = 65;

  // Pools for a larger batch: the spec pools scaled by f = ceil(B / 4), so with the fixture
  // tables every request keeps the same per-request ring as at B = 4 (ori: 32 blocks = 4096
  // tokens; cmp: 8 blocks; idx: 16; HCA state: 16 = one 128-token window) instead of requests
  // sharing blocks. The CSA state pools stay 64 f + 1 (gcd(4, 64 f + 1) = 1: the spec's
  // deliberately non-partitioned pool). B <= 4 gives the spec defaults.
  static PoolSizes for_batch(int batch) {
    const index_t f = std::max<index_t>(1, (index_t(batch) + 3) / 4);
    return PoolSizes{128 * f, 32 * f, 64 * f, 64 * f, 64 * f + 1, 64 * f + 1};
  }
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
  }

  // Sized for this step, then built.
  StepMetadata(std::span<const std::int32_t> starts, const StepShape& sh, const StepTables& tables,
               const PoolSizes& pools, const ModelConfig& cfg = flash_config())
      : StepMetadata(sh.batch, sh.seq, cfg) {
    build(starts, sh, tables, pools, cfg);
  }

  // Builds every tensor of spec §3.7 for one step (no allocation):
  //   starts [B] INT32 (start position of each request; 0 <= start, start + S <= max_seq_len),
  //   sh (B <= max_batch, S <= max_seq, commit_tokens: -1 = all S, 1 = MTP),
  //   tables (engine-owned, must outlive the use of tables()), pools (block counts).
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
    detail::check_starts(where, starts, sh, cfg);
    detail::check_num_blocks(where, "pools.ori", pools.ori, cfg.page, index_t(1) << 31);
    detail::check_num_blocks(where, "pools.cmp", pools.cmp, cfg.page);
    detail::check_num_blocks(where, "pools.idx", pools.idx, cfg.page);
    detail::check_num_blocks(where, "pools.hca_state", pools.hca_state, cfg.c128_state_page);
    detail::check_num_blocks(where, "pools.csa_state", pools.csa_state, cfg.c4_state_page);
    detail::check_num_blocks(where, "pools.csa_inner_state", pools.csa_inner_state,
                             cfg.c4_state_page);

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
    detail::validate_compressed_slots(where, "cmp_block_table", slot_view(kHcaCmp), pos,
                                      tables.cmp_block_table, pools.cmp, 128, cfg.page, sh);
    detail::validate_compressed_slots(where, "cmp_block_table", slot_view(kCsaCmp), pos,
                                      tables.cmp_block_table, pools.cmp, 4, cfg.page, sh);
    detail::validate_compressed_slots(where, "idx_block_table", slot_view(kCsaIdx), pos,
                                      tables.idx_block_table, pools.idx, 4, cfg.page, sh);
    detail::validate_paged_slots(where, "hca_state_table", slot_view(kHcaState), pos,
                                 tables.hca_state_table, pools.hca_state, cfg.c128_state_page, sh);
    detail::validate_paged_slots(where, "csa_state_table", slot_view(kCsaState), pos,
                                 tables.csa_state_table, pools.csa_state, cfg.c4_state_page, sh);
    detail::validate_paged_slots(where, "csa_inner_state_table", slot_view(kCsaInnerState), pos,
                                 tables.csa_inner_state_table, pools.csa_inner_state,
                                 cfg.c4_state_page, sh);

    // Everything is valid: fill (never throws).
    shape_ = sh;
    tables_ = tables;
    pools_ = pools;
    std::copy_n(scratch_pos_.data(), T, pos_.data());
    detail::fill_kv_seq_lens(View<std::int32_t, 1>(kv_lens_.data(), {index_t(sh.batch)}), starts,
                             sh);
    detail::fill_ori_slot_mapping(slot_view(kOri), pos, tables.block_table, sh, cfg.page);
    detail::fill_window_indices(win, win_lens, pos, tables.block_table, sh, cfg);
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
    detail::fill_ori_slot_mapping(slot_view(kCsaInnerState), pos, tables.csa_inner_state_table, sh,
                                  cfg.c4_state_page);
    built_ = true;
  }

  bool built() const { return built_; }
  int max_batch() const { return max_batch_; }
  int max_seq() const { return max_seq_; }
  const StepShape& shape() const { return shape_; }
  const StepTables& tables() const { return tables_; }
  const PoolSizes& pools() const { return pools_; }

  // INT32 [T]: start[b] + s.
  ConstView<std::int32_t, 1> position_ids() const { return {pos_.data(), {tokens()}}; }
  // INT32 [B]: start[b] + committed tokens.
  ConstView<std::int32_t, 1> kv_seq_lens() const {
    return {kv_lens_.data(), {index_t(shape_.batch)}};
  }
  // INT64 [T], ori KV rows (page 128). The SWA layers' swa_slot_mapping is the same tensor.
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
  // INT64 [T] compressed-cache slots (-1 = no committed boundary / unmapped).
  ConstView<std::int64_t, 1> hca_cmp_slot_mapping() const { return slots(kHcaCmp); }  // ratio 128
  ConstView<std::int64_t, 1> csa_cmp_slot_mapping() const { return slots(kCsaCmp); }  // ratio 4
  ConstView<std::int64_t, 1> csa_idx_slot_mapping() const { return slots(kCsaIdx); }  // ratio 4
  // INT64 [T] compressor-state slots (every token).
  ConstView<std::int64_t, 1> hca_state_slot_mapping() const { return slots(kHcaState); }  // page 8
  ConstView<std::int64_t, 1> csa_state_slot_mapping() const { return slots(kCsaState); }  // page 4
  ConstView<std::int64_t, 1> csa_inner_state_slot_mapping() const {
    return slots(kCsaInnerState);  // page 4
  }

 private:
  enum Slot { kOri, kHcaCmp, kCsaCmp, kCsaIdx, kHcaState, kCsaState, kCsaInnerState, kNumSlots };
  index_t tokens() const { return built_ ? index_t(shape_.tokens()) : 0; }
  ConstView<std::int64_t, 1> slots(Slot s) const { return {slots_[s].data(), {tokens()}}; }

  int max_batch_ = 0, max_seq_ = 0, window_ = 0;
  bool built_ = false;
  StepShape shape_{};
  StepTables tables_{};
  PoolSizes pools_{};
  Buffer<std::int32_t> scratch_pos_, pos_, kv_lens_, win_idx_, win_lens_;
  Buffer<std::int64_t> slots_[kNumSlots];
};

// The spec fixture tables (§3.2, plain or permuted) for B requests, owning, with the spec
// widths for cfg (flash: ori 128, cmp 32, idx 64, HCA state 2048, CSA states 4096 columns).
// `FixtureTables(B)` uses PoolSizes::for_batch(B) (= the spec pools for B <= 4).
struct FixtureTables {
  explicit FixtureTables(int batch, const ModelConfig& cfg = flash_config())
      : FixtureTables(batch, PoolSizes::for_batch(batch), false, cfg) {}
  FixtureTables(int batch, const PoolSizes& pool_sizes, bool permuted = false,
                const ModelConfig& cfg = flash_config())
      : pools(pool_sizes) {
    check_range("FixtureTables", "batch", batch, 1, 1 << 20);
    const index_t B = batch, cmp_cols = cfg.score_len() / cfg.page;
    auto make = [&](Tensor<std::int32_t, 2>& t, index_t cols, index_t blocks) {
      t = Tensor<std::int32_t, 2>({B, cols});
      build_fixture_block_table(t.view(), blocks, permuted);
    };
    make(block_table, cfg.ori_table_cols(), pools.ori);
    make(cmp_block_table, cmp_cols, pools.cmp);
    // IDX_CACHE_MAX_BLOCKS = 64 = twice the ratio-4 capacity; only the first half is reached.
    make(idx_block_table, 2 * cmp_cols, pools.idx);
    make(hca_state_table, cfg.max_seq_len / cfg.c128_state_page, pools.hca_state);
    make(csa_state_table, cfg.max_seq_len / cfg.c4_state_page, pools.csa_state);
    make(csa_inner_state_table, cfg.max_seq_len / cfg.c4_state_page, pools.csa_inner_state);
  }

  StepTables tables() const {
    return {block_table.view(),     cmp_block_table.view(), idx_block_table.view(),
            hca_state_table.view(), csa_state_table.view(), csa_inner_state_table.view()};
  }

  PoolSizes pools;
  Tensor<std::int32_t, 2> block_table, cmp_block_table, idx_block_table, hca_state_table,
      csa_state_table, csa_inner_state_table;
};

}  // namespace tiledecode::paged
