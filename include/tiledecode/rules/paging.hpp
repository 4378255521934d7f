#pragma once
// The spec's paging rules, written once for every backend (spec §3). Golden keeps its own copy
// (golden/paged.hpp) so that it stays an independent oracle.
//
//   block_of(table, b, col)     the physical page of logical column `col` of request b: the table
//                               entry, or -1 for an unmapped entry (-1) or a column past the table
//   slot_of(table, b, row, page) the flattened physical row `block * page + row % page` of the
//                               logical row `row` (page = rows per table column), or -1
// Tables are INT32 (rows = requests, columns = logical pages); only -1 means "unmapped" (callers
// validate that no other negative entry is read, see paged/metadata.hpp).

#include <cstdint>

#include "tiledecode/core/view.hpp"

namespace tiledecode::rules {

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

}  // namespace tiledecode::rules
