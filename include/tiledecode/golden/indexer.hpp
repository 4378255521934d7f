#pragma once
// Golden lightning indexer (spec §7): plain loops written from the spec formulas, exact INT32
// dots, double accumulation, checked element access. No SIMD, no blocking, no tricks; the
// argument order mirrors tiledecode::kernels (minus the CPU context; raw weights instead of the
// packed struct).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/golden/rope.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::golden {

// Visible compressed rows of a token (spec §7.2): min(kv_len // 4, (pos + 1) // 4, score_len).
inline int indexer_visible_rows(const ModelConfig& cfg, int pos, int kv_len) {
  return std::min({kv_len / 4, (pos + 1) / 4, cfg.score_len()});
}

// Query path (spec §7.1), per token t and head h:
//   qi      = (qr[t] @ idx_wq_b)_int32 * qr_scale[t] * idx_wq_b_scale      (double)
//   qi_rope = bf16(rope_forward(qi[64:128], rope_pos[t]))                 (interleaved, double;
//             every qi is rounded to BF16 via FP32)
//   qh      = bf16([qi[0:64], qi_rope]) @ hadamard                         (FP32)
//   q_i8[t,h], q_sc[t,h] = Q8(qh)
// Shapes: q_i8 (T, 64, 128) INT8, q_sc (T, 64), qr (T, Q_LORA) INT8, qr_scale (T),
// idx_wq_b (Q_LORA, 64*128) INT8, idx_wq_b_scale (64*128), rope_pos (T), hadamard (128, 128).
inline void indexer_query(const ModelConfig& cfg, View<std::int8_t, 3> q_i8, View<float, 2> q_sc,
                          ConstView<std::int8_t, 2> qr, ConstView<float, 1> qr_scale,
                          ConstView<std::int8_t, 2> idx_wq_b, ConstView<float, 1> idx_wq_b_scale,
                          ConstView<std::int32_t, 1> rope_pos, const RopeTableView& rope,
                          ConstView<bf16, 2> hadamard) {
  const index_t T = qr.extent(0), H = cfg.idx_n_heads, DI = cfg.idx_head_dim;
  const index_t nope = DI - cfg.rope_dim;
  std::vector<double> qi(static_cast<std::size_t>(DI));
  std::vector<float> qh(static_cast<std::size_t>(DI));
  std::vector<std::int8_t> q(static_cast<std::size_t>(DI));
  std::vector<std::int64_t> acc(static_cast<std::size_t>(H * DI));
  for (index_t t = 0; t < T; ++t) {
    const index_t pos = rope_pos.at(t);
    // Exact INT32 products of the q-latent with every column (k outer: row-major weight walk).
    std::fill(acc.begin(), acc.end(), 0);
    for (index_t k = 0; k < cfg.q_lora; ++k)
      for (index_t col = 0; col < H * DI; ++col)
        acc[std::size_t(col)] += std::int64_t(qr.at(t, k)) * idx_wq_b.at(k, col);
    for (index_t h = 0; h < H; ++h) {
      for (index_t d = 0; d < DI; ++d) {
        const index_t col = h * DI + d;
        qi[d] =
            double(acc[std::size_t(col)]) * double(qr_scale.at(t)) * double(idx_wq_b_scale.at(col));
      }
      rope_forward(std::span<double>(qi).subspan(std::size_t(nope)), rope.cos_row(pos),
                   rope.sin_row(pos));
      for (auto& v : qi) v = round_bf16(float(v));
      for (index_t j = 0; j < DI; ++j) {
        double acc = 0;
        for (index_t i = 0; i < DI; ++i) acc += qi[i] * double(hadamard.at(i, j).to_float());
        qh[j] = float(acc);
      }
      q_sc.at(t, h) = quantize_q8(q, qh);
      for (index_t d = 0; d < DI; ++d) q_i8.at(t, h, d) = q[d];
    }
  }
}

// Head weights: w[t,h] = (x_n[t] @ weights_proj)[h] * index_weights_scale (1/sqrt(8192)).
// w (T, 64) FP32, x_n (T, D) BF16, weights_proj (D, 64) BF16.
inline void indexer_weights(const ModelConfig& cfg, View<float, 2> w, ConstView<bf16, 2> x_n,
                            ConstView<bf16, 2> weights_proj) {
  for (index_t t = 0; t < x_n.extent(0); ++t)
    for (index_t h = 0; h < cfg.idx_n_heads; ++h) {
      double acc = 0;
      for (index_t d = 0; d < cfg.hidden; ++d)
        acc += double(x_n.at(t, d).to_float()) * double(weights_proj.at(d, h).to_float());
      w.at(t, h) = float(acc) * cfg.index_weights_scale();
    }
}

// Fused score (spec §7.2) for token t of request b = t / seq:
//   vis = min(kv_seq_lens[b] // 4, (positions[t] + 1) // 4, 4096)
//   score[t, j] = k_sc[j] * Σ_h w[t,h] * relu(q_sc[t,h] * (q_i8[t,h] · k_i8[j]))   for j < vis
//   score[t, j] = kNegBig                                                           for j >= vis
// with row(b, j) = idx_block_table[b, j / P] * P + j % P into idx_kv_cache (rows, 128) INT8 and
// idx_kv_scale (rows) FP32, P = page (cfg.page = 128; 32 in the prefix-caching layout, addendum
// §3). An unmapped (-1) page inside the visible range is an error.
inline void indexer_score(const ModelConfig& cfg, View<float, 2> score,
                          ConstView<std::int8_t, 3> q_i8, ConstView<float, 2> q_sc,
                          ConstView<float, 2> w, ConstView<std::int8_t, 2> idx_kv_cache,
                          ConstView<float, 1> idx_kv_scale,
                          ConstView<std::int32_t, 2> idx_block_table,
                          ConstView<std::int32_t, 1> positions,
                          ConstView<std::int32_t, 1> kv_seq_lens, int seq, index_t page = 0) {
  const index_t T = positions.extent(0), H = cfg.idx_n_heads, DI = cfg.idx_head_dim;
  const index_t P = page > 0 ? page : index_t(cfg.page);  // index rows per table column
  check_equal<index_t>("golden::indexer_score", "idx_kv_cache.extent(1)", idx_kv_cache.extent(1),
                       DI);
  check_equal<index_t>("golden::indexer_score", "q_i8.extent(2)", q_i8.extent(2), DI);
  for (index_t t = 0; t < T; ++t) {
    const index_t b = t / seq;
    const int vis = indexer_visible_rows(cfg, positions.at(t), kv_seq_lens.at(b));
    for (index_t j = 0; j < score.extent(1); ++j) {
      if (j >= vis) {
        score.at(t, j) = kNegBig;
        continue;
      }
      const index_t blk = idx_block_table.at(b, j / P);
      if (blk < 0) throw Error("golden::indexer_score: unmapped page inside the visible range");
      const index_t row = blk * P + j % P;
      // The key row and each head's query row are read through checked element 0 and then as
      // plain arrays (their extents are checked once: 128 columns, unit inner stride), which keeps
      // the 1M-context oracle (262,144 keys x 64 heads per token) to seconds.
      const std::int8_t* k = &idx_kv_cache.at(row, 0);
      double acc = 0;
      for (index_t h = 0; h < H; ++h) {
        const std::int8_t* qh = &q_i8.at(t, h, 0);
        std::int64_t dot = 0;
        for (index_t d = 0; d < DI; ++d)
          dot += std::int64_t(qh[d * q_i8.stride(2)]) * k[d * idx_kv_cache.stride(1)];
        acc += double(w.at(t, h)) * std::max(0.0, double(q_sc.at(t, h)) * double(dot));
      }
      score.at(t, j) = float(double(idx_kv_scale.at(row)) * acc);
    }
  }
}

// Top-k of one row by full sort (spec §7.3 with the deterministic rule): descending score,
// ascending column on ties, NaN never selected; min(k, non-NaN count) winners + offset, rest -1.
inline void topk_row(std::span<std::int32_t> dst, std::span<const float> score, int k,
                     std::int32_t offset) {
  std::vector<std::int32_t> cols;
  for (std::size_t j = 0; j < score.size(); ++j)
    if (!std::isnan(score[j])) cols.push_back(std::int32_t(j));
  std::sort(cols.begin(), cols.end(), [&](std::int32_t a, std::int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  for (std::size_t i = 0; i < dst.size(); ++i)
    dst[i] = (i < cols.size() && i < std::size_t(k)) ? cols[i] + offset : -1;
}

// Indexer top-k: row t considers its visible columns [0, vis_t) (vis as in indexer_score).
// topk_idxs (T, W) INT32 with W >= topk; every slot written.
inline void indexer_topk(const ModelConfig& cfg, View<std::int32_t, 2> topk_idxs,
                         ConstView<float, 2> score, ConstView<std::int32_t, 1> positions,
                         ConstView<std::int32_t, 1> kv_seq_lens, int seq, int topk,
                         std::int32_t offset) {
  for (index_t t = 0; t < positions.extent(0); ++t) {
    const int vis = std::min<int>(
        indexer_visible_rows(cfg, positions.at(t), kv_seq_lens.at(t / seq)), int(score.extent(1)));
    std::vector<float> row(static_cast<std::size_t>(vis));
    for (int j = 0; j < vis; ++j) row[std::size_t(j)] = score.at(t, j);
    std::vector<std::int32_t> out(static_cast<std::size_t>(topk_idxs.extent(1)));
    topk_row(out, row, topk, offset);
    for (index_t i = 0; i < topk_idxs.extent(1); ++i) topk_idxs.at(t, i) = out[std::size_t(i)];
  }
}

}  // namespace tiledecode::golden
