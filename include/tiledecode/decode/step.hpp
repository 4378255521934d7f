#pragma once
// Decode-step kernels: one SWA / CSA / HCA attention layer end to end (spec §4, §9.2), from the
// hyper-connection stack x_hc [T, 4, D] FP32 to x_out [T, 4, D] FP32, on the engine's buffers,
// on either backend: the layer is ONE tile program (detail::layer_program) over the kernels'
// programs (kernels/*.hpp), run by the CPU op sets (backend/cpu/) or the a2a3 model's
// (backend/a2a3/).
//
//   auto be = decode::Backend::cpu(&pool);   // or decode::Backend::a2a3(&machine): chosen once
//   paged::StepMetadata md(max_batch, max_seq, cfg);          // once
//   decode::Workspace ws(cfg, max_batch, max_seq, be);        // once, sized for the backend
//   per step:  md.build(starts, {B, S, 1}, tables, pools, cfg);   // metadata built once
//              for each layer l: decode::layer_step(be, x_out, x_hc, W[l], C[l], md, rope(l), ws,
//              cfg);
//
// Inside one layer (layer_kernels(kind) lists them):
//   hc_pre → rmsnorm → qkv_projection (q, kv, qr, qr_scale) → write kv to kv_cache[ori_slot]
//   CSA: compressor (ratio 4 → cmp_kv) → indexer compressor (→ idx_kv_cache/scale)
//        → indexer query + weights → indexer score → indexer top-k (offset 0)
//   HCA: compressor (ratio 128 → cmp_kv)
//   sparse attention (window + compressed list, sink, inverse RoPE → o_packed)
//   → output projection (→ attn_out) → hc_post (→ x_out)
// The metadata bundle (spec §3.7) is read, never rebuilt: position_ids, kv_seq_lens, the slot
// mappings, the window lists and the tables all come from `md`. MTP: with md built for S tokens,
// commit_tokens = 1, the draft tokens' kv rows and state rows are written (and overwritten next
// step) and their compressed boundaries are not (their cmp/idx slots are -1 in md).
//
// All or nothing: the layer-level checks (backend kind, workspace backend, layer kind, metadata
// built and within the workspace, x_hc/x_out shapes and no aliasing, the weights and pools the
// family needs present and at least as large as md.pools()) and then EVERY kernel's validation
// and its backend's checks run before the first kernel writes anything.
// No heap allocation inside a step: all scratch comes from `ws` (sized once), the kernels take
// views. x_out must not alias x_hc (hc_post reads x_hc while writing x_out).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "tiledecode/backend/a2a3/cache_write.hpp"
#include "tiledecode/backend/a2a3/compressor.hpp"
#include "tiledecode/backend/a2a3/hyper_connection.hpp"
#include "tiledecode/backend/a2a3/indexer.hpp"
#include "tiledecode/backend/a2a3/output_projection.hpp"
#include "tiledecode/backend/a2a3/qkv_projection.hpp"
#include "tiledecode/backend/a2a3/rmsnorm.hpp"
#include "tiledecode/backend/a2a3/sparse_attention.hpp"
#include "tiledecode/backend/cpu/cache_write.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/backend.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/decode/workspace.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::decode {

// The primitives of a layer step, for per-kernel timing.
enum class Kernel : int {
  hc_pre,
  rmsnorm,
  qkv_projection,
  cache_write,
  compressor,
  indexer_compressor,
  indexer_query,
  indexer_score,
  indexer_topk,
  sparse_attention,
  output_projection,
  hc_post,
  count
};
inline constexpr int kNumKernels = static_cast<int>(Kernel::count);

constexpr std::string_view to_string(Kernel k) {
  constexpr std::string_view names[kNumKernels] = {
      "hc_pre",       "rmsnorm",        "qkv_proj_rope", "kv_cache_write",
      "compressor",   "idx_compressor", "indexer_query", "indexer_score",
      "indexer_topk", "sparse_attn",    "o_proj",        "hc_post"};
  return names[static_cast<int>(k)];
}

// The kernels of a family's layer step, in order (spec §9.2).
inline std::span<const Kernel> layer_kernels(LayerKind kind) {
  static constexpr Kernel swa[] = {Kernel::hc_pre,           Kernel::rmsnorm,
                                   Kernel::qkv_projection,   Kernel::cache_write,
                                   Kernel::sparse_attention, Kernel::output_projection,
                                   Kernel::hc_post};
  static constexpr Kernel hca[] = {
      Kernel::hc_pre,     Kernel::rmsnorm,          Kernel::qkv_projection,    Kernel::cache_write,
      Kernel::compressor, Kernel::sparse_attention, Kernel::output_projection, Kernel::hc_post};
  static constexpr Kernel csa[] = {
      Kernel::hc_pre,           Kernel::rmsnorm,           Kernel::qkv_projection,
      Kernel::cache_write,      Kernel::compressor,        Kernel::indexer_compressor,
      Kernel::indexer_query,    Kernel::indexer_score,     Kernel::indexer_topk,
      Kernel::sparse_attention, Kernel::output_projection, Kernel::hc_post};
  if (kind == LayerKind::csa) return csa;
  if (kind == LayerKind::hca) return hca;
  return swa;
}

// Accumulated wall time per primitive (seconds) and call counts; fixed arrays, no allocation.
struct KernelTimes {
  double seconds[kNumKernels] = {};
  long calls[kNumKernels] = {};
  void clear() { *this = KernelTimes{}; }
  double total() const {
    double s = 0;
    for (double v : seconds) s += v;
    return s;
  }
  KernelTimes& operator+=(const KernelTimes& o) {
    for (int i = 0; i < kNumKernels; ++i) seconds[i] += o.seconds[i], calls[i] += o.calls[i];
    return *this;
  }
};

// A planned layer step: every kernel's arguments, built from the caller's views and the workspace
// and validated (decode::plan_layer_step). Views only: it is valid while the caller's buffers and
// the workspace are. Tests and profilers run single kernels of it (decode::run_layer_kernel).
// Not copyable: the indexer query's arguments may point at the plan's own idx_wq.
struct LayerPlan {
  LayerPlan() = default;
  LayerPlan(const LayerPlan&) = delete;
  LayerPlan& operator=(const LayerPlan&) = delete;

  LayerKind kind = LayerKind::swa;
  bool reference_rope = false;
  kernels::HcPreArgs hc_pre;
  kernels::RmsNormArgs rmsnorm;
  kernels::QkvArgs qkv;
  kernels::CacheWriteArgs<bf16> cache;
  kernels::CompressorArgs compressor;
  kernels::CompressorArgs inner;
  kernels::IndexerQueryWeights idx_wq;  // views (the a2a3 model reads them) when not packed
  kernels::IndexerQueryArgs idx_query;
  kernels::IndexerWeightsArgs idx_weights;
  kernels::IndexerScoreArgs idx_score;
  kernels::IndexerTopkArgs idx_topk;
  kernels::SparseAttentionArgs attention;
  kernels::OutputProjectionArgs o_proj;
  kernels::HcPostArgs hc_post;
  StepViews v;
  ConstView<std::int32_t, 1> positions;
  int seq = 1;
};

// ---- the entry points (defined below) ---------------------------------------------------------
// Header-only by default: every entry point is an inline function of this header, and each
// translation unit that calls one compiles the whole stack (every kernel on every CPU tier and on
// the a2a3 model: ~1 min of g++ -O3 per TU on one Zen 3 core). A program that calls them from many
// TUs can compile the stack once instead: define TILEDECODE_SEPARATE_STEP in every TU of the
// program (target-wide) and TILEDECODE_STEP_IMPLEMENTATION as well in exactly one, which then holds
// the only (non-inline) definitions; the others see these declarations and nothing of the bodies.
// Same code either way (this repository's tests, benchmarks and examples build that way:
// src/step_instance.cpp). Everything else in the library stays inline.
#if defined(TILEDECODE_SEPARATE_STEP) || defined(TILEDECODE_STEP_IMPLEMENTATION)
#define TILEDECODE_STEP_LINKAGE
#else
#define TILEDECODE_STEP_LINKAGE inline
#endif

// One layer step (all or nothing: see the definition).
TILEDECODE_STEP_LINKAGE void layer_step(const Backend& be, View<float, 3> x_out,
                                        ConstView<float, 3> x_hc, const LayerWeights& w,
                                        const LayerCaches& c, const paged::StepMetadata& md,
                                        const RopeTableView& rope, Workspace& ws,
                                        const ModelConfig& cfg, const LayerOptions& opt = {},
                                        KernelTimes* times = nullptr);
// What layer_step checks before its first write, without running anything.
TILEDECODE_STEP_LINKAGE void validate_layer_step(
    const Backend& be, View<float, 3> x_out, ConstView<float, 3> x_hc, const LayerWeights& w,
    const LayerCaches& c, const paged::StepMetadata& md, const RopeTableView& rope, Workspace& ws,
    const ModelConfig& cfg, const LayerOptions& opt = {});
// The validated plan of one layer step, for running it one kernel at a time.
TILEDECODE_STEP_LINKAGE void plan_layer_step(LayerPlan& p, const Backend& be, View<float, 3> x_out,
                                             ConstView<float, 3> x_hc, const LayerWeights& w,
                                             const LayerCaches& c, const paged::StepMetadata& md,
                                             const RopeTableView& rope, Workspace& ws,
                                             const ModelConfig& cfg, const LayerOptions& opt = {});
// Kernel k of such a plan.
TILEDECODE_STEP_LINKAGE void run_layer_kernel(const Backend& be, const LayerPlan& p, Kernel k,
                                              KernelTimes* times = nullptr);

namespace detail {
class KernelTimer {
 public:
  KernelTimer(KernelTimes* t, Kernel k) : t_(t), k_(static_cast<int>(k)) {
    if (t_) t0_ = std::chrono::steady_clock::now();
  }
  ~KernelTimer() {
    if (!t_) return;
    t_->seconds[k_] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    ++t_->calls[k_];
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

 private:
  KernelTimes* t_;
  int k_;
  std::chrono::steady_clock::time_point t0_{};
};

template <class V>
inline void require(std::string_view where, std::string_view arg, const V& v, LayerKind kind) {
  check_view(where, arg, v);
  if (v.data() == nullptr || v.size() == 0) {
    throw_arg(where, arg, "an empty view",
              std::string("a view (required by ") + std::string(to_string(kind)) + " layers)");
  }
}

// The layer-level checks (backend, metadata, layer kind, x shapes, presence and sizes of the pools
// and weights the family needs), then the plan of every kernel's arguments.
inline void plan_layer(LayerPlan& p, std::string_view where, const Backend& be,
                       View<float, 3> x_out, ConstView<float, 3> x_hc, const LayerWeights& w,
                       const LayerCaches& c, const paged::StepMetadata& md,
                       const RopeTableView& rope, Workspace& ws, const ModelConfig& cfg,
                       const LayerOptions& opt) {
  if (be.kind != BackendKind::cpu && be.kind != BackendKind::a2a3)
    throw_arg(where, "be.kind", int(be.kind), "cpu (0) or a2a3 (1)");
  if (ws.backend() != be.kind)
    throw_arg(where, "ws", std::string(to_string(ws.backend())) + " workspace",
              "a workspace sized for the " + std::string(to_string(be.kind)) + " backend");
  const LayerKind k = w.kind;
  if (k != LayerKind::swa && k != LayerKind::csa && k != LayerKind::hca)
    throw_arg(where, "weights.kind", int(k), "swa (0), csa (4) or hca (128)");
  if (opt.indexer_rope != IndexerRope::absolute && opt.indexer_rope != IndexerRope::reference)
    throw_arg(where, "opt.indexer_rope", int(opt.indexer_rope), "absolute or reference");
  if (!md.built()) throw Error(std::string(where) + ": argument 'md' is not built (call build())");
  const auto& sh = md.shape();
  check_range(where, "md.shape().batch", sh.batch, 1, ws.max_batch() + 1);
  check_range(where, "md.shape().seq", sh.seq, 1, ws.max_seq() + 1);
  const index_t T = sh.tokens(), D = cfg.hidden;
  check_rows(where, "x_hc", x_hc, {T, kHcStreams, D});
  check_rows(where, "x_out", x_out, {T, kHcStreams, D});
  if (static_cast<const void*>(x_out.data()) == static_cast<const void*>(x_hc.data())) {
    throw_arg(where, "x_out", "x_hc's buffer", "a buffer distinct from x_hc");
  }
  // Every pool at least as large as the pool the metadata was validated against (in the rows of
  // md's layout: paged::StepMetadata::pool_rows), so every slot md built is inside the pool.
  using paged::Table;
  const Table cmp_table = k == LayerKind::hca ? Table::hca_cmp : Table::csa_cmp;
  require(where, "caches.kv_cache", c.kv_cache, k);
  check_at_least<index_t>(where, "caches.kv_cache.extent(0)", c.kv_cache.extent(0),
                          md.pool_rows(Table::ori));
  require(where, "weights.attn_sink", w.attn_sink, k);
  if (k != LayerKind::swa) {
    require(where, "caches.cmp_kv", c.cmp_kv, k);
    require(where, "caches.state", c.state, k);
    require(where, "weights.compressor.wkv", w.compressor.wkv, k);
    check_at_least<index_t>(where, "caches.cmp_kv.extent(0)", c.cmp_kv.extent(0),
                            md.pool_rows(cmp_table));
    if (k == LayerKind::hca)
      check_at_least<index_t>(where, "caches.state.extent(0)", c.state.extent(0),
                              md.pool_rows(Table::hca_state));
  }
  if (k == LayerKind::csa) {
    check_at_least<index_t>(where, "caches.state.extent(0)", c.state.extent(0),
                            md.pool_rows(Table::csa_state));
    require(where, "caches.inner_state", c.inner_state, k);
    require(where, "caches.idx_kv_cache", c.idx_kv_cache, k);
    require(where, "caches.idx_kv_scale", c.idx_kv_scale, k);
    require(where, "weights.indexer.compressor.wkv", w.indexer.compressor.wkv, k);
    check_at_least<index_t>(where, "caches.inner_state.extent(0)", c.inner_state.extent(0),
                            md.pool_rows(Table::csa_inner_state));
    check_at_least<index_t>(where, "caches.idx_kv_cache.extent(0)", c.idx_kv_cache.extent(0),
                            md.pool_rows(Table::idx));
    if (be.kind == BackendKind::cpu && w.indexer.packed_query == nullptr) {
      throw_arg(where, "weights.indexer.packed_query", "nullptr",
                "packed indexer query weights (kernels::pack_indexer_query_weights)");
    }
  }

  p.kind = k;
  p.reference_rope = opt.indexer_rope == IndexerRope::reference;
  p.v = ws.views(sh.batch, sh.seq);
  p.seq = sh.seq;
  p.positions = md.position_ids();
  StepViews& v = p.v;
  const auto pos = md.position_ids();
  p.hc_pre = {&cfg, v.x_mixed, v.post, v.comb, x_hc, w.hc, v.hc_ws};
  p.rmsnorm = {v.x_n, v.x_mixed, w.attn_norm, cfg.rms_eps};
  p.qkv = {&cfg, v.q, v.kv, v.qr, v.qr_scale, v.x_n, w.qkv, rope, pos, v.qkv_scratch};
  // SWA layers call it swa_slot_mapping; it is the same tensor (spec §3.3).
  p.cache = {c.kv_cache, v.kv, md.ori_slot_mapping()};
  if (k != LayerKind::swa) {
    const bool csa = k == LayerKind::csa;
    kernels::CompressorArgs& a = p.compressor;
    a.cfg = &cfg;
    a.spec = csa ? kernels::csa_compressor_spec(cfg) : kernels::hca_compressor_spec(cfg);
    a.state_pool = c.state;
    a.cmp_kv = c.cmp_kv;
    a.kv_out = v.cmp_kv_out;
    a.x_n = v.x_n;
    a.w = w.compressor;
    a.meta = {sh, pos, csa ? md.csa_state_slot_mapping() : md.hca_state_slot_mapping(),
              csa ? md.csa_cmp_slot_mapping() : md.hca_cmp_slot_mapping(),
              csa ? md.tables().csa_state_table : md.tables().hca_state_table};
    a.rope = rope;
    a.workspace = v.compressor_ws;
  }
  if (k == LayerKind::csa) {
    kernels::CompressorArgs& a = p.inner;
    a.cfg = &cfg;
    a.spec = kernels::indexer_compressor_spec(cfg);
    a.inner = true;
    a.state_pool = c.inner_state;
    a.idx_kv = c.idx_kv_cache;
    a.idx_scale = c.idx_kv_scale;
    a.kv_out = v.idx_kv_out;
    a.x_n = v.x_n;
    a.w = w.indexer.compressor;
    a.hadamard = w.indexer.hadamard;
    a.meta = {sh, pos, md.csa_inner_state_slot_mapping(), md.csa_idx_slot_mapping(),
              md.tables().csa_inner_state_table};
    a.rope = rope;
    a.rope_rule = p.reference_rope ? kernels::InnerRopePosition::request_start
                                   : kernels::InnerRopePosition::window_start;
    a.workspace = v.compressor_ws;
    p.idx_wq = kernels::IndexerQueryWeights::views(cfg, w.indexer.wq_b, w.indexer.wq_b_scale,
                                                   w.indexer.hadamard);
    const kernels::IndexerQueryWeights* wq =
        w.indexer.packed_query != nullptr && be.kind == BackendKind::cpu ? w.indexer.packed_query
                                                                         : &p.idx_wq;
    p.idx_query = {&cfg, v.idx_q_i8, v.idx_q_scale, v.qr, v.qr_scale, wq, v.idx_rope_pos, rope};
    p.idx_query.check_rope_pos = false;  // filled when the kernel runs; checked in validate_plan
    p.idx_weights = {&cfg, v.idx_weights, v.x_n, w.indexer.weights_proj};
    p.idx_score = {&cfg,          v.score,          v.idx_q_i8,     v.idx_q_scale,
                   v.idx_weights, c.idx_kv_cache,   c.idx_kv_scale, md.idx_block_table(),
                   pos,           md.kv_seq_lens(), sh.seq,         md.rows_per_page(Table::idx)};
    // q_sc is produced inside the step (a Q8 scale: > 0 by construction; a non-finite one from a
    // non-finite upstream value propagates into the scores, which top-k handles), so its values
    // are not a precondition here.
    p.idx_score.check_q_scales = false;
    p.idx_topk = {&cfg, v.topk_idxs, v.score, pos, md.kv_seq_lens(), sh.seq, cfg.idx_topk, 0};
  }
  p.attention = kernels::sparse_attention_args(
      cfg, k, v.o_packed, v.q, c.kv_cache, c.cmp_kv, md.window_indices(), md.window_lens(),
      k == LayerKind::csa ? ConstView<std::int32_t, 2>(v.topk_idxs) : ConstView<std::int32_t, 2>(),
      k == LayerKind::swa ? ConstView<std::int32_t, 2>() : md.table(cmp_table), pos,
      md.kv_seq_lens(), sh.seq, w.attn_sink, rope,
      k == LayerKind::swa ? 0 : md.rows_per_page(cmp_table));
  p.o_proj = {&cfg, v.attn_out, v.o_packed, w.wo_a, w.wo_b, w.wo_b_scale, w.wo_a_norm};
  p.hc_post = {&cfg, x_out, v.attn_out, x_hc, v.post, v.comb};
}

// Every kernel's validation, with the backend's own checks (shapes it supports, workspace sizes).
template <class B>
void validate_plan(const B& b, const LayerPlan& p) {
  kernels::validate(p.hc_pre);
  ops_for<kernels::HcPre, B>::check(b, p.hc_pre);
  kernels::validate(p.rmsnorm);
  kernels::validate(p.qkv);
  ops_for<kernels::QkvProjection, B>::check(b, p.qkv);
  kernels::validate(p.cache);
  if (p.kind != LayerKind::swa) {
    kernels::validate(p.compressor);
    ops_for<kernels::Compressor, B>::check(b, p.compressor);
  }
  if (p.kind == LayerKind::csa) {
    kernels::validate(p.inner);
    ops_for<kernels::Compressor, B>::check(b, p.inner);
    kernels::validate(p.idx_query);
    // The positions the indexer query will rotate at (written into idx_rope_pos when it runs).
    for (index_t t = 0; t < p.v.T; ++t) {
      const std::int32_t r =
          rules::indexer_query_rope_position(p.positions, t, p.seq, p.reference_rope);
      if (r < 0 || r >= p.idx_query.rope.length())
        check_range<index_t>("indexer_query", nth_name("rope_pos", t), r, 0,
                             p.idx_query.rope.length());
    }
    ops_for<kernels::IndexerQuery, B>::check(b, p.idx_query);
    kernels::validate(p.idx_weights);
    kernels::validate(p.idx_score);
    ops_for<kernels::IndexerScore, B>::check(b, p.idx_score);
    kernels::validate(p.idx_topk);
    ops_for<kernels::IndexerTopk, B>::check(b, p.idx_topk);
  }
  kernels::validate(p.attention);
  ops_for<kernels::SparseAttention, B>::check(b, p.attention, p.v.attn_ws);
  kernels::validate(p.o_proj);
  ops_for<kernels::OutputProjection, B>::check(b, p.o_proj, p.v.oproj_ws);
  kernels::validate(p.hc_post);
}

// One kernel of the layer: the CPU is timed on the wall clock, the a2a3 model reports its
// predicted latency (both into KernelTimes).
template <class B, class F>
void run_kernel(const B& b, Kernel k, KernelTimes* times, F&& body) {
  if constexpr (std::is_same_v<B, a2a3::A2a3>) {
    const double us = b.kernel(to_string(k), body);
    if (times) {
      times->seconds[int(k)] += us * 1e-6;
      ++times->calls[int(k)];
    }
  } else {
    KernelTimer tm(times, k);
    body();
  }
}

// One kernel of a planned layer as its tile program (the host-side zeroing of the compressors'
// FP32 emitted rows and the indexer query's RoPE positions belong to their kernels).
template <class B>
void kernel_program(const B& b, const LayerPlan& p, Kernel k) {
  const StepViews& v = p.v;
  switch (k) {
    case Kernel::hc_pre:
      return kernels::hc_pre_program(b, p.hc_pre);
    case Kernel::rmsnorm:
      return kernels::rmsnorm_program(b, p.rmsnorm);
    case Kernel::qkv_projection:
      return kernels::qkv_projection_program(b, p.qkv);
    case Kernel::cache_write:
      return kernels::cache_write_program(b, p.cache);
    case Kernel::compressor:
      std::fill_n(v.cmp_kv_out.data(), v.cmp_kv_out.size(), 0.0f);
      return kernels::compressor_program(b, p.compressor);
    case Kernel::indexer_compressor:
      std::fill_n(v.idx_kv_out.data(), v.idx_kv_out.size(), 0.0f);
      return kernels::compressor_program(b, p.inner);
    case Kernel::indexer_query:
      for (index_t t = 0; t < v.T; ++t)
        v.idx_rope_pos(t) =
            rules::indexer_query_rope_position(p.positions, t, p.seq, p.reference_rope);
      kernels::indexer_query_program(b, p.idx_query);
      return kernels::indexer_weights_program(b, p.idx_weights);
    case Kernel::indexer_score:
      return kernels::indexer_score_program(b, p.idx_score);
    case Kernel::indexer_topk:
      return kernels::indexer_topk_program(b, p.idx_topk);
    case Kernel::sparse_attention:
      return kernels::sparse_attention_program(b, p.attention, v.attn_ws);
    case Kernel::output_projection:
      return kernels::output_projection_program(b, p.o_proj, v.oproj_ws);
    case Kernel::hc_post:
      return kernels::hc_post_program(b, p.hc_post);
    case Kernel::count:
      break;
  }
}

// The layer as a tile program (spec §4, §9.2): every kernel of the family in order.
template <class B>
void layer_program(const B& b, const LayerPlan& p, KernelTimes* times) {
  for (const Kernel k : layer_kernels(p.kind))
    run_kernel(b, k, times, [&] { kernel_program(b, p, k); });
}

}  // namespace detail

#if !defined(TILEDECODE_SEPARATE_STEP) || defined(TILEDECODE_STEP_IMPLEMENTATION)
// One attention layer of the decode step (family = w.kind) on backend `be` (CPU or the a2a3 model).
//   x_out  (T, 4, D) FP32, written;   x_hc (T, 4, D) FP32, the layer's input stack
//   w      the layer's weights; c: its pools (updated: kv_cache, and per family cmp_kv, state,
//          idx_kv_cache/idx_kv_scale, inner_state)
//   md     this step's metadata bundle (built once per step, shared by all layers)
//   rope   the layer's RoPE table (SWA: rope_theta; CSA/HCA: compress_rope_theta with YaRN)
//   ws     the workspace, sized for `be` (holds this layer's intermediates afterwards)
//   opt    indexer RoPE positions (see LayerOptions); times: optional per-kernel time (CPU: wall
//          clock; a2a3: the model's predicted latency)
// All or nothing: every argument of every kernel of the step is validated before the first
// write; on bad input tiledecode::Error names the argument and no output, pool, state or cache
// has changed.
TILEDECODE_STEP_LINKAGE void layer_step(const Backend& be, View<float, 3> x_out,
                                        ConstView<float, 3> x_hc, const LayerWeights& w,
                                        const LayerCaches& c, const paged::StepMetadata& md,
                                        const RopeTableView& rope, Workspace& ws,
                                        const ModelConfig& cfg, const LayerOptions& opt,
                                        KernelTimes* times) {
  LayerPlan p;
  detail::plan_layer(p, "decode::layer_step", be, x_out, x_hc, w, c, md, rope, ws, cfg, opt);
  dispatch(be, [&](const auto& b) {
    detail::validate_plan(b, p);
    detail::layer_program(b, p, times);
  });
}

// Validates one layer step without running it (what layer_step checks before its first write).
TILEDECODE_STEP_LINKAGE void validate_layer_step(const Backend& be, View<float, 3> x_out,
                                                 ConstView<float, 3> x_hc, const LayerWeights& w,
                                                 const LayerCaches& c,
                                                 const paged::StepMetadata& md,
                                                 const RopeTableView& rope, Workspace& ws,
                                                 const ModelConfig& cfg, const LayerOptions& opt) {
  LayerPlan p;
  detail::plan_layer(p, "decode::layer_step", be, x_out, x_hc, w, c, md, rope, ws, cfg, opt);
  dispatch(be, [&](const auto& b) { detail::validate_plan(b, p); });
}

// Fills `p` with the validated plan of one layer step (everything layer_step checks) without
// running it; with run_layer_kernel the layer then runs one kernel at a time (tests feed each
// kernel the golden inputs through p.v; profilers time one kernel). Same arguments as layer_step.
TILEDECODE_STEP_LINKAGE void plan_layer_step(LayerPlan& p, const Backend& be, View<float, 3> x_out,
                                             ConstView<float, 3> x_hc, const LayerWeights& w,
                                             const LayerCaches& c, const paged::StepMetadata& md,
                                             const RopeTableView& rope, Workspace& ws,
                                             const ModelConfig& cfg, const LayerOptions& opt) {
  detail::plan_layer(p, "decode::plan_layer_step", be, x_out, x_hc, w, c, md, rope, ws, cfg, opt);
  dispatch(be, [&](const auto& b) { detail::validate_plan(b, p); });
}

// Runs kernel `k` of a plan made by plan_layer_step with the same backend (its inputs are whatever
// p.v and the pools hold). Throws, before running anything, if the family has no such kernel.
TILEDECODE_STEP_LINKAGE void run_layer_kernel(const Backend& be, const LayerPlan& p, Kernel k,
                                              KernelTimes* times) {
  const auto ks = layer_kernels(p.kind);
  if (std::find(ks.begin(), ks.end(), k) == ks.end())
    throw_arg("decode::run_layer_kernel", "k", std::string(to_string(k)),
              "a kernel of " + std::string(to_string(p.kind)) + " layers");
  dispatch(be, [&](const auto& b) {
    detail::run_kernel(b, k, times, [&] { detail::kernel_program(b, p, k); });
  });
}
#endif  // the definitions
#undef TILEDECODE_STEP_LINKAGE

namespace detail {
inline void check_kind(std::string_view where, LayerKind got, LayerKind want) {
  if (got != want) {
    throw_arg(where, "weights.kind", std::string(to_string(got)), std::string(to_string(want)));
  }
}
}  // namespace detail

// The three families by name (same arguments as layer_step; the weights' kind must match).
inline void swa_step(const Backend& be, View<float, 3> x_out, ConstView<float, 3> x_hc,
                     const LayerWeights& w, const LayerCaches& c, const paged::StepMetadata& md,
                     const RopeTableView& rope, Workspace& ws, const ModelConfig& cfg,
                     KernelTimes* times = nullptr) {
  detail::check_kind("decode::swa_step", w.kind, LayerKind::swa);
  layer_step(be, x_out, x_hc, w, c, md, rope, ws, cfg, {}, times);
}
inline void csa_step(const Backend& be, View<float, 3> x_out, ConstView<float, 3> x_hc,
                     const LayerWeights& w, const LayerCaches& c, const paged::StepMetadata& md,
                     const RopeTableView& rope, Workspace& ws, const ModelConfig& cfg,
                     const LayerOptions& opt = {}, KernelTimes* times = nullptr) {
  detail::check_kind("decode::csa_step", w.kind, LayerKind::csa);
  layer_step(be, x_out, x_hc, w, c, md, rope, ws, cfg, opt, times);
}
inline void hca_step(const Backend& be, View<float, 3> x_out, ConstView<float, 3> x_hc,
                     const LayerWeights& w, const LayerCaches& c, const paged::StepMetadata& md,
                     const RopeTableView& rope, Workspace& ws, const ModelConfig& cfg,
                     KernelTimes* times = nullptr) {
  detail::check_kind("decode::hca_step", w.kind, LayerKind::hca);
  layer_step(be, x_out, x_hc, w, c, md, rope, ws, cfg, {}, times);
}

}  // namespace tiledecode::decode
