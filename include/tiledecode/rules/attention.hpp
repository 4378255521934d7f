#pragma once
// The spec's sparse-attention column rules (spec §8.1), written once for every backend. Golden
// keeps its own copy (golden/sparse_attention.hpp) so that it stays an independent oracle.
//
// The key/value set of token t (request b = t / S, position p) is a list of cfg.attn_cols(kind)
// columns in blocks of 128 (ATTN_K_TILE):
//   block 0, the window     column k < 128: row window_idx[t, k] of the ori pool, valid iff
//                           k < window_lens[t] and window_idx[t, k] >= 0 (every family; metadata
//                           built by paged/metadata.hpp already has -1 past the lens)
//   blocks 1.., compressed  column 128 + i, row c of request b through cmp_block_table (page rows
//                           per column), valid iff the page is mapped and
//                             CSA: c = topk[t, i] (i < idx_topk) with 0 <= c < (p + 1) / 4
//                             HCA: c = i < n_t = min(cap, (p + 1) / 128, kv_seq_lens[b] / 128)
//                             SWA: no compressed columns
// An invalid column contributes exactly nothing to the softmax (its e is 0), so a backend may
// skip it (the CPU compacts the valid rows) or gather a zero row and mask it with MASK_NEG (the
// a2a3 schedule); both are the same math.

#include <algorithm>
#include <cstdint>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rules/paging.hpp"

namespace tiledecode::rules {

// CSA: compressed row `raw` is visible to the token at position `pos` (spec §8.1 mask).
constexpr bool csa_row_visible(index_t raw, index_t pos) {
  return raw >= 0 && raw < (pos + 1) / 4;
}

// HCA: the number n_t of compressed rows 0 .. n_t - 1 the token at `pos` attends (spec §8.1,
// quirk 6): min(cap, (pos + 1) / 128, kv_len / 128); cap = cfg.hca_capacity().
constexpr index_t hca_visible_rows(index_t cap, index_t pos, index_t kv_len) {
  return std::min({cap, (pos + 1) / 128, kv_len / 128});
}

// The column sources of one sparse-attention call.
struct AttentionColumns {
  LayerKind kind = LayerKind::swa;
  int window = 128;                       // cfg.window (= the block width, validated by the kernel)
  int page = 128;                         // rows per compressed-table column
  index_t hca_cap = 128;                  // cfg.hca_capacity()
  int n_topk = 512;                       // cfg.idx_topk: CSA columns read from topk
  int seq = 2;                            // S (request of token t = t / S)
  ConstView<std::int32_t, 2> window_idx;  // (T, 128)
  ConstView<std::int32_t, 1> window_lens;      // (T)
  ConstView<std::int32_t, 2> topk;             // (T, >= n_topk) CSA only
  ConstView<std::int32_t, 2> cmp_block_table;  // (B, cols) CSA / HCA
  ConstView<std::int32_t, 1> positions;        // (T)
  ConstView<std::int32_t, 1> kv_seq_lens;      // (B) HCA only

  static AttentionColumns of(const ModelConfig& cfg, LayerKind kind, int seq) {
    AttentionColumns c;
    c.kind = kind;
    c.window = cfg.window;
    c.page = cfg.page;
    c.hca_cap = cfg.hca_capacity();
    c.n_topk = cfg.idx_topk;
    c.seq = seq;
    return c;
  }
  int n_cols() const {
    return window + (kind == LayerKind::csa ? n_topk : kind == LayerKind::hca ? int(hca_cap) : 0);
  }
  int n_blocks() const { return (n_cols() + window - 1) / window; }
};

// Physical rows of the 128 columns of block `beta` of token t: rows[k] = the row of column
// 128 * beta + k in the block's pool (block 0: the ori pool, blocks >= 1: the compressed pool),
// -1 for an invalid column. Returns the number of valid columns.
inline int attention_block_columns(const AttentionColumns& a, index_t t, int beta,
                                   std::int64_t* rows) {
  const index_t W = a.window, b = t / a.seq, p = a.positions(t);
  int n = 0;
  if (beta == 0) {
    const index_t lens = a.window_lens(t);
    for (index_t k = 0; k < W; ++k) {
      const index_t idx = a.window_idx(t, k);
      rows[k] = (k < lens && idx >= 0) ? idx : -1;
      n += rows[k] >= 0;
    }
    return n;
  }
  const index_t c0 = index_t(beta - 1) * W;
  const index_t n_t =
      a.kind == LayerKind::hca ? hca_visible_rows(a.hca_cap, p, a.kv_seq_lens(b)) : 0;
  for (index_t k = 0; k < W; ++k) {
    const index_t i = c0 + k;
    std::int64_t r = -1;
    if (a.kind == LayerKind::csa && i < a.n_topk) {
      const index_t raw = a.topk(t, i);
      if (csa_row_visible(raw, p)) r = slot_of(a.cmp_block_table, b, raw, a.page);
    } else if (a.kind == LayerKind::hca && i < n_t) {
      r = slot_of(a.cmp_block_table, b, i, a.page);
    }
    rows[k] = r;
    n += r >= 0;
  }
  return n;
}

}  // namespace tiledecode::rules
