#pragma once
// Decode-step kernels: one SWA / CSA / HCA attention layer end to end (spec §4, §9.2), from the
// hyper-connection stack x_hc [T, 4, D] FP32 to x_out [T, 4, D] FP32, on the engine's buffers.
//
//   paged::StepMetadata md(max_batch, 2, cfg);      // once
//   decode::Workspace ws(cfg, max_batch, 2, be.concurrency());   // once
//   per step:  auto be = decode::Backend::cpu(&pool);             // backend chosen once
//              md.build(starts, {B, 2, 1}, tables, pools, cfg);   // metadata built once
//              for each layer l: decode::layer_step(be, x_out, x_hc, W[l], C[l], md, rope(l), ws,
//              cfg);
//
// Inside one layer (every primitive validates its own arguments before its first write):
//   hc_pre → rmsnorm → qkv_projection (q, kv, qr, qr_scale) → write kv to kv_cache[ori_slot]
//   CSA: compressor_step (ratio 4 → cmp_kv) → indexer_compressor_step (→ idx_kv_cache/scale)
//        → indexer_query → indexer_weights → indexer_score → indexer_topk (offset 0)
//   HCA: compressor_step (ratio 128 → cmp_kv)
//   sparse_attention (window + compressed list, sink, inverse RoPE → o_packed)
//   → output_projection (→ attn_out) → hc_post (→ x_out)
// The metadata bundle (spec §3.7) is read, never rebuilt: position_ids, kv_seq_lens, the slot
// mappings, the window lists and the tables all come from `md`. MTP: with md built for S = 2,
// commit_tokens = 1, the draft token's kv row and state rows are written (and overwritten next
// step) and its compressed boundary is not (its cmp/idx slot is -1 in md).
//
// No heap allocation inside a step: all scratch comes from `ws` (sized once), and the kernels
// take views. x_out must not alias x_hc (hc_post reads x_hc while writing x_out).
// Validation done here, before the first write: backend kind, layer kind, metadata built and
// within the workspace, x_hc/x_out shapes, the weights and pools the family needs present and
// the pools at least as large as md.pools() (so every slot md validated is inside the pool).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string_view>

#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/backend.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/decode/workspace.hpp"
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/kernels/hyper_connection.hpp"
#include "tiledecode/kernels/indexer.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"
#include "tiledecode/kernels/rmsnorm.hpp"
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
  if (v.data() == nullptr || v.size() == 0) {
    throw_arg(where, arg, "an empty view",
              std::string("a view (required by ") + std::string(to_string(kind)) + " layers)");
  }
}

inline void validate_layer(std::string_view where, const Backend& be, View<float, 3> x_out,
                           ConstView<float, 3> x_hc, const LayerWeights& w, const LayerCaches& c,
                           const paged::StepMetadata& md, Workspace& ws, const ModelConfig& cfg) {
  if (be.kind != BackendKind::cpu) {
    throw_arg(where, "backend", std::string(to_string(be.kind)),
              "cpu (a2a3 is a latency-prediction model: hc_pre, rms_norm, the cache write and "
              "hc_post are timing-only there, so it cannot produce x_out; see decode_step "
              "--backend a2a3)");
  }
  if (!md.built()) throw Error(std::string(where) + ": argument 'md' is not built (call build())");
  const auto& sh = md.shape();
  check_range(where, "md.shape().batch", sh.batch, 1, ws.max_batch() + 1);
  check_range(where, "md.shape().seq", sh.seq, 1, ws.max_seq() + 1);
  const index_t T = sh.tokens(), D = cfg.hidden;
  check_equal<index_t>(where, "x_hc.extent(0)", x_hc.extent(0), T);
  check_equal<index_t>(where, "x_hc.extent(1)", x_hc.extent(1), kHcStreams);
  check_equal<index_t>(where, "x_hc.extent(2)", x_hc.extent(2), D);
  check_equal<index_t>(where, "x_out.extent(0)", x_out.extent(0), T);
  check_equal<index_t>(where, "x_out.extent(1)", x_out.extent(1), kHcStreams);
  check_equal<index_t>(where, "x_out.extent(2)", x_out.extent(2), D);
  if (static_cast<const void*>(x_out.data()) == static_cast<const void*>(x_hc.data())) {
    throw_arg(where, "x_out", "x_hc's buffer", "a buffer distinct from x_hc");
  }
  const auto& pools = md.pools();
  const LayerKind k = w.kind;
  require(where, "caches.kv_cache", c.kv_cache, k);
  check_at_least<index_t>(where, "caches.kv_cache.extent(0)", c.kv_cache.extent(0),
                          pools.ori * cfg.page);
  require(where, "weights.attn_sink", w.attn_sink, k);
  if (k == LayerKind::swa) return;
  require(where, "caches.cmp_kv", c.cmp_kv, k);
  require(where, "caches.state", c.state, k);
  require(where, "weights.compressor.wkv", w.compressor.wkv, k);
  check_at_least<index_t>(where, "caches.cmp_kv.extent(0)", c.cmp_kv.extent(0),
                          pools.cmp * cfg.page);
  if (k == LayerKind::hca) {
    check_at_least<index_t>(where, "caches.state.extent(0)", c.state.extent(0),
                            pools.hca_state * cfg.c128_state_page);
    return;
  }
  check_at_least<index_t>(where, "caches.state.extent(0)", c.state.extent(0),
                          pools.csa_state * cfg.c4_state_page);
  require(where, "caches.inner_state", c.inner_state, k);
  require(where, "caches.idx_kv_cache", c.idx_kv_cache, k);
  require(where, "weights.indexer.compressor.wkv", w.indexer.compressor.wkv, k);
  check_at_least<index_t>(where, "caches.inner_state.extent(0)", c.inner_state.extent(0),
                          pools.csa_inner_state * cfg.c4_state_page);
  check_at_least<index_t>(where, "caches.idx_kv_cache.extent(0)", c.idx_kv_cache.extent(0),
                          pools.idx * cfg.page);
  if (w.indexer.packed_query == nullptr) {
    throw_arg(where, "weights.indexer.packed_query", "nullptr",
              "packed indexer query weights (kernels::pack_indexer_query_weights)");
  }
}
}  // namespace detail

// One attention layer of the decode step (family = w.kind), CPU backend.
//   x_out  (T, 4, D) FP32, written;   x_hc (T, 4, D) FP32, the layer's input stack
//   w      the layer's weights; c: its pools (updated: kv_cache, and per family cmp_kv, state,
//          idx_kv_cache/idx_kv_scale, inner_state)
//   md     this step's metadata bundle (built once per step, shared by all layers)
//   rope   the layer's RoPE table (SWA: rope_theta; CSA/HCA: compress_rope_theta with YaRN)
//   ws     the workspace (holds this layer's intermediates afterwards)
//   opt    indexer RoPE positions (see LayerOptions); times: optional per-kernel timing
inline void layer_step(const Backend& be, View<float, 3> x_out, ConstView<float, 3> x_hc,
                       const LayerWeights& w, const LayerCaches& c, const paged::StepMetadata& md,
                       const RopeTableView& rope, Workspace& ws, const ModelConfig& cfg,
                       const LayerOptions& opt = {}, KernelTimes* times = nullptr) {
  constexpr std::string_view where = "decode::layer_step";
  detail::validate_layer(where, be, x_out, x_hc, w, c, md, ws, cfg);
  const cpu::Context& ctx = be.cpu_ctx;
  const auto& sh = md.shape();
  const int S = sh.seq;
  const LayerKind kind = w.kind;
  StepViews v = ws.views(sh.batch, S);
  const auto pos = md.position_ids();
  using detail::KernelTimer;

  {
    KernelTimer tm(times, Kernel::hc_pre);
    kernels::hc_pre(ctx, v.x_mixed, v.post, v.comb, x_hc, w.hc, v.hc_mixes, cfg);
  }
  {
    KernelTimer tm(times, Kernel::rmsnorm);
    kernels::rmsnorm(ctx, v.x_n, v.x_mixed, w.attn_norm, cfg.rms_eps);
  }
  {
    KernelTimer tm(times, Kernel::qkv_projection);
    kernels::qkv_projection(ctx, v.q, v.kv, v.qr, v.qr_scale, v.x_n, w.qkv, rope, pos,
                            v.qkv_scratch, cfg);
  }
  {
    // SWA layers call it swa_slot_mapping; it is the same tensor (spec §3.3).
    KernelTimer tm(times, Kernel::cache_write);
    paged::write_cache<bf16>(c.kv_cache, v.kv, md.ori_slot_mapping());
  }
  ConstView<std::int32_t, 2> topk{};
  if (kind != LayerKind::swa) {
    KernelTimer tm(times, Kernel::compressor);
    const bool csa = kind == LayerKind::csa;
    const auto spec = csa ? kernels::csa_compressor_spec(cfg) : kernels::hca_compressor_spec(cfg);
    const kernels::CompressorMetadata meta{
        sh, pos, csa ? md.csa_state_slot_mapping() : md.hca_state_slot_mapping(),
        csa ? md.csa_cmp_slot_mapping() : md.hca_cmp_slot_mapping(),
        csa ? md.tables().csa_state_table : md.tables().hca_state_table};
    std::fill_n(v.cmp_kv_out.data(), v.cmp_kv_out.size(), 0.0f);
    kernels::compressor_step(ctx, cfg, spec, c.state, c.cmp_kv, v.cmp_kv_out, v.x_n, w.compressor,
                             meta, rope, v.compressor_ws);
  }
  if (kind == LayerKind::csa) {
    const bool ref = opt.indexer_rope == IndexerRope::reference;
    {
      KernelTimer tm(times, Kernel::indexer_compressor);
      const kernels::CompressorMetadata meta{sh, pos, md.csa_inner_state_slot_mapping(),
                                             md.csa_idx_slot_mapping(),
                                             md.tables().csa_inner_state_table};
      std::fill_n(v.idx_kv_out.data(), v.idx_kv_out.size(), 0.0f);
      kernels::indexer_compressor_step(ctx, cfg, c.inner_state, c.idx_kv_cache, c.idx_kv_scale,
                                       v.idx_kv_out, v.x_n, w.indexer.compressor,
                                       w.indexer.hadamard, meta, rope, v.compressor_ws,
                                       ref ? kernels::InnerRopePosition::request_start
                                           : kernels::InnerRopePosition::window_start);
    }
    {
      KernelTimer tm(times, Kernel::indexer_query);
      if (ref) {
        kernels::indexer_rope_positions(v.idx_rope_pos, pos, S);
      } else {
        for (index_t t = 0; t < v.T; ++t) v.idx_rope_pos(t) = pos(t);
      }
      kernels::indexer_query(ctx, cfg, v.idx_q_i8, v.idx_q_scale, v.qr, v.qr_scale,
                             *w.indexer.packed_query, v.idx_rope_pos, rope);
      kernels::indexer_weights(ctx, cfg, v.idx_weights, v.x_n, w.indexer.weights_proj);
    }
    {
      KernelTimer tm(times, Kernel::indexer_score);
      kernels::indexer_score(ctx, cfg, v.score, v.idx_q_i8, v.idx_q_scale, v.idx_weights,
                             c.idx_kv_cache, c.idx_kv_scale, md.tables().idx_block_table, pos,
                             md.kv_seq_lens(), S);
    }
    {
      KernelTimer tm(times, Kernel::indexer_topk);
      kernels::indexer_topk(ctx, cfg, v.topk_idxs, v.score, pos, md.kv_seq_lens(), S, cfg.idx_topk,
                            0);
    }
    topk = v.topk_idxs;
  }
  {
    KernelTimer tm(times, Kernel::sparse_attention);
    kernels::sparse_attention(ctx, cfg, kind, v.o_packed, v.q, c.kv_cache, c.cmp_kv,
                              md.window_indices(), md.window_lens(), topk,
                              md.tables().cmp_block_table, pos, md.kv_seq_lens(), S, w.attn_sink,
                              rope, v.attn_ws);
  }
  {
    KernelTimer tm(times, Kernel::output_projection);
    kernels::output_projection(ctx, cfg, v.attn_out, v.o_packed, w.wo_a, w.wo_b, w.wo_b_scale,
                               v.oproj_ws);
  }
  {
    KernelTimer tm(times, Kernel::hc_post);
    kernels::hc_post(ctx, x_out, v.attn_out, x_hc, v.post, v.comb, cfg);
  }
}

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
