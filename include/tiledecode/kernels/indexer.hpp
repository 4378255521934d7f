#pragma once
// Lightning indexer (spec §7) — contracts and tile programs of its four kernels:
//   indexer_query    qi = (qr @ idx_wq_b)_int32 · qr_scale · idx_wq_b_scale; RoPE of dims 64..127
//                    at rope_pos; bf16; qh = x @ hadamard; q_i8, q_sc = Q8(qh) per (token, head)
//   indexer_weights  w[t,h] = (x_n[t] @ weights_proj)[h] · index_weights_scale
//   indexer_score    score[t, j] = k_sc[j] · Σ_h w[t,h] · relu(q_sc[t,h] · (q_i8[t,h] · k_i8[j]))
//                    for j < vis_t (rules/indexer.hpp), NEG_BIG over the whole tail
//   indexer_topk     the min(k, vis_t) best columns (descending score, ascending column on ties,
//                    NaN never selected), + offset, -1 in every other slot (tile/topk.hpp)
//
// Decode-step composition (CSA layer, spec §9.2):
//   indexer_rope_positions(rope_pos, positions, S)             rope_pos[t] = start_b  [QUIRK]
//   indexer_query(be, cfg, q_i8, q_sc, qr, qr_scale, wq, rope_pos, rope_csa)
//   indexer_weights(be, cfg, w, x_n, weights_proj)
//   (inner compressor writes idx_kv_cache / idx_kv_scale)
//   indexer_score(be, cfg, score, q_i8, q_sc, w, idx_kv_cache, idx_kv_scale, idx_block_table,
//                 positions, kv_seq_lens, S)
//   indexer_topk(be, cfg, topk_idxs, score, positions, kv_seq_lens, S, cfg.idx_topk, 0)
//
// Choices for the spec's open points:
//  * [QUIRK §5/§11.1] The query RoPE position is an explicit per-token input `rope_pos[t]`; the
//    reference CSA composition rotates both S tokens at start_b (indexer_rope_positions builds
//    that list). Passing position_ids instead gives the "pos_t" variant.
//  * [§11.4] The score tail j >= vis_t is written with kNegBig over the whole row, never stale.
//  * An unmapped page (-1, or a column past the table width) inside a token's visible range is
//    an error: the row the score must read does not exist. -1 outside every visible range is fine.
//  * [§11.3] Top-k ties: descending score, ascending column; NaN is never selected; all slots of
//    the output row are written (-1 padding), also when NaN leaves fewer than min(k, vis) winners.
//  * The score epilogue's operation order (the op's meaning, both backends): coef[h] =
//    q_sc[t,h] · w[t,h] once per token; per key j: s = Σ_h coef[h] · relu(float(dot_jh)) (h
//    ascending on the CPU, a pairwise tree on the a2a3 vector unit), then s · k_sc[j]. (Equal to
//    the spec's formula because q_sc > 0 and k_sc > 0 commute with the ReLU.)
// Backends: backend/cpu/indexer.hpp (the fused INT8 score micro-kernels: all 64 head dots of a
// 16-key block reduced while in registers) and backend/a2a3/indexer.hpp (the launch sequence of
// spec §7.4, fused or two-scope score).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/rules/indexer.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::kernels {

// Fixed tile limits (stack tiles, no allocation on the hot path).
inline constexpr int kIndexerHeadDim = 128;    // idx_head_dim (the micro-kernels' row width)
inline constexpr int kIndexerMaxHeads = 64;    // idx_n_heads, a multiple of 16
inline constexpr int kIndexerMaxQLora = 4096;  // q_lora, even (INT32 bounds: avx2 < 2^17,
                                               // VNNI tiers <= 43804; indexer_avx2.hpp)

// Visible compressed rows of a token (rules/indexer.hpp).
inline int indexer_visible_rows(const ModelConfig& cfg, int pos, int kv_len) {
  return rules::indexer_visible_rows(cfg, pos, kv_len);
}

// rope_pos[t] = positions[(t / seq) * seq] = start_b: the indexer query rotation position of the
// reference CSA composition (spec §5 [QUIRK]). dst and positions are (T) INT32, T % seq == 0.
inline void indexer_rope_positions(View<std::int32_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                   int seq) {
  constexpr std::string_view where = "indexer_rope_positions";
  check_range(where, "seq", seq, 1, 1 << 20);
  check_view(where, "positions", positions);
  check_extents(where, "dst", dst, {positions.extent(0)});
  if (positions.extent(0) % seq != 0) {
    throw_arg(where, "positions.extent(0)", positions.extent(0), "a multiple of seq");
  }
  for (index_t t = 0; t < positions.extent(0); ++t)
    dst(t) = rules::indexer_query_rope_position(positions, t, seq, true);
}

// The indexer query weights: idx_wq_b (Q_LORA, heads*128) INT8, its column scales and the
// Hadamard rotation (128, 128) BF16 as views of the caller's weights, plus the copies a backend
// prepared at load time (the CPU's packed layout, kernels::pack_indexer_query_weights in
// backend/cpu/indexer.hpp; empty when only views are given: the a2a3 model reads the views).
//   packed wq_b  (N/16, Q_LORA/2, 16 columns, 2 k) INT8, N = heads * 128: column block nb holds
//                columns nb*16..nb*16+15; byte [c*2 + (k & 1)] of pair row kp is W[2kp + (k&1),
//                col]
//   wq_b_scale   (N) FP32;  hadamard (128, 128) FP32 (exact values of the BF16 matrix)
//   sylvester    the matrix is exactly s·(-1)^popcount(i&j) with s = hadamard_scale > 0 (the CSA
//                rotation): the CPU query path then uses a fast Walsh–Hadamard transform; any
//                other matrix (e.g. the standalone reference test's random one) is multiplied.
struct IndexerQueryWeights {
  int q_lora = 0;
  int n_heads = 0;
  ConstView<std::int8_t, 2> wq_b_view;  // (Q_LORA, heads*128)
  ConstView<float, 1> wq_b_scale_view;  // (heads*128)
  ConstView<bf16, 2> hadamard_view;     // (128, 128)
  Buffer<std::int8_t> wq_b;             // CPU packed
  Buffer<float> wq_b_scale;
  Buffer<float> hadamard;
  bool sylvester = false;
  float hadamard_scale = 0.0f;

  bool packed() const { return wq_b.size() > 0; }
  // Views only (no prepared copies).
  static IndexerQueryWeights views(const ModelConfig& cfg, ConstView<std::int8_t, 2> wq_b,
                                   ConstView<float, 1> wq_b_scale, ConstView<bf16, 2> hadamard) {
    IndexerQueryWeights w;
    w.q_lora = cfg.q_lora;
    w.n_heads = cfg.idx_n_heads;
    w.wq_b_view = wq_b;
    w.wq_b_scale_view = wq_b_scale;
    w.hadamard_view = hadamard;
    return w;
  }
};

struct IndexerQuery {
  static constexpr std::string_view kernel_name = "indexer_query";
};
struct IndexerWeights {
  static constexpr std::string_view kernel_name = "indexer_weights";
};
struct IndexerScore {
  static constexpr std::string_view kernel_name = "indexer_score";
};
struct IndexerTopk {
  static constexpr std::string_view kernel_name = "indexer_topk";
};

namespace detail {

inline void check_indexer_config(std::string_view where, const ModelConfig& cfg) {
  check_equal(where, "cfg.idx_head_dim", cfg.idx_head_dim, kIndexerHeadDim);
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, 64);
  if (cfg.idx_n_heads < 16 || cfg.idx_n_heads > kIndexerMaxHeads || cfg.idx_n_heads % 16 != 0) {
    throw_arg(where, "cfg.idx_n_heads", cfg.idx_n_heads, "a multiple of 16 in [16, 64]");
  }
  if (cfg.q_lora < 2 || cfg.q_lora > kIndexerMaxQLora || cfg.q_lora % 2 != 0) {
    throw_arg(where, "cfg.q_lora", cfg.q_lora, "an even value in [2, 4096]");
  }
  check_equal(where, "cfg.page", cfg.page, 128);
}

// Validates positions (T) / kv_seq_lens (B) / seq; returns B.
inline index_t check_indexer_metadata(std::string_view where, const ModelConfig& cfg,
                                      ConstView<std::int32_t, 1> positions,
                                      ConstView<std::int32_t, 1> kv_seq_lens, int seq) {
  check_range(where, "seq", seq, 1, 1 << 20);
  check_view(where, "kv_seq_lens", kv_seq_lens);
  check_view(where, "positions", positions);
  const index_t B = kv_seq_lens.extent(0);
  check_at_least<index_t>(where, "kv_seq_lens.extent(0)", B, 1);
  check_equal<index_t>(where, "positions.extent(0)", positions.extent(0), B * seq);
  for (index_t t = 0; t < positions.extent(0); ++t) {
    if (positions(t) < 0 || positions(t) >= cfg.max_seq_len)
      check_range(where, nth_name("positions", t), positions(t), 0, cfg.max_seq_len);
  }
  for (index_t b = 0; b < B; ++b) {
    if (kv_seq_lens(b) < 0 || kv_seq_lens(b) > cfg.max_seq_len)
      check_range(where, nth_name("kv_seq_lens", b), kv_seq_lens(b), 0, cfg.max_seq_len + 1);
  }
  return B;
}

}  // namespace detail

// ---- indexer_query

struct IndexerQueryArgs {
  const ModelConfig* cfg = nullptr;
  View<std::int8_t, 3> q_i8;     // (T, heads, 128)
  View<float, 2> q_sc;           // (T, heads)
  ConstView<std::int8_t, 2> qr;  // (T, Q_LORA)
  ConstView<float, 1> qr_scale;  // (T)
  const IndexerQueryWeights* wq = nullptr;
  ConstView<std::int32_t, 1> rope_pos;  // (T)
  RopeTableView rope;
  // Validate rope_pos's values (caller inputs). A decode step skips it: it fills rope_pos itself
  // when the kernel runs (rules::indexer_query_rope_position of positions it validated), so at
  // validation the buffer holds the previous step's values; the step checks the derived
  // positions against the table instead (decode/step.hpp, validate_plan).
  bool check_rope_pos = true;
  index_t tokens() const { return qr.extent(0); }
};

inline void validate(const IndexerQueryArgs& a) {
  constexpr std::string_view where = "indexer_query";
  const ModelConfig& cfg = *a.cfg;
  detail::check_indexer_config(where, cfg);
  check_view(where, "qr", a.qr);
  const index_t T = a.qr.extent(0), K = cfg.q_lora, H = cfg.idx_n_heads;
  if (a.wq == nullptr) throw_arg(where, "wq", "nullptr", "the indexer query weights");
  check_equal(where, "wq.q_lora", a.wq->q_lora, cfg.q_lora);
  check_equal(where, "wq.n_heads", a.wq->n_heads, cfg.idx_n_heads);
  const index_t N = H * kIndexerHeadDim;
  if (a.wq->packed()) {  // the CPU layout (pack_indexer_query_weights checked the shapes)
    check_equal<index_t>(where, "wq.wq_b.size()", index_t(a.wq->wq_b.size()), K * N);
    check_equal<index_t>(where, "wq.wq_b_scale.size()", index_t(a.wq->wq_b_scale.size()), N);
    check_equal<index_t>(where, "wq.hadamard.size()", index_t(a.wq->hadamard.size()),
                         kIndexerHeadDim * kIndexerHeadDim);
  } else {  // plain views (the a2a3 model reads them): every extent, data and inner stride
    check_rows(where, "wq.wq_b", a.wq->wq_b_view, {K, N});
    check_rows(where, "wq.wq_b_scale", a.wq->wq_b_scale_view, {N});
    check_rows(where, "wq.hadamard", a.wq->hadamard_view, {kIndexerHeadDim, kIndexerHeadDim});
  }
  check_rows(where, "qr", a.qr, {T, K});
  check_extents(where, "qr_scale", a.qr_scale, {T});
  check_extents(where, "rope_pos", a.rope_pos, {T});
  check_rows(where, "q_i8", a.q_i8, {T, H, kIndexerHeadDim});
  check_extents(where, "q_sc", a.q_sc, {T, H});
  check_rope_table(where, a.rope);
  check_equal<index_t>(where, "rope.cos.extent(1)", a.rope.cos.extent(1), 64);
  check_equal<index_t>(where, "rope.sin.extent(1)", a.rope.sin.extent(1), 64);
  for (index_t t = 0; t < T && a.check_rope_pos; ++t) {
    if (a.rope_pos(t) < 0 || a.rope_pos(t) >= a.rope.length())
      check_range<index_t>(where, nth_name("rope_pos", t), a.rope_pos(t), 0, a.rope.length());
  }
}

// Program: project (the INT8 tile matmul qr · idx_wq_b), then the epilogue (dequant, RoPE, BF16,
// Hadamard, Q8 per (token, head) row); the CPU fuses the epilogue into each (head, token tile).
template <class B>
void indexer_query_program(const B& be, const IndexerQueryArgs& a) {
  using Ops = ops_for<IndexerQuery, B>;
  Ops::project(be, a);   // acc = qr · idx_wq_b  (exact INT32)
  Ops::epilogue(be, a);  // q_i8, q_sc = Q8(bf16([acc·s][:64], rope(..)[64:]) @ hadamard)
}

// ---- indexer_weights

struct IndexerWeightsArgs {
  const ModelConfig* cfg = nullptr;
  View<float, 2> w;                 // (T, heads)
  ConstView<bf16, 2> x_n;           // (T, D)
  ConstView<bf16, 2> weights_proj;  // (D, heads)
  index_t tokens() const { return x_n.extent(0); }
};

inline void validate(const IndexerWeightsArgs& a) {
  constexpr std::string_view where = "indexer_weights";
  const ModelConfig& cfg = *a.cfg;
  detail::check_indexer_config(where, cfg);
  check_view(where, "x_n", a.x_n);
  const index_t T = a.x_n.extent(0), D = cfg.hidden, H = cfg.idx_n_heads;
  check_rows(where, "x_n", a.x_n, {T, D});
  check_rows(where, "weights_proj", a.weights_proj, {D, H});
  check_rows(where, "w", a.w, {T, H});
}

template <class B>
void indexer_weights_program(const B& be, const IndexerWeightsArgs& a) {
  ops_for<IndexerWeights, B>::weights(be, a);  // w = (x_n · weights_proj) · scale (BF16 matmul)
}

// ---- indexer_score

struct IndexerScoreArgs {
  const ModelConfig* cfg = nullptr;
  View<float, 2> score;                        // (T, score_len)
  ConstView<std::int8_t, 3> q_i8;              // (T, heads, 128)
  ConstView<float, 2> q_sc;                    // (T, heads) > 0
  ConstView<float, 2> w;                       // (T, heads)
  ConstView<std::int8_t, 2> idx_kv_cache;      // (blocks*page, 128)
  ConstView<float, 1> idx_kv_scale;            // (blocks*page)
  ConstView<std::int32_t, 2> idx_block_table;  // (>= B, cols)
  ConstView<std::int32_t, 1> positions;        // (T)
  ConstView<std::int32_t, 1> kv_seq_lens;      // (B)
  int seq = 2;
  // Index rows per table column (page): cfg.page (base and device-ring layouts) or cfg.page / 4
  // (prefix caching, addendum §3: 32 rows); a multiple of 16. 0 = cfg.page.
  index_t page = 0;
  index_t page_rows() const { return page > 0 ? page : index_t(cfg->page); }
  // Validate q_sc's values (caller inputs). A decode step skips it: its q_sc are Q8 scales it
  // produced itself (> 0 by construction; a non-finite one propagates, top-k handles NaN).
  bool check_q_scales = true;
  index_t tokens() const { return positions.extent(0); }
  index_t visible(index_t t) const {
    return rules::indexer_visible_rows(*cfg, positions(t), kv_seq_lens(t / seq));
  }
};

inline void validate(const IndexerScoreArgs& a) {
  constexpr std::string_view where = "indexer_score";
  const ModelConfig& cfg = *a.cfg;
  detail::check_indexer_config(where, cfg);
  const index_t B = detail::check_indexer_metadata(where, cfg, a.positions, a.kv_seq_lens, a.seq);
  const index_t T = a.positions.extent(0), H = cfg.idx_n_heads, page = a.page_rows();
  // 16-row key blocks never straddle a page (the score reads a block's rows contiguously).
  if (page < 16 || page > cfg.page || cfg.page % page != 0 || page % 16 != 0)
    throw_arg(where, "page", page, "a multiple of 16 dividing cfg.page (index rows per column)");
  check_rows(where, "score", a.score, {T, cfg.score_len()});
  check_rows(where, "q_i8", a.q_i8, {T, H, kIndexerHeadDim});
  check_extents(where, "q_sc", a.q_sc, {T, H});
  check_rows(where, "w", a.w, {T, H});
  check_rows(where, "idx_kv_cache", a.idx_kv_cache, {-1, kIndexerHeadDim});
  const index_t rows = a.idx_kv_cache.extent(0);
  if (rows < page || rows % page != 0) {
    throw_arg(where, "idx_kv_cache.extent(0)", rows,
              "a positive multiple of the page (" + std::to_string(page) + " rows)");
  }
  const index_t blocks = rows / page;
  check_extents(where, "idx_kv_scale", a.idx_kv_scale, {rows});
  check_inner_stride(where, "idx_kv_scale", a.idx_kv_scale);
  check_view(where, "idx_block_table", a.idx_block_table);
  if (a.idx_block_table.extent(0) < B)
    check_at_least(where, "idx_block_table.extent(0)", a.idx_block_table.extent(0), B);
  for (index_t t = 0; t < T && a.check_q_scales; ++t)
    for (index_t h = 0; h < H; ++h)
      if (!(a.q_sc(t, h) > 0.0f) || !std::isfinite(a.q_sc(t, h))) {
        throw_arg(where, nth_name("q_sc", t, h), a.q_sc(t, h), "a finite value > 0 (a Q8 scale)");
      }
  for (index_t b = 0; b < B; ++b)
    for (index_t c = 0; c < a.idx_block_table.extent(1); ++c) {
      const std::int32_t blk = a.idx_block_table(b, c);
      if (blk < -1 || blk >= blocks) {
        throw_arg(where, nth_name("idx_block_table", b, c), blk,
                  "[-1, " + std::to_string(blocks) + ") (pool blocks)");
      }
    }
  for (index_t t = 0; t < T; ++t) {
    const index_t b = t / a.seq;
    const index_t pages = (a.visible(t) + page - 1) / page;
    if (pages > a.idx_block_table.extent(1)) {
      throw_arg(
          where, "idx_block_table.extent(1)", a.idx_block_table.extent(1),
          ">= " + std::to_string(pages) + " (visible pages of token " + std::to_string(t) + ")");
    }
    for (index_t c = 0; c < pages; ++c)
      if (a.idx_block_table(b, c) < 0) {
        throw_arg(where, nth_name("idx_block_table", b, c), a.idx_block_table(b, c),
                  "a mapped block: page inside the visible range of token " + std::to_string(t));
      }
  }
}

// One work item of the score: token t, visible rows vis, its pages first, first + step, ... <
// last (page = a.page_rows() index rows; the backend chooses the split of a token's pages over
// items).
struct ScoreItem {
  index_t t = 0;
  index_t vis = 0;
  index_t first = 0, last = 0, step = 1;
};

// Program: per item, every page = one fused op (the INT8 key·query tile matmul and the score
// epilogue while the INT32 dots are live), then the item's tail (NEG_BIG past vis).
template <class B>
void indexer_score_program(const B& be, const IndexerScoreArgs& a) {
  using Ops = ops_for<IndexerScore, B>;
  Ops::for_items(be, a, [&](auto& lane, const ScoreItem& it) {
    Ops::begin_item(lane, a, it);  // coef = q_sc · w, the token's query operands
    for (index_t p = it.first; p < it.last; p += it.step)
      Ops::score_page(lane, a, it, p);  // score[t, page·p ..] through idx_block_table[b, p]
    Ops::end_item(lane, a, it);         // pipeline drain; NEG_BIG over the item's columns >= vis
  });
}

// ---- indexer_topk

struct IndexerTopkArgs {
  const ModelConfig* cfg = nullptr;
  View<std::int32_t, 2> topk_idxs;         // (T, W >= topk)
  ConstView<float, 2> score;               // (T, N)
  ConstView<std::int32_t, 1> positions;    // (T)
  ConstView<std::int32_t, 1> kv_seq_lens;  // (B)
  int seq = 2;
  int topk = 512;
  std::int32_t offset = 0;
  index_t tokens() const { return positions.extent(0); }
  index_t visible(index_t t) const {
    return std::min<index_t>(rules::indexer_visible_rows(*cfg, positions(t), kv_seq_lens(t / seq)),
                             score.extent(1));
  }
};

inline void validate(const IndexerTopkArgs& a) {
  constexpr std::string_view where = "indexer_topk";
  detail::check_indexer_metadata(where, *a.cfg, a.positions, a.kv_seq_lens, a.seq);
  const index_t T = a.positions.extent(0);
  check_view(where, "score", a.score);
  const index_t N = a.score.extent(1);
  check_rows(where, "score", a.score, {T, -1});
  check_view(where, "topk_idxs", a.topk_idxs);
  check_equal(where, "topk_idxs.extent(0)", a.topk_idxs.extent(0), T);
  check_inner_stride(where, "topk_idxs", a.topk_idxs);
  check_at_least<index_t>(where, "score.extent(1)", N, 1);
  check_range<index_t>(where, "topk", a.topk, 1, N + 1);
  check_at_least<index_t>(where, "topk_idxs.extent(1)", a.topk_idxs.extent(1), a.topk);
  check_range<index_t>(where, "offset", a.offset, 0,
                       index_t(std::numeric_limits<std::int32_t>::max()) - N + 1);
}

template <class B>
void indexer_topk_program(const B& be, const IndexerTopkArgs& a) {
  using Ops = ops_for<IndexerTopk, B>;
  Ops::for_rows(be, a, [&](auto& lane, index_t t) { Ops::topk_row(lane, a, t); });
}

// ---- entry points

// Indexer query path (spec §7.1) on backend `be`. Shapes: q_i8 (T, heads, 128) INT8, q_sc
// (T, heads) FP32, qr (T, Q_LORA) INT8 (any value, -128 included), qr_scale (T) FP32, rope_pos (T)
// INT32 in [0, rope.length()); rope: the layer's table (CSA: compress_rope_theta + YaRN).
template <class Be>
void indexer_query(const Be& be, const ModelConfig& cfg, View<std::int8_t, 3> q_i8,
                   View<float, 2> q_sc, ConstView<std::int8_t, 2> qr, ConstView<float, 1> qr_scale,
                   const IndexerQueryWeights& wq, ConstView<std::int32_t, 1> rope_pos,
                   const RopeTableView& rope) {
  const IndexerQueryArgs a{&cfg, q_i8, q_sc, qr, qr_scale, &wq, rope_pos, rope};
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<IndexerQuery, decltype(b)>::check(b, a);
    if (a.tokens() == 0) return;
    b.kernel(IndexerQuery::kernel_name, [&] { indexer_query_program(b, a); });
  });
}

// Head weights (spec §7.1): w (T, heads) FP32, x_n (T, D) BF16, weights_proj (D, heads) BF16.
template <class Be>
void indexer_weights(const Be& be, const ModelConfig& cfg, View<float, 2> w, ConstView<bf16, 2> x_n,
                     ConstView<bf16, 2> weights_proj) {
  const IndexerWeightsArgs a{&cfg, w, x_n, weights_proj};
  dispatch(be, [&](const auto& b) {
    validate(a);
    if (a.tokens() == 0) return;
    b.kernel(IndexerWeights::kernel_name, [&] { indexer_weights_program(b, a); });
  });
}

// Fused indexer score (spec §7.2), see the header. Shapes: score (T, 4096) FP32; q_i8 (T, heads,
// 128) INT8; q_sc (T, heads) FP32, > 0 and finite (Q8 scales); w (T, heads) FP32 (any sign);
// idx_kv_cache (blocks*128, 128) INT8 (any value); idx_kv_scale (blocks*128) FP32;
// idx_block_table (B, cols) INT32, entries in [-1, blocks), -1 = unmapped (an error inside a
// visible range); positions (T) INT32; kv_seq_lens (B) INT32 raw lengths; T = B * seq.
template <class Be>
void indexer_score(const Be& be, const ModelConfig& cfg, View<float, 2> score,
                   ConstView<std::int8_t, 3> q_i8, ConstView<float, 2> q_sc, ConstView<float, 2> w,
                   ConstView<std::int8_t, 2> idx_kv_cache, ConstView<float, 1> idx_kv_scale,
                   ConstView<std::int32_t, 2> idx_block_table, ConstView<std::int32_t, 1> positions,
                   ConstView<std::int32_t, 1> kv_seq_lens, int seq) {
  const IndexerScoreArgs a{&cfg,         score,           q_i8,      q_sc,        w,  idx_kv_cache,
                           idx_kv_scale, idx_block_table, positions, kv_seq_lens, seq};
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<IndexerScore, decltype(b)>::check(b, a);
    if (a.tokens() == 0) return;
    b.kernel(IndexerScore::kernel_name, [&] { indexer_score_program(b, a); });
  });
}

// Indexer top-k (spec §7.3): row t takes the min(topk, vis_t) best of score[t, 0:vis_t]
// (descending score, ascending column on ties, NaN never selected), adds `offset` (0 in the CSA
// composition, 128 = WIN in the standalone reference test) and writes -1 into every other slot.
// topk_idxs (T, W) INT32 with W >= topk; score (T, N) FP32 with N >= 1; topk in [1, N] (512
// flash, 1024 pro); offset in [0, INT32_MAX - N]; vis_t as in indexer_score (clamped to N).
template <class Be>
void indexer_topk(const Be& be, const ModelConfig& cfg, View<std::int32_t, 2> topk_idxs,
                  ConstView<float, 2> score, ConstView<std::int32_t, 1> positions,
                  ConstView<std::int32_t, 1> kv_seq_lens, int seq, int topk, std::int32_t offset) {
  const IndexerTopkArgs a{&cfg, topk_idxs, score, positions, kv_seq_lens, seq, topk, offset};
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<IndexerTopk, decltype(b)>::check(b, a);
    if (a.tokens() == 0) return;
    b.kernel(IndexerTopk::kernel_name, [&] { indexer_topk_program(b, a); });
  });
}

}  // namespace tiledecode::kernels
