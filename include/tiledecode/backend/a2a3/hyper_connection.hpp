#pragma once
// hc_pre / hc_post (kernels/hyper_connection.hpp) on the a2a3 model (FP32 vector arithmetic):
//   hc_pre.mix   vector, 12 x 4 blocks: (2 mix rows, one of 4 K-splits of 4096 inputs) for all
//                tokens: fn rows · x_hc[t] (Mul + WholeReduceSum) -> FP32 partials to GM (the 4
//                K-splits of the reference's target reduction, addendum §11)
//   hc_pre.gates vector, T blocks: the splits summed in ascending order, the RMS scale of x_hc[t],
//                hc_gates on the scalar unit, the mix-in Σ_i pre_i · x_i, BF16
//   hc_post      vector, T x 2 blocks (half a row each): a·post[o] + Σ_i x_i·comb[i][o]

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/a2a3/tile_ops.hpp"
#include "tiledecode/kernels/hyper_connection.hpp"

namespace tiledecode::a2a3 {

namespace hc_detail {
inline constexpr int kSplits = 4;  // K-splits of the mix dot products
inline constexpr int kRowsPerBlock = 2;

// hc_gates (kernels/hyper_connection.hpp) of one token on the scalar unit, FP32. Its scalar
// instruction count, one per FP32 add / mul / compare, 20 per exp (a polynomial), 10 per division:
// 8 sigmoids x 34, 8 gate epilogues, 16 comb pre-activations x 2, 4 row softmaxes x 136, 20 column
// and 19 row normalisations x 176 = 7720.
struct GatesRule {
  static constexpr std::string_view name = "hc_gates";
  static constexpr int kScalarOps = 7720;
  Tile<float> mix, scale_t, base_t, pre, post, comb;  // (1,24), (1,3), (1,24), (1,4), (1,4), (4,4)
  index_t elements() const { return 1; }
  void run() const {
    float scale[3], base[kHcMixes], pr[4], po[4], cb[16], mx[kHcMixes];
    for (int i = 0; i < 3; ++i) scale[i] = scale_t(0, i);
    for (int j = 0; j < kHcMixes; ++j) base[j] = base_t(0, j), mx[j] = mix(0, j);
    kernels::hc_gates<float>(pr, po, cb, mx, scale, base);
    for (int i = 0; i < 4; ++i) pre(0, i) = pr[i], post(0, i) = po[i];
    for (int i = 0; i < 16; ++i) comb(i / 4, i % 4) = cb[i];
  }
};
}  // namespace hc_detail

struct backend_ops_hc_pre {
  // One token's block and the tiles its three per-token ops share.
  struct Lane {
    VectorBlock* blk;
    Tile<float> x, mix, pre;
  };
  static constexpr int kSplits = hc_detail::kSplits;

  // FP32 partial mixes (splits, T, 24).
  static std::size_t workspace_bytes(const A2a3&, const ModelConfig&, index_t T) {
    return GmArena::bytes<float, 3>({kSplits, std::max<index_t>(T, 0), kHcMixes});
  }
  static void check(const A2a3& be, const kernels::HcPreArgs& a) {
    if ((index_t(kHcStreams) * a.cfg->hidden) % kSplits != 0)
      throw_arg("a2a3 hc_pre", "cfg.hidden", a.cfg->hidden, "a multiple of 1 (4 K-splits)");
    const std::size_t need = workspace_bytes(be, *a.cfg, a.tokens());
    if (a.workspace.size() < need)
      throw_arg("a2a3 hc_pre", "workspace.size()", a.workspace.size(),
                ">= " + std::to_string(need) + " (hc_pre_workspace_bytes)");
  }
  static View<float, 3> partials(const kernels::HcPreArgs& a) {
    GmArena g(a.workspace);
    return g.take<float, 3>({kSplits, a.tokens(), kHcMixes});
  }

  static void mixes(const A2a3& be, const kernels::HcPreArgs& a) {
    const index_t T = a.tokens(), n = index_t(kHcStreams) * a.cfg->hidden, kc = n / kSplits;
    const int groups = kHcMixes / hc_detail::kRowsPerBlock;
    const View<float, 3> part = partials(a);
    be.m->launch_vector("hc_pre.mix", groups * kSplits, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      const index_t j0 = index_t(blk.index / kSplits) * hc_detail::kRowsPerBlock;
      const index_t k0 = index_t(blk.index % kSplits) * kc;
      auto fn = v.alloc<float>(Space::ub, "fn", hc_detail::kRowsPerBlock, kc);
      std::array<Tile<float>, 2> x{v.alloc<float>(Space::ub, "x[0]", 1, kc),
                                   v.alloc<float>(Space::ub, "x[1]", 1, kc)};
      auto prod = v.alloc<float>(Space::ub, "prod", 1, kc);
      auto out = v.alloc<float>(Space::ub, "mix", T, hc_detail::kRowsPerBlock);
      v.copy_in(fn, 0, a.w.fn.slice(0, j0, j0 + hc_detail::kRowsPerBlock).slice(1, k0, k0 + kc),
                "fn_in");
      for (index_t t = 0; t < T; ++t) {
        auto& xt = x[std::size_t(t % 2)];
        v.copy_in(xt, 0, ConstView<float, 2>(a.x_hc.data() + t * a.x_hc.stride(0) + k0, {1, kc}),
                  "x_in");
        for (index_t r = 0; r < hc_detail::kRowsPerBlock; ++r) {
          v.vmul(prod, rows_of(fn, r, 1), xt, "mul");
          v.vrow_sum(part_of(out, t, r), prod, "dot");
        }
      }
      v.copy_out(View<float, 2>(&part(blk.index % kSplits, 0, j0), {T, hc_detail::kRowsPerBlock},
                                {kHcMixes, 1}),
                 out, 0, "mix_out");
    });
  }
  template <class Body>
  static void for_tokens(const A2a3& be, const kernels::HcPreArgs& a, Body&& body) {
    be.m->launch_vector("hc_pre.gates", int(a.tokens()), [&](VectorBlock& blk) {
      Lane lane{&blk, {}, {}, {}};
      body(lane, index_t(blk.index));
    });
  }
  // Per token: the splits summed in order, x = x_hc[t] in UB, mix *= 1 / sqrt(mean(x²) + eps).
  static void rms_scale(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    VectorCore& v = z.blk->vec;
    const index_t n = index_t(kHcStreams) * a.cfg->hidden;
    z.x = v.alloc<float>(Space::ub, "x_hc", 1, n);
    auto sq = v.alloc<float>(Space::ub, "x2", 1, n);
    auto r = v.alloc<float>(Space::ub, "r", 1, 1);
    auto p = v.alloc<float>(Space::ub, "partials", kSplits, kHcMixes);
    z.mix = v.alloc<float>(Space::ub, "mix", 1, kHcMixes);
    const View<float, 3> part = partials(a);
    v.copy_in(z.x, 0, ConstView<float, 2>(a.x_hc.data() + t * a.x_hc.stride(0), {1, n}), "x_in");
    v.copy_in(p, 0,
              ConstView<float, 2>(&part(0, t, 0), {kSplits, kHcMixes}, {a.tokens() * kHcMixes, 1}),
              "partials_in");
    v.vcopy(Sub<float>(z.mix), rows_of(p, 0, 1), "split0");
    for (index_t s = 1; s < kSplits; ++s) v.vadd(z.mix, z.mix, rows_of(p, s, 1), "splits");
    a2a3::rms_scale(v, r, z.x, sq, a.cfg->rms_eps);
    v.vmul_rows(z.mix, z.mix, r, "mix_scale");
  }
  static void gates(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    VectorCore& v = z.blk->vec;
    auto sc = v.alloc<float>(Space::ub, "scale", 1, 3);
    auto bs = v.alloc<float>(Space::ub, "base", 1, kHcMixes);
    z.pre = v.alloc<float>(Space::ub, "pre", 1, 4);
    auto post = v.alloc<float>(Space::ub, "post", 1, 4);
    auto comb = v.alloc<float>(Space::ub, "comb", 4, 4);
    v.copy_in(sc, 0, ConstView<float, 2>(a.w.scale.data(), {1, 3}), "scale_in");
    v.copy_in(bs, 0, ConstView<float, 2>(a.w.base.data(), {1, kHcMixes}), "base_in");
    v.scalar_rule(hc_detail::GatesRule{z.mix, sc, bs, z.pre, post, comb},
                  {&z.mix.state(), &sc.state(), &bs.state()},
                  {&z.pre.state(), &post.state(), &comb.state()});
    v.copy_out(a.post.slice(0, t, t + 1), post, 0, "post_out");
    v.copy_out(View<float, 2>(&a.comb(t, 0, 0), {4, 4}), comb, 0, "comb_out");
  }
  static void mix_in(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    VectorCore& v = z.blk->vec;
    const index_t D = a.cfg->hidden;
    auto acc = v.alloc<float>(Space::ub, "x_mixed_f32", 1, D);
    auto o = v.alloc<bf16>(Space::ub, "x_mixed", 1, D);
    v.vmul_rows(acc, part(z.x, 0, 1, 0, D), part(z.pre, 0, 1, 0, 1), "mix_in0");
    for (index_t i = 1; i < kHcStreams; ++i)
      v.vaxpy_rows(acc, part(z.x, 0, 1, i * D, D), part(z.pre, 0, 1, i, 1), "mix_in");
    v.vcast(Sub<bf16>(o), Sub<float>(acc), "cast_bf16");
    v.copy_out(a.x_mixed.slice(0, t, t + 1), o, 0, "x_mixed_out");
  }

 private:
  static Sub<float> part_of(Tile<float> t, index_t r, index_t c, index_t n = 1) {
    return part(t, r, 1, c, n);
  }
};

struct backend_ops_hc_post {
  using Lane = VectorBlock;
  template <class Body>
  static void for_chunks(const A2a3& be, const kernels::HcPostArgs& a, Body&& body) {
    const index_t D = a.cfg->hidden, halves = D >= 1024 ? 2 : 1, w = D / halves;
    be.m->launch_vector("hc_post", int(a.tokens() * halves), [&](VectorBlock& blk) {
      body(blk, index_t(blk.index) / halves, (blk.index % halves) * w, w);
    });
  }
  static void combine(VectorBlock& blk, const kernels::HcPostArgs& a, index_t t, index_t c0,
                      index_t n) {
    VectorCore& v = blk.vec;
    auto ab = v.alloc<bf16>(Space::ub, "attn_out", 1, n);
    auto af = v.alloc<float>(Space::ub, "attn_out_f32", 1, n);
    auto x = v.alloc<float>(Space::ub, "x_hc", kHcStreams, n);
    auto y = v.alloc<float>(Space::ub, "y", 1, n);
    auto pc = v.alloc<float>(Space::ub, "post_comb", 5, 4);
    v.copy_in(ab, 0, a.attn_out.slice(0, t, t + 1).slice(1, c0, c0 + n), "attn_out_in");
    v.copy_in(x, 0, a.x_hc.row(t).slice(1, c0, c0 + n), "x_hc_in");
    v.copy_in(pc, 0, a.post.slice(0, t, t + 1), "post_in");
    v.copy_in(pc, 1, a.comb.row(t), "comb_in");
    v.vcast(Sub<float>(af), Sub<bf16>(ab), "cast_f32");
    for (index_t o = 0; o < kHcStreams; ++o) {
      v.vmul_rows(y, af, part(pc, 0, 1, o, 1), "a_post");
      for (index_t i = 0; i < kHcStreams; ++i)
        v.vaxpy_rows(y, rows_of(x, i, 1), part(pc, 1 + i, 1, o, 1), "x_comb");
      v.copy_out(a.y.row(t).slice(0, o, o + 1).slice(1, c0, c0 + n), y, 0, "y_out");
    }
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::HcPre, a2a3::A2a3> : a2a3::backend_ops_hc_pre {};
template <>
struct backend_ops<kernels::HcPost, a2a3::A2a3> : a2a3::backend_ops_hc_post {};
}  // namespace tiledecode
