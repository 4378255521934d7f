#pragma once
// The spec's paging rules, written once for every backend (spec §3; HEAD addendum §2, §3, §7).
// Golden keeps its own copy (golden/paged.hpp) so that it stays an independent oracle.
//
//   block_of(table, b, col)      the physical page of logical column `col` of request b: the table
//                                entry, or -1 for an unmapped entry (-1) or a column past the table
//   slot_of(table, b, row, page) the flattened physical row `block * page + row % page` of the
//                                logical row `row` (page = rows per table column), or -1. This is
//                                the READER rule of every layout (addendum §2.3.2: readers index
//                                the unwrapped column): a kernel reads compressed row c of
//                                request b at slot_of(table, b, c, rows_per_page(layout, table)).
//   ring_slot_of(table, b, row, page, n)
//                                the WRITER rule of the ring layouts (addendum §2.2, §3.2):
//                                table[b, (row / page) mod n] * page + row % page, or -1
//
// Tables are INT32 (rows = requests, columns = logical pages); only -1 means "unmapped" (callers
// validate that no other negative entry is read, see paged/metadata.hpp).
//
// Layouts (which formula each table of a step uses):
//   base            spec §3 host lowering: one compressed table shared by CSA and HCA, every
//                   cache paged at cfg.page rows, no ring wrap, no block_counts.
//   device_ring     addendum §2 (#862, the [DSP] tree): the base tables plus block_counts [B, 6];
//                   writers of the compressed, index and state tables wrap the logical column
//                   mod n_g, ori does not (its ring is encoded in the table, §2.3.1).
//   prefix_caching  addendum §3 (#955, the [MTP] tree): every scheduler table (ori, HCA cmp,
//                   CSA cmp, index) has cfg.page (= 128) source tokens per column, so a page of a
//                   ratio-R table stores cfg.page / R rows (HCA 1, CSA and index 32); separate HCA
//                   and CSA compressed tables and pools; block_counts [B, 7]; same ring rule.
// With R | page, compressed row c = p / R lies in column c / (page / R) = p / page and row
// c % (page / R) = (p % page) / R, so the addendum's §3.2 form (j = p // 128, o = (p mod 128)//R)
// and the generic `ring_slot_of(table, b, c, page / R, n)` are the same number.

#include <cstdint>

#include "tiledecode/core/view.hpp"

namespace tiledecode::rules {

enum class Layout : std::uint8_t { base = 0, device_ring = 1, prefix_caching = 2 };

// The seven tables of one step. The value is the block_counts column of the prefix-caching layout
// (addendum §3.1: 0 ori, 1 HCA cmp, 2 CSA cmp, 3 index, 4 HCA state, 5 CSA state, 6 CSA inner
// state); see count_column for the #862 numbering.
enum class Table : std::uint8_t {
  ori = 0,
  hca_cmp = 1,
  csa_cmp = 2,
  idx = 3,
  hca_state = 4,
  csa_state = 5,
  csa_inner_state = 6,
};
inline constexpr int kNumTables = 7;

// Columns of block_counts: 7 (prefix caching, §3.1), 6 (#862, §2.2), none for the base layout.
constexpr int block_counts_width(Layout layout) {
  return layout == Layout::prefix_caching ? 7 : layout == Layout::device_ring ? 6 : 0;
}

// block_counts column holding n_g of `table`, or -1 where the layout never reads one: the base
// layout, and ori in every layout (§2.3.1: block_counts[:, 0] is never read). #862 groups
// (§2.2): 0 ori, 1 cmp (shared by HCA and CSA), 2 idx, 3 HCA state, 4 CSA state, 5 inner state.
constexpr int count_column(Layout layout, Table table) {
  if (layout == Layout::base || table == Table::ori) return -1;
  if (layout == Layout::prefix_caching) return static_cast<int>(table);
  switch (table) {
    case Table::hca_cmp:
    case Table::csa_cmp:
      return 1;
    case Table::idx:
      return 2;
    case Table::hca_state:
      return 3;
    case Table::csa_state:
      return 4;
    default:
      return 5;
  }
}

// Compression ratio whose rows (compressed tables) or whose windows (state tables) a table holds;
// 1 for ori.
constexpr int table_ratio(Table table) {
  switch (table) {
    case Table::ori:
      return 1;
    case Table::hca_cmp:
    case Table::hca_state:
      return 128;
    default:
      return 4;
  }
}
constexpr bool is_state_table(Table table) {
  return table == Table::hca_state || table == Table::csa_state || table == Table::csa_inner_state;
}

// Storage rows per column of a compressed / index table: cfg.page in the base and #862 layouts
// (compressed-row paging), cfg.page / R in the prefix-caching layout (source-token paging,
// addendum §3.1: 128 / 4 = 32 for CSA and index, 128 / 128 = 1 for HCA). `page` = cfg.page.
constexpr index_t compressed_rows_per_page(Layout layout, index_t page, int ratio) {
  return layout == Layout::prefix_caching ? page / ratio : page;
}

// Physical block of a validated table: -1 for an unmapped entry or a column past the table.
inline index_t block_of(ConstView<std::int32_t, 2> table, index_t b, index_t col) {
  return col < table.extent(1) ? index_t(table(b, col)) : index_t(-1);
}

// Flattened slot of logical row `row` through a validated table of `page` rows per column.
inline std::int64_t slot_of(ConstView<std::int32_t, 2> table, index_t b, index_t row,
                            index_t page) {
  const index_t blk = block_of(table, b, row / page);
  return blk < 0 ? -1 : blk * page + row % page;
}

// Ring column of logical column `col` for a request with `count` live columns (addendum §2.2,
// §3.2: the device writers read table[b, L mod n_g]). count >= 1.
constexpr index_t ring_column(index_t col, index_t count) {
  return col % count;
}

// Writer slot of logical row `row` through a ring of `count` live columns of a validated table
// (1 <= count <= table width): table[b, (row / page) mod count] * page + row % page; exactly -1
// for an unmapped (-1) entry (addendum §2.3.4: never -page + r).
inline std::int64_t ring_slot_of(ConstView<std::int32_t, 2> table, index_t b, index_t row,
                                 index_t page, index_t count) {
  const index_t blk = table(b, ring_column(row / page, count));
  return blk < 0 ? -1 : blk * page + row % page;
}

// Last compressed row a token at `pos` can read (spec §3.5: rows c < (pos + 1) / R are visible),
// -1 if none. Every reader of a step touches rows 0 .. this of its request.
constexpr index_t last_visible_compressed_row(index_t pos, int ratio) {
  return (pos + 1) / ratio - 1;
}

// First logical column L in [first, last] with table[b, L] != table[b, L mod count] (the reader
// and the writer would then address different pages, addendum §2.3.2), or -1 if the table is
// periodic there. Columns < count are trivially periodic. The ring column is stepped alongside L
// (no division per column).
inline index_t first_aperiodic_column(ConstView<std::int32_t, 2> table, index_t b, index_t count,
                                      index_t first, index_t last) {
  index_t col = first < count ? count : first;
  for (index_t ring = ring_column(col, count); col <= last; ++col) {
    if (table(b, col) != table(b, ring)) return col;
    if (++ring == count) ring = 0;
  }
  return -1;
}

}  // namespace tiledecode::rules
