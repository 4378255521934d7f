#pragma once
// Paged-KV decode metadata (spec §3). Every builder writes a caller-owned output view in one
// pass, after validating every input it reads; on bad input it throws tiledecode::Error and has
// written nothing.
//
// Conventions (spec §3):
//   token row t = b*S + s; position_ids[t] = start[b] + s.
//   A slot is a flattened physical row: block_id * page_rows + row_in_page (INT64 slot mappings,
//   INT32 window lists).
//   -1 in a slot mapping or index list = "do not write" / invalid (produced here, never an error).
//   Block-table entries: -1 = unmapped page (its slots become -1); an entry < -1 or >= the
//   pool's block count is an error (only -1 is the unmapped marker, so a corrupted table is
//   caught instead of silently read as "unmapped").
//   Logical table columns past the table width map to -1 (the spec's `blk < cols` rule): a
//   table may cover less than max_seq_len.
//   Tables may have more rows than B (an engine's max-batch table); rows 0..B-1 are used.
//   Fewer rows than B is an error.
//
// Each builder is split into `detail::validate_*` (reads inputs, throws) and `detail::fill_*`
// (trusts validated inputs, never throws): `StepMetadata::build` validates every builder's
// inputs before filling any output, so a failed build leaves the whole bundle unchanged.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::paged {

// Batch geometry of one decode step.
struct StepShape {
  int batch = 4;           // B requests
  int seq = 2;             // S tokens per request
  int commit_tokens = -1;  // -1: all S committed (standalone tests); 1: MTP (draft token s=1)
  constexpr int tokens() const { return batch * seq; }
  constexpr int committed() const { return commit_tokens < 0 ? seq : commit_tokens; }
};

namespace detail {

inline std::string idx_name(std::string_view arg, index_t i) {
  return std::string(arg) + "[" + std::to_string(i) + "]";
}
inline std::string idx_name(std::string_view arg, index_t i, index_t j) {
  return std::string(arg) + "[" + std::to_string(i) + "," + std::to_string(j) + "]";
}

// check_range for element `i` of `arg`; the name is formatted only on failure (no allocation on
// the valid path: validation runs every step).
template <class V>
inline void check_element(std::string_view where, std::string_view arg, index_t i, V value, V lo,
                          V hi) {
  if (value < lo || value >= hi) check_range(where, idx_name(arg, i), value, lo, hi);
}

inline void check_shape(std::string_view where, const StepShape& sh) {
  check_range(where, "shape.batch", sh.batch, 1, 1 << 20);
  check_range(where, "shape.seq", sh.seq, 1, 1 << 10);
  check_range(where, "shape.commit_tokens", sh.commit_tokens, -1, sh.seq + 1);
}
inline void check_len(std::string_view where, std::string_view arg, index_t got, index_t want) {
  check_equal(where, arg, got, want);
}
// Pool block count: at least one block, and every slot (block * page + row) fits `max_rows`.
inline void check_num_blocks(std::string_view where, std::string_view arg, index_t num_blocks,
                             index_t page, index_t max_rows = index_t(1) << 62) {
  check_range<index_t>(where, arg, num_blocks, 1, max_rows / page + 1);
}
inline void check_starts(std::string_view where, std::span<const std::int32_t> start,
                         const StepShape& sh, const ModelConfig& cfg) {
  check_len(where, "start.size()", index_t(start.size()), index_t(sh.batch));
  for (int b = 0; b < sh.batch; ++b) {
    // start + S <= max_seq_len, i.e. start in [0, max_seq_len - S + 1).
    check_element(where, "start", b, start[b], 0, cfg.max_seq_len - sh.seq + 1);
  }
}
inline void check_positions(std::string_view where, ConstView<std::int32_t, 1> pos,
                            const StepShape& sh, const ModelConfig& cfg) {
  check_shape(where, sh);
  check_len(where, "position_ids.extent(0)", pos.extent(0), index_t(sh.tokens()));
  for (index_t t = 0; t < pos.extent(0); ++t) {
    check_element(where, "position_ids", t, pos(t), 0, cfg.max_seq_len);
  }
}
// A table needs a row per request (more rows are allowed) and at least one column.
inline void check_table(std::string_view where, std::string_view arg,
                        ConstView<std::int32_t, 2> table, const StepShape& sh) {
  if (table.extent(0) < sh.batch)
    check_at_least(where, std::string(arg) + ".extent(0)", table.extent(0), index_t(sh.batch));
  if (table.extent(1) < 1)
    check_at_least(where, std::string(arg) + ".extent(1)", table.extent(1), index_t(1));
}
// Validates the table entry that logical column `col` of request `b` reads (if any).
inline void check_block(std::string_view where, std::string_view arg,
                        ConstView<std::int32_t, 2> table, index_t b, index_t col,
                        index_t num_blocks) {
  if (col < 0 || col >= table.extent(1)) return;  // past the table: -1 by the spec rule
  const index_t blk = table(b, col);
  if (blk < -1 || blk >= num_blocks) {
    throw_arg(where, idx_name(arg, b, col), blk,
              "[-1, " + std::to_string(num_blocks) + ") (-1 = unmapped; pool blocks)");
  }
}
// Physical block of a validated table: -1 for an unmapped entry or a column past the table.
inline index_t block_of(ConstView<std::int32_t, 2> table, index_t b, index_t col) {
  return col < table.extent(1) ? index_t(table(b, col)) : index_t(-1);
}
// Flattened slot of absolute row `row` through a validated table.
inline std::int64_t slot_of(ConstView<std::int32_t, 2> table, index_t b, index_t row,
                            index_t page) {
  const index_t blk = block_of(table, b, row / page);
  return blk < 0 ? -1 : blk * page + row % page;
}

// --- validate / fill pairs (the public builders below are validate + fill) -----------------

inline void validate_position_ids(std::string_view where, View<std::int32_t, 1> dst,
                                  std::span<const std::int32_t> start, const StepShape& sh,
                                  const ModelConfig& cfg) {
  check_shape(where, sh);
  check_len(where, "position_ids.extent(0)", dst.extent(0), index_t(sh.tokens()));
  check_starts(where, start, sh, cfg);
}
inline void fill_position_ids(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                              const StepShape& sh) {
  for (int b = 0; b < sh.batch; ++b)
    for (int s = 0; s < sh.seq; ++s) dst(b * sh.seq + s) = start[b] + s;
}

inline void validate_kv_seq_lens(std::string_view where, View<std::int32_t, 1> dst,
                                 std::span<const std::int32_t> start, const StepShape& sh,
                                 const ModelConfig& cfg) {
  check_shape(where, sh);
  check_len(where, "kv_seq_lens.extent(0)", dst.extent(0), index_t(sh.batch));
  check_starts(where, start, sh, cfg);
}
inline void fill_kv_seq_lens(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                             const StepShape& sh) {
  for (int b = 0; b < sh.batch; ++b) dst(b) = start[b] + sh.committed();
}

// Positions are validated separately (check_positions); this checks table, pool and output.
inline void validate_paged_slots(std::string_view where, std::string_view table_name,
                                 View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                 ConstView<std::int32_t, 2> table, index_t num_blocks, index_t page,
                                 const StepShape& sh) {
  check_table(where, table_name, table, sh);
  check_num_blocks(where, "num_blocks", num_blocks, page);
  check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  for (index_t b = 0, t = 0; b < sh.batch; ++b)
    for (index_t s = 0; s < sh.seq; ++s, ++t)
      check_block(where, table_name, table, b, positions(t) / page, num_blocks);
}
// Only boundary tokens that are committed read the table (spec §3.5); only those are checked.
inline void validate_compressed_slots(std::string_view where, std::string_view table_name,
                                      View<std::int64_t, 1> dst,
                                      ConstView<std::int32_t, 1> positions,
                                      ConstView<std::int32_t, 2> table, index_t num_blocks,
                                      int ratio, index_t page, const StepShape& sh) {
  check_table(where, table_name, table, sh);
  check_num_blocks(where, "num_blocks", num_blocks, page);
  check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  for (index_t b = 0, t = 0; b < sh.batch; ++b) {
    for (index_t s = 0; s < sh.seq; ++s, ++t) {
      const index_t p = positions(t);
      if ((p + 1) % ratio == 0 && s < sh.committed())
        check_block(where, table_name, table, b, p / ratio / page, num_blocks);
    }
  }
}

inline void fill_ori_slot_mapping(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                  ConstView<std::int32_t, 2> table, const StepShape& sh,
                                  index_t page) {
  for (index_t b = 0, t = 0; b < sh.batch; ++b)
    for (index_t s = 0; s < sh.seq; ++s, ++t) dst(t) = slot_of(table, b, positions(t), page);
}

inline void fill_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                         ConstView<std::int32_t, 1> positions,
                                         ConstView<std::int32_t, 2> table, int ratio,
                                         const StepShape& sh, index_t page) {
  for (index_t b = 0, t = 0; b < sh.batch; ++b) {
    for (index_t s = 0; s < sh.seq; ++s, ++t) {
      const index_t p = positions(t);
      const bool boundary = (p + 1) % ratio == 0 && s < sh.committed();
      dst(t) = boundary ? slot_of(table, b, p / ratio, page) : -1;
    }
  }
}

inline void validate_window_indices(std::string_view where, View<std::int32_t, 2> idx,
                                    View<std::int32_t, 1> lens,
                                    ConstView<std::int32_t, 1> positions,
                                    ConstView<std::int32_t, 2> table, index_t num_blocks,
                                    const StepShape& sh, const ModelConfig& cfg) {
  check_table(where, "block_table", table, sh);
  // INT32 lists: every slot must fit, so pool rows <= 2^31.
  check_num_blocks(where, "num_blocks", num_blocks, cfg.page, index_t(1) << 31);
  check_len(where, "window_indices.extent(0)", idx.extent(0), index_t(sh.tokens()));
  check_len(where, "window_indices.extent(1)", idx.extent(1), index_t(cfg.window));
  check_len(where, "window_lens.extent(0)", lens.extent(0), index_t(sh.tokens()));
  // A window spans at most two pages; validate every column it touches.
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t p = positions(t), w0 = std::max<index_t>(0, p - cfg.window + 1);
    for (index_t c = w0 / cfg.page; c <= p / cfg.page; ++c)
      check_block(where, "block_table", table, t / sh.seq, c, num_blocks);
  }
}

// One pass over the output in per-page runs: one table lookup per page the window touches.
inline void fill_window_indices(View<std::int32_t, 2> idx, View<std::int32_t, 1> lens,
                                ConstView<std::int32_t, 1> positions,
                                ConstView<std::int32_t, 2> table, const StepShape& sh,
                                const ModelConfig& cfg) {
  const index_t page = cfg.page, win = cfg.window, col_stride = idx.stride(1);
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, p = positions(t);
    const index_t w0 = std::max<index_t>(0, p - win + 1), len = p - w0 + 1;
    lens(t) = static_cast<std::int32_t>(len);
    std::int32_t* out = &idx(t, 0);
    // (column k of row t) = out[k * col_stride]; contiguous rows take the unit-stride loops.
    auto run_fill = [&](index_t k0, index_t n, std::int32_t first, std::int32_t step) {
      if (col_stride == 1) {
        for (index_t i = 0; i < n; ++i) out[k0 + i] = first + step * static_cast<std::int32_t>(i);
      } else {
        for (index_t i = 0; i < n; ++i)
          out[(k0 + i) * col_stride] = first + step * static_cast<std::int32_t>(i);
      }
    };
    index_t k = 0;
    while (k < len) {  // (run of rows of one page) oldest → newest
      const index_t x = w0 + k, r = x % page, run = std::min(len - k, page - r);
      const index_t blk = block_of(table, b, x / page);
      if (blk < 0) {
        run_fill(k, run, -1, 0);
      } else {
        run_fill(k, run, static_cast<std::int32_t>(blk * page + r), 1);
      }
      k += run;
    }
    run_fill(k, win - k, -1, 0);
  }
}

}  // namespace detail

// position_ids[b*S + s] = start[b] + s  (spec §3.1). INT32 [T].
// Validates 0 <= start[b] and start[b] + S <= cfg.max_seq_len.
inline void build_position_ids(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                               const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_position_ids";
  detail::validate_position_ids(where, dst, start, sh, cfg);
  detail::fill_position_ids(dst, start, sh);
}

// kv_seq_lens[b] = start[b] + committed tokens (spec §3.1; commit_tokens -1 → S). INT32 [B].
inline void build_kv_seq_lens(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                              const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_kv_seq_lens";
  detail::validate_kv_seq_lens(where, dst, start, sh, cfg);
  detail::fill_kv_seq_lens(dst, start, sh);
}

// Fixture block table (spec §3.2): table[b, c] = (phys(c) * B + b) mod P with B = dst rows,
// phys(c) = c mod P (plain) or ((c mod P) * 7 + 3) mod P (permuted). INT32 [B, cols].
// Production engines supply their own tables.
inline void build_fixture_block_table(View<std::int32_t, 2> dst, index_t num_blocks,
                                      bool permuted = false) {
  constexpr std::string_view where = "build_fixture_block_table";
  check_range<index_t>(where, "num_blocks", num_blocks, 1, index_t(1) << 31);
  const index_t batch = dst.extent(0), cols = dst.extent(1);
  for (index_t b = 0; b < batch; ++b) {
    for (index_t c = 0; c < cols; ++c) {
      const index_t phys = permuted ? ((c % num_blocks) * 7 + 3) % num_blocks : c % num_blocks;
      dst(b, c) = static_cast<std::int32_t>((phys * batch + b) % num_blocks);
    }
  }
}

// Slot of absolute row `row` of request b through a table with `page` rows per block:
// table[b, row / page] * page + row % page, or -1 if the entry is -1 or the column is past the
// table. Validates the one entry it reads (throws naming `table_name[b,col]`).
inline std::int64_t paged_slot(std::string_view where, std::string_view table_name,
                               ConstView<std::int32_t, 2> table, index_t b, index_t row,
                               index_t page, index_t num_blocks) {
  check_range<index_t>(where, "b", b, 0, table.extent(0));
  check_at_least<index_t>(where, "row", row, 0);
  detail::check_block(where, table_name, table, b, row / page, num_blocks);
  return detail::slot_of(table, b, row, page);
}

// Original-cache slot of each token (spec §3.3; also `swa_slot_mapping`): page cfg.page (128),
// no commit masking (the draft row is overwritten next step). INT64 [T]; -1 = do not write
// (unmapped page or position past the table).
//   positions [T] INT32, block_table [>=B, cols] INT32, num_blocks = ori pool blocks.
inline void build_ori_slot_mapping(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                   ConstView<std::int32_t, 2> block_table, index_t num_blocks,
                                   const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_ori_slot_mapping";
  detail::check_positions(where, positions, sh, cfg);
  detail::validate_paged_slots(where, "block_table", dst, positions, block_table, num_blocks,
                               cfg.page, sh);
  detail::fill_ori_slot_mapping(dst, positions, block_table, sh, cfg.page);
}

// Compressed-cache slot for ratio R (spec §3.5): only a token closing a window
// ((pos+1) % R == 0) writes row c = pos / R through `cmp_table` (page cfg.page); boundary
// tokens at s >= commit_tokens are masked to -1. INT64 [T]; -1 = do not write.
// Used for CSA/HCA `cmp_slot_mapping` (cmp_block_table) and CSA `idx_slot_mapping`
// (idx_block_table), ratio 4 or 128.
inline void build_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                          ConstView<std::int32_t, 1> positions,
                                          ConstView<std::int32_t, 2> cmp_table, index_t num_blocks,
                                          int ratio, const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_compressed_slot_mapping";
  if (ratio != 4 && ratio != 128) throw_arg(where, "ratio", ratio, "4 or 128");
  detail::check_positions(where, positions, sh, cfg);
  detail::validate_compressed_slots(where, "cmp_block_table", dst, positions, cmp_table, num_blocks,
                                    ratio, cfg.page, sh);
  detail::fill_compressed_slot_mapping(dst, positions, cmp_table, ratio, sh, cfg.page);
}

// Compressor-state slot of every token (spec §3.6): page `state_page` rows (cfg.c4_state_page
// = 4 for ratio-4 states, cfg.c128_state_page = 8 for ratio-128 states), written for every
// token (no commit masking). INT64 [T]; -1 = do not write.
inline void build_state_slot_mapping(View<std::int64_t, 1> dst,
                                     ConstView<std::int32_t, 1> positions,
                                     ConstView<std::int32_t, 2> state_table, index_t num_blocks,
                                     int state_page, const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_state_slot_mapping";
  if (state_page != cfg.c4_state_page && state_page != cfg.c128_state_page) {
    throw_arg(where, "state_page", state_page,
              std::to_string(cfg.c4_state_page) + " or " + std::to_string(cfg.c128_state_page));
  }
  detail::check_positions(where, positions, sh, cfg);
  detail::validate_paged_slots(where, "state_table", dst, positions, state_table, num_blocks,
                               state_page, sh);
  detail::fill_ori_slot_mapping(dst, positions, state_table, sh, state_page);
}

// Sliding-window gather lists (spec §3.4), used as `swa_indices`/`swa_lens` and as
// `window_swa_indices`/`window_swa_lens`: for token t at position p, w0 = max(0, p - WIN + 1),
// lens[t] = p - w0 + 1 (1..WIN), idx[t, k] = physical slot of position w0 + k for k < lens[t]
// (oldest → newest, the token itself last); -1 for k >= lens[t] and for rows of an unmapped
// page. idx INT32 [T, WIN], lens INT32 [T]. num_blocks * page must be <= 2^31 (INT32 slots).
inline void build_window_indices(View<std::int32_t, 2> idx, View<std::int32_t, 1> lens,
                                 ConstView<std::int32_t, 1> positions,
                                 ConstView<std::int32_t, 2> block_table, index_t num_blocks,
                                 const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_window_indices";
  detail::check_positions(where, positions, sh, cfg);
  detail::validate_window_indices(where, idx, lens, positions, block_table, num_blocks, sh, cfg);
  detail::fill_window_indices(idx, lens, positions, block_table, sh, cfg);
}

}  // namespace tiledecode::paged
