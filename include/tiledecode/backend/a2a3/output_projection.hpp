#pragma once
// Grouped W8A8 output projection (kernels/output_projection.hpp) on the a2a3 model, after the
// device design of spec §8.6 item 5: one chain per group g — the groups have a manual dependency
// chain so that they pipeline — of three launches, then one combine launch:
//   proj_a.g    cube, O_LORA/128 blocks (N fragments of 128, K tile 256): o_r[:, g] =
//               o_packed[g] · wo_a[g]ᵀ, T padded to 16 rows
//   quant.g     vector, T blocks: Q8 of (token, g) over O_LORA (abs, row max, floor, 127/amax,
//               scale, clamp, cast)
//   proj_b.g    cube, D/512 blocks (D chunks of 512, K tile 256): INT32 partial P_g (T_PAD rows)
//   proj_b_act  vector, T x 4 blocks: Σ_g a_dq[g] · P_g in group order, x wo_b_scale, BF16
// The model runs launches one after another (machine.hpp), so the chain's pipelining across groups
// is not credited: each launch pays its launch overhead and its own HBM/port bound.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/tile_ops.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/output_projection.hpp"

namespace tiledecode::a2a3 {

namespace output_projection_detail {

inline constexpr index_t kPad = 16;  // cube row tile (T = 8 pads to 16)
inline constexpr index_t kK = 256;   // L0 reduction depth

struct Scratch {
  View<float, 3> o_r;             // (T, G, R)
  View<std::int8_t, 3> a_i8;      // (T, G, R)
  View<float, 2> a_dq;            // (T, G)
  View<std::int32_t, 2> partial;  // (T_PAD, G*D)
  static std::size_t bytes(const ModelConfig& cfg, index_t T) {
    const index_t G = cfg.o_groups, R = cfg.o_lora, D = cfg.hidden;
    const index_t TP = (T + kPad - 1) / kPad * kPad;
    return GmArena::bytes<float, 3>({T, G, R}) + GmArena::bytes<std::int8_t, 3>({T, G, R}) +
           GmArena::bytes<float, 2>({T, G}) + GmArena::bytes<std::int32_t, 2>({TP, G * D});
  }
  Scratch(std::span<std::byte> ws, const ModelConfig& cfg, index_t T) {
    const index_t G = cfg.o_groups, R = cfg.o_lora, D = cfg.hidden;
    const index_t TP = (T + kPad - 1) / kPad * kPad;
    GmArena g(ws);
    o_r = g.take<float, 3>({T, G, R});
    a_i8 = g.take<std::int8_t, 3>({T, G, R});
    a_dq = g.take<float, 2>({T, G});
    partial = g.take<std::int32_t, 2>({TP, G * D});
  }
};

struct Sched {
  A2a3 be;
  Scratch sc;
};

inline std::string group_name(std::string_view base, int g) {
  return std::string(base) + ".g" + std::to_string(g);
}

}  // namespace output_projection_detail

struct backend_ops_output_projection {
  using Sched = output_projection_detail::Sched;
  using Scratch = output_projection_detail::Scratch;
  static constexpr index_t kPad = output_projection_detail::kPad;
  static constexpr index_t kK = output_projection_detail::kK;

  static constexpr int groups_per_chain(int) { return 1; }  // one chain per group

  static const char* unsupported(const ModelConfig& cfg) {
    if (cfg.o_lora % 128 != 0) return "o_lora not a multiple of 128 (N fragments)";
    if (cfg.o_group_in() % kK != 0) return "o_group_in not a multiple of 256 (K tiles)";
    if (cfg.hidden % 512 != 0) return "hidden not a multiple of 512 (D chunks)";
    return nullptr;
  }
  static std::size_t workspace_bytes(const A2a3&, const ModelConfig& cfg, index_t T) {
    return Scratch::bytes(cfg, T);
  }
  static void check(const A2a3& be, const kernels::OutputProjectionArgs& a,
                    std::span<const std::byte> ws) {
    if (const char* why = unsupported(*a.cfg))
      throw_arg("a2a3 output_projection", "cfg", std::string(a.cfg->name), why);
    if (a.tokens() > kPad)
      throw_arg("a2a3 output_projection", "attn_out.extent(0)", a.tokens(),
                "<= 16 (one cube row tile)");
    const std::size_t need = workspace_bytes(be, *a.cfg, a.tokens());
    if (ws.size() < need)
      throw_arg("a2a3 output_projection", "workspace.size()", ws.size(),
                ">= " + std::to_string(need) + " (output_projection_workspace_bytes)");
  }
  static Sched schedule(const A2a3& be, const kernels::OutputProjectionArgs& a,
                        std::span<std::byte> ws) {
    return {be, Scratch(ws, *a.cfg, a.tokens())};
  }

  // proj_a.g: per 128-wide N fragment, o_r = o_packed[g] · wo_a[g]ᵀ over K tiles of 256.
  static void project_a(Sched& s, const kernels::OutputProjectionArgs& x, int g, int) {
    const ModelConfig& cfg = *x.cfg;
    const index_t T = x.tokens(), G = cfg.o_groups, R = cfg.o_lora, KI = cfg.o_group_in();
    const index_t nfr = R / 128;
    s.be.m->launch_cube(
        output_projection_detail::group_name("o_proj.proj_a", g), int(nfr), [&](CubeBlock& blk) {
          CubeCore& c = blk.cube;
          const index_t n0 = index_t(blk.index) * 128;
          auto a1 = c.alloc<bf16>(Space::l1, "o_packed", kPad, KI);
          std::array<Tile<bf16>, 2> b1{c.alloc<bf16>(Space::l1, "wo_a[0]", 128, kK),
                                       c.alloc<bf16>(Space::l1, "wo_a[1]", 128, kK)};
          // L0B holds (128 x 128) BF16 = 32 KiB, double buffered: each K tile of 256 is 2 L0 steps.
          std::array<Tile<bf16>, 2> a0{c.alloc<bf16>(Space::l0a, "a_l0[0]", kPad, 128),
                                       c.alloc<bf16>(Space::l0a, "a_l0[1]", kPad, 128)};
          std::array<Tile<bf16>, 2> b0{c.alloc<bf16>(Space::l0b, "b_l0[0]", 128, 128),
                                       c.alloc<bf16>(Space::l0b, "b_l0[1]", 128, 128)};
          auto acc = c.alloc<float>(Space::l0c, "o_r", kPad, 128);
          c.copy_in(a1, 0, x.o_packed.slice(0, g * T, g * T + T), "o_packed_in");
          int step = 0;
          for (index_t kt = 0; kt < KI / kK; ++kt) {
            const std::size_t b = std::size_t(kt % 2);
            c.copy_in(b1[b], 0,
                      x.wo_a.row(g).slice(0, n0, n0 + 128).slice(1, kt * kK, kt * kK + kK),
                      "wo_a_in");
            for (index_t h = 0; h < kK / 128; ++h, ++step) {
              const std::size_t u = std::size_t(step % 2);
              c.load_l0(a0[u], a1, 0, kPad, kt * kK + h * 128, 128, false, "a_l0");
              c.load_l0(b0[u], b1[b], 0, 128, h * 128, 128, false, "b_l0");
              c.mmad(acc, a0[u], b0[u], T, 128, 128, step > 0, "proj_a_mmad");
            }
          }
          c.copy_out(View<float, 2>(&s.sc.o_r(0, g, n0), {T, 128}, {G * R, 1}), acc, 0, "o_r_out");
        });
  }
  // quant.g: Q8 per (token, g) over O_LORA (spec §2): amax = max(|x|, 1e-4), sq = 127 / amax,
  // q = rint(x · sq) clamped to ±127, dq = 1 / sq.
  static void quantize(Sched& s, const kernels::OutputProjectionArgs& x, int g, int) {
    const index_t T = x.tokens(), R = x.cfg->o_lora;
    s.be.m->launch_vector(
        output_projection_detail::group_name("o_proj.quant", g), int(T), [&](VectorBlock& blk) {
          VectorCore& v = blk.vec;
          const index_t t = blk.index;
          auto xr = v.alloc<float>(Space::ub, "o_r", 1, R);
          auto ab = v.alloc<float>(Space::ub, "abs", 1, R);
          auto q = v.alloc<std::int8_t>(Space::ub, "a_i8", 1, R);
          auto sq = v.alloc<float>(Space::ub, "scale", 1, 1);
          auto dq = v.alloc<float>(Space::ub, "a_dq", 1, 1);
          v.copy_in(xr, 0, ConstView<float, 2>(&s.sc.o_r(t, g, 0), {1, R}), "o_r_in");
          a2a3::quantize_rows(v, xr, ab, q, sq, dq);
          v.copy_out(View<std::int8_t, 2>(&s.sc.a_i8(t, g, 0), {1, R}), q, 0, "a_i8_out");
          v.copy_out(View<float, 2>(&s.sc.a_dq(t, g), {1, 1}), dq, 0, "a_dq_out");
        });
  }
  // proj_b.g: per 512-wide D chunk, the INT32 partial P_g = a_i8[:, g] · wo_b[n, g·R ..]ᵀ.
  static void project_b(Sched& s, const kernels::OutputProjectionArgs& x, int g, int) {
    const ModelConfig& cfg = *x.cfg;
    const index_t T = x.tokens(), G = cfg.o_groups, R = cfg.o_lora, D = cfg.hidden;
    const index_t dch = D / 512;
    s.be.m->launch_cube(
        output_projection_detail::group_name("o_proj.proj_b", g), int(dch), [&](CubeBlock& blk) {
          CubeCore& c = blk.cube;
          const index_t n0 = index_t(blk.index) * 512;
          auto a1 = c.alloc<std::int8_t>(Space::l1, "a_i8", kPad, R);
          std::array<Tile<std::int8_t>, 2> b1{c.alloc<std::int8_t>(Space::l1, "wo_b[0]", 512, kK),
                                              c.alloc<std::int8_t>(Space::l1, "wo_b[1]", 512, kK)};
          std::array<Tile<std::int8_t>, 2> a0{
              c.alloc<std::int8_t>(Space::l0a, "a_l0[0]", kPad, kK),
              c.alloc<std::int8_t>(Space::l0a, "a_l0[1]", kPad, kK)};
          std::array<Tile<std::int8_t>, 2> b0{c.alloc<std::int8_t>(Space::l0b, "b_l0[0]", 128, kK),
                                              c.alloc<std::int8_t>(Space::l0b, "b_l0[1]", 128, kK)};
          auto acc = c.alloc<std::int32_t>(Space::l0c, "partial", kPad, 512);
          c.copy_in(a1, 0, ConstView<std::int8_t, 2>(&s.sc.a_i8(0, g, 0), {T, R}, {G * R, 1}),
                    "a_i8_in");
          int step = 0;
          for (index_t kt = 0; kt < R / kK; ++kt) {
            const std::size_t b = std::size_t(kt % 2);
            c.copy_in(b1[b], 0,
                      x.wo_b.slice(0, n0, n0 + 512).slice(1, g * R + kt * kK, g * R + kt * kK + kK),
                      "wo_b_in");
            c.load_l0(a0[b], a1, 0, kPad, kt * kK, kK, false, "a_l0");
            for (index_t nc = 0; nc < 4; ++nc, ++step) {
              auto& bm = b0[std::size_t(step % 2)];
              c.load_l0(bm, b1[b], nc * 128, 128, 0, kK, false, "b_l0");
              c.mmad(acc, a0[b], bm, T, 128, kK, kt > 0, "proj_b_mmad", nc * 128);
            }
          }
          // FIXPIPE writes the whole 16-row tile (T padded; spec §8.6 item 5: INT32 [T_PAD,
          // 8*4096]).
          c.copy_out(View<std::int32_t, 2>(&s.sc.partial(0, g * D + n0), {kPad, 512}, {G * D, 1}),
                     acc, 0, "partial_out");
        });
  }
  // proj_b_act: attn_out = bf16(wo_b_scale · Σ_g a_dq[g] · P_g), groups summed in order.
  static void combine(Sched& s, const kernels::OutputProjectionArgs& x) {
    const ModelConfig& cfg = *x.cfg;
    const index_t T = x.tokens(), G = cfg.o_groups, D = cfg.hidden;
    const index_t quarters = 4, qw = D / quarters;
    s.be.m->launch_vector("o_proj.proj_b_act", int(T * quarters), [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      const index_t t = blk.index / quarters, n0 = (blk.index % quarters) * qw;
      auto p = v.alloc<std::int32_t>(Space::ub, "partials", G, qw);
      auto pf = v.alloc<float>(Space::ub, "partials_f32", G, qw);
      auto dq = v.alloc<float>(Space::ub, "a_dq", 1, G);
      auto ws = v.alloc<float>(Space::ub, "wo_b_scale", 1, qw);
      auto acc = v.alloc<float>(Space::ub, "acc", 1, qw);
      auto o = v.alloc<bf16>(Space::ub, "attn_out", 1, qw);
      v.copy_in(p, 0, ConstView<std::int32_t, 2>(&s.sc.partial(t, n0), {G, qw}, {D, 1}),
                "partials_in");
      v.copy_in(dq, 0, ConstView<float, 2>(&s.sc.a_dq(t, 0), {1, G}), "a_dq_in");
      v.copy_in(ws, 0, ConstView<float, 2>(x.wo_b_scale.data() + n0, {1, qw}), "wo_b_scale_in");
      v.vcast(Sub<float>(pf), Sub<std::int32_t>(p), "cast_f32");
      v.vmul_rows(pf, pf, dq, "dequant");
      v.vcopy(Sub<float>(acc), rows_of(pf, 0, 1), "sum_g0");
      for (index_t g = 1; g < G; ++g) v.vadd(acc, acc, rows_of(pf, g, 1), "sum_g");
      v.vmul(acc, acc, ws, "wo_b_scale");
      v.vcast(Sub<bf16>(o), Sub<float>(acc), "cast_bf16");
      v.copy_out(x.attn_out.slice(0, t, t + 1).slice(1, n0, n0 + qw), o, 0, "attn_out");
    });
  }
};

}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::OutputProjection, a2a3::A2a3> : a2a3::backend_ops_output_projection {};
}  // namespace tiledecode
