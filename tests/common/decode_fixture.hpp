#pragma once
// Shared fixtures of the decode-step tests: one layer's synthetic weights and pools at the spec
// deployment sizes (flash, B requests), the spec fixture tables, the layer's RoPE table, and the
// comparisons of spec §10.2 for a layer's outputs and caches.
#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "common/compare.hpp"
#include "common/narrow_config.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdtest {

// narrow_config(): common/narrow_config.hpp (also used by the fuzz targets, without gtest).

struct LayerSetup {
  tiledecode::ModelConfig cfg;
  tiledecode::LayerKind kind;
  tiledecode::decode::LayerWeightsStorage weights;
  tiledecode::decode::LayerCacheStorage caches;
  tiledecode::RopeTable rope;

  LayerSetup(const tiledecode::ModelConfig& c, tiledecode::LayerKind k,
             const tiledecode::paged::PoolSizes& pools, int layer, std::uint64_t seed,
             const tiledecode::cpu::Context& ctx,
             tiledecode::paged::Layout layout = tiledecode::paged::Layout::base)
      : cfg(c),
        kind(k),
        weights(c, k),
        caches(c, k, pools, layout),
        rope(tiledecode::make_rope_table(c, k, c.max_seq_len)) {
    tiledecode::decode::synthetic::fill_weights(ctx, weights, cfg, layer, seed);
    weights.pack(cfg);
    tiledecode::decode::synthetic::fill_caches(ctx, caches, cfg, layer, seed);
  }
};

template <class T, std::size_t R>
std::vector<float> to_float_vec(tiledecode::ConstView<T, R> v) {
  std::vector<float> r(static_cast<std::size_t>(v.size()));
  const T* p = v.data();
  for (std::size_t i = 0; i < r.size(); ++i) {
    if constexpr (std::is_same_v<T, tiledecode::bf16>) {
      r[i] = p[i].to_float();
    } else {
      r[i] = static_cast<float>(p[i]);
    }
  }
  return r;
}

// Spec §10.2 x_out tolerance of a family: ratio_reldiff(4e-3 CSA / 3e-3 HCA, SWA, 0.8 %, max 1).
inline double x_out_threshold(tiledecode::LayerKind k) {
  return k == tiledecode::LayerKind::csa ? 4e-3 : 3e-3;
}

inline testing::AssertionResult x_out_close(tiledecode::ConstView<float, 3> a,
                                            tiledecode::ConstView<float, 3> e,
                                            tiledecode::LayerKind k) {
  return ratio_reldiff(std::span<const float>(a.data(), std::size_t(a.size())),
                       std::span<const float>(e.data(), std::size_t(e.size())), x_out_threshold(k),
                       0.008, 1.0);
}

// Every pool of a layer against the golden layer's pools: BF16 KV caches and compressed rows
// ratio_allclose(1e-4, 1/128) (spec §10.2 kv_cache rule, 0 % for compressed rows as the
// compressor tests), states (1e-3, 1e-3, 0 %), index cache ±1 on ≤ 1 %, scales (1e-4, 1/128, 1 %).
inline void expect_caches_close(tiledecode::decode::LayerCacheStorage& a,
                                tiledecode::decode::LayerCacheStorage& e, const char* what) {
  using tiledecode::ConstView;
  auto cmp = [&](auto va, auto ve, double atol, double rtol, double ratio, const char* name) {
    const auto fa = to_float_vec(va), fe = to_float_vec(ve);
    EXPECT_TRUE(ratio_allclose(fa, fe, atol, rtol, ratio)) << what << ": " << name;
  };
  cmp(ConstView<tiledecode::bf16, 2>(a.kv_cache.view()),
      ConstView<tiledecode::bf16, 2>(e.kv_cache.view()), 1e-4, 1.0 / 128, 0.005, "kv_cache");
  if (a.kind == tiledecode::LayerKind::swa) return;
  cmp(ConstView<tiledecode::bf16, 2>(a.cmp_kv.view()),
      ConstView<tiledecode::bf16, 2>(e.cmp_kv.view()), 1e-4, 1.0 / 128, 0.0, "cmp_kv");
  cmp(ConstView<float, 2>(a.state.view()), ConstView<float, 2>(e.state.view()), 1e-3, 1e-3, 0.0,
      "compressor state");
  if (a.kind != tiledecode::LayerKind::csa) return;
  cmp(ConstView<float, 2>(a.inner_state.view()), ConstView<float, 2>(e.inner_state.view()), 1e-3,
      1e-3, 0.0, "indexer compressor state");
  cmp(ConstView<std::int8_t, 2>(a.idx_kv_cache.view()),
      ConstView<std::int8_t, 2>(e.idx_kv_cache.view()), 1.0, 0.0, 0.01, "idx_kv_cache");
  cmp(ConstView<float, 1>(a.idx_kv_scale.view()), ConstView<float, 1>(e.idx_kv_scale.view()), 1e-4,
      1.0 / 128, 0.01, "idx_kv_scale");
}

}  // namespace tdtest
