#pragma once
// Inputs of the whole-layer comparison in `peer_compare`: one CSA attention layer (spec §4,
// §9.2) with the decode API's own storage (decode/layer.hpp), synthetic weights and caches at
// the spec fixture statistics (decode/synthetic.hpp), the spec fixture tables scaled to the
// batch (paged::FixtureTables) and the step's metadata bundle built once (MTP: S = 2,
// commit_tokens = 1, as in the full decode forward). No Torch here.

#include <cstdint>
#include <memory>
#include <vector>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/decode/workspace.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdpeer {

// The CSA layer's weights (shared by every point) and its RoPE table.
struct LayerModel {
  tiledecode::ModelConfig cfg;
  tiledecode::decode::LayerWeightsStorage w;
  tiledecode::RopeTable rope;

  explicit LayerModel(const tiledecode::ModelConfig& c, tiledecode::Executor* exec)
      : cfg(c),
        w(c, tiledecode::LayerKind::csa),
        rope(tiledecode::make_rope_table(c, tiledecode::LayerKind::csa, c.max_seq_len)) {
    const auto ctx = tiledecode::cpu::make_context(exec);
    tiledecode::decode::synthetic::fill_weights(ctx, w, c, /*layer=*/2, /*seed=*/2026);
    w.pack(c);
  }
};

// One (batch, seq, context) point: pools, tables, metadata, input stack and output buffers.
// S tokens per request, the first committed (MTP metadata, commit_tokens = 1, as in the full
// decode forward, for S = 2 and for the S = 8 speculative tree alike). Not movable (the metadata
// keeps views of the tables).
struct LayerCase {
  int batch = 4, seq = 2, context = 8192;
  std::vector<std::int32_t> starts;
  tiledecode::paged::StepShape shape;
  tiledecode::paged::FixtureTables fx;
  tiledecode::paged::StepMetadata md;
  tiledecode::decode::LayerCacheStorage caches;
  tiledecode::Tensor<float, 3> x_hc;

  LayerCase(const LayerModel& m, int b, int ctx_len, int max_threads, int s = 2)
      : batch(b),
        seq(s),
        context(ctx_len),
        starts(make_starts(b, ctx_len, s)),
        shape{b, s, 1},
        fx(b, m.cfg),
        md(starts, shape, fx.tables(), fx.pools, m.cfg) {
    tiledecode::ThreadPool pool(std::size_t(std::max(1, max_threads)));
    const auto ctx = tiledecode::cpu::make_context(&pool);
    caches = tiledecode::decode::LayerCacheStorage(m.cfg, tiledecode::LayerKind::csa, fx.pools);
    tiledecode::decode::synthetic::fill_caches(ctx, caches, m.cfg, /*layer=*/2, /*seed=*/2026);
    x_hc = tiledecode::Tensor<float, 3>({shape.tokens(), 4, m.cfg.hidden});
    tiledecode::decode::synthetic::fill_x_hc(ctx, x_hc.view(), /*seed=*/2026, /*step=*/0);
  }
  // Request b starts at context - S - (b % 4), as in fixtures.hpp.
  static std::vector<std::int32_t> make_starts(int b, int ctx_len, int seq) {
    std::vector<std::int32_t> s;
    for (int i = 0; i < b; ++i) s.push_back(ctx_len - seq - (i % 4));
    return s;
  }
  LayerCase(const LayerCase&) = delete;
  LayerCase& operator=(const LayerCase&) = delete;
};

}  // namespace tdpeer
