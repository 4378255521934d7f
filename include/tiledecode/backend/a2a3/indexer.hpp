#pragma once
// The lightning indexer (kernels/indexer.hpp) on the a2a3 model, after the device design of
// spec §7.4 — every stage a launch whose tile program computes the result with the machine's
// instructions and is timed by the cost model:
//   query    qr_proj      cube,   8 blocks: qr (T, 1024) . idx_wq_b (1024, 8192) -> INT32 GM
//                         (N tiled 1024 per block, K in 4 tiles of 256, T padded to 16 rows)
//            qr_rope      vector, T blocks: dequant (x qr_scale x column scale), forward RoPE of
//                         dims 64..127 at rope_pos, BF16 -> GM (T*64, 128)
//            qr_hadamard  cube,   T blocks of 64 rows: BF16 . Hadamard -> FP32 GM (T*64, 128)
//            qr_quant     vector, T blocks: Q8 per (token, head) row -> q_i8, q_sc
//   weights  weights_mm   cube,   4 blocks: split-K partials x_n . weights_proj (4 slices of D/4)
//            weights_red  vector, 1 block: the 4 partials summed in order x index_weights_scale
//   score    fused        mixed,  T*2 blocks (token u/2, lane u%2 walks pages u%2, u%2+2, ...):
//                         cube k_page (128x128) . q (64x128)^T -> INT32 (128, 64) -> 2-slot ring
//                         -> vector epilogue (pages alternate between the block's 2 AIVs),
//                         2-deep software pipeline (cube page i+1 overlaps vector page i)
//            two_scope    cube T*2 blocks write INT32 GM scratch (T*4096, 64); vector T*4 blocks
//                         (NSPLIT=4) read it back and run the same epilogue (the program's page
//                         loop runs once per scope)
//   top-k    topk         vector, T blocks: pairs (masked past vis_t and NaN), Sort32 runs, 4-way
//                         merge passes to two sorted halves, the top-k merge of the two halves
// Intermediates live in the machine's GM scratch (Machine::gm_scratch).
// Score tail [AMBIGUOUS §7.4 / §11.4]: every column >= vis_t is written NEG_BIG (the vector cores
// of each lane fill the tail pages they own), so the output is fully defined.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/backend/a2a3/tile_ops.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/indexer.hpp"

namespace tiledecode::a2a3 {

inline constexpr int kIdxPage = 128;       // REDUCE_TILE = one cache page
inline constexpr int kIdxHeads = 64;       // indexer heads
inline constexpr int kIdxDim = 128;        // indexer head dim
inline constexpr int kFusedNSplit = 2;     // REDUCE_NSPLIT of the fused scope
inline constexpr int kTwoScopeNSplit = 4;  // NSPLIT of the earlier score_reduce scope
inline constexpr int kCubeRowPad = 16;     // cube fractal rows: T is padded to 16

// --- static buffer plan of the fused score scope (compile-time capacity checks) ---
using IdxRingSlot = StaticTile<std::int32_t, Space::ub, kIdxPage, kIdxHeads>;  // 32 KiB
using IdxEpilogue = StaticTile<float, Space::ub, kIdxPage, kIdxHeads>;         // FP32 epilogue
using IdxVecSmall = StaticTile<float, Space::ub, 8, kIdxPage>;  // q scale, w, k scale x2, out x2
template <int Slots>
inline constexpr bool idx_score_ub_fits_v =
    fits_v<Space::ub, Replicated<IdxRingSlot, Slots>, IdxEpilogue, IdxVecSmall>;
// PR #831: the default 8-slot ring does not fit beside the epilogue; 2 slots do.
inline constexpr int kIdxRingSlots = 2;
static_assert(idx_score_ub_fits_v<kIdxRingSlots>, "fused score UB plan must fit");
static_assert(!idx_score_ub_fits_v<8>, "an 8-slot ring of 32 KiB cannot fit beside the epilogue");

using IdxL1Plan =
    Replicated<StaticTile<std::int8_t, Space::l1, kIdxPage, kIdxDim>, 3>;  // q + 2 pages
static_assert(fits_v<Space::l1, IdxL1Plan>);
static_assert(
    fits_v<Space::l0c, Replicated<StaticTile<std::int32_t, Space::l0c, kIdxPage, kIdxHeads>, 2>>);

namespace indexer_detail {
inline const char* unsupported(const ModelConfig& cfg) {
  if (cfg.idx_n_heads != kIdxHeads || cfg.idx_head_dim != kIdxDim)
    return "indexer schedule tiles are 64 heads of 128";
  if (cfg.q_lora % 256 != 0) return "q_lora not a multiple of 256";
  if (cfg.hidden % 1024 != 0) return "hidden not a multiple of 1024 (4 K-splits of 256)";
  return nullptr;
}
inline void check_supported(std::string_view where, const ModelConfig& cfg) {
  if (const char* why = unsupported(cfg)) throw_arg(where, "cfg", std::string(cfg.name), why);
}
}  // namespace indexer_detail

// ---------------------------------------------------------------------------------------------
// indexer_query

struct backend_ops_indexer_query {
  static void check(const A2a3&, const kernels::IndexerQueryArgs& a) {
    indexer_detail::check_supported("a2a3 indexer_query", *a.cfg);
    check_range<index_t>("a2a3 indexer_query", "qr.extent(0)", a.tokens(), 0, kCubeRowPad + 1);
  }
  struct Scratch {
    View<std::int32_t, 2> acc;  // (T, 8192)
    View<bf16, 2> qi_bf;        // (T*64, 128)
    View<float, 2> qh;          // (T*64, 128)
  };
  static Scratch scratch(const A2a3& be, const kernels::IndexerQueryArgs& a) {
    const index_t T = a.tokens(), N = index_t(kIdxHeads) * kIdxDim;
    const std::size_t bytes = GmArena::bytes<std::int32_t, 2>({T, N}) +
                              GmArena::bytes<bf16, 2>({T * kIdxHeads, kIdxDim}) +
                              GmArena::bytes<float, 2>({T * kIdxHeads, kIdxDim});
    GmArena g(be.m->gm_scratch(bytes));
    Scratch s;
    s.acc = g.take<std::int32_t, 2>({T, N});
    s.qi_bf = g.take<bf16, 2>({T * kIdxHeads, kIdxDim});
    s.qh = g.take<float, 2>({T * kIdxHeads, kIdxDim});
    return s;
  }
  // qr_proj: acc = qr · idx_wq_b (cube, N tiled 1024 per block, K tiles of 256).
  static void project(const A2a3& be, const kernels::IndexerQueryArgs& a) {
    const index_t T = a.tokens(), N = index_t(kIdxHeads) * kIdxDim, K = a.cfg->q_lora;
    const Scratch ws = scratch(be, a);
    const ConstView<std::int8_t, 2> wq_b = a.wq->wq_b_view;
    be.m->launch_cube("indexer.qr_proj", int((N + 1023) / 1024), [&](CubeBlock& blk) {
      CubeCore& c = blk.cube;
      const index_t n0 = index_t(blk.index) * 1024;
      auto a_l1 = c.alloc<std::int8_t>(Space::l1, "qr", kCubeRowPad, K);
      std::array<Tile<std::int8_t>, 2> w_l1{c.alloc<std::int8_t>(Space::l1, "wq_b[0]", 256, 512),
                                            c.alloc<std::int8_t>(Space::l1, "wq_b[1]", 256, 512)};
      std::array<Tile<std::int8_t>, 2> a_l0{
          c.alloc<std::int8_t>(Space::l0a, "qr_l0[0]", kCubeRowPad, 256),
          c.alloc<std::int8_t>(Space::l0a, "qr_l0[1]", kCubeRowPad, 256)};
      std::array<Tile<std::int8_t>, 2> b_l0{c.alloc<std::int8_t>(Space::l0b, "w_l0[0]", 128, 256),
                                            c.alloc<std::int8_t>(Space::l0b, "w_l0[1]", 128, 256)};
      std::array<Tile<std::int32_t>, 2> acc{
          c.alloc<std::int32_t>(Space::l0c, "acc[0]", kCubeRowPad, 512),
          c.alloc<std::int32_t>(Space::l0c, "acc[1]", kCubeRowPad, 512)};
      c.copy_in(a_l1, 0, a.qr, "qr_in");
      int step = 0;
      for (index_t half = 0; half < 2; ++half) {
        const index_t nh = n0 + half * 512;
        auto& cacc = acc[std::size_t(half)];
        for (index_t kt = 0; kt < K / 256; ++kt, ++step) {
          auto& wl1 = w_l1[std::size_t(step % 2)];
          c.copy_in(wl1, 0, wq_b.slice(0, kt * 256, kt * 256 + 256).slice(1, nh, nh + 512),
                    "wq_b_in");
          auto& al0 = a_l0[std::size_t(step % 2)];
          c.load_l0(al0, a_l1, 0, kCubeRowPad, kt * 256, 256, false, "qr_l0");
          for (index_t nc = 0; nc < 4; ++nc) {
            auto& bl0 = b_l0[std::size_t(nc % 2)];
            c.load_l0(bl0, wl1, 0, 256, nc * 128, 128, /*transpose=*/true, "w_l0");
            c.mmad(cacc, al0, bl0, T, 128, 256, kt > 0, "qr_mmad", nc * 128);
          }
        }
        c.copy_out(ws.acc.slice(1, nh, nh + 512), cacc, 0, "qi_out");
      }
    });
  }
  // qr_rope, qr_hadamard, qr_quant.
  static void epilogue(const A2a3& be, const kernels::IndexerQueryArgs& a) {
    const index_t T = a.tokens(), N = index_t(kIdxHeads) * kIdxDim;
    const Scratch ws = scratch(be, a);
    be.m->launch_vector("indexer.qr_rope", int(T), [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      const index_t t = blk.index;
      auto acc = v.alloc<std::int32_t>(Space::ub, "qi_acc", kIdxHeads, kIdxDim);
      auto cs = v.alloc<float>(Space::ub, "col_scale", kIdxHeads, kIdxDim);
      auto f = v.alloc<float>(Space::ub, "qi_f32", kIdxHeads, kIdxDim);
      auto qs = v.alloc<float>(Space::ub, "qr_scale", 1, 1);
      auto rot = v.alloc<float>(Space::ub, "cos_sin", 2, 64);
      auto half = v.alloc<float>(Space::ub, "cos_sin_half", 2, 32);
      auto rb = v.alloc<bf16>(Space::ub, "cos_sin_bf16", 2, 32);
      auto tmp = v.alloc<float>(Space::ub, "rope_tmp", kIdxHeads, 64);
      auto o = v.alloc<bf16>(Space::ub, "qi_bf", kIdxHeads, kIdxDim);
      v.copy_in(acc, 0, ConstView<std::int32_t, 2>(ws.acc.data() + t * N, {kIdxHeads, kIdxDim}),
                "qi_acc_in");
      v.copy_in(cs, 0, ConstView<float, 2>(a.wq->wq_b_scale_view.data(), {kIdxHeads, kIdxDim}),
                "wscale_in");
      v.copy_in(qs, 0, ConstView<float, 2>(a.qr_scale.data() + t, {1, 1}), "qr_scale_in");
      rope_rows(v, rot, half, rb, a.rope, a.rope_pos(t), false);
      v.vcast(Sub<float>(f), Sub<std::int32_t>(acc), "cast_f32");
      v.vmul_scalar(f, f, qs, "mul_qr_scale");
      v.vmul(f, f, cs, "mul_col_scale");
      rope_rotate(v, part(f, 0, kIdxHeads, 64, 64), tmp, rot);
      v.vcast(Sub<bf16>(o), Sub<float>(f), "cast_bf16");
      v.copy_out(ws.qi_bf.slice(0, t * kIdxHeads, (t + 1) * kIdxHeads), o, 0, "qi_bf_out");
    });
    be.m->launch_cube("indexer.qr_hadamard", int(T), [&](CubeBlock& blk) {
      CubeCore& c = blk.cube;
      const index_t r0 = index_t(blk.index) * kIdxHeads;
      auto a1 = c.alloc<bf16>(Space::l1, "qi", kIdxHeads, kIdxDim);
      auto h1 = c.alloc<bf16>(Space::l1, "hadamard", kIdxDim, kIdxDim);
      auto a0 = c.alloc<bf16>(Space::l0a, "qi_l0", kIdxHeads, kIdxDim);
      auto b0 = c.alloc<bf16>(Space::l0b, "hadamard_l0", kIdxDim, kIdxDim);
      auto acc = c.alloc<float>(Space::l0c, "qh", kIdxHeads, kIdxDim);
      c.copy_in(a1, 0, ConstView<bf16, 2>(ws.qi_bf.slice(0, r0, r0 + kIdxHeads)), "qi_in");
      c.copy_in(h1, 0, a.wq->hadamard_view, "hadamard_in");
      c.load_l0(a0, a1, 0, kIdxHeads, 0, kIdxDim, false, "qi_l0");
      c.load_l0(b0, h1, 0, kIdxDim, 0, kIdxDim, /*transpose=*/true, "hadamard_l0");
      c.mmad(acc, a0, b0, kIdxHeads, kIdxDim, kIdxDim, false, "hadamard_mmad");
      c.copy_out(ws.qh.slice(0, r0, r0 + kIdxHeads), acc, 0, "qh_out");
    });
    be.m->launch_vector("indexer.qr_quant", int(T), [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      const index_t t = blk.index, r0 = t * kIdxHeads;
      auto x = v.alloc<float>(Space::ub, "qh", kIdxHeads, kIdxDim);
      auto ab = v.alloc<float>(Space::ub, "abs", kIdxHeads, kIdxDim);
      auto q = v.alloc<std::int8_t>(Space::ub, "q_i8", kIdxHeads, kIdxDim);
      auto sq = v.alloc<float>(Space::ub, "q_scale", 1, kIdxHeads);
      auto dq = v.alloc<float>(Space::ub, "q_sc", 1, kIdxHeads);
      v.copy_in(x, 0, ConstView<float, 2>(ws.qh.slice(0, r0, r0 + kIdxHeads)), "qh_in");
      quantize_rows(v, x, ab, q, sq, dq);
      v.copy_out(a.q_i8.row(t), q, 0, "q_i8_out");
      v.copy_out(a.q_sc.slice(0, t, t + 1), dq, 0, "q_sc_out");
    });
  }
};

// ---------------------------------------------------------------------------------------------
// indexer_weights: split-K over 4 slices of D/4 on the cube, then a vector reduce + scale.

struct backend_ops_indexer_weights {
  static void weights(const A2a3& be, const kernels::IndexerWeightsArgs& a) {
    indexer_detail::check_supported("a2a3 indexer_weights", *a.cfg);
    check_range<index_t>("a2a3 indexer_weights", "x_n.extent(0)", a.tokens(), 0, kCubeRowPad + 1);
    const index_t T = a.tokens(), D = a.cfg->hidden, ks = D / 4;
    GmArena g(be.m->gm_scratch(GmArena::bytes<float, 3>({4, T, kIdxHeads})));
    const View<float, 3> part_gm = g.take<float, 3>({4, T, kIdxHeads});
    be.m->launch_cube("indexer.weights_mm", 4, [&](CubeBlock& blk) {
      CubeCore& c = blk.cube;
      const index_t k0 = index_t(blk.index) * ks;
      auto x1 = c.alloc<bf16>(Space::l1, "x_n", kCubeRowPad, ks);
      auto w1 = c.alloc<bf16>(Space::l1, "weights_proj", ks, kIdxHeads);
      std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "x_l0[0]", kCubeRowPad, 256),
                                   c.alloc<bf16>(Space::l0a, "x_l0[1]", kCubeRowPad, 256)};
      std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "wp_l0[0]", kIdxHeads, 256),
                                   c.alloc<bf16>(Space::l0b, "wp_l0[1]", kIdxHeads, 256)};
      auto acc = c.alloc<float>(Space::l0c, "w_part", kCubeRowPad, kIdxHeads);
      c.copy_in(x1, 0, a.x_n.slice(1, k0, k0 + ks), "x_n_in");
      c.copy_in(w1, 0, a.weights_proj.slice(0, k0, k0 + ks), "weights_proj_in");
      for (index_t kt = 0; kt < ks / 256; ++kt) {
        c.load_l0(a0[std::size_t(kt % 2)], x1, 0, kCubeRowPad, kt * 256, 256, false, "x_l0");
        c.load_l0(b0[std::size_t(kt % 2)], w1, kt * 256, 256, 0, kIdxHeads, true, "wp_l0");
        c.mmad(acc, a0[std::size_t(kt % 2)], b0[std::size_t(kt % 2)], T, kIdxHeads, 256, kt > 0,
               "weights_mmad");
      }
      c.copy_out(part_gm.row(blk.index), acc, 0, "w_part_out");
    });
    be.m->launch_vector("indexer.weights_reduce", 1, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      auto p = v.alloc<float>(Space::ub, "w_part", 4 * T, kIdxHeads);
      auto o = v.alloc<float>(Space::ub, "w", T, kIdxHeads);
      v.copy_in(p, 0, ConstView<float, 2>(part_gm.data(), {4 * T, kIdxHeads}), "w_part_in");
      v.vcopy(Sub<float>(o), rows_of(p, 0, T), "sum0");
      for (index_t k = 1; k < 4; ++k) v.vadd(o, o, rows_of(p, k * T, T), "sum");
      v.vmuls(o, o, a.cfg->index_weights_scale(), "scale");
      v.copy_out(a.w, o, 0, "w_out");
    });
  }
};

// ---------------------------------------------------------------------------------------------
// indexer_score

struct backend_ops_indexer_score {
  static void check(const A2a3&, const kernels::IndexerScoreArgs& a) {
    indexer_detail::check_supported("a2a3 indexer_score", *a.cfg);
    if (a.cfg->score_len() % kIdxPage != 0)
      throw_arg("a2a3 indexer_score", "cfg.score_len()", a.cfg->score_len(),
                "a multiple of the 128-row page");
    // The score tiles whole 128-row index pages (one DataCopy per page); the prefix-caching
    // layout's 32-row pages would need four gathers per tile, not modelled.
    if (a.page_rows() != kIdxPage)
      throw_arg(
          "a2a3 indexer_score", "page", a.page_rows(),
          "128 (index rows per table column; prefix caching's 32-row pages are not modelled)");
  }

  // The vector epilogue's buffers of one AIV (spec §7.4): INT32 -> FP32, ReLU, x coef per head
  // column, row sum over heads, x key scale per position, NEG_BIG at/after `valid`.
  struct VecBufs {
    Tile<float> f;                        // (128, 64)
    Tile<float> coef;                     // (1, 64) q_sc · w of the token
    std::array<Tile<float>, 2> ksc, out;  // (1, 128), double buffered
    Tile<float> tail;                     // (1, 128) NEG_BIG
  };
  static VecBufs alloc_vec(VectorCore& v, const kernels::IndexerScoreArgs& a, index_t t) {
    VecBufs b{v.alloc<float>(Space::ub, "epilogue_f32", kIdxPage, kIdxHeads),
              v.alloc<float>(Space::ub, "coef", 1, kIdxHeads),
              {v.alloc<float>(Space::ub, "kscale[0]", 1, kIdxPage),
               v.alloc<float>(Space::ub, "kscale[1]", 1, kIdxPage)},
              {v.alloc<float>(Space::ub, "score_out[0]", 1, kIdxPage),
               v.alloc<float>(Space::ub, "score_out[1]", 1, kIdxPage)},
              v.alloc<float>(Space::ub, "neg_big", 1, kIdxPage)};
    auto qw = v.alloc<float>(Space::ub, "q_sc_w", 2, kIdxHeads);
    v.copy_in(qw, 0, ConstView<float, 2>(a.q_sc.slice(0, t, t + 1)), "q_sc_in");
    v.copy_in(qw, 1, ConstView<float, 2>(a.w.slice(0, t, t + 1)), "w_in");
    v.vmul(b.coef, rows_of(qw, 0, 1), rows_of(qw, 1, 1), "coef");
    v.vdup(Sub<float>(b.tail), kNegBig, "dup_neg_big");
    return b;
  }
  static void epilogue(VectorCore& v, Tile<std::int32_t> d, VecBufs& b, int buf, index_t valid) {
    auto& out = b.out[std::size_t(buf)];
    v.vcast(Sub<float>(b.f), Sub<std::int32_t>(d), "cast_f32");
    v.vrelu(b.f, b.f, "relu");
    v.vmul_cols(b.f, b.f, b.coef, "mul_coef");
    v.vrow_sum(out, b.f, "head_sum");
    v.vmul(out, out, b.ksc[std::size_t(buf)], "mul_kscale");
    v.vmaxs(out, out, kNegBig, "clamp");
    v.vfill_from(Sub<float>(out), valid, kNegBig, "tail_mask");
  }
  static void load_page_scale(VectorCore& v, Tile<float> dst, const kernels::IndexerScoreArgs& a,
                              index_t b, index_t p) {
    const index_t blk = a.idx_block_table(b, p);
    v.copy_in(dst, 0, ConstView<float, 2>(a.idx_kv_scale.data() + blk * kIdxPage, {1, kIdxPage}),
              "kscale_in");
  }
  // The cube part of one page: key page (128 x 128) . q (64 x 128)^T -> INT32 (128, 64).
  struct CubeBufs {
    Tile<std::int8_t> q_l1, q_l0;
    std::array<Tile<std::int8_t>, 2> k_l1, k_l0;
    std::array<Tile<std::int32_t>, 2> acc;
  };
  static CubeBufs alloc_cube(CubeCore& c, const kernels::IndexerScoreArgs& a, index_t t) {
    CubeBufs bf{c.alloc<std::int8_t>(Space::l1, "q_i8", kIdxHeads, kIdxDim),
                c.alloc<std::int8_t>(Space::l0b, "q_l0", kIdxHeads, kIdxDim),
                {c.alloc<std::int8_t>(Space::l1, "k_page[0]", kIdxPage, kIdxDim),
                 c.alloc<std::int8_t>(Space::l1, "k_page[1]", kIdxPage, kIdxDim)},
                {c.alloc<std::int8_t>(Space::l0a, "k_l0[0]", kIdxPage, kIdxDim),
                 c.alloc<std::int8_t>(Space::l0a, "k_l0[1]", kIdxPage, kIdxDim)},
                {c.alloc<std::int32_t>(Space::l0c, "score_i32[0]", kIdxPage, kIdxHeads),
                 c.alloc<std::int32_t>(Space::l0c, "score_i32[1]", kIdxPage, kIdxHeads)}};
    c.copy_in(bf.q_l1, 0, a.q_i8.row(t), "q_i8_in");
    c.load_l0(bf.q_l0, bf.q_l1, 0, kIdxHeads, 0, kIdxDim, false, "q_l0");
    return bf;
  }
  static void cube_page(CubeCore& c, CubeBufs& bf, const kernels::IndexerScoreArgs& a, index_t b,
                        index_t p, int j) {
    const std::size_t s = std::size_t(j % 2);
    const index_t blk = a.idx_block_table(b, p);
    c.copy_in(bf.k_l1[s], 0, a.idx_kv_cache.slice(0, blk * kIdxPage, blk * kIdxPage + kIdxPage),
              "k_page_in");
    c.load_l0(bf.k_l0[s], bf.k_l1[s], 0, kIdxPage, 0, kIdxDim, false, "k_l0");
    c.mmad(bf.acc[s], bf.k_l0[s], bf.q_l0, kIdxPage, kIdxHeads, kIdxDim, false, "score_mmad");
  }
  // Vector cores of a lane write NEG_BIG over its pages >= n_pages (they alternate per page).
  static void fill_tail(VectorCore& v, const VecBufs& bf, const kernels::IndexerScoreArgs& a,
                        index_t t, index_t first, index_t step, index_t n_pages) {
    const index_t total = a.cfg->score_len() / kIdxPage;
    for (index_t p = first; p < total; p += step)
      if (p >= n_pages)
        v.copy_out(a.score.slice(0, t, t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage), bf.tail,
                   0, "neg_big_out");
  }

  // --- the fused scope: one mixed block per (token, lane of 2)
  struct FusedLane {
    MixedBlock* blk;
    CubeBufs cb;
    std::array<Ring<std::int32_t>, 2> ring;  // one per AIV, slots in its UB
    VecBufs vb[2];
    int j = 0;             // pages issued
    index_t pending = -1;  // page whose vector epilogue is still to run
  };
  // --- the two-scope design: cube blocks (T*2) then vector blocks (T*4)
  struct CubeLane {
    CubeBlock* blk;
    CubeBufs cb;
    View<std::int32_t, 2> scratch;
    int j = 0;
  };
  struct VecLane {
    VectorBlock* blk;
    VecBufs vb;
    std::array<Tile<std::int32_t>, 2> d;
    View<std::int32_t, 2> scratch;
    int j = 0;
  };

  template <class Body>
  static void for_items(const A2a3& be, const kernels::IndexerScoreArgs& a, Body&& body) {
    const index_t T = a.tokens();
    const auto pages_of = [&](index_t t) { return (a.visible(t) + kIdxPage - 1) / kIdxPage; };
    if (be.score_design == ScoreDesign::fused) {
      be.m->launch_mixed("indexer.score_fused", int(T * kFusedNSplit), [&](MixedBlock& blk) {
        const index_t t = blk.index / kFusedNSplit, split = blk.index % kFusedNSplit;
        FusedLane z{&blk,
                    alloc_cube(blk.cube, a, t),
                    {Ring<std::int32_t>(blk.cube, blk.vec0, "score_ring", be.ring_slots, kIdxPage,
                                        kIdxHeads),
                     Ring<std::int32_t>(blk.cube, blk.vec1, "score_ring", be.ring_slots, kIdxPage,
                                        kIdxHeads)},
                    {alloc_vec(blk.vec0, a, t), alloc_vec(blk.vec1, a, t)}};
        body(z, kernels::ScoreItem{t, a.visible(t), split, pages_of(t), kFusedNSplit});
      });
      return;
    }
    const index_t L = a.cfg->score_len();
    GmArena g(be.m->gm_scratch(GmArena::bytes<std::int32_t, 2>({T * L, kIdxHeads})));
    const View<std::int32_t, 2> scratch = g.take<std::int32_t, 2>({T * L, kIdxHeads});
    be.m->launch_cube("indexer.score_mat", int(T * kFusedNSplit), [&](CubeBlock& blk) {
      const index_t t = blk.index / kFusedNSplit, split = blk.index % kFusedNSplit;
      CubeLane z{&blk, alloc_cube(blk.cube, a, t), scratch};
      body(z, kernels::ScoreItem{t, a.visible(t), split, pages_of(t), kFusedNSplit});
    });
    be.m->launch_vector("indexer.score_reduce", int(T * kTwoScopeNSplit), [&](VectorBlock& blk) {
      const index_t t = blk.index / kTwoScopeNSplit, split = blk.index % kTwoScopeNSplit;
      VectorCore& v = blk.vec;
      VecLane z{&blk,
                alloc_vec(v, a, t),
                {v.alloc<std::int32_t>(Space::ub, "scratch[0]", kIdxPage, kIdxHeads),
                 v.alloc<std::int32_t>(Space::ub, "scratch[1]", kIdxPage, kIdxHeads)},
                scratch};
      body(z, kernels::ScoreItem{t, a.visible(t), split, pages_of(t), kTwoScopeNSplit});
    });
  }

  // Fused: cube page j, then the vector epilogue of page j - 1 (2-deep software pipeline).
  static void begin_item(FusedLane&, const kernels::IndexerScoreArgs&, const kernels::ScoreItem&) {}
  static void vector_step(FusedLane& z, const kernels::IndexerScoreArgs& a,
                          const kernels::ScoreItem& it, index_t p, int j) {
    VectorCore& v = z.blk->vec(j % 2);
    Ring<std::int32_t>& r = z.ring[std::size_t(j % 2)];
    VecBufs& b = z.vb[j % 2];
    const int buf = (j / 2) % 2;
    load_page_scale(v, b.ksc[std::size_t(buf)], a, it.t / a.seq, p);
    Tile<std::int32_t> d = r.pop();
    epilogue(v, d, b, buf, it.vis - p * kIdxPage);
    r.release();
    v.copy_out(a.score.slice(0, it.t, it.t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage),
               b.out[std::size_t(buf)], 0, "score_out");
  }
  static void score_page(FusedLane& z, const kernels::IndexerScoreArgs& a,
                         const kernels::ScoreItem& it, index_t p) {
    cube_page(z.blk->cube, z.cb, a, it.t / a.seq, p, z.j);
    z.ring[std::size_t(z.j % 2)].push(z.cb.acc[std::size_t(z.j % 2)], 0, kIdxPage, "score_push");
    if (z.pending >= 0) vector_step(z, a, it, z.pending, z.j - 1);
    z.pending = p;
    ++z.j;
  }
  static void end_item(FusedLane& z, const kernels::IndexerScoreArgs& a,
                       const kernels::ScoreItem& it) {
    if (z.pending >= 0) vector_step(z, a, it, z.pending, z.j - 1);
    const index_t n_pages = it.last;
    fill_tail(z.blk->vec0, z.vb[0], a, it.t, it.first, 2 * it.step, n_pages);
    fill_tail(z.blk->vec1, z.vb[1], a, it.t, it.first + it.step, 2 * it.step, n_pages);
  }

  // Two-scope, cube: every page's INT32 dots to GM scratch.
  static void begin_item(CubeLane&, const kernels::IndexerScoreArgs&, const kernels::ScoreItem&) {}
  static void score_page(CubeLane& z, const kernels::IndexerScoreArgs& a,
                         const kernels::ScoreItem& it, index_t p) {
    cube_page(z.blk->cube, z.cb, a, it.t / a.seq, p, z.j);
    const index_t r0 = it.t * a.cfg->score_len() + p * kIdxPage;
    z.blk->cube.copy_out(z.scratch.slice(0, r0, r0 + kIdxPage), z.cb.acc[std::size_t(z.j % 2)], 0,
                         "scratch_out");
    ++z.j;
  }
  static void end_item(CubeLane&, const kernels::IndexerScoreArgs&, const kernels::ScoreItem&) {}
  // Two-scope, vector: read the dots back, the same epilogue.
  static void begin_item(VecLane&, const kernels::IndexerScoreArgs&, const kernels::ScoreItem&) {}
  static void score_page(VecLane& z, const kernels::IndexerScoreArgs& a,
                         const kernels::ScoreItem& it, index_t p) {
    VectorCore& v = z.blk->vec;
    const int buf = z.j % 2;
    const index_t r0 = it.t * a.cfg->score_len() + p * kIdxPage;
    v.copy_in(z.d[std::size_t(buf)], 0,
              ConstView<std::int32_t, 2>(z.scratch.slice(0, r0, r0 + kIdxPage)), "scratch_in");
    load_page_scale(v, z.vb.ksc[std::size_t(buf)], a, it.t / a.seq, p);
    epilogue(v, z.d[std::size_t(buf)], z.vb, buf, it.vis - p * kIdxPage);
    v.copy_out(a.score.slice(0, it.t, it.t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage),
               z.vb.out[std::size_t(buf)], 0, "score_out");
    ++z.j;
  }
  static void end_item(VecLane& z, const kernels::IndexerScoreArgs& a,
                       const kernels::ScoreItem& it) {
    fill_tail(z.blk->vec, z.vb, a, it.t, it.first, it.step, it.last);
  }
};

// ---------------------------------------------------------------------------------------------
// indexer_topk: Sort32 runs, 4-way merges to two sorted halves, the top-k merge of the halves
// (exact: the global top-k lies in the union of the halves' top-k).

struct backend_ops_indexer_topk {
  static void check(const A2a3&, const kernels::IndexerTopkArgs& a) {
    const index_t L = a.score.extent(1);
    if (L < 64 || L > 4096 || (L & (L - 1)) != 0 || a.topk > L / 2)
      throw_arg("a2a3 indexer_topk", "score.extent(1)", L,
                "a power of two in [64, 4096] with topk <= width / 2 (the sort network's UB plan)");
  }
  using Lane = VectorBlock;
  template <class Body>
  static void for_rows(const A2a3& be, const kernels::IndexerTopkArgs& a, Body&& body) {
    be.m->launch_vector("indexer.topk", int(a.tokens()),
                        [&](VectorBlock& blk) { body(blk, index_t(blk.index)); });
  }
  static void topk_row(VectorBlock& blk, const kernels::IndexerTopkArgs& a, index_t t) {
    VectorCore& v = blk.vec;
    const index_t L = a.score.extent(1), K = a.topk;
    auto sc = v.alloc<float>(Space::ub, "score_row", 1, L);
    auto pa = v.alloc<ScorePair>(Space::ub, "pairs[0]", 1, L);
    auto pb = v.alloc<ScorePair>(Space::ub, "pairs[1]", 1, L);
    auto cnt = v.alloc<std::int32_t>(Space::ub, "valid", 1, 1);
    auto o = v.alloc<std::int32_t>(Space::ub, "topk_row", 1, a.topk_idxs.extent(1));
    v.copy_in(sc, 0, ConstView<float, 2>(a.score.slice(0, t, t + 1)), "score_in");
    v.vmake_pairs(pa, cnt, sc, a.visible(t), "mask_pairs");
    v.vsort32(pb, pa, "sort32");
    Tile<ScorePair> src = pb, dst = pa;
    index_t run = 32;
    for (; run * 4 <= L / 2; run *= 4) {
      v.vmerge(dst, src, run, 4, run * 4, "mrgsort");
      std::swap(src, dst);
    }
    for (; run < L / 2; run *= 2) {
      v.vmerge(dst, src, run, 2, run * 2, "mrgsort");
      std::swap(src, dst);
    }
    v.vmerge(dst, src, L / 2, 2, K, "mrgsort_topk");
    if (o.cols() > L) v.vdup(Sub<std::int32_t>(o), std::int32_t(-1), "pad");
    v.vpair_indices(part(o, 0, 1, 0, std::min(L, o.cols())),
                    part(dst, 0, 1, 0, std::min(L, o.cols())), K, cnt, a.offset, "emit_ids");
    v.copy_out(a.topk_idxs.slice(0, t, t + 1), o, 0, "topk_out");
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::IndexerQuery, a2a3::A2a3> : a2a3::backend_ops_indexer_query {};
template <>
struct backend_ops<kernels::IndexerWeights, a2a3::A2a3> : a2a3::backend_ops_indexer_weights {};
template <>
struct backend_ops<kernels::IndexerScore, a2a3::A2a3> : a2a3::backend_ops_indexer_score {};
template <>
struct backend_ops<kernels::IndexerTopk, a2a3::A2a3> : a2a3::backend_ops_indexer_topk {};
}  // namespace tiledecode
