#pragma once
// Paged cache write (scatter) and gather (spec §3.3–§3.6, §8.1).
//
// A pool is any paged cache seen as rows: View<E, 2> [rows, width] with rows = blocks * page
// (the ori cache [blocks, 128, 1, 512] BF16 is [blocks*128, 512]; the index cache is INT8
// [blocks*128, 128] plus its FP32 scales [blocks*128, 1]; compressor states are FP32
// [blocks*page, 2*OUT_DIM]). E is any trivially copyable element type; rows are copied as bytes,
// so the inner dimension of every row view must be contiguous (stride 1).
//
// What -1 means:
//   slot mapping (write_cache):   -1 = skip this token (not written). < -1 is an error.
//   index list   (gather_rows, gather_windows): -1 = invalid → zero row, valid = 0. < -1 is an
//                                 error.
//   logical row  (gather_logical_rows): -1 = invalid; a row whose page is unmapped (table entry
//                                 -1) or past the table width is invalid too (spec §3.3 rule).
// Every index is validated against the pool before the first write: on bad input the functions
// throw tiledecode::Error naming the argument, e.g. `slot_mapping[3]`, and the value, and have
// written nothing.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"

namespace tiledecode::paged {

namespace detail {

template <class E, std::size_t R>
void check_rows_contiguous(std::string_view where, std::string_view arg, const View<E, R>& v) {
  if (v.extent(R - 1) > 1 && v.stride(R - 1) != 1) {
    throw_arg(where, std::string(arg) + ".stride(" + std::to_string(R - 1) + ")", v.stride(R - 1),
              "exactly 1 (rows are copied contiguously)");
  }
}

// slots[i] must be -1 or a pool row; the argument name is formatted only on failure.
template <class I, class Name>
void check_slot(std::string_view where, const Name& arg_name, I value, index_t rows) {
  if (value < -1 || index_t(value) >= rows) {
    throw_arg(where, arg_name(), index_t(value),
              "[-1, " + std::to_string(rows) + ") (-1 = skip/invalid; pool rows)");
  }
}

template <class E>
inline void copy_row(E* dst, const E* src, index_t width) {
  std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src),
              std::size_t(width) * sizeof(E));
}
template <class E>
inline void zero_row(E* dst, index_t width) {
  std::memset(static_cast<void*>(dst), 0, std::size_t(width) * sizeof(E));
}

// Gathers rows `slots[i]` (validated: -1 or in the pool) into dst rows, in order.
template <class E, class I>
void gather_rows_unchecked(View<E, 2> dst, View<std::uint8_t, 1> valid, ConstView<E, 2> pool,
                           ConstView<I, 1> slots) {
  const index_t width = pool.extent(1);
  for (index_t i = 0; i < slots.extent(0); ++i) {
    const index_t s = slots(i);
    if (s < 0) {
      zero_row(&dst(i, 0), width);
      valid(i) = 0;
    } else {
      copy_row(&dst(i, 0), &pool(s, 0), width);
      valid(i) = 1;
    }
  }
}

}  // namespace detail

// Cache write: pool[slot_mapping[t], :] = rows[t, :] for every t with slot_mapping[t] >= 0;
// -1 skips the token (spec §3.3: unmapped page, uncommitted compressed boundary, no boundary).
//   pool [pool_rows, W] E (written), rows [T, W] E, slot_mapping [T] INT64.
// Tokens are written in order t = 0..T-1, so if two tokens map to the same slot (aliasing
// fixture pools, spec §3.8) the later one wins — the spec's per-request order.
// Throws if slot_mapping[t] < -1 or >= pool_rows (naming `slot_mapping[t]`), or on shape
// mismatch; nothing is written then.
template <class E>
void write_cache(View<E, 2> pool, ConstView<std::type_identity_t<E>, 2> rows,
                 ConstView<std::int64_t, 1> slot_mapping) {
  static_assert(std::is_trivially_copyable_v<E>, "cache rows are copied as bytes");
  constexpr std::string_view where = "write_cache";
  check_equal(where, "rows.extent(1)", rows.extent(1), pool.extent(1));
  check_equal(where, "slot_mapping.extent(0)", slot_mapping.extent(0), rows.extent(0));
  detail::check_rows_contiguous(where, "pool", pool);
  detail::check_rows_contiguous(where, "rows", rows);
  const index_t n = rows.extent(0), pool_rows = pool.extent(0), width = pool.extent(1);
  for (index_t t = 0; t < n; ++t)
    detail::check_slot(
        where, [&] { return detail::idx_name("slot_mapping", t); }, slot_mapping(t), pool_rows);
  if (width == 0) return;
  for (index_t t = 0; t < n; ++t) {
    const index_t s = slot_mapping(t);
    if (s >= 0) detail::copy_row(&pool(s, 0), &rows(t, 0), width);
  }
}

namespace detail {
template <class E, class I>
void gather_rows_checked(View<E, 2> dst, View<std::uint8_t, 1> valid, ConstView<E, 2> pool,
                         ConstView<I, 1> slots) {
  static_assert(std::is_trivially_copyable_v<E>, "cache rows are copied as bytes");
  static_assert(std::is_same_v<I, std::int32_t> || std::is_same_v<I, std::int64_t>,
                "slot lists are INT32 (window lists) or INT64 (slot mappings)");
  constexpr std::string_view where = "gather_rows";
  check_equal(where, "dst.extent(0)", dst.extent(0), slots.extent(0));
  check_equal(where, "dst.extent(1)", dst.extent(1), pool.extent(1));
  check_equal(where, "valid.extent(0)", valid.extent(0), slots.extent(0));
  check_rows_contiguous(where, "dst", dst);
  check_rows_contiguous(where, "pool", pool);
  for (index_t i = 0; i < slots.extent(0); ++i)
    check_slot(
        where, [&] { return idx_name("slots", i); }, slots(i), pool.extent(0));
  if (pool.extent(1) == 0) {
    for (index_t i = 0; i < slots.extent(0); ++i) valid(i) = slots(i) >= 0;
    return;
  }
  gather_rows_unchecked<E, I>(dst, valid, pool, slots);
}
}  // namespace detail

// Gather by physical slot: dst[i, :] = pool[slots[i], :], valid[i] = 1; slots[i] == -1 →
// dst[i, :] = 0 (all-zero bytes) and valid[i] = 0.
//   dst [N, W] E, valid [N] UINT8, pool [pool_rows, W] E, slots [N] INT32 (window lists) or
//   INT64 (slot mappings).
// Throws if slots[i] < -1 or >= pool_rows (naming `slots[i]`), or on shape mismatch; nothing is
// written then.
template <class E>
void gather_rows(View<E, 2> dst, View<std::uint8_t, 1> valid,
                 ConstView<std::type_identity_t<E>, 2> pool, ConstView<std::int32_t, 1> slots) {
  detail::gather_rows_checked<E, std::int32_t>(dst, valid, pool, slots);
}
template <class E>
void gather_rows(View<E, 2> dst, View<std::uint8_t, 1> valid,
                 ConstView<std::type_identity_t<E>, 2> pool, ConstView<std::int64_t, 1> slots) {
  detail::gather_rows_checked<E, std::int64_t>(dst, valid, pool, slots);
}

// Window gather (spec §8.1 window rows): for every token t and column k,
// dst[t, k, :] = pool[window_indices[t, k], :] and valid[t, k] = 1; -1 → zero row, valid 0.
//   dst [T, K, W] E, valid [T, K] UINT8, pool [pool_rows, W] E (ori cache rows),
//   window_indices [T, K] INT32 (build_window_indices / StepMetadata, K = WIN = 128).
// Tokens are split over ctx's executor (a pure copy: identical for any thread count).
// Throws if an index is < -1 or >= pool_rows (naming `window_indices[t,k]`), or on shape
// mismatch; nothing is written then.
template <class E>
void gather_windows(View<E, 3> dst, View<std::uint8_t, 2> valid,
                    ConstView<std::type_identity_t<E>, 2> pool,
                    ConstView<std::int32_t, 2> window_indices, const cpu::Context& ctx = {}) {
  static_assert(std::is_trivially_copyable_v<E>, "cache rows are copied as bytes");
  constexpr std::string_view where = "gather_windows";
  const index_t T = window_indices.extent(0), K = window_indices.extent(1);
  check_equal(where, "dst.extent(0)", dst.extent(0), T);
  check_equal(where, "dst.extent(1)", dst.extent(1), K);
  check_equal(where, "dst.extent(2)", dst.extent(2), pool.extent(1));
  check_equal(where, "valid.extent(0)", valid.extent(0), T);
  check_equal(where, "valid.extent(1)", valid.extent(1), K);
  detail::check_rows_contiguous(where, "dst", dst);
  detail::check_rows_contiguous(where, "pool", pool);
  for (index_t t = 0; t < T; ++t)
    for (index_t k = 0; k < K; ++k)
      detail::check_slot(
          where, [&] { return detail::idx_name("window_indices", t, k); }, window_indices(t, k),
          pool.extent(0));
  if (pool.extent(1) == 0) {
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < K; ++k) valid(t, k) = window_indices(t, k) >= 0;
    return;
  }
  // 4 tokens per task: ~0.5 MiB of BF16 rows, enough to amortise dispatch.
  ctx.parallel_for(0, T, 4, [&](index_t t) {
    detail::gather_rows_unchecked<E, std::int32_t>(dst.row(t), valid.row(t), pool,
                                                   window_indices.row(t));
  });
}

// Gather by logical row through one request's block-table row (spec §8.1 compressed rows:
// row = table[raw / page] * page + raw % page):
// dst[i, :] = pool[table_row[rows[i] / page] * page + rows[i] % page, :], valid[i] = 1.
// rows[i] == -1, an unmapped page (entry -1) or a page past the table width → zero row, valid 0.
//   dst [N, W] E, valid [N] UINT8, pool [blocks * page, W] E, table_row [cols] INT32
//   (e.g. cmp_block_table.row(b)), rows [N] INT32, page = rows per block (128).
// Throws if rows[i] < -1, if a table entry read is < -1 or >= blocks (naming `table_row[c]`),
// if pool rows are not a multiple of page, or on shape mismatch; nothing is written then.
template <class E>
void gather_logical_rows(View<E, 2> dst, View<std::uint8_t, 1> valid,
                         ConstView<std::type_identity_t<E>, 2> pool,
                         ConstView<std::int32_t, 1> table_row, ConstView<std::int32_t, 1> rows,
                         index_t page) {
  static_assert(std::is_trivially_copyable_v<E>, "cache rows are copied as bytes");
  constexpr std::string_view where = "gather_logical_rows";
  check_range<index_t>(where, "page", page, 1, index_t(1) << 30);
  const index_t n = rows.extent(0), cols = table_row.extent(0), width = pool.extent(1);
  check_equal(where, "dst.extent(0)", dst.extent(0), n);
  check_equal(where, "dst.extent(1)", dst.extent(1), width);
  check_equal(where, "valid.extent(0)", valid.extent(0), n);
  check_equal(where, "pool.extent(0) % page", pool.extent(0) % page, index_t(0));
  detail::check_rows_contiguous(where, "dst", dst);
  detail::check_rows_contiguous(where, "pool", pool);
  const index_t blocks = pool.extent(0) / page;
  for (index_t i = 0; i < n; ++i) {
    const index_t r = rows(i);
    if (r < -1) throw_arg(where, detail::idx_name("rows", i), r, ">= -1 (-1 = invalid)");
    if (r < 0 || r / page >= cols) continue;
    const index_t blk = table_row(r / page);
    if (blk < -1 || blk >= blocks) {
      throw_arg(where, detail::idx_name("table_row", r / page), blk,
                "[-1, " + std::to_string(blocks) + ") (-1 = unmapped; pool blocks)");
    }
  }
  for (index_t i = 0; i < n; ++i) {
    const index_t r = rows(i);
    const index_t blk = (r < 0 || r / page >= cols) ? -1 : index_t(table_row(r / page));
    if (blk < 0) {
      if (width) detail::zero_row(&dst(i, 0), width);
      valid(i) = 0;
    } else {
      if (width) detail::copy_row(&dst(i, 0), &pool(blk * page + r % page, 0), width);
      valid(i) = 1;
    }
  }
}

}  // namespace tiledecode::paged
