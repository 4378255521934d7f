#pragma once
// q / kv projection with RoPE (kernels/qkv_projection.hpp) on the a2a3 model:
//   a_mm     cube, 12 blocks: x_n (T x D, padded to 16 rows) . [wq_a | wkv] in 128-column
//            chunks (8 of wq_a, 4 of wkv), K streamed in double-buffered 512 x 128 BF16 L1
//            tiles, transposed L1 -> L0B loads (the weights are stored (K, N)) -> FP32 GM
//   norm     vector, T blocks: RMSNorm x gamma_cq, Q8 -> qr / qr_scale; RMSNorm x gamma_ckv,
//            RoPE at pos_t, BF16 -> kv
//   b_mm     cube, 24 blocks: qr (T x 1024 INT8) . wq_b (1024 x 32768) in 512-column slices,
//            K in 4 tiles of 256 -> INT32 GM (T, H*512)
//   q_post   vector, T x H/16 blocks of 16 heads: dequant, per-head RMSNorm, RoPE, BF16 -> q
// FP32 vector arithmetic throughout (the CPU runs the epilogues in double).

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
#include "tiledecode/kernels/qkv_projection.hpp"

namespace tiledecode::a2a3 {

struct backend_ops_qkv_projection {
  static constexpr index_t kPad = 16;    // cube rows (T padded to 16)
  static constexpr index_t kHeads = 16;  // heads per q_post block

  static const char* unsupported(const ModelConfig& cfg) {
    if (cfg.q_lora % 256 != 0 || (cfg.n_heads * cfg.head_dim) % 512 != 0 || cfg.hidden % 512 != 0)
      return "q_lora not a multiple of 256, or H*512 / D not multiples of 512";
    if (cfg.n_heads % kHeads != 0 && cfg.n_heads > kHeads) return "n_heads not a multiple of 16";
    return nullptr;
  }
  // The INT32 products qr · wq_b (T, H*512).
  static std::size_t workspace_bytes(const A2a3&, const ModelConfig& cfg, index_t T) {
    return GmArena::bytes<std::int32_t, 2>(
        {std::max<index_t>(T, 0), index_t(cfg.n_heads) * cfg.head_dim});
  }
  static void check(const A2a3& be, const kernels::QkvArgs& a) {
    if (const char* why = unsupported(*a.cfg))
      throw_arg("a2a3 qkv_projection", "cfg", std::string(a.cfg->name), why);
    check_range<index_t>("a2a3 qkv_projection", "x_n.extent(0)", a.tokens(), 0, kPad + 1);
    const std::size_t need = workspace_bytes(be, *a.cfg, a.tokens());
    if (a.s.extra.size() < need)
      throw_arg("a2a3 qkv_projection", "scratch.extra.size()", a.s.extra.size(),
                ">= " + std::to_string(need) + " (qkv_projection_workspace_bytes)");
  }
  static View<std::int32_t, 2> products(const kernels::QkvArgs& a) {
    GmArena g(a.s.extra);
    return g.take<std::int32_t, 2>({a.tokens(), index_t(a.cfg->n_heads) * a.cfg->head_dim});
  }

  // a_mm: [cq_raw | kv_raw] = x_n . [wq_a | wkv] into the scratch's cq / kvf.
  static void project_a(const A2a3& be, const kernels::QkvArgs& a) {
    Machine& m = *be.m;
    const ModelConfig& cfg = *a.cfg;
    const index_t T = a.tokens(), D = cfg.hidden, QL = cfg.q_lora, HD = cfg.head_dim;
    const QkvWeights& w = a.w;
    const ConstView<bf16, 2> x_n = a.x_n;
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
      c.copy_out((is_q ? a.s.cq : a.s.kvf).slice(1, n0, n0 + 128), acc, 0, "a_out");
    });
  }

  using Lane = VectorBlock;
  template <class Body>
  static void for_tokens(const A2a3& be, const kernels::QkvArgs& a, Body&& body) {
    be.m->launch_vector("qkv.norm", int(a.tokens()),
                        [&](VectorBlock& blk) { body(blk, index_t(blk.index)); });
  }
  // cq = rmsnorm(cq_raw)·gamma_cq; qr, qr_scale = Q8(cq).
  static void q_latent(VectorBlock& blk, const kernels::QkvArgs& a, index_t t) {
    VectorCore& v = blk.vec;
    const index_t QL = a.cfg->q_lora;
    auto cq = v.alloc<float>(Space::ub, "cq", 1, QL);
    auto gb = v.alloc<bf16>(Space::ub, "gamma_cq", 1, QL);
    auto g = v.alloc<float>(Space::ub, "gamma_cq_f32", 1, QL);
    auto sq = v.alloc<float>(Space::ub, "scratch", 1, QL);
    auto r = v.alloc<float>(Space::ub, "r", 1, 1);
    auto qq = v.alloc<std::int8_t>(Space::ub, "qr", 1, QL);
    auto qs = v.alloc<float>(Space::ub, "q_scale", 1, 1);
    auto dq = v.alloc<float>(Space::ub, "qr_scale", 1, 1);
    v.copy_in(cq, 0, ConstView<float, 2>(a.s.cq.slice(0, t, t + 1)), "cq_in");
    v.copy_in(gb, 0, ConstView<bf16, 2>(a.w.gamma_cq.data(), {1, QL}), "gamma_cq_in");
    v.vcast(Sub<float>(g), Sub<bf16>(gb), "cast_gamma");
    rms_scale(v, r, cq, sq, a.cfg->rms_eps);
    v.vmul_rows(cq, cq, r, "mul_r");
    v.vmul(cq, cq, g, "mul_gamma");
    quantize_rows(v, cq, sq, qq, qs, dq);
    v.copy_out(a.qr.slice(0, t, t + 1), qq, 0, "qr_out");
    v.copy_out(View<float, 2>(a.qr_scale.data() + t, {1, 1}), dq, 0, "qr_scale_out");
  }
  // kv = bf16(rope(rmsnorm(kv_raw)·gamma_ckv)) at pos_t.
  static void kv_row(VectorBlock& blk, const kernels::QkvArgs& a, index_t t) {
    VectorCore& v = blk.vec;
    const index_t HD = a.cfg->head_dim, NOPE = a.cfg->nope_dim();
    auto kf = v.alloc<float>(Space::ub, "kv", 1, HD);
    auto gb = v.alloc<bf16>(Space::ub, "gamma_ckv", 1, HD);
    auto g = v.alloc<float>(Space::ub, "gamma_ckv_f32", 1, HD);
    auto sq = v.alloc<float>(Space::ub, "kv2", 1, HD);
    auto r = v.alloc<float>(Space::ub, "r", 1, 1);
    auto rot = v.alloc<float>(Space::ub, "cos_sin", 2, 64);
    auto half = v.alloc<float>(Space::ub, "cos_sin_half", 2, 32);
    auto rb = v.alloc<bf16>(Space::ub, "cos_sin_bf16", 2, 32);
    auto tmp = v.alloc<float>(Space::ub, "rope_tmp", 1, 64);
    auto kb = v.alloc<bf16>(Space::ub, "kv_bf16", 1, HD);
    v.copy_in(kf, 0, ConstView<float, 2>(a.s.kvf.slice(0, t, t + 1)), "kv_in");
    v.copy_in(gb, 0, ConstView<bf16, 2>(a.w.gamma_ckv.data(), {1, HD}), "gamma_ckv_in");
    rope_rows(v, rot, half, rb, a.rope, a.positions(t), false);
    v.vcast(Sub<float>(g), Sub<bf16>(gb), "cast_gamma");
    rms_scale(v, r, kf, sq, a.cfg->rms_eps);
    v.vmul_rows(kf, kf, r, "mul_r");
    v.vmul(kf, kf, g, "mul_gamma");
    rope_rotate(v, part(kf, 0, 1, NOPE, 64), tmp, rot);
    v.vcast(Sub<bf16>(kb), Sub<float>(kf), "cast_bf16");
    v.copy_out(a.kv.slice(0, t, t + 1), kb, 0, "kv_out");
  }

  // b_mm (cube) into the INT32 products, then q_post (vector).
  static void project_b(const A2a3& be, const kernels::QkvArgs& a) {
    Machine& m = *be.m;
    const ModelConfig& cfg = *a.cfg;
    const index_t T = a.tokens(), QL = cfg.q_lora, H = cfg.n_heads, HD = cfg.head_dim;
    const QkvWeights& w = a.w;
    const ConstView<std::int8_t, 2> qr = a.qr;
    const View<std::int32_t, 2> qi_gm = products(a);
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
        c.copy_out(qi_gm.slice(1, n0, n0 + 512), cc, 0, "qi_out");
      }
    });

    q_post(be, a, qi_gm);
  }
  // q_post: dequant acc·qr_scale·wq_b_scale, per-head RMSNorm (no weight), RoPE, BF16.
  static void q_post(const A2a3& be, const kernels::QkvArgs& a, View<std::int32_t, 2> qi_gm) {
    const ModelConfig& cfg = *a.cfg;
    const index_t T = a.tokens(), H = cfg.n_heads, HD = cfg.head_dim, NOPE = cfg.nope_dim();
    const index_t nh = std::min<index_t>(kHeads, H), tiles = H / nh, cols = nh * HD;
    be.m->launch_vector("qkv.q_post", int(T * tiles), [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      const index_t t = blk.index / tiles, c0 = (blk.index % tiles) * cols;
      auto qi = v.alloc<std::int32_t>(Space::ub, "qi", nh, HD);
      auto cs = v.alloc<float>(Space::ub, "col_scale", nh, HD);
      auto f = v.alloc<float>(Space::ub, "qf", nh, HD);
      auto sq = v.alloc<float>(Space::ub, "qf2", nh, HD);
      auto r = v.alloc<float>(Space::ub, "r", 1, nh);
      auto qs = v.alloc<float>(Space::ub, "qr_scale", 1, 1);
      auto rot = v.alloc<float>(Space::ub, "cos_sin", 2, 64);
      auto half = v.alloc<float>(Space::ub, "cos_sin_half", 2, 32);
      auto rb = v.alloc<bf16>(Space::ub, "cos_sin_bf16", 2, 32);
      auto tmp = v.alloc<float>(Space::ub, "rope_tmp", nh, 64);
      auto o = v.alloc<bf16>(Space::ub, "q_bf16", nh, HD);
      v.copy_in(qi, 0, ConstView<std::int32_t, 2>(&qi_gm(t, c0), {nh, HD}, {HD, 1}), "qi_in");
      v.copy_in(cs, 0, ConstView<float, 2>(a.w.wq_b_scale.data() + c0, {nh, HD}), "scale_in");
      v.copy_in(qs, 0, ConstView<float, 2>(a.qr_scale.data() + t, {1, 1}), "qr_scale_in");
      rope_rows(v, rot, half, rb, a.rope, a.positions(t), false);
      v.vcast(Sub<float>(f), Sub<std::int32_t>(qi), "cast_f32");
      v.vmul_scalar(f, f, qs, "mul_qr_scale");
      v.vmul(f, f, cs, "mul_col_scale");
      rms_scale(v, r, f, sq, cfg.rms_eps);
      v.vmul_rows(f, f, r, "head_norm");
      rope_rotate(v, part(f, 0, nh, NOPE, 64), tmp, rot);
      v.vcast(Sub<bf16>(o), Sub<float>(f), "cast_bf16");
      v.copy_out(View<bf16, 2>(&a.q(t, c0 / HD, 0), {nh, HD}, {a.q.stride(1), 1}), o, 0, "q_out");
    });
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::QkvProjection, a2a3::A2a3> : a2a3::backend_ops_qkv_projection {};
}  // namespace tiledecode
