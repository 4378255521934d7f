#pragma once
// Grouped W8A8 output projection (spec §8.5):
//   o_r[t,g,:]    = o_packed[g*T+t, :] @ wo_a[g]^T          FP32 accumulate, BF16 weights
//   a_i8, a_dq    = Q8(o_r[t,g,:])                          per (token, group) over O_LORA
//   P_g[t,n]      = Σ_r a_i8[t,g,r] · wo_b[n, g*O_LORA + r]  exact INT32
//   attn_out[t,n] = bf16(wo_b_scale[n] · Σ_g a_dq[t,g] · P_g[t,n])  (groups summed in order g =
//   0..)
//
// Three phases, each parallel over a shape-only split (bit-identical for any thread count):
//   1. o_packed → FP32 once (workspace), so the wo_a loop reads activations without conversion;
//   2. wo_a: tasks of (group, 32 rows); register tiles of 3 weight rows × 4 tokens (each weight
//      vector widened once per 4 tokens, each activation vector loaded once per 3 rows), whole
//      rows per tile so the weights stream as a few long runs; then Q8 per (token, group);
//   3. wo_b: tasks of 32 output channels; two weight rows × up to 4 tokens per register tile
//      (Isa::avx2_vnni: vpdpbusd with the weights offset to u8; the per-(token, group)
//      activation sums that undo the offset are taken in phase 2; exact, so bit-identical).
// At decode sizes (T = 8) every weight is read once per call: 64 MiB (flash wo_a, BF16) + 32 MiB
// (wo_b, INT8) against 2·T operations per weight element. On one core of the development machine
// the compute roofline (wo_a FMA + wo_b INT8) is longer than the read roofline, so the call is
// compute-bound there; see docs/sparse_attention.md for the measured shares.
// NaN policy: inputs are not scanned; a NaN in o_r makes Q8 of that (token, group) unspecified
// (core/quant.hpp), so the corresponding outputs are unspecified but finite-typed.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/output_projection_avx2.hpp"
#include "tiledecode/backend/cpu/quant.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::kernels {

namespace output_projection_detail {

inline constexpr int kRowsPerTask = 32;  // wo_a rows per task
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
  static void a_chunk(float* out, std::int64_t ldout, const float* o, std::int64_t ldo, int nt,
                      const bf16* w, std::int64_t ldw, int nr, int kc, int /*nr_pf*/) {
    for (int t = 0; t < nt; ++t)
      for (int r = 0; r < nr; ++r) {
        // Eight interleaved partial sums (as the SIMD lanes): a single running FP32 sum over
        // 4096 products drifts enough to flip Q8 roundings downstream.
        float lane[8] = {};
        for (int k = 0; k < kc; ++k) lane[k % 8] += o[t * ldo + k] * w[r * ldw + k].to_float();
        float acc = 0;
        for (float v : lane) acc += v;
        out[t * ldout + r] += acc;
      }
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
  static void a_chunk(float* out, std::int64_t ldout, const float* o, std::int64_t ldo, int nt,
                      const bf16* w, std::int64_t ldw, int nr, int kc, int nr_pf) {
    cpu::avx2::oproj_a_chunk(out, ldout, o, ldo, nt, w, ldw, nr, kc, nr_pf);
  }
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* /*a_sum*/, std::int64_t /*ld_sum*/) {
    cpu::avx2::oproj_b_pair(p, ldp, a, lda, nt, w, ldw, kr);
  }
};

// avx2_vnni: the avx2 wo_a stage, the vpdpbusd wo_b tile.
struct Avx2VnniOps : Avx2Ops {
  static void b_pair(std::int32_t* p, std::int64_t ldp, const std::int8_t* a, std::int64_t lda,
                     int nt, const std::int8_t* w, std::int64_t ldw, int kr,
                     const std::int32_t* a_sum, std::int64_t ld_sum) {
    cpu::avx2_vnni::oproj_b_pair(p, ldp, a, lda, nt, w, ldw, kr, a_sum, ld_sum);
  }
};
#endif

template <class Ops>
void run(const cpu::Context& ctx, const ModelConfig& cfg, View<bf16, 2> attn_out,
         ConstView<bf16, 2> o_packed, ConstView<bf16, 3> wo_a, ConstView<std::int8_t, 2> wo_b,
         ConstView<float, 1> wo_b_scale, std::byte* ws) {
  const index_t T = attn_out.extent(0), G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(),
                N = cfg.hidden;
  const Layout L(cfg, std::size_t(T));
  float* of = reinterpret_cast<float*>(ws + L.of);            // (G*T, K)
  float* orr = reinterpret_cast<float*>(ws + L.orr);          // (T, G, R)
  auto* a = reinterpret_cast<std::int8_t*>(ws + L.a);         // (T, G*R)
  float* adq = reinterpret_cast<float*>(ws + L.adq);          // (T, G)
  auto* asum = reinterpret_cast<std::int32_t*>(ws + L.asum);  // (T, G)

  ctx.parallel_for(0, G * T, 1, [&](std::int64_t row) {
    for (index_t k = 0; k < K; ++k) of[row * K + k] = o_packed(row, k).to_float();
  });
  std::fill(orr, orr + T * G * R, 0.0f);
  const index_t row_tasks = (R + kRowsPerTask - 1) / kRowsPerTask;
  ctx.parallel_for(0, G * row_tasks, 1, [&](std::int64_t task) {
    const index_t g = task / row_tasks, r0 = (task % row_tasks) * kRowsPerTask;
    const int nr = int(std::min<index_t>(kRowsPerTask, R - r0));
    const bf16* w = &wo_a(g, r0, 0);
    for (index_t k0 = 0; k0 < K; k0 += kKChunk) {
      const int kc = int(std::min<index_t>(kKChunk, K - k0));
      for (index_t t0 = 0; t0 < T; t0 += kTokTile) {
        const int nt = int(std::min<index_t>(kTokTile, T - t0));
        // The rows after this task's, up to the end of the group, may be prefetched.
        Ops::a_chunk(orr + (t0 * G + g) * R + r0, G * R, of + (g * T + t0) * K + k0, K, nt, w + k0,
                     wo_a.stride(1), nr, kc, int(R - r0));
      }
    }
  });
  ctx.parallel_for(0, T * G, 1, [&](std::int64_t tg) {
    adq[tg] = cpu::quantize_q8_row(ctx.isa, a + tg * R, orr + tg * R, R);
    std::int32_t sum = 0;
    for (index_t r = 0; r < R; ++r) sum += a[tg * R + r];
    asum[tg] = sum;
  });
  const index_t chan_tasks = (N + kChanPerTask - 1) / kChanPerTask;
  ctx.parallel_for(0, chan_tasks, 1, [&](std::int64_t task) {
    const index_t n0 = task * kChanPerTask, n1 = std::min<index_t>(N, n0 + kChanPerTask);
    constexpr int kTok = 16;
    for (index_t t0 = 0; t0 < T; t0 += kTok) {
      const int nt = int(std::min<index_t>(kTok, T - t0));
      for (index_t n = n0; n < n1; n += 2) {
        // Odd channel count: pair the last channel with itself and keep one result.
        const index_t n2 = std::min(n + 1, n1 - 1);
        const std::int8_t* w = &wo_b(n, 0);
        const std::int64_t ldw = &wo_b(n2, 0) - w;
        float acc[kTok][2] = {};
        for (index_t g = 0; g < G; ++g) {
          std::int32_t p[kTok][2];
          Ops::b_pair(&p[0][0], 2, a + t0 * G * R + g * R, G * R, nt, w + g * R, ldw, int(R),
                      asum + t0 * G + g, G);
          for (int t = 0; t < nt; ++t)
            for (int c = 0; c < 2; ++c) acc[t][c] += adq[(t0 + t) * G + g] * float(p[t][c]);
        }
        for (int t = 0; t < nt; ++t) {
          attn_out(t0 + t, n) = bf16(wo_b_scale(n) * acc[t][0]);
          if (n2 != n) attn_out(t0 + t, n2) = bf16(wo_b_scale(n2) * acc[t][1]);
        }
      }
    }
  });
}

}  // namespace output_projection_detail

// Workspace bytes for T tokens (independent of the thread count): FP32 o_packed copy, FP32 o_r,
// INT8 activations and their scales, plus 64 bytes of alignment slack.
inline std::size_t output_projection_workspace_bytes(const ModelConfig& cfg, index_t T) {
  return output_projection_detail::Layout(cfg, std::size_t(std::max<index_t>(T, 0))).total + 64;
}

// Grouped W8A8 output projection of T tokens.
//   attn_out    BF16 [T, D]                    output
//   o_packed    BF16 [O_GROUPS·T, O_GROUP_IN]  from kernels::sparse_attention
//   wo_a        BF16 [O_GROUPS, O_LORA, O_GROUP_IN]   (used as x @ wo_a[g]^T); rows contiguous
//   wo_b        INT8 [D, O_GROUPS·O_LORA], rows contiguous; any int8 value (the AVX2 dot puts
//               |w| on vpmaddubsw's unsigned side, where -128 reads as 128, and the Q8
//               activations are in [-127, 127], so every pair sum stays < 32767: exact)
//   wo_b_scale  FP32 [D] per output channel
//   workspace   >= output_projection_workspace_bytes(cfg, T) bytes, any alignment
// Throws tiledecode::Error on invalid arguments before writing anything.
inline void output_projection(const cpu::Context& ctx, const ModelConfig& cfg,
                              View<bf16, 2> attn_out, ConstView<bf16, 2> o_packed,
                              ConstView<bf16, 3> wo_a, ConstView<std::int8_t, 2> wo_b,
                              ConstView<float, 1> wo_b_scale, std::span<std::byte> workspace) {
  constexpr std::string_view where = "output_projection";
  const index_t G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(), N = cfg.hidden;
  const index_t T = attn_out.extent(0);
  check_equal(where, "attn_out.extent(1)", attn_out.extent(1), N);
  check_equal(where, "o_packed.extent(0)", o_packed.extent(0), G * T);
  check_equal(where, "o_packed.extent(1)", o_packed.extent(1), K);
  check_equal(where, "wo_a.extent(0)", wo_a.extent(0), G);
  check_equal(where, "wo_a.extent(1)", wo_a.extent(1), R);
  check_equal(where, "wo_a.extent(2)", wo_a.extent(2), K);
  check_equal(where, "wo_a.stride(2)", wo_a.stride(2), index_t(1));
  check_equal(where, "wo_b.extent(0)", wo_b.extent(0), N);
  check_equal(where, "wo_b.extent(1)", wo_b.extent(1), G * R);
  check_equal(where, "wo_b.stride(1)", wo_b.stride(1), index_t(1));
  check_equal(where, "wo_b_scale.extent(0)", wo_b_scale.extent(0), N);
  if (R % 32 != 0 || R > 65536) {
    throw_arg(where, "cfg.o_lora", R, "a multiple of 32 in [32, 65536] (INT32 bound of wo_b)");
  }
  if (K % 8 != 0) throw_arg(where, "cfg.o_group_in()", K, "a multiple of 8");
  const std::size_t need = output_projection_workspace_bytes(cfg, T);
  if (workspace.size() < need)
    throw_arg(where, "workspace.size()", workspace.size(),
              ">= " + std::to_string(need) + " (output_projection_workspace_bytes(cfg, T))");
  if (T == 0) return;
  auto base = reinterpret_cast<std::uintptr_t>(workspace.data());
  std::byte* ws = workspace.data() + (64 - base % 64) % 64;
  namespace od = output_projection_detail;
  const cpu::Isa isa = cpu::checked_isa(ctx.isa);
#if TILEDECODE_X86
  if (isa == cpu::Isa::avx2_vnni)
    return od::run<od::Avx2VnniOps>(ctx, cfg, attn_out, o_packed, wo_a, wo_b, wo_b_scale, ws);
  if (cpu::has_avx2(isa))
    return od::run<od::Avx2Ops>(ctx, cfg, attn_out, o_packed, wo_a, wo_b, wo_b_scale, ws);
#endif
  od::run<od::ScalarOps>(ctx, cfg, attn_out, o_packed, wo_a, wo_b, wo_b_scale, ws);
}

}  // namespace tiledecode::kernels
