#pragma once
// Layer schedules (spec §9.2) on the a2a3 model: the kernels of one SWA / CSA / HCA attention
// layer in sequence, each a launch (or a few) with its own launch overhead.
//
//   hc_pre -> rms_norm -> qkv_proj_rope -> cache write -> [compressor] -> [indexer] ->
//   sparse_attn -> hc_post
//
// qkv_proj_rope (qkv_projection.hpp), the compressors (compressor.hpp), the indexer
// (indexer.hpp) and sparse attention (sparse_attention.hpp) are the functional, golden-checked
// schedules. The other kernels here - hc_pre, rms_norm, the cache write, hc_post - are
// TIMING-ONLY tile programs: real
// copies, mmads and vector ops of the real shapes, issued on the model's cores and timed by the
// same cost model, but run with the machine in timing-only mode (no data is computed), because no
// functional a2a3 schedule of them exists yet. Their weights stream from GM exactly once per
// launch; their vector work is counted pass by pass.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/timing.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::a2a3 {

// hc_pre (§4.1): RMS-scaled linear mix of the 4 streams (cube) then
// Sinkhorn (20 iterations of a 4x4 normalisation) and the weighted mix (vector, per token).
inline KernelReport hc_pre_timing(Machine& m, const ModelConfig& cfg, index_t T) {
  detail::TimingOnly off(m);
  const index_t D = cfg.hidden, HC = cfg.hc_mult;
  m.begin_kernel("hc_pre");
  // (T x 4D) . (24 x 4D)^T with split-K over the cube cores; FP32 weights are counted as
  // BF16-sized tiles (the model has no FP32 cube path; 0.75 MiB either way is small).
  detail::gemm_timing<bf16>(m, "hc_pre.mix_mm", T, (2 + HC) * HC, HC * D, m.arch().cube_cores);
  // Per token: sum of the split-K partials, RMS scale, sigmoid gates, 20 Sinkhorn iterations on
  // the 4x4 combine (a few short ops each), the weighted mix of the 4 streams.
  detail::vector_timing(m, "hc_pre.sinkhorn_mix", int(T), HC * D * 4, D * 2, HC * D, 4, 1, 0, 1024,
                        20 * 4 + 8);
  return m.end_kernel();
}

// rms_norm (§4.2), per token.
inline KernelReport rmsnorm_timing(Machine& m, const ModelConfig& cfg, index_t T) {
  detail::TimingOnly off(m);
  m.begin_kernel("rms_norm");
  detail::vector_timing(m, "rms_norm", int(T), cfg.hidden * 2 + cfg.hidden * 2, cfg.hidden * 2,
                        cfg.hidden, 4);
  return m.end_kernel();
}

// Write of the new kv rows into the paged cache (§3.3): one 1 KiB row per token.
inline KernelReport cache_write_timing(Machine& m, const ModelConfig& cfg, index_t T) {
  detail::TimingOnly off(m);
  m.begin_kernel("cache_write");
  detail::vector_timing(m, "cache_write", 1, T * cfg.head_dim * 2, T * cfg.head_dim * 2,
                        T * cfg.head_dim, 1);
  return m.end_kernel();
}

// hc_post (§4.5): y[t,o,:] = attn_out[t]*post[t,o] + sum_i x_hc[t,i,:]*comb[t,i,o] (FP32).
inline KernelReport hc_post_timing(Machine& m, const ModelConfig& cfg, index_t T) {
  detail::TimingOnly off(m);
  const index_t D = cfg.hidden, HC = cfg.hc_mult;
  m.begin_kernel("hc_post");
  detail::vector_timing(m, "hc_post", int(T * 2), HC * D * 4 / 2 + D, HC * D * 4 / 2, HC * D / 2,
                        2 * HC);
  return m.end_kernel();
}

// A layer report: its kernels in order (§9.2); latency = the sum (each kernel's launches carry
// their launch overheads).
struct LayerReport {
  LayerKind kind;
  std::vector<KernelReport> kernels;
  double latency_us() const {
    double s = 0;
    for (const auto& k : kernels) s += k.latency_us();
    return s;
  }
};

// The timing-only kernels that open every layer, in order: hc_pre, rms_norm. A layer is then
//   qkv_proj_rope (qkv_projection.hpp), cache_write (timing-only), then
//   SWA: sparse_attention(swa), hc_post
//   CSA: compressor(ratio 4) (compressor.hpp), indexer with its inner compressor,
//        sparse_attention(csa), hc_post
//   HCA: compressor(ratio 128), sparse_attention(hca), hc_post
// with hc_post timing-only (see examples/90_a2a3_report.cpp).
inline std::vector<KernelReport> layer_pre_timing(Machine& m, const ModelConfig& cfg, index_t T) {
  std::vector<KernelReport> r;
  r.push_back(hc_pre_timing(m, cfg, T));
  r.push_back(rmsnorm_timing(m, cfg, T));
  return r;
}

}  // namespace tiledecode::a2a3
