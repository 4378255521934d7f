#pragma once
// Golden twins of the paged-KV metadata builders and of cache write / gather (spec §3; HEAD
// addendum §2.2, §3.2, §7), written element by element straight from the spec formulas with
// bounds-checked access (View::at). They do not validate arguments beyond that (a bad index
// throws from at()); they are the oracle for valid inputs. Same names and argument order as
// tiledecode::paged where a twin exists. Independent of rules/paging.hpp (the fast path's copy):
// only types (StepShape, Layout) come from paged/metadata.hpp, no formula.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"

namespace tiledecode::golden {

using paged::StepShape;

// phys_slot(x) = table[b, x // page] * page + x % page; -1 if the column is past the table or
// the entry is negative (spec §3.3).
inline std::int64_t phys_slot(ConstView<std::int32_t, 2> table, index_t b, index_t x,
                              index_t page) {
  const index_t blk = x / page;
  if (blk >= table.extent(1)) return -1;
  const index_t entry = table.at(b, blk);
  if (entry < 0) return -1;
  return entry * page + x % page;
}

// §3.1 position_ids[b, s] = start_b + s.
inline void build_position_ids(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                               const StepShape& sh, const ModelConfig& /*cfg*/) {
  for (int b = 0; b < sh.batch; ++b)
    for (int s = 0; s < sh.seq; ++s) dst.at(b * sh.seq + s) = start[b] + s;
}

// §3.1 kv_seq_lens[b] = start_b + (commit_tokens if given else S).
inline void build_kv_seq_lens(View<std::int32_t, 1> dst, std::span<const std::int32_t> start,
                              const StepShape& sh, const ModelConfig& /*cfg*/) {
  const int add = sh.commit_tokens >= 0 ? sh.commit_tokens : sh.seq;
  for (int b = 0; b < sh.batch; ++b) dst.at(b) = start[b] + add;
}

// §3.2 block_table[b, c] = (phys(c) * batch + b) mod P.
inline void build_fixture_block_table(View<std::int32_t, 2> dst, index_t num_blocks,
                                      bool permuted = false) {
  const index_t batch = dst.extent(0);
  for (index_t b = 0; b < batch; ++b) {
    for (index_t c = 0; c < dst.extent(1); ++c) {
      index_t phys = c % num_blocks;
      if (permuted) phys = ((c % num_blocks) * 7 + 3) % num_blocks;
      dst.at(b, c) = std::int32_t((phys * batch + b) % num_blocks);
    }
  }
}

// §3.3 ori_slot(t) = table[b, pos // 128] * 128 + pos % 128, or -1.
inline void build_ori_slot_mapping(View<std::int64_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                   ConstView<std::int32_t, 2> block_table, index_t /*num_blocks*/,
                                   const StepShape& sh, const ModelConfig& cfg) {
  for (index_t t = 0; t < sh.tokens(); ++t)
    dst.at(t) = phys_slot(block_table, t / sh.seq, positions.at(t), cfg.page);
}

// §3.5 cmp_slot(t): boundary ((pos + 1) % R == 0) → row c = pos // R through the table (page
// 128); -1 otherwise, and -1 for boundary tokens at s >= commit_tokens.
inline void build_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                          ConstView<std::int32_t, 1> positions,
                                          ConstView<std::int32_t, 2> cmp_table,
                                          index_t /*num_blocks*/, int ratio, const StepShape& sh,
                                          const ModelConfig& cfg) {
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, s = t % sh.seq, pos = positions.at(t);
    const bool boundary = (pos + 1) % ratio == 0;
    std::int64_t slot = boundary ? phys_slot(cmp_table, b, pos / ratio, cfg.page) : -1;
    if (sh.commit_tokens >= 0 && s >= sh.commit_tokens) slot = -1;
    dst.at(t) = slot;
  }
}

// §3.6 state_slot(t) = state_table[b, pos // SB] * SB + pos % SB, or -1.
inline void build_state_slot_mapping(View<std::int64_t, 1> dst,
                                     ConstView<std::int32_t, 1> positions,
                                     ConstView<std::int32_t, 2> state_table, index_t /*num_blocks*/,
                                     int state_page, const StepShape& sh,
                                     const ModelConfig& /*cfg*/) {
  for (index_t t = 0; t < sh.tokens(); ++t)
    dst.at(t) = phys_slot(state_table, t / sh.seq, positions.at(t), state_page);
}

// §3.4 w0 = max(0, p - WIN + 1); len = p - w0 + 1; idx[t, k] = phys_slot(w0 + k) for k < len,
// else -1.
inline void build_window_indices(View<std::int32_t, 2> idx, View<std::int32_t, 1> lens,
                                 ConstView<std::int32_t, 1> positions,
                                 ConstView<std::int32_t, 2> block_table, index_t /*num_blocks*/,
                                 const StepShape& sh, const ModelConfig& cfg) {
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t p = positions.at(t);
    const index_t w0 = std::max<index_t>(0, p - cfg.window + 1);
    const index_t len = p - w0 + 1;
    lens.at(t) = std::int32_t(len);
    for (index_t k = 0; k < cfg.window; ++k) {
      idx.at(t, k) =
          k < len ? std::int32_t(phys_slot(block_table, t / sh.seq, w0 + k, cfg.page)) : -1;
    }
  }
}

// --- HEAD addendum: ring writers (§2.2, §3.2) ------------------------------------------------

// Addendum §2.2, #862 form (compressed-row paging, P = cfg.page rows per page): on a boundary
// (p + 1) mod R == 0 with s < commit_tokens, c = p // R and
//   slot = cmp[b, (c // P) mod n]·P + c mod P,   n = block_counts[b, count_col];
// -1 if the entry is negative, no committed boundary.
inline void build_ring862_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                                  ConstView<std::int32_t, 1> positions,
                                                  ConstView<std::int32_t, 2> table,
                                                  ConstView<std::int32_t, 2> block_counts,
                                                  int count_col, int ratio, const StepShape& sh,
                                                  const ModelConfig& cfg) {
  const index_t P = cfg.page;
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, s = t % sh.seq, p = positions.at(t);
    std::int64_t slot = -1;
    if ((p + 1) % ratio == 0) {
      const index_t c = p / ratio, n = block_counts.at(b, count_col);
      const index_t entry = table.at(b, (c / P) % n);
      if (entry >= 0) slot = entry * P + c % P;
    }
    if (sh.commit_tokens >= 0 && s >= sh.commit_tokens) slot = -1;
    dst.at(t) = slot;
  }
}

// Addendum §3.2, prefix-caching form: on a boundary, source block j = p // 128 and in-block
// offset o = (p mod 128) // R (128 = cfg.page, the source tokens per column), rows per page
// 128 / R:
//   csa_cmp / csa_idx: table[b, j mod n]·32 + o ;  hca_cmp: table[b, j mod n]·1 + 0.
inline void build_prefix_compressed_slot_mapping(View<std::int64_t, 1> dst,
                                                 ConstView<std::int32_t, 1> positions,
                                                 ConstView<std::int32_t, 2> table,
                                                 ConstView<std::int32_t, 2> block_counts,
                                                 int count_col, int ratio, const StepShape& sh,
                                                 const ModelConfig& cfg) {
  const index_t tokens_per_col = cfg.page, rows = cfg.page / ratio;
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, s = t % sh.seq, p = positions.at(t);
    std::int64_t slot = -1;
    if ((p + 1) % ratio == 0) {
      const index_t j = p / tokens_per_col, o = (p % tokens_per_col) / ratio;
      const index_t n = block_counts.at(b, count_col);
      const index_t entry = table.at(b, j % n);
      if (entry >= 0) slot = entry * rows + o;
    }
    if (sh.commit_tokens >= 0 && s >= sh.commit_tokens) slot = -1;
    dst.at(t) = slot;
  }
}

// Addendum §2.2 / §7 state writers: slot = table[b, (p // SB) mod n]·SB + p mod SB for every token
// (no commit masking); -1 if the entry is negative.
inline void build_ring_state_slot_mapping(View<std::int64_t, 1> dst,
                                          ConstView<std::int32_t, 1> positions,
                                          ConstView<std::int32_t, 2> state_table,
                                          ConstView<std::int32_t, 2> block_counts, int count_col,
                                          int state_page, const StepShape& sh) {
  for (index_t t = 0; t < sh.tokens(); ++t) {
    const index_t b = t / sh.seq, p = positions.at(t), n = block_counts.at(b, count_col);
    const index_t entry = state_table.at(b, (p / state_page) % n);
    dst.at(t) = entry >= 0 ? entry * state_page + p % state_page : -1;
  }
}

// Addendum §2.3.2 option (a): table[b, L] == table[b, L mod n] for every L in [first, last].
inline bool ring_table_is_periodic(ConstView<std::int32_t, 2> table, index_t b, index_t n,
                                   index_t first, index_t last) {
  for (index_t L = first; L <= last; ++L)
    if (table.at(b, L) != table.at(b, L % n)) return false;
  return true;
}

// Reader of compressed row c (addendum §3.2 / §3.3): table[b, c // rows]·rows + c mod rows,
// rows = cfg.page / R (prefix caching) or cfg.page; -1 past the table or for a negative entry.
inline std::int64_t compressed_row_slot(ConstView<std::int32_t, 2> table, index_t b, index_t c,
                                        index_t rows) {
  return phys_slot(table, b, c, rows);
}

// Cache write: pool[slot[t]] = rows[t] where slot[t] >= 0, in token order.
template <class E>
void write_cache(View<E, 2> pool, ConstView<std::type_identity_t<E>, 2> rows,
                 ConstView<std::int64_t, 1> slot_mapping) {
  for (index_t t = 0; t < rows.extent(0); ++t) {
    const index_t slot = slot_mapping.at(t);
    if (slot < 0) continue;
    for (index_t j = 0; j < rows.extent(1); ++j) pool.at(slot, j) = rows.at(t, j);
  }
}

// Gather: dst[i] = pool[slot[i]], valid 1; slot -1 → zero row (all-zero bytes), valid 0.
template <class E, class I>
void gather_rows(View<E, 2> dst, View<std::uint8_t, 1> valid,
                 ConstView<std::type_identity_t<E>, 2> pool, ConstView<I, 1> slots) {
  for (index_t i = 0; i < slots.extent(0); ++i) {
    const index_t slot = slots.at(i);
    valid.at(i) = slot >= 0 ? 1 : 0;
    for (index_t j = 0; j < dst.extent(1); ++j) {
      if (slot >= 0) {
        dst.at(i, j) = pool.at(slot, j);
      } else {
        std::memset(static_cast<void*>(&dst.at(i, j)), 0, sizeof(E));
      }
    }
  }
}

// Window gather: per token, gather_rows of its window list.
template <class E>
void gather_windows(View<E, 3> dst, View<std::uint8_t, 2> valid,
                    ConstView<std::type_identity_t<E>, 2> pool,
                    ConstView<std::int32_t, 2> window_indices) {
  for (index_t t = 0; t < window_indices.extent(0); ++t)
    gather_rows<E, std::int32_t>(dst.row(t), valid.row(t), pool, window_indices.row(t));
}

// Logical gather: row r → table_row[r // page] * page + r % page; -1, unmapped or past the
// table → zero row, valid 0.
template <class E>
void gather_logical_rows(View<E, 2> dst, View<std::uint8_t, 1> valid,
                         ConstView<std::type_identity_t<E>, 2> pool,
                         ConstView<std::int32_t, 1> table_row, ConstView<std::int32_t, 1> rows,
                         index_t page) {
  for (index_t i = 0; i < rows.extent(0); ++i) {
    const index_t r = rows.at(i);
    index_t slot = -1;
    if (r >= 0 && r / page < table_row.extent(0) && table_row.at(r / page) >= 0)
      slot = index_t(table_row.at(r / page)) * page + r % page;
    valid.at(i) = slot >= 0 ? 1 : 0;
    for (index_t j = 0; j < dst.extent(1); ++j) {
      if (slot >= 0) {
        dst.at(i, j) = pool.at(slot, j);
      } else {
        std::memset(static_cast<void*>(&dst.at(i, j)), 0, sizeof(E));
      }
    }
  }
}

}  // namespace tiledecode::golden
