#pragma once
// The lightning indexer (spec §7) scheduled on the a2a3 model: query path, weights, score (fused
// mixed scope of PR #831, or the earlier two-scope design) and top-k, every stage a launch whose
// tile program computes the result functionally and is timed by the cost model.
//
// Launch sequence (each a kernel launch with its own overhead):
//   qr_proj      cube,   8 blocks: qr(T,1024) . idx_wq_b(1024,8192) -> INT32 GM (T,8192)
//                (N tiled 1024 per block, K in 4 tiles of 256, T padded to 16 rows)
//   qr_rope      vector, T blocks: dequant (x qr_scale x column scale), forward RoPE of dims
//                64..127 at start_b [QUIRK §5], BF16 -> GM (T*64, 128)
//   qr_hadamard  cube,   T blocks of 64 rows: BF16 . Hadamard -> FP32 GM (T*64, 128)
//   qr_quant     vector, T blocks: Q8 per (token, head) row -> q_i8 (T*64,128), q_sc (T*64)
//   weights_mm   cube,   4 blocks: split-K partial x_n . weights_proj over 4 slices of 1024
//   weights_red  vector, 1 block: sum of the 4 partials (fixed order) x index_weights_scale
//   score        fused:  mixed, T*2 blocks (token u/2, lane u%2 walks pages u%2, u%2+2, ...):
//                        cube k_page(128x128) . q(64x128)^T -> INT32 (128,64) -> 2-slot ring ->
//                        vector epilogue (pages alternate between the block's 2 AIVs), 2-deep
//                        software pipeline (cube page i+1 overlaps vector page i)
//                two_scope: cube T*2 blocks write INT32 GM scratch (T*4096, 64); vector T*4
//                        blocks (NSPLIT=4) read it back and run the same epilogue
//   topk         vector, T blocks: mask >= vis_t, Sort32 runs, three 4-way merge passes to two
//                        sorted 2048 halves, merge of the two top-512 candidate lists
//   inner_cmp.*  the inner compressor (§6.4) that refreshes the index cache before scoring
//                (compressor.hpp): projections (cube), state write + pooling + RMSNorm + RoPE
//                (vector), Hadamard (cube), Q8 + cache write (vector). Functional when the
//                caller passes an `InnerCompressorStep` (whose outputs must alias the index
//                cache the score reads); without one the same launches are issued timing-only
//                (timing.hpp) and the index cache passed in is taken as already refreshed.
//
// Score tail [AMBIGUOUS §7.4 / §11.4]: every column >= vis_t is written NEG_BIG (the vector
// cores of each lane fill the tail pages they own), so the output is fully defined.
// Top-k ties: descending score, then ascending index (the merge is stable by index); entries at
// or after vis_t are never picked; all 4096 columns are written (-1 padding).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/compressor.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/backend/a2a3/timing.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"

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

// Inputs of the indexer (shapes for T = B*S tokens; rows of the index pool = blocks * 128).
struct IndexerInputs {
  ConstView<bf16, 2> x_n;                      // (T, D) attention-normed hidden
  ConstView<std::int8_t, 2> qr;                // (T, Q_LORA) INT8 q-latent
  ConstView<float, 1> qr_scale;                // (T)
  ConstView<std::int8_t, 2> wq_b;              // (Q_LORA, 64*128) idx_wq_b
  ConstView<float, 1> wq_b_scale;              // (64*128) per output column
  ConstView<bf16, 2> weights_proj;             // (D, 64)
  ConstView<bf16, 2> hadamard;                 // (128, 128)
  RopeTableView rope;                          // CSA/HCA (YaRN) table, rows = positions
  ConstView<std::int32_t, 1> positions;        // (T)
  ConstView<std::int32_t, 1> kv_seq_lens;      // (B)
  ConstView<std::int8_t, 2> idx_kv;            // (pool rows, 128) index cache
  ConstView<float, 1> idx_scale;               // (pool rows)
  ConstView<std::int32_t, 2> idx_block_table;  // (B, table cols)
  int seq = 2;                                 // S
  int offset = 0;                              // added to emitted top-k ids (0 in the CSA layer)
};

struct IndexerOutputs {
  View<float, 2> score;        // (T, 4096) FP32; NEG_BIG at/after vis_t
  View<std::int32_t, 2> topk;  // (T, 4096) INT32; first min(512, vis_t) ids + offset, rest -1
};

// Intermediate GM tensors of the indexer launches.
struct IndexerWorkspace {
  Tensor<std::int32_t, 2> qi_acc;   // (T, 8192)
  Tensor<bf16, 2> qi_bf;            // (T*64, 128)
  Tensor<float, 2> qh;              // (T*64, 128)
  Tensor<std::int8_t, 2> q_i8;      // (T*64, 128)
  Tensor<float, 1> q_sc;            // (T*64)
  Tensor<float, 3> w_part;          // (4, T, 64)
  Tensor<float, 2> w;               // (T, 64) includes index_weights_scale
  Tensor<std::int32_t, 2> scratch;  // (T*4096, 64) two-scope only
  IndexerWorkspace(int tokens, const ModelConfig& cfg, bool two_scope)
      : qi_acc({tokens, cfg.idx_n_heads * cfg.idx_head_dim}),
        qi_bf({tokens * kIdxHeads, kIdxDim}),
        qh({tokens * kIdxHeads, kIdxDim}),
        q_i8({tokens * kIdxHeads, kIdxDim}),
        q_sc({tokens * kIdxHeads}),
        w_part({4, tokens, kIdxHeads}),
        w({tokens, kIdxHeads}),
        scratch({two_scope ? index_t(tokens) * cfg.score_len() : 1, kIdxHeads}) {}
};

enum class ScoreDesign { fused, two_scope };

namespace detail {

inline void check_indexer(const IndexerInputs& in, const IndexerOutputs& out,
                          const ModelConfig& cfg) {
  constexpr std::string_view w = "a2a3::indexer";
  const index_t T = in.positions.extent(0);
  check_at_least(w, "seq", in.seq, 1);
  if (T % in.seq != 0) throw_arg(w, "positions.extent(0)", T, "a multiple of seq");
  const index_t B = T / in.seq;
  if (cfg.idx_n_heads != kIdxHeads || cfg.idx_head_dim != kIdxDim)
    throw_arg(w, "cfg.idx_n_heads", cfg.idx_n_heads, "64 heads of 128 (schedule tiles)");
  check_equal(w, "x_n.extent(0)", in.x_n.extent(0), T);
  check_equal(w, "x_n.extent(1)", in.x_n.extent(1), index_t(cfg.hidden));
  check_equal(w, "qr.extent(0)", in.qr.extent(0), T);
  check_equal(w, "qr.extent(1)", in.qr.extent(1), index_t(cfg.q_lora));
  check_equal(w, "qr_scale.extent(0)", in.qr_scale.extent(0), T);
  check_equal(w, "wq_b.extent(0)", in.wq_b.extent(0), index_t(cfg.q_lora));
  check_equal(w, "wq_b.extent(1)", in.wq_b.extent(1), index_t(kIdxHeads * kIdxDim));
  check_equal(w, "wq_b_scale.extent(0)", in.wq_b_scale.extent(0), index_t(kIdxHeads * kIdxDim));
  check_equal(w, "weights_proj.extent(0)", in.weights_proj.extent(0), index_t(cfg.hidden));
  check_equal(w, "weights_proj.extent(1)", in.weights_proj.extent(1), index_t(kIdxHeads));
  check_equal(w, "hadamard.extent(0)", in.hadamard.extent(0), index_t(kIdxDim));
  check_equal(w, "hadamard.extent(1)", in.hadamard.extent(1), index_t(kIdxDim));
  check_equal(w, "kv_seq_lens.extent(0)", in.kv_seq_lens.extent(0), B);
  check_equal(w, "idx_kv.extent(1)", in.idx_kv.extent(1), index_t(kIdxDim));
  check_equal(w, "idx_scale.extent(0)", in.idx_scale.extent(0), in.idx_kv.extent(0));
  check_equal(w, "idx_block_table.extent(0)", in.idx_block_table.extent(0), B);
  check_equal(w, "score.extent(0)", out.score.extent(0), T);
  check_equal(w, "score.extent(1)", out.score.extent(1), index_t(cfg.score_len()));
  check_equal(w, "topk.extent(0)", out.topk.extent(0), T);
  check_equal(w, "topk.extent(1)", out.topk.extent(1), index_t(cfg.score_len()));
  const index_t pool_blocks = in.idx_kv.extent(0) / kIdxPage;
  for (index_t t = 0; t < T; ++t) {
    const index_t b = t / in.seq;
    check_range<index_t>(w, "positions[" + std::to_string(t) + "]", in.positions(t), 0,
                         cfg.max_seq_len);
    check_range<index_t>(w, "kv_seq_lens[" + std::to_string(b) + "]", in.kv_seq_lens(b), 0,
                         cfg.max_seq_len + 1);
    check_range<index_t>(w, "rope position (start_b)", in.positions(b * in.seq), 0,
                         in.rope.length());
    const index_t vis =
        std::min<index_t>({in.kv_seq_lens(b) / 4, (in.positions(t) + 1) / 4, cfg.score_len()});
    const index_t pages = (vis + kIdxPage - 1) / kIdxPage;
    check_at_least(w, "idx_block_table.extent(1)", in.idx_block_table.extent(1), pages);
    for (index_t p = 0; p < pages; ++p)
      check_range<index_t>(w,
                           "idx_block_table[" + std::to_string(b) + "," + std::to_string(p) + "]",
                           in.idx_block_table(b, p), -1, pool_blocks);
  }
}

inline index_t indexer_vis(const IndexerInputs& in, const ModelConfig& cfg, index_t t) {
  const index_t b = t / in.seq;
  return std::min<index_t>({in.kv_seq_lens(b) / 4, (in.positions(t) + 1) / 4, cfg.score_len()});
}

// Query path + weights: six launches, results in ws.q_i8 / ws.q_sc / ws.w.
inline void indexer_query_and_weights(Machine& m, const IndexerInputs& in, IndexerWorkspace& ws,
                                      const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0);
  const index_t N = kIdxHeads * kIdxDim, K = cfg.q_lora;
  // ---- qr_proj: cube, N tiled 1024 per block, K in tiles of 256, T padded to 16.
  const int n_blk = int((N + 1023) / 1024);
  m.launch_cube("indexer.qr_proj", n_blk, [&](CubeBlock& blk) {
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
    std::fill_n(a_l1.data(), a_l1.size(), std::int8_t(0));  // pad rows are zero
    c.copy_in(a_l1, 0, in.qr, "qr_in");
    int step = 0;
    for (index_t half = 0; half < 2; ++half) {
      const index_t nh = n0 + half * 512;
      auto& cacc = acc[std::size_t(half)];
      for (index_t kt = 0; kt < K / 256; ++kt, ++step) {
        auto& wl1 = w_l1[std::size_t(step % 2)];
        c.copy_in(wl1, 0, in.wq_b.slice(0, kt * 256, kt * 256 + 256).slice(1, nh, nh + 512),
                  "wq_b_in");
        auto& al0 = a_l0[std::size_t(step % 2)];
        c.load_l0(al0, a_l1, 0, kCubeRowPad, kt * 256, 256, false, "qr_l0");
        for (index_t nc = 0; nc < 4; ++nc) {
          auto& bl0 = b_l0[std::size_t(nc % 2)];
          c.load_l0(bl0, wl1, 0, 256, nc * 128, 128, /*transpose=*/true, "w_l0");
          c.mmad(cacc, al0, bl0, T, 128, 256, kt > 0, "qr_mmad",
                 nc * 128);  // pads to 16 rows in cost
        }
      }
      c.copy_out(ws.qi_acc.view().slice(1, nh, nh + 512), cacc, 0, "qi_out");
    }
  });
  // ---- qr_rope: vector, one token per block.
  m.launch_vector("indexer.qr_rope", int(T), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index, start = in.positions((t / in.seq) * in.seq);
    auto acc = v.alloc<std::int32_t>(Space::ub, "qi_acc", 1, N);
    auto cs = v.alloc<float>(Space::ub, "col_scale", 1, N);
    auto f = v.alloc<float>(Space::ub, "qi_f32", kIdxHeads, kIdxDim);
    auto rot = v.alloc<bf16>(Space::ub, "cos_sin", 2, 64);
    auto o = v.alloc<bf16>(Space::ub, "qi_bf", kIdxHeads, kIdxDim);
    v.copy_in(acc, 0, ws.qi_acc.view().slice(0, t, t + 1), "qi_acc_in");
    v.copy_in(cs, 0, ConstView<float, 2>(in.wq_b_scale.data(), {1, N}), "wscale_in");
    v.copy_in(rot, 0, ConstView<bf16, 2>(in.rope.cos_row(start), {1, 64}), "cos_in");
    v.copy_in(rot, 1, ConstView<bf16, 2>(in.rope.sin_row(start), {1, 64}), "sin_in");
    const float rs = in.qr_scale(t);
    v.vec(
        "dequant", N, 4, {&acc.state(), &cs.state()}, {&f.state()},
        [&] {
          for (index_t i = 0; i < N; ++i) f.data()[i] = float(acc.data()[i]) * rs * cs.data()[i];
        },
        2.0);
    v.vec(
        "rope_fwd", kIdxHeads * 64, 4, {&f.state(), &rot.state()}, {&f.state()},
        [&] {
          for (index_t h = 0; h < kIdxHeads; ++h)
            rope_forward(std::span<float>(f.row(h) + 64, 64), rot.row(0), rot.row(1));
        },
        4.0);
    v.vec("cast_bf16", N, 4, {&f.state()}, {&o.state()}, [&] {
      for (index_t i = 0; i < N; ++i) o.data()[i] = bf16(f.data()[i]);
    });
    v.copy_out(ws.qi_bf.view().slice(0, t * kIdxHeads, (t + 1) * kIdxHeads), o, 0, "qi_bf_out");
  });
  // ---- qr_hadamard: cube, 64-row tiles: (64 x 128) BF16 . H (128 x 128).
  m.launch_cube("indexer.qr_hadamard", int(T), [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t r0 = index_t(blk.index) * kIdxHeads;
    auto a1 = c.alloc<bf16>(Space::l1, "qi", kIdxHeads, kIdxDim);
    auto h1 = c.alloc<bf16>(Space::l1, "hadamard", kIdxDim, kIdxDim);
    auto a0 = c.alloc<bf16>(Space::l0a, "qi_l0", kIdxHeads, kIdxDim);
    auto b0 = c.alloc<bf16>(Space::l0b, "hadamard_l0", kIdxDim, kIdxDim);
    auto acc = c.alloc<float>(Space::l0c, "qh", kIdxHeads, kIdxDim);
    c.copy_in(a1, 0, ConstView<bf16, 2>(ws.qi_bf.view().slice(0, r0, r0 + kIdxHeads)), "qi_in");
    c.copy_in(h1, 0, in.hadamard, "hadamard_in");
    c.load_l0(a0, a1, 0, kIdxHeads, 0, kIdxDim, false, "qi_l0");
    c.load_l0(b0, h1, 0, kIdxDim, 0, kIdxDim, /*transpose=*/true, "hadamard_l0");
    c.mmad(acc, a0, b0, kIdxHeads, kIdxDim, kIdxDim, false, "hadamard_mmad");
    c.copy_out(ws.qh.view().slice(0, r0, r0 + kIdxHeads), acc, 0, "qh_out");
  });
  // ---- qr_quant: vector, Q8 per (token, head) row.
  m.launch_vector("indexer.qr_quant", int(T), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t r0 = index_t(blk.index) * kIdxHeads;
    auto x = v.alloc<float>(Space::ub, "qh", kIdxHeads, kIdxDim);
    auto q = v.alloc<std::int8_t>(Space::ub, "q_i8", kIdxHeads, kIdxDim);
    auto s = v.alloc<float>(Space::ub, "q_sc", 1, kIdxHeads);
    v.copy_in(x, 0, ConstView<float, 2>(ws.qh.view().slice(0, r0, r0 + kIdxHeads)), "qh_in");
    v.vec("amax", kIdxHeads * kIdxDim, 4, {&x.state()}, {&s.state()}, [] {});
    v.vec(
        "quant", kIdxHeads * kIdxDim, 4, {&x.state(), &s.state()}, {&q.state(), &s.state()},
        [&] {
          for (index_t h = 0; h < kIdxHeads; ++h)
            s(0, h) = quantize_q8(std::span<std::int8_t>(q.row(h), kIdxDim),
                                  std::span<const float>(x.row(h), kIdxDim));
        },
        3.0);
    v.copy_out(ws.q_i8.view().slice(0, r0, r0 + kIdxHeads), q, 0, "q_i8_out");
    v.copy_out(View<float, 2>(ws.q_sc.data() + r0, {1, kIdxHeads}), s, 0, "q_sc_out");
  });
  // ---- weights: split-K over 4 slices of D/4 on the cube, then a vector reduce + scale.
  const index_t D = cfg.hidden, ks = D / 4;
  m.launch_cube("indexer.weights_mm", 4, [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t k0 = index_t(blk.index) * ks;
    auto x1 = c.alloc<bf16>(Space::l1, "x_n", kCubeRowPad, ks);
    auto w1 = c.alloc<bf16>(Space::l1, "weights_proj", ks, kIdxHeads);
    std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "x_l0[0]", kCubeRowPad, 256),
                                 c.alloc<bf16>(Space::l0a, "x_l0[1]", kCubeRowPad, 256)};
    std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "wp_l0[0]", kIdxHeads, 256),
                                 c.alloc<bf16>(Space::l0b, "wp_l0[1]", kIdxHeads, 256)};
    auto acc = c.alloc<float>(Space::l0c, "w_part", kCubeRowPad, kIdxHeads);
    std::fill_n(x1.data(), x1.size(), bf16());
    c.copy_in(x1, 0, in.x_n.slice(1, k0, k0 + ks), "x_n_in");
    c.copy_in(w1, 0, in.weights_proj.slice(0, k0, k0 + ks), "weights_proj_in");
    for (index_t kt = 0; kt < ks / 256; ++kt) {
      c.load_l0(a0[std::size_t(kt % 2)], x1, 0, kCubeRowPad, kt * 256, 256, false, "x_l0");
      c.load_l0(b0[std::size_t(kt % 2)], w1, kt * 256, 256, 0, kIdxHeads, true, "wp_l0");
      c.mmad(acc, a0[std::size_t(kt % 2)], b0[std::size_t(kt % 2)], T, kIdxHeads, 256, kt > 0,
             "weights_mmad");
    }
    c.copy_out(ws.w_part.view().row(blk.index), acc, 0, "w_part_out");
  });
  m.launch_vector("indexer.weights_reduce", 1, [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    auto p = v.alloc<float>(Space::ub, "w_part", 4 * T, kIdxHeads);
    auto o = v.alloc<float>(Space::ub, "w", T, kIdxHeads);
    v.copy_in(p, 0, ConstView<float, 2>(ws.w_part.data(), {4 * T, kIdxHeads}), "w_part_in");
    const float sc = cfg.index_weights_scale();
    v.vec("sum_scale", 4 * T * kIdxHeads, 4, {&p.state()}, {&o.state()}, [&] {
      for (index_t t = 0; t < T; ++t)
        for (index_t h = 0; h < kIdxHeads; ++h) {
          float s = 0;
          for (index_t k = 0; k < 4; ++k) s += p(k * T + t, h);
          o(t, h) = s * sc;
        }
    });
    v.copy_out(ws.w.view(), o, 0, "w_out");
  });
}

// Vector epilogue of one page (spec §7.4): INT32 -> FP32, x q scale per head column, ReLU,
// x weight per head, row-sum over heads, x key scale per position, NEG_BIG at/after `valid`.
struct ScoreEpilogue {
  Tile<float> f;     // (128, 64)
  Tile<float> qs_w;  // (2, 64): q scale, weights
  Tile<float> ksc;   // (1, 128) per page (double buffered by the caller)
  Tile<float> out;   // (1, 128)
};
inline void score_epilogue(VectorCore& v, Tile<std::int32_t> d, const ScoreEpilogue& e,
                           index_t valid) {
  v.vec("cast_f32", kIdxPage * kIdxHeads, 4, {&d.state()}, {&e.f.state()}, [&] {
    for (index_t i = 0; i < kIdxPage * kIdxHeads; ++i) e.f.data()[i] = float(d.data()[i]);
  });
  v.vec(
      "mul_qscale_relu", kIdxPage * kIdxHeads, 4, {&e.f.state(), &e.qs_w.state()}, {&e.f.state()},
      [&] {
        for (index_t r = 0; r < kIdxPage; ++r)
          for (index_t h = 0; h < kIdxHeads; ++h)
            e.f(r, h) = std::max(e.qs_w(0, h) * e.f(r, h), 0.0f);
      },
      2.0);
  v.vec("mul_w", kIdxPage * kIdxHeads, 4, {&e.f.state(), &e.qs_w.state()}, {&e.f.state()}, [&] {
    for (index_t r = 0; r < kIdxPage; ++r)
      for (index_t h = 0; h < kIdxHeads; ++h) e.f(r, h) = e.qs_w(1, h) * e.f(r, h);
  });
  v.vec("row_sum", kIdxPage * kIdxHeads, 4, {&e.f.state()}, {&e.out.state()}, [&] {
    for (index_t r = 0; r < kIdxPage; ++r) {
      float s = 0;
      for (index_t h = 0; h < kIdxHeads; ++h) s += e.f(r, h);
      e.out(0, r) = s;
    }
  });
  v.vec(
      "mul_kscale_mask", kIdxPage, 4, {&e.out.state(), &e.ksc.state()}, {&e.out.state()},
      [&] {
        for (index_t r = 0; r < kIdxPage; ++r)
          e.out(0, r) = r < valid ? std::max(e.ksc(0, r) * e.out(0, r), kNegBig) : kNegBig;
      },
      2.0);
}

// Copies the key page of logical page `p` of request b into `dst` (contiguous page, one DMA).
template <class T>
inline void load_page(Core& c, Tile<T> dst, ConstView<T, 2> pool, const IndexerInputs& in,
                      index_t b, index_t p, std::string_view name) {
  const index_t blk = in.idx_block_table(b, p);
  if (blk < 0) {
    std::array<std::int64_t, kIdxPage> none;
    none.fill(-1);
    c.gather_rows_in(dst, 0, pool, std::span<const std::int64_t>(none), name);
  } else {
    c.copy_in(dst, 0, pool.slice(0, blk * kIdxPage, blk * kIdxPage + kIdxPage), name);
  }
}

inline void load_page_scale(Core& c, Tile<float> dst, const IndexerInputs& in, index_t b,
                            index_t p) {
  const index_t blk = in.idx_block_table(b, p);
  if (blk < 0) {
    std::fill_n(dst.data(), kIdxPage, 0.0f);
    return;
  }
  c.copy_in(dst, 0, ConstView<float, 2>(in.idx_scale.data() + blk * kIdxPage, {1, kIdxPage}),
            "kscale_in");
}

// The cube part of one page: key page (128 x 128) . q (64 x 128)^T -> INT32 (128, 64) in `acc`.
struct ScoreCubeBufs {
  Tile<std::int8_t> q_l1, q_l0;
  std::array<Tile<std::int8_t>, 2> k_l1, k_l0;
  std::array<Tile<std::int32_t>, 2> acc;
};
inline ScoreCubeBufs alloc_score_cube(CubeCore& c) {
  return {c.alloc<std::int8_t>(Space::l1, "q_i8", kIdxHeads, kIdxDim),
          c.alloc<std::int8_t>(Space::l0b, "q_l0", kIdxHeads, kIdxDim),
          {c.alloc<std::int8_t>(Space::l1, "k_page[0]", kIdxPage, kIdxDim),
           c.alloc<std::int8_t>(Space::l1, "k_page[1]", kIdxPage, kIdxDim)},
          {c.alloc<std::int8_t>(Space::l0a, "k_l0[0]", kIdxPage, kIdxDim),
           c.alloc<std::int8_t>(Space::l0a, "k_l0[1]", kIdxPage, kIdxDim)},
          {c.alloc<std::int32_t>(Space::l0c, "score_i32[0]", kIdxPage, kIdxHeads),
           c.alloc<std::int32_t>(Space::l0c, "score_i32[1]", kIdxPage, kIdxHeads)}};
}
inline void score_cube_page(CubeCore& c, ScoreCubeBufs& bf, const IndexerInputs& in, index_t b,
                            index_t p, int j) {
  const std::size_t s = std::size_t(j % 2);
  load_page(c, bf.k_l1[s], in.idx_kv, in, b, p, "k_page_in");
  c.load_l0(bf.k_l0[s], bf.k_l1[s], 0, kIdxPage, 0, kIdxDim, false, "k_l0");
  c.mmad(bf.acc[s], bf.k_l0[s], bf.q_l0, kIdxPage, kIdxHeads, kIdxDim, false, "score_mmad");
}

struct ScoreVecBufs {
  ScoreEpilogue e[2];
  Tile<float> tail;
};
inline ScoreVecBufs alloc_score_vec(VectorCore& v, const IndexerWorkspace& ws, index_t t) {
  auto f = v.alloc<float>(Space::ub, "epilogue_f32", kIdxPage, kIdxHeads);
  auto qw = v.alloc<float>(Space::ub, "qscale_w", 2, kIdxHeads);
  auto k0 = v.alloc<float>(Space::ub, "kscale[0]", 1, kIdxPage);
  auto k1 = v.alloc<float>(Space::ub, "kscale[1]", 1, kIdxPage);
  auto o0 = v.alloc<float>(Space::ub, "score_out[0]", 1, kIdxPage);
  auto o1 = v.alloc<float>(Space::ub, "score_out[1]", 1, kIdxPage);
  auto tail = v.alloc<float>(Space::ub, "neg_big", 1, kIdxPage);
  v.copy_in(qw, 0, ConstView<float, 2>(ws.q_sc.data() + t * kIdxHeads, {1, kIdxHeads}), "q_sc_in");
  v.copy_in(qw, 1, ConstView<float, 2>(ws.w.data() + t * kIdxHeads, {1, kIdxHeads}), "w_in");
  v.vec("dup_neg_big", kIdxPage, 4, {}, {&tail.state()},
        [&] { std::fill_n(tail.data(), kIdxPage, kNegBig); });
  return {{{f, qw, k0, o0}, {f, qw, k1, o1}}, tail};
}

// Vector cores of a lane write NEG_BIG over the pages >= n_pages they own.
inline void score_fill_tail(VectorCore& v, const ScoreVecBufs& bf, View<float, 2> score, index_t t,
                            index_t first_page, index_t step, index_t n_pages,
                            const ModelConfig& cfg) {
  const index_t total = cfg.score_len() / kIdxPage;
  for (index_t p = first_page; p < total; p += step)
    if (p >= n_pages)
      v.copy_out(score.slice(0, t, t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage), bf.tail, 0,
                 "neg_big_out");
}

inline void indexer_score_fused(Machine& m, const IndexerInputs& in, const IndexerOutputs& out,
                                IndexerWorkspace& ws, const ModelConfig& cfg, int ring_slots) {
  const index_t T = in.positions.extent(0);
  m.launch_mixed("indexer.score_fused", int(T * kFusedNSplit), [&](MixedBlock& blk) {
    const index_t t = blk.index / kFusedNSplit, split = blk.index % kFusedNSplit;
    const index_t b = t / in.seq, vis = indexer_vis(in, cfg, t);
    const index_t n_pages = (vis + kIdxPage - 1) / kIdxPage;
    CubeCore& c = blk.cube;
    ScoreCubeBufs cb = alloc_score_cube(c);
    // One ring per AIV (pages alternate between them), slots in that AIV's UB.
    Ring<std::int32_t> ring0(c, blk.vec0, "score_ring", ring_slots, kIdxPage, kIdxHeads);
    Ring<std::int32_t> ring1(c, blk.vec1, "score_ring", ring_slots, kIdxPage, kIdxHeads);
    ScoreVecBufs vb[2] = {alloc_score_vec(blk.vec0, ws, t), alloc_score_vec(blk.vec1, ws, t)};
    c.copy_in(
        cb.q_l1, 0,
        ConstView<std::int8_t, 2>(ws.q_i8.view().slice(0, t * kIdxHeads, (t + 1) * kIdxHeads)),
        "q_i8_in");
    c.load_l0(cb.q_l0, cb.q_l1, 0, kIdxHeads, 0, kIdxDim, false, "q_l0");
    std::vector<index_t> pages;
    for (index_t p = split; p < n_pages; p += kFusedNSplit) pages.push_back(p);
    auto vector_step = [&](int j) {
      VectorCore& v = blk.vec(j % 2);
      Ring<std::int32_t>& r = j % 2 ? ring1 : ring0;
      const ScoreEpilogue& e = vb[j % 2].e[(j / 2) % 2];
      const index_t p = pages[std::size_t(j)];
      load_page_scale(v, e.ksc, in, b, p);
      Tile<std::int32_t> d = r.pop();
      score_epilogue(v, d, e, vis - p * kIdxPage);
      r.release();
      v.copy_out(out.score.slice(0, t, t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage), e.out, 0,
                 "score_out");
    };
    // 2-deep software pipeline: cube page j, then the vector epilogue of page j-1.
    for (int j = 0; j < int(pages.size()); ++j) {
      score_cube_page(c, cb, in, b, pages[std::size_t(j)], j);
      (j % 2 ? ring1 : ring0).push(cb.acc[std::size_t(j % 2)], 0, kIdxPage, "score_push");
      if (j >= 1) vector_step(j - 1);
    }
    if (!pages.empty()) vector_step(int(pages.size()) - 1);
    // The tail pages this lane owns: AIV 0 and AIV 1 take alternate ones.
    score_fill_tail(blk.vec0, vb[0], out.score, t, split, 2 * kFusedNSplit, n_pages, cfg);
    score_fill_tail(blk.vec1, vb[1], out.score, t, split + kFusedNSplit, 2 * kFusedNSplit, n_pages,
                    cfg);
  });
}

inline void indexer_score_two_scope(Machine& m, const IndexerInputs& in, const IndexerOutputs& out,
                                    IndexerWorkspace& ws, const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), L = cfg.score_len();
  m.launch_cube("indexer.score_mat", int(T * kFusedNSplit), [&](CubeBlock& blk) {
    const index_t t = blk.index / kFusedNSplit, split = blk.index % kFusedNSplit;
    const index_t b = t / in.seq, n_pages = (indexer_vis(in, cfg, t) + kIdxPage - 1) / kIdxPage;
    CubeCore& c = blk.cube;
    ScoreCubeBufs cb = alloc_score_cube(c);
    c.copy_in(
        cb.q_l1, 0,
        ConstView<std::int8_t, 2>(ws.q_i8.view().slice(0, t * kIdxHeads, (t + 1) * kIdxHeads)),
        "q_i8_in");
    c.load_l0(cb.q_l0, cb.q_l1, 0, kIdxHeads, 0, kIdxDim, false, "q_l0");
    int j = 0;
    for (index_t p = split; p < n_pages; p += kFusedNSplit, ++j) {
      score_cube_page(c, cb, in, b, p, j);
      const index_t r0 = t * L + p * kIdxPage;
      c.copy_out(ws.scratch.view().slice(0, r0, r0 + kIdxPage), cb.acc[std::size_t(j % 2)], 0,
                 "scratch_out");
    }
  });
  m.launch_vector("indexer.score_reduce", int(T * kTwoScopeNSplit), [&](VectorBlock& blk) {
    const index_t t = blk.index / kTwoScopeNSplit, split = blk.index % kTwoScopeNSplit;
    const index_t b = t / in.seq, vis = indexer_vis(in, cfg, t);
    const index_t n_pages = (vis + kIdxPage - 1) / kIdxPage;
    VectorCore& v = blk.vec;
    ScoreVecBufs vb = alloc_score_vec(v, ws, t);
    std::array<Tile<std::int32_t>, 2> d{
        v.alloc<std::int32_t>(Space::ub, "scratch[0]", kIdxPage, kIdxHeads),
        v.alloc<std::int32_t>(Space::ub, "scratch[1]", kIdxPage, kIdxHeads)};
    int j = 0;
    for (index_t p = split; p < n_pages; p += kTwoScopeNSplit, ++j) {
      const ScoreEpilogue& e = vb.e[j % 2];
      const index_t r0 = t * L + p * kIdxPage;
      v.copy_in(d[std::size_t(j % 2)], 0,
                ConstView<std::int32_t, 2>(ws.scratch.view().slice(0, r0, r0 + kIdxPage)),
                "scratch_in");
      load_page_scale(v, e.ksc, in, b, p);
      score_epilogue(v, d[std::size_t(j % 2)], e, vis - p * kIdxPage);
      v.copy_out(out.score.slice(0, t, t + 1).slice(1, p * kIdxPage, (p + 1) * kIdxPage), e.out, 0,
                 "score_out");
    }
    score_fill_tail(v, vb, out.score, t, split, kTwoScopeNSplit, n_pages, cfg);
  });
}

inline void merge_runs(ScorePair* dst, const ScorePair* src, index_t n, index_t run, index_t ways,
                       index_t keep) {
  // Merges groups of `ways` consecutive sorted runs of length `run`; keeps the first `keep` of
  // each merged group (the rest of dst's group is left as is).
  for (index_t g = 0; g < n; g += run * ways) {
    std::array<index_t, 4> pos{}, end{};
    for (index_t w = 0; w < ways; ++w) {
      pos[std::size_t(w)] = std::min(n, g + w * run);
      end[std::size_t(w)] = std::min(n, g + (w + 1) * run);
    }
    const index_t total = std::min(end[std::size_t(ways - 1)] - g, keep);
    for (index_t o = 0; o < total; ++o) {
      index_t best = -1;
      for (index_t w = 0; w < ways; ++w) {
        if (pos[std::size_t(w)] >= end[std::size_t(w)]) continue;
        if (best < 0 || pair_before(src[pos[std::size_t(w)]], src[pos[std::size_t(best)]]))
          best = w;
      }
      dst[g + o] = src[pos[std::size_t(best)]++];
    }
  }
}

inline void indexer_topk(Machine& m, const IndexerInputs& in, const IndexerOutputs& out,
                         const ModelConfig& cfg) {
  const index_t T = in.positions.extent(0), L = cfg.score_len(), K = cfg.idx_topk;
  if (L != 4096 || K > L / 2)
    throw_arg("a2a3::indexer_topk", "cfg.idx_topk", K, "<= 2048 with a 4096-wide score row");
  m.launch_vector("indexer.topk", int(T), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index, vis = indexer_vis(in, cfg, t);
    auto sc = v.alloc<float>(Space::ub, "score_row", 1, L);
    auto a = v.alloc<ScorePair>(Space::ub, "pairs[0]", 1, L);
    auto bq = v.alloc<ScorePair>(Space::ub, "pairs[1]", 1, L);
    auto o = v.alloc<std::int32_t>(Space::ub, "topk_row", 1, L);
    v.copy_in(sc, 0, ConstView<float, 2>(out.score.slice(0, t, t + 1)), "score_in");
    v.vec("mask_pairs", L, 8, {&sc.state()}, {&a.state()}, [&] {
      for (index_t j = 0; j < L; ++j)
        a(0, j) = {j < vis && !std::isnan(sc(0, j)) ? sc(0, j) : kNegBig, std::int32_t(j)};
    });
    v.sort32("sort32", L, {&a.state()}, {&bq.state()}, [&] {
      std::copy_n(a.data(), L, bq.data());
      for (index_t g = 0; g < L; g += 32) std::sort(bq.data() + g, bq.data() + g + 32, pair_before);
    });
    // Three 4-way passes: runs 32 -> 128 -> 512 -> 2048 (two sorted halves).
    Tile<ScorePair> src = bq, dst = a;
    for (index_t run = 32; run < L / 2; run *= 4) {
      v.merge("mrgsort", L, {&src.state()}, {&dst.state()},
              [&] { merge_runs(dst.data(), src.data(), L, run, 4, run * 4); });
      std::swap(src, dst);
    }
    // Top-K of the union of the two halves' top-K candidates.
    v.merge("mrgsort_topk", K, {&src.state()}, {&dst.state()},
            [&] { merge_runs(dst.data(), src.data(), L, L / 2, 2, K); });
    const index_t k = std::min(K, vis);
    v.vec("emit_ids", L, 4, {&dst.state()}, {&o.state()}, [&] {
      for (index_t j = 0; j < L; ++j) o(0, j) = j < k ? dst(0, j).index + in.offset : -1;
    });
    v.copy_out(out.topk.slice(0, t, t + 1), o, 0, "topk_out");
  });
}

}  // namespace detail

// The inner compressor step run inside the indexer (its outputs alias IndexerInputs::idx_kv /
// idx_scale, which the score then reads).
struct InnerCompressorStep {
  CompressorInputs in;
  CompressorOutputs out;
  CompressorWorkspace* ws = nullptr;
};

// Runs the whole indexer (§7: query path, weights, inner compressor, score, top-k) on the model.
// `design` picks the score schedule; `ring_slots` is the fused scope's cube->vector ring depth
// (2 in PR #831; a depth whose slots do not fit UB beside the epilogue is rejected at plan
// time); `inner` runs the inner compressor functionally; with `inner == nullptr` and
// `inner_compressor_timing` its launches are issued timing-only.
// Returns the kernel report (one entry per launch).
inline KernelReport indexer(Machine& m, const IndexerInputs& in, const IndexerOutputs& out,
                            IndexerWorkspace& ws, const ModelConfig& cfg,
                            ScoreDesign design = ScoreDesign::fused, int ring_slots = kIdxRingSlots,
                            const InnerCompressorStep* inner = nullptr,
                            bool inner_compressor_timing = true) {
  detail::check_indexer(in, out, cfg);
  if (inner && inner->ws) detail::check_compressor(inner->in, inner->out, *inner->ws, cfg, true);
  if (design == ScoreDesign::two_scope)
    check_equal("a2a3::indexer", "ws.scratch.extent(0)", ws.scratch.extent(0),
                in.positions.extent(0) * cfg.score_len());
  m.begin_kernel(design == ScoreDesign::fused ? "indexer_fused" : "indexer_two_scope");
  detail::indexer_query_and_weights(m, in, ws, cfg);
  if (inner) {
    if (inner->ws == nullptr) throw_arg("a2a3::indexer", "inner->ws", "null", "a workspace");
    if (inner->out.idx_kv.data() != in.idx_kv.data() ||
        inner->out.idx_scale.data() != in.idx_scale.data())
      throw_arg("a2a3::indexer", "inner->out.idx_kv", "another tensor",
                "the index cache the score reads (in.idx_kv / in.idx_scale)");
    detail::compressor_step_launches(m, inner->in, inner->out, *inner->ws, cfg, true,
                                     "indexer.inner_cmp");
  } else if (inner_compressor_timing) {
    detail::TimingOnly off(m);
    const index_t T = in.positions.extent(0);
    detail::compressor_launches(m, cfg, "indexer.inner_cmp", T, T / in.seq, 4, cfg.idx_head_dim,
                                true);
  }
  if (design == ScoreDesign::fused)
    detail::indexer_score_fused(m, in, out, ws, cfg, ring_slots);
  else
    detail::indexer_score_two_scope(m, in, out, ws, cfg);
  detail::indexer_topk(m, in, out, cfg);
  return m.end_kernel();
}

}  // namespace tiledecode::a2a3
