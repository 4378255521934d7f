#pragma once
// Golden reference of the sparse attention core (spec §8.1–§8.4), written from the spec formulas
// with plain loops and double accumulation. It is the oracle of tests/test_sparse_attn.cpp.
//
// Column list of token t (b = t / S, p = positions[t]), NC = cfg.attn_cols(kind) columns in
// blocks of 128 (spec §8.1):
//   window column k < 128:  valid iff k < window_lens[t] and window_idx[t,k] >= 0;
//                           row = kv_cache[window_idx[t,k]]
//   CSA column 128 + i:     raw = topk_idxs[t,i] (i < cfg.idx_topk); valid iff 0 <= raw < (p+1)/4
//                           and the page cmp_block_table[b, raw/P] is mapped (>= 0)
//   HCA column 128 + i:     valid iff i < n_t = min(cap, (p+1)/128, kv_seq_lens[b]/128) and the
//                           page of row i is mapped; cap = cfg.hca_capacity() = max_seq_len/128
//                           (addendum §5.1: sized by the cache, never by index_topk; 8192 at 1M)
//   compressed row c:       cmp_kv[cmp_block_table[b, c/P]*P + c%P], P = cmp_page (128; prefix
//                           caching: 1 HCA, 32 CSA)
// Per head and block (§8.2): s = scale*(q·K) (invalid → MASK_NEG), m = max s, e = exp(s-m)
// (0 for invalid), l = Σe, o = Σ bf16(e)·K; merge (§8.3), den = l + exp(sink - m), out = o/den
// (0 if the token has no valid column); o_packed[g*T+t, hh*512 ...] = [bf16(out[:448]),
// bf16(rope_inverse(out[448:], p))] (§8.4).

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::golden {

// Same argument order as kernels::sparse_attention (minus the context and workspace). cmp_page:
// compressed rows per table column (0 = cfg.page; 1 HCA / 32 CSA in the prefix-caching layout).
// Out-of-range window indices (>= kv_cache rows) and table entries (>= pool blocks) throw.
inline void sparse_attention(
    const ModelConfig& cfg, LayerKind kind, View<bf16, 2> o_packed, ConstView<bf16, 3> q,
    ConstView<bf16, 2> kv_cache, ConstView<bf16, 2> cmp_kv, ConstView<std::int32_t, 2> window_idx,
    ConstView<std::int32_t, 1> window_lens, ConstView<std::int32_t, 2> topk_idxs,
    ConstView<std::int32_t, 2> cmp_block_table, ConstView<std::int32_t, 1> positions,
    ConstView<std::int32_t, 1> kv_seq_lens, int seq, ConstView<float, 1> attn_sink,
    const RopeTableView& rope, index_t cmp_page = 0) {
  constexpr std::string_view where = "golden::sparse_attention";
  const index_t T = q.extent(0), H = cfg.n_heads, D = cfg.head_dim;
  const index_t page = cmp_page > 0 ? cmp_page : index_t(cfg.page);
  check_equal(where, "q.extent(1)", q.extent(1), H);
  check_equal(where, "q.extent(2)", q.extent(2), D);
  check_range(where, "seq", seq, 1, 1 << 10);
  if (T % seq != 0) throw_arg(where, "q.extent(0)", T, "a multiple of seq");
  check_equal(where, "o_packed.extent(0)", o_packed.extent(0), index_t(cfg.o_groups) * T);
  check_equal(where, "o_packed.extent(1)", o_packed.extent(1), index_t(cfg.o_group_in()));
  check_equal(where, "kv_cache.extent(1)", kv_cache.extent(1), D);
  check_equal(where, "kv_cache.stride(1)", kv_cache.stride(1),
              index_t(1));  // rows read via pointer
  if (kind != LayerKind::swa) {
    check_equal(where, "cmp_kv.extent(1)", cmp_kv.extent(1), D);
    check_equal(where, "cmp_kv.stride(1)", cmp_kv.stride(1), index_t(1));
  }
  const index_t ncols = cfg.attn_cols(kind), win = cfg.window, blk = cfg.attn_k_tile;
  const index_t cmp_blocks = cmp_kv.extent(0) / page;
  const float scale = cfg.softmax_scale();

  for (index_t t = 0; t < T; ++t) {
    const index_t b = t / seq, p = positions.at(t);
    // Column rows (nullptr = invalid).
    std::vector<const bf16*> rows(static_cast<std::size_t>(ncols), nullptr);
    for (index_t k = 0; k < win; ++k) {
      const index_t idx = window_idx.at(t, k);
      if (idx >= kv_cache.extent(0)) throw_arg(where, "window_idx", idx, "-1 or < kv_cache rows");
      if (k < window_lens.at(t) && idx >= 0) rows[k] = &kv_cache.at(idx, 0);
    }
    auto cmp_row = [&](index_t c) -> const bf16* {
      const index_t col = c / page;
      if (col >= cmp_block_table.extent(1)) return nullptr;
      const index_t e = cmp_block_table.at(b, col);
      if (e >= cmp_blocks) throw_arg(where, "cmp_block_table", e, "< cmp pool blocks");
      if (e < 0) return nullptr;
      return &cmp_kv.at(e * page + c % page, 0);
    };
    if (kind == LayerKind::csa) {
      for (index_t i = 0; i < cfg.idx_topk; ++i) {
        const index_t raw = topk_idxs.at(t, i);
        if (raw >= 0 && raw < (p + 1) / 4) rows[win + i] = cmp_row(raw);
      }
    } else if (kind == LayerKind::hca) {
      const index_t n =
          std::min<index_t>({cfg.hca_capacity(), (p + 1) / 128, index_t(kv_seq_lens.at(b)) / 128});
      for (index_t i = 0; i < n; ++i) rows[win + i] = cmp_row(i);
    }
    bool any = false;
    for (auto* r : rows) any = any || r != nullptr;

    for (index_t h = 0; h < H; ++h) {
      std::vector<double> out(static_cast<std::size_t>(D), 0.0);
      if (any) {
        double m = 0, l = 0;
        std::vector<double> o(static_cast<std::size_t>(D), 0.0);
        for (index_t b0 = 0; b0 < ncols; b0 += blk) {
          std::vector<double> s(static_cast<std::size_t>(blk));
          double mb = -INFINITY;
          for (index_t j = 0; j < blk; ++j) {
            const bf16* kr = rows[b0 + j];
            if (kr == nullptr) {
              s[j] = kMaskNeg;
            } else {
              double dot = 0;
              for (index_t d = 0; d < D; ++d)
                dot += double(q(t, h, d).to_float()) * kr[d].to_float();
              s[j] = double(scale) * dot;
            }
            mb = std::max(mb, s[j]);
          }
          double lb = 0;
          std::vector<double> ob(static_cast<std::size_t>(D), 0.0);
          for (index_t j = 0; j < blk; ++j) {
            const bf16* kr = rows[b0 + j];
            if (kr == nullptr) continue;
            const double e = std::exp(s[j] - mb);
            lb += e;
            const double pe = round_bf16(float(e));
            for (index_t d = 0; d < D; ++d) ob[d] += pe * kr[d].to_float();
          }
          if (b0 == 0) {
            m = mb, l = lb, o = ob;
          } else {
            const double mn = std::max(m, mb), a = std::exp(m - mn), g = std::exp(mb - mn);
            l = a * l + g * lb;
            for (index_t d = 0; d < D; ++d) o[d] = a * o[d] + g * ob[d];
            m = mn;
          }
        }
        const double den = l + std::exp(double(attn_sink.at(h)) - m);
        for (index_t d = 0; d < D; ++d) out[d] = o[d] / den;
      }
      float rope_part[64];
      const index_t nope = cfg.nope_dim();
      for (index_t d = 0; d < cfg.rope_dim; ++d) rope_part[d] = float(out[nope + d]);
      check_rope_position(where, rope, p);
      rope_inverse(std::span<float>(rope_part, 64), rope.cos_row(p), rope.sin_row(p));
      const index_t g = h / cfg.heads_per_group(), hh = h % cfg.heads_per_group();
      for (index_t d = 0; d < nope; ++d) o_packed.at(g * T + t, hh * D + d) = bf16(float(out[d]));
      for (index_t d = 0; d < cfg.rope_dim; ++d)
        o_packed.at(g * T + t, hh * D + nope + d) = bf16(rope_part[d]);
    }
  }
}

}  // namespace tiledecode::golden
