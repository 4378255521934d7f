#pragma once
// Deterministic row top-k by selection (spec §7.3, lessons: fill every slot, never pick NaN).
//
// Order: descending score; equal scores (+0 and -0 are equal) by ascending column. NaN scores
// are never selected. A row with `valid` columns considered yields
//   n = min(k, number of non-NaN scores in [0, valid))
// indices in dst[0, n) (each + offset) and -1 in every other slot of the dst row, so a consumer
// never reads an unwritten slot.
//
// Algorithm, O(valid) per row, no allocation: scores map to order-preserving 32-bit keys; a
// most-significant-digit radix select (8-bit digits, at most 4 histogram passes over the row,
// stopping as soon as the threshold digit holds exactly the remaining count) finds the n-th
// largest key; one scan in column order collects every key above it plus the first columns
// equal to it (ascending column = the tie rule); only the n winners are then sorted, by a
// stable LSD radix sort on the key (ties keep their ascending column order).

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::kernels {

namespace detail {
// Order-preserving key of a non-NaN float: a > b  <=>  key(a) > key(b); -0 and +0 share a key.
inline std::uint32_t topk_key(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
}  // namespace detail

namespace detail {
// Rows up to this many columns (and k up to it) take the tiled path: keys computed once into a
// stack tile, radix select on the tile, LSD radix sort of the winners (48 KB of stack). Longer
// rows use the tile-free path (keys recomputed per pass, comparison sort of the winners).
inline constexpr std::int64_t kTopkTile = 4096;

// MSD radix select over keys (0 = NaN, skipped): after return, keys whose top (32 - shift) bits
// exceed `prefix` are winners and the first `need` keys equal to it complete the n winners.
// shift == 32: every non-NaN key wins.
template <class KeyAt>
void topk_threshold(std::int64_t n_cols, std::int64_t n, std::int64_t n_valid, KeyAt&& key_at,
                    std::uint32_t& prefix, int& shift, std::int64_t& need) {
  prefix = 0;
  shift = 32;
  need = n;
  if (n >= n_valid) return;
  std::uint32_t hist[256];
  for (shift = 24; shift >= 0; shift -= 8) {
    std::fill(std::begin(hist), std::end(hist), 0u);
    for (std::int64_t j = 0; j < n_cols; ++j) {
      const std::uint32_t key = key_at(j);
      if (key == 0) continue;
      // Only keys matching the prefix found at the coarser digits are still candidates.
      if (shift + 8 < 32 && (key >> (shift + 8)) != prefix) continue;
      ++hist[(key >> shift) & 0xffu];
    }
    int digit = 255;
    for (; digit > 0; --digit) {
      if (hist[digit] >= need) break;
      need -= hist[digit];
    }
    prefix = (prefix << 8) | std::uint32_t(digit);
    if (hist[digit] == need) return;  // the whole bucket is taken: no finer digit needed
  }
  shift = 0;
}

// Key of a score, 0 for NaN (no float maps to 0: it would be the NaN pattern 0xffffffff).
inline std::uint32_t topk_key_or_nan(float x) {
  return x == x ? topk_key(x) : 0u;
}
}  // namespace detail

// Top-k of one row. dst: the whole output row (any length; slots past the winners get -1);
// score: the row's columns [0, valid) (callers pass the valid prefix); k >= 0 winners at most;
// offset added to every emitted column id. Preconditions (checked by the callers' API):
// dst.size() >= k, offset + score.size() fits int32.
inline void topk_row(std::span<std::int32_t> dst, std::span<const float> score, int k,
                     std::int32_t offset) {
  const auto n_cols = static_cast<std::int64_t>(score.size());
  std::fill(dst.begin(), dst.end(), -1);
  if (k <= 0 || n_cols == 0) return;
  std::uint32_t prefix = 0;
  int shift = 32;
  std::int64_t need = 0;

  if (n_cols <= detail::kTopkTile && k <= detail::kTopkTile) {
    std::uint32_t keys[detail::kTopkTile];  // (n_cols) key per column, 0 = NaN
    std::int64_t n_valid = 0;
    for (std::int64_t j = 0; j < n_cols; ++j) {
      keys[j] = detail::topk_key_or_nan(score[j]);
      n_valid += keys[j] != 0;
    }
    const std::int64_t n = std::min<std::int64_t>(k, n_valid);
    if (n == 0) return;
    detail::topk_threshold(
        n_cols, n, n_valid, [&](std::int64_t j) { return keys[j]; }, prefix, shift, need);
    // Winners in column order: (wk, dst) = (key, column).
    std::uint32_t wk[detail::kTopkTile];
    std::int64_t m = 0;
    for (std::int64_t j = 0; j < n_cols && m < n; ++j) {
      const std::uint32_t key = keys[j];
      if (key == 0) continue;
      const std::uint32_t top = shift == 32 ? 0u : key >> shift;
      if (shift == 32 || top > prefix || (top == prefix && need-- > 0)) {
        wk[m] = key;
        dst[std::size_t(m)] = std::int32_t(j);
        ++m;
      }
    }
    // Stable LSD radix sort by descending key (4 byte passes, skipping uniform digits): the
    // column order of equal keys is kept, i.e. ties stay in ascending column.
    std::uint32_t* k_in = wk;
    std::int32_t* i_in = dst.data();
    std::uint32_t* k_out = keys;  // the key tile is free now
    std::int32_t i_tmp[detail::kTopkTile];
    std::int32_t* i_out = i_tmp;
    for (int sh = 0; sh < 32; sh += 8) {
      std::uint32_t cnt[256] = {};
      for (std::int64_t i = 0; i < n; ++i) ++cnt[(k_in[i] >> sh) & 0xffu];
      if (cnt[(k_in[0] >> sh) & 0xffu] == std::uint32_t(n)) continue;
      std::uint32_t pos[256];
      std::uint32_t acc = 0;
      for (int d = 255; d >= 0; --d) {
        pos[d] = acc;
        acc += cnt[d];
      }
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint32_t p = pos[(k_in[i] >> sh) & 0xffu]++;
        k_out[p] = k_in[i];
        i_out[p] = i_in[i];
      }
      std::swap(k_in, k_out);
      std::swap(i_in, i_out);
    }
    if (i_in != dst.data()) std::copy(i_in, i_in + n, dst.begin());
    for (std::int64_t i = 0; i < n; ++i) dst[std::size_t(i)] += offset;
    return;
  }

  // Tile-free path for rows longer than kTopkTile.
  std::int64_t n_valid = 0;
  for (float s : score) n_valid += (s == s);
  const std::int64_t n = std::min<std::int64_t>(k, n_valid);
  if (n == 0) return;
  const auto key_at = [&](std::int64_t j) { return detail::topk_key_or_nan(score[j]); };
  detail::topk_threshold(n_cols, n, n_valid, key_at, prefix, shift, need);
  std::int64_t m = 0;
  for (std::int64_t j = 0; j < n_cols && m < n; ++j) {
    const std::uint32_t key = key_at(j);
    if (key == 0) continue;
    const std::uint32_t top = shift == 32 ? 0u : key >> shift;
    if (shift == 32 || top > prefix || (top == prefix && need-- > 0))
      dst[std::size_t(m++)] = std::int32_t(j);
  }
  std::sort(dst.begin(), dst.begin() + n, [&](std::int32_t a, std::int32_t b) {
    const std::uint32_t ka = detail::topk_key(score[a]), kb = detail::topk_key(score[b]);
    return ka != kb ? ka > kb : a < b;
  });
  for (std::int64_t i = 0; i < n; ++i) dst[std::size_t(i)] += offset;
}

// Row-wise top-k of a score matrix.
//   dst       (rows, W) INT32, W >= k: winners then -1 padding (all W slots written)
//   score     (rows, N) FP32
//   valid_len (rows) INT32 in [0, N]: row r considers columns [0, valid_len[r]) only
//   k         in [1, N]; offset >= 0 with offset + N <= INT32_MAX
// Parallel over rows; each row is independent, so results do not depend on the thread count.
inline void topk_rows(const cpu::Context& ctx, View<std::int32_t, 2> dst, ConstView<float, 2> score,
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
    check_range<index_t>(where, "valid_len[" + std::to_string(r) + "]", valid_len(r), 0, n + 1);
  }
  ctx.parallel_for(0, rows, 1, [&](std::int64_t r) {
    topk_row(std::span<std::int32_t>(&dst(r, 0), std::size_t(dst.extent(1))),
             std::span<const float>(&score(r, 0), std::size_t(valid_len(r))), k, offset);
  });
}

}  // namespace tiledecode::kernels
