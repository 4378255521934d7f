#pragma once
// The spec's compressor rules (spec §6), written once for every backend. Golden keeps its own copy
// (golden/compressor.hpp).
//
// A token at position p closes a window of ratio R iff (p + 1) % R == 0; it emits compressed row
// c = p / R. Pooling of row c reads one FP32 state row [kv | score] per candidate position through
// the state table by ABSOLUTE position (an unmapped page reads kv 0 and score "-inf"):
//   ratio 4 overlapping (COFF 2): the previous window 4c-4 .. 4c-1 gives its FRONT halves
//     (kv[d], score[d]), the current window 4c .. 4c+3 its BACK halves (kv[hd + d], score[hd + d]);
//     c = 0 has no previous window (those 4 candidates are absent);
//   ratio 128: positions 128c .. 128c + 127, (kv[d], score[d]).
// The emitted row is rotated at the window start c * R (main compressors; the indexer's inner
// compressor may instead use start_b, spec §5 [AMBIGUOUS] §11.2).

#include <cstdint>

#include "tiledecode/core/view.hpp"

namespace tiledecode::rules {

// (p + 1) % R == 0: the token at p closes compressed row p / R.
constexpr bool closes_window(index_t pos, int ratio) {
  return (pos + 1) % ratio == 0;
}

// One pooling candidate of a compressed row: the absolute position whose state row it reads and
// which half of that row (0: front [kv 0 .. hd, score OUT .. OUT + hd), 1: back [hd .. 2hd, ...)).
struct PoolCandidate {
  index_t pos;
  int half;
};

// The candidates of compressed row c in pooling order; returns their count (at most 2 * ratio).
inline int compressor_candidates(int ratio, bool overlap, index_t c, PoolCandidate* out) {
  int n = 0;
  if (overlap) {
    if (c > 0)
      for (index_t p = (c - 1) * ratio; p < c * ratio; ++p) out[n++] = {p, 0};
    for (index_t p = c * ratio; p < (c + 1) * ratio; ++p) out[n++] = {p, 1};
  } else {
    for (index_t p = c * ratio; p < (c + 1) * ratio; ++p) out[n++] = {p, 0};
  }
  return n;
}

// The first absolute position whose state row the pooling of row c reads.
constexpr index_t compressor_first_position(int ratio, bool overlap, index_t c) {
  return (overlap && c > 0) ? (c - 1) * ratio : c * ratio;
}

// RoPE position of compressed row c: its window start c * R, or start_b (request_start).
constexpr index_t compressed_row_rope_position(bool request_start, index_t c, int ratio,
                                               index_t start_b) {
  return request_start ? start_b : c * ratio;
}

}  // namespace tiledecode::rules
