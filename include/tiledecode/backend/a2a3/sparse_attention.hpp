#pragma once
// Sparse attention with the grouped output projection (spec §8) scheduled on the a2a3 model,
// following the device design of §8.6 (CSA `decode_sparse_attn`); the SWA and HCA variants use
// the same launches with their own column lists (§8.1).
//
// Launch sequence:
//   plan        vector, 1 block (scalar walk): per token the 128 window rows + the compressed
//               rows (CSA: top-k masked by (pos+1)//4 through cmp_block_table; HCA: 0..n_t-1;
//               SWA: none) as physical row ids (-1 = invalid), the additive bias (0 / -1e20),
//               the live-block mask (block 0 always live) and the work order (live items first).
//   qk_pv       mixed, 24 blocks (= AIC count); lane c takes live items c, c+24, ...: gather
//               128 KV rows into L1 (one DMA per row: issue-bound), then for 2 batches of 32
//               heads: cube S = q.K^T (K tiles of 128) -> ring -> vector (16 heads per AIV)
//               s*scale + bias, rowmax, exp, rowsum, bf16(P) -> ring -> cube O = P.K -> ring ->
//               vector stores (m, l, o) per 16-head tile to a GM scratch.
//   merge_norm  vector, T x H/16 blocks: merge over live blocks (§8.3), sink, 1/den, inverse RoPE
//               at pos_t, BF16, one packed 512-wide store per head row into o_packed
//               (O_GROUPS*T, 4096) (PR #831).
//   proj_a      cube, O_GROUPS x 8 blocks (N fragments of 128, K tile 256): o_r = o_packed . wo_a^T
//   quant       vector, T x O_GROUPS blocks: Q8 per (token, group) over 1024
//   proj_b      cube, O_GROUPS x 8 blocks (D chunks of 512, K tile 256): INT32 partials
//               (T, O_GROUPS*D)
//   proj_b_act  vector, T x 4 blocks: sum_g a_dq * partial (fixed g order), x wo_b_scale, BF16.
// Cube row tiles are padded to 16 rows (T = 8): the model charges whole fractals.
//
// Choices: an all-invalid block is skipped (device behaviour, §11.9) and ignored by the merge;
// the golden's (m=-1e20, l=0, o=0) block contributes nothing either, so results agree. A token
// with no live column at all outputs 0 (cannot happen: the current token is in its window).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::a2a3 {

inline constexpr int kAttnTile = 128;  // K columns per block
inline constexpr int kHeadBatch = 32;  // heads per cube QK/PV batch
inline constexpr int kVecHeads = 16;   // heads per AIV (and per merge_norm block)
inline constexpr int kHeadDim = 512;

// Static UB plan of the qk_pv vector side (per AIV): S ring, O ring, softmax work buffers.
using AttnSSlot = StaticTile<float, Space::ub, kVecHeads, kAttnTile>;  // 8 KiB
using AttnOSlot = StaticTile<float, Space::ub, kVecHeads, kHeadDim>;   // 32 KiB
using AttnWork = StaticTile<float, Space::ub, kVecHeads, kAttnTile>;
using AttnP = StaticTile<bf16, Space::ub, kVecHeads, kAttnTile>;
static_assert(
    fits_v<Space::ub, Replicated<AttnSSlot, 2>, Replicated<AttnOSlot, 2>, AttnWork, AttnP>);
// L1 of the cube side: q of one token (64 x 512 BF16) + double-buffered gathered K (128 x 512).
static_assert(fits_v<Space::l1, StaticTile<bf16, Space::l1, 64, kHeadDim>,
                     Replicated<StaticTile<bf16, Space::l1, kAttnTile, kHeadDim>, 2>,
                     Replicated<StaticTile<bf16, Space::l1, kVecHeads, kAttnTile>, 4>>);

struct SparseAttnInputs {
  LayerKind kind = LayerKind::csa;
  ConstView<bf16, 3> q;                        // (T, H, 512)
  ConstView<bf16, 2> ori_kv;                   // (ori pool rows, 512)
  ConstView<std::int32_t, 2> window_idx;       // (T, 128) physical ori rows, -1 invalid
  ConstView<std::int32_t, 1> window_lens;      // (T) columns k >= lens are invalid
  ConstView<bf16, 2> cmp_kv;                   // (cmp pool rows, 512); unused for SWA
  ConstView<std::int32_t, 2> cmp_block_table;  // (B, cols); unused for SWA
  ConstView<std::int32_t, 2> topk;             // (T, >= idx_topk) CSA compressed ids; else unused
  ConstView<std::int32_t, 1> positions;        // (T)
  ConstView<std::int32_t, 1> kv_seq_lens;      // (B) (HCA n_t bound)
  ConstView<float, 1> attn_sink;               // (H)
  RopeTableView rope;                          // table of the layer kind (inverse RoPE at pos_t)
  ConstView<bf16, 3> wo_a;                     // (O_GROUPS, O_LORA, 8*512)
  ConstView<std::int8_t, 2> wo_b;              // (D, O_GROUPS*O_LORA)
  ConstView<float, 1> wo_b_scale;              // (D)
  int seq = 2;                                 // S
};

// GM workspaces of the launches.
struct SparseAttnWorkspace {
  Tensor<std::int32_t, 2> rows;     // (T, cols) physical row per column (-1 invalid); column
                                    // block 0 = window (ori pool), blocks 1.. = compressed pool
  Tensor<float, 2> bias;            // (T, cols)
  Tensor<std::int32_t, 2> live;     // (T, blocks) 1 = block has a valid column
  Tensor<std::int32_t, 1> order;    // (T*blocks) work order: live items first, then empty
  Tensor<float, 3> m, l;            // (T, blocks, H)
  Tensor<float, 4> o;               // (T, blocks, H, 512)
  Tensor<bf16, 2> o_packed;         // (O_GROUPS*T, 4096)
  Tensor<float, 3> o_r;             // (T, O_GROUPS, O_LORA)
  Tensor<std::int8_t, 3> a_i8;      // (T, O_GROUPS, O_LORA)
  Tensor<float, 2> a_dq;            // (T, O_GROUPS)
  Tensor<std::int32_t, 2> partial;  // (T, O_GROUPS*D)
  int cols, blocks;
  SparseAttnWorkspace(int tokens, LayerKind kind, const ModelConfig& cfg)
      : cols(cfg.attn_cols(kind)), blocks(cfg.attn_cols(kind) / kAttnTile) {
    rows = Tensor<std::int32_t, 2>({tokens, cols});
    bias = Tensor<float, 2>({tokens, cols});
    live = Tensor<std::int32_t, 2>({tokens, blocks});
    order = Tensor<std::int32_t, 1>({index_t(tokens) * blocks});
    m = Tensor<float, 3>({tokens, blocks, cfg.n_heads});
    l = Tensor<float, 3>({tokens, blocks, cfg.n_heads});
    o = Tensor<float, 4>({tokens, blocks, cfg.n_heads, cfg.head_dim});
    o_packed = Tensor<bf16, 2>({index_t(cfg.o_groups) * tokens, cfg.o_group_in()});
    o_r = Tensor<float, 3>({tokens, cfg.o_groups, cfg.o_lora});
    a_i8 = Tensor<std::int8_t, 3>({tokens, cfg.o_groups, cfg.o_lora});
    a_dq = Tensor<float, 2>({tokens, cfg.o_groups});
    partial = Tensor<std::int32_t, 2>({tokens, index_t(cfg.o_groups) * cfg.hidden});
  }
};

namespace detail {

inline void check_sparse_attn(const SparseAttnInputs& in, View<bf16, 2> out,
                              const SparseAttnWorkspace& ws, const ModelConfig& cfg) {
  constexpr std::string_view w = "a2a3::sparse_attention";
  const index_t T = in.positions.extent(0);
  check_at_least(w, "seq", in.seq, 1);
  if (T % in.seq != 0) throw_arg(w, "positions.extent(0)", T, "a multiple of seq");
  const index_t B = T / in.seq;
  if (cfg.n_heads % kHeadBatch != 0 || cfg.head_dim != kHeadDim || cfg.heads_per_group() != 8)
    throw_arg(w, "cfg.n_heads", cfg.n_heads, "a multiple of 32 heads of 512, 8 heads per group");
  check_equal(w, "q.extent(0)", in.q.extent(0), T);
  check_equal(w, "q.extent(1)", in.q.extent(1), index_t(cfg.n_heads));
  check_equal(w, "q.extent(2)", in.q.extent(2), index_t(cfg.head_dim));
  check_equal(w, "ori_kv.extent(1)", in.ori_kv.extent(1), index_t(cfg.head_dim));
  check_equal(w, "window_idx.extent(0)", in.window_idx.extent(0), T);
  check_equal(w, "window_idx.extent(1)", in.window_idx.extent(1), index_t(cfg.window));
  check_equal(w, "window_lens.extent(0)", in.window_lens.extent(0), T);
  check_equal(w, "kv_seq_lens.extent(0)", in.kv_seq_lens.extent(0), B);
  check_equal(w, "attn_sink.extent(0)", in.attn_sink.extent(0), index_t(cfg.n_heads));
  check_equal(w, "wo_a.extent(0)", in.wo_a.extent(0), index_t(cfg.o_groups));
  check_equal(w, "wo_a.extent(1)", in.wo_a.extent(1), index_t(cfg.o_lora));
  check_equal(w, "wo_a.extent(2)", in.wo_a.extent(2), index_t(cfg.o_group_in()));
  check_equal(w, "wo_b.extent(0)", in.wo_b.extent(0), index_t(cfg.hidden));
  check_equal(w, "wo_b.extent(1)", in.wo_b.extent(1), index_t(cfg.o_groups) * cfg.o_lora);
  check_equal(w, "wo_b_scale.extent(0)", in.wo_b_scale.extent(0), index_t(cfg.hidden));
  check_equal(w, "out.extent(0)", out.extent(0), T);
  check_equal(w, "out.extent(1)", out.extent(1), index_t(cfg.hidden));
  check_equal(w, "ws.cols", index_t(ws.cols), index_t(cfg.attn_cols(in.kind)));
  check_equal(w, "ws.rows.extent(0)", ws.rows.extent(0), T);
  if (in.kind != LayerKind::swa) {
    check_equal(w, "cmp_kv.extent(1)", in.cmp_kv.extent(1), index_t(cfg.head_dim));
    check_equal(w, "cmp_block_table.extent(0)", in.cmp_block_table.extent(0), B);
  }
  if (in.kind == LayerKind::csa) {
    check_equal(w, "topk.extent(0)", in.topk.extent(0), T);
    check_at_least(w, "topk.extent(1)", in.topk.extent(1), index_t(cfg.idx_topk));
  }
  for (index_t t = 0; t < T; ++t) {
    check_range<index_t>(w, "positions[" + std::to_string(t) + "]", in.positions(t), 0,
                         in.rope.length());
    check_range<index_t>(w, "window_lens[" + std::to_string(t) + "]", in.window_lens(t), 0,
                         cfg.window + 1);
    for (index_t k = 0; k < cfg.window; ++k)
      check_range<index_t>(w, "window_idx", in.window_idx(t, k), -1, in.ori_kv.extent(0));
  }
  const index_t cmp_blocks = in.kind == LayerKind::swa ? 0 : in.cmp_kv.extent(0) / kAttnTile;
  for (index_t b = 0; b < B && in.kind != LayerKind::swa; ++b)
    for (index_t c = 0; c < in.cmp_block_table.extent(1); ++c)
      check_range<index_t>(w, "cmp_block_table", in.cmp_block_table(b, c), -1, cmp_blocks);
}

// Physical compressed row of compressed id `raw` of request b, or -1.
inline std::int32_t cmp_row(const SparseAttnInputs& in, index_t b, index_t raw) {
  const index_t col = raw / kAttnTile;
  if (col >= in.cmp_block_table.extent(1)) return -1;
  const std::int32_t blk = in.cmp_block_table(b, col);
  return blk < 0 ? -1 : std::int32_t(blk * kAttnTile + raw % kAttnTile);
}

inline void sparse_plan(Machine& m, const SparseAttnInputs& in, SparseAttnWorkspace& ws,
                        const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), C = ws.cols, NB = ws.blocks;
  m.launch_vector("sparse_attn.plan", 1, [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    auto widx = v.alloc<std::int32_t>(Space::ub, "window_idx", T, cfg.window);
    auto rows = v.alloc<std::int32_t>(Space::ub, "rows", T, C);
    auto bias = v.alloc<float>(Space::ub, "bias", T, C);
    auto live = v.alloc<std::int32_t>(Space::ub, "live", 1, T * NB);
    auto order = v.alloc<std::int32_t>(Space::ub, "order", 1, T * NB);
    v.copy_in(widx, 0, in.window_idx, "window_idx_in");
    const index_t n_cmp = C - cfg.window;
    Tile<std::int32_t> tk;
    if (in.kind == LayerKind::csa) {
      tk = v.alloc<std::int32_t>(Space::ub, "topk", T, n_cmp);
      v.copy_in(tk, 0, in.topk.slice(1, 0, n_cmp), "topk_in");
    }
    v.scalar("build_plan", double(T * C), {&widx.state(), tk.data() ? &tk.state() : &widx.state()},
             {&rows.state(), &bias.state(), &live.state()}, [&] {
               for (index_t t = 0; t < T; ++t) {
                 const index_t b = t / in.seq, pos = in.positions(t);
                 for (index_t k = 0; k < cfg.window; ++k) {
                   const bool ok = k < in.window_lens(t) && widx(t, k) >= 0;
                   rows(t, k) = ok ? widx(t, k) : -1;
                 }
                 const index_t hca_n = std::min<index_t>(
                     {index_t(cfg.hca_capacity()), (pos + 1) / 128, in.kv_seq_lens(b) / 128});
                 for (index_t i = 0; i < n_cmp; ++i) {
                   std::int32_t r = -1;
                   if (in.kind == LayerKind::csa) {
                     const index_t raw = tk(t, i);
                     if (raw >= 0 && raw < (pos + 1) / 4) r = cmp_row(in, b, raw);
                   } else if (in.kind == LayerKind::hca && i < hca_n) {
                     r = cmp_row(in, b, i);
                   }
                   rows(t, cfg.window + i) = r;
                 }
                 for (index_t c = 0; c < C; ++c) bias(t, c) = rows(t, c) >= 0 ? 0.0f : kMaskNeg;
                 for (index_t bl = 0; bl < NB; ++bl) {
                   bool any = bl == 0;  // block 0 (the window) is always live
                   for (index_t c = bl * kAttnTile; c < (bl + 1) * kAttnTile; ++c)
                     any = any || rows(t, c) >= 0;
                   live(0, t * NB + bl) = any ? 1 : 0;
                 }
               }
               index_t n = 0;
               for (int pass = 1; pass >= 0; --pass)
                 for (index_t i = 0; i < T * NB; ++i)
                   if (live(0, i) == pass) order(0, n++) = std::int32_t(i);
             });
    v.copy_out(ws.rows.view(), rows, 0, "rows_out");
    v.copy_out(ws.bias.view(), bias, 0, "bias_out");
    v.copy_out(View<std::int32_t, 2>(ws.live.data(), {1, T * NB}), live, 0, "live_out");
    v.copy_out(View<std::int32_t, 2>(ws.order.data(), {1, T * NB}), order, 0, "order_out");
  });
}

inline void sparse_qk_pv(Machine& m, const SparseAttnInputs& in, SparseAttnWorkspace& ws,
                         const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), NB = ws.blocks, H = cfg.n_heads;
  const int lanes = m.arch().cube_cores;
  index_t n_live = 0;
  for (index_t i = 0; i < T * NB; ++i) n_live += ws.live.data()[i];
  const float scale = cfg.softmax_scale();
  m.launch_mixed("sparse_attn.qk_pv", lanes, [&](MixedBlock& blk) {
    CubeCore& c = blk.cube;
    auto q_l1 = c.alloc<bf16>(Space::l1, "q", H, kHeadDim);
    std::array<Tile<bf16>, 2> k_l1{c.alloc<bf16>(Space::l1, "kv[0]", kAttnTile, kHeadDim),
                                   c.alloc<bf16>(Space::l1, "kv[1]", kAttnTile, kHeadDim)};
    std::array<Tile<bf16>, 2> qa{c.alloc<bf16>(Space::l0a, "q_l0[0]", kHeadBatch, kAttnTile),
                                 c.alloc<bf16>(Space::l0a, "q_l0[1]", kHeadBatch, kAttnTile)};
    std::array<Tile<bf16>, 2> pa{c.alloc<bf16>(Space::l0a, "p_l0[0]", kVecHeads, kAttnTile),
                                 c.alloc<bf16>(Space::l0a, "p_l0[1]", kVecHeads, kAttnTile)};
    std::array<Tile<bf16>, 2> kb{c.alloc<bf16>(Space::l0b, "k_l0[0]", kAttnTile, kAttnTile),
                                 c.alloc<bf16>(Space::l0b, "k_l0[1]", kAttnTile, kAttnTile)};
    std::array<Tile<float>, 2> s_acc{c.alloc<float>(Space::l0c, "s[0]", kHeadBatch, kAttnTile),
                                     c.alloc<float>(Space::l0c, "s[1]", kHeadBatch, kAttnTile)};
    std::array<Tile<float>, 2> o_acc{c.alloc<float>(Space::l0c, "o[0]", kVecHeads, kHeadDim),
                                     c.alloc<float>(Space::l0c, "o[1]", kVecHeads, kHeadDim)};
    Ring<float> s_ring[2] = {{c, blk.vec0, "s_ring", 2, kVecHeads, kAttnTile},
                             {c, blk.vec1, "s_ring", 2, kVecHeads, kAttnTile}};
    Ring<float> o_ring[2] = {{c, blk.vec0, "o_ring", 2, kVecHeads, kHeadDim},
                             {c, blk.vec1, "o_ring", 2, kVecHeads, kHeadDim}};
    Ring<bf16> p_ring[2] = {{blk.vec0, c, "p_ring", 2, kVecHeads, kAttnTile},
                            {blk.vec1, c, "p_ring", 2, kVecHeads, kAttnTile}};
    struct VecBufs {
      Tile<float> bias, s, ml;
      Tile<bf16> p;
    };
    VecBufs vb[2];
    for (int i = 0; i < 2; ++i) {
      VectorCore& v = blk.vec(i);
      vb[i] = {v.alloc<float>(Space::ub, "bias", 1, kAttnTile),
               v.alloc<float>(Space::ub, "s", kVecHeads, kAttnTile),
               v.alloc<float>(Space::ub, "m_l", 2, kVecHeads),
               v.alloc<bf16>(Space::ub, "p", kVecHeads, kAttnTile)};
    }
    index_t last_t = -1;
    int j = 0;
    for (index_t it = blk.index; it < n_live; it += lanes, ++j) {
      const index_t item = ws.order.data()[it], t = item / NB, bl = item % NB;
      const auto& kv_l1 = k_l1[std::size_t(j % 2)];
      // Gather the block's 128 KV rows: one DMA per row (window from the ori pool, compressed
      // from the compressed pool).
      const std::int32_t* rows = ws.rows.data() + t * ws.cols + bl * kAttnTile;
      const bool cmp = bl > 0;  // block 0 is the window (ori pool), the rest compressed rows
      c.gather_rows_in(kv_l1, 0, cmp ? in.cmp_kv : in.ori_kv,
                       std::span<const std::int32_t>(rows, kAttnTile), "kv_gather");
      if (t != last_t) {
        c.copy_in(q_l1, 0, in.q.row(t), "q_in");
        last_t = t;
      }
      for (int i = 0; i < 2; ++i)
        blk.vec(i).copy_in(
            vb[i].bias, 0,
            ConstView<float, 2>(ws.bias.data() + t * ws.cols + bl * kAttnTile, {1, kAttnTile}),
            "bias_in");
      // Software pipeline inside an item: QK of both head batches first (the cube computes
      // batch 1 while the vector cores run the softmax of batch 0), then the softmax of both,
      // then PV of both, then the stores.
      const index_t HB = H / kHeadBatch;
      for (index_t hb = 0; hb < HB; ++hb) {
        auto& s = s_acc[std::size_t(hb % 2)];
        // S = q[32 heads] . K^T over 4 K tiles of 128 dims.
        for (index_t kt = 0; kt < kHeadDim / kAttnTile; ++kt) {
          auto& a = qa[std::size_t(kt % 2)];
          auto& bmat = kb[std::size_t(kt % 2)];
          c.load_l0(a, q_l1, hb * kHeadBatch, kHeadBatch, kt * kAttnTile, kAttnTile, false, "q_l0");
          c.load_l0(bmat, kv_l1, 0, kAttnTile, kt * kAttnTile, kAttnTile, false, "k_l0");
          c.mmad(s, a, bmat, kHeadBatch, kAttnTile, kAttnTile, kt > 0, "qk_mmad");
        }
        for (int i = 0; i < 2; ++i) s_ring[i].push(s, i * kVecHeads, kVecHeads, "s_push");
      }
      for (index_t hb = 0; hb < HB; ++hb) {
        // Vector softmax statistics of 16 heads per AIV.
        for (int i = 0; i < 2; ++i) {
          VectorCore& v = blk.vec(i);
          VecBufs& b = vb[i];
          Tile<float> st = s_ring[i].pop();
          v.vec(
              "scale_bias", kVecHeads * kAttnTile, 4, {&st.state(), &b.bias.state()},
              {&b.s.state()},
              [&] {
                for (index_t h = 0; h < kVecHeads; ++h)
                  for (index_t k = 0; k < kAttnTile; ++k)
                    b.s(h, k) = scale * st(h, k) + b.bias(0, k);
              },
              2.0);
          s_ring[i].release();
          v.vec("rowmax", kVecHeads * kAttnTile, 4, {&b.s.state()}, {&b.ml.state()}, [&] {
            for (index_t h = 0; h < kVecHeads; ++h) {
              float mx = b.s(h, 0);
              for (index_t k = 1; k < kAttnTile; ++k) mx = std::max(mx, b.s(h, k));
              b.ml(0, h) = mx;
            }
          });
          v.vec(
              "exp", kVecHeads * kAttnTile, 4, {&b.s.state(), &b.ml.state()}, {&b.s.state()},
              [&] {
                for (index_t h = 0; h < kVecHeads; ++h)
                  for (index_t k = 0; k < kAttnTile; ++k)
                    b.s(h, k) = std::exp(b.s(h, k) - b.ml(0, h));
              },
              m.arch().vector_exp_cost_factor);
          v.vec("rowsum", kVecHeads * kAttnTile, 4, {&b.s.state()}, {&b.ml.state()}, [&] {
            for (index_t h = 0; h < kVecHeads; ++h) {
              float sum = 0;
              for (index_t k = 0; k < kAttnTile; ++k) sum += b.s(h, k);
              b.ml(1, h) = sum;
            }
          });
          v.vec("cast_p", kVecHeads * kAttnTile, 4, {&b.s.state()}, {&b.p.state()}, [&] {
            for (index_t k = 0; k < kVecHeads * kAttnTile; ++k) b.p.data()[k] = bf16(b.s.data()[k]);
          });
          p_ring[i].push(b.p, 0, kVecHeads, "p_push");
          const index_t h0 = hb * kHeadBatch + i * kVecHeads;
          v.copy_out(View<float, 2>(&ws.m.view()(t, bl, h0), {1, kVecHeads}), b.ml, 0, "m_out");
          v.copy_out(View<float, 2>(&ws.l.view()(t, bl, h0), {1, kVecHeads}), b.ml, 1, "l_out");
        }
      }
      for (index_t hb = 0; hb < HB; ++hb) {
        // O = P . K per AIV half (16 heads), N in 4 tiles of 128 dims; K^T via transposed loads.
        for (int i = 0; i < 2; ++i) {
          Tile<bf16> p1 = p_ring[i].pop();
          auto& a = pa[std::size_t(i)];
          c.load_l0(a, p1, 0, kVecHeads, 0, kAttnTile, false, "p_l0");
          p_ring[i].release();
          auto& o = o_acc[std::size_t(i)];
          for (index_t nt = 0; nt < kHeadDim / kAttnTile; ++nt) {
            auto& bmat = kb[std::size_t(nt % 2)];
            c.load_l0(bmat, kv_l1, 0, kAttnTile, nt * kAttnTile, kAttnTile, /*transpose=*/true,
                      "kT_l0");
            c.mmad(o, a, bmat, kVecHeads, kAttnTile, kAttnTile, false, "pv_mmad", nt * kAttnTile);
          }
          o_ring[i].push(o, 0, kVecHeads, "o_push");
        }
        for (int i = 0; i < 2; ++i) {
          VectorCore& v = blk.vec(i);
          Tile<float> ot = o_ring[i].pop();
          const index_t h0 = hb * kHeadBatch + i * kVecHeads;
          v.copy_out(View<float, 2>(&ws.o.view()(t, bl, h0, 0), {kVecHeads, kHeadDim}), ot, 0,
                     "o_out");
          o_ring[i].release();
        }
      }
    }
  });
}

inline void sparse_merge_norm(Machine& m, const SparseAttnInputs& in, SparseAttnWorkspace& ws,
                              const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), NB = ws.blocks, H = cfg.n_heads;
  const index_t tiles = H / kVecHeads;
  m.launch_vector("sparse_attn.merge_norm", int(T * tiles), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index / tiles, h0 = (blk.index % tiles) * kVecHeads;
    const index_t pos = in.positions(t);
    auto acc = v.alloc<float>(Space::ub, "o_acc", kVecHeads, kHeadDim);
    std::array<Tile<float>, 2> ob{v.alloc<float>(Space::ub, "o_blk[0]", kVecHeads, kHeadDim),
                                  v.alloc<float>(Space::ub, "o_blk[1]", kVecHeads, kHeadDim)};
    auto ml = v.alloc<float>(Space::ub, "m_l", 2 * NB, kVecHeads);
    auto st = v.alloc<float>(Space::ub, "m_l_run", 3, kVecHeads);
    auto sink = v.alloc<float>(Space::ub, "sink", 1, kVecHeads);
    auto rot = v.alloc<bf16>(Space::ub, "cos_sin", 2, 64);
    auto ob16 = v.alloc<bf16>(Space::ub, "o_bf16", kVecHeads, kHeadDim);
    for (index_t bl = 0; bl < NB; ++bl) {
      v.copy_in(ml, bl, ConstView<float, 2>(&ws.m.view()(t, bl, h0), {1, kVecHeads}), "m_in");
      v.copy_in(ml, NB + bl, ConstView<float, 2>(&ws.l.view()(t, bl, h0), {1, kVecHeads}), "l_in");
    }
    v.copy_in(sink, 0, ConstView<float, 2>(in.attn_sink.data() + h0, {1, kVecHeads}), "sink_in");
    v.copy_in(rot, 0, ConstView<bf16, 2>(in.rope.cos_row(pos), {1, 64}), "cos_in");
    v.copy_in(rot, 1, ConstView<bf16, 2>(in.rope.sin_row(pos), {1, 64}), "sin_in");
    bool first = true;
    int j = 0;
    for (index_t bl = 0; bl < NB; ++bl) {
      if (!ws.live.view()(t, bl)) continue;  // skipped block: (m=-3e38, l=0, o=0) vanishes
      auto& o = ob[std::size_t(j++ % 2)];
      v.copy_in(o, 0, ConstView<float, 2>(&ws.o.view()(t, bl, h0, 0), {kVecHeads, kHeadDim}),
                "o_in");
      if (first) {
        v.vec("merge_init", kVecHeads * kHeadDim, 4, {&o.state(), &ml.state()},
              {&acc.state(), &st.state()}, [&] {
                std::copy_n(o.data(), kVecHeads * kHeadDim, acc.data());
                for (index_t h = 0; h < kVecHeads; ++h) {
                  st(0, h) = ml(bl, h);
                  st(1, h) = ml(NB + bl, h);
                }
              });
        first = false;
        continue;
      }
      v.vec(
          "merge", kVecHeads * kHeadDim, 4, {&o.state(), &ml.state(), &acc.state()},
          {&acc.state(), &st.state()},
          [&] {
            for (index_t h = 0; h < kVecHeads; ++h) {
              const float mo = st(0, h), mb = ml(bl, h), mn = std::max(mo, mb);
              const float alpha = std::exp(mo - mn), gamma = std::exp(mb - mn);
              st(1, h) = alpha * st(1, h) + gamma * ml(NB + bl, h);
              st(0, h) = mn;
              for (index_t d = 0; d < kHeadDim; ++d)
                acc(h, d) = alpha * acc(h, d) + gamma * o(h, d);
            }
          },
          3.0);
    }
    v.vec(
        "sink_norm_rope_cast", kVecHeads * kHeadDim, 4,
        {&acc.state(), &st.state(), &sink.state(), &rot.state()}, {&ob16.state()},
        [&] {
          for (index_t h = 0; h < kVecHeads; ++h) {
            float* row = acc.row(h);
            if (first) {
              std::fill_n(row, kHeadDim, 0.0f);
            } else {
              const float den = st(1, h) + std::exp(sink(0, h) - st(0, h));
              for (index_t d = 0; d < kHeadDim; ++d) row[d] = row[d] / den;
            }
            const int nope = cfg.nope_dim();
            for (index_t d = 0; d < nope; ++d) ob16(h, d) = bf16(row[d]);
            rope_inverse(std::span<float>(row + nope, 64), rot.row(0), rot.row(1));
            for (index_t d = nope; d < kHeadDim; ++d) ob16(h, d) = bf16(row[d]);
          }
        },
        4.0);
    // One 512-wide store per head row into o_packed[g*T + t, hh*512 ..] (PR #831).
    for (index_t h = 0; h < kVecHeads; ++h) {
      const index_t hg = h0 + h, g = hg / cfg.heads_per_group(), hh = hg % cfg.heads_per_group();
      v.copy_out(View<bf16, 2>(&ws.o_packed.view()(g * T + t, hh * kHeadDim), {1, kHeadDim}), ob16,
                 h, "o_packed_out");
    }
  });
}

inline void sparse_oproj(Machine& m, const SparseAttnInputs& in, View<bf16, 2> out,
                         SparseAttnWorkspace& ws, const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), G = cfg.o_groups, R = cfg.o_lora, KI = cfg.o_group_in();
  const index_t D = cfg.hidden;
  constexpr index_t kPad = 16, kK = 256;
  // proj_a: per (group, 128-wide N fragment): o_r = o_packed[g] . wo_a[g]^T, K tiles of 256.
  const index_t nfr = R / 128;
  m.launch_cube("sparse_attn.proj_a", int(G * nfr), [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t g = blk.index / nfr, n0 = (blk.index % nfr) * 128;
    auto a1 = c.alloc<bf16>(Space::l1, "o_packed", kPad, KI);
    std::array<Tile<bf16>, 2> b1{c.alloc<bf16>(Space::l1, "wo_a[0]", 128, kK),
                                 c.alloc<bf16>(Space::l1, "wo_a[1]", 128, kK)};
    // L0B holds (128 x 128) BF16 = 32 KiB, double buffered: each K tile of 256 is 2 L0 steps.
    std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "a_l0[0]", kPad, 128),
                                 c.alloc<bf16>(Space::l0a, "a_l0[1]", kPad, 128)};
    std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "b_l0[0]", 128, 128),
                                 c.alloc<bf16>(Space::l0b, "b_l0[1]", 128, 128)};
    auto acc = c.alloc<float>(Space::l0c, "o_r", kPad, 128);
    c.copy_in(a1, 0, ConstView<bf16, 2>(ws.o_packed.view().slice(0, g * T, g * T + T)),
              "o_packed_in");
    int step = 0;
    for (index_t kt = 0; kt < KI / kK; ++kt) {
      const std::size_t s = std::size_t(kt % 2);
      c.copy_in(b1[s], 0, in.wo_a.row(g).slice(0, n0, n0 + 128).slice(1, kt * kK, kt * kK + kK),
                "wo_a_in");
      for (index_t h = 0; h < kK / 128; ++h, ++step) {
        const std::size_t u = std::size_t(step % 2);
        c.load_l0(a0[u], a1, 0, kPad, kt * kK + h * 128, 128, false, "a_l0");
        c.load_l0(b0[u], b1[s], 0, 128, h * 128, 128, false, "b_l0");
        c.mmad(acc, a0[u], b0[u], T, 128, 128, step > 0, "proj_a_mmad");
      }
    }
    c.copy_out(View<float, 2>(&ws.o_r.view()(0, g, n0), {T, 128}, {G * R, 1}), acc, 0, "o_r_out");
  });
  // quant: Q8 per (token, group) over O_LORA.
  m.launch_vector("sparse_attn.quant", int(T * G), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index / G, g = blk.index % G;
    auto x = v.alloc<float>(Space::ub, "o_r", 1, R);
    auto q = v.alloc<std::int8_t>(Space::ub, "a_i8", 1, R);
    auto s = v.alloc<float>(Space::ub, "a_dq", 1, 8);
    v.copy_in(x, 0, ConstView<float, 2>(&ws.o_r.view()(t, g, 0), {1, R}), "o_r_in");
    v.vec("amax", R, 4, {&x.state()}, {&s.state()}, [] {});
    v.vec(
        "quant", R, 4, {&x.state(), &s.state()}, {&q.state(), &s.state()},
        [&] {
          s(0, 0) = quantize_q8(std::span<std::int8_t>(q.data(), std::size_t(R)),
                                std::span<const float>(x.data(), std::size_t(R)));
        },
        3.0);
    v.copy_out(View<std::int8_t, 2>(&ws.a_i8.view()(t, g, 0), {1, R}), q, 0, "a_i8_out");
    v.copy_out(View<float, 2>(&ws.a_dq.view()(t, g), {1, 1}), s, 0, "a_dq_out");
  });
  // proj_b: per (group, 512-wide D chunk): INT32 partial = a_i8[g] . wo_b[n, g*R ..]^T.
  const index_t dch = D / 512;
  m.launch_cube("sparse_attn.proj_b", int(G * dch), [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t g = blk.index / dch, n0 = (blk.index % dch) * 512;
    auto a1 = c.alloc<std::int8_t>(Space::l1, "a_i8", kPad, R);
    std::array<Tile<std::int8_t>, 2> b1{c.alloc<std::int8_t>(Space::l1, "wo_b[0]", 512, kK),
                                        c.alloc<std::int8_t>(Space::l1, "wo_b[1]", 512, kK)};
    std::array<Tile<std::int8_t>, 2> a0{c.alloc<std::int8_t>(Space::l0a, "a_l0[0]", kPad, kK),
                                        c.alloc<std::int8_t>(Space::l0a, "a_l0[1]", kPad, kK)};
    std::array<Tile<std::int8_t>, 2> b0{c.alloc<std::int8_t>(Space::l0b, "b_l0[0]", 128, kK),
                                        c.alloc<std::int8_t>(Space::l0b, "b_l0[1]", 128, kK)};
    auto acc = c.alloc<std::int32_t>(Space::l0c, "partial", kPad, 512);
    c.copy_in(a1, 0,
              ConstView<std::int8_t, 2>(
                  View<std::int8_t, 2>(&ws.a_i8.view()(0, g, 0), {T, R}, {G * R, 1})),
              "a_i8_in");
    int step = 0;
    for (index_t kt = 0; kt < R / kK; ++kt) {
      const std::size_t s = std::size_t(kt % 2);
      c.copy_in(b1[s], 0,
                in.wo_b.slice(0, n0, n0 + 512).slice(1, g * R + kt * kK, g * R + kt * kK + kK),
                "wo_b_in");
      c.load_l0(a0[s], a1, 0, kPad, kt * kK, kK, false, "a_l0");
      for (index_t nc = 0; nc < 4; ++nc, ++step) {
        auto& b = b0[std::size_t(step % 2)];
        c.load_l0(b, b1[s], nc * 128, 128, 0, kK, false, "b_l0");
        c.mmad(acc, a0[s], b, T, 128, kK, kt > 0, "proj_b_mmad", nc * 128);
      }
    }
    c.copy_out(View<std::int32_t, 2>(&ws.partial.view()(0, g * D + n0), {T, 512}, {G * D, 1}), acc,
               0, "partial_out");
  });
  // proj_b_act: attn_out = bf16(wo_b_scale * sum_g a_dq[g] * partial_g), groups summed in order.
  const index_t quarters = 4, qw = D / quarters;
  m.launch_vector("sparse_attn.proj_b_act", int(T * quarters), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index / quarters, n0 = (blk.index % quarters) * qw;
    auto p = v.alloc<std::int32_t>(Space::ub, "partials", G, qw);
    auto dq = v.alloc<float>(Space::ub, "a_dq", 1, G);
    auto ws_ = v.alloc<float>(Space::ub, "wo_b_scale", 1, qw);
    auto accf = v.alloc<float>(Space::ub, "acc", 1, qw);
    auto o = v.alloc<bf16>(Space::ub, "attn_out", 1, qw);
    v.copy_in(p, 0,
              ConstView<std::int32_t, 2>(
                  View<std::int32_t, 2>(&ws.partial.view()(t, n0), {G, qw}, {D, 1})),
              "partials_in");
    v.copy_in(dq, 0, ConstView<float, 2>(&ws.a_dq.view()(t, 0), {1, G}), "a_dq_in");
    v.copy_in(ws_, 0, ConstView<float, 2>(in.wo_b_scale.data() + n0, {1, qw}), "wo_b_scale_in");
    v.vec(
        "dequant_sum", G * qw, 4, {&p.state(), &dq.state()}, {&accf.state()},
        [&] {
          for (index_t n = 0; n < qw; ++n) {
            float s = 0;
            for (index_t g = 0; g < G; ++g) s += dq(0, g) * float(p(g, n));
            accf(0, n) = s;
          }
        },
        2.0);
    v.vec("scale_cast", qw, 4, {&accf.state(), &ws_.state()}, {&o.state()}, [&] {
      for (index_t n = 0; n < qw; ++n) o(0, n) = bf16(ws_(0, n) * accf(0, n));
    });
    v.copy_out(out.slice(0, t, t + 1).slice(1, n0, n0 + qw), o, 0, "attn_out");
  });
}

}  // namespace detail

// Runs sparse attention + grouped output projection (§8) on the model; writes out (T, D) BF16.
inline KernelReport sparse_attention(Machine& m, const SparseAttnInputs& in, View<bf16, 2> out,
                                     SparseAttnWorkspace& ws, const ModelConfig& cfg) {
  detail::check_sparse_attn(in, out, ws, cfg);
  m.begin_kernel(std::string("sparse_attn_") + std::string(to_string(in.kind)));
  detail::sparse_plan(m, in, ws, cfg);
  detail::sparse_qk_pv(m, in, ws, cfg);
  detail::sparse_merge_norm(m, in, ws, cfg);
  detail::sparse_oproj(m, in, out, ws, cfg);
  return m.end_kernel();
}

}  // namespace tiledecode::a2a3
