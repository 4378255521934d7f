#pragma once
// q / kv projection with RoPE (spec §4 step 3) scheduled on the a2a3 model. Semantics are those
// of kernels/qkv_projection.hpp (weights in QkvWeights):
//   cq = rmsnorm(x_n @ wq_a) * gamma_cq ; qr, qr_scale = Q8(cq)
//   qf = (qr @ wq_b)_int32 * qr_scale * wq_b_scale ; per-head RMSNorm (no weight)
//   q  = bf16([qf[:448], rope_fwd(qf[448:], pos_t)])
//   kv = bf16([kvf[:448], rope_fwd(kvf[448:], pos_t)]),  kvf = rmsnorm(x_n @ wkv) * gamma_ckv
//
// Launches:
//   a_mm     cube, 12 blocks: x_n (T x D, padded to 16 rows) . [wq_a | wkv] in 128-column
//            chunks (8 of wq_a, 4 of wkv), K streamed in double-buffered 512 x 128 BF16 L1
//            tiles, transposed L1 -> L0B loads (the weights are stored (K, N)) -> FP32 GM
//   norm     vector, T blocks: RMSNorm x gamma_cq, Q8 -> qr / qr_scale; RMSNorm x gamma_ckv,
//            RoPE at pos_t, BF16 -> kv
//   b_mm     cube, 24 blocks: qr (T x 1024 INT8) . wq_b (1024 x 32768) in 512-column slices,
//            K in 4 tiles of 256 -> INT32 GM (T, 32768)
//   q_post   vector, T x 4 blocks of 16 heads: dequant, per-head RMSNorm, RoPE, BF16 -> q

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::a2a3 {

struct QkvWorkspace {
  Tensor<float, 2> cq_raw;     // (T, Q_LORA)
  Tensor<float, 2> kv_raw;     // (T, 512)
  Tensor<std::int32_t, 2> qi;  // (T, H*512)
  QkvWorkspace(int tokens, const ModelConfig& cfg)
      : cq_raw({tokens, cfg.q_lora}),
        kv_raw({tokens, cfg.head_dim}),
        qi({tokens, index_t(cfg.n_heads) * cfg.head_dim}) {}
};

// Runs qkv_proj_rope on the model. q (T, H, 512) BF16, kv (T, 512) BF16, qr (T, Q_LORA) INT8,
// qr_scale (T) FP32; x_n (T, D) BF16; positions (T) (RoPE rows of `rope`).
inline KernelReport qkv_projection(Machine& m, View<bf16, 3> q, View<bf16, 2> kv,
                                   View<std::int8_t, 2> qr, View<float, 1> qr_scale,
                                   ConstView<bf16, 2> x_n, const QkvWeights& w,
                                   const RopeTableView& rope, ConstView<std::int32_t, 1> positions,
                                   QkvWorkspace& ws, const ModelConfig& cfg) {
  constexpr std::string_view where = "a2a3::qkv_projection";
  const index_t T = x_n.extent(0), D = cfg.hidden, QL = cfg.q_lora, H = cfg.n_heads;
  const index_t HD = cfg.head_dim, NOPE = cfg.nope_dim();
  check_range<index_t>(where, "x_n.extent(0)", T, 1, 17);  // cube rows padded to 16
  check_equal(where, "x_n.extent(1)", x_n.extent(1), D);
  check_equal(where, "wq_a.extent(0)", w.wq_a.extent(0), D);
  check_equal(where, "wq_a.extent(1)", w.wq_a.extent(1), QL);
  check_equal(where, "gamma_cq.extent(0)", w.gamma_cq.extent(0), QL);
  check_equal(where, "wq_b.extent(0)", w.wq_b.extent(0), QL);
  check_equal(where, "wq_b.extent(1)", w.wq_b.extent(1), H * HD);
  check_equal(where, "wq_b_scale.extent(0)", w.wq_b_scale.extent(0), H * HD);
  check_equal(where, "wkv.extent(0)", w.wkv.extent(0), D);
  check_equal(where, "wkv.extent(1)", w.wkv.extent(1), HD);
  check_equal(where, "gamma_ckv.extent(0)", w.gamma_ckv.extent(0), HD);
  check_equal(where, "q.extent(0)", q.extent(0), T);
  check_equal(where, "q.extent(1)", q.extent(1), H);
  check_equal(where, "q.extent(2)", q.extent(2), HD);
  check_equal(where, "kv.extent(0)", kv.extent(0), T);
  check_equal(where, "qr.extent(0)", qr.extent(0), T);
  check_equal(where, "qr.extent(1)", qr.extent(1), QL);
  check_equal(where, "qr_scale.extent(0)", qr_scale.extent(0), T);
  check_equal(where, "positions.extent(0)", positions.extent(0), T);
  check_equal(where, "ws.qi.extent(0)", ws.qi.extent(0), T);
  if (QL % 256 != 0 || (H * HD) % 512 != 0 || D % 512 != 0)
    throw_arg(where, "cfg.q_lora", QL, "a multiple of 256 (with H*512 and D multiples of 512)");
  for (index_t t = 0; t < T; ++t)
    check_range<index_t>(where, "positions[" + std::to_string(t) + "]", positions(t), 0,
                         rope.length());
  constexpr index_t kPad = 16;
  const float eps = cfg.rms_eps;
  m.begin_kernel("qkv_proj_rope");

  // ---- a_mm: [cq_raw | kv_raw] = x_n . [wq_a | wkv]
  const index_t qa_chunks = QL / 128, chunks = qa_chunks + HD / 128;
  m.launch_cube("qkv.a_mm", int(chunks), [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t ch = blk.index;
    const bool is_q = ch < qa_chunks;
    const index_t n0 = (is_q ? ch : ch - qa_chunks) * 128;
    const ConstView<bf16, 2> wsrc = (is_q ? w.wq_a : w.wkv).slice(1, n0, n0 + 128);
    auto x1 = c.alloc<bf16>(Space::l1, "x_n", kPad, D);
    std::array<Tile<bf16>, 2> w1{c.alloc<bf16>(Space::l1, "w[0]", 512, 128),
                                 c.alloc<bf16>(Space::l1, "w[1]", 512, 128)};
    std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "x_l0[0]", kPad, 128),
                                 c.alloc<bf16>(Space::l0a, "x_l0[1]", kPad, 128)};
    std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "w_l0[0]", 128, 128),
                                 c.alloc<bf16>(Space::l0b, "w_l0[1]", 128, 128)};
    auto acc = c.alloc<float>(Space::l0c, "acc", kPad, 128);
    c.copy_in(x1, 0, x_n, "x_n_in");
    int step = 0;
    for (index_t k1 = 0; k1 < D; k1 += 512) {
      auto& wt = w1[std::size_t((k1 / 512) % 2)];
      c.copy_in(wt, 0, wsrc.slice(0, k1, k1 + 512), "w_in");
      for (index_t k0 = 0; k0 < 512; k0 += 128, ++step) {
        const std::size_t s = std::size_t(step % 2);
        c.load_l0(a0[s], x1, 0, kPad, k1 + k0, 128, false, "x_l0");
        c.load_l0(b0[s], wt, k0, 128, 0, 128, /*transpose=*/true, "w_l0");
        c.mmad(acc, a0[s], b0[s], T, 128, 128, k1 + k0 > 0, "a_mmad");
      }
    }
    c.copy_out((is_q ? ws.cq_raw.view() : ws.kv_raw.view()).slice(1, n0, n0 + 128), acc, 0,
               "a_out");
  });

  // ---- norm: cq -> qr / qr_scale; kv -> RMSNorm, RoPE, BF16.
  m.launch_vector("qkv.norm", int(T), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index, pos = positions(t);
    auto cq = v.alloc<float>(Space::ub, "cq", 1, QL);
    auto g1 = v.alloc<bf16>(Space::ub, "gamma_cq", 1, QL);
    auto qq = v.alloc<std::int8_t>(Space::ub, "qr", 1, QL);
    auto qs = v.alloc<float>(Space::ub, "qr_scale", 1, 8);
    auto kf = v.alloc<float>(Space::ub, "kv", 1, HD);
    auto g2 = v.alloc<bf16>(Space::ub, "gamma_ckv", 1, HD);
    auto rot = v.alloc<bf16>(Space::ub, "cos_sin", 2, 64);
    auto kb = v.alloc<bf16>(Space::ub, "kv_bf16", 1, HD);
    v.copy_in(cq, 0, ConstView<float, 2>(ws.cq_raw.view().slice(0, t, t + 1)), "cq_in");
    v.copy_in(g1, 0, ConstView<bf16, 2>(w.gamma_cq.data(), {1, QL}), "gamma_cq_in");
    v.copy_in(kf, 0, ConstView<float, 2>(ws.kv_raw.view().slice(0, t, t + 1)), "kv_in");
    v.copy_in(g2, 0, ConstView<bf16, 2>(w.gamma_ckv.data(), {1, HD}), "gamma_ckv_in");
    v.copy_in(rot, 0, ConstView<bf16, 2>(rope.cos_row(pos), {1, 64}), "cos_in");
    v.copy_in(rot, 1, ConstView<bf16, 2>(rope.sin_row(pos), {1, 64}), "sin_in");
    auto rmsnorm = [&](float* x, const bf16* g, index_t n) {
      float ss = 0;
      for (index_t i = 0; i < n; ++i) ss += x[i] * x[i];
      const float r = 1.0f / std::sqrt(ss / float(n) + eps);
      for (index_t i = 0; i < n; ++i) x[i] = x[i] * r * g[i].to_float();
    };
    v.vec("rmsnorm_cq", QL * 3, 4, {&cq.state(), &g1.state()}, {&cq.state()},
          [&] { rmsnorm(cq.data(), g1.data(), QL); });
    v.vec("quant_qr", QL * 3, 4, {&cq.state()}, {&qq.state(), &qs.state()}, [&] {
      qs(0, 0) = quantize_q8(std::span<std::int8_t>(qq.data(), std::size_t(QL)),
                             std::span<const float>(cq.data(), std::size_t(QL)));
    });
    v.vec("rmsnorm_rope_kv", HD * 5, 4, {&kf.state(), &g2.state(), &rot.state()}, {&kb.state()},
          [&] {
            rmsnorm(kf.data(), g2.data(), HD);
            rope_forward(std::span<float>(kf.data() + NOPE, 64), rot.row(0), rot.row(1));
            for (index_t i = 0; i < HD; ++i) kb(0, i) = bf16(kf(0, i));
          });
    v.copy_out(qr.slice(0, t, t + 1), qq, 0, "qr_out");
    v.copy_out(View<float, 2>(qr_scale.data() + t, {1, 1}), qs, 0, "qr_scale_out");
    v.copy_out(kv.slice(0, t, t + 1), kb, 0, "kv_out");
  });

  // ---- b_mm: qi = qr . wq_b (INT32), 512-column slices, K tiles of 256.
  const index_t slices = (H * HD) / 512;
  const int grid = int(std::min<index_t>(slices, m.arch().cube_cores));
  m.launch_cube("qkv.b_mm", grid, [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    auto a1 = c.alloc<std::int8_t>(Space::l1, "qr", kPad, QL);
    std::array<Tile<std::int8_t>, 2> w1{c.alloc<std::int8_t>(Space::l1, "wq_b[0]", 256, 512),
                                        c.alloc<std::int8_t>(Space::l1, "wq_b[1]", 256, 512)};
    std::array<Tile<std::int8_t>, 2> a0{c.alloc<std::int8_t>(Space::l0a, "qr_l0[0]", kPad, 256),
                                        c.alloc<std::int8_t>(Space::l0a, "qr_l0[1]", kPad, 256)};
    std::array<Tile<std::int8_t>, 2> b0{c.alloc<std::int8_t>(Space::l0b, "w_l0[0]", 128, 256),
                                        c.alloc<std::int8_t>(Space::l0b, "w_l0[1]", 128, 256)};
    std::array<Tile<std::int32_t>, 2> acc{c.alloc<std::int32_t>(Space::l0c, "qi[0]", kPad, 512),
                                          c.alloc<std::int32_t>(Space::l0c, "qi[1]", kPad, 512)};
    c.copy_in(a1, 0, ConstView<std::int8_t, 2>(qr), "qr_in");
    int l1s = 0, l0s = 0, j = 0;
    for (index_t sl = blk.index; sl < slices; sl += grid, ++j) {
      const index_t n0 = sl * 512;
      auto& cc = acc[std::size_t(j % 2)];
      for (index_t kt = 0; kt < QL / 256; ++kt, ++l1s) {
        auto& wt = w1[std::size_t(l1s % 2)];
        c.copy_in(wt, 0, w.wq_b.slice(0, kt * 256, kt * 256 + 256).slice(1, n0, n0 + 512),
                  "wq_b_in");
        auto& al0 = a0[std::size_t(l1s % 2)];
        c.load_l0(al0, a1, 0, kPad, kt * 256, 256, false, "qr_l0");
        for (index_t nc = 0; nc < 4; ++nc, ++l0s) {
          auto& bl0 = b0[std::size_t(l0s % 2)];
          c.load_l0(bl0, wt, 0, 256, nc * 128, 128, /*transpose=*/true, "w_l0");
          c.mmad(cc, al0, bl0, T, 128, 256, kt > 0, "b_mmad", nc * 128);
        }
      }
      c.copy_out(ws.qi.view().slice(1, n0, n0 + 512), cc, 0, "qi_out");
    }
  });

  // ---- q_post: dequant, per-head RMSNorm, RoPE, BF16 (16 heads per block).
  constexpr index_t kHeads = 16;
  const index_t tiles = H / kHeads, cols = kHeads * HD;
  m.launch_vector("qkv.q_post", int(T * tiles), [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    const index_t t = blk.index / tiles, c0 = (blk.index % tiles) * cols, pos = positions(t);
    auto qi = v.alloc<std::int32_t>(Space::ub, "qi", 1, cols);
    auto cs = v.alloc<float>(Space::ub, "col_scale", 1, cols);
    auto f = v.alloc<float>(Space::ub, "qf", kHeads, HD);
    auto rot = v.alloc<bf16>(Space::ub, "cos_sin", 2, 64);
    auto o = v.alloc<bf16>(Space::ub, "q_bf16", kHeads, HD);
    v.copy_in(qi, 0,
              ConstView<std::int32_t, 2>(ws.qi.view().slice(0, t, t + 1).slice(1, c0, c0 + cols)),
              "qi_in");
    v.copy_in(cs, 0, ConstView<float, 2>(w.wq_b_scale.data() + c0, {1, cols}), "scale_in");
    v.copy_in(rot, 0, ConstView<bf16, 2>(rope.cos_row(pos), {1, 64}), "cos_in");
    v.copy_in(rot, 1, ConstView<bf16, 2>(rope.sin_row(pos), {1, 64}), "sin_in");
    const float rs = qr_scale(t);  // scalar read of the norm launch's output
    v.vec(
        "dequant", cols, 4, {&qi.state(), &cs.state()}, {&f.state()},
        [&] {
          for (index_t i = 0; i < cols; ++i) f.data()[i] = float(qi.data()[i]) * rs * cs.data()[i];
        },
        2.0);
    v.vec("head_rmsnorm_rope", cols * 4, 4, {&f.state(), &rot.state()}, {&o.state()}, [&] {
      for (index_t h = 0; h < kHeads; ++h) {
        float* x = f.row(h);
        float ss = 0;
        for (index_t i = 0; i < HD; ++i) ss += x[i] * x[i];
        const float r = 1.0f / std::sqrt(ss / float(HD) + eps);
        for (index_t i = 0; i < HD; ++i) x[i] *= r;
        rope_forward(std::span<float>(x + NOPE, 64), rot.row(0), rot.row(1));
        for (index_t i = 0; i < HD; ++i) o(h, i) = bf16(x[i]);
      }
    });
    v.copy_out(View<bf16, 2>(&q(t, c0 / HD, 0), {kHeads, HD}), o, 0, "q_out");
  });
  return m.end_kernel();
}

}  // namespace tiledecode::a2a3
