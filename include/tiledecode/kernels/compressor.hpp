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
//   production allocator hands out disjoint blocks and the order stops mattering: the CPU backend
//   then runs the requests' steps 2a-2b at once (backend/cpu/compressor.hpp for_requests: where no
//   request touches a state block or cache slot another one writes; the same bits).
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
// CPU fast path (backend/cpu/compressor.hpp): the projections read 2 × OUT_DIM × D BF16 weights per
// step and dominate. Tasks own 24 weight rows; a 3-row × 4-token register tile (BF16 → FP32 by a
// shift, FMA into lane-wise accumulators) makes one pass over K per token group, so the weights
// stream from DRAM once per step (software prefetch ahead) and are re-read from L1/L2 by later
// token groups. Pooling runs in double (below). Work is split by shape only (weight rows,
// channels), each output has one fixed reduction order, so results are bit-identical for any
// thread count. The AVX2 / AVX-512 path is chosen by ctx.isa; the scalar twin is always compiled.
//
// Pooling in double (issue 17: every value rounded to BF16 or INT8 is accurate to the last bit
// first). y is rounded to BF16 (the cmp_kv row, the inner compressor's Hadamard input), so an error
// of one FP32 ulp in the pooled value flips that rounding whenever y lies within the ulp of a BF16
// midpoint (the example: a pooled 0.876953065, one FP32 ulp below the midpoint of 0.875 and
// 0.87890625, rounded to 0.875). An FP32 pooling is off by more than an ulp: each weight e^(s - m)
// carries the exp's relative error ε_j (~2^-23), which moves the pooled value by
// Σ_j w_j ε_j (kv_j - pooled); the kv spread exceeds the pooled mean (n candidates of N(0, σ) pool
// to ~σ/√n), so that is several pooled ulps, plus the FP32 sums' own roundings. The CPU tiers
// therefore pool in double:
//   m = the FP32 max of the scores (exact); x_j = s_j - m in double (exact: two FP32 values);
//   p_j = cpu::pool_exp_f64(x_j): a one-constant ln2 reduction and a degree-10 Taylor polynomial,
//     relative error <= 2.2e-13 + a few double ulps (x < -708 gives 0: below 1e-307 of the
//     maximum's weight 1);
//   l = Σ_j p_j, acc = Σ_j fma(p_j, kv_j, acc), ascending j, in double; pooled = acc / l;
//   the RMSNorm and the RoPE read that double (kept as an FP32 pair hi + lo, 48 significant bits)
//   and round y once to FP32.
// The error before that rounding is ~1e-12 relative, ~1e-5 of an FP32 ulp, so y is the correctly
// rounded FP32 value of the exact one except for about one value in 10^5–10^6, and its BF16 is
// golden's (which rounds its double y to FP32, then BF16, the same two steps). The inner
// compressor's Hadamard z = bf16(y) · H is summed in double in ascending i as well (each BF16 ×
// BF16 product is exact) and rounded once to FP32, then to BF16, as golden does.
// Every tier runs the same operations lane for lane (scalar: one channel at a time, std::fma for
// the vector FMAs; AVX2: 4 double lanes; AVX-512: 8), so scalar, avx2, avx2_vnni and avx512 give
// the same bits (tests/test_compressor.cpp, CompressorTiers.BitIdenticalAcrossTiers).
// Measured (tests/test_rounding.cpp, ctest rounding.*Compressor*, rounding.IndexerHadamard*; Xeon
// Sapphire Rapids, every tier the same; pooling-only steps at the projections' and the fixtures'
// state statistics): emitted values whose rounding differs from golden's,
//                              double (now)      FP32 (before, same data)
//   CSA cmp_kv BF16            0 / 524288        25 (4.8e-5)
//   HCA cmp_kv BF16            0 / 131072        29 (2.2e-4)
//   inner bf16(y)              0 / 524288        27 (5.2e-5)
//   inner Hadamard z BF16      0 / 524288        30 (5.7e-5)
//   inner INT8 index row       0 / 524288         2 (3.8e-6)
//   FP32 y differing from golden's FP32 y: 0 (CSA, HCA) and 1 / 524288 (inner); before 67–89 %.
// Cost at B = 4 (T = 8), one thread, thread CPU time, Xeon Sapphire Rapids (bench_compressor, 35
// alternating runs; docs/compressors.md "Rounding accuracy" has the table): steps that close no
// window are unchanged (no pooling); steps closing a window on every request, min / median:
// CSA −1.6 / −1.7 %, HCA −2.6 / −3.2 %, inner +0.7 / +2.1 % on the avx512 tier, and CSA −2.4 /
// −0.6 %, HCA +2.7 / +3.6 %, inner −0.2 / +1.4 % on the avx2 tier (the 5 % budget holds). The
// 8-candidate windows got faster (two passes, no online rescale); a 128-candidate HCA row costs
// 47 µs on AVX2 and 43 µs on AVX-512 against 39–40 µs before (hot cache).
// Rounding check (opt-in: CompressorWeights::row_norms given; the CPU tiers). The double pooling
// gives golden's y of the same state rows, but the rows this step writes are its own FP32 dots, a
// few FP32 ulps from golden's: from the same step inputs (x_n, the weights, the state pool before
// the step) golden rounds other values. Before each emit the check bounds, per value of y, how far
// golden's y can be (the written state values' dot bounds, through the softmax weights, the RMS
// factor and the RoPE), and recomputes as golden does the state values of every value whose bound
// holds a BF16 rounding boundary: that value's channel first, every channel of the written
// candidates if the RMS factor still leaves one in doubt (backend/cpu/compressor.hpp "Rounding
// check"). Measured: 0 of 131072 CSA, 32768 HCA and 65536 inner values off golden's from the same
// inputs, where the default dots alone give 1-8 (tests/test_rounding.cpp, docs/compressors.md).
// Opt-in because its repairs (exact dots of one or two tokens) cost more than the 5 % budget on
// steps that close windows: measured +34 % (CSA), +36 % (HCA), +29 % (inner) on
// bench_compressor's `_boundary_live` rows at T = 8, one thread, Zen 5 (docs/compressors.md).
// The a2a3 model keeps FP32 (backend/a2a3/compressor.hpp says why).

// Program (below): project (the BF16 tile matmul of x_n with [wkv; wgate], + ape) -> per request,
// in order: the state rows, then every committed boundary: the gated pool of its window (rules/
// compressor.hpp), RMSNorm + RoPE, and the emit (main: BF16 row; inner: BF16 -> Hadamard -> BF16 ->
// Q8); then `finish` (a backend that batches the inner emit across tokens — the a2a3 Hadamard and
// Q8 launches — completes it there).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/rules/compressor.hpp"
#include "tiledecode/tile/backend.hpp"

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
  // Optional, opt-in: per row of wkv, then per row of wgate, an upper bound of its Euclidean norm
  // (compressor_row_norms), each >= 0 (+Inf: a bound that trusts nothing). Given it, the CPU
  // backend's rounding check (backend/cpu/compressor.hpp) makes every emitted BF16 row round as
  // golden's does from the step's inputs, recomputing as golden does the state values whose error
  // could flip one of its roundings.
  ConstView<float, 1> row_norms = {};  // (2 * OUT_DIM)
};

// Per row of wkv, then of wgate, an upper bound of its Euclidean norm (bf16_norm_bound: FP32,
// rounded up; +Inf past FLT_MAX or for a row with a NaN): CompressorWeights::row_norms. A load-time
// preparation (decode/layer.hpp LayerWeightsStorage::enable_compressor_rounding_check).
// Throws tiledecode::Error if wgate's extents are not wkv's.
inline Tensor<float, 1> compressor_row_norms(ConstView<bf16, 2> wkv, ConstView<bf16, 2> wgate) {
  constexpr std::string_view where = "compressor_row_norms";
  check_view(where, "wkv", wkv);
  check_extents(where, "wgate", wgate, {wkv.extent(0), wkv.extent(1)});
  const index_t OUT = wkv.extent(0), D = wkv.extent(1);
  Tensor<float, 1> r({2 * OUT});
  for (index_t n = 0; n < OUT; ++n) {
    r.data()[n] = bf16_norm_bound(&wkv(n, 0), D, wkv.stride(1));
    r.data()[OUT + n] = bf16_norm_bound(&wgate(n, 0), D, wgate.stride(1));
  }
  return r;
}

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

// Request lanes of the CPU backend (backend/cpu/compressor.hpp, for_requests): requests whose
// tails (state rows, pooling, check, emit) touch no state block or cache slot that another one
// writes run on up to this many lanes at once, each with its own part of the workspace.
inline constexpr index_t kCompressorLanes = 8;
// One lane's part (floats): the pooled, y, z, y_lo, softmax max and sum rows, the pooling's kept
// max and the listing's flags (head_dim each), the check's two bounds (2 head_dim each), the
// pooling's kept sums (2 head_dim doubles) and the repairs' flags (2 head_dim bytes).
constexpr index_t compressor_lane_size(const CompressorSpec& spec) {
  return 8 * ws_round(spec.head_dim) + 2 * ws_round(2 * spec.head_dim) +
         ws_round(4 * spec.head_dim) + ws_round(spec.head_dim / 2);
}
// Entries (two INT64 each) of the lanes' independence test: per token its state block written, its
// cache slot written and the state pages its window reads (window positions in a row: at most
// window / page + 2).
constexpr index_t compressor_dep_entries(const ModelConfig& cfg, const CompressorSpec& spec,
                                         index_t tokens) {
  const index_t page = compressor_state_page(cfg, spec) > 0 ? compressor_state_page(cfg, spec) : 1;
  return tokens * (4 + spec.window() / page);
}

}  // namespace detail

// Workspace (FP32 elements) one compressor step with `tokens` = B*S rows needs:
// x_n widened to FP32 (T, D), the projected state rows (T, 2*OUT_DIM), one masked state row,
// norm_w as FP32 (head_dim), the written tokens' slots (T INT64), token order (T INT32) and error
// scales (T), the lanes' independence test (detail::compressor_dep_entries), and kCompressorLanes
// lanes of the pooled / normalised / rotated row buffers and the rounding check's rows
// (compressor_lane_size).
constexpr index_t compressor_workspace_size(const ModelConfig& cfg, const CompressorSpec& spec,
                                            index_t tokens) {
  return detail::ws_round(tokens * cfg.hidden) + detail::ws_round(tokens * spec.state_width()) +
         detail::ws_round(spec.state_width()) + detail::ws_round(spec.head_dim) +
         detail::ws_round(2 * tokens) + 2 * detail::ws_round(tokens) +
         detail::ws_round(4 * detail::compressor_dep_entries(cfg, spec, tokens)) +
         detail::kCompressorLanes * detail::compressor_lane_size(spec);
}

// ---------------------------------------------------------------------------------------------
// Validation (once, before the first write).

namespace detail {

inline bool view_given(index_t size, const void* data) {
  return data != nullptr && size > 0;
}

template <class T>
void check_matrix(std::string_view where, std::string_view arg, ConstView<T, 2> v, index_t rows,
                  index_t cols) {
  // The argument name is built only on failure: validation runs every step, allocation-free.
  check_view(where, arg, v);  // extents >= 0 (a negative extent would reach a memcpy size)
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
  // Extents, data and a unit stride (the a2a3 model copies it as one contiguous row): a
  // right-sized view without data used to pass and crash the pooling (tests/test_all_or_nothing).
  check_rows(where, "w.norm_w", w.norm_w, {HD});
  if (view_given(w.row_norms.size(), w.row_norms.data())) {
    check_rows(where, "w.row_norms", w.row_norms, {2 * OUT});
    check_nonnegative(where, "w.row_norms", w.row_norms, "a value >= 0 (compressor_row_norms)");
  }
  check_matrix<float>(where, "state_pool", state_pool, -1, spec.state_width());
  if (view_given(kv_out.size(), kv_out.data())) check_matrix<float>(where, "kv_out", kv_out, B, HD);
  check_rope_table(where, rope);
  check_equal(where, "workspace.stride(0)", workspace.stride(0), index_t(1));
  check_at_least(where, "workspace.extent(0)", workspace.extent(0),
                 compressor_workspace_size(cfg, spec, T));

  check_equal(where, "positions.extent(0)", meta.positions.extent(0), T);
  check_equal(where, "state_slot_mapping.extent(0)", meta.state_slot_mapping.extent(0), T);
  check_equal(where, "cmp_slot_mapping.extent(0)", meta.cmp_slot_mapping.extent(0), T);
  check_view(where, "state_table", meta.state_table);
  // A table may have more rows than B (an engine's max-batch table); rows 0..B-1 are read.
  if (meta.state_table.extent(0) < B)
    check_at_least(where, "state_table.extent(0)", meta.state_table.extent(0), B);
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
      if (blk < -1 || blk >= state_blocks) {  // -1 is the only unmapped marker
        throw_arg(where, "state_table[" + std::to_string(b) + "," + std::to_string(col) + "]", blk,
                  "[-1, " + std::to_string(state_blocks) + ") (state pool blocks)");
      }
    }
    const index_t rope_pos =
        rope_rule == InnerRopePosition::request_start ? index_t(meta.positions(b * S)) : c * R;
    if (rope_pos < 0 || rope_pos >= rope.length()) check_rope_position(where, rope, rope_pos);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// The program.

struct Compressor {
  static constexpr std::string_view kernel_name(const CompressorSpec& s, bool inner) {
    return inner ? "indexer_inner_compressor"
                 : (s.ratio == 4 ? "compressor_ratio4" : "compressor_ratio128");
  }
};

struct CompressorArgs {
  const ModelConfig* cfg = nullptr;
  CompressorSpec spec;
  bool inner = false;           // the indexer's inner compressor (emits INT8 index rows)
  View<float, 2> state_pool;    // (rows, 2*OUT_DIM), updated
  View<bf16, 2> cmp_kv;         // main: (rows, head_dim)
  View<std::int8_t, 2> idx_kv;  // inner: (rows, head_dim)
  View<float, 1> idx_scale;     // inner: (rows)
  View<float, 2> kv_out;        // optional (B, head_dim) FP32 emitted rows
  ConstView<bf16, 2> x_n;       // (T, D)
  CompressorWeights w;
  ConstView<bf16, 2> hadamard;  // inner: (head_dim, head_dim)
  CompressorMetadata meta;
  RopeTableView rope;
  InnerRopePosition rope_rule = InnerRopePosition::window_start;
  View<float, 1> workspace;
  index_t tokens() const { return meta.shape.tokens(); }
  bool has_kv_out() const { return detail::view_given(kv_out.size(), kv_out.data()); }
  // RoPE position of compressed row c of request b.
  index_t rope_position(index_t b, index_t c) const {
    return rules::compressed_row_rope_position(rope_rule == InnerRopePosition::request_start, c,
                                               spec.ratio, meta.positions(b * meta.shape.seq));
  }
};

inline void validate(const CompressorArgs& a) {
  const std::string_view where = a.inner ? "indexer_compressor_step" : "compressor_step";
  const ModelConfig& cfg = *a.cfg;
  index_t cache_rows = 0;
  if (a.inner) {
    check_equal(where, "spec.head_dim", a.spec.head_dim, cfg.idx_head_dim);
    check_view(where, "idx_kv_cache", a.idx_kv);
    detail::check_matrix<std::int8_t>(where, "idx_kv_cache", a.idx_kv, -1, a.spec.head_dim);
    check_extents(where, "idx_kv_scale", a.idx_scale, {a.idx_kv.extent(0)});
    check_view(where, "hadamard", a.hadamard);
    detail::check_matrix<bf16>(where, "hadamard", a.hadamard, a.spec.head_dim, a.spec.head_dim);
    if (a.rope_rule != InnerRopePosition::window_start &&
        a.rope_rule != InnerRopePosition::request_start)
      throw_arg(where, "rope_rule", int(a.rope_rule), "window_start or request_start");
    cache_rows = a.idx_kv.extent(0);
  } else {
    check_equal(where, "spec.head_dim", a.spec.head_dim, cfg.head_dim);
    check_view(where, "cmp_kv", a.cmp_kv);
    detail::check_matrix<bf16>(where, "cmp_kv", a.cmp_kv, -1, a.spec.head_dim);
    if (a.rope_rule != InnerRopePosition::window_start)
      throw_arg(where, "rope_rule", int(a.rope_rule), "window_start (main compressors)");
    cache_rows = a.cmp_kv.extent(0);
  }
  detail::check_compressor_args(where, cfg, a.spec, a.state_pool, cache_rows, a.kv_out, a.x_n, a.w,
                                a.meta, a.rope, a.rope_rule, a.workspace);
}

// The tile program (both backends).
template <class B>
void compressor_program(const B& be, const CompressorArgs& a) {
  using Ops = ops_for<Compressor, B>;
  const index_t S = a.meta.shape.seq;
  Ops::project(be, a);  // proj[t] = [x_n[t]·wkvᵀ | x_n[t]·wgateᵀ + ape[pos % R]]
  // Requests in order, each scattering its state rows before it pools (fixture pools alias
  // across requests, spec §3.8; kernel and golden follow the same order).
  Ops::for_requests(be, a, [&](auto& lane, index_t b) {
    for (index_t s = 0; s < S; ++s) Ops::store_state(lane, a, b * S + s);  // state_slot ← proj
    Ops::state_barrier(lane);
    for (index_t s = 0; s < S; ++s) {
      const index_t t = b * S + s, slot = a.meta.cmp_slot_mapping(t);
      if (slot < 0) continue;  // no committed boundary
      const index_t c = a.meta.positions(t) / a.spec.ratio;
      Ops::pool(lane, a, b, c);                        // gated softmax over the window
      Ops::norm_rope(lane, a, a.rope_position(b, c));  // RMSNorm·norm_w, RoPE (last 64)
      Ops::check_rounding(lane, a, b, c);              // the rounding check (CPU, issue 17)
      Ops::emit(lane, a, b, t, slot);                  // cmp_kv row / index row (+ kv_out)
    }
  });
  Ops::finish(be, a);
}

template <class Be>
void run_compressor(const Be& be, const CompressorArgs& a) {
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<Compressor, decltype(b)>::check(b, a);
    b.kernel(Compressor::kernel_name(a.spec, a.inner), [&] { compressor_program(b, a); });
  });
}

// One main-compressor step (CSA ratio 4 overlapping or HCA ratio 128; spec §6.1–§6.3), on `be`.
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
// outside its range.
template <class Be>
void compressor_step(const Be& be, const ModelConfig& cfg, const CompressorSpec& spec,
                     View<float, 2> state_pool, View<bf16, 2> cmp_kv, View<float, 2> kv_out,
                     ConstView<bf16, 2> x_n, const CompressorWeights& w,
                     const CompressorMetadata& meta, const RopeTableView& rope,
                     View<float, 1> workspace) {
  CompressorArgs a;
  a.cfg = &cfg;
  a.spec = spec;
  a.state_pool = state_pool;
  a.cmp_kv = cmp_kv;
  a.kv_out = kv_out;
  a.x_n = x_n;
  a.w = w;
  a.meta = meta;
  a.rope = rope;
  a.workspace = workspace;
  run_compressor(be, a);
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
template <class Be>
void indexer_compressor_step(const Be& be, const ModelConfig& cfg, View<float, 2> state_pool,
                             View<std::int8_t, 2> idx_kv_cache, View<float, 1> idx_kv_scale,
                             View<float, 2> kv_out, ConstView<bf16, 2> x_n,
                             const CompressorWeights& w, ConstView<bf16, 2> hadamard,
                             const CompressorMetadata& meta, const RopeTableView& rope,
                             View<float, 1> workspace,
                             InnerRopePosition rope_rule = InnerRopePosition::window_start) {
  CompressorArgs a;
  a.cfg = &cfg;
  a.spec = indexer_compressor_spec(cfg);
  a.inner = true;
  a.state_pool = state_pool;
  a.idx_kv = idx_kv_cache;
  a.idx_scale = idx_kv_scale;
  a.kv_out = kv_out;
  a.x_n = x_n;
  a.w = w;
  a.hadamard = hadamard;
  a.meta = meta;
  a.rope = rope;
  a.rope_rule = rope_rule;
  a.workspace = workspace;
  run_compressor(be, a);
}

}  // namespace tiledecode::kernels
