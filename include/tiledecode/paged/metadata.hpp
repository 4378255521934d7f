#pragma once
// Paged-KV decode metadata (spec §3; HEAD addendum §2, §3, §7). Every builder writes a
// caller-owned output view in one pass, after validating every input it reads; on bad input it
// throws tiledecode::Error and has written nothing.
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
// Ring builders (addendum §2.2, §3.2; `build_ring_*`): the device writers of the compressed,
// index and state tables wrap the logical column, table[b, L mod n] with n = block_counts[b, g],
// while every reader (sparse attention, indexer score, compressor state pooling) indexes the
// unwrapped column table[b, L] (§2.3.2). The two agree only on a periodic table, so:
//   [AMBIGUOUS addendum §2.3.2] option (a): the table must satisfy table[b, L] ==
//     table[b, L mod n] for every column L the step's writers or readers touch; a non-periodic
//     entry is REJECTED (Error naming table[b,L]), never silently written through the ring.
//     Columns touched by request b: compressed / index tables 0 .. last visible row / rows per
//     page of the request's last token (spec §3.5 visibility); state tables the positions its
//     tokens write plus those the compressor pooling of this step's boundaries reads (ratio 4:
//     from the previous window, ratio 128: from the window start; rules/compressor.hpp).
//   [AMBIGUOUS addendum §2.3.4] a -1 entry gives exactly -1 (never -page + r); every touched
//     column must lie inside the table (the reader would otherwise read past it), and
//     1 <= n <= table width.
//   A table with zero columns is a group the deployment does not serve (e.g. no CSA layer at 1M,
//     addendum §1.3): its slots are all -1 and neither it nor its count is read.
//   Commit masking (spec §3.5) applies as in the base builders; the device builder has none
//     (addendum §2.3.3): pass commit_tokens = -1 to get its behaviour.
//   [AMBIGUOUS addendum §7, S > R] option (b): every boundary token of a step (S = 8 has two
//     ratio-4 boundaries) gets its own compressed slot, row c = pos / R.
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
#include "tiledecode/rules/compressor.hpp"
#include "tiledecode/rules/paging.hpp"

namespace tiledecode::paged {

using rules::Layout;
using rules::Table;

// Batch geometry of one decode step.
struct StepShape {
  int batch = 4;           // B requests
  int seq = 2;             // S tokens per request
  int commit_tokens = -1;  // -1: all S committed (standalone tests); 1: MTP (draft token s=1)
  constexpr int tokens() const { return batch * seq; }
  constexpr int committed() const { return commit_tokens < 0 ? seq : commit_tokens; }
};

// One ring-wrapped table as the ring builders read it (addendum §2.2 / §3.2). `name` names the
// table in errors ("csa_cmp_block_table", ...); StepMetadata fills these from its StepTables.
struct RingTable {
  std::string_view name = "table";
  ConstView<std::int32_t, 2> table{};         // [>= B, width]; width 0 = group not served
  ConstView<std::int32_t, 2> block_counts{};  // [>= B, > count_col]
  int count_col = 1;                          // block_counts column of n_g
  index_t num_blocks = 1;                     // pool pages
  index_t rows_per_page = 128;  // storage rows per page (compressed: page or page / R; state: SB)
  int ratio = 4;  // compressed: ratio of its rows; state: ratio of the compressor that pools it
  bool state = false;  // state table (row = position) or compressed / index table (row = pos / R)

  bool served() const { return table.extent(1) > 0; }
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
// The paging formulas live in rules/paging.hpp (one copy for every backend).
using rules::block_of;
using rules::slot_of;

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

// --- ring layouts (addendum §2, §3) -----------------------------------------------------------

// Logical columns [lo, hi] of request b's table that this step's writers and readers touch
// (hi < lo: none). See the header comment for the rule; positions are validated.
inline void ring_columns_touched(const RingTable& r, ConstView<std::int32_t, 1> positions,
                                 index_t b, const StepShape& sh, index_t& lo, index_t& hi) {
  index_t p_min = positions(b * sh.seq), p_max = p_min, first_read = p_min;
  for (index_t s = 0; s < sh.seq; ++s) {
    const index_t p = positions(b * sh.seq + s);
    p_min = std::min(p_min, p);
    p_max = std::max(p_max, p);
    // Every boundary pools (committed or not: the compressor reads its states either way).
    if (r.state && rules::closes_window(p, r.ratio)) {
      first_read = std::min(first_read,
                            rules::compressor_first_position(r.ratio, r.ratio == 4, p / r.ratio));
    }
  }
  if (r.state) {
    lo = std::min(p_min, first_read) / r.rows_per_page;
    hi = p_max / r.rows_per_page;
  } else {
    const index_t last_row = rules::last_visible_compressed_row(p_max, r.ratio);
    lo = 0;
    hi = last_row < 0 ? -1 : last_row / r.rows_per_page;
  }
}

inline void validate_ring_slots(std::string_view where, const RingTable& r,
                                View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                const StepShape& sh) {
  check_len(where, "slot_mapping.extent(0)", dst.extent(0), index_t(sh.tokens()));
  if (!r.served()) return;  // not served: nothing is read
  check_table(where, r.name, r.table, sh);
  check_num_blocks(where, "ring.num_blocks", r.num_blocks, r.rows_per_page);
  if (r.block_counts.extent(0) < sh.batch)
    check_at_least(where, "ring.block_counts.extent(0)", r.block_counts.extent(0),
                   index_t(sh.batch));
  if (r.count_col < 0 || r.count_col >= r.block_counts.extent(1))
    check_at_least(where, "ring.block_counts.extent(1)", r.block_counts.extent(1),
                   index_t(r.count_col) + 1);
  const index_t width = r.table.extent(1);
  for (index_t b = 0; b < sh.batch; ++b) {
    const index_t n = r.block_counts(b, r.count_col);
    if (n < 1 || n > width) {
      throw_arg(where, idx_name("block_counts", b, r.count_col), n,
                "[1, " + std::to_string(width) + "] (live columns of " + std::string(r.name) +
                    ", extent(1) = " + std::to_string(width) + ")");
    }
    index_t lo = 0, hi = -1;
    ring_columns_touched(r, positions, b, sh, lo, hi);
    if (hi < lo) continue;
    if (hi >= width) {
      throw_arg(where, std::string(r.name) + ".extent(1)", width,
                ">= " + std::to_string(hi + 1) + " (request " + std::to_string(b) +
                    " touches logical column " + std::to_string(hi) +
                    "; readers index the unwrapped column, addendum §2.3.2)");
    }
    // Each ring column the step maps to, once (check_block names the entry).
    for (index_t col = lo; col <= std::min(hi, lo + n - 1); ++col)
      check_block(where, r.name, r.table, b, rules::ring_column(col, n), r.num_blocks);
    const index_t bad = rules::first_aperiodic_column(r.table, b, n, lo, hi);
    if (bad >= 0) {
      const index_t ring = rules::ring_column(bad, n);
      throw_arg(where, idx_name(r.name, b, bad), r.table(b, bad),
                "exactly " + idx_name(r.name, b, ring) + " = " + std::to_string(r.table(b, ring)) +
                    " (ring writers use column L mod n, n = " +
                    idx_name("block_counts", b, r.count_col) + " = " + std::to_string(n) +
                    ", readers column L: the table must be periodic over the columns a step "
                    "touches, addendum §2.3.2 option (a))");
    }
  }
}

inline void fill_ring_slots(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                            const RingTable& r, const StepShape& sh) {
  for (index_t b = 0, t = 0; b < sh.batch; ++b) {
    const index_t n = r.served() ? index_t(r.block_counts(b, r.count_col)) : 0;
    for (index_t s = 0; s < sh.seq; ++s, ++t) {
      const index_t p = positions(t);
      if (n == 0) {
        dst(t) = -1;
      } else if (r.state) {
        dst(t) = rules::ring_slot_of(r.table, b, p, r.rows_per_page, n);
      } else {
        const bool write = rules::closes_window(p, r.ratio) && s < sh.committed();
        dst(t) = write ? rules::ring_slot_of(r.table, b, p / r.ratio, r.rows_per_page, n) : -1;
      }
    }
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

// Ring compressed-cache slot (addendum §2.2 #862 form, §3.2 prefix-caching form): a token closing
// a window ((pos + 1) % R == 0, committed: s < commit_tokens) writes row c = pos / R at
//   table[b, (c / rows_per_page) mod n] * rows_per_page + c % rows_per_page,
// n = block_counts[b, count_col]. rows_per_page = cfg.page for #862 (compressed-row paging),
// cfg.page / R for prefix caching (32 CSA / index, 1 HCA). -1 = do not write (no committed
// boundary, unmapped page, or a table with zero columns = group not served). Validates the counts
// (1 <= n <= width), that the table covers and is periodic over every column the step touches
// (see the header comment), and every entry read. INT64 [T].
inline void build_ring_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                               ConstView<std::int32_t, 1> positions,
                                               const RingTable& ring, const StepShape& sh,
                                               const ModelConfig& cfg) {
  constexpr std::string_view where = "build_ring_compressed_slot_mapping";
  if (ring.ratio != 4 && ring.ratio != 128) throw_arg(where, "ring.ratio", ring.ratio, "4 or 128");
  check_range<index_t>(where, "ring.rows_per_page", ring.rows_per_page, 1, index_t(1) << 30);
  detail::check_positions(where, positions, sh, cfg);
  RingTable r = ring;
  r.state = false;
  detail::validate_ring_slots(where, r, dst, positions, sh);
  detail::fill_ring_slots(dst, positions, r, sh);
}

// Ring compressor-state slot of every token (addendum §2.2, §7): table[b, (pos / SB) mod n] * SB +
// pos % SB with SB = ring.rows_per_page (cfg.c4_state_page or cfg.c128_state_page; 4/8, 8/32 and
// 2/8 are all deployments) and ring.ratio the ratio of the compressor that pools these states (4
// overlapping or 128): the step's pooling reads are part of the periodicity check. Not commit
// masked. INT64 [T]; -1 = unmapped or group not served.
inline void build_ring_state_slot_mapping(View<std::int64_t, 1> dst,
                                          ConstView<std::int32_t, 1> positions,
                                          const RingTable& ring, const StepShape& sh,
                                          const ModelConfig& cfg) {
  constexpr std::string_view where = "build_ring_state_slot_mapping";
  if (ring.ratio != 4 && ring.ratio != 128) throw_arg(where, "ring.ratio", ring.ratio, "4 or 128");
  const index_t sb = ring.ratio == 4 ? cfg.c4_state_page : cfg.c128_state_page;
  if (ring.rows_per_page != sb || sb < 1) {
    throw_arg(where, "ring.rows_per_page", ring.rows_per_page,
              "the state page of ratio " + std::to_string(ring.ratio) +
                  " (cfg.c4_state_page / cfg.c128_state_page = " + std::to_string(sb) + ", >= 1)");
  }
  detail::check_positions(where, positions, sh, cfg);
  RingTable r = ring;
  r.state = true;
  detail::validate_ring_slots(where, r, dst, positions, sh);
  detail::fill_ring_slots(dst, positions, r, sh);
}

}  // namespace tiledecode::paged
