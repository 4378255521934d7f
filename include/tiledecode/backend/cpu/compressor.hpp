#pragma once
// Compressors (kernels/compressor.hpp) on the CPU backend.
//
// The projections read 2 × OUT_DIM × D BF16 weights per step and dominate. Tasks own 24 weight
// rows; a 3-row × 4-token register tile (BF16 → FP32 by a shift, FMA into lane-wise accumulators)
// makes one pass over K per token group, so the weights stream from DRAM once per step (software
// prefetch ahead) and are re-read from L1/L2 by later token groups. Pooling runs in double
// (kernels/compressor.hpp, "Pooling in double": the FP32 max, then e^(s - m), the weight sum and
// the weighted kv sum in double in candidate order), parallel over channel blocks; the Hadamard of
// the inner compressor sums in double too. Work is split by shape only (weight rows, channels),
// each output has one fixed reduction order, so results are bit-identical for any thread count.
// On more than one thread, requests whose tails touch nothing another request writes run on
// lanes at once, and threads whose lanes are done help the others' stages (for_requests,
// lane_crew.hpp; whether they do changes no bit: they share no memory they write).
// The scalar twins below follow the vector micro-kernels' operations exactly (the projections: 8
// lanes, ascending k, the AVX2 horizontal-sum tree; the pooling: the same double operations per
// channel; the candidate order), so every tier gives the same bits.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/bf16_rounded.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/compressor_avx2.hpp"
#include "tiledecode/backend/cpu/compressor_avx512.hpp"
#include "tiledecode/backend/cpu/compressor_check.hpp"
#include "tiledecode/backend/cpu/lane_crew.hpp"
#include "tiledecode/backend/cpu/rounding_check.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/rules/paging.hpp"

namespace tiledecode::kernels {

namespace detail {

// ---------------------------------------------------------------------------------------------
// Scalar twins of the AVX2 microkernels in backend/cpu/compressor_avx2.hpp: same task split,
// same summation order (the two-level lane order of bf16_rows_avx2.hpp), same
// candidate order and the same double exp (cpu::pool_exp_f64); one row at a time (no register
// tile).

// out[t*ld_out + r] = Σ_k x[t*ld_x + k] * w[r*ld_w + k] in the shared two-level order
// (cpu::bf16_rows_dot_scalar, backend/cpu/bf16_rows_avx2.hpp).
inline void project_rows_scalar(float* out, index_t ld_out, const float* x, index_t ld_x,
                                index_t n_tok, const bf16* w, index_t ld_w, index_t n_rows,
                                index_t d) {
  cpu::bf16_rows_dot_scalar<false>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d);
}

// avx2::compressor_pool_channels one channel at a time: the FP32 max, then in ascending j
// p = pool_exp_f64(double(s) - double(m)), l += p, acc = fma(p, double(kv), acc); hi/lo = the FP32
// pair of acc / l. The same operations as the vector tiers, so the same bits.
inline void pool_channels_scalar(float* hi, float* lo, const float* const* kv,
                                 const float* const* score, int n_cand, index_t c0, index_t c1,
                                 float* mx = nullptr, float* ls = nullptr) {
  for (index_t c = c0; c < c1; ++c) {
    float m = kNegBig;
    for (int j = 0; j < n_cand; ++j) m = m > score[j][c] ? m : score[j][c];  // _mm256_max_ps(m, s)
    double l = 0.0, acc = 0.0;
    for (int j = 0; j < n_cand; ++j) {
      const double p = cpu::pool_exp_f64(double(score[j][c]) - double(m));
      l += p;
      acc = std::fma(p, double(kv[j][c]), acc);
    }
    const double q = acc / l;  // l = 0 only if every score is -Inf: 0 / 0 = NaN (the policy)
    hi[c] = float(q);
    lo[c] = float(q - double(hi[c]));
    if (mx) mx[c] = m, ls[c] = float(l);  // the rounding check's softmax max and weight sum
  }
}

// z = y @ h in double, rounded once (avx2::compressor_hadamard_row): BF16 × BF16 products are
// exact in double, so the plain multiply-add is the vector FMA / multiply-add, bit for bit.
inline void hadamard_row_scalar(float* z, const float* y, const bf16* h, index_t ld_h, index_t n) {
  for (index_t j = 0; j < n; ++j) {
    double acc = 0.0;
    for (index_t i = 0; i < n; ++i) acc += double(y[i]) * double(h[i * ld_h + j].to_float());
    z[j] = float(acc);
  }
}

// An entry of the lanes' independence test (backend_ops_compressor::independent).
struct DepEntry {
  std::int64_t key;  // a state block (>= 0) or -1 - a cache slot
  std::int64_t who;  // 2 · request + (1: written)
};

// Shared: x32 .. ax, deps; the rest per request lane (lane 0 unless the tails run on lanes).
struct CompressorWorkspace {
  float* x32;       // (T, D)
  float* proj;      // (T, 2*OUT_DIM): [kv | g] = the state rows of this step
  float* null_row;  // (2*OUT_DIM): kv 0, score kNegBig — stands in for unmapped state rows
  DepEntry* deps;   // (compressor_dep_entries) the lanes' independence test
  float* pooled;    // (head_dim)
  float* y;         // (head_dim)
  float* z;         // (head_dim)
  float* y_lo;      // (head_dim) the rounding check: y's double as the FP32 pair y + y_lo
  float* bound;     // (2 head_dim) the rounding check: the pooled values' error bounds, per part:
                    // [d] from the written kv values of channel d, [head_dim + d] from their scores
  float* bound_r;   // (2 head_dim) the same with κ_r, for the RMS factor's bound
  float* mx;        // (head_dim) the rounding check: the pooling's softmax max per channel
  float* ls;        // (head_dim) the rounding check: its weight sum Σ e^(s - max), FP32
  float* mp;        // (head_dim) the rounding check: the max over the candidates before the written
                    // ones (ws.pre's; compressor_pool_resume continues it over the rest)
  float* nw;        // (head_dim) the rounding check: norm_w as FP32
  double* pre;      // (2 head_dim) the rounding check: the SIMD pooling's sums before the written
                    // candidates (avx2:: / avx512::compressor_pool_resume)
  std::int32_t* hit;      // (head_dim) the rounding check: the listing's flags per value
  std::uint8_t* fixed;    // (2 head_dim) the rounding check: the parts repaired in this window
  std::int64_t* keys;     // (T) the rounding check: the state slot of written[i] (unmapped last)
  std::int32_t* written;  // (T) the rounding check: tokens sorted by (state slot, t)
  float* ax;              // (T) the rounding check: 2^-24 · max_k |x_n[t, k]|, each token's
                          // error scale (compressor_check::Written::a)
};

// The workspace's parts (kernels::compressor_workspace_size), with request lane `lane`'s rows.
inline CompressorWorkspace carve_workspace(const ModelConfig& cfg, const CompressorSpec& spec,
                                           index_t T, float* ws, index_t lane = 0) {
  const index_t HD = spec.head_dim;
  CompressorWorkspace w{};
  w.x32 = ws;
  w.proj = w.x32 + ws_round(T * cfg.hidden);
  w.null_row = w.proj + ws_round(T * spec.state_width());
  w.nw = w.null_row + ws_round(spec.state_width());
  w.keys = reinterpret_cast<std::int64_t*>(w.nw + ws_round(HD));
  w.written = reinterpret_cast<std::int32_t*>(w.keys) + ws_round(2 * T);
  w.ax = reinterpret_cast<float*>(w.written) + ws_round(T);
  w.deps = reinterpret_cast<DepEntry*>(w.ax + ws_round(T));
  float* l = reinterpret_cast<float*>(w.deps) + ws_round(4 * compressor_dep_entries(cfg, spec, T)) +
             lane * compressor_lane_size(spec);
  w.pooled = l;
  w.y = w.pooled + ws_round(HD);
  w.z = w.y + ws_round(HD);
  w.y_lo = w.z + ws_round(HD);
  w.mx = w.y_lo + ws_round(HD);
  w.ls = w.mx + ws_round(HD);
  w.mp = w.ls + ws_round(HD);
  w.hit = reinterpret_cast<std::int32_t*>(w.mp + ws_round(HD));
  w.bound = reinterpret_cast<float*>(w.hit) + ws_round(HD);
  w.bound_r = w.bound + ws_round(2 * HD);
  w.pre = reinterpret_cast<double*>(w.bound_r + ws_round(2 * HD));
  w.fixed = reinterpret_cast<std::uint8_t*>(reinterpret_cast<float*>(w.pre) + ws_round(4 * HD));
  return w;
}

}  // namespace detail

}  // namespace tiledecode::kernels

namespace tiledecode::cpu {

template <Isa I>
struct backend_ops_compressor {
  static constexpr bool avx2 = has_avx2(I) && TILEDECODE_X86;
  // The AVX2 and AVX-512 poolings keep the sums before the written candidates (ws.pre; each
  // tier reads its own layout): pool, resume_block.
  static constexpr bool keeps_pre = avx2;
  using Ws = kernels::detail::CompressorWorkspace;

  static void check(const Cpu<I>&, const kernels::CompressorArgs&) {}
  static Ws ws_of(const kernels::CompressorArgs& a, index_t lane = 0) {
    return kernels::detail::carve_workspace(*a.cfg, a.spec, a.tokens(), a.workspace.data(), lane);
  }

  // proj[t] = [x_n[t] @ wkv^T | x_n[t] @ wgate^T + ape[pos % R]] for all T tokens.
  static void project(const Cpu<I>& be, const kernels::CompressorArgs& a) {
    const ModelConfig& cfg = *a.cfg;
    const Ws ws = ws_of(a);
    const index_t T = a.tokens(), D = cfg.hidden, OUT = a.spec.out_dim(), SW = a.spec.state_width();
    // The FP32 copy of x_n for the FMA kernels (the vdpbf16ps and the exact ones read the BF16
    // rows).
    const bool exact = be.bf16_dot == Bf16Dot::exact;
    [[maybe_unused]] const bool bf16_rows = I == Isa::avx512 && be.bf16_dot == Bf16Dot::dpbf16;
#if TILEDECODE_X86
    // The blocked vdpbf16ps kernel reads x_n as a token panel, packed once here into the FP32
    // copy's space (unused on that path: 2·T·D BF16 elements), shared by every row task.
    [[maybe_unused]] const bool panel = bf16_rows && avx512::bf16_panel_fits(T, D, 2 * T * D);
    [[maybe_unused]] bf16* const xp = reinterpret_cast<bf16*>(ws.x32);
    if (panel) avx512::pack_bf16_panel(be, xp, a.x_n.data(), a.x_n.stride(0), T, D);
#endif
    // The FP32 copy, and the rounding check's error scale of each token while its row is in L1;
    // without the copy, the scales after the projection, which leaves x_n in cache (before it,
    // x_n may come from memory: 750-900 cycles a token on Zen 4, one thread, in bench_compressor).
    const bool made = x32_made(be), check = checking(be, a);
    const auto scales = [&](std::int64_t t) {
      ws.ax[t] = 0x1p-24f * rounding_check::bf16_abs_max(I, a.x_n.data() + t * a.x_n.stride(0), D);
    };
    if (made) {
      be.tasks(T, [&](std::int64_t t) {
        const bf16* src = a.x_n.data() + t * a.x_n.stride(0);
        float* dst = ws.x32 + t * D;
        for (index_t k = 0; k < D; ++k) dst[k] = src[k].to_float();
        if (check) scales(t);
      });
    }
    // Tasks of RB rows of wkv, then of wgate: the split depends on the shape (and the path) only.
#if TILEDECODE_X86
    const index_t RB = exact       ? kExactTaskRows
                       : bf16_rows ? avx512::kDpbf16TaskRows
                                   : index_t(kCompressorRowBlock);
#else
    const index_t RB = exact ? kExactTaskRows : index_t(kCompressorRowBlock);
#endif
    const index_t per = (OUT + RB - 1) / RB;
    be.tasks(2 * per, [&](std::int64_t i) {
      const bool gate = i >= per;
      const ConstView<bf16, 2>& m = gate ? a.w.wgate : a.w.wkv;
      const index_t r0 = (gate ? i - per : i) * RB, n = std::min(RB, OUT - r0);
      float* out = ws.proj + (gate ? OUT : 0) + r0;
      const bf16* wr = m.data() + r0 * m.stride(0);
      if (exact) {  // Bf16Dot::exact, every tier: double sums in ascending k (bf16_exact.hpp)
        bf16_rows_dot_exact(I, out, SW, a.x_n.data(), a.x_n.stride(0), T, wr, m.stride(0), n, D);
        return;
      }
#if TILEDECODE_X86
      // avx512 with Bf16Dot::dpbf16 (automatic on AMD: vdpbf16ps at twice the FMA rate there):
      // the o-proj wo_a kernels on the BF16 x_n, their own summation order, one bits for any T
      // (docs/compressors.md). With Bf16Dot::fma, more than 8 tokens: the avx2 bits on 512-bit
      // FMA, the weights widened once per 96 tokens instead of once per 4 (bf16_rows_avx512.hpp;
      // T = 128: 2.1x, T = 512: 2.7x).
      if constexpr (I == Isa::avx512) {
        if (bf16_rows) {  // vdpbf16ps on the BF16 x_n (isa.hpp, Bf16Dot)
          const bf16* xb = a.x_n.data();
          if (panel) {
            avx512::bf16_rows_dot_blocked<false>(out, SW, xp, avx512::bf16_panel_tile_elems(D), T,
                                                 wr, m.stride(0), n, D, OUT - r0);
          } else {
            avx512::bf16_rows_dot<false>(out, SW, xb, a.x_n.stride(0), T, wr, m.stride(0), n, D,
                                         OUT - r0);
          }
          return;
        }
        if (T >= avx512::bf16_rows_fma_detail::kFmaMinTokens) {
          avx512::bf16_rows_dot_fma<false>(out, SW, ws.x32, D, T, wr, m.stride(0), n, D, OUT - r0);
          return;
        }
      }
      if constexpr (avx2) {
        avx2::compressor_project_rows(out, SW, ws.x32, D, T, wr, m.stride(0), n, D, OUT - r0);
        return;
      }
#endif
      kernels::detail::project_rows_scalar(out, SW, ws.x32, D, T, wr, m.stride(0), n, D);
    });
    for (index_t t = 0; t < T; ++t) {
      const index_t r = a.meta.positions(t) % a.spec.ratio;
      float* g = ws.proj + t * SW + OUT;
      for (index_t o = 0; o < OUT; ++o) g[o] += a.w.ape(r, o);
    }
    for (index_t i = 0; i < SW; ++i) ws.null_row[i] = i < OUT ? 0.0f : kNegBig;
    if (check && !made) be.tasks(T, scales);
    if (check) {  // the rounding check's lookup of the step's writers (writer below)
      for (index_t t = 0; t < T; ++t) ws.written[t] = std::int32_t(t);
      std::sort(ws.written, ws.written + T, [&](std::int32_t x, std::int32_t y) {
        const std::int64_t kx = slot_key(a, x), ky = slot_key(a, y);
        return kx != ky ? kx < ky : x < y;
      });
      for (index_t i = 0; i < T; ++i) ws.keys[i] = slot_key(a, ws.written[i]);
      for (index_t i = 0; i < a.spec.head_dim; ++i) ws.nw[i] = a.w.norm_w(i).to_float();
    }
  }

  struct Lane {
    const Cpu<I>* be;
    Ws ws;
    LaneCrew* crew = nullptr;  // the lanes' crew (for_requests), where the tails run on lanes
    double r = 0.0;            // the last norm_rope's RMS factor
    // The first candidate after the sums the last pool kept in ws.pre (-1: none kept).
    int pre_j = -1;
  };
  // The requests' tails. On one thread, or where one request's tail touches a state block or a
  // cache slot that another one writes (independent: the fixtures' aliased pools, spec §3.8),
  // in order on the calling thread, each pooling parallel over channel blocks. Otherwise on
  // min(B, kCompressorLanes) lanes at once (tasks; lane i takes requests i, i + L, ...), each with
  // its own rows of the workspace: the requests read and write disjoint memory, so the order does
  // not matter and the bits are the serial run's. A lane's stages (the pooling's channel blocks,
  // the check's repairs: their rows' dots in two halves where a helper waits) are tasks of its
  // LaneCrew executor, which the threads whose lanes are done help with (lane_crew.hpp; which
  // thread runs a task changes no bit).
  template <class Body>
  static void for_requests(const Cpu<I>& be, const kernels::CompressorArgs& a, Body&& body) {
    static_assert(kernels::detail::kCompressorLanes <= LaneCrew::kMaxLanes);
    const index_t B = a.meta.shape.batch;
    const index_t L = std::min(B, kernels::detail::kCompressorLanes);
    if (L < 2 || be.concurrency() < 2 || !independent(a)) {
      Lane lane{&be, ws_of(a)};
      for (index_t b = 0; b < B; ++b) body(lane, b);
      return;
    }
    LaneCrew crew{int(L)};
    be.tasks(L, [&](std::int64_t i) {
      crew.start();
      const Cpu<I> lane_be{crew.lane(int(i)), be.bf16_dot};
      Lane lane{&lane_be, ws_of(a, i), &crew};
      for (index_t b = i; b < B; b += L) body(lane, b);
      crew.finish_and_help();
    });
  }
  // Whether no state block that a request writes in this step (state_slot_mapping, block = slot /
  // page) is read (its committed windows' pages through the state table) or written by another
  // request, and no cache slot (cmp_slot_mapping) is written by two. Blocks, not rows: a
  // conservative test (one sort of at most compressor_dep_entries entries in the workspace).
  static bool independent(const kernels::CompressorArgs& a) {
    const Ws ws = ws_of(a);
    const index_t T = a.tokens(), S = a.meta.shape.seq, R = a.spec.ratio;
    const index_t page = kernels::compressor_state_page(*a.cfg, a.spec);
    kernels::detail::DepEntry* e = ws.deps;
    index_t n = 0;
    for (index_t t = 0; t < T; ++t) {
      const std::int64_t b = t / S, slot = a.meta.state_slot_mapping(t);
      const std::int64_t cs = a.meta.cmp_slot_mapping(t);
      if (slot >= 0) e[n++] = {slot / page, 2 * b + 1};
      if (cs < 0) continue;
      e[n++] = {-1 - cs, 2 * b + 1};
      const index_t c = a.meta.positions(t) / R;
      const index_t c0 = rules::compressor_first_position(R, a.spec.overlap, c) / page;
      for (index_t col = c0; col <= ((c + 1) * R - 1) / page; ++col) {
        const index_t blk = rules::block_of(a.meta.state_table, b, col);
        if (blk >= 0) e[n++] = {blk, 2 * b};
      }
    }
    std::sort(e, e + n, [](const auto& x, const auto& y) {
      return x.key != y.key ? x.key < y.key : x.who < y.who;
    });
    for (index_t i = 0; i < n;) {  // per key: its requests (ascending) and whether one writes it
      index_t j = i;
      bool write = false;
      for (; j < n && e[j].key == e[i].key; ++j) write |= (e[j].who & 1) != 0;
      if (write && e[j - 1].who / 2 != e[i].who / 2) return false;
      i = j;
    }
    return true;
  }
  static void store_state(Lane& z, const kernels::CompressorArgs& a, index_t t) {
    const index_t slot = a.meta.state_slot_mapping(t), SW = a.spec.state_width();
    if (slot < 0) return;
    std::memcpy(a.state_pool.data() + slot * a.state_pool.stride(0), z.ws.proj + t * SW,
                sizeof(float) * std::size_t(SW));
  }
  static void state_barrier(Lane&) {}

  // pooled[d] = Σ_j e^{g_j[d]} kv_j[d] / Σ_j e^{g_j[d]} over the candidates of row c
  // (rules::compressor_candidates), state rows read through the table by absolute position; in
  // double, kept as the FP32 pair ws.pooled (hi) + ws.z (lo; z is free until the emit).
  static void pool(Lane& z, const kernels::CompressorArgs& a, index_t b, index_t c) {
    const index_t HD = a.spec.head_dim;
    const float* kv[2 * 128];
    const float* sc[2 * 128];
    const int n = window_rows(z, a, b, c, kv, sc);
#if TILEDECODE_X86
    // The window the program pools next (the step's next committed boundary), whose rows the
    // avx512 pooling prefetches into L2 while this one runs: the rows come from memory otherwise
    // (an HCA window is 128 rows of 4 KB, one page each, which the hardware prefetchers do not
    // follow).
    [[maybe_unused]] const float* nkv[2 * 128];
    [[maybe_unused]] const float* nsc[2 * 128];
    [[maybe_unused]] avx512::PoolAhead ahead;
    if constexpr (I == Isa::avx512) {
      const index_t S = a.meta.shape.seq, T = a.tokens();
      for (index_t t = b * S; t < T; ++t) {
        if (a.meta.cmp_slot_mapping(t) < 0) continue;
        const index_t bt = t / S, ct = a.meta.positions(t) / a.spec.ratio;
        if (bt == b && ct <= c) continue;
        ahead = {nkv, nsc, window_rows(z, a, bt, ct, nkv, nsc)};
        break;
      }
    }
#endif
    // The rounding check's re-pooling resumes after the candidates before the request's tokens
    // (the last S of the window at most: positions ascend), from sums the SIMD pooling keeps.
    const int pre_j = std::max(0, n - int(a.meta.shape.seq));
    z.pre_j = keeps_pre && checking(*z.be, a) ? pre_j : -1;
    // Channel blocks only where the window is long enough to be worth a task (shape-only rule).
    const index_t grain = n >= 64 ? 128 : HD;
    z.be->tasks((HD + grain - 1) / grain, [&](std::int64_t i) {
      const index_t c0 = i * grain, c1 = std::min(HD, c0 + grain);
#if TILEDECODE_X86
      if constexpr (I == Isa::avx512) {
        avx512::compressor_pool_channels(z.ws.pooled, z.ws.z, kv, sc, n, c0, c1, ahead, z.ws.mx,
                                         z.ws.ls, z.pre_j >= 0 ? z.ws.pre : nullptr, z.ws.mp,
                                         pre_j);
        return;
      } else if constexpr (avx2) {
        avx2::compressor_pool_channels(z.ws.pooled, z.ws.z, kv, sc, n, c0, c1, z.ws.mx, z.ws.ls,
                                       z.pre_j >= 0 ? z.ws.pre : nullptr, z.ws.mp, pre_j);
        return;
      }
#endif
      kernels::detail::pool_channels_scalar(z.ws.pooled, z.ws.z, kv, sc, n, c0, c1, z.ws.mx,
                                            z.ws.ls);
    });
  }
  // The 8 channels [c, c + 8) of a window pooled again (the rounding check's repairs): the tier's
  // kernel, as pool's, so the same bits (a channel's value depends on its own inputs only).
  static void pool_block(const float* const* kv, const float* const* sc, int n, float* hi,
                         float* lo, index_t c) {
#if TILEDECODE_X86
    if constexpr (I == Isa::avx512) {
      avx512::compressor_pool_channels(hi, lo, kv, sc, n, c, c + 8);
      return;
    } else if constexpr (avx2) {
      avx2::compressor_pool_channels(hi, lo, kv, sc, n, c, c + 8);
      return;
    }
#endif
    kernels::detail::pool_channels_scalar(hi, lo, kv, sc, n, c, c + 8);
  }
  // pool_block from the sums the pooling kept before candidate j0 (ws.pre), where the block's max
  // has not moved (the same bits); false where it did, or on tiers that keep none.
  static bool resume_block(const float* const* kv, const float* const* sc, int n, const Ws& ws,
                           index_t c, int j0) {
#if TILEDECODE_X86
    if constexpr (I == Isa::avx512)
      return avx512::compressor_pool_resume(ws.pooled, ws.z, kv, sc, n, c, j0, ws.pre, ws.mp,
                                            ws.mx);
    else if constexpr (keeps_pre)
      return avx2::compressor_pool_resume(ws.pooled, ws.z, kv, sc, n, c, j0, ws.pre, ws.mp, ws.mx);
#endif
    (void)kv, (void)sc, (void)n, (void)ws, (void)c, (void)j0;
    return false;
  }
  // The kv and score rows of window c of request b (rules::compressor_candidates, state rows read
  // through the table by absolute position; an unmapped one reads the null row); returns their
  // number.
  static int window_rows(const Lane& z, const kernels::CompressorArgs& a, index_t b, index_t c,
                         const float** kv, const float** sc, std::int64_t* rows = nullptr) {
    const index_t HD = a.spec.head_dim, OUT = a.spec.out_dim();
    const index_t page = kernels::compressor_state_page(*a.cfg, a.spec);
    rules::PoolCandidate cand[2 * 128];
    const int n = rules::compressor_candidates(a.spec.ratio, a.spec.overlap, c, cand);
    for (int j = 0; j < n; ++j) {
      const std::int64_t row = rules::slot_of(a.meta.state_table, b, cand[j].pos, page);
      const float* r = row < 0 ? z.ws.null_row : a.state_pool.data() + row * a.state_pool.stride(0);
      const index_t off = cand[j].half ? HD : 0;
      kv[j] = r + off;
      sc[j] = r + OUT + off;
      if (rows) rows[j] = row;
    }
    return n;
  }
  // y = rmsnorm(pooled, norm_w) with forward RoPE on the last 64 dims at rope_pos, in double from
  // the double pooled value (hi + lo) and rounded once to FP32: y is rounded to BF16 next (cmp_kv
  // rows, the inner compressor's Hadamard input), where each extra FP32 rounding of the norm and
  // the rotation would flip BF16 roundings (Σ pooled² of 512 values, two products and the
  // rotation's two products and add cost nothing next to the pool).
  static void norm_rope(Lane& z, const kernels::CompressorArgs& a, index_t rope_pos) {
    const index_t HD = a.spec.head_dim;
    const auto pooled = [&](index_t i) { return pooled_of(z.ws, i); };
    double ss = 0.0;
    for (index_t i = 0; i < HD; ++i) ss += pooled(i) * pooled(i);
    const double r = 1.0 / std::sqrt(ss / double(HD) + double(a.cfg->rms_eps));
    const index_t nope = HD - kRopeDim;
    // y as FP32, and its double as y + y_lo for the rounding check (48 bits; unused otherwise).
    const auto put = [&](index_t i, double v) {
      z.ws.y[i] = float(v);
      z.ws.y_lo[i] = float(v - double(z.ws.y[i]));
    };
    for (index_t i = 0; i < nope; ++i) put(i, pooled(i) * r * double(a.w.norm_w(i).to_float()));
    double y[kRopeDim];
    for (index_t i = 0; i < kRopeDim; ++i)
      y[i] = pooled(nope + i) * r * double(a.w.norm_w(nope + i).to_float());
    rope_forward_f64(y, a.rope.cos_row(rope_pos), a.rope.sin_row(rope_pos), kRopeDim);
    for (index_t i = 0; i < kRopeDim; ++i) put(nope + i, y[i]);
    z.r = r;
  }

  // ---- Rounding check (issue 17) -------------------------------------------------------------
  // y is rounded to BF16 next (the cmp_kv row; the inner compressor's Hadamard input, whose
  // Hadamard and Q8 are golden's arithmetic on golden's bf16(y)). The pooling is double, so y is
  // golden's y of the same state rows; what still differs are the state values this step wrote,
  // the FP32 dots x_n · wkv / wgate a few FP32 ulps from golden's (exact, then rounded). Those are
  // the step's own, so golden, run on the step's inputs (x_n, the weights, the state pool before
  // the step), rounds from other values. The check bounds, per value of y, how far golden's y can
  // be, and recomputes as golden does (bf16_exact.hpp: ascending-k double sums, rounded to FP32,
  // + ape) the state values of every value whose bound holds a BF16 rounding boundary:
  //   * per channel d, the pooled value's bound B_d (compressor_check.hpp: each written state
  //     value within κ · 2^-24 · max|x_n[t]| · |w_row| + two FP32 roundings of golden's, through
  //     the softmax weights), in two parts: from the written kv values and from their scores
  //     (each part a weight row per channel: wkv's, wgate's);
  //   * the RMS factor r's relative bound ρ = sqrt(Σ_d (p_d B'_d)²) / (Σ_d p_d² + hd · eps), B'
  //     as B with κ_r = 4 for κ: the root of the sum of squares, not the sum, since the channels'
  //     errors are independent roundings of different weight rows (measured: |r / r_golden − 1|
  //     <= 0.30 of it at κ_r = 1 on the vdpbf16ps order, 0.42 on the FMA order);
  //   * value i: Y_i = |r · norm_w[i]| · B_i + |y_i| · ρ (the RoPE pairs: |cos| Y_even + |sin|
  //     Y_odd and back), plus 2^-40 |y_i| for the double arithmetic; listed when
  //     bf16(fp32(y_i − Y_i)) != bf16(fp32(y_i + Y_i)) (the two roundings are monotone, so golden's
  //     y, within Y_i, rounds as y does otherwise).
  // Repairs (a part: one weight row's dots for every written candidate, its bound then 0; its
  // 8-channel block re-pooled by the tier's kernel, every tier's bits, on the AVX2 tiers from the
  // sums the pooling kept before the written candidates where the block's max did not move,
  // resume_block; repair_parts: the candidates of one half through the rows together), in three
  // steps. First, while a listed channel has a part left: those parts (own_parts: per listed value
  // its parts, a RoPE pair's four, the one that narrows its interval most first, until the value
  // with the rest's bounds holds no boundary), listed again after each, up to half the parts. Then,
  // while a value is still listed (ρ: golden's r needs more channels), rounds of up to kRhoParts
  // parts, a listed channel's not yet repaired first, then the parts that remove most of ρ's sum of
  // squares (next_parts), as many as rho_clear's target needs, each round listed again, until none
  // is listed or every part is repaired. Where more than kMaxChannels channels are listed, or one
  // still is then, every part not yet repaired of every written candidate (repair_rest), and the
  // row is pooled again. A part reads one weight row and no part is read twice, so the steps save
  // what they leave out: on bench_compressor's live windows (17 draws, 1088 steps each) no CSA, HCA
  // or inner row needed every part (when the rounds for ρ stopped at half the parts and a full
  // repair read all of them, 0.4 % of inner's rows and 0.1 % of HCA's went that way:
  // docs/compressors.md). The pooling hands the check its softmax max and weight sum per channel
  // (ws.mx, ws.ls), so the bound costs an exp per written candidate and channel only. The repaired
  // state values are golden's, and they stay in the pool. A row with a non-finite y is not checked
  // (its policy is the kernel's). Opt-in (CompressorWeights::row_norms): on steps that close
  // windows, one thread, its cost is under the 5 % budget for CSA, HCA and the inner compressor on
  // the AVX2 tier (Zen 3, 2026-12-07, sixteenth session: +3.6 %, +4.3 % and +4.7 % of the step,
  // counted in the kernel over 17 draws of the live windows; inner's wall time +4.1 to +5.1 %),
  // and above it on the avx512 tier, whose vdpbf16ps projections make the unchecked step faster
  // while the repairs' double dots are not (Zen 4, 2026-12-08: +5.4 %, +5.6 % and +6.7 %; the
  // inner compressor's dots alone 4.1 % there); on two threads the requests' tails run at once
  // where they are independent, on lanes that help each other (for_requests). Cost and rates:
  // docs/compressors.md ("Rounding accuracy").
  static constexpr int kMaxChannels = 32;     // listed channels per row; past that, every part
  static constexpr int kRhoParts = 64;        // parts per round of the repairs for ρ, at most
  static constexpr double kRhoMargin = 0.95;  // a round aims at this fraction of rho_clear's ρ
  // Parts per repair_parts call, at most (a round's: a part per listed channel and kind, or the
  // parts of a round for ρ).
  static constexpr int kRepairRows = std::max(2 * kMaxChannels, kRhoParts);

  static bool checking(const Cpu<I>& be, const kernels::CompressorArgs& a) {
    return kernels::detail::view_given(a.w.row_norms.size(), a.w.row_norms.data()) &&
           be.bf16_dot != Bf16Dot::exact;
  }
  static std::int64_t slot_key(const kernels::CompressorArgs& a, index_t t) {
    const std::int64_t s = a.meta.state_slot_mapping(t);
    return s < 0 ? INT64_MAX : s;
  }
  // The last token t < lim (program order: requests, then tokens) that wrote state row `row` in
  // this step, or -1: a binary search of the tokens sorted by (slot, t) (their slots in ws.keys).
  static index_t writer(const Ws& ws, const kernels::CompressorArgs& a, std::int64_t row,
                        index_t lim) {
    const index_t T = a.tokens();
    if (row < ws.keys[0] || row > ws.keys[T - 1]) return -1;  // below or above every slot
    index_t lo = 0, hi = T;
    while (lo < hi) {
      const index_t mid = (lo + hi) / 2, t = ws.written[mid];
      const std::int64_t k = ws.keys[mid];
      if (k < row || (k == row && t < lim)) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    if (lo == 0) return -1;
    return ws.keys[lo - 1] == row ? index_t(ws.written[lo - 1]) : -1;
  }

  // A candidate written in this step: its token and where its values live.
  struct WrittenCand {
    index_t t;
    float* row;   // its state row
    index_t off;  // its half (0 or head_dim)
  };

  // Value i of y as the check sees it (y's double, y + y_lo), and |r · norm_w[i]|, the scale from
  // a pooled value's bound to y's (own_parts; listed_channels reads the same in list_row).
  static double y_of(const Ws& ws, index_t i) {
    return double(ws.y[i]) + double(ws.y_lo[i]);
  }
  static double y_scale(const Lane& z, index_t i) {
    return std::fabs(z.r * double(z.ws.nw[i]));  // norm_w as FP32 (project)
  }
  // Channel i's pooled value as the check sees it (its double, pooled + z).
  static double pooled_of(const Ws& ws, index_t i) {
    return double(ws.pooled[i]) + double(ws.z[i]);
  }
  // Whether part p (p < HD: channel p's kv values; HD + d: channel d's scores) is not yet repaired:
  // a bound of either kind not 0 (a part with nothing to repair has both 0).
  static bool part_left(const Ws& ws, int p) {
    return ws.bound[p] != 0.0f || ws.bound_r[p] != 0.0f;
  }
  // Channel d's bound from both parts (b: ws.bound or ws.bound_r).
  static double both_parts(const float* b, index_t HD, index_t d) {
    return double(b[d]) + double(b[HD + d]);
  }
  // The channels of the values of y whose interval holds a BF16 rounding boundary (the RoPE
  // pairs: both), in ch; returns their number, or kMaxChannels + 1 past kMaxChannels. rho: ρ.
  // The test is rounding_check::list_bf16_row's, as compressor_check::list_row (the same
  // arithmetic, vectorized by the tier's target, into ws.hit).
  static int listed_channels(const Lane& z, const kernels::CompressorArgs& a, index_t rope_pos,
                             int* ch, double* rho_out = nullptr) {
    const index_t HD = a.spec.head_dim;
    const Ws& ws = z.ws;
    double ss = 0.0, q = 0.0;  // four chains each (HD % 8 == 0), added in a fixed order
    compressor_check::rho_sums(I, ws.pooled, ws.z, ws.bound_r, HD, &ss, &q);
    const double rho = std::sqrt(q) / (ss + double(HD) * double(a.cfg->rms_eps));
    if (rho_out) *rho_out = rho;
    compressor_check::list_row(I, ws.hit, ws.y, ws.y_lo, ws.pooled, ws.z, ws.bound, ws.nw, z.r, rho,
                               a.rope.cos_row(rope_pos), a.rope.sin_row(rope_pos), HD, kRopeDim);
    int n = 0;
    for (index_t i0 = 0; i0 < HD; i0 += 8) {  // blocks of 8 flags, most of them all 0
      const index_t i1 = std::min<index_t>(HD, i0 + 8);
      std::int32_t any = 0;
      for (index_t i = i0; i < i1; ++i) any |= ws.hit[i];
      if (!any) continue;
      for (index_t i = i0; i < i1; ++i) {
        if (!ws.hit[i]) continue;
        if (n <= kMaxChannels) ch[n] = int(i);
        if (++n > kMaxChannels) return kMaxChannels + 1;
      }
    }
    return n;
  }

  static void check_rounding(Lane& z, const kernels::CompressorArgs& a, index_t b, index_t c) {
    if (!checking(*z.be, a)) return;
    const index_t HD = a.spec.head_dim, OUT = a.spec.out_dim(), S = a.meta.shape.seq;
    const index_t R = a.spec.ratio, ld = a.state_pool.stride(0);
    const Ws& ws = z.ws;
    std::uint32_t inf = 0;  // y's largest exponent field, every value at once (it vectorizes)
    for (index_t i = 0; i < HD; ++i)
      inf = std::max(inf, std::bit_cast<std::uint32_t>(ws.y[i]) & 0x7f800000u);
    if (inf == 0x7f800000u) return;  // a NaN or ±Inf in y
    const float* kv[2 * 128];
    const float* sc[2 * 128];
    std::int64_t rows[2 * 128];
    const int n = window_rows(z, a, b, c, kv, sc, rows);
    WrittenCand wc[2 * 128];
    compressor_check::Written wr[2 * 128];
    int nw = 0, first = n;  // first: the first written candidate
    const float* nk = a.w.row_norms.data();
    for (int j = 0; j < n; ++j) {
      if (rows[j] < 0) continue;
      const index_t t = writer(ws, a, rows[j], (b + 1) * S);
      if (t < 0) continue;  // an input of the step
      float* row = a.state_pool.data() + rows[j] * ld;
      const index_t off = kv[j] - row;
      const float* ape = &a.w.ape(a.meta.positions(t) % R, off);
      wr[nw] = {kv[j], sc[j], nk + off, nk + OUT + off, ape, ws.ax[t]};
      wc[nw] = {t, row, off};
      ++nw;
      first = std::min(first, j);
    }
    // Whether a repaired block resumes from the pooling's sums (every written candidate after
    // them).
    const bool resume = z.pre_j >= 0 && first >= z.pre_j;
    if (nw == 0) return;              // every candidate is an input: y is golden's
    const float* xw = x32(*z.be, a);  // the repairs' x (FP32), where project made it
    compressor_check::pool_bound(I, ws.bound, ws.bound_r, ws.pooled, ws.mx, ws.ls, wr, nw, HD);
    const index_t rope_pos = a.rope_position(b, c);
    int ch[kMaxChannels + 1];
    double rho = 0.0;
    int nch = listed_channels(z, a, rope_pos, ch, &rho);
    if (nch == 0) return;
    std::fill_n(ws.fixed, 2 * HD, std::uint8_t{0});
    // Golden's state values of parts[0 .. m): their bounds become 0 (and they are fixed), the
    // blocks of 8 channels that hold them are pooled again (pool_block: every tier's bits; the
    // other channels' values do not move) and y follows.
    const auto repair = [&](const int* parts, int m) {
      repair_parts(z, a, xw, wc, nw, parts, m);
      index_t blocks[2 * kMaxChannels];
      int nb = 0;
      for (int i = 0; i < m; ++i) {
        const index_t blk = (parts[i] % HD) / 8;
        ws.bound[parts[i]] = 0.0f;
        ws.bound_r[parts[i]] = 0.0f;
        ws.fixed[parts[i]] = 1;
        if (std::find(blocks, blocks + nb, blk) == blocks + nb) {
          blocks[nb++] = blk;
          if (!(resume && resume_block(kv, sc, n, ws, 8 * blk, z.pre_j)))
            pool_block(kv, sc, n, ws.pooled, ws.z, 8 * blk);
        }
      }
      norm_rope(z, a, rope_pos);
    };
    int parts[kRepairRows], done = 0;  // parts repaired
    while (nch > 0 && nch <= kMaxChannels && done < HD) {
      const int m = own_parts(z, a, rope_pos, rho, ch, nch, parts);
      if (m == 0) break;
      repair(parts, m);
      done += m;
      nch = listed_channels(z, a, rope_pos, ch, &rho);
    }
    // Still listed: ρ, golden's r needs more channels. The parts that remove most of ρ's sum of
    // squares first (with any listed channel's not yet repaired), as many as bring ρ under
    // kRhoMargin of the ρ at which the listed values clear (rho_clear; ρ is the root of that sum
    // over a denominator the repairs barely move), at most kRhoParts a round, until none is
    // listed or every part is repaired (a round reads its own rows only: nothing is read again
    // later).
    while (nch > 0 && nch <= kMaxChannels && done < 2 * HD) {
      const double clear = kRhoMargin * rho_clear(z, a, rope_pos, ch, nch, rho) / rho;
      const int m = next_parts(ws, HD, ch, nch, parts, clear * clear);
      if (m == 0) break;
      repair(parts, m);
      done += m;
      nch = listed_channels(z, a, rope_pos, ch, &rho);
    }
    if (nch == 0) return;
    repair_rest(z, a, xw, wc, nw);
    pool(z, a, b, c);
    norm_rope(z, a, rope_pos);
  }

  // The parts to repair of the listed channels ch[0 .. nch) (part p < HD: channel p's kv values
  // in every written candidate, from wkv's row; HD + d: channel d's scores, from wgate's): per
  // listed value, its parts with a bound left (a channel's two; a RoPE pair's four: the pair's
  // values are rotated together), the one that narrows the value's interval most first: its bound
  // times its channel's scale |r · norm_w|; in a pair, times the rotation's weight of its channel
  // in each value whose interval still holds a boundary (|cos| in its own channel's value, |sin|
  // in the other's), summed (ties: channel e's before e + 1's, kv before score), until the value,
  // with the bounds of the parts not taken, holds no BF16 boundary (list_bf16_row's test, at the
  // same ρ; a pair: both values); all of them otherwise. A listed pair is both its channels,
  // adjacent in ch, taken once. Returns their number (0: none left). (A pair's parts by their
  // bounds alone, unweighted: 8 % more parts in the inner compressor's first rounds.)
  static int own_parts(const Lane& z, const kernels::CompressorArgs& a, index_t rope_pos,
                       double rho, const int* ch, int nch, int* parts) {
    const int HD = int(a.spec.head_dim), nope = HD - int(kRopeDim);
    const Ws& ws = z.ws;
    int m = 0;
    for (int i = 0; i < nch; ++i) {
      const int d = ch[i];
      const bool pair = d >= nope;
      if (pair && (d - nope) % 2 == 1 && i > 0 && ch[i - 1] == d - 1) continue;  // taken with e
      const int e = pair ? d - (d - nope) % 2 : d;
      const int nc = pair ? 2 : 1;  // channels e, e + 1 (a pair) or d
      int cand[4], nk = 0;
      double wt[4];
      for (int c = 0; c < nc; ++c)
        for (const int p : {e + c, HD + e + c})
          if (part_left(ws, p)) {
            cand[nk] = p;
            wt[nk++] = y_scale(z, e + c) * double(ws.bound[p]);
          }
      bool taken[4] = {};
      // The bound of channel e + c's parts not taken (kv then score, as the listing adds them).
      const auto rest = [&](int c) {
        double r = 0.0;
        for (int k = 0; k < nk; ++k)
          if (!taken[k] && cand[k] % HD == e + c) r += double(ws.bound[cand[k]]);
        return r;
      };
      // Whether value e (and e + 1 of a pair) still holds a boundary with those bounds.
      const ValueTest test = value_test(z, a, rope_pos, e, pair);
      const auto splits = [&] { return test.splits(rest(0), rest(1), rho); };
      for (int mask; (mask = splits()) != 0;) {
        int best = -1;
        double bw = 0.0;
        for (int k = 0; k < nk; ++k) {
          if (taken[k]) continue;
          double g = 1.0;  // a pair: its channel's rotation weights in the values still listed
          if (pair) {
            const bool even = cand[k] % HD == e;
            g = ((mask & 1) ? (even ? test.nc : test.ns) : 0.0) +
                ((mask & 2) ? (even ? test.ns : test.nc) : 0.0);
          }
          if (best < 0 || wt[k] * g > bw) best = k, bw = wt[k] * g;
        }
        if (best < 0) break;  // every part taken: the rest is ρ's
        taken[best] = true;
        parts[m++] = cand[best];
      }
    }
    return m;
  }

  // list_row's test (compressor_check.hpp) for value e, its operands read once: splits(be, bo, ρ)
  // with be its pooled value's bound; a RoPE pair (e even past the nope values): both its values,
  // bo the bound of e + 1's, rotated by nc = |cos|, ns = |sin| (bit 0: e holds a boundary, bit 1:
  // e + 1; 0: neither).
  struct ValueTest {
    bool pair;
    double ye, yo, se, so, pe, po, nc, ns;
    int splits(double be, double bo, double rho) const {
      if (!pair) return compressor_check::value_splits(ye, se, be, rho);
      return compressor_check::pair_splits(ye, yo, nc, ns, se, so, be, bo, pe, po, rho);
    }
  };
  static ValueTest value_test(const Lane& z, const kernels::CompressorArgs& a, index_t rope_pos,
                              int e, bool pair) {
    const Ws& ws = z.ws;
    ValueTest t{pair, y_of(ws, e), 0.0, y_scale(z, e), 0.0, 0.0, 0.0, 1.0, 0.0};
    if (!pair) return t;
    const index_t k = (e - (a.spec.head_dim - kRopeDim)) / 2;
    t.yo = y_of(ws, e + 1), t.so = y_scale(z, e + 1);
    t.pe = std::fabs(pooled_of(ws, e)), t.po = std::fabs(pooled_of(ws, e + 1));
    t.nc = std::fabs(double(a.rope.cos_row(rope_pos)[k].to_float()));
    t.ns = std::fabs(double(a.rope.sin_row(rope_pos)[k].to_float()));
    return t;
  }
  // The ρ at which none of the listed values ch[0 .. nch) (listed at rho) holds a boundary with
  // its own bounds as they are: the largest found by 20 bisections of [0, rho] (the listing's
  // interval grows with ρ); 0 where one holds one at ρ = 0 (its own bound, which ρ's channels do
  // not clear). Only a target: the rounds list again after each repair.
  static double rho_clear(const Lane& z, const kernels::CompressorArgs& a, index_t rope_pos,
                          const int* ch, int nch, double rho) {
    const int HD = int(a.spec.head_dim), nope = HD - int(kRopeDim);
    ValueTest test[kMaxChannels];
    double be[kMaxChannels], bo[kMaxChannels];
    for (int i = 0; i < nch; ++i) {  // nch <= kMaxChannels (check_rounding)
      const int d = ch[i], e = d >= nope ? d - (d - nope) % 2 : d;
      test[i] = value_test(z, a, rope_pos, e, d >= nope);
      be[i] = both_parts(z.ws.bound, HD, e);
      bo[i] = d >= nope ? both_parts(z.ws.bound, HD, e + 1) : 0.0;
    }
    const auto any = [&](double r) {
      for (int i = 0; i < nch; ++i)
        if (test[i].splits(be[i], bo[i], r)) return true;
      return false;
    };
    if (!(rho > 0.0) || any(0.0)) return 0.0;
    double lo = 0.0, hi = rho;
    for (int it = 0; it < 20; ++it) {
      const double mid = 0.5 * (lo + hi);
      (any(mid) ? hi : lo) = mid;
    }
    return lo;
  }
  // The next parts to repair for ρ (check_rounding): the listed channels' (ch[0 .. nch)) not yet
  // repaired, then the rest by how much of ρ's sum they remove, up to kRhoParts in all. Channel
  // d's share of the sum is p_d² (b_k + b_s)² (p: pooled + plo; b_k = bound_r[d], b_s =
  // bound_r[HD + d]: its kv part's and its scores' bounds, 0 once repaired or with nothing to
  // repair; a NaN share counts as none); repairing its larger part L first removes p_d² L (L + 2S)
  // of it (kv's the larger on a tie), its smaller part S then the rest, p_d² S² (at most a third
  // of the first). Those gains (0 and NaN: none) are ranked by buckets of an eighth of an octave
  // below the largest share (kGainBuckets of them, the last one everything smaller), largest
  // first, channel order within a bucket (a channel's smaller part lands in a later bucket than
  // its larger one, or after it in the last). Taken in that order: whole buckets while they fit
  // in the round and leave more than keep (a fraction) of the sum (every channel's share, the
  // listed ones' too), then the next bucket's parts until keep is reached or the round is full;
  // at least one part, if there is one. keep <= 0 (or NaN): a full round. The parts come out
  // listed ones first, then in channel order. Returns their number (0: no part has a share
  // left). ws.hit is its scratch (the listing writes it anew).
  // Parts, not channels: a round needs the sum to shrink, and a channel's larger part holds most
  // of its share (docs/compressors.md: 24 % fewer parts in the inner compressor's rounds than
  // whole channels by their shares, with the rounds of up to 64 parts aimed at 0.95 of
  // rho_clear's ρ, against 16 channels aimed at 0.8). Buckets, not a sort: no branch on the
  // gains' order (an exact sort took as many parts, and cost about what they saved).
  static constexpr int kGainBuckets = 128;  // 16 octaves
  static int next_parts(const Ws& ws, index_t HD, const int* ch, int nch, int* parts,
                        double keep = 0.0) {
    const int H = int(HD);
    int m = 0;
    for (int i = 0; i < nch && m + 2 <= kRhoParts; ++i)
      for (const int p : {ch[i], ch[i] + H})
        if (part_left(ws, p) && std::find(parts, parts + m, p) == parts + m) parts[m++] = p;
    if (m == kRhoParts) return m;
    const int listed = m, cap = kRhoParts - listed;
    const bool full = !(keep > 0.0);
    // Per channel (ws.hit as scratch: the listing writes it anew): -1 listed, else its parts'
    // buckets + 1 (bits 0-7: the larger part's, 8-15: the smaller's; 0: no gain).
    std::int32_t* const tag = ws.hit;
    std::fill_n(tag, H, 0);
    for (int i = 0; i < nch; ++i) tag[ch[i]] = -1;
    const auto p2_of = [&](int d) {
      const double p = pooled_of(ws, d);
      return p * p;
    };
    // Pass 1: the sum, the listed channels' shares, the largest share (no gain exceeds it).
    double sum = 0.0, listed_share = 0.0, top = 0.0;
    for (int d = 0; d < H; ++d) {
      const double b = double(ws.bound_r[d]) + double(ws.bound_r[H + d]);
      const double share = p2_of(d) * b * b;
      if (!(share > 0.0)) continue;  // 0, NaN (a NaN pooled value: such a row is not checked)
      sum += share;
      if (tag[d] < 0) listed_share += share;
      top = std::max(top, share);
    }
    if (!(top > 0.0)) return m;  // no part with a gain
    const auto key = [](double g) { return std::int64_t(std::bit_cast<std::uint64_t>(g) >> 49); };
    const std::int64_t ktop = key(top);
    const auto bucket = [&](double g) {  // g > 0, g <= top
      return int(std::min<std::int64_t>(ktop - key(g), kGainBuckets - 1));
    };
    // Channel d's gains: its larger part's and its smaller's, and which part is the larger.
    const auto gains = [&](int d, double* g) {
      const double bk = double(ws.bound_r[d]), bs = double(ws.bound_r[H + d]);
      const double p2 = p2_of(d);
      const bool kv = bk >= bs;
      const double L = kv ? bk : bs, S = kv ? bs : bk;
      g[0] = p2 * L * (L + 2.0 * S);
      g[1] = p2 * S * S;
      return kv;
    };
    // Pass 2: the buckets' counts and gains, each channel's buckets in its tag.
    int cnt[kGainBuckets] = {};
    double gs[kGainBuckets] = {};
    for (int d = 0; d < H; ++d) {
      if (tag[d] < 0) continue;
      double g[2];
      gains(d, g);
      std::int32_t t = 0;
      for (int i = 0; i < 2; ++i) {
        if (!(g[i] > 0.0)) continue;  // 0, NaN
        const int b = bucket(g[i]);
        ++cnt[b];
        gs[b] += g[i];
        t |= (b + 1) << (8 * i);
      }
      tag[d] = t;
    }
    double left = sum - listed_share;  // what is left of the sum once the parts taken are repaired
    const auto done = [&] { return !full && left <= keep * sum; };
    int taken = 0, cut = 0;
    for (; cut < kGainBuckets; ++cut) {  // whole buckets
      if (cnt[cut] == 0) continue;
      if (taken + cnt[cut] > cap || done() || (!full && left - gs[cut] <= keep * sum)) break;
      taken += cnt[cut];
      left -= gs[cut];
    }
    // Pass 3: the whole buckets' parts, and bucket `cut`'s in channel order while not done (the
    // first one in any case where nothing else is taken) and the round has room.
    int room = cap - taken;
    bool want = cut < kGainBuckets && (!done() || (listed == 0 && taken == 0));
    for (int d = 0; d < H; ++d) {
      const std::int32_t t = tag[d];
      if (t <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        const int b = ((t >> (8 * i)) & 0xff) - 1;
        if (b < 0 || b > cut || (b == cut && !(want && room > 0))) continue;
        double g[2];
        const bool kv = gains(d, g);
        parts[m++] = (i == 0) == kv ? d : H + d;
        if (b == cut) {
          --room;
          left -= g[i];
          want = !done();
        }
      }
    }
    return m;
  }

  // Whether project makes the FP32 copy of x_n (ws.x32): not with Bf16Dot::exact (double dots on
  // the BF16 rows) nor on the vdpbf16ps path (which packs a BF16 panel there).
  static bool x32_made(const Cpu<I>& be) {
    return be.bf16_dot != Bf16Dot::exact && !(I == Isa::avx512 && be.bf16_dot == Bf16Dot::dpbf16);
  }
  // That copy (the same values as x_n), or nullptr where project made none.
  static const float* x32(const Cpu<I>& be, const kernels::CompressorArgs& a) {
    return x32_made(be) ? ws_of(a).x32 : nullptr;
  }
  // Golden's state values of parts[0 .. np) (own_parts) of every written candidate. The
  // candidates on one half share the weight rows (wkv's or wgate's row off + d), so that half's
  // tokens go through them together: bf16_rows_gather_dots_rounded (golden's sums rounded to
  // FP32, certified in a faster order with the rows' norms; x widened from x32, the FP32 copy of
  // x_n, where there is one), the rows read once per kFewTok tokens.
  static void repair_parts(const Lane& z, const kernels::CompressorArgs& a, const float* x32,
                           const WrittenCand* wc, int nw, const int* parts, int np) {
    constexpr int kRows = kRepairRows, kTok = kFewTok;
    const index_t D = a.cfg->hidden, OUT = a.spec.out_dim(), HD = a.spec.head_dim;
    const bf16* rows[kRows] = {};
    float norms[kRows] = {};
    const bf16* xs[kTok] = {};
    const float* xf[kTok] = {};
    const WrittenCand* who[kTok];
    float s[kTok][kRows];
    bool taken[2 * 128] = {};
    for (int q = 0; q < nw; ++q) {
      if (taken[q]) continue;
      const index_t off = wc[q].off;
      for (int i = 0; i < np; ++i) {
        const bool kv = parts[i] < HD;
        const index_t r = off + parts[i] % HD;  // the part's weight row
        rows[i] = kv ? &a.w.wkv(r, 0) : &a.w.wgate(r, 0);
        norms[i] = a.w.row_norms(kv ? r : OUT + r);
      }
      int m = 0;
      const auto flush = [&] {
        // The rows in parts that threads run at once (the same bits: each row's dots are the
        // row's own): two halves where another thread helps the lanes; without lanes, a part per
        // 16 rows, up to the executor's threads.
        const int h = z.crew ? (np >= 2 && z.crew->helping() ? 2 : 1)
                             : int(std::clamp<index_t>(np / 16, 1, index_t(z.be->concurrency())));
        z.be->tasks(h, [&](std::int64_t i) {
          const int r0 = int(i) * np / h, r1 = (int(i) + 1) * np / h;
          bf16_rows_gather_dots_rounded(I, m, xs, r1 - r0, rows + r0, norms + r0, D, s[0] + r0,
                                        kRows, x32 ? xf : nullptr);
        });
        for (int u = 0; u < m; ++u) {
          const WrittenCand& w = *who[u];
          const float* ape = &a.w.ape(a.meta.positions(w.t) % a.spec.ratio, off);
          for (int i = 0; i < np; ++i) {
            const index_t d = parts[i] % HD;
            if (parts[i] < HD)
              w.row[off + d] = s[u][i];
            else
              w.row[OUT + off + d] = s[u][i] + ape[d];
          }
        }
        m = 0;
      };
      for (int p = q; p < nw; ++p) {
        if (taken[p] || wc[p].off != off) continue;
        taken[p] = true;
        xs[m] = &a.x_n(wc[p].t, 0);
        xf[m] = x32 ? x32 + wc[p].t * D : nullptr;
        who[m] = &wc[p];
        if (++m == kTok) flush();
      }
      if (m > 0) flush();
    }
  }

  // Golden's state values of every part not yet fixed (ws.fixed) of every written candidate, so
  // that all of them are golden's (every channel, kv and score, of its half): the parts through
  // repair_parts, at most kRepairRows at a time; the parts the rounds repaired are not read again.
  static void repair_rest(const Lane& z, const kernels::CompressorArgs& a, const float* x32,
                          const WrittenCand* wc, int nw) {
    const int HD = int(a.spec.head_dim);
    int parts[kRepairRows], m = 0;
    for (int p = 0; p < 2 * HD; ++p) {
      if (z.ws.fixed[p]) continue;
      parts[m++] = p;
      if (m == kRepairRows) {
        repair_parts(z, a, x32, wc, nw, parts, m);
        m = 0;
      }
    }
    if (m > 0) repair_parts(z, a, x32, wc, nw, parts, m);
  }
  // Main: cmp_kv[slot] = bf16(y). Inner: y_bf = bf16(y), z = y_bf @ H, z_bf = bf16(z), Q8.
  static void emit(Lane& z, const kernels::CompressorArgs& a, index_t b, index_t, index_t slot) {
    const index_t HD = a.spec.head_dim;
    const Ws& ws = z.ws;
    if (!a.inner) {
      bf16* dst = a.cmp_kv.data() + slot * a.cmp_kv.stride(0);
      for (index_t i = 0; i < HD; ++i) dst[i] = bf16(ws.y[i]);
    } else {
      for (index_t i = 0; i < HD; ++i) ws.pooled[i] = round_bf16(ws.y[i]);
#if TILEDECODE_X86
      if constexpr (avx2) {
        avx2::compressor_hadamard_row(ws.z, ws.pooled, a.hadamard.data(), a.hadamard.stride(0), HD);
      } else
#endif
      {
        kernels::detail::hadamard_row_scalar(ws.z, ws.pooled, a.hadamard.data(),
                                             a.hadamard.stride(0), HD);
      }
      for (index_t i = 0; i < HD; ++i) ws.z[i] = round_bf16(ws.z[i]);
      a.idx_scale(slot) = quantize_q8(
          std::span<std::int8_t>(a.idx_kv.data() + slot * a.idx_kv.stride(0), std::size_t(HD)),
          std::span<const float>(ws.z, std::size_t(HD)));
    }
    if (a.has_kv_out()) std::memcpy(&a.kv_out(b, 0), ws.y, sizeof(float) * std::size_t(HD));
  }
  static void finish(const Cpu<I>&, const kernels::CompressorArgs&) {}
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::Compressor, cpu::Cpu<I>> : cpu::backend_ops_compressor<I> {};
}  // namespace tiledecode
