#pragma once
// The vocabulary's top-k select (spec §7.3, lessons: fill every slot, never pick NaN): the op's
// meaning and its one implementation (plain C++, every CPU tier; the a2a3 model runs the chip's
// Sort32 / MrgSort instead, backend/a2a3/indexer.hpp, and must give the same indices).
//
// Order: descending score; equal scores (+0 and -0 are equal) by ascending column. NaN scores
// are never selected (a NaN ranks after every number, -inf and kNegBig included; those are
// ordinary numbers: kNegBig above -inf). A row with `valid` columns considered yields
//   n = min(k, number of non-NaN scores in [0, valid))
// indices in dst[0, n) (each + offset) and -1 in every other slot of the dst row, so a consumer
// never reads an unwritten slot.
//
// Algorithm: a radix threshold select, linear in the row, then a sort of the n winners only
// (never of the row). At CSA's 1M context a row has 262,144 candidates and k = 512 / 1024.
//   key      scores map to order-preserving u32 keys (a > b <=> key(a) > key(b); -0 -> +0);
//            NaN -> 0, a value no number maps to (-inf is 0x007fffff), so NaN sits alone in the
//            lowest digit bucket and the histogram's bucket 0 counts the row's NaNs.
//   digits   11 + 11 + 10 bits (levels 0, 1, 2: bits 31..21, 20..10, 9..0), 2048 counters.
//   select   level 0 histograms the whole row; walking the buckets from the top finds the one
//            holding the n-th largest key: keys above it win, keys in it are candidates.
//            While that bucket holds more than kTopkCandidates keys, one more histogram pass
//            over the row (counting only the bucket's keys) splits it by the next digit. Then
//            one collect pass in column order writes the winners' columns to dst and copies the
//            bucket's (key, column) pairs to a stack buffer, where the remaining digits are
//            resolved in memory (histogram + stable compaction per level). A bucket that is a
//            single key value needs no buffer: its first `need` columns win (the tie rule).
//            Typical rows: 2 passes over the row (histogram, collect); at most 4 (all-equal or
//            adversarial rows: 3 histograms, collect). Rows of <= kTopkCandidates columns skip
//            the row histogram: one pass loads them into the buffer.
//   sort     the n winners by (key desc, column asc): a stable LSD radix sort (8-bit digits,
//            uniform digits skipped) of the winners collected in column order, ties keep
//            ascending column. n > kTopkSortMax (only when k > 2048): an in-place comparison
//            sort of the n winners in dst (same order) instead; still no allocation.
// Bounds: no allocation; ~48 KB of stack per call (2048 u32 counters, 4096 candidate pairs,
// 2048 winner keys; the candidate buffer doubles as the sort's scratch). k has no bound of its
// own (dst holds the winners' columns); column ids and counts are int32 / u32, so a row holds
// at most INT32_MAX columns (kTopkMaxColumns, the callers' `offset + N <= INT32_MAX` check).
// The scalar code is portable C++ (no intrinsics); the hot loops are branch-light compares.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::tile {

namespace detail {
// Order-preserving key of a non-NaN float: a > b  <=>  key(a) > key(b); -0 and +0 share a key.
inline std::uint32_t topk_key(float x) {
  const std::uint32_t u = x == 0.0f ? 0u : std::bit_cast<std::uint32_t>(x);
  return u ^ (std::uint32_t(std::int32_t(u) >> 31) | 0x80000000u);
}

// Key of a score, 0 for NaN (no float maps to 0: it would be the NaN pattern 0xffffffff).
inline std::uint32_t topk_key_or_nan(float x) {
  const std::uint32_t key = topk_key(x);
  return x == x ? key : 0u;
}

inline constexpr std::int64_t kTopkBins = 2048;        // counters of one histogram (11 bits)
inline constexpr std::int64_t kTopkCandidates = 4096;  // (key, column) pairs on the stack
inline constexpr std::int64_t kTopkSortMax = 2048;     // winners radix-sorted on the stack
inline constexpr std::int64_t kTopkMaxColumns = std::numeric_limits<std::int32_t>::max();
inline constexpr int kTopkLevels = 3;
inline constexpr int kTopkShift[kTopkLevels] = {21, 10, 0};
inline constexpr std::uint32_t kTopkMask[kTopkLevels] = {0x7ffu, 0x7ffu, 0x3ffu};

// The bucket holding the need-th largest counted key: walks hist[mask..0] from the top, taking
// whole buckets while they fit; on return `need` is what the returned bucket still owes
// (1 <= need <= hist[d]).
inline std::uint32_t topk_pick_digit(const std::uint32_t* hist, std::uint32_t mask,
                                     std::int64_t& need) {
  std::uint32_t d = mask;
  for (; d > 0; --d) {
    if (std::int64_t(hist[d]) >= need) break;
    need -= hist[d];
  }
  return d;
}

// Winners' sink: columns to dst, keys to wk while the winners are radix-sorted (keyed).
struct TopkWinners {
  std::int32_t* cols;
  std::uint32_t* keys;  // nullptr: n > kTopkSortMax, keys recomputed by the comparison sort
  std::int64_t m = 0;
  void push(std::uint32_t key, std::int32_t col) {
    cols[m] = col;
    if (keys) keys[m] = key;
    ++m;
  }
};

// Resolves the candidates (ck, cc)[0, c) - one bucket of keys, in column order, sharing the
// digits above `level` - down to the `need` best: appends them to w in an order in which equal
// keys keep ascending column. Stable in-place compaction per level; no allocation.
inline void topk_resolve_candidates(std::uint32_t* ck, std::int32_t* cc, std::int64_t c,
                                    std::int64_t need, int level, std::uint32_t* hist,
                                    TopkWinners& w) {
  for (;; ++level) {
    if (need <= 0) return;
    if (need >= c || level == kTopkLevels) {  // the whole bucket, or equal keys: column order
      const std::int64_t take = std::min(need, c);
      for (std::int64_t i = 0; i < take; ++i) w.push(ck[i], cc[i]);
      return;
    }
    const int sh = kTopkShift[level];
    const std::uint32_t mask = kTopkMask[level];
    std::fill(hist, hist + mask + 1, 0u);
    for (std::int64_t i = 0; i < c; ++i) ++hist[(ck[i] >> sh) & mask];
    const std::uint32_t d = topk_pick_digit(hist, mask, need);
    std::int64_t kept = 0;
    for (std::int64_t i = 0; i < c; ++i) {
      const std::uint32_t dig = (ck[i] >> sh) & mask;
      if (dig > d) {
        w.push(ck[i], cc[i]);
      } else if (dig == d) {
        ck[kept] = ck[i];
        cc[kept] = cc[i];
        ++kept;
      }
    }
    c = kept;
  }
}

// Stable LSD radix sort of (keys, cols)[0, n) by descending key (8-bit digits, digits uniform
// over the winners skipped); tk / tc: scratch of n entries. Equal keys keep their order.
inline void topk_sort_winners(std::uint32_t* keys, std::int32_t* cols, std::int64_t n,
                              std::uint32_t* tk, std::int32_t* tc) {
  std::uint32_t* k_in = keys;
  std::int32_t* i_in = cols;
  std::uint32_t* k_out = tk;
  std::int32_t* i_out = tc;
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
  if (i_in != cols) std::copy(i_in, i_in + n, cols);
}
}  // namespace detail

// Top-k of one row. dst: the whole output row (any length; slots past the winners get -1);
// score: the row's columns [0, valid) (callers pass the valid prefix); k >= 0 winners at most;
// offset added to every emitted column id. Preconditions (checked by the callers' API):
// dst.size() >= k, offset + score.size() <= INT32_MAX (so score.size() <= kTopkMaxColumns).
inline void topk_row(std::span<std::int32_t> dst, std::span<const float> score, int k,
                     std::int32_t offset) {
  using namespace detail;
  const auto n_cols = static_cast<std::int64_t>(score.size());
  std::fill(dst.begin(), dst.end(), -1);
  if (k <= 0 || n_cols == 0) return;
  const float* s = score.data();

  std::uint32_t hist[kTopkBins];
  std::uint32_t ck[kTopkCandidates];  // candidates; the winners' sort scratch afterwards
  std::int32_t cc[kTopkCandidates];
  std::uint32_t wk[kTopkSortMax];
  TopkWinners w{dst.data(), nullptr};
  std::int64_t n = 0;

  if (n_cols <= kTopkCandidates) {
    // Short row: every non-NaN column is a candidate; resolve all digits in memory.
    std::int64_t c = 0;
    for (std::int64_t j = 0; j < n_cols; ++j) {
      const std::uint32_t key = topk_key_or_nan(s[j]);
      ck[c] = key;
      cc[c] = std::int32_t(j);
      c += key != 0;
    }
    n = std::min<std::int64_t>(k, c);
    if (n == 0) return;
    if (n <= kTopkSortMax) w.keys = wk;
    topk_resolve_candidates(ck, cc, c, n, 0, hist, w);
  } else {
    // Level 0 over the whole row; bucket 0 holds exactly the NaNs.
    std::fill(hist, hist + kTopkBins, 0u);
    for (std::int64_t j = 0; j < n_cols; ++j) ++hist[topk_key_or_nan(s[j]) >> kTopkShift[0]];
    n = std::min<std::int64_t>(k, n_cols - std::int64_t(hist[0]));
    if (n == 0) return;
    if (n <= kTopkSortMax) w.keys = wk;
    std::int64_t need = n;
    std::uint32_t d = topk_pick_digit(hist, kTopkMask[0], need);
    std::int64_t bucket = hist[d];
    // The threshold bucket: keys in [lo, hi]; keys above hi win.
    std::uint32_t lo = d << kTopkShift[0];
    std::uint32_t hi = lo | ((1u << kTopkShift[0]) - 1u);
    int level = 1;  // the next digit to resolve
    // Split an oversized bucket by further histogram passes over the row (its keys only).
    while (bucket > kTopkCandidates && need < bucket && level < kTopkLevels) {
      const int sh = kTopkShift[level];
      const std::uint32_t mask = kTopkMask[level];
      std::fill(hist, hist + mask + 1, 0u);
      for (std::int64_t j = 0; j < n_cols; ++j) {
        const std::uint32_t key = topk_key_or_nan(s[j]);
        if (key - lo <= hi - lo) ++hist[(key >> sh) & mask];
      }
      d = topk_pick_digit(hist, mask, need);
      bucket = hist[d];
      lo |= d << sh;
      hi = lo | ((1u << sh) - 1u);
      ++level;
    }
    if (need == bucket) {
      // The whole bucket wins: no candidates.
      hi = lo - 1u;  // lo > 0: NaN (key 0) never wins
      need = 0;
    }
    // Collect in column order. A single-value bucket (lo == hi) needs no buffer: its first
    // `need` columns win; otherwise the bucket (<= kTopkCandidates keys) goes to the buffer.
    std::int64_t c = 0;
    if (lo == hi) {
      for (std::int64_t j = 0; j < n_cols; ++j) {
        const std::uint32_t key = topk_key_or_nan(s[j]);
        if (key > hi || (key == hi && need-- > 0)) w.push(key, std::int32_t(j));
      }
    } else {
      for (std::int64_t j = 0; j < n_cols; ++j) {
        const std::uint32_t key = topk_key_or_nan(s[j]);
        if (key > hi) {
          w.push(key, std::int32_t(j));
        } else if (key >= lo) {
          ck[c] = key;
          cc[c] = std::int32_t(j);
          ++c;
        }
      }
    }
    topk_resolve_candidates(ck, cc, c, need, level, hist, w);
  }

  // Sort the n winners by (key desc, column asc).
  if (w.keys) {
    topk_sort_winners(wk, dst.data(), n, ck, cc);
  } else {
    std::sort(dst.begin(), dst.begin() + n, [&](std::int32_t a, std::int32_t b) {
      const std::uint32_t ka = topk_key(s[a]), kb = topk_key(s[b]);
      return ka != kb ? ka > kb : a < b;
    });
  }
  for (std::int64_t i = 0; i < n; ++i) dst[std::size_t(i)] += offset;
}

}  // namespace tiledecode::tile
