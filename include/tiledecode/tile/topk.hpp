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
//   key      scores map to order-preserving u32 keys (a > b <=> key(a) > key(b); -0 -> +0),
//            branch-free integer ops; NaN -> 0, a value no number maps to (-inf's key is
//            0x00800000), so the lowest level-0 bucket holds exactly the row's NaNs.
//   digits   11 + 11 + 10 bits (levels 0, 1, 2: key bits 31..21, 20..10, 9..0), 2048 counters.
//   select   level 0 histograms the whole row (keys of 512 scores at a time into a stack chunk,
//            four counter sets so equal keys do not serialise on one counter); walking the
//            buckets from the top finds the one holding the n-th largest key: keys above it
//            win, keys in it are candidates. While that bucket holds more than kTopkCandidates
//            keys, one more histogram pass over the row (counting only the bucket's keys, four
//            counter sets again) splits it by the next digit; a bucket found to hold one key
//            value stops the splitting. Then one collect pass in column order writes the
//            winners' columns to dst and copies the bucket's (key, column) pairs to a stack
//            buffer, where the remaining digits are resolved in memory (histogram + stable
//            compaction per level). A bucket of one key value needs no buffer: its first
//            `need` columns win (the tie rule). The collect pass stops once every winner and
//            candidate is found. The filter passes test 16 keys at once (vectorised compares)
//            and look at single keys only in groups holding a key >= the bucket's low end.
//            Passes over the row: 2 for score-like rows (histogram, collect), 3 when the
//            threshold is a big tie (all-equal rows, a few distinct values), at most 4. Rows
//            of <= kTopkShortRow columns skip the row histogram: one pass loads them into the
//            buffer and every digit is resolved there.
//   sort     the n winners by (key desc, column asc): a stable LSD radix sort (8-bit digits,
//            uniform digits skipped) of the winners collected in column order, ties keep
//            ascending column. n > kTopkSortMax (only when k > 2048): an in-place comparison
//            sort of the n winners in dst (same order) instead; still no allocation.
// Bounds: no allocation; ~51 KB of stack per call (2048 u32 counters, 4096 candidate pairs that
// double as the histogram passes' extra counter sets and the sort's scratch, 2048 winner keys, a
// 512-key chunk). k has no bound of its own (dst holds the winners' columns; k > 2048 takes the
// comparison sort); column ids are int32 and counts u32, so a row holds at most INT32_MAX
// columns (kTopkMaxColumns): the callers' `offset + N <= INT32_MAX` check (kernels::topk_rows,
// kernels::indexer_topk) rejects wider rows at validation.
// Portable C++ (no intrinsics): the key and filter loops vectorise with baseline SSE2 / NEON; the
// first pass is bound by its counter scatter, so there is no AVX2 variant (none was measured).

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::tile {

namespace detail {
// Order-preserving key of a non-NaN float: a > b  <=>  key(a) > key(b); -0 and +0 share a key:
// 2^31 + |x|'s bits for x >= 0, 2^31 - |x|'s bits for x < 0 (-inf -> 0x00800000, +inf ->
// 0xff800000). Integer-only and branch-free, so the chunk loops below vectorise (SSE2 / NEON).
inline std::uint32_t topk_key_bits(std::uint32_t u) {
  const std::uint32_t mag = u & 0x7fffffffu;
  const auto neg = std::uint32_t(std::int32_t(u) >> 31);  // all ones for a negative sign
  return 0x80000000u + ((mag ^ neg) - neg);
}
inline std::uint32_t topk_key(float x) {
  return topk_key_bits(std::bit_cast<std::uint32_t>(x));
}

// Key of a score, 0 for NaN (no number maps to 0: the smallest key, -inf's, is 0x00800000).
inline std::uint32_t topk_key_or_nan_bits(std::uint32_t u) {
  const std::uint32_t key = topk_key_bits(u);
  return std::int32_t(u & 0x7fffffffu) > 0x7f800000 ? 0u : key;
}
inline std::uint32_t topk_key_or_nan(float x) {
  return topk_key_or_nan_bits(std::bit_cast<std::uint32_t>(x));
}

// The row is read in chunks: keys of kTopkChunk scores at a time into a stack buffer (one
// vectorisable loop), then the chunk's keys are counted or filtered. Filters test groups of
// kTopkGroup keys at once (an OR of compares, vectorised) and visit a group key by key only when
// one of its keys can matter (>= the threshold bucket's low end): rare on real rows.
inline constexpr std::int64_t kTopkChunk = 512;
inline constexpr std::int64_t kTopkGroup = 16;
inline void topk_chunk_keys(std::uint32_t* out, const float* s, std::int64_t m) {
  std::memcpy(out, s, sizeof(float) * std::size_t(m));
  for (std::int64_t i = 0; i < m; ++i) out[i] = topk_key_or_nan_bits(out[i]);
}
// Whether any of kb[0, kTopkGroup) is >= lo.
inline bool topk_group_any_ge(const std::uint32_t* kb, std::uint32_t lo) {
  std::uint32_t any = 0;
  for (std::int64_t i = 0; i < kTopkGroup; ++i) any |= std::uint32_t(kb[i] >= lo);
  return any != 0;
}
// The positions i in [0, m) with kb[i] in [lo, lo + span], in order, without a branch per key
// (a tie-heavy row would mispredict it); returns their count.
inline int topk_group_select(std::uint8_t* pos, const std::uint32_t* kb, std::int64_t m,
                             std::uint32_t lo, std::uint32_t span) {
  int c = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    pos[c] = std::uint8_t(i);
    c += int(kb[i] - lo <= span);
  }
  return c;
}

inline constexpr std::int64_t kTopkBins = 2048;        // counters of one histogram (11 bits)
inline constexpr std::int64_t kTopkCandidates = 4096;  // (key, column) pairs on the stack
inline constexpr std::int64_t kTopkShortRow = 1024;    // rows resolved in memory (<= candidates)
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

  // Stack: 8 KB counters, 32 KB candidate pairs (also the histogram passes' three extra counter
  // sets and the winners' sort scratch), 8 KB winner keys, 2 KB chunk keys.
  std::uint32_t hist[kTopkBins];
  std::uint32_t work[2 * kTopkCandidates];
  std::uint32_t* const ck = work;
  auto* const cc = reinterpret_cast<std::int32_t*>(work + kTopkCandidates);  // same-size int
  std::uint32_t wk[kTopkSortMax];
  alignas(64) std::uint32_t kb[kTopkChunk];
  TopkWinners w{dst.data(), nullptr};
  std::int64_t n = 0;

  if (n_cols <= kTopkShortRow) {
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
    // Level 0 over the whole row, four counter sets (equal keys in a row do not serialise on
    // one counter); bucket 0 holds exactly the NaNs.
    {
      std::uint32_t* const h1 = work;
      std::uint32_t* const h2 = work + kTopkBins;
      std::uint32_t* const h3 = work + 2 * kTopkBins;
      std::fill(hist, hist + kTopkBins, 0u);
      std::fill(work, work + 3 * kTopkBins, 0u);
      for (std::int64_t j0 = 0; j0 < n_cols; j0 += kTopkChunk) {
        const std::int64_t m = std::min(kTopkChunk, n_cols - j0);
        topk_chunk_keys(kb, s + j0, m);
        std::int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
          ++hist[kb[i] >> kTopkShift[0]];
          ++h1[kb[i + 1] >> kTopkShift[0]];
          ++h2[kb[i + 2] >> kTopkShift[0]];
          ++h3[kb[i + 3] >> kTopkShift[0]];
        }
        for (; i < m; ++i) ++hist[kb[i] >> kTopkShift[0]];
      }
      for (std::int64_t d = 0; d < kTopkBins; ++d) hist[d] += h1[d] + h2[d] + h3[d];
    }
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
      std::uint32_t* const hs[4] = {hist, work, work + kTopkBins, work + 2 * kTopkBins};
      for (std::uint32_t* h : hs) std::fill(h, h + mask + 1, 0u);
      std::uint32_t kmin = ~0u, kmax = 0u;  // the bucket's key range
      for (std::int64_t j0 = 0; j0 < n_cols; j0 += kTopkChunk) {
        const std::int64_t m = std::min(kTopkChunk, n_cols - j0);
        topk_chunk_keys(kb, s + j0, m);
        for (std::int64_t g = 0; g < m; g += kTopkGroup) {
          const std::int64_t gm = std::min(kTopkGroup, m - g);
          if (gm == kTopkGroup && !topk_group_any_ge(kb + g, lo)) continue;
          std::uint8_t pos[kTopkGroup];
          const int np = topk_group_select(pos, kb + g, gm, lo, hi - lo);
          for (int p = 0; p < np; ++p) {
            const std::uint32_t key = kb[g + pos[p]];
            ++hs[p & 3][(key >> sh) & mask];
            kmin = std::min(kmin, key);
            kmax = std::max(kmax, key);
          }
        }
      }
      for (std::uint32_t dg = 0; dg <= mask; ++dg) hist[dg] += hs[1][dg] + hs[2][dg] + hs[3][dg];
      if (kmin == kmax) {  // one key value: the rest of its digits are known
        lo = hi = kmin;
        level = kTopkLevels;
        break;
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
    // Keys below lo never matter (whole bucket: lo = hi + 1). The pass stops once every winner
    // and candidate is found (a big tie at the top of the row: after its first `need` columns).
    const bool single = lo == hi;
    const std::int64_t want_w = single ? n : n - need, want_c = single || need == 0 ? 0 : bucket;
    std::int64_t c = 0;
    for (std::int64_t j0 = 0; j0 < n_cols && (w.m < want_w || c < want_c); j0 += kTopkChunk) {
      const std::int64_t m = std::min(kTopkChunk, n_cols - j0);
      topk_chunk_keys(kb, s + j0, m);
      for (std::int64_t g = 0; g < m; g += kTopkGroup) {
        const std::int64_t gm = std::min(kTopkGroup, m - g);
        if (gm == kTopkGroup && !topk_group_any_ge(kb + g, lo)) continue;
        std::uint8_t pos[kTopkGroup];
        const int np = topk_group_select(pos, kb + g, gm, lo, ~lo);  // the keys >= lo
        for (int p = 0; p < np; ++p) {
          const std::uint32_t key = kb[g + pos[p]];
          const auto col = std::int32_t(j0 + g + pos[p]);
          if (key > hi) {
            w.push(key, col);
          } else if (single) {
            if (need-- > 0) w.push(key, col);
          } else {
            ck[c] = key;
            cc[c] = col;
            ++c;
          }
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
      const std::uint32_t key_a = topk_key(s[a]), key_b = topk_key(s[b]);
      return key_a != key_b ? key_a > key_b : a < b;
    });
  }
  for (std::int64_t i = 0; i < n; ++i) dst[std::size_t(i)] += offset;
}

}  // namespace tiledecode::tile
