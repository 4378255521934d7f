#pragma once
// Row-wise top-k of a score matrix (spec §7.3) with the deterministic select of tile/topk.hpp
// (descending score, ascending column on ties, NaN never selected, -1 padding).

#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/tile/topk.hpp"

namespace tiledecode::kernels {

using tile::topk_row;

// Row-wise top-k of a score matrix.
//   dst       (rows, W) INT32, W >= k: winners then -1 padding (all W slots written)
//   score     (rows, N) FP32
//   valid_len (rows) INT32 in [0, N]: row r considers columns [0, valid_len[r]) only
//   k         in [1, N]; offset >= 0 with offset + N <= INT32_MAX
// Parallel over rows; each row is independent, so results do not depend on the thread count.
template <class Ctx>  // anything with parallel_for(begin, end, grain, fn), e.g. cpu::Context
void topk_rows(const Ctx& ctx, View<std::int32_t, 2> dst, ConstView<float, 2> score,
               ConstView<std::int32_t, 1> valid_len, int k, std::int32_t offset) {
  constexpr std::string_view where = "topk_rows";
  const index_t rows = score.extent(0), n = score.extent(1);
  check_equal(where, "dst.extent(0)", dst.extent(0), rows);
  check_equal(where, "valid_len.extent(0)", valid_len.extent(0), rows);
  check_range<index_t>(where, "k", k, 1, n + 1);
  check_at_least<index_t>(where, "dst.extent(1)", dst.extent(1), k);
  check_range<index_t>(where, "offset", offset, 0,
                       index_t(std::numeric_limits<std::int32_t>::max()) - n + 1);
  if (dst.stride(1) != 1) throw_arg(where, "dst.stride(1)", dst.stride(1), "1 (contiguous rows)");
  if (score.stride(1) != 1) {
    throw_arg(where, "score.stride(1)", score.stride(1), "1 (contiguous rows)");
  }
  for (index_t r = 0; r < rows; ++r) {
    if (valid_len(r) < 0 || valid_len(r) > n)
      check_range<index_t>(where, nth_name("valid_len", r), valid_len(r), 0, n + 1);
  }
  ctx.parallel_for(0, rows, 1, [&](std::int64_t r) {
    topk_row(std::span<std::int32_t>(&dst(r, 0), std::size_t(dst.extent(1))),
             std::span<const float>(&score(r, 0), std::size_t(valid_len(r))), k, offset);
  });
}

}  // namespace tiledecode::kernels
