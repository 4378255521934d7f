#pragma once
// Compressors of spec §6: learned, per-channel softmax-gated pooling of R raw tokens into one
// compressed KV row, with per-token FP32 state caches.
//
//   CSA main   ratio 4, overlapping (COFF 2), OUT_DIM 1024, head_dim 512 → BF16 cmp_kv rows
//   HCA        ratio 128, non-overlapping,    OUT_DIM 512,  head_dim 512 → BF16 cmp_kv rows
//   indexer    ratio 4, overlapping,          OUT_DIM 256,  head_dim 128 → Hadamard → Q8 →
//   (inner)                                                                INT8 idx cache + scale
//
// One step, for T = B*S token rows t = b*S + s at positions pos_t:
//   1. projections (all T tokens at once; they do not read any cache):
//        kv_t = x_n[t] @ wkv^T, g_t = x_n[t] @ wgate^T + ape[pos_t % R]   (FP32 accumulate)
//   2. for b = 0 .. B-1, in order:
//      a. for every token s of b: state_pool[state_slot(t)] = [kv_t | g_t] (skipped if slot -1)
//      b. for every token s of b with cmp_slot(t) >= 0 (a committed window boundary, P = pos_t,
//         c = P / R): pool each channel d < head_dim over the window, reading the state rows
//         through `state_table` by ABSOLUTE position (page -> state_table[b, pos / page]; an
//         unmapped page (< 0) or a column past the table reads kv 0 and score "-inf" = kNegBig):
//           ratio 4 overlap: previous window positions 4c-4..4c-1 give their FRONT halves
//             (kv[d], score[d]), current window 4c..4c+3 their BACK halves (kv[hd+d],
//             score[hd+d]); c = 0 has no previous window (those 4 candidates are absent);
//           ratio 128: positions 128c..128c+127, kv[d], score[d];
//         pooled[d] = Σ_j e^{g_j[d]} kv_j[d] / Σ_j e^{g_j[d]};
//         y = pooled * rsqrt(mean(pooled²) + eps) * norm_w; y[hd-64:hd] = rope_fwd(·, rope_pos);
//         main: cmp_kv[cmp_slot] = bf16(y);
//         inner: idx_kv_cache[slot], idx_kv_scale[slot] = Q8(bf16(bf16(y) @ hadamard));
//         kv_out[b] = y (FP32), when kv_out is given.
//   Requests run in order and each one scatters before it pools because fixture state pools
//   alias across requests (spec §3.8: CSA state pools have 65 blocks, so request 1 block 17 is
//   request 0 block 1) and, for HCA, a step's draft token can alias the oldest row of the window
//   it closes (a 128-position ring). Kernel and golden follow the same order, so they agree; a
//   production allocator hands out disjoint blocks and the order stops mattering.
//
// Choices (spec [AMBIGUOUS]/[QUIRK] points):
//   * Commit masking. A boundary token at s >= commit_tokens has cmp_slot -1 (the metadata
//     builder masks it). Such a token is NOT pooled at all: no cache row, no kv_out row — the
//     draft's window will be closed again, with committed data, on the next step. Its state row
//     is still written (states have no commit masking, spec §3.6). kv_out rows of requests that
//     emit nothing are left untouched (callers zero them, as the reference harness does).
//   * cmp_slot >= 0 on a token that does not close a window ((pos+1) % R != 0) is rejected.
//   * Inner-compressor RoPE position (spec §5 table, §11.2): `InnerRopePosition`. Default
//     `window_start` = c*4, the position the main compressors use and the row's own first raw
//     position (the standalone indexer-compressor test); `request_start` = start_b =
//     positions[b*S] reproduces the reference CSA composition bit-for-bit.
//   * HCA history (spec §6.3, §11.5): state rows never written read as whatever the pool holds
//     (zero-initialised fixtures: score 0, kv 0, so they take part with weight e^0).
//   * Main compressors rotate at the window start c*R (spec §5).
//
// Fast path: the projections read 2 × OUT_DIM × D BF16 weights per step and dominate. Tasks own
// 24 weight rows; a 3-row × 4-token register tile (BF16 → FP32 by a shift, FMA into lane-wise
// accumulators) makes one pass over K per token group, so the weights stream from DRAM once per
// step (software prefetch ahead) and are re-read from L1/L2 by later token groups. Pooling is an
// online softmax over chunks of 8 candidates. Work is split by shape only (weight rows, channels),
// each output has one fixed reduction order, so results are bit-identical for any thread count.
// The AVX2 path is chosen by ctx.isa; the scalar twin is always compiled.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "tiledecode/backend/cpu/compressor_avx2.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::kernels {

// Geometry of one compressor (spec §6.2–§6.4).
struct CompressorSpec {
  int ratio = 4;        // R: 4 or 128
  int head_dim = 512;   // width of the emitted row: 512 (main), 128 (indexer inner)
  bool overlap = true;  // ratio-4 overlapping windows (COFF 2)

  constexpr int coff() const { return overlap ? 2 : 1; }
  constexpr int out_dim() const { return coff() * head_dim; }  // OUT_DIM
  constexpr int state_width() const { return 2 * out_dim(); }  // [kv | score]
  constexpr int window() const { return coff() * ratio; }      // candidates per channel
};

// CSA main compressor: ratio 4, overlapping, OUT_DIM 1024.
constexpr CompressorSpec csa_compressor_spec(const ModelConfig& cfg) {
  return {4, cfg.head_dim, true};
}
// HCA compressor: ratio 128, OUT_DIM 512.
constexpr CompressorSpec hca_compressor_spec(const ModelConfig& cfg) {
  return {128, cfg.head_dim, false};
}
// Indexer inner compressor: ratio 4, overlapping, head_dim 128, OUT_DIM 256.
constexpr CompressorSpec indexer_compressor_spec(const ModelConfig& cfg) {
  return {4, cfg.idx_head_dim, true};
}

// State page rows of a compressor (spec §1.3): 4 for ratio 4, 8 for ratio 128.
constexpr int compressor_state_page(const ModelConfig& cfg, const CompressorSpec& spec) {
  return spec.ratio == 4 ? cfg.c4_state_page : cfg.c128_state_page;
}

// Weights of one compressor (spec §2). All row-major with unit inner stride.
struct CompressorWeights {
  ConstView<bf16, 2> wkv;     // (OUT_DIM, D) BF16, used as x @ wkv^T
  ConstView<bf16, 2> wgate;   // (OUT_DIM, D) BF16
  ConstView<float, 2> ape;    // (R, OUT_DIM) FP32, added to the gate of position pos % R
  ConstView<bf16, 1> norm_w;  // (head_dim) BF16 RMSNorm weight
};

// Step metadata of one compressor (spec §3). Slot mappings are INT64 flattened physical rows,
// -1 = "do not write"; table entries < 0 are unmapped pages.
struct CompressorMetadata {
  paged::StepShape shape;                         // B, S (commit masking lives in cmp_slot_mapping)
  ConstView<std::int32_t, 1> positions;           // (T) absolute position of token t = b*S + s
  ConstView<std::int64_t, 1> state_slot_mapping;  // (T) state row of each token, or -1
  ConstView<std::int64_t, 1> cmp_slot_mapping;    // (T) emitted row of a committed boundary, or -1
  ConstView<std::int32_t, 2> state_table;         // (B, cols) state page ids by pos / state_page
};

// RoPE position of the indexer's compressed row (spec §5 [AMBIGUOUS], §11.2).
enum class InnerRopePosition : std::uint8_t {
  window_start,   // c * 4 (default; same rule as the main compressors)
  request_start,  // start_b = positions[b*S] (the reference CSA composition)
};

namespace detail {

inline constexpr index_t kWsAlign = 16;  // floats: every workspace part starts on 64 bytes
constexpr index_t ws_round(index_t n) {
  return (n + kWsAlign - 1) / kWsAlign * kWsAlign;
}

}  // namespace detail

// Workspace (FP32 elements) one compressor step with `tokens` = B*S rows needs:
// x_n widened to FP32 (T, D), the projected state rows (T, 2*OUT_DIM), one masked state row,
// and the pooled / normalised / rotated row buffers.
constexpr index_t compressor_workspace_size(const ModelConfig& cfg, const CompressorSpec& spec,
                                            index_t tokens) {
  return detail::ws_round(tokens * cfg.hidden) + detail::ws_round(tokens * spec.state_width()) +
         detail::ws_round(spec.state_width()) + 3 * detail::ws_round(spec.head_dim);
}

namespace detail {

// ---------------------------------------------------------------------------------------------
// Scalar twins of the AVX2 microkernels in backend/cpu/compressor_avx2.hpp: same task split,
// same lane-wise summation order (8 lanes, ascending k, the AVX2 horizontal-sum tree), same
// candidate order; one row at a time (no register tile), std::exp instead of the polynomial exp.

// out[t*ld_out + r] = Σ_k x[t*ld_x + k] * w[r*ld_w + k]; 8 lane-wise partial sums per output.
inline void project_rows_scalar(float* out, index_t ld_out, const float* x, index_t ld_x,
                                index_t n_tok, const bf16* w, index_t ld_w, index_t n_rows,
                                index_t d) {
  constexpr int G = cpu::kCompressorTokenGroup;
  for (index_t tg = 0; tg < n_tok; tg += G) {
    const int nt = static_cast<int>(std::min<index_t>(G, n_tok - tg));
    const float* xg = x + tg * ld_x;
    for (index_t r = 0; r < n_rows; ++r) {
      float acc[G][8] = {};  // (tokens, lanes) partial sums of this row
      const bf16* wr = w + r * ld_w;
      for (index_t k = 0; k < d; k += 8) {
        float wf[8];
        for (int l = 0; l < 8; ++l) wf[l] = wr[k + l].to_float();
        for (int t = 0; t < nt; ++t) {
          const float* xt = xg + t * ld_x + k;
          for (int l = 0; l < 8; ++l) acc[t][l] += wf[l] * xt[l];
        }
      }
      for (int t = 0; t < nt; ++t) {
        const float* a = acc[t];
        out[(tg + t) * ld_out + r] =
            ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
      }
    }
  }
}

inline void pool_channels_scalar(float* pooled, const float* const* kv, const float* const* score,
                                 int n_cand, index_t c0, index_t c1) {
  for (index_t c = c0; c < c1; ++c) {
    float m = kNegBig, l = 0.0f, acc = 0.0f;
    for (int j0 = 0; j0 < n_cand; j0 += cpu::kCompressorPoolChunk) {
      const int j1 = std::min(n_cand, j0 + cpu::kCompressorPoolChunk);
      float m_new = m;
      for (int j = j0; j < j1; ++j) m_new = std::max(m_new, score[j][c]);
      const float alpha = std::exp(m - m_new);
      l *= alpha;
      acc *= alpha;
      for (int j = j0; j < j1; ++j) {
        const float p = std::exp(score[j][c] - m_new);
        l += p;
        acc += p * kv[j][c];
      }
      m = m_new;
    }
    pooled[c] = l > 0.0f ? acc / l : 0.0f;
  }
}

inline void hadamard_row_scalar(float* z, const float* y, const bf16* h, index_t ld_h, index_t n) {
  for (index_t j = 0; j < n; ++j) z[j] = 0.0f;
  for (index_t i = 0; i < n; ++i) {
    const float yi = y[i];
    const bf16* hr = h + i * ld_h;
    for (index_t j = 0; j < n; ++j) z[j] += yi * hr[j].to_float();
  }
}

inline bool use_avx2(const cpu::Context& ctx) {
  return TILEDECODE_X86 && cpu::has_avx2(ctx.isa);
}

// ---------------------------------------------------------------------------------------------
// Validation (once, before the first write).

inline bool view_given(index_t size, const void* data) {
  return data != nullptr && size > 0;
}

template <class T>
void check_matrix(std::string_view where, std::string_view arg, ConstView<T, 2> v, index_t rows,
                  index_t cols) {
  // The argument name is built only on failure: validation runs every step, allocation-free.
  if (rows >= 0 && v.extent(0) != rows)
    check_equal(where, std::string(arg) + ".extent(0)", v.extent(0), rows);
  if (v.extent(1) != cols) check_equal(where, std::string(arg) + ".extent(1)", v.extent(1), cols);
  if (v.stride(1) != 1)
    check_equal(where, std::string(arg) + ".stride(1)", v.stride(1), index_t(1));
  if (v.data() == nullptr && v.extent(0) > 0) throw_arg(where, arg, "null", "a view with data");
}

// Everything the compressor reads or writes, validated; returns nothing, throws tiledecode::Error.
// cache_rows: rows of the destination cache (cmp_kv or idx_kv_cache).
inline void check_compressor_args(std::string_view where, const ModelConfig& cfg,
                                  const CompressorSpec& spec, ConstView<float, 2> state_pool,
                                  index_t cache_rows, ConstView<float, 2> kv_out,
                                  ConstView<bf16, 2> x_n, const CompressorWeights& w,
                                  const CompressorMetadata& meta, const RopeTableView& rope,
                                  InnerRopePosition rope_rule, ConstView<float, 1> workspace) {
  if (spec.ratio != 4 && spec.ratio != 128) throw_arg(where, "spec.ratio", spec.ratio, "4 or 128");
  if (spec.overlap != (spec.ratio == 4)) {
    throw_arg(where, "spec.overlap", int(spec.overlap), "1 for ratio 4, 0 for ratio 128");
  }
  if (spec.head_dim < kRopeDim || spec.head_dim % 8 != 0) {
    throw_arg(where, "spec.head_dim", spec.head_dim, "a multiple of 8, >= 64");
  }
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, kRopeDim);
  if (cfg.hidden <= 0 || cfg.hidden % 8 != 0) {
    throw_arg(where, "cfg.hidden", cfg.hidden, "a positive multiple of 8");
  }
  const auto& sh = meta.shape;
  check_range(where, "shape.batch", sh.batch, 1, 1 << 20);
  check_range(where, "shape.seq", sh.seq, 1, 1 << 10);
  const index_t T = sh.tokens(), B = sh.batch, S = sh.seq;
  const index_t D = cfg.hidden, OUT = spec.out_dim(), R = spec.ratio, HD = spec.head_dim;
  const index_t page = compressor_state_page(cfg, spec);

  check_matrix<bf16>(where, "x_n", x_n, T, D);
  check_matrix<bf16>(where, "w.wkv", w.wkv, OUT, D);
  check_matrix<bf16>(where, "w.wgate", w.wgate, OUT, D);
  check_matrix<float>(where, "w.ape", w.ape, R, OUT);
  check_equal(where, "w.norm_w.extent(0)", w.norm_w.extent(0), HD);
  check_matrix<float>(where, "state_pool", state_pool, -1, spec.state_width());
  if (view_given(kv_out.size(), kv_out.data())) check_matrix<float>(where, "kv_out", kv_out, B, HD);
  check_rope_table(where, rope);
  check_equal(where, "workspace.stride(0)", workspace.stride(0), index_t(1));
  check_at_least(where, "workspace.extent(0)", workspace.extent(0),
                 compressor_workspace_size(cfg, spec, T));

  check_equal(where, "positions.extent(0)", meta.positions.extent(0), T);
  check_equal(where, "state_slot_mapping.extent(0)", meta.state_slot_mapping.extent(0), T);
  check_equal(where, "cmp_slot_mapping.extent(0)", meta.cmp_slot_mapping.extent(0), T);
  check_equal(where, "state_table.extent(0)", meta.state_table.extent(0), B);
  check_at_least(where, "state_table.extent(1)", meta.state_table.extent(1), index_t(1));

  const index_t state_rows = state_pool.extent(0);
  const index_t state_blocks = state_rows / page;
  const index_t cols = meta.state_table.extent(1);
  // Argument names are only built on failure: validation runs every step and must stay cheap.
  const auto nth = [](std::string_view arg, index_t i) {
    std::string s(arg);
    s += '[';
    s += std::to_string(i);
    s += ']';
    return s;
  };
  for (index_t t = 0; t < T; ++t) {
    const index_t pos = meta.positions(t);
    if (pos < 0 || pos >= cfg.max_seq_len) {
      check_range<index_t>(where, nth("positions", t), pos, 0, cfg.max_seq_len);
    }
    const index_t ss = meta.state_slot_mapping(t);
    if (ss != -1 && (ss < 0 || ss >= state_rows)) {
      throw_arg(where, nth("state_slot_mapping", t), ss,
                "-1 or [0, " + std::to_string(state_rows) + ") (state pool rows)");
    }
    const index_t cs = meta.cmp_slot_mapping(t);
    if (cs == -1) continue;
    if (cs < 0 || cs >= cache_rows) {
      throw_arg(where, nth("cmp_slot_mapping", t), cs,
                "-1 or [0, " + std::to_string(cache_rows) + ") (cache rows)");
    }
    if ((pos + 1) % R != 0) {
      throw_arg(where, nth("cmp_slot_mapping", t), cs,
                "-1 for a token that closes no window (position " + std::to_string(pos) + ")");
    }
    // Every state-table entry the pooling reads (current window and, with overlap, the previous).
    const index_t b = t / S, c = pos / R;
    const index_t first = (spec.overlap && c > 0) ? (c - 1) * R : c * R;
    for (index_t col = first / page; col <= pos / page && col < cols; ++col) {
      const index_t blk = meta.state_table(b, col);
      if (blk >= state_blocks) {
        throw_arg(where, "state_table[" + std::to_string(b) + "," + std::to_string(col) + "]", blk,
                  "[-1, " + std::to_string(state_blocks) + ") (state pool blocks)");
      }
    }
    const index_t rope_pos =
        rope_rule == InnerRopePosition::request_start ? index_t(meta.positions(b * S)) : c * R;
    if (rope_pos < 0 || rope_pos >= rope.length()) check_rope_position(where, rope, rope_pos);
  }
}

// ---------------------------------------------------------------------------------------------
// The step, shared by both entry points; `emit(slot)` stores the normalised row ws.y.

struct CompressorWorkspace {
  float* x32;       // (T, D)
  float* proj;      // (T, 2*OUT_DIM): [kv | g] = the state rows of this step
  float* null_row;  // (2*OUT_DIM): kv 0, score kNegBig — stands in for unmapped state rows
  float* pooled;    // (head_dim)
  float* y;         // (head_dim)
  float* z;         // (head_dim)
};

inline CompressorWorkspace carve_workspace(const ModelConfig& cfg, const CompressorSpec& spec,
                                           index_t T, float* ws) {
  CompressorWorkspace w{};
  w.x32 = ws;
  w.proj = w.x32 + ws_round(T * cfg.hidden);
  w.null_row = w.proj + ws_round(T * spec.state_width());
  w.pooled = w.null_row + ws_round(spec.state_width());
  w.y = w.pooled + ws_round(spec.head_dim);
  w.z = w.y + ws_round(spec.head_dim);
  return w;
}

// Projections of all T tokens: ws.proj[t] = [x_n[t] @ wkv^T | x_n[t] @ wgate^T + ape[pos % R]].
inline void compressor_project(const cpu::Context& ctx, const ModelConfig& cfg,
                               const CompressorSpec& spec, ConstView<bf16, 2> x_n,
                               const CompressorWeights& w, ConstView<std::int32_t, 1> positions,
                               const CompressorWorkspace& ws) {
  const index_t T = x_n.extent(0), D = cfg.hidden, OUT = spec.out_dim(), SW = spec.state_width();
  ctx.parallel_for(0, T, 1, [&](std::int64_t t) {
    const bf16* src = x_n.data() + t * x_n.stride(0);
    float* dst = ws.x32 + t * D;
    for (index_t k = 0; k < D; ++k) dst[k] = src[k].to_float();
  });
  const bool avx2 = use_avx2(ctx);
  // Tasks of RB rows of wkv, then of wgate: the split depends on the shape only.
  constexpr index_t RB = cpu::kCompressorRowBlock;
  const index_t per = (OUT + RB - 1) / RB;
  ctx.parallel_for(0, 2 * per, 1, [&](std::int64_t i) {
    const bool gate = i >= per;
    const ConstView<bf16, 2>& m = gate ? w.wgate : w.wkv;
    const index_t r0 = (gate ? i - per : i) * RB, n = std::min(RB, OUT - r0);
    float* out = ws.proj + (gate ? OUT : 0) + r0;
    const bf16* wr = m.data() + r0 * m.stride(0);
#if TILEDECODE_X86
    if (avx2) {
      cpu::avx2::compressor_project_rows(out, SW, ws.x32, D, T, wr, m.stride(0), n, D, OUT - r0);
      return;
    }
#endif
    project_rows_scalar(out, SW, ws.x32, D, T, wr, m.stride(0), n, D);
  });
  for (index_t t = 0; t < T; ++t) {
    const index_t a = positions(t) % spec.ratio;
    float* g = ws.proj + t * SW + OUT;
    for (index_t o = 0; o < OUT; ++o) g[o] += w.ape(a, o);
  }
}

// Pools the window closed by token t (request b, compressed row c) into ws.pooled.
inline void compressor_pool(const cpu::Context& ctx, const ModelConfig& cfg,
                            const CompressorSpec& spec, ConstView<float, 2> state_pool,
                            ConstView<std::int32_t, 2> state_table, index_t b, index_t c,
                            const CompressorWorkspace& ws) {
  const index_t R = spec.ratio, HD = spec.head_dim, OUT = spec.out_dim();
  const index_t page = compressor_state_page(cfg, spec);
  const index_t cols = state_table.extent(1);
  // State row of absolute position p, or the masked row for an unmapped page.
  auto row_of = [&](index_t p) -> const float* {
    const index_t col = p / page;
    const index_t blk = col < cols ? index_t(state_table(b, col)) : -1;
    return blk < 0 ? ws.null_row
                   : state_pool.data() + (blk * page + p % page) * state_pool.stride(0);
  };
  const float* kv[2 * 128];
  const float* sc[2 * 128];
  int n = 0;
  if (spec.overlap) {
    if (c > 0) {
      for (index_t p = (c - 1) * R; p < c * R; ++p, ++n) {  // front halves of the previous window
        kv[n] = row_of(p);
        sc[n] = kv[n] + OUT;
      }
    }
    for (index_t p = c * R; p < (c + 1) * R; ++p, ++n) {  // back halves of the current window
      const float* r = row_of(p);
      kv[n] = r + HD;
      sc[n] = r + OUT + HD;
    }
  } else {
    for (index_t p = c * R; p < (c + 1) * R; ++p, ++n) {
      kv[n] = row_of(p);
      sc[n] = kv[n] + OUT;
    }
  }
  const bool avx2 = use_avx2(ctx);
  // Channel blocks only where the window is long enough to be worth a task (shape-only rule).
  const index_t grain = n >= 64 ? 64 : HD;
  ctx.parallel_for(0, (HD + grain - 1) / grain, 1, [&](std::int64_t i) {
    const index_t c0 = i * grain, c1 = std::min(HD, c0 + grain);
#if TILEDECODE_X86
    if (avx2) {
      cpu::avx2::compressor_pool_channels(ws.pooled, kv, sc, n, c0, c1);
      return;
    }
#endif
    pool_channels_scalar(ws.pooled, kv, sc, n, c0, c1);
  });
}

// y = rmsnorm(pooled, norm_w) with forward RoPE on the last 64 dims at rope_pos.
inline void compressor_norm_rope(const ModelConfig& cfg, const CompressorSpec& spec,
                                 ConstView<bf16, 1> norm_w, const RopeTableView& rope,
                                 index_t rope_pos, const CompressorWorkspace& ws) {
  const index_t HD = spec.head_dim;
  float lanes[8] = {};
  for (index_t i = 0; i < HD; ++i) lanes[i % 8] += ws.pooled[i] * ws.pooled[i];
  const float ss = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                   ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  const float r = 1.0f / std::sqrt(ss / float(HD) + cfg.rms_eps);
  for (index_t i = 0; i < HD; ++i) ws.y[i] = ws.pooled[i] * r * norm_w(i).to_float();
  rope_forward(std::span<float>(ws.y + HD - kRopeDim, kRopeDim), rope, rope_pos);
}

template <class Emit>
void compressor_run(const cpu::Context& ctx, const ModelConfig& cfg, const CompressorSpec& spec,
                    View<float, 2> state_pool, View<float, 2> kv_out, ConstView<bf16, 2> x_n,
                    const CompressorWeights& w, const CompressorMetadata& meta,
                    const RopeTableView& rope, InnerRopePosition rope_rule,
                    View<float, 1> workspace, Emit&& emit) {
  const index_t T = meta.shape.tokens(), S = meta.shape.seq, B = meta.shape.batch;
  const index_t SW = spec.state_width(), OUT = spec.out_dim(), HD = spec.head_dim;
  const CompressorWorkspace ws = carve_workspace(cfg, spec, T, workspace.data());
  compressor_project(ctx, cfg, spec, x_n, w, meta.positions, ws);
  for (index_t i = 0; i < SW; ++i) ws.null_row[i] = i < OUT ? 0.0f : kNegBig;
  const bool has_kv_out = view_given(kv_out.size(), kv_out.data());
  for (index_t b = 0; b < B; ++b) {
    for (index_t s = 0; s < S; ++s) {
      const index_t t = b * S + s, slot = meta.state_slot_mapping(t);
      if (slot >= 0) {
        std::memcpy(state_pool.data() + slot * state_pool.stride(0), ws.proj + t * SW,
                    sizeof(float) * std::size_t(SW));
      }
    }
    for (index_t s = 0; s < S; ++s) {
      const index_t t = b * S + s, slot = meta.cmp_slot_mapping(t);
      if (slot < 0) continue;
      const index_t c = meta.positions(t) / spec.ratio;
      compressor_pool(ctx, cfg, spec, state_pool, meta.state_table, b, c, ws);
      const index_t rope_pos = rope_rule == InnerRopePosition::request_start
                                   ? index_t(meta.positions(b * S))
                                   : c * spec.ratio;
      compressor_norm_rope(cfg, spec, w.norm_w, rope, rope_pos, ws);
      emit(slot);
      if (has_kv_out) std::memcpy(&kv_out(b, 0), ws.y, sizeof(float) * std::size_t(HD));
    }
  }
}

}  // namespace detail

// One main-compressor step (CSA ratio 4 overlapping or HCA ratio 128; spec §6.1–§6.3).
//   state_pool  (rows, 2*OUT_DIM) FP32, in/out: flattened state pages (rows = blocks * page,
//               page 4 for ratio 4, 8 for ratio 128); row state_slot_mapping[t] ← [kv_t | g_t].
//   cmp_kv      (rows, 512) BF16, out: row cmp_slot_mapping[t] ← the compressed row.
//   kv_out      (B, 512) FP32, optional (empty view = skip): the FP32 row of request b's emitted
//               window (the last one if a step closes several); other rows untouched.
//   x_n         (T, D) BF16 normalised hidden rows, t = b*S + s.
//   w           wkv/wgate (OUT_DIM, D) BF16, ape (R, OUT_DIM) FP32, norm_w (512) BF16.
//   meta        positions, state/cmp slot mappings (-1 = skip), state table (< 0 = unmapped).
//   rope        the layer's table (CSA/HCA profile); rows up to the largest c*R rotated.
//   workspace   >= compressor_workspace_size(cfg, spec, T) floats, unit stride.
// Throws tiledecode::Error, before writing anything, on any shape, slot, table-id or position
// outside its range (see detail::check_compressor_args).
inline void compressor_step(const cpu::Context& ctx, const ModelConfig& cfg,
                            const CompressorSpec& spec, View<float, 2> state_pool,
                            View<bf16, 2> cmp_kv, View<float, 2> kv_out, ConstView<bf16, 2> x_n,
                            const CompressorWeights& w, const CompressorMetadata& meta,
                            const RopeTableView& rope, View<float, 1> workspace) {
  constexpr std::string_view where = "compressor_step";
  check_equal(where, "spec.head_dim", spec.head_dim, cfg.head_dim);
  detail::check_matrix<bf16>(where, "cmp_kv", cmp_kv, -1, spec.head_dim);
  detail::check_compressor_args(where, cfg, spec, state_pool, cmp_kv.extent(0), kv_out, x_n, w,
                                meta, rope, InnerRopePosition::window_start, workspace);
  const index_t HD = spec.head_dim;
  const detail::CompressorWorkspace ws =
      detail::carve_workspace(cfg, spec, meta.shape.tokens(), workspace.data());
  detail::compressor_run(ctx, cfg, spec, state_pool, kv_out, x_n, w, meta, rope,
                         InnerRopePosition::window_start, workspace, [&](index_t slot) {
                           bf16* dst = cmp_kv.data() + slot * cmp_kv.stride(0);
                           for (index_t i = 0; i < HD; ++i) dst[i] = bf16(ws.y[i]);
                         });
}

// One indexer inner-compressor step (spec §6.4): as compressor_step with
// spec = indexer_compressor_spec(cfg) (head_dim 128, OUT_DIM 256, state rows of 512 floats,
// page 4), but the emitted row y is stored as
//   z = bf16(bf16(y) @ hadamard) (FP32 accumulate), idx_kv_cache[slot], idx_kv_scale[slot] = Q8(z)
//   idx_kv_cache  (rows, 128) INT8, out;  idx_kv_scale (rows) FP32, out (dequant scale).
//   hadamard      (128, 128) BF16, the rotation applied as a row vector times the matrix (the
//                 fixture's Sylvester H/sqrt(128) or any other matrix, spec §6.4 [QUIRK]).
//   rope_rule     position of the rotation (see InnerRopePosition; window_start by default).
//   kv_out        (B, 128) FP32 optional: y before the BF16 rounding and the Hadamard.
inline void indexer_compressor_step(const cpu::Context& ctx, const ModelConfig& cfg,
                                    View<float, 2> state_pool, View<std::int8_t, 2> idx_kv_cache,
                                    View<float, 1> idx_kv_scale, View<float, 2> kv_out,
                                    ConstView<bf16, 2> x_n, const CompressorWeights& w,
                                    ConstView<bf16, 2> hadamard, const CompressorMetadata& meta,
                                    const RopeTableView& rope, View<float, 1> workspace,
                                    InnerRopePosition rope_rule = InnerRopePosition::window_start) {
  constexpr std::string_view where = "indexer_compressor_step";
  const CompressorSpec spec = indexer_compressor_spec(cfg);
  const index_t HD = spec.head_dim;
  detail::check_matrix<std::int8_t>(where, "idx_kv_cache", idx_kv_cache, -1, HD);
  check_equal(where, "idx_kv_scale.extent(0)", idx_kv_scale.extent(0), idx_kv_cache.extent(0));
  detail::check_matrix<bf16>(where, "hadamard", hadamard, HD, HD);
  if (rope_rule != InnerRopePosition::window_start &&
      rope_rule != InnerRopePosition::request_start) {
    throw_arg(where, "rope_rule", int(rope_rule), "window_start or request_start");
  }
  detail::check_compressor_args(where, cfg, spec, state_pool, idx_kv_cache.extent(0), kv_out, x_n,
                                w, meta, rope, rope_rule, workspace);
  const detail::CompressorWorkspace ws =
      detail::carve_workspace(cfg, spec, meta.shape.tokens(), workspace.data());
  const bool avx2 = detail::use_avx2(ctx);
  detail::compressor_run(
      ctx, cfg, spec, state_pool, kv_out, x_n, w, meta, rope, rope_rule, workspace,
      [&](index_t slot) {
        // y_bf = bf16(y) (pooled buffer reused), z = y_bf @ H, z_bf = bf16(z), Q8.
        for (index_t i = 0; i < HD; ++i) ws.pooled[i] = round_bf16(ws.y[i]);
#if TILEDECODE_X86
        if (avx2) {
          cpu::avx2::compressor_hadamard_row(ws.z, ws.pooled, hadamard.data(), hadamard.stride(0),
                                             HD);
        } else {
          detail::hadamard_row_scalar(ws.z, ws.pooled, hadamard.data(), hadamard.stride(0), HD);
        }
#else
        (void)avx2;
        detail::hadamard_row_scalar(ws.z, ws.pooled, hadamard.data(), hadamard.stride(0), HD);
#endif
        for (index_t i = 0; i < HD; ++i) ws.z[i] = round_bf16(ws.z[i]);
        idx_kv_scale(slot) =
            quantize_q8(std::span<std::int8_t>(idx_kv_cache.data() + slot * idx_kv_cache.stride(0),
                                               std::size_t(HD)),
                        std::span<const float>(ws.z, std::size_t(HD)));
      });
}

}  // namespace tiledecode::kernels
