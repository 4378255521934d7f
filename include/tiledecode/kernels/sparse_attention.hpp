#pragma once
// Sparse attention core of one decode step (spec §8.1–§8.4) for SWA, CSA and HCA layers:
// window + compressed key/value set per token, attention sink, block-wise online softmax merge,
// inverse RoPE, and the packed BF16 head rows that feed the output projection.
//
// Algorithm (flash-decoding over 128-column blocks). The 64 (pro: 128) query heads share every
// KV row (MQA, V = K), so one block of one token is a small GEMM pair for a tile of heads:
//   S = Q·Kᵀ (heads × 512 · 512 × ≤128), P = bf16(exp(S − rowmax)), O_β = P·K
// Work item = (token, tile of kHeadsPerItem = 64 heads). The item's queries are widened and
// transposed once (512 × heads), so heads are the vector lanes of both GEMMs and each is a
// broadcast-FMA register tile of 6 × 16 floats (backend/cpu/sparse_attention_avx2.hpp). Per item
// and block the valid rows are gathered (invalid columns are never read: their e is exactly 0 in
// the spec, so dropping them is exact), converted BF16 → FP32 once into the item's workspace and
// reused by every head; the next block's rows are prefetched meanwhile. Block statistics merge
// online (§8.3) into an FP32 O accumulator per head, so no score matrix larger than one block
// (128 × heads) exists. Blocks keep the spec's partition (columns
// 128β..128β+127 of the concatenated list) so the per-block maxima, and hence the BF16 rounding
// of the probabilities, match the reference. An all-invalid block is skipped (its weight in the
// merge is exactly 0 in the spec).
//
// Determinism: an item's result depends only on its inputs (and every head's arithmetic is the
// same whatever tile it sits in); items are distributed to workspace slots round-robin, so
// outputs are bit-identical for any thread count and any slot count.
// Parallelism: T·ceil(H/64) items (B=4, S=2: 8 flash, 16 pro) over min(items, slots) tasks.
//
// Decisions where the spec leaves room (documented and tested):
//  * Window column k of token t is valid iff k < window_lens[t] and window_idx[t,k] >= 0, for
//    every family (the spec names the lens rule for SWA; metadata built by paged/metadata.hpp
//    already has -1 past lens, so this only matters for hand-made lists).
//  * window_idx entries must be -1 or in [0, kv_cache rows); other values are an error.
//  * CSA top-k: only the first cfg.idx_topk columns of topk_idxs are read; raw ids outside
//    [0, (pos+1)/4) are masked (spec §8.1), not an error. HCA uses n_t = min(128, (pos+1)/128,
//    kv_seq_lens[b]/128) (spec §8.1, quirk 6).
//  * cmp_block_table entries < 0 are unmapped pages: their compressed columns are invalid;
//    entries >= cmp pool blocks are an error. Logical pages past the table width are unmapped.
//  * attn_sink must be finite (a NaN/Inf sink is rejected). NaN in q or the caches is not
//    scanned for; it propagates into that token's output.
//  * A token with no valid column outputs exact zeros (spec §8.3).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/sparse_attention_avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::kernels {

namespace sparse_attention_detail {

inline constexpr int kHeadsPerItem = 64;  // heads sharing one FP32 copy of a KV block
inline constexpr int kBlock = 128;        // ATTN_K_TILE (validated against cfg)
inline constexpr int kMaxDim = 512;       // head_dim (validated against cfg)

constexpr std::size_t round16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// Per-slot workspace layout, in floats; every part starts on a 64-byte boundary.
struct SlotLayout {
  int ldk, lds, dim, heads;
  std::size_t kf, qf, s, o, stats, total;  // offsets (floats) and total size
  explicit SlotLayout(int head_dim)
      : ldk(head_dim + 16), lds(kHeadsPerItem), dim(head_dim), heads(kHeadsPerItem) {
    kf = 0;
    qf = kf + round16(std::size_t(kBlock) * ldk);
    s = qf + round16(std::size_t(heads) * dim);
    o = s + round16(std::size_t(kBlock) * lds);
    stats = o + round16(std::size_t(heads) * dim);
    total = stats + round16(std::size_t(6) * heads);
  }
  std::size_t bytes() const { return total * sizeof(float); }
};

// Plain C++ block primitives (the always-compiled twin of backend/cpu/sparse_attention_avx2.hpp).
struct ScalarOps {
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim) {
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < dim; ++d) kf[std::int64_t(i) * ldk + d] = rows[i][d].to_float();
  }
  // st (nc, lds): st[j, h] = scale · Σ_d kf[j, d] · qt[d, h]; qt (dim, ldq) transposed queries.
  static void qk(float* st, int lds, const float* qt, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    for (int j = 0; j < nc; ++j)
      for (int h = 0; h < nh; ++h) {
        float acc = 0;
        for (int d = 0; d < dim; ++d)
          acc += qt[std::int64_t(d) * ldq + h] * kf[std::int64_t(j) * ldk + d];
        st[std::int64_t(j) * lds + h] = scale * acc;
      }
  }
  static void softmax_block(float* st, int lds, int nh, int nc, float* mb, float* lb) {
    for (int h = 0; h < nh; ++h) {
      float m = st[h];
      for (int j = 1; j < nc; ++j) m = std::max(m, st[std::int64_t(j) * lds + h]);
      float l = 0;
      for (int j = 0; j < nc; ++j) {
        float& x = st[std::int64_t(j) * lds + h];
        const float e = std::exp(x - m);
        l += e;
        x = round_bf16(e);
      }
      mb[h] = m;
      lb[h] = l;
    }
  }
  static void divide_round(bf16* dst, const float* src, float den, int n) {
    for (int d = 0; d < n; ++d) dst[d] = bf16(src[d] / den);
  }
  static void load_q_transposed(float* qt, int ldq, const bf16* const* q, int nh, int dim) {
    for (int h = 0; h < nh; ++h)
      for (int d = 0; d < dim; ++d) qt[std::int64_t(d) * ldq + h] = q[h][d].to_float();
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    float acc[kMaxDim];
    for (int h = 0; h < nh; ++h) {
      std::fill(acc, acc + dim, 0.0f);
      for (int j = 0; j < nc; ++j) {
        const float pj = p[std::int64_t(j) * ldp + h];
        const float* kr = kf + std::int64_t(j) * ldk;
        for (int d = 0; d < dim; ++d) acc[d] += pj * kr[d];
      }
      float* orow = o + std::int64_t(h) * ldo;
      for (int d = 0; d < dim; ++d)
        orow[d] = first ? gamma[h] * acc[d] : alpha[h] * orow[d] + gamma[h] * acc[d];
    }
  }
};

#if TILEDECODE_X86
struct Avx2Ops {
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim) {
    cpu::avx2::sa_load_rows(kf, ldk, rows, n, dim);
  }
  static void qk(float* s, int lds, const float* q, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    cpu::avx2::sa_qk(s, lds, q, ldq, nh, kf, ldk, nc, dim, scale);
  }
  static void softmax_block(float* s, int lds, int nh, int nc, float* mb, float* lb) {
    cpu::avx2::sa_softmax_block(s, lds, nh, nc, mb, lb);
  }
  static void divide_round(bf16* dst, const float* src, float den, int n) {
    cpu::avx2::sa_divide_round(dst, src, den, n);
  }
  static void load_q_transposed(float* qt, int ldq, const bf16* const* q, int nh, int dim) {
    cpu::avx2::sa_load_q_transposed(qt, ldq, q, nh, dim);
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    cpu::avx2::sa_pv_merge(o, ldo, p, ldp, nh, kf, ldk, nc, dim, alpha, gamma, first);
  }
};
#endif

// Validated arguments of one call.
struct Args {
  const ModelConfig* cfg;
  LayerKind kind;
  View<bf16, 2> o_packed;
  ConstView<bf16, 3> q;
  ConstView<bf16, 2> kv_cache, cmp_kv;
  ConstView<std::int32_t, 2> window_idx;
  ConstView<std::int32_t, 1> window_lens;
  ConstView<std::int32_t, 2> topk_idxs, cmp_block_table;
  ConstView<std::int32_t, 1> positions, kv_seq_lens;
  int seq;
  ConstView<float, 1> attn_sink;
  RopeTableView rope;
};

// Row of compressed entry c of request b through the compressed block table (nullptr: unmapped).
inline const bf16* compressed_row(const Args& a, index_t b, index_t c) {
  const index_t page = a.cfg->page, col = c / page;
  if (col >= a.cmp_block_table.extent(1)) return nullptr;
  const index_t blk = a.cmp_block_table(b, col);
  if (blk < 0) return nullptr;
  return a.cmp_kv.data() + (blk * page + c % page) * a.cmp_kv.stride(0);
}

// Valid rows of block `beta` of token t, compacted in column order; returns their count.
inline int gather_block_rows(const Args& a, index_t t, int beta, const bf16** rows) {
  const ModelConfig& cfg = *a.cfg;
  const index_t b = t / a.seq, p = a.positions(t);
  int n = 0;
  const index_t c0 = index_t(beta) * kBlock;
  for (index_t c = c0; c < c0 + kBlock; ++c) {
    const bf16* r = nullptr;
    if (c < cfg.window) {
      const index_t idx = a.window_idx(t, c);
      if (c < a.window_lens(t) && idx >= 0) r = a.kv_cache.data() + idx * a.kv_cache.stride(0);
    } else if (a.kind == LayerKind::csa) {
      const index_t raw = a.topk_idxs(t, c - cfg.window);
      if (raw >= 0 && raw < (p + 1) / 4) r = compressed_row(a, b, raw);
    } else if (a.kind == LayerKind::hca) {
      const index_t i = c - cfg.window;
      const index_t n_t =
          std::min<index_t>({cfg.hca_capacity(), (p + 1) / 128, index_t(a.kv_seq_lens(b)) / 128});
      if (i < n_t) r = compressed_row(a, b, i);
    }
    if (r != nullptr) rows[n++] = r;
  }
  return n;
}

// One work item: token t, heads [h0, h0 + nh). Writes the item's packed head rows.
template <class Ops>
void run_item(const Args& a, float* ws, const SlotLayout& L, index_t t, int h0, int nh) {
  const ModelConfig& cfg = *a.cfg;
  const int dim = L.dim;
  float* kf = ws + L.kf;  // (≤128 valid rows, ldk)
  float* qt = ws + L.qf;  // (dim, heads): the item's queries, transposed
  float* s = ws + L.s;    // (≤128 cols, lds = heads): scores, then BF16-rounded probabilities
  float* o = ws + L.o;    // (nh heads, dim): merged, unnormalised output
  float* m = ws + L.stats;
  float* l = m + L.heads;
  float* mb = l + L.heads;
  float* lb = mb + L.heads;
  float* alpha = lb + L.heads;
  float* gamma = alpha + L.heads;

  {
    const bf16* qrows[kHeadsPerItem];
    for (int h = 0; h < nh; ++h) qrows[h] = &a.q(t, h0 + h, 0);
    Ops::load_q_transposed(qt, L.heads, qrows, nh, dim);
  }
  const int n_blocks = cfg.attn_cols(a.kind) / kBlock;
  const bf16* row_buf[2][kBlock];
  int n_next = gather_block_rows(a, t, 0, row_buf[0]);
  bool first = true;
  for (int beta = 0; beta < n_blocks; ++beta) {
    const bf16* const* rows = row_buf[beta % 2];
    const int nv = n_next;
    if (beta + 1 < n_blocks) {
      // Gather the next block's row list now and start pulling its rows towards L2 while this
      // block computes (the rows are scattered 1 KB runs the hardware prefetcher sees late).
      const bf16** next = row_buf[(beta + 1) % 2];
      n_next = gather_block_rows(a, t, beta + 1, next);
      for (int i = 0; i < n_next; ++i)
        for (int off = 0; off < dim * 2; off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(next[i]) + off, 0, 2);
    }
    if (nv == 0) continue;  // all-invalid block: exactly zero weight in the merge
    Ops::load_rows(kf, L.ldk, rows, nv, dim);
    Ops::qk(s, L.lds, qt, L.heads, nh, kf, L.ldk, nv, dim, cfg.softmax_scale());
    Ops::softmax_block(s, L.lds, nh, nv, mb, lb);
    for (int h = 0; h < nh; ++h) {  // online merge of the block statistics (spec §8.3)
      if (first) {
        m[h] = mb[h], l[h] = lb[h], alpha[h] = 0.0f, gamma[h] = 1.0f;
      } else {
        const float mn = std::max(m[h], mb[h]);
        alpha[h] = std::exp(m[h] - mn);
        gamma[h] = std::exp(mb[h] - mn);
        l[h] = alpha[h] * l[h] + gamma[h] * lb[h];
        m[h] = mn;
      }
    }
    Ops::pv_merge(o, dim, s, L.lds, nh, kf, L.ldk, nv, dim, alpha, gamma, first);
    first = false;
  }

  // Normalise with the sink, inverse RoPE on dims 448..511 at the token's position, round to
  // BF16 and issue one 512-wide store per head row (spec §8.4).
  const index_t T = a.q.extent(0), p = a.positions(t);
  const int nope = cfg.nope_dim(), hpg = cfg.heads_per_group();
  for (int h = 0; h < nh; ++h) {
    alignas(64) bf16 packed[kMaxDim];
    float tail[64];
    const int hg = h0 + h;
    if (first) {
      std::fill(packed, packed + dim, bf16(0.0f));
    } else {
      const float den = l[h] + std::exp(a.attn_sink(hg) - m[h]);
      const float* orow = o + std::int64_t(h) * dim;
      Ops::divide_round(packed, orow, den, nope);
      for (int d = 0; d < cfg.rope_dim; ++d) tail[d] = orow[nope + d] / den;
      rope_inverse(std::span<float>(tail, cfg.rope_dim), a.rope.cos_row(p), a.rope.sin_row(p));
      for (int d = 0; d < cfg.rope_dim; ++d) packed[nope + d] = bf16(tail[d]);
    }
    const index_t g = hg / hpg, hh = hg % hpg;
    bf16* dst = &a.o_packed(g * T + t, hh * dim);
    std::memcpy(dst, packed, sizeof(bf16) * std::size_t(dim));
  }
}

inline void validate(const Args& a, std::size_t workspace_bytes, std::size_t slot_bytes) {
  constexpr std::string_view where = "sparse_attention";
  const ModelConfig& cfg = *a.cfg;
  if (a.kind != LayerKind::swa && a.kind != LayerKind::csa && a.kind != LayerKind::hca)
    throw_arg(where, "kind", int(a.kind), "swa (0), csa (4) or hca (128)");
  check_equal(where, "cfg.head_dim", cfg.head_dim, kMaxDim);
  check_equal(where, "cfg.attn_k_tile", cfg.attn_k_tile, kBlock);
  check_equal(where, "cfg.window", cfg.window, kBlock);
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, 64);
  if (cfg.n_heads % cfg.o_groups != 0 || cfg.n_heads % 8 != 0)
    throw_arg(where, "cfg.n_heads", cfg.n_heads, "a multiple of 8 and of cfg.o_groups");
  if (cfg.attn_cols(a.kind) % kBlock != 0)
    throw_arg(where, "cfg.attn_cols", cfg.attn_cols(a.kind), "a multiple of 128");
  const index_t T = a.q.extent(0), H = cfg.n_heads, D = cfg.head_dim;
  check_range(where, "seq", a.seq, 1, 1 << 10);
  if (T % a.seq != 0) throw_arg(where, "q.extent(0)", T, "a multiple of seq");
  const index_t B = T / a.seq;
  check_equal(where, "q.extent(1)", a.q.extent(1), H);
  check_equal(where, "q.extent(2)", a.q.extent(2), D);
  check_equal(where, "q.stride(2)", a.q.stride(2), index_t(1));
  check_equal(where, "o_packed.extent(0)", a.o_packed.extent(0), index_t(cfg.o_groups) * T);
  check_equal(where, "o_packed.extent(1)", a.o_packed.extent(1), index_t(cfg.o_group_in()));
  check_equal(where, "o_packed.stride(1)", a.o_packed.stride(1), index_t(1));
  check_equal(where, "kv_cache.extent(1)", a.kv_cache.extent(1), D);
  check_equal(where, "kv_cache.stride(1)", a.kv_cache.stride(1), index_t(1));
  check_equal(where, "window_idx.extent(0)", a.window_idx.extent(0), T);
  check_equal(where, "window_idx.extent(1)", a.window_idx.extent(1), index_t(cfg.window));
  check_equal(where, "window_lens.extent(0)", a.window_lens.extent(0), T);
  check_equal(where, "positions.extent(0)", a.positions.extent(0), T);
  check_equal(where, "attn_sink.extent(0)", a.attn_sink.extent(0), H);
  check_at_least(where, "rope.cos.extent(1)", a.rope.cos.extent(1), index_t(cfg.rope_dim / 2));
  check_at_least(where, "rope.sin.extent(1)", a.rope.sin.extent(1), index_t(cfg.rope_dim / 2));
  check_equal(where, "rope.sin.extent(0)", a.rope.sin.extent(0), a.rope.cos.extent(0));
  const index_t max_pos = std::min<index_t>(cfg.max_seq_len, a.rope.length());
  for (index_t t = 0; t < T; ++t) {
    check_range<index_t>(where, "positions[" + std::to_string(t) + "]", a.positions(t), 0, max_pos);
    check_range<index_t>(where, "window_lens[" + std::to_string(t) + "]", a.window_lens(t), 0,
                         cfg.window + 1);
    for (index_t k = 0; k < cfg.window; ++k) {
      const index_t v = a.window_idx(t, k);
      if (v < -1 || v >= a.kv_cache.extent(0))
        throw_arg(where, "window_idx[" + std::to_string(t) + "," + std::to_string(k) + "]", v,
                  "-1 or [0, " + std::to_string(a.kv_cache.extent(0)) + ") (kv_cache rows)");
    }
  }
  for (index_t h = 0; h < H; ++h)
    if (!std::isfinite(a.attn_sink(h)))
      throw_arg(where, "attn_sink[" + std::to_string(h) + "]", a.attn_sink(h), "a finite value");
  if (a.kind != LayerKind::swa) {
    check_equal(where, "cmp_kv.extent(1)", a.cmp_kv.extent(1), D);
    if (a.cmp_kv.extent(0) > 0)
      check_equal(where, "cmp_kv.stride(1)", a.cmp_kv.stride(1), index_t(1));
    if (a.cmp_kv.extent(0) % cfg.page != 0)
      throw_arg(where, "cmp_kv.extent(0)", a.cmp_kv.extent(0), "a multiple of the page (128)");
    const index_t cmp_blocks = a.cmp_kv.extent(0) / cfg.page;
    check_equal(where, "cmp_block_table.extent(0)", a.cmp_block_table.extent(0), B);
    check_at_least(where, "cmp_block_table.extent(1)", a.cmp_block_table.extent(1), index_t(1));
    for (index_t b = 0; b < B; ++b)
      for (index_t c = 0; c < a.cmp_block_table.extent(1); ++c)
        if (a.cmp_block_table(b, c) >= cmp_blocks)
          throw_arg(where, "cmp_block_table[" + std::to_string(b) + "," + std::to_string(c) + "]",
                    a.cmp_block_table(b, c),
                    "< 0 (unmapped) or < " + std::to_string(cmp_blocks) + " (cmp pool blocks)");
  }
  if (a.kind == LayerKind::hca) {
    check_equal(where, "kv_seq_lens.extent(0)", a.kv_seq_lens.extent(0), B);
    for (index_t b = 0; b < B; ++b)
      check_range<index_t>(where, "kv_seq_lens[" + std::to_string(b) + "]", a.kv_seq_lens(b), 0,
                           cfg.max_seq_len + 1);
  }
  if (a.kind == LayerKind::csa) {
    check_equal(where, "topk_idxs.extent(0)", a.topk_idxs.extent(0), T);
    check_at_least(where, "topk_idxs.extent(1)", a.topk_idxs.extent(1), index_t(cfg.idx_topk));
  }
  if (T > 0 && workspace_bytes < slot_bytes)
    throw_arg(where, "workspace.size()", workspace_bytes,
              ">= " + std::to_string(slot_bytes) + " (sparse_attention_workspace_bytes(cfg, 1))");
}

template <class Ops>
void run(const cpu::Context& ctx, const Args& a, std::span<std::byte> workspace) {
  const SlotLayout L(a.cfg->head_dim);
  // 64-byte align the workspace start; slots are whole multiples of 64 bytes.
  auto base = reinterpret_cast<std::uintptr_t>(workspace.data());
  const std::size_t skip = (64 - base % 64) % 64;
  float* ws = reinterpret_cast<float*>(workspace.data() + skip);
  const std::size_t n_slots_ws = (workspace.size() - skip) / L.bytes();
  const index_t T = a.q.extent(0);
  const int H = a.cfg->n_heads, tiles = (H + kHeadsPerItem - 1) / kHeadsPerItem;
  const index_t n_items = T * tiles;
  const index_t n_slots = std::min<index_t>(n_items, index_t(n_slots_ws));
  ctx.parallel_for(0, n_slots, 1, [&](std::int64_t slot) {
    float* w = ws + std::size_t(slot) * L.total;
    for (index_t item = slot; item < n_items; item += n_slots) {
      const index_t t = item / tiles;
      const int h0 = int(item % tiles) * kHeadsPerItem;
      run_item<Ops>(a, w, L, t, h0, std::min(kHeadsPerItem, H - h0));
    }
  });
}

}  // namespace sparse_attention_detail

// Workspace bytes for `threads` concurrent work items (pass ctx.exec->concurrency(); 1 for
// serial). A smaller workspace is legal down to one slot (it limits parallelism, never results).
// About 555 KB per slot: one FP32 KV block (128 × 528), and for the item's 64 heads the
// transposed queries (512 × 64), the scores (128 × 64) and the O accumulator (64 × 512).
inline std::size_t sparse_attention_workspace_bytes(const ModelConfig& cfg, std::size_t threads) {
  const sparse_attention_detail::SlotLayout L(cfg.head_dim);
  return std::max<std::size_t>(1, threads) * L.bytes() + 64;
}

// Sparse attention of one layer for T = B·S tokens, writing the packed head rows.
//   o_packed     BF16 [O_GROUPS·T, O_GROUP_IN]: row g·T+t, columns (h%8)·512.. = head h of t
//   q            BF16 [T, H, 512]
//   kv_cache     BF16 [ori rows, 512]   original cache pool (blocks × 128 rows, flattened)
//   cmp_kv       BF16 [cmp rows, 512]   compressed pool (CSA/HCA; may be empty for SWA)
//   window_idx   INT32 [T, 128]  physical ori rows, oldest → newest; -1 = invalid
//   window_lens  INT32 [T]       valid window prefix length (0..128)
//   topk_idxs    INT32 [T, >= idx_topk]  CSA raw compressed ids; -1 / out of [0,(pos+1)/4) masked
//                (ignored for SWA/HCA; may be empty)
//   cmp_block_table INT32 [B, cols]  compressed pages (page 128); < 0 unmapped (CSA/HCA)
//   positions    INT32 [T]       absolute position of each token (inverse-RoPE position)
//   kv_seq_lens  INT32 [B]       committed length per request (HCA's n_t bound)
//   seq          S, tokens per request (t = b·S + s)
//   attn_sink    FP32 [H]        finite
//   rope         the layer's RoPE table (covers every position)
//   workspace    >= sparse_attention_workspace_bytes(cfg, 1) bytes, any alignment
// Throws tiledecode::Error on invalid arguments before writing anything.
inline void sparse_attention(
    const cpu::Context& ctx, const ModelConfig& cfg, LayerKind kind, View<bf16, 2> o_packed,
    ConstView<bf16, 3> q, ConstView<bf16, 2> kv_cache, ConstView<bf16, 2> cmp_kv,
    ConstView<std::int32_t, 2> window_idx, ConstView<std::int32_t, 1> window_lens,
    ConstView<std::int32_t, 2> topk_idxs, ConstView<std::int32_t, 2> cmp_block_table,
    ConstView<std::int32_t, 1> positions, ConstView<std::int32_t, 1> kv_seq_lens, int seq,
    ConstView<float, 1> attn_sink, const RopeTableView& rope, std::span<std::byte> workspace) {
  namespace sd = sparse_attention_detail;
  const sd::Args a{&cfg,      kind,        o_packed,    q,         kv_cache,
                   cmp_kv,    window_idx,  window_lens, topk_idxs, cmp_block_table,
                   positions, kv_seq_lens, seq,         attn_sink, rope};
  const sd::SlotLayout L(cfg.head_dim);
  sd::validate(a, workspace.size() >= 64 ? workspace.size() - 64 : 0, L.bytes());
  if (q.extent(0) == 0) return;
#if TILEDECODE_X86
  if (cpu::has_avx2(ctx.isa)) return sd::run<sd::Avx2Ops>(ctx, a, workspace);
#endif
  sd::run<sd::ScalarOps>(ctx, a, workspace);
}

}  // namespace tiledecode::kernels
