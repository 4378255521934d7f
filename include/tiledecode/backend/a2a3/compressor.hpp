#pragma once
// Compressors (spec §6) scheduled on the a2a3 model: the CSA main compressor (ratio 4,
// overlapping), the HCA compressor (ratio 128) and the indexer's inner compressor (ratio 4,
// head_dim 128, + Hadamard + Q8 into the index cache). Semantics and choices are those of
// kernels/compressor.hpp (requests in order, each scatters its state rows before it pools;
// commit-masked boundaries are not pooled; unmapped state pages read kv 0 / score NEG_BIG).
//
// Launches:
//   proj      cube, one block per 128 rows of [wkv; wgate] (<= 24 blocks): x_n (T x D, padded to
//             16 rows) . W^T, K streamed in double-buffered 128 x 512 BF16 L1 tiles
//             -> FP32 GM scratch (T, 2*OUT_DIM)
//   pool      vector, 1 block (requests in order, the reference's aliasing contract): per token
//             + ape[pos % R] on the gate half, state row -> state pool; GM barrier; per committed
//             boundary the window's candidate state rows are gathered through the state table
//             (one DMA per row, chunks of <= 16 rows), online softmax pooling per channel,
//             RMSNorm x norm_w, forward RoPE of the last 64 dims; main: BF16 row -> cmp_kv
//   hadamard  (inner) cube, 1 block: bf16(y) . Hadamard -> FP32 (T, 128)
//   quant     (inner) vector, 1 block: Q8(bf16(z)) -> idx_kv_cache / idx_kv_scale rows
// The pooling runs the softmax online in FP32 (chunk max, rescale) where the golden uses a
// global max in double; the difference is within the spec tolerances (tests/test_a2a3.cpp).

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
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::a2a3 {

struct CompressorInputs {
  kernels::CompressorSpec spec;      // csa / hca / indexer spec of kernels/compressor.hpp
  ConstView<bf16, 2> x_n;            // (T, D)
  kernels::CompressorWeights w;      // wkv, wgate (OUT_DIM, D); ape (R, OUT_DIM); norm_w (hd)
  kernels::CompressorMetadata meta;  // shape, positions, state/cmp slot mappings, state table
  RopeTableView rope;                // CSA/HCA (YaRN) table
  kernels::InnerRopePosition rope_rule = kernels::InnerRopePosition::window_start;  // inner only
  ConstView<bf16, 2> hadamard;  // (hd, hd), inner only
};

struct CompressorOutputs {
  View<float, 2> state_pool;    // (pool rows, 2*OUT_DIM) FP32, updated in place
  View<bf16, 2> cmp_kv;         // main: (cmp rows, head_dim)
  View<std::int8_t, 2> idx_kv;  // inner: (idx rows, head_dim)
  View<float, 1> idx_scale;     // inner: (idx rows)
};

struct CompressorWorkspace {
  Tensor<float, 2> proj;  // (T, 2*OUT_DIM)
  Tensor<bf16, 2> y_bf;   // (T, head_dim) inner: bf16(y) of boundary tokens
  Tensor<float, 2> z;     // (T, head_dim) inner: bf16(y) . Hadamard
  CompressorWorkspace(int tokens, const kernels::CompressorSpec& spec)
      : proj({tokens, 2 * spec.out_dim()}),
        y_bf({tokens, spec.head_dim}),
        z({tokens, spec.head_dim}) {}
};

namespace detail {

inline void check_compressor(const CompressorInputs& in, const CompressorOutputs& out,
                             const CompressorWorkspace& ws, const ModelConfig& cfg, bool inner) {
  constexpr std::string_view w = "a2a3::compressor";
  const auto& sp = in.spec;
  const auto& mt = in.meta;
  const index_t T = mt.shape.tokens(), OUT = sp.out_dim(), HD = sp.head_dim;
  if (sp.ratio != 4 && sp.ratio != 128) throw_arg(w, "spec.ratio", sp.ratio, "4 or 128");
  if (OUT % 128 != 0 || HD < 64) throw_arg(w, "spec.head_dim", HD, "OUT_DIM a multiple of 128");
  check_equal(w, "x_n.extent(0)", in.x_n.extent(0), T);
  check_equal(w, "x_n.extent(1)", in.x_n.extent(1), index_t(cfg.hidden));
  check_equal(w, "wkv.extent(0)", in.w.wkv.extent(0), OUT);
  check_equal(w, "wgate.extent(0)", in.w.wgate.extent(0), OUT);
  check_equal(w, "wkv.extent(1)", in.w.wkv.extent(1), index_t(cfg.hidden));
  check_equal(w, "wgate.extent(1)", in.w.wgate.extent(1), index_t(cfg.hidden));
  check_equal(w, "ape.extent(0)", in.w.ape.extent(0), index_t(sp.ratio));
  check_equal(w, "ape.extent(1)", in.w.ape.extent(1), OUT);
  check_equal(w, "norm_w.extent(0)", in.w.norm_w.extent(0), HD);
  check_equal(w, "positions.extent(0)", mt.positions.extent(0), T);
  check_equal(w, "state_slot_mapping.extent(0)", mt.state_slot_mapping.extent(0), T);
  check_equal(w, "cmp_slot_mapping.extent(0)", mt.cmp_slot_mapping.extent(0), T);
  check_equal(w, "state_table.extent(0)", mt.state_table.extent(0), index_t(mt.shape.batch));
  check_equal(w, "state_pool.extent(1)", out.state_pool.extent(1), 2 * OUT);
  check_equal(w, "ws.proj.extent(0)", ws.proj.extent(0), T);
  check_equal(w, "ws.proj.extent(1)", ws.proj.extent(1), 2 * OUT);
  const index_t page = sp.ratio == 4 ? cfg.c4_state_page : cfg.c128_state_page;
  const index_t pool_blocks = out.state_pool.extent(0) / page;
  for (index_t b = 0; b < mt.shape.batch; ++b)
    for (index_t c = 0; c < mt.state_table.extent(1); ++c)
      check_range<index_t>(w, "state_table", mt.state_table(b, c), -1, pool_blocks);
  const index_t out_rows = inner ? out.idx_kv.extent(0) : out.cmp_kv.extent(0);
  if (inner) {
    check_equal(w, "idx_kv.extent(1)", out.idx_kv.extent(1), HD);
    check_equal(w, "idx_scale.extent(0)", out.idx_scale.extent(0), out.idx_kv.extent(0));
    check_equal(w, "hadamard.extent(0)", in.hadamard.extent(0), HD);
    check_equal(w, "hadamard.extent(1)", in.hadamard.extent(1), HD);
  } else {
    check_equal(w, "cmp_kv.extent(1)", out.cmp_kv.extent(1), HD);
  }
  for (index_t t = 0; t < T; ++t) {
    const index_t pos = mt.positions(t);
    check_range<index_t>(w, "positions[" + std::to_string(t) + "]", pos, 0, in.rope.length());
    check_range<index_t>(w, "state_slot_mapping", mt.state_slot_mapping(t), -1,
                         out.state_pool.extent(0));
    const index_t cs = mt.cmp_slot_mapping(t);
    check_range<index_t>(w, "cmp_slot_mapping", cs, -1, out_rows);
    if (cs >= 0 && (pos + 1) % sp.ratio != 0)
      throw_arg(w, "cmp_slot_mapping[" + std::to_string(t) + "]", cs,
                "-1 for a token that does not close a window");
  }
}

}  // namespace detail

namespace detail {

// The launches of one compressor step, appended to the machine's current kernel.
inline void compressor_step_launches(Machine& m, const CompressorInputs& in,
                                     const CompressorOutputs& out, CompressorWorkspace& ws,
                                     const ModelConfig& cfg, bool inner, const std::string& pre) {
  check_compressor(in, out, ws, cfg, inner);
  const auto& sp = in.spec;
  const auto& mt = in.meta;
  const index_t T = mt.shape.tokens(), B = mt.shape.batch, S = mt.shape.seq;
  const index_t OUT = sp.out_dim(), HD = sp.head_dim, R = sp.ratio, D = cfg.hidden;
  const index_t page = R == 4 ? cfg.c4_state_page : cfg.c128_state_page;

  // ---- proj (cube)
  constexpr index_t kPad = 16, kL1 = 512, kL0 = 128;
  const index_t chunks = 2 * OUT / 128;
  const int grid = int(std::min<index_t>(chunks, m.arch().cube_cores));
  m.launch_cube(pre + ".proj_mm", grid, [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    auto x1 = c.alloc<bf16>(Space::l1, "x_n", kPad, D);
    std::array<Tile<bf16>, 2> w1{c.alloc<bf16>(Space::l1, "w[0]", 128, kL1),
                                 c.alloc<bf16>(Space::l1, "w[1]", 128, kL1)};
    std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "x_l0[0]", kPad, kL0),
                                 c.alloc<bf16>(Space::l0a, "x_l0[1]", kPad, kL0)};
    std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "w_l0[0]", 128, kL0),
                                 c.alloc<bf16>(Space::l0b, "w_l0[1]", 128, kL0)};
    std::array<Tile<float>, 2> acc{c.alloc<float>(Space::l0c, "proj[0]", kPad, 128),
                                   c.alloc<float>(Space::l0c, "proj[1]", kPad, 128)};
    c.copy_in(x1, 0, in.x_n, "x_n_in");
    int l1s = 0, l0s = 0, j = 0;
    for (index_t ch = blk.index; ch < chunks; ch += grid, ++j) {
      const index_t n0 = ch * 128;
      const ConstView<bf16, 2> wsrc = n0 < OUT ? in.w.wkv.slice(0, n0, n0 + 128)
                                               : in.w.wgate.slice(0, n0 - OUT, n0 - OUT + 128);
      auto& cc = acc[std::size_t(j % 2)];
      for (index_t k1 = 0; k1 < D; k1 += kL1, ++l1s) {
        auto& wt = w1[std::size_t(l1s % 2)];
        c.copy_in(wt, 0, wsrc.slice(1, k1, k1 + kL1), "w_in");
        for (index_t k0 = 0; k0 < kL1; k0 += kL0, ++l0s) {
          const std::size_t s = std::size_t(l0s % 2);
          c.load_l0(a0[s], x1, 0, kPad, k1 + k0, kL0, false, "x_l0");
          c.load_l0(b0[s], wt, 0, 128, k0, kL0, false, "w_l0");
          c.mmad(cc, a0[s], b0[s], T, 128, kL0, k1 + k0 > 0, "proj_mmad");
        }
      }
      c.copy_out(ws.proj.view().slice(1, n0, n0 + 128), cc, 0, "proj_out");
    }
  });

  // ---- pool (vector, one block: requests in order)
  m.launch_vector(pre + ".pool", 1, [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    constexpr index_t kChunk = 16;
    auto row = v.alloc<float>(Space::ub, "state_row", 1, 2 * OUT);
    auto ape = v.alloc<float>(Space::ub, "ape_row", 1, OUT);
    auto cand = v.alloc<float>(Space::ub, "candidates", kChunk, 2 * OUT);
    auto acc = v.alloc<float>(Space::ub, "m_num_den", 3, HD);
    auto rot = v.alloc<bf16>(Space::ub, "cos_sin", 2, 64);
    auto nw = v.alloc<bf16>(Space::ub, "norm_w", 1, HD);
    auto y = v.alloc<float>(Space::ub, "y", 1, HD);
    auto ybf = v.alloc<bf16>(Space::ub, "y_bf16", 1, HD);
    v.copy_in(nw, 0, ConstView<bf16, 2>(in.w.norm_w.data(), {1, HD}), "norm_w_in");
    const index_t cols = mt.state_table.extent(1);
    for (index_t b = 0; b < B; ++b) {
      for (index_t s = 0; s < S; ++s) {
        const index_t t = b * S + s, pos = mt.positions(t), slot = mt.state_slot_mapping(t);
        if (slot < 0) continue;
        v.copy_in(row, 0, ConstView<float, 2>(ws.proj.view().slice(0, t, t + 1)), "proj_in");
        v.copy_in(ape, 0, in.w.ape.slice(0, pos % R, pos % R + 1), "ape_in");
        v.vec("add_ape", OUT, 4, {&row.state(), &ape.state()}, {&row.state()}, [&] {
          for (index_t o = 0; o < OUT; ++o) row(0, OUT + o) += ape(0, o);
        });
        v.copy_out(out.state_pool.slice(0, slot, slot + 1), row, 0, "state_out");
      }
      // The request's state rows must be in GM before its pooling reads them back.
      v.gm_barrier(Pipe::mte3, Pipe::mte2);
      for (index_t s = 0; s < S; ++s) {
        const index_t t = b * S + s, slot = mt.cmp_slot_mapping(t);
        if (slot < 0) continue;
        const index_t pos = mt.positions(t), c = pos / R;
        // Candidates: (position, kv column, score column).
        std::vector<std::array<index_t, 3>> cl;
        if (sp.overlap) {
          if (c > 0)
            for (index_t p = (c - 1) * R; p < c * R; ++p) cl.push_back({p, 0, OUT});
          for (index_t p = c * R; p < (c + 1) * R; ++p) cl.push_back({p, HD, OUT + HD});
        } else {
          for (index_t p = c * R; p < (c + 1) * R; ++p) cl.push_back({p, 0, OUT});
        }
        v.vec("pool_init", 3 * HD, 4, {}, {&acc.state()}, [&] {
          for (index_t d = 0; d < HD; ++d) {
            acc(0, d) = kNegBig;
            acc(1, d) = 0.0f;
            acc(2, d) = 0.0f;
          }
        });
        for (std::size_t c0 = 0; c0 < cl.size(); c0 += kChunk) {
          const std::size_t n = std::min<std::size_t>(kChunk, cl.size() - c0);
          std::array<std::int64_t, kChunk> rows{};
          bool any_unmapped = false;
          for (std::size_t i = 0; i < n; ++i) {
            const index_t p = cl[c0 + i][0], tc = p / page;
            const index_t blk_id = tc < cols ? index_t(mt.state_table(b, tc)) : -1;
            rows[i] = blk_id < 0 ? -1 : blk_id * page + p % page;
            any_unmapped = any_unmapped || blk_id < 0;
          }
          v.gather_rows_in(cand, 0, ConstView<float, 2>(out.state_pool),
                           std::span<const std::int64_t>(rows.data(), n), "state_gather");
          if (any_unmapped)  // unmapped page: kv 0, score NEG_BIG
            v.vec("dup_unmapped", index_t(n) * 2 * OUT, 4, {&cand.state()}, {&cand.state()}, [&] {
              for (std::size_t i = 0; i < n; ++i)
                if (rows[i] < 0)
                  for (index_t o = 0; o < OUT; ++o) cand(index_t(i), OUT + o) = kNegBig;
            });
          v.vec(
              "pool_online", index_t(n) * HD * 3, 4, {&cand.state(), &acc.state()}, {&acc.state()},
              [&] {
                for (index_t d = 0; d < HD; ++d) {
                  float mx = acc(0, d);
                  for (std::size_t i = 0; i < n; ++i)
                    mx = std::max(mx, cand(index_t(i), cl[c0 + i][2] + d));
                  const float r = std::exp(acc(0, d) - mx);
                  float num = acc(1, d) * r, den = acc(2, d) * r;
                  for (std::size_t i = 0; i < n; ++i) {
                    const float e = std::exp(cand(index_t(i), cl[c0 + i][2] + d) - mx);
                    num += e * cand(index_t(i), cl[c0 + i][1] + d);
                    den += e;
                  }
                  acc(0, d) = mx;
                  acc(1, d) = num;
                  acc(2, d) = den;
                }
              },
              m.arch().vector_exp_cost_factor);
        }
        const index_t rp = in.rope_rule == kernels::InnerRopePosition::request_start && inner
                               ? index_t(mt.positions(b * S))
                               : c * R;
        check_range<index_t>("a2a3::compressor", "rope position", rp, 0, in.rope.length());
        v.copy_in(rot, 0, ConstView<bf16, 2>(in.rope.cos_row(rp), {1, 64}), "cos_in");
        v.copy_in(rot, 1, ConstView<bf16, 2>(in.rope.sin_row(rp), {1, 64}), "sin_in");
        v.vec("norm_rope", HD * 6, 4, {&acc.state(), &rot.state(), &nw.state()},
              {&y.state(), &ybf.state()}, [&] {
                float ms = 0;
                for (index_t d = 0; d < HD; ++d) {
                  const float p = acc(1, d) / acc(2, d);
                  y(0, d) = p;
                  ms += p * p;
                }
                const float inv = 1.0f / std::sqrt(ms / float(HD) + cfg.rms_eps);
                for (index_t d = 0; d < HD; ++d) y(0, d) = y(0, d) * inv * nw(0, d).to_float();
                rope_forward(std::span<float>(y.row(0) + HD - 64, 64), rot.row(0), rot.row(1));
                for (index_t d = 0; d < HD; ++d) ybf(0, d) = bf16(y(0, d));
              });
        if (inner)
          v.copy_out(ws.y_bf.view().slice(0, t, t + 1), ybf, 0, "y_out");
        else
          v.copy_out(out.cmp_kv.slice(0, slot, slot + 1), ybf, 0, "cmp_kv_out");
      }
    }
  });

  if (inner) {
    // ---- hadamard (cube): z = bf16(y) . H for all T rows (rows without a boundary unused).
    m.launch_cube(pre + ".hadamard_mm", 1, [&](CubeBlock& blk) {
      CubeCore& c = blk.cube;
      auto a1 = c.alloc<bf16>(Space::l1, "y_bf16", kPad, HD);
      auto h1 = c.alloc<bf16>(Space::l1, "hadamard", HD, HD);
      auto a0 = c.alloc<bf16>(Space::l0a, "y_l0", kPad, HD);
      auto b0 = c.alloc<bf16>(Space::l0b, "h_l0", HD, HD);
      auto acc = c.alloc<float>(Space::l0c, "z", kPad, HD);
      c.copy_in(a1, 0, ConstView<bf16, 2>(ws.y_bf.view()), "y_in");
      c.copy_in(h1, 0, in.hadamard, "hadamard_in");
      c.load_l0(a0, a1, 0, kPad, 0, HD, false, "y_l0");
      c.load_l0(b0, h1, 0, HD, 0, HD, /*transpose=*/true, "h_l0");
      c.mmad(acc, a0, b0, T, HD, HD, false, "hadamard_mmad");
      c.copy_out(ws.z.view(), acc, 0, "z_out");
    });
    // ---- quant (vector): Q8(bf16(z)) -> index cache rows of the boundary tokens.
    m.launch_vector(pre + ".quant", 1, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      auto z = v.alloc<float>(Space::ub, "z", T, HD);
      auto q = v.alloc<std::int8_t>(Space::ub, "q", T, HD);
      auto sc = v.alloc<float>(Space::ub, "dq", T, 8);
      v.copy_in(z, 0, ConstView<float, 2>(ws.z.view()), "z_in");
      v.vec(
          "bf16_q8", T * HD, 4, {&z.state()}, {&q.state(), &sc.state()},
          [&] {
            for (index_t t = 0; t < T; ++t) {
              if (mt.cmp_slot_mapping(t) < 0) continue;
              for (index_t d = 0; d < HD; ++d) z(t, d) = round_bf16(z(t, d));
              sc(t, 0) = quantize_q8(std::span<std::int8_t>(q.row(t), std::size_t(HD)),
                                     std::span<const float>(z.row(t), std::size_t(HD)));
            }
          },
          4.0);
      for (index_t t = 0; t < T; ++t) {
        const index_t slot = mt.cmp_slot_mapping(t);
        if (slot < 0) continue;
        v.copy_out(out.idx_kv.slice(0, slot, slot + 1), q, t, "idx_kv_out");
        v.copy_out(View<float, 2>(out.idx_scale.data() + slot, {1, 1}), sc, t, "idx_scale_out");
      }
    });
  }
}

}  // namespace detail

// Runs one compressor step on the model (`inner` = the indexer's inner compressor, which writes
// the INT8 index cache instead of cmp_kv). Returns the kernel report.
inline KernelReport compressor(Machine& m, const CompressorInputs& in, const CompressorOutputs& out,
                               CompressorWorkspace& ws, const ModelConfig& cfg, bool inner) {
  const int R = in.spec.ratio;
  m.begin_kernel(inner ? "indexer_inner_compressor"
                       : (R == 4 ? "compressor_ratio4" : "compressor_ratio128"));
  detail::compressor_step_launches(m, in, out, ws, cfg, inner,
                                   inner ? "inner_cmp" : (R == 4 ? "cmp4" : "cmp128"));
  return m.end_kernel();
}

}  // namespace tiledecode::a2a3
