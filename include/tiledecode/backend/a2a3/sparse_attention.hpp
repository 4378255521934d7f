#pragma once
// Sparse attention (kernels/sparse_attention.hpp) on the a2a3 model: the op set of the shared tile
// program and its schedule, after the device design of spec §8.6 (CSA `decode_sparse_attn`; the
// SWA and HCA variants run the same launches with their own column lists, spec §8.1).
//
//   plan        vector, 1 block: the column rule (rules/attention.hpp) for every (token, block) on
//               the scalar unit -> physical rows (-1 invalid), the additive bias (0 / MASK_NEG),
//               the live-block mask (block 0 always live) and the work order (live items first)
//   qk_pv       mixed, 24 blocks (= AIC count), the program's stage 1: lane c takes live items
//               c, c + 24, ... = (token, block): gather 128 KV rows into L1 (one DMA per row: a
//               sparse gather is issue-bound), then for batches of 32 heads: cube S = q·Kᵀ (K
//               tiles of 128) -> ring -> vector (16 heads per AIV) scale + bias, row max, exp, row
//               sum, bf16(P) -> ring -> cube O = P·K -> ring -> vector stores (m, l, O) of the item
//               (one block: the partial) to GM scratch
//   rope_cs     vector, 1 block (spec §8.6 item 3): per token the interleaved cos row and the
//               sign-folded sin row of the inverse rotation, to GM
//   merge_norm  vector, T x H/16 blocks, the program's stage 2: merge the live partials in block
//               order (spec §8.3), sink, 1/den, inverse RoPE, BF16, one packed 512-wide store per
//               head row (PR #831)
// Cube row tiles are padded to 16 rows by the cost model (whole fractals).
// The all-invalid block rule: such a block is skipped (device behaviour, §11.9) and ignored by the
// merge — except block 0, which the device always computes; with no valid window row it yields
// (m = MASK_NEG-ish, l = 128, O = 0), whose weight vanishes next to any valid block, and a token
// without any valid column outputs 0 as on the CPU.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/sparse_attention.hpp"

namespace tiledecode::a2a3 {

namespace sparse_attention_detail {

inline constexpr int kTile = 128;     // K columns per block
inline constexpr int kHeadDim = 512;  // head_dim
// Heads per cube QK/PV batch (spec §8.6: batches of 32 heads), and per AIV (half a batch).
constexpr int head_batch(int H) {
  return H < 32 ? H : 32;
}

// Static UB plan of the qk_pv vector side (per AIV, 16 heads): S ring, O ring, softmax buffers.
using SSlot = StaticTile<float, Space::ub, 16, kTile>;     // 8 KiB
using OSlot = StaticTile<float, Space::ub, 16, kHeadDim>;  // 32 KiB
using SWork = StaticTile<float, Space::ub, 16, kTile>;
using PTile = StaticTile<bf16, Space::ub, 16, kTile>;
static_assert(fits_v<Space::ub, Replicated<SSlot, 2>, Replicated<OSlot, 2>, SWork, PTile>);
// L1 of the cube side: q of one token (128 heads x 512 BF16, pro) + double-buffered gathered K
// (128 x 512) + the P ring slots of both AIVs.
static_assert(fits_v<Space::l1, StaticTile<bf16, Space::l1, 128, kHeadDim>,
                     Replicated<StaticTile<bf16, Space::l1, kTile, kHeadDim>, 2>,
                     Replicated<StaticTile<bf16, Space::l1, 16, kTile>, 4>>);

// GM scratch of one call.
struct Scratch {
  index_t T = 0, cols = 0, NB = 0, H = 0;
  View<std::int32_t, 2> rows;   // (T, cols) physical row per column, -1 invalid
  View<float, 2> bias;          // (T, cols) 0 / MASK_NEG
  View<std::int32_t, 2> live;   // (T, NB) 1 = block computed
  View<std::int32_t, 1> order;  // (T*NB) live items first
  View<float, 3> m, l;          // (T, NB, H)
  View<float, 4> o;             // (T, NB, H, 512)
  View<float, 3> rope;          // (T, 2, 64): interleaved cos, sign-folded sin (inverse)
  int n_live = 0;

  static std::array<std::size_t, 1> sizes(index_t T, index_t cols, index_t NB, index_t H) {
    return {GmArena::bytes<std::int32_t, 2>({T, cols}) + GmArena::bytes<float, 2>({T, cols}) +
            GmArena::bytes<std::int32_t, 2>({T, NB}) + GmArena::bytes<std::int32_t, 1>({T * NB}) +
            2 * GmArena::bytes<float, 3>({T, NB, H}) + GmArena::bytes<float, 4>({T, NB, H, 512}) +
            GmArena::bytes<float, 3>({T, 2, 64})};
  }
  Scratch(std::span<std::byte> ws, index_t tokens, index_t n_cols, index_t n_blocks, index_t heads)
      : T(tokens), cols(n_cols), NB(n_blocks), H(heads) {
    GmArena g(ws);
    rows = g.take<std::int32_t, 2>({T, cols});
    bias = g.take<float, 2>({T, cols});
    live = g.take<std::int32_t, 2>({T, NB});
    order = g.take<std::int32_t, 1>({T * NB});
    m = g.take<float, 3>({T, NB, H});
    l = g.take<float, 3>({T, NB, H});
    o = g.take<float, 4>({T, NB, H, 512});
    rope = g.take<float, 3>({T, 2, 64});
  }
};

// The column rule (rules/attention.hpp) in whole-tile vector instructions over the T x cols index
// lanes: for every (token, block) the 128 physical rows, the bias and the live flag. Vectorised:
// two compares (lens or visibility bound, sign), a select, a shift and a mask (page, row in page),
// a gather of the table entries, a multiply-add (row) and the bias select = 8 ALU instructions.
struct PlanRule {
  static constexpr std::string_view name = "build_plan";
  static constexpr int kVectorOps = 8;
  static constexpr std::size_t kElemBytes = 4;
  const kernels::SparseAttentionArgs* a;
  Tile<std::int32_t> rows;  // (T, cols)
  Tile<float> bias;         // (T, cols)
  Tile<std::int32_t> live;  // (1, T*NB)
  index_t elements() const { return rows.size(); }
  void run() const {
    const index_t T = rows.rows(), NB = a->n_blocks();
    for (index_t t = 0; t < T; ++t)
      for (int bl = 0; bl < int(NB); ++bl) {
        std::int64_t r[kTile];
        const int n = rules::attention_block_columns(a->cols, t, bl, r);
        for (int k = 0; k < kTile; ++k) {
          rows(t, bl * kTile + k) = std::int32_t(r[k]);
          bias(t, bl * kTile + k) = r[k] >= 0 ? 0.0f : kMaskNeg;
        }
        live(0, t * NB + bl) = (n > 0 || bl == 0) ? 1 : 0;  // block 0 is always computed
      }
  }
};
// Work order: live (token, block) items first, then the empty ones: 2 scalar ops per item.
struct OrderRule {
  static constexpr std::string_view name = "work_order";
  static constexpr int kScalarOps = 2;
  Tile<std::int32_t> live;   // (1, n)
  Tile<std::int32_t> order;  // (1, n)
  index_t elements() const { return live.cols(); }
  void run() const {
    index_t k = 0;
    for (int pass = 1; pass >= 0; --pass)
      for (index_t i = 0; i < live.cols(); ++i)
        if (live(0, i) == pass) order(0, k++) = std::int32_t(i);
  }
};

// Buffers of one AIV in qk_pv.
struct VecBufs {
  Tile<float> bias, s;
  std::array<Tile<float>, 2> ml;  // per head batch parity: (2, vh) = m, l
  Tile<bf16> p;
};

// One qk_pv block (1 AIC + 2 AIV) and its buffers, reused by the lane's items.
struct Lane {
  MixedBlock* blk;
  const Scratch* sc;
  int H, hb, vh;  // heads, heads per cube batch, heads per AIV
  Tile<bf16> q_l1;
  std::array<Tile<bf16>, 2> k_l1, qa, pa, kb;
  std::array<Tile<float>, 2> s_acc, o_acc;
  std::array<Ring<float>, 2> s_ring, o_ring;
  std::array<Ring<bf16>, 2> p_ring;
  VecBufs vb[2];
  index_t last_t = -1, t = 0;
  int j = 0, bl = 0;  // items done by this lane (double-buffer parity), current block
  float scale = 1.0f;

  Lane(MixedBlock& b, const Scratch& scratch, int heads)
      : blk(&b),
        sc(&scratch),
        H(heads),
        hb(head_batch(heads)),
        vh(head_batch(heads) / 2),
        q_l1(b.cube.alloc<bf16>(Space::l1, "q", heads, kHeadDim)),
        k_l1{b.cube.alloc<bf16>(Space::l1, "kv[0]", kTile, kHeadDim),
             b.cube.alloc<bf16>(Space::l1, "kv[1]", kTile, kHeadDim)},
        qa{b.cube.alloc<bf16>(Space::l0a, "q_l0[0]", hb, kTile),
           b.cube.alloc<bf16>(Space::l0a, "q_l0[1]", hb, kTile)},
        pa{b.cube.alloc<bf16>(Space::l0a, "p_l0[0]", vh, kTile),
           b.cube.alloc<bf16>(Space::l0a, "p_l0[1]", vh, kTile)},
        kb{b.cube.alloc<bf16>(Space::l0b, "k_l0[0]", kTile, kTile),
           b.cube.alloc<bf16>(Space::l0b, "k_l0[1]", kTile, kTile)},
        s_acc{b.cube.alloc<float>(Space::l0c, "s[0]", hb, kTile),
              b.cube.alloc<float>(Space::l0c, "s[1]", hb, kTile)},
        o_acc{b.cube.alloc<float>(Space::l0c, "o[0]", vh, kHeadDim),
              b.cube.alloc<float>(Space::l0c, "o[1]", vh, kHeadDim)},
        s_ring{Ring<float>(b.cube, b.vec0, "s_ring", 2, vh, kTile),
               Ring<float>(b.cube, b.vec1, "s_ring", 2, vh, kTile)},
        o_ring{Ring<float>(b.cube, b.vec0, "o_ring", 2, vh, kHeadDim),
               Ring<float>(b.cube, b.vec1, "o_ring", 2, vh, kHeadDim)},
        p_ring{Ring<bf16>(b.vec0, b.cube, "p_ring", 2, vh, kTile),
               Ring<bf16>(b.vec1, b.cube, "p_ring", 2, vh, kTile)} {
    for (int i = 0; i < 2; ++i) {
      VectorCore& v = b.vec(i);
      vb[i] = {
          v.alloc<float>(Space::ub, "bias", 1, kTile),
          v.alloc<float>(Space::ub, "s", vh, kTile),
          {v.alloc<float>(Space::ub, "m_l[0]", 2, vh), v.alloc<float>(Space::ub, "m_l[1]", 2, vh)},
          v.alloc<bf16>(Space::ub, "p", vh, kTile)};
    }
  }
};

// One merge_norm block (1 AIV): a (token, 16-head tile) of stage 2.
struct MergeLane {
  VectorCore* v;
  const Scratch* sc;
  int NB, vh;
  Tile<float> acc;                    // (vh, 512) merged O
  std::array<Tile<float>, 2> ob;      // (vh, 512) partial O, double buffered
  Tile<float> ml;                     // (2*NB, vh) m, l of every block
  Tile<float> st;                     // (2, vh) running m, l
  Tile<float> alpha, gamma, mn, tmp;  // (1, vh)
  Tile<float> sink;                   // (1, vh)
  Tile<float> rot;                    // (2, 64) interleaved cos, folded sin
  Tile<float> x, sw;                  // (vh, 64) rope half and its pair swap
  Tile<bf16> ob16;                    // (vh, 512)
  bool first = true;
  int j = 0;
  index_t t = 0;
  int h0 = 0;
  MergeLane(VectorCore& core, const Scratch& scratch, int n_blocks, int heads)
      : v(&core),
        sc(&scratch),
        NB(n_blocks),
        vh(heads),
        acc(core.alloc<float>(Space::ub, "o_acc", heads, kHeadDim)),
        ob{core.alloc<float>(Space::ub, "o_blk[0]", heads, kHeadDim),
           core.alloc<float>(Space::ub, "o_blk[1]", heads, kHeadDim)},
        ml(core.alloc<float>(Space::ub, "m_l", 2 * n_blocks, heads)),
        st(core.alloc<float>(Space::ub, "m_l_run", 2, heads)),
        alpha(core.alloc<float>(Space::ub, "alpha", 1, heads)),
        gamma(core.alloc<float>(Space::ub, "gamma", 1, heads)),
        mn(core.alloc<float>(Space::ub, "m_new", 1, heads)),
        tmp(core.alloc<float>(Space::ub, "tmp", 1, heads)),
        sink(core.alloc<float>(Space::ub, "sink", 1, heads)),
        rot(core.alloc<float>(Space::ub, "cos_sin", 2, 64)),
        x(core.alloc<float>(Space::ub, "rope_x", heads, 64)),
        sw(core.alloc<float>(Space::ub, "rope_swap", heads, 64)),
        ob16(core.alloc<bf16>(Space::ub, "o_bf16", heads, kHeadDim)) {}
};

struct Schedule {
  A2a3 be;
  const kernels::SparseAttentionArgs* a;
  Scratch sc;

  // Stage 1: qk_pv over the live (token, block) items.
  template <class Body>
  void for_items(Body&& body) {
    const int lanes = std::min(be.arch().cube_cores, std::max(sc.n_live, 1));
    const int H = a->cfg->n_heads;
    be.m->launch_mixed("sparse_attn.qk_pv", lanes, [&](MixedBlock& blk) {
      Lane lane(blk, sc, H);
      for (index_t it = blk.index; it < sc.n_live; it += lanes, ++lane.j) {
        const index_t item = sc.order(it), t = item / sc.NB;
        const int bl = int(item % sc.NB);
        body(lane, kernels::AttentionItem{t, 0, H, bl, bl + 1});
      }
    });
  }
  // Stage 2: rope_cs, then merge_norm over (token, 16-head tile).
  template <class Body>
  void for_partials(Body&& body) {
    rope_cs();
    const index_t T = sc.T;
    const int H = a->cfg->n_heads, vh = head_batch(H) / 2, tiles = H / vh, NB = int(sc.NB);
    be.m->launch_vector("sparse_attn.merge_norm", int(T * tiles), [&](VectorBlock& blk) {
      MergeLane lane(blk.vec, sc, NB, vh);
      body(lane, kernels::AttentionItem{blk.index / tiles, (blk.index % tiles) * vh, vh, 0, NB});
    });
  }
  // The head-invariant rotation rows of the inverse RoPE per token (spec §8.6 item 3):
  // cos_i[j] = c[j/2], sin_f[j] = (+s, -s)[j%2] * s[j/2], so that
  // rope_inv(x)[j] = x[j] * cos_i[j] + x[j^1] * sin_f[j].
  void rope_cs() {
    const index_t T = sc.T;
    be.m->launch_vector("sparse_attn.rope_cs", 1, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      auto cs = v.alloc<bf16>(Space::ub, "cos_sin_bf16", 2 * T, 32);
      auto h = v.alloc<float>(Space::ub, "cos_sin_half", 2 * T, 32);
      auto w = v.alloc<float>(Space::ub, "cos_sin", 2 * T, 64);
      for (index_t t = 0; t < T; ++t) {
        const index_t p = a->cols.positions(t);
        v.copy_in(cs, 2 * t, ConstView<bf16, 2>(a->rope.cos_row(p), {1, 32}), "cos_in");
        v.copy_in(cs, 2 * t + 1, ConstView<bf16, 2>(a->rope.sin_row(p), {1, 32}), "sin_in");
      }
      v.vcast(Sub<float>(h), Sub<bf16>(cs), "cast_f32");
      v.vdup_pairs(Sub<float>(w), Sub<float>(h), "interleave");
      for (index_t t = 0; t < T; ++t)
        v.vsign_pairs(rows_of(w, 2 * t + 1, 1), rows_of(w, 2 * t + 1, 1), 1.0f, -1.0f, "fold_sign");
      v.copy_out(View<float, 2>(sc.rope.data(), {2 * T, 64}), w, 0, "cos_sin_out");
    });
  }
};

}  // namespace sparse_attention_detail

struct backend_ops_sparse_attention {
  using Lane = sparse_attention_detail::Lane;
  using MergeLane = sparse_attention_detail::MergeLane;
  using Scratch = sparse_attention_detail::Scratch;
  static constexpr bool split_blocks = true;
  static constexpr int kTile = sparse_attention_detail::kTile;
  static constexpr int kHeadDim = sparse_attention_detail::kHeadDim;

  // What this schedule supports (a test table asks before running; check() throws the same).
  static const char* unsupported(const ModelConfig& cfg) {
    const int hb = sparse_attention_detail::head_batch(cfg.n_heads);
    if (cfg.head_dim != kHeadDim) return "head_dim != 512";
    if (cfg.n_heads % hb != 0 || hb % 2 != 0 || cfg.n_heads > 128)
      return "n_heads not a multiple of the 32-head cube batch (or even and < 32), or > 128";
    return nullptr;
  }
  static std::size_t workspace_bytes(const A2a3&, const ModelConfig& cfg, LayerKind kind,
                                     index_t T) {
    const index_t cols = cfg.attn_cols(kind), NB = cols / kTile;
    return Scratch::sizes(T, cols, NB, cfg.n_heads)[0];
  }
  static void check(const A2a3& be, const kernels::SparseAttentionArgs& a,
                    std::span<const std::byte> ws) {
    if (const char* why = unsupported(*a.cfg))
      throw_arg("a2a3 sparse_attention", "cfg", std::string(a.cfg->name), why);
    const std::size_t need = workspace_bytes(be, *a.cfg, a.kind, a.tokens());
    if (ws.size() < need)
      throw_arg("a2a3 sparse_attention", "workspace.size()", ws.size(),
                ">= " + std::to_string(need) + " (sparse_attention_workspace_bytes)");
  }

  // The plan launch, then the schedule of both stages.
  static sparse_attention_detail::Schedule schedule(const A2a3& be,
                                                    const kernels::SparseAttentionArgs& a,
                                                    std::span<std::byte> workspace) {
    const index_t T = a.tokens(), NB = a.n_blocks(), cols = NB * kTile;
    sparse_attention_detail::Schedule s{be, &a, Scratch(workspace, T, cols, NB, a.cfg->n_heads)};
    Scratch& sc = s.sc;
    be.m->launch_vector("sparse_attn.plan", 1, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      auto widx = v.alloc<std::int32_t>(Space::ub, "window_idx", T, a.cfg->window);
      auto rows = v.alloc<std::int32_t>(Space::ub, "rows", T, cols);
      auto bias = v.alloc<float>(Space::ub, "bias", T, cols);
      auto live = v.alloc<std::int32_t>(Space::ub, "live", 1, T * NB);
      auto order = v.alloc<std::int32_t>(Space::ub, "order", 1, T * NB);
      v.copy_in(widx, 0, a.cols.window_idx, "window_idx_in");
      Tile<std::int32_t> tk;
      if (a.kind == LayerKind::csa) {
        tk = v.alloc<std::int32_t>(Space::ub, "topk", T, a.cfg->idx_topk);
        v.copy_in(tk, 0, a.cols.topk.slice(1, 0, a.cfg->idx_topk), "topk_in");
      }
      v.vector_rule(sparse_attention_detail::PlanRule{&a, rows, bias, live},
                    {&widx.state(), tk.data() ? &tk.state() : &widx.state()},
                    {&rows.state(), &bias.state(), &live.state()});
      v.scalar_rule(sparse_attention_detail::OrderRule{live, order}, {&live.state()},
                    {&order.state()});
      v.copy_out(sc.rows, rows, 0, "rows_out");
      v.copy_out(sc.bias, bias, 0, "bias_out");
      v.copy_out(View<std::int32_t, 2>(sc.live.data(), {1, T * NB}), live, 0, "live_out");
      v.copy_out(View<std::int32_t, 2>(sc.order.data(), {1, T * NB}), order, 0, "order_out");
    });
    for (index_t i = 0; i < T * NB; ++i) sc.n_live += sc.live.data()[i];
    return s;
  }

  // ---- stage 1 (qk_pv), one (token, block) item on a lane
  static void load_queries(Lane& z, const kernels::SparseAttentionArgs& a,
                           const kernels::AttentionItem& it) {
    z.t = it.t;
    if (it.t != z.last_t) {
      z.blk->cube.copy_in(z.q_l1, 0, a.q.row(it.t), "q_in");
      z.last_t = it.t;
    }
  }
  static void begin_item(Lane&, const kernels::AttentionItem&) {}
  // Items are live blocks (the plan's order), so every item computes its block.
  static int block_rows(Lane& z, const kernels::SparseAttentionArgs&, const kernels::AttentionItem&,
                        int beta) {
    z.bl = beta;
    return 1;
  }
  // The block's 128 rows into L1 (one DMA per valid row, zero rows for invalid columns) and its
  // bias into both AIVs.
  static void gather_kv(Lane& z, const kernels::SparseAttentionArgs& a, int beta) {
    const std::int32_t* rows = &z.sc->rows(z.t, index_t(beta) * kTile);
    z.blk->cube.gather_rows_in(z.k_l1[std::size_t(z.j % 2)], 0, beta == 0 ? a.kv_cache : a.cmp_kv,
                               std::span<const std::int32_t>(rows, kTile), "kv_gather");
    for (int i = 0; i < 2; ++i)
      z.blk->vec(i).copy_in(
          z.vb[i].bias, 0, ConstView<float, 2>(&z.sc->bias(z.t, index_t(beta) * kTile), {1, kTile}),
          "bias_in");
  }
  // S = q·Kᵀ per batch of hb heads over 4 K tiles of 128 dims; each AIV receives its half.
  static void scores(Lane& z, const kernels::AttentionItem&, float scale) {
    z.scale = scale;
    CubeCore& c = z.blk->cube;
    const auto& kv = z.k_l1[std::size_t(z.j % 2)];
    for (int hb = 0; hb < z.H / z.hb; ++hb) {
      auto& s = z.s_acc[std::size_t(hb % 2)];
      for (index_t kt = 0; kt < kHeadDim / kTile; ++kt) {
        auto& qa = z.qa[std::size_t(kt % 2)];
        auto& kb = z.kb[std::size_t(kt % 2)];
        c.load_l0(qa, z.q_l1, hb * z.hb, z.hb, kt * kTile, kTile, false, "q_l0");
        c.load_l0(kb, kv, 0, kTile, kt * kTile, kTile, false, "k_l0");
        c.mmad(s, qa, kb, z.hb, kTile, kTile, kt > 0, "qk_mmad");
      }
      for (int i = 0; i < 2; ++i) z.s_ring[std::size_t(i)].push(s, i * z.vh, z.vh, "s_push");
    }
  }
  // Per AIV and head batch: s·scale + bias, m = row max, e = exp(s - m), l = row sum, P = bf16(e)
  // -> the P ring; m and l to the item's partial in GM.
  static void block_softmax(Lane& z, const kernels::AttentionItem& it) {
    (void)it;
    for (int hb = 0; hb < z.H / z.hb; ++hb)
      for (int i = 0; i < 2; ++i) {
        VectorCore& v = z.blk->vec(i);
        sparse_attention_detail::VecBufs& b = z.vb[i];
        const auto& ml = b.ml[std::size_t(hb % 2)];
        Tile<float> st = z.s_ring[std::size_t(i)].pop();
        v.vmuls(b.s, st, z.scale, "scale");
        z.s_ring[std::size_t(i)].release();
        v.vadd_cols(b.s, b.s, b.bias, "bias");
        v.vrow_max(rows_of(ml, 0, 1), b.s, "row_max");
        v.vsub_rows(b.s, b.s, rows_of(ml, 0, 1), "sub_max");
        v.vexp(b.s, b.s, "exp");
        v.vrow_sum(rows_of(ml, 1, 1), b.s, "row_sum");
        v.vcast(Sub<bf16>(b.p), Sub<float>(b.s), "cast_p");
        z.p_ring[std::size_t(i)].push(b.p, 0, z.vh, "p_push");
        const index_t h0 = index_t(hb) * z.hb + index_t(i) * z.vh;
        v.copy_out(View<float, 2>(&z.sc->m(z.t, z.bl, h0), {1, z.vh}), ml, 0, "m_out");
        v.copy_out(View<float, 2>(&z.sc->l(z.t, z.bl, h0), {1, z.vh}), ml, 1, "l_out");
      }
  }
  // O = P·K per AIV half (vh heads), N in 4 tiles of 128 dims; Kᵀ via transposed loads.
  static void merge_block(Lane& z, const kernels::AttentionItem&) {
    CubeCore& c = z.blk->cube;
    const auto& kv = z.k_l1[std::size_t(z.j % 2)];
    for (int hb = 0; hb < z.H / z.hb; ++hb)
      for (int i = 0; i < 2; ++i) {
        Tile<bf16> p1 = z.p_ring[std::size_t(i)].pop();
        auto& pa = z.pa[std::size_t(i)];
        c.load_l0(pa, p1, 0, z.vh, 0, kTile, false, "p_l0");
        z.p_ring[std::size_t(i)].release();
        auto& o = z.o_acc[std::size_t(i)];
        for (index_t nt = 0; nt < kHeadDim / kTile; ++nt) {
          auto& kb = z.kb[std::size_t(nt % 2)];
          c.load_l0(kb, kv, 0, kTile, nt * kTile, kTile, /*transpose=*/true, "kT_l0");
          c.mmad(o, pa, kb, z.vh, kTile, kTile, false, "pv_mmad", nt * kTile);
        }
        z.o_ring[std::size_t(i)].push(o, 0, z.vh, "o_push");
      }
  }
  static void store_partial(Lane& z, const kernels::SparseAttentionArgs&,
                            const kernels::AttentionItem&) {
    for (int hb = 0; hb < z.H / z.hb; ++hb)
      for (int i = 0; i < 2; ++i) {
        VectorCore& v = z.blk->vec(i);
        Tile<float> ot = z.o_ring[std::size_t(i)].pop();
        const index_t h0 = index_t(hb) * z.hb + index_t(i) * z.vh;
        v.copy_out(View<float, 2>(&z.sc->o(z.t, z.bl, h0, 0), {z.vh, kHeadDim}), ot, 0, "o_out");
        z.o_ring[std::size_t(i)].release();
      }
  }

  // ---- stage 2 (merge_norm), one (token, head tile) per block
  static void begin_item(MergeLane& z, const kernels::AttentionItem& it) {
    VectorCore& v = *z.v;
    z.t = it.t;
    z.h0 = it.h0;
    for (int bl = 0; bl < z.NB; ++bl) {
      v.copy_in(z.ml, bl, ConstView<float, 2>(&z.sc->m(it.t, bl, it.h0), {1, it.nh}), "m_in");
      v.copy_in(z.ml, z.NB + bl, ConstView<float, 2>(&z.sc->l(it.t, bl, it.h0), {1, it.nh}),
                "l_in");
    }
  }
  // Online merge of block beta's partial (spec §8.3); skipped blocks contribute nothing.
  static void merge_partial(MergeLane& z, const kernels::SparseAttentionArgs&,
                            const kernels::AttentionItem& it, int beta) {
    if (!z.sc->live(it.t, beta)) return;
    VectorCore& v = *z.v;
    auto& o = z.ob[std::size_t(z.j++ % 2)];
    v.copy_in(o, 0, ConstView<float, 2>(&z.sc->o(it.t, beta, it.h0, 0), {it.nh, kHeadDim}), "o_in");
    const Sub<float> mb = rows_of(z.ml, beta, 1), lb = rows_of(z.ml, z.NB + beta, 1);
    const Sub<float> m = rows_of(z.st, 0, 1), l = rows_of(z.st, 1, 1);
    if (z.first) {
      v.vcopy(Sub<float>(z.acc), Sub<float>(o), "merge_init");
      v.vcopy(m, mb, "m_init");
      v.vcopy(l, lb, "l_init");
      z.first = false;
      return;
    }
    v.vmax(z.mn, m, mb, "m_new");
    v.vsub(z.alpha, m, z.mn, "m_old");
    v.vexp(z.alpha, z.alpha, "alpha");
    v.vsub(z.gamma, mb, z.mn, "m_blk");
    v.vexp(z.gamma, z.gamma, "gamma");
    v.vmul(l, l, z.alpha, "l_scale");
    v.vmul(z.tmp, lb, z.gamma, "l_blk");
    v.vadd(l, l, z.tmp, "l_merge");
    v.vcopy(m, Sub<float>(z.mn), "m_merge");
    v.vmul_rows(z.acc, z.acc, z.alpha, "o_scale");
    v.vaxpy_rows(z.acc, o, z.gamma, "o_merge");
  }
  // den = l + exp(sink - m); out = O / den; nope -> BF16; rope half inverse-rotated -> BF16; one
  // 512-wide store per head row into o_packed[g*T + t, hh*512 ..] (PR #831).
  static void finish(MergeLane& z, const kernels::SparseAttentionArgs& a,
                     const kernels::AttentionItem& it) {
    VectorCore& v = *z.v;
    const ModelConfig& cfg = *a.cfg;
    const index_t T = a.tokens();
    const int nope = cfg.nope_dim();
    v.copy_in(z.sink, 0, ConstView<float, 2>(a.attn_sink.data() + it.h0, {1, it.nh}), "sink_in");
    v.copy_in(z.rot, 0, ConstView<float, 2>(&z.sc->rope(it.t, 0, 0), {2, 64}), "cos_sin_in");
    if (z.first) {
      v.vdup(Sub<float>(z.acc), 0.0f, "zero_out");
    } else {
      const Sub<float> m = rows_of(z.st, 0, 1), l = rows_of(z.st, 1, 1);
      v.vsub(z.alpha, z.sink, m, "sink_sub");
      v.vexp(z.alpha, z.alpha, "sink_exp");
      v.vadd(z.alpha, z.alpha, l, "den");
      v.vdiv_rows(z.acc, z.acc, z.alpha, "normalise");
    }
    const Sub<float> rope = part(z.acc, 0, it.nh, nope, 64);
    v.vcopy(Sub<float>(z.x), rope, "rope_x");
    v.vswap_pairs(z.sw, z.x, "rope_swap");
    v.vmul_cols(z.x, z.x, rows_of(z.rot, 0, 1), "rope_cos");
    v.vmul_cols(z.sw, z.sw, rows_of(z.rot, 1, 1), "rope_sin");
    v.vadd(rope, z.x, z.sw, "rope_add");
    v.vcast(Sub<bf16>(z.ob16), Sub<float>(z.acc), "cast_bf16");
    const int hpg = cfg.heads_per_group();
    for (int h = 0; h < it.nh; ++h) {
      const index_t hg = it.h0 + h, g = hg / hpg, hh = hg % hpg;
      v.copy_out(View<bf16, 2>(&a.o_packed(g * T + it.t, hh * kHeadDim), {1, kHeadDim}), z.ob16, h,
                 "o_packed_out");
    }
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::SparseAttention, a2a3::A2a3> : a2a3::backend_ops_sparse_attention {};
}  // namespace tiledecode
