#pragma once
// Golden decode-step layer (spec §4, §9.2) for SWA, CSA and HCA, composed ONLY of golden
// primitives — its own metadata (golden/paged.hpp builders from the start positions and the
// tables), golden hc_pre, RMSNorm, q/kv projection, cache write, compressors, indexer, sparse
// attention, output projection and hc_post. It is the oracle of tests/test_layer.cpp,
// tests/test_decode_step.cpp and the example's --check.
//
// Order (spec §9.2):
//   hc_pre → rmsnorm → qkv_proj_rope → kv → kv_cache[ori_slot]            (all families)
//   CSA: main compressor (ratio 4) → inner compressor → indexer query, weights, score, top-k
//   HCA: compressor (ratio 128)
//   sparse attention (window + compressed list, sink, inverse RoPE) → output projection → hc_post
// Caches are updated in place. `trace`, when given, receives every intermediate tensor.

#include <cstdint>
#include <span>
#include <vector>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/golden/compressor.hpp"
#include "tiledecode/golden/hyper_connection.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/golden/output_projection.hpp"
#include "tiledecode/golden/paged.hpp"
#include "tiledecode/golden/qkv_projection.hpp"
#include "tiledecode/golden/rmsnorm.hpp"
#include "tiledecode/golden/sparse_attention.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace tiledecode::golden {

// Every intermediate of one golden layer step (spec tensor names).
struct LayerTrace {
  Tensor<std::int32_t, 1> position_ids, kv_seq_lens, window_lens;
  Tensor<std::int32_t, 2> window_indices;
  Tensor<std::int64_t, 1> ori_slot_mapping, cmp_slot_mapping, idx_slot_mapping, state_slot_mapping,
      inner_state_slot_mapping;
  Tensor<bf16, 2> x_mixed, x_n, kv, o_packed, attn_out;
  Tensor<float, 2> post, score, idx_weights, idx_q_scale;
  Tensor<float, 3> comb;
  Tensor<bf16, 3> q;
  Tensor<std::int8_t, 2> qr;
  Tensor<std::int8_t, 3> idx_q_i8;
  Tensor<float, 1> qr_scale;
  Tensor<std::int32_t, 2> topk_idxs;
};

// One golden layer step.
//   x_out (T, 4, D) FP32 ← x_hc (T, 4, D) FP32, T = sh.batch * sh.seq
//   w, c    the layer's weights and pools (c updated in place)
//   starts  (B) start position of each request; sh: B, S, commit_tokens
//   tables  the step's block tables; rope: the layer's table (SWA plain, CSA/HCA YaRN)
inline void decode_layer(View<float, 3> x_out, ConstView<float, 3> x_hc,
                         const decode::LayerWeights& w, const decode::LayerCaches& c,
                         std::span<const std::int32_t> starts, const paged::StepShape& sh,
                         const paged::StepTables& tables, const RopeTableView& rope,
                         const ModelConfig& cfg, const decode::LayerOptions& opt = {},
                         LayerTrace* trace = nullptr) {
  const LayerKind kind = w.kind;
  const index_t T = sh.tokens(), B = sh.batch, S = sh.seq, D = cfg.hidden;
  check_equal<index_t>("golden::decode_layer", "x_hc.extent(0)", x_hc.extent(0), T);
  LayerTrace local;
  LayerTrace& tr = trace ? *trace : local;

  // Metadata (spec §3), built here from the golden builders.
  tr.position_ids = Tensor<std::int32_t, 1>({T});
  tr.kv_seq_lens = Tensor<std::int32_t, 1>({B});
  tr.window_indices = Tensor<std::int32_t, 2>({T, cfg.window});
  tr.window_lens = Tensor<std::int32_t, 1>({T});
  tr.ori_slot_mapping = Tensor<std::int64_t, 1>({T});
  tr.cmp_slot_mapping = Tensor<std::int64_t, 1>({T});
  tr.idx_slot_mapping = Tensor<std::int64_t, 1>({T});
  tr.state_slot_mapping = Tensor<std::int64_t, 1>({T});
  tr.inner_state_slot_mapping = Tensor<std::int64_t, 1>({T});
  golden::build_position_ids(tr.position_ids.view(), starts, sh, cfg);
  golden::build_kv_seq_lens(tr.kv_seq_lens.view(), starts, sh, cfg);
  const ConstView<std::int32_t, 1> pos = tr.position_ids.view();
  golden::build_ori_slot_mapping(tr.ori_slot_mapping.view(), pos, tables.block_table, 0, sh, cfg);
  golden::build_window_indices(tr.window_indices.view(), tr.window_lens.view(), pos,
                               tables.block_table, 0, sh, cfg);
  // The layout's writers (addendum §2.2 / §3.2 / §7; golden's own copies in golden/paged.hpp).
  // block_counts columns: prefix caching §3.1 (1 HCA cmp, 2 CSA cmp, 3 idx, 4 HCA state, 5 CSA
  // state, 6 inner state), device ring #862 §2.2 (1 cmp, 2 idx, 3 HCA state, 4 CSA state, 5 inner).
  const bool prefix = tables.layout == paged::Layout::prefix_caching;
  const bool ring = tables.layout != paged::Layout::base;
  const ConstView<std::int32_t, 2> cmp_table =
      !prefix ? tables.cmp_block_table
              : (kind == LayerKind::hca ? tables.hca_cmp_block_table : tables.csa_cmp_block_table);
  const int ratio = kind == LayerKind::hca ? 128 : 4;
  // Rows per table column of the compressed / index pools (prefix caching: 128 / R).
  const index_t cmp_page = prefix ? cfg.page / ratio : cfg.page;
  const index_t idx_page = prefix ? cfg.page / 4 : cfg.page;
  auto compressed = [&](View<std::int64_t, 1> dst, ConstView<std::int32_t, 2> table, int r,
                        int prefix_col, int ring_col) {
    if (!ring)
      golden::build_compressed_slot_mapping(dst, pos, table, 0, r, sh, cfg);
    else if (prefix)
      golden::build_prefix_compressed_slot_mapping(dst, pos, table, tables.block_counts, prefix_col,
                                                   r, sh, cfg);
    else
      golden::build_ring862_compressed_slot_mapping(dst, pos, table, tables.block_counts, ring_col,
                                                    r, sh, cfg);
  };
  auto state = [&](View<std::int64_t, 1> dst, ConstView<std::int32_t, 2> table, int sb,
                   int prefix_col, int ring_col) {
    if (!ring)
      golden::build_state_slot_mapping(dst, pos, table, 0, sb, sh, cfg);
    else
      golden::build_ring_state_slot_mapping(dst, pos, table, tables.block_counts,
                                            prefix ? prefix_col : ring_col, sb, sh);
  };
  if (kind == LayerKind::csa) {
    compressed(tr.cmp_slot_mapping.view(), cmp_table, 4, 2, 1);
    compressed(tr.idx_slot_mapping.view(), tables.idx_block_table, 4, 3, 2);
    state(tr.state_slot_mapping.view(), tables.csa_state_table, cfg.c4_state_page, 5, 4);
    state(tr.inner_state_slot_mapping.view(), tables.csa_inner_state_table, cfg.c4_state_page, 6,
          5);
  } else if (kind == LayerKind::hca) {
    compressed(tr.cmp_slot_mapping.view(), cmp_table, 128, 1, 1);
    state(tr.state_slot_mapping.view(), tables.hca_state_table, cfg.c128_state_page, 4, 3);
  }

  // Front-end (spec §4).
  tr.x_mixed = Tensor<bf16, 2>({T, D});
  tr.post = Tensor<float, 2>({T, 4});
  tr.comb = Tensor<float, 3>({T, 4, 4});
  hc_pre(tr.x_mixed.view(), tr.post.view(), tr.comb.view(), x_hc, w.hc, cfg);
  tr.x_n = Tensor<bf16, 2>({T, D});
  rmsnorm(tr.x_n.view(), tr.x_mixed.view(), w.attn_norm, cfg.rms_eps);
  tr.q = Tensor<bf16, 3>({T, cfg.n_heads, cfg.head_dim});
  tr.kv = Tensor<bf16, 2>({T, cfg.head_dim});
  tr.qr = Tensor<std::int8_t, 2>({T, cfg.q_lora});
  tr.qr_scale = Tensor<float, 1>({T});
  qkv_projection(tr.q.view(), tr.kv.view(), tr.qr.view(), tr.qr_scale.view(), tr.x_n.view(), w.qkv,
                 rope, pos, cfg);
  write_cache<bf16>(c.kv_cache, tr.kv.view(), tr.ori_slot_mapping.view());

  // Compressors and indexer (spec §6, §7).
  tr.topk_idxs = Tensor<std::int32_t, 2>({T, cfg.score_len()});
  const ConstView<std::int32_t, 1> lens = tr.kv_seq_lens.view();
  if (kind != LayerKind::swa) {
    const auto spec = kind == LayerKind::csa ? kernels::csa_compressor_spec(cfg)
                                             : kernels::hca_compressor_spec(cfg);
    const auto& state_table =
        kind == LayerKind::csa ? tables.csa_state_table : tables.hca_state_table;
    Tensor<float, 2> kv_out({B, cfg.head_dim});
    compressor_step(
        cfg, spec, c.state, c.cmp_kv, kv_out.view(), tr.x_n.view(), w.compressor,
        {sh, pos, tr.state_slot_mapping.view(), tr.cmp_slot_mapping.view(), state_table}, rope);
  }
  if (kind == LayerKind::csa) {
    const bool ref = opt.indexer_rope == decode::IndexerRope::reference;
    Tensor<float, 2> idx_out({B, cfg.idx_head_dim});
    indexer_compressor_step(
        cfg, c.inner_state, c.idx_kv_cache, c.idx_kv_scale, idx_out.view(), tr.x_n.view(),
        w.indexer.compressor, w.indexer.hadamard,
        {sh, pos, tr.inner_state_slot_mapping.view(), tr.idx_slot_mapping.view(),
         tables.csa_inner_state_table},
        rope,
        ref ? kernels::InnerRopePosition::request_start : kernels::InnerRopePosition::window_start);
    Tensor<std::int32_t, 1> rope_pos({T});
    for (index_t t = 0; t < T; ++t) rope_pos.view()(t) = ref ? starts[t / S] : pos(t);
    tr.idx_q_i8 = Tensor<std::int8_t, 3>({T, cfg.idx_n_heads, cfg.idx_head_dim});
    tr.idx_q_scale = Tensor<float, 2>({T, cfg.idx_n_heads});
    tr.idx_weights = Tensor<float, 2>({T, cfg.idx_n_heads});
    tr.score = Tensor<float, 2>({T, cfg.score_len()});
    indexer_query(cfg, tr.idx_q_i8.view(), tr.idx_q_scale.view(), tr.qr.view(), tr.qr_scale.view(),
                  w.indexer.wq_b, w.indexer.wq_b_scale, rope_pos.view(), rope, w.indexer.hadamard);
    indexer_weights(cfg, tr.idx_weights.view(), tr.x_n.view(), w.indexer.weights_proj);
    indexer_score(cfg, tr.score.view(), tr.idx_q_i8.view(), tr.idx_q_scale.view(),
                  tr.idx_weights.view(), c.idx_kv_cache, c.idx_kv_scale, tables.idx_block_table,
                  pos, lens, int(S), idx_page);
    indexer_topk(cfg, tr.topk_idxs.view(), tr.score.view(), pos, lens, int(S), cfg.idx_topk, 0);
  } else {
    for (auto& v : tr.topk_idxs.flat()) v = -1;
  }

  // Attention core and output projection (spec §8).
  tr.o_packed = Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
  sparse_attention(cfg, kind, tr.o_packed.view(), tr.q.view(), c.kv_cache, c.cmp_kv,
                   tr.window_indices.view(), tr.window_lens.view(), tr.topk_idxs.view(), cmp_table,
                   pos, lens, int(S), w.attn_sink, rope, cmp_page);
  tr.attn_out = Tensor<bf16, 2>({T, D});
  output_projection(cfg, tr.attn_out.view(), tr.o_packed.view(), w.wo_a, w.wo_b, w.wo_b_scale);
  hc_post(x_out, tr.attn_out.view(), x_hc, tr.post.view(), tr.comb.view(), cfg);
}

}  // namespace tiledecode::golden
