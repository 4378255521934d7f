#pragma once
// Sparse attention core of one decode step (spec §8.1–§8.4) for SWA, CSA and HCA layers — the
// contract and the ONE tile program both backends run.
//
// Per token t and head h (V = K, MQA: the 64 (pro: 128) heads share every KV row):
//   columns   window block + compressed blocks of 128 (rules/attention.hpp, spec §8.1)
//   block β   S = scale·q·Kᵀ, m_β = max S, P = bf16(exp(S − m_β)), l_β = Σ exp(S − m_β),
//             O_β = P·K                                                     (spec §8.2)
//   merge     (m, l, O) ← online merge of the blocks in order                (spec §8.3)
//   finish    out = O / (l + exp(sink − m)); o_packed[g·T + t, (h%8)·512 ..] =
//             [bf16(out[:448]), bf16(rope_inverse(out[448:], pos_t))]      (spec §8.4)
// Blocks keep the spec's partition (columns 128β .. 128β + 127 of the list), so per-block maxima
// and the BF16 rounding of P match the reference. An all-invalid block is skipped (its weight in
// the merge is exactly 0); a token with no valid column outputs exact zeros.
//
// The program (below) is a loop over work items, each attending a range of blocks of one token
// for a tile of heads with the ops of tile/ (gather rows through the tables, the BF16 tile matmul,
// the block softmax, the online merge, sink normalisation and the packed inverse-RoPE store).
// Where the backends schedule it differently, the difference is the backend's policy
// (backend_ops<SparseAttention, B>), not a second copy of the math:
//   CPU   item = (token, 64 heads), all blocks, merged online in the item's workspace slot;
//   a2a3  item = (token, block) on 24 mixed blocks (live items first, spec §8.6), partials (m, l,
//   O)
//         to GM scratch (`split_blocks`), merged by a second stage (merge_norm).
//
// Decisions where the spec leaves room (documented and tested):
//  * Window column k of token t is valid iff k < window_lens[t] and window_idx[t,k] >= 0, for
//    every family; window_idx entries must be -1 or in [0, kv_cache rows).
//  * CSA top-k: only the first cfg.idx_topk columns of topk_idxs are read; raw ids outside
//    [0, (pos+1)/4) are masked (spec §8.1), not an error. HCA uses n_t = min(128, (pos+1)/128,
//    kv_seq_lens[b]/128) (spec §8.1, quirk 6).
//  * cmp_block_table entries -1 are unmapped pages (their compressed columns are invalid); other
//    negative entries and entries >= cmp pool blocks are errors. Columns past the table width are
//    unmapped.
//  * attn_sink must be finite. NaN in q or the caches is not scanned for; it propagates into that
//    token's outputs (docs/security.md).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/rules/attention.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::kernels {

// The family tag: backends implement backend_ops<SparseAttention, B>.
struct SparseAttention {
  static constexpr std::string_view kernel_name(LayerKind k) {
    return k == LayerKind::swa ? "sparse_attn_swa"
                               : (k == LayerKind::csa ? "sparse_attn_csa" : "sparse_attn_hca");
  }
};

// The arguments of one call (views of the caller's tensors; validated by validate()).
struct SparseAttentionArgs {
  const ModelConfig* cfg = nullptr;
  LayerKind kind = LayerKind::swa;
  View<bf16, 2> o_packed;         // (O_GROUPS*T, O_GROUP_IN)
  ConstView<bf16, 3> q;           // (T, H, 512)
  ConstView<bf16, 2> kv_cache;    // (ori rows, 512)
  ConstView<bf16, 2> cmp_kv;      // (cmp rows, 512) CSA/HCA
  rules::AttentionColumns cols;   // window lists, top-k, compressed table, positions, kv lens
  ConstView<float, 1> attn_sink;  // (H)
  RopeTableView rope;

  index_t tokens() const { return q.extent(0); }
  index_t batch() const { return tokens() / cols.seq; }
  int n_blocks() const { return cols.n_blocks(); }
};

// One work item: token t, heads [h0, h0 + nh), blocks [beta0, beta1).
struct AttentionItem {
  index_t t = 0;
  int h0 = 0, nh = 0;
  int beta0 = 0, beta1 = 0;
};

inline SparseAttentionArgs sparse_attention_args(
    const ModelConfig& cfg, LayerKind kind, View<bf16, 2> o_packed, ConstView<bf16, 3> q,
    ConstView<bf16, 2> kv_cache, ConstView<bf16, 2> cmp_kv, ConstView<std::int32_t, 2> window_idx,
    ConstView<std::int32_t, 1> window_lens, ConstView<std::int32_t, 2> topk_idxs,
    ConstView<std::int32_t, 2> cmp_block_table, ConstView<std::int32_t, 1> positions,
    ConstView<std::int32_t, 1> kv_seq_lens, int seq, ConstView<float, 1> attn_sink,
    const RopeTableView& rope, index_t cmp_page = 0) {
  SparseAttentionArgs a;
  a.cfg = &cfg;
  a.kind = kind;
  a.o_packed = o_packed;
  a.q = q;
  a.kv_cache = kv_cache;
  a.cmp_kv = cmp_kv;
  a.cols = rules::AttentionColumns::of(cfg, kind, seq);
  a.cols.window_idx = window_idx;
  a.cols.window_lens = window_lens;
  a.cols.topk = topk_idxs;
  a.cols.cmp_block_table = cmp_block_table;
  if (cmp_page > 0) a.cols.page = int(cmp_page);
  a.cols.positions = positions;
  a.cols.kv_seq_lens = kv_seq_lens;
  a.attn_sink = attn_sink;
  a.rope = rope;
  return a;
}

// Validates every argument the program reads (throws tiledecode::Error naming it; no allocation
// on the valid path).
inline void validate(const SparseAttentionArgs& a) {
  constexpr std::string_view where = "sparse_attention";
  const ModelConfig& cfg = *a.cfg;
  if (a.kind != LayerKind::swa && a.kind != LayerKind::csa && a.kind != LayerKind::hca)
    throw_arg(where, "kind", int(a.kind), "swa (0), csa (4) or hca (128)");
  check_equal(where, "cfg.head_dim", cfg.head_dim, 512);
  check_equal(where, "cfg.attn_k_tile", cfg.attn_k_tile, 128);
  check_equal(where, "cfg.window", cfg.window, 128);
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, 64);
  check_equal(where, "cfg.page", cfg.page, 128);
  if (cfg.n_heads < 8 || cfg.n_heads % cfg.o_groups != 0 || cfg.n_heads % 8 != 0)
    throw_arg(where, "cfg.n_heads", cfg.n_heads, "a multiple of 8 and of cfg.o_groups");
  if (cfg.attn_cols(a.kind) % 128 != 0)
    throw_arg(where, "cfg.attn_cols", cfg.attn_cols(a.kind), "a multiple of 128");
  check_range(where, "seq", a.cols.seq, 1, 1 << 10);
  check_view(where, "q", a.q);
  const index_t T = a.q.extent(0), H = cfg.n_heads, D = cfg.head_dim;
  if (T % a.cols.seq != 0) throw_arg(where, "q.extent(0)", T, "a multiple of seq");
  const index_t B = T / a.cols.seq;
  check_rows(where, "q", a.q, {T, H, D});
  check_rows(where, "o_packed", a.o_packed, {index_t(cfg.o_groups) * T, cfg.o_group_in()});
  check_rows(where, "kv_cache", a.kv_cache, {-1, D});
  check_rows(where, "window_idx", a.cols.window_idx, {T, cfg.window});
  check_extents(where, "window_lens", a.cols.window_lens, {T});
  check_extents(where, "positions", a.cols.positions, {T});
  check_extents(where, "attn_sink", a.attn_sink, {H});
  check_rope_table(where, a.rope);
  const index_t max_pos = std::min<index_t>(cfg.max_seq_len, a.rope.length());
  const index_t kv_rows = a.kv_cache.extent(0);
  for (index_t t = 0; t < T; ++t) {
    const index_t p = a.cols.positions(t), lens = a.cols.window_lens(t);
    if (p < 0 || p >= max_pos) check_range<index_t>(where, nth_name("positions", t), p, 0, max_pos);
    if (lens < 0 || lens > cfg.window)
      check_range<index_t>(where, nth_name("window_lens", t), lens, 0, cfg.window + 1);
    for (index_t k = 0; k < cfg.window; ++k) {
      const index_t v = a.cols.window_idx(t, k);
      if (v < -1 || v >= kv_rows)
        throw_arg(where, nth_name("window_idx", t, k), v,
                  "-1 or [0, " + std::to_string(kv_rows) + ") (kv_cache rows)");
    }
  }
  check_finite(where, "attn_sink", a.attn_sink);
  if (a.kind != LayerKind::swa) {
    check_rows(where, "cmp_kv", a.cmp_kv, {-1, D});
    const index_t page = a.cols.page;
    if (page < 1 || page > cfg.page || cfg.page % page != 0)
      throw_arg(where, "cols.page", page, "a divisor of cfg.page (compressed rows per column)");
    if (a.cmp_kv.extent(0) < page || a.cmp_kv.extent(0) % page != 0)
      throw_arg(where, "cmp_kv.extent(0)", a.cmp_kv.extent(0),
                "a positive multiple of the page (" + std::to_string(page) + " rows)");
    const index_t cmp_blocks = a.cmp_kv.extent(0) / page;
    check_view(where, "cmp_block_table", a.cols.cmp_block_table);
    if (a.cols.cmp_block_table.extent(0) < B)
      check_at_least(where, "cmp_block_table.extent(0)", a.cols.cmp_block_table.extent(0), B);
    check_at_least(where, "cmp_block_table.extent(1)", a.cols.cmp_block_table.extent(1),
                   index_t(1));
    for (index_t b = 0; b < B; ++b)
      for (index_t c = 0; c < a.cols.cmp_block_table.extent(1); ++c) {
        const index_t e = a.cols.cmp_block_table(b, c);
        if (e < -1 || e >= cmp_blocks)
          throw_arg(where, nth_name("cmp_block_table", b, c), e,
                    "-1 (unmapped) or [0, " + std::to_string(cmp_blocks) + ") (cmp pool blocks)");
      }
  }
  if (a.kind == LayerKind::hca) {
    check_extents(where, "kv_seq_lens", a.cols.kv_seq_lens, {B});
    for (index_t b = 0; b < B; ++b) {
      const index_t v = a.cols.kv_seq_lens(b);
      if (v < 0 || v > cfg.max_seq_len)
        check_range<index_t>(where, nth_name("kv_seq_lens", b), v, 0, cfg.max_seq_len + 1);
    }
  }
  if (a.kind == LayerKind::csa) {
    check_view(where, "topk_idxs", a.cols.topk);
    check_equal(where, "topk_idxs.extent(0)", a.cols.topk.extent(0), T);
    check_at_least(where, "topk_idxs.extent(1)", a.cols.topk.extent(1), index_t(cfg.idx_topk));
    check_inner_stride(where, "topk_idxs", a.cols.topk);
  }
}

// The tile program (both backends).
template <class B>
void sparse_attention_program(const B& be, const SparseAttentionArgs& a,
                              std::span<std::byte> workspace) {
  using Ops = ops_for<SparseAttention, B>;
  const float scale = a.cfg->softmax_scale();
  auto sched = Ops::schedule(be, a, workspace);
  // Stage 1: every item attends its blocks of one token, merging them online.
  sched.for_items([&](auto& lane, const AttentionItem& it) {
    Ops::load_queries(lane, a, it);
    Ops::begin_item(lane, it);  // (m, l, O) = (-inf, 0, 0)
    for (int beta = it.beta0; beta < it.beta1; ++beta) {
      if (Ops::block_rows(lane, a, it, beta) == 0) continue;  // all invalid: zero weight
      Ops::gather_kv(lane, a, beta);  // K = the block's valid rows, through the tables
      Ops::scores(lane, it, scale);   // S = scale · Q · Kᵀ
      Ops::block_softmax(lane, it);   // m_β, l_β, P = bf16(exp(S − m_β))
      Ops::merge_block(lane, it);     // (m, l, O) ← merge((m, l, O), (m_β, l_β, P·K))
    }
    if constexpr (Ops::split_blocks)
      Ops::store_partial(lane, a, it);  // the item's (m, l, O) for stage 2
    else
      Ops::finish(lane, a, it);  // O / (l + e^(sink − m)), inverse RoPE, packed BF16 rows
  });
  // Stage 2 (split-block schedules only): merge the partials of each (token, head tile).
  if constexpr (Ops::split_blocks) {
    sched.for_partials([&](auto& lane, const AttentionItem& it) {
      Ops::begin_item(lane, it);
      for (int beta = it.beta0; beta < it.beta1; ++beta) Ops::merge_partial(lane, a, it, beta);
      Ops::finish(lane, a, it);
    });
  }
}

// Workspace bytes the backend `be` needs for T tokens (a CPU backend: one slot per concurrent
// item; a2a3: the GM scratch of the plan and the partials).
template <class Be>
std::size_t sparse_attention_workspace_bytes(const Be& be, const ModelConfig& cfg, LayerKind kind,
                                             index_t tokens) {
  return dispatch(be, [&](const auto& b) {
    return ops_for<SparseAttention, decltype(b)>::workspace_bytes(b, cfg, kind, tokens);
  });
}

// Sparse attention of one layer for T = B·S tokens, writing the packed head rows, on backend `be`
// (a cpu::Context, or an a2a3::Context of the chip model).
//   o_packed     BF16 [O_GROUPS·T, O_GROUP_IN]: row g·T+t, columns (h%8)·512.. = head h of t
//   q            BF16 [T, H, 512]
//   kv_cache     BF16 [ori rows, 512]   original cache pool (blocks × 128 rows, flattened)
//   cmp_kv       BF16 [cmp rows, 512]   compressed pool (CSA/HCA; may be empty for SWA)
//   window_idx   INT32 [T, 128]  physical ori rows, oldest → newest; -1 = invalid
//   window_lens  INT32 [T]       valid window prefix length (0..128)
//   topk_idxs    INT32 [T, >= idx_topk]  CSA raw compressed ids; -1 / out of [0,(pos+1)/4) masked
//                (ignored for SWA/HCA; may be empty)
//   cmp_block_table INT32 [>= B, cols]  compressed pages (page 128); -1 unmapped (CSA/HCA)
//   positions    INT32 [T]       absolute position of each token (inverse-RoPE position)
//   kv_seq_lens  INT32 [B]       committed length per request (HCA's n_t bound)
//   seq          S, tokens per request (t = b·S + s)
//   attn_sink    FP32 [H]        finite
//   rope         the layer's RoPE table (covers every position)
//   workspace    >= sparse_attention_workspace_bytes(be, cfg, kind, T) bytes, any alignment
// Throws tiledecode::Error on invalid arguments before writing anything.
template <class Be>
void sparse_attention(const Be& be, const ModelConfig& cfg, LayerKind kind, View<bf16, 2> o_packed,
                      ConstView<bf16, 3> q, ConstView<bf16, 2> kv_cache, ConstView<bf16, 2> cmp_kv,
                      ConstView<std::int32_t, 2> window_idx, ConstView<std::int32_t, 1> window_lens,
                      ConstView<std::int32_t, 2> topk_idxs,
                      ConstView<std::int32_t, 2> cmp_block_table,
                      ConstView<std::int32_t, 1> positions, ConstView<std::int32_t, 1> kv_seq_lens,
                      int seq, ConstView<float, 1> attn_sink, const RopeTableView& rope,
                      std::span<std::byte> workspace) {
  const SparseAttentionArgs a = sparse_attention_args(
      cfg, kind, o_packed, q, kv_cache, cmp_kv, window_idx, window_lens, topk_idxs, cmp_block_table,
      positions, kv_seq_lens, seq, attn_sink, rope);
  dispatch(be, [&](const auto& b) {
    using Ops = ops_for<SparseAttention, decltype(b)>;
    validate(a);
    Ops::check(b, a, workspace);
    if (a.tokens() == 0) return;
    b.kernel(SparseAttention::kernel_name(kind),
             [&] { sparse_attention_program(b, a, workspace); });
  });
}

}  // namespace tiledecode::kernels
