#pragma once
// Inputs shared by TileDecode, the golden references and the ATen peer in `peer_compare`:
// one CSA layer's weights (built once) and one decode step's tensors for a (batch, context)
// point (built per point). Plain tiledecode tensors in the spec's layouts (§2, §3.7); no Torch
// here, so the TileDecode side compiles without it.
//
// Geometry of a point: B requests, S = 2 tokens each, request b starts at
// start_b = context - 2 - (b % 4), so every request sees about `context` keys and the four
// residues give a mix of steps with and without a ratio-4 / ratio-128 window boundary.
// Pools are sized per point so that no request's live rows alias (rings for the window and
// the compressor states, full capacity for the compressed and index caches).

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdpeer {

// One implementation of one kernel bound to one case: `run` is a decode step of the kernel,
// `output` its primary output (after a run) as floats, for the agreement check.
struct Runner {
  std::function<void()> run;
  std::function<std::vector<float>()> output;
  explicit operator bool() const { return bool(run); }
};

using tiledecode::bf16;
using tiledecode::index_t;
using tiledecode::ModelConfig;
using tiledecode::Tensor;

// One compressor's weights (spec §6): projections stored [OUT_DIM, D] (used as x @ W^T).
struct CompressorWeights {
  int ratio = 4;
  int head_dim = 512;          // pooled row width (512 main, 128 inner)
  int out_dim = 1024;          // 2*head_dim for overlapping ratio 4, head_dim for ratio 128
  Tensor<bf16, 2> wkv, wgate;  // (out_dim, D)
  Tensor<float, 2> ape;        // (ratio, out_dim)
  Tensor<bf16, 1> norm_w;      // (head_dim)
};

// One CSA layer's weights.
struct Weights {
  ModelConfig cfg;
  CompressorWeights c4, c128, inner;  // CSA main, HCA, indexer inner
  Tensor<bf16, 2> hadamard;           // (128, 128) Sylvester / sqrt(128)
  Tensor<bf16, 3> wo_a;               // (O_GROUPS, O_LORA, O_GROUP_IN)
  Tensor<std::int8_t, 2> wo_b;        // (D, O_GROUPS*O_LORA)
  Tensor<float, 1> wo_b_scale;        // (D)
  Tensor<float, 1> sink;              // (H)
  tiledecode::RopeTable rope_csa;     // base 160000 + YaRN (CSA/HCA layers)
  tiledecode::RopeTable rope_swa;     // base 10000 (SWA layers)
};

// A compressor's state pool and its metadata for one point.
struct StatePool {
  int page = 4;                   // rows per state page (4 ratio-4, 8 ratio-128)
  index_t blocks = 0;             // physical pages
  Tensor<float, 2> rows;          // (blocks*page, 2*out_dim)  [kv | score]
  Tensor<std::int32_t, 2> table;  // (B, max_seq_len/page)
  Tensor<std::int64_t, 1> slots;  // (T) state slot of every token
};

struct Case {
  int batch = 4, seq = 2, context = 8192;
  int tokens() const { return batch * seq; }
  std::vector<std::int32_t> start;
  Tensor<std::int32_t, 1> positions;    // (T)
  Tensor<std::int32_t, 1> kv_seq_lens;  // (B)

  // --- indexer (spec §7.2): quantised queries, head weights, INT8 index cache
  Tensor<std::int8_t, 2> q_i8;  // (T*64, 128), row t*64 + h
  Tensor<float, 1> q_sc;        // (T*64)
  Tensor<float, 2> w;           // (T, 64)
  index_t idx_blocks = 0;
  Tensor<std::int8_t, 2> idx_kv;      // (idx_blocks*128, 128)
  Tensor<float, 1> idx_sc;            // (idx_blocks*128)
  Tensor<std::int32_t, 2> idx_table;  // (B, 2 * score_len / 128): 64 at 16k
  Tensor<std::int64_t, 1> idx_slots;  // (T) index-cache slot of a ratio-4 boundary token

  // --- sparse attention (spec §8.1)
  Tensor<bf16, 3> q;  // (T, H, 512)
  index_t ori_blocks = 0;
  Tensor<bf16, 2> ori_kv;             // (ori_blocks*128, 512)
  Tensor<std::int32_t, 2> ori_table;  // (B, max_seq_len / 128)
  Tensor<std::int32_t, 2> win_idx;    // (T, 128) physical ori rows, -1 invalid
  Tensor<std::int32_t, 1> win_lens;   // (T)
  index_t cmp_blocks = 0;
  Tensor<bf16, 2> cmp_kv;                  // (cmp_blocks*128, 512)
  Tensor<std::int32_t, 2> cmp_table;       // (B, score_len / 128)
  Tensor<std::int32_t, 2> topk;            // (T, idx_topk) raw compressed rows (indexer output)
  Tensor<std::int64_t, 1> c4_cmp_slots;    // (T) CSA compressed-cache slot (ratio 4)
  Tensor<std::int64_t, 1> c128_cmp_slots;  // (T) HCA compressed-cache slot (ratio 128)

  // --- output projection input (spec §8.4 packed layout)
  Tensor<bf16, 2> o_packed;  // (O_GROUPS*T, O_GROUP_IN)

  // --- compressors (spec §6)
  Tensor<bf16, 2> x_n;  // (T, D) normed hidden state
  StatePool s4, s128, sinner;
};

namespace detail {
inline void fill_bf16(tdtest::Rng& r, std::span<bf16> v, float lo, float hi) {
  for (auto& x : v) x = bf16(r.uniform(lo, hi));
}
inline void fill_state(tdtest::Rng& r, std::span<float> v) {
  // Spec §10.3: history rows 0.05*randn for kv and score; uniform of the same spread is as
  // good for timing and much cheaper to draw for the large pools.
  for (auto& x : v) x = r.uniform(-0.0866f, 0.0866f);
}
inline CompressorWeights make_compressor(tdtest::Rng& r, const ModelConfig& cfg, int ratio,
                                         int head_dim, float wkv_sd, float wgate_sd, float ape_sd) {
  CompressorWeights c;
  c.ratio = ratio;
  c.head_dim = head_dim;
  c.out_dim = ratio == 4 ? 2 * head_dim : head_dim;
  c.wkv = Tensor<bf16, 2>({c.out_dim, cfg.hidden});
  c.wgate = Tensor<bf16, 2>({c.out_dim, cfg.hidden});
  c.ape = Tensor<float, 2>({ratio, c.out_dim});
  c.norm_w = Tensor<bf16, 1>({head_dim});
  const float k = 1.7320508f;  // uniform(-k sd, k sd) has standard deviation sd
  fill_bf16(r, c.wkv.flat(), -k * wkv_sd, k * wkv_sd);
  fill_bf16(r, c.wgate.flat(), -k * wgate_sd, k * wgate_sd);
  r.fill_uniform(c.ape.flat(), -k * ape_sd, k * ape_sd);
  fill_bf16(r, c.norm_w.flat(), 0.6f, 1.3f);
  return c;
}
inline StatePool make_state_pool(tdtest::Rng& r, const ModelConfig& cfg, const Case& cs, int page,
                                 int ring_pages, int out_dim) {
  StatePool p;
  p.page = page;
  p.blocks = index_t(ring_pages) * cs.batch;
  p.rows = Tensor<float, 2>({p.blocks * page, 2 * out_dim});
  fill_state(r, p.rows.flat());
  p.table = Tensor<std::int32_t, 2>({cs.batch, cfg.max_seq_len / page});
  tiledecode::paged::build_fixture_block_table(p.table.view(), p.blocks);
  p.slots = Tensor<std::int64_t, 1>({cs.tokens()});
  const tiledecode::paged::StepShape sh{cs.batch, cs.seq, -1};
  tiledecode::paged::build_state_slot_mapping(p.slots.view(), cs.positions.view(), p.table.view(),
                                              p.blocks, page, sh, cfg);
  return p;
}
}  // namespace detail

inline Weights make_weights(const ModelConfig& cfg, std::uint64_t seed = 1) {
  tdtest::Rng r(seed);
  Weights w;
  w.cfg = cfg;
  // Standard deviations from spec §10.3 (checkpoint statistics).
  w.c4 = detail::make_compressor(r, cfg, 4, cfg.head_dim, 0.0245f, 0.0388f, 0.1243f);
  w.c128 = detail::make_compressor(r, cfg, 128, cfg.head_dim, 0.0245f, 0.0388f, 0.1243f);
  w.inner = detail::make_compressor(r, cfg, 4, cfg.idx_head_dim, 0.0293f, 0.0512f, 0.1528f);
  w.hadamard = Tensor<bf16, 2>({cfg.idx_head_dim, cfg.idx_head_dim});
  tiledecode::build_hadamard(w.hadamard.view(), 1.0f / std::sqrt(float(cfg.idx_head_dim)));
  const index_t o_in = cfg.o_group_in();
  w.wo_a = Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, o_in});
  detail::fill_bf16(r, w.wo_a.flat(), -0.03f, 0.03f);
  w.wo_b = Tensor<std::int8_t, 2>({cfg.hidden, index_t(cfg.o_groups) * cfg.o_lora});
  r.fill_int8(w.wo_b.flat());
  w.wo_b_scale = Tensor<float, 1>({cfg.hidden});
  r.fill_uniform(w.wo_b_scale.flat(), 1e-4f, 3e-4f);
  w.sink = Tensor<float, 1>({cfg.n_heads});
  std::fill(w.sink.flat().begin(), w.sink.flat().end(), 4.0f);  // CSA fixture sink (§10.3)
  w.rope_csa = tiledecode::make_rope_table(cfg, tiledecode::LayerKind::csa, cfg.max_seq_len);
  w.rope_swa = tiledecode::make_rope_table(cfg, tiledecode::LayerKind::swa, cfg.max_seq_len);
  return w;
}

// Builds one (batch, seq, context) point: B requests of S tokens (2: MTP; 8: the reference's
// speculative serving tree); `context` in [S + 4, max_seq_len].
inline Case make_case(const ModelConfig& cfg, int batch, int context, int seq = 2,
                      std::uint64_t seed = 7) {
  namespace pg = tiledecode::paged;
  // S = 2 keeps the seeds (and inputs) of the points measured before S was a parameter.
  tdtest::Rng r(seed + std::uint64_t(batch) * 131 + std::uint64_t(context) +
                (seq == 2 ? 0 : std::uint64_t(seq) * 1000003));
  Case cs;
  cs.batch = batch;
  cs.seq = seq;
  cs.context = context;
  const int T = cs.tokens();
  const pg::StepShape sh{batch, cs.seq, -1};
  for (int b = 0; b < batch; ++b) cs.start.push_back(context - cs.seq - (b % 4));
  cs.positions = Tensor<std::int32_t, 1>({T});
  cs.kv_seq_lens = Tensor<std::int32_t, 1>({batch});
  pg::build_position_ids(cs.positions.view(), cs.start, sh, cfg);
  pg::build_kv_seq_lens(cs.kv_seq_lens.view(), cs.start, sh, cfg);

  const int H = cfg.n_heads, HD = cfg.head_dim, IH = cfg.idx_n_heads, ID = cfg.idx_head_dim;
  const index_t page = cfg.page;
  // Rows a request can reach: ratio-4 rows up to context/4 (at most score_len).
  const index_t c4_rows = std::min<index_t>(context / 4 + 1, cfg.score_len());
  const index_t c4_pages = (c4_rows + page - 1) / page;

  // Indexer.
  cs.q_i8 = Tensor<std::int8_t, 2>({index_t(T) * IH, ID});
  r.fill_int8(cs.q_i8.flat());
  cs.q_sc = Tensor<float, 1>({index_t(T) * IH});
  r.fill_uniform(cs.q_sc.flat(), 0.002f, 0.02f);
  cs.w = Tensor<float, 2>({T, IH});
  r.fill_uniform(cs.w.flat(), -0.02f, 0.02f);
  cs.idx_blocks = c4_pages * batch;
  cs.idx_kv = Tensor<std::int8_t, 2>({cs.idx_blocks * page, ID});
  r.fill_int8(cs.idx_kv.flat());
  cs.idx_sc = Tensor<float, 1>({cs.idx_blocks * page});
  r.fill_uniform(cs.idx_sc.flat(), 0.005f, 0.02f);
  // IDX_CACHE_MAX_BLOCKS: twice the ratio-4 capacity (64 columns at 16k; only the first half is
  // reached), as paged::FixtureTables.
  cs.idx_table = Tensor<std::int32_t, 2>({batch, 2 * ((cfg.score_len() + page - 1) / page)});
  pg::build_fixture_block_table(cs.idx_table.view(), cs.idx_blocks);
  cs.idx_slots = Tensor<std::int64_t, 1>({T});
  pg::build_compressed_slot_mapping(cs.idx_slots.view(), cs.positions.view(), cs.idx_table.view(),
                                    cs.idx_blocks, 4, sh, cfg);

  // Attention: queries, a 4-page ring per request for the window, full compressed capacity.
  cs.q = Tensor<bf16, 3>({T, H, HD});
  detail::fill_bf16(r, cs.q.flat(), -0.5f, 0.5f);
  cs.ori_blocks = 4 * index_t(batch);
  cs.ori_kv = Tensor<bf16, 2>({cs.ori_blocks * page, HD});
  detail::fill_bf16(r, cs.ori_kv.flat(), -0.5f, 0.5f);
  cs.ori_table = Tensor<std::int32_t, 2>({batch, cfg.ori_table_cols()});
  pg::build_fixture_block_table(cs.ori_table.view(), cs.ori_blocks);
  cs.win_idx = Tensor<std::int32_t, 2>({T, cfg.window});
  cs.win_lens = Tensor<std::int32_t, 1>({T});
  pg::build_window_indices(cs.win_idx.view(), cs.win_lens.view(), cs.positions.view(),
                           cs.ori_table.view(), cs.ori_blocks, sh, cfg);
  cs.cmp_blocks = c4_pages * batch;
  cs.cmp_kv = Tensor<bf16, 2>({cs.cmp_blocks * page, HD});
  detail::fill_bf16(r, cs.cmp_kv.flat(), -0.5f, 0.5f);
  cs.cmp_table = Tensor<std::int32_t, 2>({batch, cfg.score_len() / page});
  pg::build_fixture_block_table(cs.cmp_table.view(), cs.cmp_blocks);
  cs.c4_cmp_slots = Tensor<std::int64_t, 1>({T});
  pg::build_compressed_slot_mapping(cs.c4_cmp_slots.view(), cs.positions.view(),
                                    cs.cmp_table.view(), cs.cmp_blocks, 4, sh, cfg);
  cs.c128_cmp_slots = Tensor<std::int64_t, 1>({T});
  pg::build_compressed_slot_mapping(cs.c128_cmp_slots.view(), cs.positions.view(),
                                    cs.cmp_table.view(), cs.cmp_blocks, 128, sh, cfg);
  // Top-k list as the indexer leaves it: distinct visible rows in random order, -1 past vis.
  cs.topk = Tensor<std::int32_t, 2>({T, cfg.idx_topk});
  std::vector<std::int32_t> perm;
  for (int t = 0; t < T; ++t) {
    const int b = t / cs.seq;
    const int vis =
        std::min({cs.kv_seq_lens.data()[b] / 4, (cs.positions.data()[t] + 1) / 4, cfg.score_len()});
    perm.resize(vis);
    std::iota(perm.begin(), perm.end(), 0);
    const int k = std::min(vis, cfg.idx_topk);
    for (int i = 0; i < k; ++i) std::swap(perm[i], perm[i + r.integer(0, vis - 1 - i)]);
    for (int i = 0; i < cfg.idx_topk; ++i)
      cs.topk.data()[t * cfg.idx_topk + i] = i < k ? perm[i] : -1;
  }

  // Output projection input.
  cs.o_packed = Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
  detail::fill_bf16(r, cs.o_packed.flat(), -1.0f, 1.0f);

  // Compressors: normed hidden state and state pools (rings covering each window).
  cs.x_n = Tensor<bf16, 2>({T, cfg.hidden});
  detail::fill_bf16(r, cs.x_n.flat(), -1.7f, 1.7f);
  cs.s4 = detail::make_state_pool(r, cfg, cs, cfg.c4_state_page, 4, 2 * HD);
  cs.s128 = detail::make_state_pool(r, cfg, cs, cfg.c128_state_page, 17, HD);
  cs.sinner = detail::make_state_pool(r, cfg, cs, cfg.c4_state_page, 4, 2 * ID);
  return cs;
}

}  // namespace tdpeer
