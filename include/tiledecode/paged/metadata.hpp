#pragma once
// Paged-KV decode metadata (spec §3). Every builder writes a caller-owned output view in one
// pass, after validating every input it reads; on bad input it throws tiledecode::Error and has
// written nothing.
//
// Conventions (spec §3):
//   token row t = b*S + s; position_ids[t] = start[b] + s.
//   A slot is a flattened physical row: block_id * page_rows + row_in_page (INT64).
//   -1 in a slot mapping or index list = "do not write" / invalid. A block-table entry < 0 is an
//   unmapped page (its slots become -1); an entry >= the pool's block count is an error.
//   Logical table columns past the table width map to -1 (the spec's `blk < cols` rule).

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
inline void check_shape(std::string_view where, const StepShape& sh) {
  check_range(where, "shape.batch", sh.batch, 1, 1 << 20);
  check_range(where, "shape.seq", sh.seq, 1, 1 << 10);
  check_range(where, "shape.commit_tokens", sh.commit_tokens, -1, sh.seq + 1);
}
inline void check_len(std::string_view where, std::string_view arg, index_t got, index_t want) {
  check_equal(where, arg, got, want);
}
// Physical block of logical column `col` of request row `b`, validated against the pool.
// Returns -1 for unmapped entries and for columns past the table width.
inline index_t table_block(std::string_view where, std::string_view arg,
                           ConstView<std::int32_t, 2> table, index_t b, index_t col,
                           index_t num_blocks) {
  if (col < 0 || col >= table.extent(1)) return -1;
  const index_t blk = table(b, col);
  if (blk < 0) return -1;
  if (blk >= num_blocks) {
    throw_arg(where, std::string(arg) + "[" + std::to_string(b) + "," + std::to_string(col) + "]",
              blk, "[-1, " + std::to_string(num_blocks) + ") (pool blocks)");
  }
  return blk;
}
}  // namespace detail

// position_ids[b*S + s] = start[b] + s  (spec §3.1). Validates 0 <= start, start + S <= max_seq_len.
inline void build_position_ids(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                               const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_position_ids";
  detail::check_shape(where, sh);
  detail::check_len(where, "start.size()", index_t(start.size()), index_t(sh.batch));
  detail::check_len(where, "position_ids.extent(0)", dst.extent(0), index_t(sh.tokens()));
  for (int b = 0; b < sh.batch; ++b) {
    check_range(where, "start[" + std::to_string(b) + "]", start[b], 0, cfg.max_seq_len - sh.seq + 1);
  }
  for (int b = 0; b < sh.batch; ++b)
    for (int s = 0; s < sh.seq; ++s) dst(b * sh.seq + s) = start[b] + s;
}

// kv_seq_lens[b] = start[b] + committed tokens (spec §3.1).
inline void build_kv_seq_lens(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                              const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_kv_seq_lens";
  detail::check_shape(where, sh);
  detail::check_len(where, "start.size()", index_t(start.size()), index_t(sh.batch));
  detail::check_len(where, "kv_seq_lens.extent(0)", dst.extent(0), index_t(sh.batch));
  for (int b = 0; b < sh.batch; ++b) {
    check_range(where, "start[" + std::to_string(b) + "]", start[b], 0, cfg.max_seq_len - sh.seq + 1);
  }
  for (int b = 0; b < sh.batch; ++b) dst(b) = start[b] + sh.committed();
}

// Fixture block table (spec §3.2): table[b, c] = (phys(c) * B + b) mod P with
// phys(c) = c mod P (plain) or ((c mod P) * 7 + 3) mod P (permuted). Production engines
// supply their own tables.
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
// table[b, row / page] * page + row % page, or -1 if unmapped / past the table.
inline std::int64_t paged_slot(std::string_view where, std::string_view table_name,
                               ConstView<std::int32_t, 2> table, index_t b, index_t row,
                               index_t page, index_t num_blocks) {
  const index_t blk = detail::table_block(where, table_name, table, b, row / page, num_blocks);
  return blk < 0 ? -1 : blk * page + row % page;
}

namespace detail {
inline void check_positions(std::string_view where, ConstView<std::int32_t, 1> pos,
                            const StepShape& sh, const ModelConfig& cfg) {
  check_shape(where, sh);
  check_len(where, "position_ids.extent(0)", pos.extent(0), index_t(sh.tokens()));
  for (index_t t = 0; t < pos.extent(0); ++t) {
    check_range(where, "position_ids[" + std::to_string(t) + "]", pos(t), 0, cfg.max_seq_len);
  }
}
inline void check_table(std::string_view where, std::string_view arg,
                        ConstView<std::int32_t, 2> table, const StepShape& sh) {
  check_len(where, std::string(arg) + ".extent(0)", table.extent(0), index_t(sh.batch));
  check_at_least(where, std::string(arg) + ".extent(1)", table.extent(1), index_t(1));
}
}  // namespace detail

// Original-cache slot of each token (spec §3.3; also `swa_slot_mapping`): page 128, no commit
// masking (the draft row is overwritten next step).
inline void build_ori_slot_mapping(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                   ConstView<std::int32_t, 2> block_table, index_t num_blocks,
                                   const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_ori_slot_mapping";
  detail::check_positions(where, positions, sh, cfg);
  detail::check_table(where, "block_table", block_table, sh);
  detail::check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  for (index_t t = 0; t < sh.tokens(); ++t)  // validate every entry read, before any write
    (void)paged_slot(where, "block_table", block_table, t / sh.seq, positions(t), cfg.page, num_blocks);
  for (index_t t = 0; t < sh.tokens(); ++t)
    dst(t) = paged_slot(where, "block_table", block_table, t / sh.seq, positions(t), cfg.page,
                        num_blocks);
}

// Compressed-cache slot for ratio R (spec §3.5): only a token closing a window ((pos+1) % R == 0)
// writes row c = pos / R through `cmp_table` (page 128); boundary tokens at s >= commit_tokens
// are masked to -1.
inline void build_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                          ConstView<std::int32_t, 1> positions,
                                          ConstView<std::int32_t, 2> cmp_table, index_t num_blocks,
                                          int ratio, const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_compressed_slot_mapping";
  if (ratio != 4 && ratio != 128) throw_arg(where, "ratio", ratio, "4 or 128");
  detail::check_positions(where, positions, sh, cfg);
  detail::check_table(where, "cmp_block_table", cmp_table, sh);
  detail::check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  auto slot = [&](index_t t) -> std::int64_t {
    const index_t p = positions(t);
    if ((p + 1) % ratio != 0 || (t % sh.seq) >= sh.committed()) return -1;
    return paged_slot(where, "cmp_block_table", cmp_table, t / sh.seq, p / ratio, cfg.page,
                      num_blocks);
  };
  for (index_t t = 0; t < sh.tokens(); ++t) (void)slot(t);
  for (index_t t = 0; t < sh.tokens(); ++t) dst(t) = slot(t);
}

// Compressor-state slot of every token (spec §3.6): page `state_page` (4 or 8) rows, written for
// every token (no commit masking).
inline void build_state_slot_mapping(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                     ConstView<std::int32_t, 2> state_table, index_t num_blocks,
                                     int state_page, const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_state_slot_mapping";
  if (state_page != cfg.c4_state_page && state_page != cfg.c128_state_page) {
    throw_arg(where, "state_page", state_page, "4 or 8");
  }
  detail::check_positions(where, positions, sh, cfg);
  detail::check_table(where, "state_table", state_table, sh);
  detail::check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  for (index_t t = 0; t < sh.tokens(); ++t)
    (void)paged_slot(where, "state_table", state_table, t / sh.seq, positions(t), state_page, num_blocks);
  for (index_t t = 0; t < sh.tokens(); ++t)
    dst(t) = paged_slot(where, "state_table", state_table, t / sh.seq, positions(t), state_page,
                        num_blocks);
}

// Sliding-window gather lists (spec §3.4): for token t at position p, w0 = max(0, p - WIN + 1),
// lens[t] = p - w0 + 1, idx[t, k] = physical slot of position w0 + k (oldest → newest, the token
// itself last); -1 past lens[t] or for an unmapped page. INT32 [T, WIN].
inline void build_window_indices(View<std::int32_t, 2> idx, View<std::int32_t, 1> lens,
                                 ConstView<std::int32_t, 1> positions,
                                 ConstView<std::int32_t, 2> block_table, index_t num_blocks,
                                 const StepShape& sh, const ModelConfig& cfg) {
  constexpr std::string_view where = "build_window_indices";
  detail::check_positions(where, positions, sh, cfg);
  detail::check_table(where, "block_table", block_table, sh);
  detail::check_len(where, "window_indices.extent(0)", idx.extent(0), index_t(sh.tokens()));
  detail::check_len(where, "window_indices.extent(1)", idx.extent(1), index_t(cfg.window));
  detail::check_len(where, "window_lens.extent(0)", lens.extent(0), index_t(sh.tokens()));
  if (num_blocks * cfg.page > INT32_MAX) throw_arg(where, "num_blocks", num_blocks, "pool rows < 2^31 (INT32 lists)");
  // Validate every table column a window touches (at most two per token) before writing.
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t p = positions(t), w0 = std::max<index_t>(0, p - cfg.window + 1);
    for (index_t c = w0 / cfg.page; c <= p / cfg.page; ++c)
      (void)detail::table_block(where, "block_table", block_table, t / sh.seq, c, num_blocks);
  }
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, p = positions(t);
    const index_t w0 = std::max<index_t>(0, p - cfg.window + 1), len = p - w0 + 1;
    lens(t) = static_cast<std::int32_t>(len);
    for (index_t k = 0; k < cfg.window; ++k) {
      idx(t, k) = k < len ? static_cast<std::int32_t>(paged_slot(where, "block_table", block_table,
                                                                  b, w0 + k, cfg.page, num_blocks))
                          : -1;
    }
  }
}

}  // namespace tiledecode::paged
