#pragma once
// Grouped W8A8 output projection (kernels/output_projection.hpp) on the CPU backend: one chain over
// all groups, each op one parallel stage with a shape-only split (bit-identical for any thread
// count):
//   project_a  o_packed → FP32 once (workspace), then wo_a in tasks of (group, 32 rows): register
//              tiles of 3 weight rows × 4 tokens (each weight vector widened once per 4 tokens,
//              each activation vector loaded once per 3 rows), whole rows per tile so the weights
//              stream as a few long runs;
//   quantize   Q8 per (token, group), plus Σ_r a_i8 per (token, group) (the VNNI tiers'
//              offset correction);
//   project_b  tasks of 32 output channels: two weight rows × up to 4 tokens per register tile
//              (Isa::avx2_vnni / Isa::avx512: 256- / 512-bit vpdpbusd with the weights offset to
//              u8; exact, so bit-identical),
//              every group's INT32 P_g consumed at once by the dequantised group sum and the BF16
//              store — the program's combine is fused here (no INT32 partials in memory).
// With Bf16Dot::exact (every tier) wo_a sums each whole row in double in ascending k straight from
// o_packed (bf16_exact.hpp): o_r is golden's, so Q8 of it rounds as the exact value does.
//
// Rounding check (issue 17): the default dots given wo_a_norm (the row norms that
// decode::LayerWeightsStorage::pack makes, kernels::output_projection_row_norms). The default o_r
// are FP32 block sums a few FP32 ulps from golden's; where that moves a value across a Q8 midpoint,
// or moves the row's amax (the scale of every value of the row and of the combine), one flip
// changes a whole token's outputs. So quantize first lists, per (token, group) row, the values
// whose rounding that error could change (rounding_check.hpp: an interval of half-width κ · 2^-24 ·
// max_k |x[k]| · |w_r| + two FP32 ulps around each o_r; listed if it reaches the largest value's
// interval, or if, scaled by any Q8 scale the repaired amax can give, it holds a midpoint),
// recomputes those as golden does (bf16_pair_dots_exact: ascending-k double sums, 16 at a time),
// and then quantises. Where the interval holds the error the Q8 activations are golden's, so
// attn_out is golden's bytes (every other stage is golden's arithmetic). The bound is measured, not
// proven: every tier's FP32 sums are 64-k blocks of FP32 partials added in double
// (bf16_rows_avx2.hpp, bf16_rows_avx512.hpp), whose worst case, 64 · 2^-24 · Σ|x · w|, would list
// ~2 % of the values; measured, |o_r − exact| stays below 1.9 · 2^-24 · max|x| · |w_r| over 131072
// dots of the layer's statistics on every tier, and κ = 16 keeps 8× above that. A row lists at most
// 16 repairs (ties: many equal values), its own quota (its bits do not depend on its batch); past
// that the rest keep their FP32 sums. Rows with a non-finite x or o_r are not checked (Q8's policy
// applies). Measured on Zen 5 (paired runs in one process): ~80 values repaired per call at T = 8
// (64 of them the rows' amax), T = 8 +1.8-2.4 % (one thread) / +2.0-3.1 % (two), T = 128 +5-7 %
// (docs/compressors.md).
//
// At decode sizes (T = 8) every weight is read once per call: 64 MiB (flash wo_a, BF16) + 32 MiB
// (wo_b, INT8) against 2·T operations per weight element; see docs/sparse_attention.md.
// From 16 tokens the avx512 tier blocks both stages for the caches with the same bits (batch
// invariance: tests/test_oproj.cpp LargeBatchBitIdenticalToSmallBatches): wo_a on
// avx512::bf16_rows_dot_blocked (a lane per token: register tiles of 6 weight rows × 64 tokens,
// the BF16 copy of o_packed packed as each group's token panel of 16-token tiles, tasks of
// kRowsPerBlockedTask rows), wo_b on project_b_blocked (4 channels of one group in L1 × 6-token
// tiles, the groups in order). B = 64, S = 2 (T = 128), one thread, Zen 4 (bench_sparse_attn):
// 154-178 -> 84 ms (37 -> 68 % of the machine's BF16 and INT8 ceilings); B = 4 unchanged (10-12
// ms, memory bound). Zen 5, peer_compare (cold caches), interleaved with the previous wo_a kernel
// (dot-product tiles of 6 rows × 4 tokens): B = 64, S = 2 62.2 -> 46.5 ms (45.8 -> 63.4 % of
// those ceilings), S = 8 225 -> 186 ms (50.7 -> 63.3 %); B = 4, S = 2 9.3 ms both.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/output_projection_avx2.hpp"
#include "tiledecode/backend/cpu/output_projection_avx512.hpp"
#include "tiledecode/backend/cpu/quant.hpp"
#include "tiledecode/backend/cpu/rounding_check.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/output_projection.hpp"

namespace tiledecode::cpu {

namespace output_projection_detail {

inline constexpr int kRowsPerTask = 32;  // wo_a rows per task
// wo_a rows per task of the blocked avx512 kernel: a multiple of its 6-row tiles and 48-row panels
// (and of the lane-per-row pass's 16), so that only a group's last task has a partial tile. A
// shape-only split: each output's sum is the same for any.
inline constexpr int kRowsPerBlockedTask = 96;
inline constexpr int kKChunk = 4096;  // wo_a reduction chunk (whole rows: few, long weight streams)
inline constexpr int kTokTile = 8;    // tokens per a_chunk call (register tiles of 4)
inline constexpr int kChanPerTask = 32;  // wo_b output channels per task

constexpr std::size_t round64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

struct Layout {
  std::size_t of, orr, a, adq, asum, total;  // byte offsets
  Layout(const ModelConfig& cfg, std::size_t T) {
    const std::size_t G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in();
    of = 0;                                         // FP32 [G*T, K]
    orr = of + round64(G * T * K * sizeof(float));  // FP32 [T, G, R]
    a = orr + round64(T * G * R * sizeof(float));   // INT8 [T, G*R]
    adq = a + round64(T * G * R);                   // FP32 [T, G]
    asum = adq + round64(T * G * sizeof(float));    // INT32 [T, G]: Σ_r a_i8 (VNNI offset)
    total = asum + round64(T * G * sizeof(std::int32_t));
  }
};

struct ScalarOps {
  static constexpr bool kBf16Activations = false;  // wo_a reads the FP32 copy of o_packed
  static void a_chunk(float* out, std::int64_t ldout, const float* o, std::int64_t ldo, int nt,
                      const bf16* w, std::int64_t ldw, int nr, int kc, int /*nr_pf*/) {
    // The shared two-level order (8 FP32 lanes per 64-k block, double across blocks): a single
    // running FP32 sum over 4096 products drifts enough to flip Q8 roundings downstream.
    cpu::bf16_rows_dot_scalar<true>(out, ldout, o, ldo, nt, w, ldw, nr, kc);
  }
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* /*a_sum*/, std::int64_t /*ld_sum*/) {
    for (int t = 0; t < nt; ++t)
      for (int c = 0; c < 2; ++c) {
        std::int32_t acc = 0;
        for (int r = 0; r < kr; ++r) acc += std::int32_t(a[t * lda + r]) * w[c * ldw + r];
        p[t * ldp + c] = acc;
      }
  }
};

#if TILEDECODE_X86
struct Avx2Ops {
  static constexpr bool kBf16Activations = false;
  static void a_chunk(float* out, std::int64_t ldout, const float* o, std::int64_t ldo, int nt,
                      const bf16* w, std::int64_t ldw, int nr, int kc, int nr_pf) {
    avx2::oproj_a_chunk(out, ldout, o, ldo, nt, w, ldw, nr, kc, nr_pf);
  }
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* /*a_sum*/, std::int64_t /*ld_sum*/) {
    avx2::oproj_b_pair(p, ldp, a, lda, nt, w, ldw, kr);
  }
};

// avx2_vnni: the avx2 wo_a stage, the vpdpbusd wo_b tile.
struct Avx2VnniOps : Avx2Ops {
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* a_sum, std::int64_t ld_sum) {
    avx2_vnni::oproj_b_pair(p, ldp, a, lda, nt, w, ldw, kr, a_sum, ld_sum);
  }
};
// avx512: wo_a on vdpbf16ps with the BF16 o_packed rows (bf16_rows_avx512.hpp; not the avx2
// order), the 512-bit vpdpbusd wo_b tile.
struct Avx512Ops : Avx2Ops {
  static constexpr bool kBf16Activations = true;  // wo_a reads the BF16 copy of o_packed
  // The copy is a token panel where a_chunk_bf16 takes the blocked kernel and the panel fits the
  // FP32 copy's space (2·T·K BF16 elements).
  static bool panel(index_t T, index_t K) { return avx512::bf16_panel_fits(T, K, 2 * T * K); }
  static index_t panel_elems(index_t T, index_t K) { return avx512::bf16_panel_elems(T, K); }
  static index_t panel_tile_elems(index_t K) { return avx512::bf16_panel_tile_elems(K); }
  static index_t panel_tiles(index_t T) { return avx512::bf16_panel_tiles(T); }
  static index_t panel_offset(index_t k0) { return avx512::bf16_panel_offset(k0); }
  static void pack_panel_tile(bf16* xp, const bf16* x, index_t ld_x, index_t T, index_t K,
                              index_t p) {
    avx512::pack_bf16_panel_tile(xp, x, ld_x, T, K, p);
  }
  static void a_chunk_bf16(float* out, std::int64_t ldout, const bf16* o, std::int64_t ldo, int nt,
                           const bf16* w, std::int64_t ldw, int nr, int kc, int nr_pf) {
    if (nt >= avx512::kBf16BlockedMinTokens) {  // the same bits, blocked for the caches
      // o: the group's token panel at k0 (project_a), ldo: its tile stride.
      avx512::bf16_rows_dot_blocked<true>(out, ldout, o, ldo, nt, w, ldw, nr, kc, nr_pf);
    } else {
      avx512::bf16_rows_dot<true>(out, ldout, o, ldo, nt, w, ldw, nr, kc, nr_pf);
    }
  }
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* a_sum, std::int64_t ld_sum) {
    avx512::oproj_b_pair(p, ldp, a, lda, nt, w, ldw, kr, a_sum, ld_sum);
  }
};
template <Isa I>
using MicroOps =
    std::conditional_t<I == Isa::avx512, Avx512Ops,
                       std::conditional_t<I == Isa::avx2_vnni, Avx2VnniOps,
                                          std::conditional_t<has_avx2(I), Avx2Ops, ScalarOps>>>;
#else
template <Isa>
using MicroOps = ScalarOps;
#endif

// The workspace parts of one call.
template <Isa I>
struct Schedule {
  Cpu<I> be;
  float* of;           // (G*T, K) FP32 o_packed (Ops::kBf16Activations: BF16, same start)
  float* orr;          // (T, G, R) o_r
  std::int8_t* a;      // (T, G*R) Q8 activations
  float* adq;          // (T, G)
  std::int32_t* asum;  // (T, G)
};

}  // namespace output_projection_detail

template <Isa I>
struct backend_ops_output_projection {
  using Ops = output_projection_detail::MicroOps<I>;
  using Sched = output_projection_detail::Schedule<I>;
  using Layout = output_projection_detail::Layout;

  static constexpr int groups_per_chain(int G) { return G; }  // one chain over every group

  // FP32 o_packed copy, FP32 o_r, INT8 activations and their scales (+ 64 bytes of alignment
  // slack); independent of the thread count.
  static std::size_t workspace_bytes(const Cpu<I>&, const ModelConfig& cfg, index_t T) {
    return Layout(cfg, std::size_t(std::max<index_t>(T, 0))).total + 64;
  }
  static void check(const Cpu<I>& be, const kernels::OutputProjectionArgs& a,
                    std::span<const std::byte> ws) {
    const std::size_t need = workspace_bytes(be, *a.cfg, a.tokens());
    if (ws.size() < need)
      throw_arg("output_projection", "workspace.size()", ws.size(),
                ">= " + std::to_string(need) + " (output_projection_workspace_bytes(cfg, T))");
  }
  static Sched schedule(const Cpu<I>& be, const kernels::OutputProjectionArgs& a,
                        std::span<std::byte> workspace) {
    const Layout L(*a.cfg, std::size_t(a.tokens()));
    const auto base = reinterpret_cast<std::uintptr_t>(workspace.data());
    std::byte* ws = workspace.data() + (64 - base % 64) % 64;
    return {be,
            reinterpret_cast<float*>(ws + L.of),
            reinterpret_cast<float*>(ws + L.orr),
            reinterpret_cast<std::int8_t*>(ws + L.a),
            reinterpret_cast<float*>(ws + L.adq),
            reinterpret_cast<std::int32_t*>(ws + L.asum)};
  }

  static void project_a(const Sched& s, const kernels::OutputProjectionArgs& x, int g0, int g1) {
    using namespace output_projection_detail;
    const ModelConfig& cfg = *x.cfg;
    const index_t T = x.tokens(), G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in();
    if (s.be.bf16_dot == Bf16Dot::exact) {
      // Every tier: whole rows summed in double in ascending k straight from o_packed (no copy;
      // bf16_exact.hpp): each o_r is the exact dot rounded once, golden's bits.
      const index_t row_tasks = (R + kExactTaskRows - 1) / kExactTaskRows;
      s.be.tasks((g1 - g0) * row_tasks, [&](std::int64_t task) {
        const index_t g = g0 + task / row_tasks, r0 = (task % row_tasks) * kExactTaskRows;
        bf16_rows_dot_exact(I, s.orr + g * R + r0, G * R, &x.o_packed(g * T, 0),
                            x.o_packed.stride(0), T, &x.wo_a(g, r0, 0), x.wo_a.stride(1),
                            std::min(kExactTaskRows, R - r0), K);
      });
      return;
    }
    [[maybe_unused]] bf16* const ob = reinterpret_cast<bf16*>(s.of);  // the BF16 copy
    // From kBf16BlockedMinTokens tokens the BF16 copy is each group's token panel
    // (avx512::pack_bf16_panel_tile; group g's at ob + g · panel), else rows as o_packed's.
    bool panel = false;
    [[maybe_unused]] index_t panel_elems = T * K;
    if constexpr (Ops::kBf16Activations) {
      panel = Ops::panel(T, K);
      if (panel) {
        panel_elems = Ops::panel_elems(T, K);
        const index_t tiles = Ops::panel_tiles(T);
        s.be.tasks((g1 - g0) * tiles, [&](std::int64_t i) {
          const index_t g = g0 + i / tiles;
          Ops::pack_panel_tile(ob + g * panel_elems, &x.o_packed(g * T, 0), x.o_packed.stride(0), T,
                               K, i % tiles);
        });
      }
    }
    if (!panel) {
      s.be.tasks((g1 - g0) * T, [&](std::int64_t i) {
        const index_t row = g0 * T + i;
        if constexpr (Ops::kBf16Activations) {
          for (index_t k = 0; k < K; ++k) ob[row * K + k] = x.o_packed(row, k);
        } else {
          for (index_t k = 0; k < K; ++k) s.of[row * K + k] = x.o_packed(row, k).to_float();
        }
      });
    }
    for (index_t t = 0; t < T; ++t)
      for (index_t g = g0; g < g1; ++g) std::fill_n(s.orr + (t * G + g) * R, R, 0.0f);
    const index_t task_rows = panel ? kRowsPerBlockedTask : kRowsPerTask;
    const index_t row_tasks = (R + task_rows - 1) / task_rows;
    s.be.tasks((g1 - g0) * row_tasks, [&](std::int64_t task) {
      const index_t g = g0 + task / row_tasks, r0 = (task % row_tasks) * task_rows;
      const int nr = int(std::min<index_t>(task_rows, R - r0));
      const bf16* w = &x.wo_a(g, r0, 0);
      for (index_t k0 = 0; k0 < K; k0 += kKChunk) {
        const int kc = int(std::min<index_t>(kKChunk, K - k0));
        // The avx512 tier takes every token at once (its kernel blocks them for the caches).
        const index_t tok_tile = Ops::kBf16Activations ? T : kTokTile;
        for (index_t t0 = 0; t0 < T; t0 += tok_tile) {
          const int nt = int(std::min<index_t>(tok_tile, T - t0));
          // The rows after this task's, up to the end of the group, may be prefetched.
          if constexpr (Ops::kBf16Activations) {
            if (panel) {  // t0 = 0: every token at once
              Ops::a_chunk_bf16(
                  s.orr + g * R + r0, G * R, ob + g * panel_elems + Ops::panel_offset(k0),
                  Ops::panel_tile_elems(K), nt, w + k0, x.wo_a.stride(1), nr, kc, int(R - r0));
            } else {
              Ops::a_chunk_bf16(s.orr + (t0 * G + g) * R + r0, G * R, ob + (g * T + t0) * K + k0, K,
                                nt, w + k0, x.wo_a.stride(1), nr, kc, int(R - r0));
            }
          } else {
            Ops::a_chunk(s.orr + (t0 * G + g) * R + r0, G * R, s.of + (g * T + t0) * K + k0, K, nt,
                         w + k0, x.wo_a.stride(1), nr, kc, int(R - r0));
          }
        }
      }
    });
  }
  // The rounding check of o_r[t, g, :] for the tokens t0 .. t0 + nt (rows of one group): the
  // values whose Q8 rounding their FP32 error could change (rounding_check.hpp) recomputed as
  // golden computes them (bf16_pair_dots_exact: the exact dot rounded once). See "Rounding check".
  static void check_rows(const Sched& s, const kernels::OutputProjectionArgs& x, index_t g,
                         index_t t0, int nt) {
    const index_t T = x.tokens(), G = x.cfg->o_groups, R = x.cfg->o_lora, K = x.cfg->o_group_in();
    const float* nrm = &x.wo_a_norm(g, 0);
    const float nmax = rounding_check::abs_max(nrm, R);  // validated >= 0 (+Inf: a bound)
    rounding_check::Repairs rep;
    for (int t = 0; t < nt; ++t)
      rounding_check::check_row(I, &x.o_packed(g * T + t0 + t, 0), K,
                                s.orr + ((t0 + t) * G + g) * R, nrm, R, nmax, t, rep, true);
    rounding_check::repair(
        I, rep, K, [&](int t, index_t) { return &x.o_packed(g * T + t0 + t, 0); },
        [&](int, index_t r) { return &x.wo_a(g, r, 0); },
        [&](int t, index_t r, double d) { s.orr[((t0 + t) * G + g) * R + r] = float(d); });
  }
  static void quantize(const Sched& s, const kernels::OutputProjectionArgs& x, int g0, int g1) {
    const index_t T = x.tokens(), G = x.cfg->o_groups, R = x.cfg->o_lora;
    const auto q8 = [&](index_t tg) {  // row tg = t · G + g
      s.adq[tg] = quantize_q8_row(I, s.a + tg * R, s.orr + tg * R, R);
      std::int32_t sum = 0;
      for (index_t r = 0; r < R; ++r) sum += s.a[tg * R + r];
      s.asum[tg] = sum;
    };
    if (x.wo_a_norm.data() != nullptr && s.be.bf16_dot != Bf16Dot::exact) {
      // With the rounding check: tasks of (group, rounding_check::kTokens tokens), whose repairs
      // interleave; each row is quantised after its repairs.
      constexpr index_t C = rounding_check::kTokens;
      const index_t chunks = (T + C - 1) / C;
      s.be.tasks((g1 - g0) * chunks, [&](std::int64_t i) {
        const index_t g = g0 + i / chunks, t0 = (i % chunks) * C;
        const int nt = int(std::min<index_t>(C, T - t0));
        check_rows(s, x, g, t0, nt);
        for (index_t t = t0; t < t0 + nt; ++t) q8(t * G + g);
      });
      return;
    }
    s.be.tasks(T * (g1 - g0),
               [&](std::int64_t i) { q8((i / (g1 - g0)) * G + g0 + i % (g1 - g0)); });
  }
  // P_g of every group for a 32-channel task, dequantised and summed over g in order while in
  // registers (golden's combine: exact products adq · P_g, double sums in ascending g, the scale in
  // double, one rounding to FP32 then BF16), then scaled and rounded: the program's combine happens
  // here.
  static void project_b(const Sched& s, const kernels::OutputProjectionArgs& x, int g0, int g1) {
    using namespace output_projection_detail;
    const index_t T = x.tokens(), G = x.cfg->o_groups, R = x.cfg->o_lora, N = x.cfg->hidden;
    const index_t chan_tasks = (N + kChanPerTask - 1) / kChanPerTask;
#if TILEDECODE_X86
    if constexpr (I == Isa::avx512) {
      if (T >= avx512::kOprojBBlockedMinTokens) return project_b_blocked(s, x, g0, g1);
    }
#endif
    s.be.tasks(chan_tasks, [&](std::int64_t task) {
      const index_t n0 = task * kChanPerTask, n1 = std::min<index_t>(N, n0 + kChanPerTask);
      constexpr int kTok = 16;
      for (index_t t0 = 0; t0 < T; t0 += kTok) {
        const int nt = int(std::min<index_t>(kTok, T - t0));
        for (index_t n = n0; n < n1; n += 2) {
          // Odd channel count: pair the last channel with itself and keep one result.
          const index_t n2 = std::min(n + 1, n1 - 1);
          const std::int8_t* w = &x.wo_b(n, 0);
          const std::int64_t ldw = &x.wo_b(n2, 0) - w;
          double acc[kTok][2] = {};  // golden's combine: exact products, double sums
          for (index_t g = g0; g < g1; ++g) {
            std::int32_t p[kTok][2];
            Ops::b_pair(&p[0][0], 2, s.a + t0 * G * R + g * R, G * R, nt, w + g * R, ldw, int(R),
                        s.asum + t0 * G + g, G);
            for (int t = 0; t < nt; ++t)
              for (int c = 0; c < 2; ++c)
                acc[t][c] += double(s.adq[(t0 + t) * G + g]) * double(p[t][c]);
          }
          for (int t = 0; t < nt; ++t) {
            x.attn_out(t0 + t, n) = bf16(float(double(x.wo_b_scale(n)) * acc[t][0]));
            if (n2 != n) x.attn_out(t0 + t, n2) = bf16(float(double(x.wo_b_scale(n2)) * acc[t][1]));
          }
        }
      }
    });
  }
#if TILEDECODE_X86
  // project_b's bits for many tokens on the avx512 tier: per 32-channel task and chunk of tokens,
  // the groups in ascending order, each group's 4-channel weight blocks (L1) run over every token
  // tile of the chunk (avx512::oproj_b_group), the double group sums kept in a 64 × 32 stack tile.
  static void project_b_blocked(const Sched& s, const kernels::OutputProjectionArgs& x, int g0,
                                int g1) {
    using namespace output_projection_detail;
    constexpr int kRows = avx512::kOprojBRows, kTile = avx512::kOprojBTileTokens;
    constexpr int kChunk = avx512::kOprojBChunkTokens;
    const index_t T = x.tokens(), G = x.cfg->o_groups, R = x.cfg->o_lora, N = x.cfg->hidden;
    const index_t chan_tasks = (N + kChanPerTask - 1) / kChanPerTask;
    const std::int64_t ldw = x.wo_b.stride(0);
    s.be.tasks(chan_tasks, [&](std::int64_t task) {
      const index_t n0 = task * kChanPerTask, n1 = std::min<index_t>(N, n0 + kChanPerTask);
      for (index_t t0 = 0; t0 < T; t0 += kChunk) {
        const index_t nch = std::min<index_t>(kChunk, T - t0);
        double acc[kChunk][kChanPerTask] = {};
        for (index_t g = g0; g < g1; ++g)
          for (index_t c0 = n0; c0 < n1; c0 += kRows)
            for (index_t tt = 0; tt < nch; tt += kTile) {
              const index_t t = t0 + tt;
              avx512::oproj_b_group(
                  &acc[tt][c0 - n0], kChanPerTask, int(std::min<index_t>(kTile, nch - tt)),
                  int(std::min<index_t>(kRows, n1 - c0)), s.a + t * G * R + g * R, G * R,
                  &x.wo_b(c0, g * R), ldw, s.adq + t * G + g, s.asum + t * G + g, G, int(R));
            }
        for (index_t t = 0; t < nch; ++t)
          for (index_t n = n0; n < n1; ++n)
            x.attn_out(t0 + t, n) = bf16(float(double(x.wo_b_scale(n)) * acc[t][n - n0]));
      }
    });
  }
#endif
  static void combine(const Sched&, const kernels::OutputProjectionArgs&) {}  // fused above
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::OutputProjection, cpu::Cpu<I>> : cpu::backend_ops_output_projection<I> {
};
}  // namespace tiledecode

namespace tiledecode::kernels {
// The CPU workspace for T tokens (independent of the thread count).
inline std::size_t output_projection_workspace_bytes(const ModelConfig& cfg, index_t T) {
  return cpu::output_projection_detail::Layout(cfg, std::size_t(std::max<index_t>(T, 0))).total +
         64;
}
}  // namespace tiledecode::kernels
