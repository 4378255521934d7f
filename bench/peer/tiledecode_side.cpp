// TileDecode kernels and golden references bound to a peer_compare case (no Torch here).

#include "peer/tiledecode_side.hpp"

#include <cstddef>
#include <memory>
#include <vector>

#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/workspace.hpp"
#include "tiledecode/golden/compressor.hpp"
#include "tiledecode/golden/decode_layer.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/golden/output_projection.hpp"
#include "tiledecode/golden/sparse_attention.hpp"
#include "tiledecode/kernels/topk.hpp"

#if __has_include("tiledecode/backend/cpu/indexer.hpp")
#include "tiledecode/backend/cpu/indexer.hpp"
#define TDPEER_HAVE_INDEXER 1
#else
#define TDPEER_HAVE_INDEXER 0
#endif

namespace tdpeer {
namespace {

namespace td = tiledecode;
namespace k = tiledecode::kernels;
using td::ConstView;
using td::View;

template <class T>
std::vector<float> floats(const Tensor<T, 2>& t) {
  std::vector<float> v(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) v[i] = static_cast<float>(t.data()[i]);
  return v;
}

// Rows at the boundary slots of a compressor's destination cache, as floats (inner: the
// dequantised INT8 row).
std::vector<float> emitted_rows(const Case& cs, int which) {
  std::vector<float> v;
  const auto& slots =
      which == 4 ? cs.c4_cmp_slots : (which == 128 ? cs.c128_cmp_slots : cs.idx_slots);
  for (index_t t = 0; t < slots.extent(0); ++t) {
    const std::int64_t s = slots.data()[t];
    if (s < 0) continue;
    if (which != 0) {
      for (index_t d = 0; d < cs.cmp_kv.extent(1); ++d)
        v.push_back(cs.cmp_kv.data()[s * cs.cmp_kv.extent(1) + d].to_float());
    } else {
      for (index_t d = 0; d < cs.idx_kv.extent(1); ++d)
        v.push_back(float(cs.idx_kv.data()[s * cs.idx_kv.extent(1) + d]) * cs.idx_sc.data()[s]);
    }
  }
  return v;
}

const CompressorWeights& compressor_weights(const Weights& w, int which) {
  return which == 4 ? w.c4 : (which == 128 ? w.c128 : w.inner);
}
StatePool& state_pool(Case& cs, int which) {
  return which == 4 ? cs.s4 : (which == 128 ? cs.s128 : cs.sinner);
}
k::CompressorSpec compressor_spec(const ModelConfig& cfg, int which) {
  return which == 4
             ? k::csa_compressor_spec(cfg)
             : (which == 128 ? k::hca_compressor_spec(cfg) : k::indexer_compressor_spec(cfg));
}
k::CompressorWeights compressor_views(const CompressorWeights& cw) {
  return {cw.wkv.view(), cw.wgate.view(), cw.ape.view(), cw.norm_w.view()};
}
k::CompressorMetadata compressor_meta(Case& cs, int which) {
  StatePool& sp = state_pool(cs, which);
  const auto& slots =
      which == 4 ? cs.c4_cmp_slots : (which == 128 ? cs.c128_cmp_slots : cs.idx_slots);
  return {td::paged::StepShape{cs.batch, cs.seq, -1}, cs.positions.view(), sp.slots.view(),
          slots.view(), sp.table.view()};
}
td::LayerKind kind_of(int ratio) {
  return ratio == 0 ? td::LayerKind::swa : (ratio == 4 ? td::LayerKind::csa : td::LayerKind::hca);
}

}  // namespace

TdRunner make_td_indexer(const Weights& w, Case& cs, const td::cpu::Context* ctx, int max_threads) {
  (void)max_threads;
  const ModelConfig& cfg = w.cfg;
  const index_t T = cs.tokens();
  auto score = std::make_shared<Tensor<float, 2>>(std::array<index_t, 2>{T, cfg.score_len()});
  auto topk = std::make_shared<Tensor<std::int32_t, 2>>(std::array<index_t, 2>{T, cfg.idx_topk});
  auto vis = std::make_shared<Tensor<std::int32_t, 1>>(std::array<index_t, 1>{T});
  TdRunner r;
  const auto q3 =
      ConstView<std::int8_t, 2>(cs.q_i8.view()).reshape<3>({T, cfg.idx_n_heads, cfg.idx_head_dim});
  const ConstView<float, 2> qsc =
      ConstView<float, 1>(cs.q_sc.view()).reshape<2>({T, cfg.idx_n_heads});
#if TDPEER_HAVE_INDEXER
  (void)vis;
  r.impl = "kernel";
  r.run = [=, &cs, &cfg] {
    k::indexer_score(*ctx, cfg, score->view(), q3, qsc, cs.w.view(), cs.idx_kv.view(),
                     cs.idx_sc.view(), cs.idx_table.view(), cs.positions.view(),
                     cs.kv_seq_lens.view(), cs.seq);
    k::indexer_topk(*ctx, cfg, topk->view(), score->view(), cs.positions.view(),
                    cs.kv_seq_lens.view(), cs.seq, cfg.idx_topk, 0);
  };
#else
  r.impl = "golden stand-in";
  r.run = [=, &cs, &cfg] {
    td::golden::indexer_score(cfg, score->view(), q3, qsc, cs.w.view(), cs.idx_kv.view(),
                              cs.idx_sc.view(), cs.idx_table.view(), cs.positions.view(),
                              cs.kv_seq_lens.view(), cs.seq);
    for (index_t t = 0; t < T; ++t)
      vis->data()[t] = td::golden::indexer_visible_rows(cfg, cs.positions.data()[t],
                                                        cs.kv_seq_lens.data()[t / cs.seq]);
    k::topk_rows(*ctx, topk->view(), score->view(), vis->view(), cfg.idx_topk, 0);
  };
#endif
  r.output = [score] { return floats(*score); };
  return r;
}

TdRunner make_td_attention(const Weights& w, Case& cs, int ratio, const td::cpu::Context* ctx,
                           int max_threads) {
  const ModelConfig& cfg = w.cfg;
  const index_t T = cs.tokens();
  auto out = std::make_shared<Tensor<bf16, 2>>(
      std::array<index_t, 2>{index_t(cfg.o_groups) * T, cfg.o_group_in()});
  auto ws = std::make_shared<std::vector<std::byte>>(
      k::sparse_attention_workspace_bytes(cfg, std::size_t(max_threads)));
  const auto& rope = ratio == 0 ? w.rope_swa : w.rope_csa;
  TdRunner r;
  r.impl = "kernel";
  r.run = [=, &cs, &cfg, &rope] {
    k::sparse_attention(*ctx, cfg, kind_of(ratio), out->view(), cs.q.view(), cs.ori_kv.view(),
                        cs.cmp_kv.view(), cs.win_idx.view(), cs.win_lens.view(), cs.topk.view(),
                        cs.cmp_table.view(), cs.positions.view(), cs.kv_seq_lens.view(), cs.seq,
                        w.sink.view(), rope.view(), *ws);
  };
  r.output = [out] { return floats(*out); };
  return r;
}

TdRunner make_td_oproj(const Weights& w, Case& cs, const td::cpu::Context* ctx) {
  const ModelConfig& cfg = w.cfg;
  const index_t T = cs.tokens();
  auto out = std::make_shared<Tensor<bf16, 2>>(std::array<index_t, 2>{T, cfg.hidden});
  auto ws = std::make_shared<std::vector<std::byte>>(k::output_projection_workspace_bytes(cfg, T));
  TdRunner r;
  r.impl = "kernel";
  r.run = [=, &cs, &w, &cfg] {
    k::output_projection(*ctx, cfg, out->view(), cs.o_packed.view(), w.wo_a.view(), w.wo_b.view(),
                         w.wo_b_scale.view(), *ws);
  };
  r.output = [out] { return floats(*out); };
  return r;
}

TdRunner make_td_compressor(const Weights& w, Case& cs, int which, const td::cpu::Context* ctx) {
  const ModelConfig& cfg = w.cfg;
  const k::CompressorSpec spec = compressor_spec(cfg, which);
  auto ws = std::make_shared<Tensor<float, 1>>(
      std::array<index_t, 1>{k::compressor_workspace_size(cfg, spec, cs.tokens())});
  const k::CompressorWeights cw = compressor_views(compressor_weights(w, which));
  const k::CompressorMetadata meta = compressor_meta(cs, which);
  StatePool& sp = state_pool(cs, which);
  TdRunner r;
  r.impl = "kernel";
  r.run = [=, &cs, &w, &cfg, &sp] {
    if (which != 0) {
      k::compressor_step(*ctx, cfg, spec, sp.rows.view(), cs.cmp_kv.view(), View<float, 2>(),
                         cs.x_n.view(), cw, meta, w.rope_csa.view(), ws->view());
    } else {
      k::indexer_compressor_step(*ctx, cfg, sp.rows.view(), cs.idx_kv.view(), cs.idx_sc.view(),
                                 View<float, 2>(), cs.x_n.view(), cw, w.hadamard.view(), meta,
                                 w.rope_csa.view(), ws->view());
    }
  };
  r.output = [&cs, which] { return emitted_rows(cs, which); };
  return r;
}

Runner make_golden_indexer(const Weights& w, Case& cs) {
  const ModelConfig& cfg = w.cfg;
  const index_t T = cs.tokens();
  auto score = std::make_shared<Tensor<float, 2>>(std::array<index_t, 2>{T, cfg.score_len()});
  auto topk = std::make_shared<Tensor<std::int32_t, 2>>(std::array<index_t, 2>{T, cfg.idx_topk});
  const auto q3 =
      ConstView<std::int8_t, 2>(cs.q_i8.view()).reshape<3>({T, cfg.idx_n_heads, cfg.idx_head_dim});
  const ConstView<float, 2> qsc =
      ConstView<float, 1>(cs.q_sc.view()).reshape<2>({T, cfg.idx_n_heads});
  Runner r;
  r.run = [=, &cs, &cfg] {
    td::golden::indexer_score(cfg, score->view(), q3, qsc, cs.w.view(), cs.idx_kv.view(),
                              cs.idx_sc.view(), cs.idx_table.view(), cs.positions.view(),
                              cs.kv_seq_lens.view(), cs.seq);
    td::golden::indexer_topk(cfg, topk->view(), score->view(), cs.positions.view(),
                             cs.kv_seq_lens.view(), cs.seq, cfg.idx_topk, 0);
  };
  r.output = [score] { return floats(*score); };
  return r;
}

Runner make_golden_attention(const Weights& w, Case& cs, int ratio) {
  const ModelConfig& cfg = w.cfg;
  const index_t T = cs.tokens();
  auto out = std::make_shared<Tensor<bf16, 2>>(
      std::array<index_t, 2>{index_t(cfg.o_groups) * T, cfg.o_group_in()});
  const auto& rope = ratio == 0 ? w.rope_swa : w.rope_csa;
  Runner r;
  r.run = [=, &cs, &w, &cfg, &rope] {
    td::golden::sparse_attention(cfg, kind_of(ratio), out->view(), cs.q.view(), cs.ori_kv.view(),
                                 cs.cmp_kv.view(), cs.win_idx.view(), cs.win_lens.view(),
                                 cs.topk.view(), cs.cmp_table.view(), cs.positions.view(),
                                 cs.kv_seq_lens.view(), cs.seq, w.sink.view(), rope.view());
  };
  r.output = [out] { return floats(*out); };
  return r;
}

Runner make_golden_oproj(const Weights& w, Case& cs) {
  const ModelConfig& cfg = w.cfg;
  auto out =
      std::make_shared<Tensor<bf16, 2>>(std::array<index_t, 2>{index_t(cs.tokens()), cfg.hidden});
  Runner r;
  r.run = [=, &cs, &w, &cfg] {
    td::golden::output_projection(cfg, out->view(), cs.o_packed.view(), w.wo_a.view(),
                                  w.wo_b.view(), w.wo_b_scale.view());
  };
  r.output = [out] { return floats(*out); };
  return r;
}

Runner make_golden_compressor(const Weights& w, Case& cs, int which) {
  const ModelConfig& cfg = w.cfg;
  const k::CompressorSpec spec = compressor_spec(cfg, which);
  const k::CompressorWeights cw = compressor_views(compressor_weights(w, which));
  const k::CompressorMetadata meta = compressor_meta(cs, which);
  StatePool& sp = state_pool(cs, which);
  Runner r;
  r.run = [=, &cs, &w, &cfg, &sp] {
    if (which != 0) {
      td::golden::compressor_step(cfg, spec, sp.rows.view(), cs.cmp_kv.view(), View<float, 2>(),
                                  cs.x_n.view(), cw, meta, w.rope_csa.view());
    } else {
      td::golden::indexer_compressor_step(cfg, sp.rows.view(), cs.idx_kv.view(), cs.idx_sc.view(),
                                          View<float, 2>(), cs.x_n.view(), cw, w.hadamard.view(),
                                          meta, w.rope_csa.view());
    }
  };
  r.output = [&cs, which] { return emitted_rows(cs, which); };
  return r;
}

TdRunner make_td_layer(const LayerModel& m, LayerCase& lc, const td::cpu::Context* ctx,
                       int max_threads) {
  const ModelConfig& cfg = m.cfg;
  const index_t T = lc.shape.tokens();
  auto ws =
      std::make_shared<td::decode::Workspace>(cfg, lc.batch, lc.seq, std::size_t(max_threads));
  auto out = std::make_shared<Tensor<float, 3>>(std::array<index_t, 3>{T, 4, cfg.hidden});
  auto weights = std::make_shared<td::decode::LayerWeights>(m.w.view());
  auto caches = std::make_shared<td::decode::LayerCaches>(lc.caches.view());
  TdRunner r;
  r.impl = "kernel";
  r.run = [=, &lc, &m, &cfg] {
    const td::decode::Backend be{td::decode::BackendKind::cpu, *ctx};
    td::decode::csa_step(be, out->view(), lc.x_hc.view(), *weights, *caches, lc.md, m.rope.view(),
                         *ws, cfg);
  };
  r.output = [out] { return std::vector<float>(out->data(), out->data() + out->size()); };
  return r;
}

Runner make_golden_layer(const LayerModel& m, LayerCase& lc) {
  const ModelConfig& cfg = m.cfg;
  const index_t T = lc.shape.tokens();
  auto out = std::make_shared<Tensor<float, 3>>(std::array<index_t, 3>{T, 4, cfg.hidden});
  auto weights = std::make_shared<td::decode::LayerWeights>(m.w.view());
  auto caches = std::make_shared<td::decode::LayerCaches>(lc.caches.view());
  Runner r;
  r.run = [=, &lc, &m, &cfg] {
    td::golden::decode_layer(out->view(), lc.x_hc.view(), *weights, *caches, lc.starts, lc.shape,
                             lc.fx.tables(), m.rope.view(), cfg);
  };
  r.output = [out] { return std::vector<float>(out->data(), out->data() + out->size()); };
  return r;
}

}  // namespace tdpeer
