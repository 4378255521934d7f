#pragma once
// Synthetic weights, caches and inputs at the statistics of the spec's attention-layer fixtures
// (spec §10.3), from a fixed seed. Every element is a pure function of (seed, layer, tensor,
// element index) — a counter-based generator (splitmix64 finaliser) — so the data is identical
// for any thread count and any fill order, and filling ~150 MB per layer stays fast.
//
// Distributions ("normal" = Irwin–Hall sum of four 16-bit uniforms scaled to unit variance: the
// right mean and standard deviation at a fraction of Box–Muller's cost; this is test data):
//   hc_fn          normal, std 1/sqrt(4D)  (the RMS-scaled mixes come out with unit std)
//   hc_scale       {0.5, 0.5, 0.5};  hc_base: pre/post 0, comb 1.0 on the diagonal, 0 off it
//                  (synthetic stand-ins: the checkpoint gate constants are not in the spec)
//   attn_norm, gamma_cq, gamma_ckv   normal(1, 0.1)
//   wq_a, wkv, wo_a                  normal, std 0.02
//   wq_b, wo_b, idx_wq_b             INT8 uniform in [-127, 127]; per-column/channel scales
//                                    uniform in ±25 % around 1/(127·sqrt(K)) (wq_b, idx_wq_b) and
//                                    0.125/(73·sqrt(K)) (wo_b: attn_out ≈ 1/8 of the residual RMS)
//   CSA main compressor  wkv std 0.0245, wgate 0.0388, ape 0.1243, norm_w normal(0.9666, 0.19)
//   indexer inner        wkv std 0.0293, wgate 0.0512, ape 0.1528, norm_w normal(0.685, 0.26)
//   HCA compressor       the CSA main statistics (the spec lists none of its own)
//   weights_proj         normal, std 0.2313
//   hadamard             Sylvester H(128)/sqrt(128), BF16 (CSA fixture)
//   attn_sink            4.0 (CSA), 0 (HCA, SWA)
// Caches (all rows of every pool, i.e. a history that covers any context):
//   kv_cache, cmp_kv     normal rows, RMS-normalised per row, BF16
//   idx cache            Q8 of an RMS-normalised normal BF16 row (+ its dequant scale)
//   CSA main/inner state 0.05·normal in both halves (kv and score)
//   HCA state            zero (spec fixture: history kv 0, score 0, §6.3)
// x_hc inputs: normal(0, 1) FP32, a different draw per step.

#include <cmath>
#include <cstdint>
#include <span>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/layer.hpp"

namespace tiledecode::decode::synthetic {

inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Key of one tensor of one layer.
inline std::uint64_t tensor_key(std::uint64_t seed, int layer, int tensor) {
  return mix64(mix64(seed) ^ (std::uint64_t(layer) << 32) ^ std::uint64_t(tensor));
}

inline float uniform01(std::uint64_t key, std::uint64_t i) {
  return float(mix64(key ^ (i * 0xd1b54a32d192ed03ull)) >> 40) * (1.0f / 16777216.0f);
}

// Approximately standard normal (Irwin–Hall n = 4, exact mean 0 and variance 1).
inline float normal(std::uint64_t key, std::uint64_t i) {
  const std::uint64_t h = mix64(key ^ (i * 0xd1b54a32d192ed03ull));
  float s = 0.0f;
  for (int k = 0; k < 4; ++k) s += (float((h >> (16 * k)) & 0xffff) + 0.5f) * (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;
}

template <class T, class F>
void fill(const cpu::Context& ctx, std::span<T> v, F&& gen) {
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t n = std::int64_t(v.size());
  ctx.parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](std::int64_t c) {
    const std::int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    for (std::int64_t i = lo; i < hi; ++i) v[std::size_t(i)] = gen(std::uint64_t(i));
  });
}

template <class T>
void fill_normal(const cpu::Context& ctx, std::span<T> v, std::uint64_t key, float mean,
                 float stddev) {
  fill(ctx, v, [&](std::uint64_t i) { return T(mean + stddev * normal(key, i)); });
}

inline void fill_int8(const cpu::Context& ctx, std::span<std::int8_t> v, std::uint64_t key) {
  fill(ctx, v, [&](std::uint64_t i) {
    return std::int8_t(std::int64_t(mix64(key ^ (i * 0xd1b54a32d192ed03ull)) % 255) - 127);
  });
}

inline void fill_scale(const cpu::Context& ctx, std::span<float> v, std::uint64_t key,
                       float center) {
  fill(ctx, v, [&](std::uint64_t i) { return center * (0.75f + 0.5f * uniform01(key, i)); });
}

// Rows of `width` normals, RMS-normalised per row, stored as T (BF16).
template <class T>
void fill_rms_rows(const cpu::Context& ctx, View<T, 2> rows, std::uint64_t key) {
  const index_t n = rows.extent(0), w = rows.extent(1);
  ctx.parallel_for(0, n, 64, [&](std::int64_t r) {
    float tmp[1024];
    double ss = 0;
    for (index_t k = 0; k < w && k < 1024; ++k) {
      tmp[k] = normal(key, std::uint64_t(r * w + k));
      ss += double(tmp[k]) * tmp[k];
    }
    const float inv = float(1.0 / std::sqrt(ss / double(w) + 1e-12));
    for (index_t k = 0; k < w && k < 1024; ++k) rows(r, k) = T(tmp[k] * inv);
  });
}

enum TensorId : int {
  kHcFn = 1,
  kAttnNorm,
  kWqA,
  kGammaCq,
  kWqB,
  kWqBScale,
  kWkv,
  kGammaCkv,
  kWoA,
  kWoB,
  kWoBScale,
  kCmpWkv,
  kCmpWgate,
  kCmpApe,
  kCmpNorm,
  kIdxWqB,
  kIdxWqBScale,
  kWeightsProj,
  kInnerWkv,
  kInnerWgate,
  kInnerApe,
  kInnerNorm,
  kKvCache = 64,
  kCmpKv,
  kState,
  kIdxCache,
  kInnerState,
};

// Fills every weight of `w` (already shaped for its kind) for layer `layer`.
inline void fill_weights(const cpu::Context& ctx, LayerWeightsStorage& w, const ModelConfig& cfg,
                         int layer, std::uint64_t seed) {
  const auto key = [&](int id) { return tensor_key(seed, layer, id); };
  const float D = float(cfg.hidden);
  fill_normal(ctx, w.hc_fn.flat(), key(kHcFn), 0.0f, 1.0f / std::sqrt(4.0f * D));
  for (int i = 0; i < 3; ++i) w.hc_scale.data()[i] = 0.5f;
  for (int j = 0; j < kHcMixes; ++j) {
    const int c = j - 8;
    w.hc_base.data()[j] = (c >= 0 && c / 4 == c % 4) ? 1.0f : 0.0f;
  }
  fill_normal(ctx, w.attn_norm.flat(), key(kAttnNorm), 1.0f, 0.1f);
  fill_normal(ctx, w.wq_a.flat(), key(kWqA), 0.0f, 0.02f);
  fill_normal(ctx, w.gamma_cq.flat(), key(kGammaCq), 1.0f, 0.1f);
  fill_int8(ctx, w.wq_b.flat(), key(kWqB));
  fill_scale(ctx, w.wq_b_scale.flat(), key(kWqBScale),
             1.0f / (127.0f * std::sqrt(float(cfg.q_lora))));
  fill_normal(ctx, w.wkv.flat(), key(kWkv), 0.0f, 0.02f);
  fill_normal(ctx, w.gamma_ckv.flat(), key(kGammaCkv), 1.0f, 0.1f);
  for (auto& s : w.attn_sink.flat()) s = w.kind == LayerKind::csa ? 4.0f : 0.0f;
  fill_normal(ctx, w.wo_a.flat(), key(kWoA), 0.0f, 0.02f);
  fill_int8(ctx, w.wo_b.flat(), key(kWoB));
  // attn_out RMS ≈ 1/8 of the residual stream's (unit) RMS when the attention output is a single
  // unit-RMS KV row (short contexts; it is smaller at long ones): the attention branch is small
  // next to the residual in a trained model. With attn_out as large as the residual, one BF16 ulp
  // of attn_out (0.4 %) exceeds the spec's x_out tolerance (3e-3) on its own.
  fill_scale(ctx, w.wo_b_scale.flat(), key(kWoBScale),
             0.125f / (73.0f * std::sqrt(float(cfg.o_groups) * float(cfg.o_lora))));
  if (w.kind == LayerKind::swa) return;
  fill_normal(ctx, w.cmp_wkv.flat(), key(kCmpWkv), 0.0f, 0.0245f);
  fill_normal(ctx, w.cmp_wgate.flat(), key(kCmpWgate), 0.0f, 0.0388f);
  fill_normal(ctx, w.cmp_ape.flat(), key(kCmpApe), 0.0f, 0.1243f);
  fill_normal(ctx, w.cmp_norm_w.flat(), key(kCmpNorm), 0.9666f, 0.19f);
  if (w.kind != LayerKind::csa) return;
  fill_int8(ctx, w.idx_wq_b.flat(), key(kIdxWqB));
  fill_scale(ctx, w.idx_wq_b_scale.flat(), key(kIdxWqBScale),
             1.0f / (127.0f * std::sqrt(float(cfg.q_lora))));
  fill_normal(ctx, w.weights_proj.flat(), key(kWeightsProj), 0.0f, 0.2313f);
  build_hadamard<bf16>(w.hadamard.view(), 1.0f / std::sqrt(float(cfg.idx_head_dim)));
  fill_normal(ctx, w.inner_wkv.flat(), key(kInnerWkv), 0.0f, 0.0293f);
  fill_normal(ctx, w.inner_wgate.flat(), key(kInnerWgate), 0.0f, 0.0512f);
  fill_normal(ctx, w.inner_ape.flat(), key(kInnerApe), 0.0f, 0.1528f);
  fill_normal(ctx, w.inner_norm_w.flat(), key(kInnerNorm), 0.685f, 0.26f);
}

// Fills every row of every pool of `c` (a history covering any context; see the header).
inline void fill_caches(const cpu::Context& ctx, LayerCacheStorage& c, const ModelConfig& /*cfg*/,
                        int layer, std::uint64_t seed) {
  const auto key = [&](int id) { return tensor_key(seed, layer, id); };
  fill_rms_rows(ctx, c.kv_cache.view(), key(kKvCache));
  if (c.kind == LayerKind::swa) return;
  fill_rms_rows(ctx, c.cmp_kv.view(), key(kCmpKv));
  if (c.kind == LayerKind::hca) {
    std::fill(c.state.flat().begin(), c.state.flat().end(), 0.0f);
    return;
  }
  fill_normal(ctx, c.state.flat(), key(kState), 0.0f, 0.05f);
  fill_normal(ctx, c.inner_state.flat(), key(kInnerState), 0.0f, 0.05f);
  // Index cache: Q8 of an RMS-normalised BF16 draw per row.
  const index_t rows = c.idx_kv_cache.extent(0), w = c.idx_kv_cache.extent(1);
  Tensor<bf16, 2> draw({rows, w});
  fill_rms_rows(ctx, draw.view(), key(kIdxCache));
  auto cache = c.idx_kv_cache.view();
  auto scale = c.idx_kv_scale.view();
  ctx.parallel_for(0, rows, 64, [&](std::int64_t r) {
    float tmp[1024];
    for (index_t k = 0; k < w && k < 1024; ++k) tmp[k] = draw.view()(r, k).to_float();
    scale(r) = quantize_q8(std::span<std::int8_t>(&cache(r, 0), std::size_t(w)),
                           std::span<const float>(tmp, std::size_t(w)));
  });
}

// x_hc (T, 4, D) ← normal(0, 1), a different draw for every `step`.
inline void fill_x_hc(const cpu::Context& ctx, View<float, 3> x_hc, std::uint64_t seed, int step) {
  fill_normal(ctx, std::span<float>(x_hc.data(), std::size_t(x_hc.size())),
              tensor_key(seed, 1 << 20, step), 0.0f, 1.0f);
}

}  // namespace tiledecode::decode::synthetic
