#pragma once
// Sparse attention (kernels/sparse_attention.hpp) on the CPU backend: the op set of the shared
// tile program for every ISA tier, and the CPU schedule.
//
// Schedule. Work item = (token, tile of kHeadsPerItem = 64 heads), all blocks of the token, merged
// online and finished in place (no partials). The item's queries are widened and transposed once
// (512 × heads), so heads are the vector lanes of both GEMMs and each is a broadcast-FMA register
// tile of 6 × 16 floats (backend/cpu/sparse_attention_avx2.hpp). Per item and block the valid rows
// are gathered (invalid columns are never read: their e is exactly 0 in the spec, so dropping them
// is exact), converted BF16 → FP32 once into the item's workspace slot and reused by every head;
// the next block's rows are prefetched meanwhile. Block statistics merge online into an FP32 O
// accumulator per head, so no score matrix larger than one block (128 × heads) exists.
// Items are distributed to workspace slots round-robin and every head's arithmetic is the same
// whatever tile it sits in, so outputs are bit-identical for any thread count and slot count.
// Parallelism: T·ceil(H/64) items (B=4, S=2: 8 flash, 16 pro) over min(items, slots) tasks.
//
// Tiers: Cpu<scalar> runs the plain twins below (same operations, same order as the AVX2
// micro-kernels: the tiers are bit-identical); avx2 and avx2_vnni run the AVX2 micro-kernels,
// avx512 their 16-lane twins (sparse_attention_avx512.hpp: the same bits).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/sparse_attention_avx2.hpp"
#include "tiledecode/backend/cpu/sparse_attention_avx512.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/sparse_attention.hpp"

namespace tiledecode::cpu {

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
  static void softmax_block(float* st, int lds, int nh, int nc, float floor, float* mb, float* lb) {
    for (int h = 0; h < nh; ++h) {
      float m = std::max(floor, st[h]);
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
    avx2::sa_load_rows(kf, ldk, rows, n, dim);
  }
  static void qk(float* s, int lds, const float* q, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    avx2::sa_qk(s, lds, q, ldq, nh, kf, ldk, nc, dim, scale);
  }
  static void softmax_block(float* s, int lds, int nh, int nc, float floor, float* mb, float* lb) {
    avx2::sa_softmax_block(s, lds, nh, nc, floor, mb, lb);
  }
  static void divide_round(bf16* dst, const float* src, float den, int n) {
    avx2::sa_divide_round(dst, src, den, n);
  }
  static void load_q_transposed(float* qt, int ldq, const bf16* const* q, int nh, int dim) {
    avx2::sa_load_q_transposed(qt, ldq, q, nh, dim);
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    avx2::sa_pv_merge(o, ldo, p, ldp, nh, kf, ldk, nc, dim, alpha, gamma, first);
  }
};

// The avx512 tier's primitives (backend/cpu/sparse_attention_avx512.hpp): the AVX2 contract and
// bits on 16-lane vectors, except load_q_transposed and divide_round (under 2 % of the kernel).
struct Avx512Ops : Avx2Ops {
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim) {
    avx512::sa_load_rows(kf, ldk, rows, n, dim);
  }
  static void qk(float* s, int lds, const float* q, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    avx512::sa_qk(s, lds, q, ldq, nh, kf, ldk, nc, dim, scale);
  }
  static void softmax_block(float* s, int lds, int nh, int nc, float floor, float* mb, float* lb) {
    avx512::sa_softmax_block(s, lds, nh, nc, floor, mb, lb);
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    avx512::sa_pv_merge(o, ldo, p, ldp, nh, kf, ldk, nc, dim, alpha, gamma, first);
  }
};

template <Isa I>
using MicroOps = std::conditional_t<I == Isa::avx512, Avx512Ops,
                                    std::conditional_t<has_avx2(I), Avx2Ops, ScalarOps>>;
#else
template <Isa>
using MicroOps = ScalarOps;
#endif

// One workspace slot: the item's FP32 K block, transposed queries, scores/probabilities, O
// accumulator and softmax statistics, plus the (double-buffered) row lists of its blocks.
struct Lane {
  const SlotLayout* L;
  float* kf;  // (≤128 valid rows, ldk)
  float* qt;  // (dim, heads): the item's queries, transposed
  float* s;   // (≤128 cols, lds = heads): scores, then BF16-rounded probabilities
  float* o;   // (heads, dim): merged, unnormalised output
  float *m, *l, *mb, *lb, *alpha, *gamma;
  bool first = true;  // no block merged yet
  int prepared = -1;  // block whose row list is ready (computed one block ahead)
  int cur = 0;        // row buffer of the current block
  int n_rows[2] = {0, 0};
  const bf16* rows[2][kBlock];

  Lane(const SlotLayout& layout, float* ws)
      : L(&layout),
        kf(ws + layout.kf),
        qt(ws + layout.qf),
        s(ws + layout.s),
        o(ws + layout.o),
        m(ws + layout.stats),
        l(m + layout.heads),
        mb(l + layout.heads),
        lb(mb + layout.heads),
        alpha(lb + layout.heads),
        gamma(alpha + layout.heads) {}
};

// The valid rows of block beta of token t as pointers, compacted in column order.
inline int compact_rows(const kernels::SparseAttentionArgs& a, index_t t, int beta,
                        const bf16** out) {
  std::int64_t rows[kBlock];
  rules::attention_block_columns(a.cols, t, beta, rows);
  const ConstView<bf16, 2>& pool = beta == 0 ? a.kv_cache : a.cmp_kv;
  int n = 0;
  for (int k = 0; k < kBlock; ++k)
    if (rows[k] >= 0) out[n++] = pool.data() + rows[k] * pool.stride(0);
  return n;
}

// Items over workspace slots, round-robin (results do not depend on the slot count).
template <Isa I>
struct Schedule {
  Cpu<I> be;
  const kernels::SparseAttentionArgs* a;
  SlotLayout L;
  float* ws;
  std::size_t n_slots_ws;

  template <class Body>
  void for_items(Body&& body) const {
    const index_t T = a->tokens();
    const int H = a->cfg->n_heads, tiles = (H + kHeadsPerItem - 1) / kHeadsPerItem;
    const index_t n_items = T * tiles;
    const index_t n_slots = std::min<index_t>(n_items, index_t(n_slots_ws));
    const int n_blocks = a->n_blocks();
    be.tasks(n_slots, [&](std::int64_t slot) {
      Lane lane(L, ws + std::size_t(slot) * L.total);
      for (index_t item = slot; item < n_items; item += n_slots) {
        const int h0 = int(item % tiles) * kHeadsPerItem;
        const kernels::AttentionItem it{item / tiles, h0, std::min(kHeadsPerItem, H - h0), 0,
                                        n_blocks};
        body(lane, it);
      }
    });
  }
};

}  // namespace sparse_attention_detail

template <Isa I>
struct backend_ops_sparse_attention {
  using Ops = sparse_attention_detail::MicroOps<I>;
  using Lane = sparse_attention_detail::Lane;
  using Layout = sparse_attention_detail::SlotLayout;
  static constexpr bool split_blocks = false;

  // About 555 KB per slot: one FP32 KV block (128 × 528), and for the item's 64 heads the
  // transposed queries (512 × 64), the scores (128 × 64) and the O accumulator (64 × 512). A
  // smaller workspace is legal down to one slot (it limits parallelism, never results).
  static std::size_t workspace_bytes(const Cpu<I>& be, const ModelConfig& cfg, LayerKind, index_t) {
    return std::max<std::size_t>(1, be.concurrency()) * Layout(cfg.head_dim).bytes() + 64;
  }
  static void check(const Cpu<I>&, const kernels::SparseAttentionArgs& a,
                    std::span<const std::byte> ws) {
    const std::size_t slot = Layout(a.cfg->head_dim).bytes();
    if (a.tokens() > 0 && ws.size() < slot + 64)
      throw_arg("sparse_attention", "workspace.size()", ws.size(),
                ">= " + std::to_string(slot + 64) + " (sparse_attention_workspace_bytes)");
  }

  static sparse_attention_detail::Schedule<I> schedule(const Cpu<I>& be,
                                                       const kernels::SparseAttentionArgs& a,
                                                       std::span<std::byte> workspace) {
    const Layout L(a.cfg->head_dim);
    // 64-byte align the workspace start; slots are whole multiples of 64 bytes.
    const auto base = reinterpret_cast<std::uintptr_t>(workspace.data());
    const std::size_t skip = (64 - base % 64) % 64;
    return {be, &a, L, reinterpret_cast<float*>(workspace.data() + skip),
            (workspace.size() - skip) / L.bytes()};
  }

  static void load_queries(Lane& z, const kernels::SparseAttentionArgs& a,
                           const kernels::AttentionItem& it) {
    const bf16* qrows[sparse_attention_detail::kHeadsPerItem];
    for (int h = 0; h < it.nh; ++h) qrows[h] = &a.q(it.t, it.h0 + h, 0);
    Ops::load_q_transposed(z.qt, z.L->heads, qrows, it.nh, z.L->dim);
  }
  static void begin_item(Lane& z, const kernels::AttentionItem&) {
    z.first = true;
    z.prepared = -1;
  }
  // Row list of block beta (computed one block ahead, whose rows are prefetched towards L2 while
  // this block computes: they are scattered 1 KB runs the hardware prefetcher sees late).
  static int block_rows(Lane& z, const kernels::SparseAttentionArgs& a,
                        const kernels::AttentionItem& it, int beta) {
    z.cur = beta % 2;
    if (z.prepared != beta)
      z.n_rows[z.cur] = sparse_attention_detail::compact_rows(a, it.t, beta, z.rows[z.cur]);
    if (beta + 1 < it.beta1) {
      const int nb = (beta + 1) % 2;
      z.n_rows[nb] = sparse_attention_detail::compact_rows(a, it.t, beta + 1, z.rows[nb]);
      for (int i = 0; i < z.n_rows[nb]; ++i)
        for (int off = 0; off < z.L->dim * 2; off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(z.rows[nb][i]) + off, 0, 2);
      z.prepared = beta + 1;
    }
    return z.n_rows[z.cur];
  }
  static void gather_kv(Lane& z, const kernels::SparseAttentionArgs&, int) {
    Ops::load_rows(z.kf, z.L->ldk, z.rows[z.cur], z.n_rows[z.cur], z.L->dim);
  }
  static void scores(Lane& z, const kernels::AttentionItem& it, float scale) {
    Ops::qk(z.s, z.L->lds, z.qt, z.L->heads, it.nh, z.kf, z.L->ldk, z.n_rows[z.cur], z.L->dim,
            scale);
  }
  // The block maximum includes kMaskNeg when the 128-column tile has invalid columns: the spec
  // (§8.2) scores them kMaskNeg, and this op set drops them instead of computing e^(kMaskNeg - m)
  // = 0. Finite scores are above kMaskNeg, so this changes nothing for them; for scores that are
  // all -Inf (or below -1e20) it gives golden's weights (0, output 0) instead of e^(-Inf + Inf).
  static void block_softmax(Lane& z, const kernels::AttentionItem& it) {
    const int n = z.n_rows[z.cur];
    const float floor =
        n < sparse_attention_detail::kBlock ? kMaskNeg : -std::numeric_limits<float>::infinity();
    Ops::softmax_block(z.s, z.L->lds, it.nh, n, floor, z.mb, z.lb);
  }
  // Online merge of the block statistics (spec §8.3), fused with O = α·O + γ·(P·K).
  static void merge_block(Lane& z, const kernels::AttentionItem& it) {
    for (int h = 0; h < it.nh; ++h) {
      if (z.first) {
        z.m[h] = z.mb[h], z.l[h] = z.lb[h], z.alpha[h] = 0.0f, z.gamma[h] = 1.0f;
      } else {
        const float mn = std::max(z.m[h], z.mb[h]);
        z.alpha[h] = std::exp(z.m[h] - mn);
        z.gamma[h] = std::exp(z.mb[h] - mn);
        z.l[h] = z.alpha[h] * z.l[h] + z.gamma[h] * z.lb[h];
        z.m[h] = mn;
      }
    }
    Ops::pv_merge(z.o, z.L->dim, z.s, z.L->lds, it.nh, z.kf, z.L->ldk, z.n_rows[z.cur], z.L->dim,
                  z.alpha, z.gamma, z.first);
    z.first = false;
  }
  // Normalise with the sink, inverse RoPE on dims 448..511 at the token's position, round to
  // BF16 and issue one 512-wide store per head row (spec §8.4).
  static void finish(Lane& z, const kernels::SparseAttentionArgs& a,
                     const kernels::AttentionItem& it) {
    const ModelConfig& cfg = *a.cfg;
    const int dim = z.L->dim;
    const index_t T = a.tokens(), p = a.cols.positions(it.t);
    const int nope = cfg.nope_dim(), hpg = cfg.heads_per_group();
    for (int h = 0; h < it.nh; ++h) {
      alignas(64) bf16 packed[sparse_attention_detail::kMaxDim];
      float tail[64];
      const int hg = it.h0 + h;
      if (z.first) {
        std::fill(packed, packed + dim, bf16(0.0f));
      } else {
        const float den = z.l[h] + std::exp(a.attn_sink(hg) - z.m[h]);
        const float* orow = z.o + std::int64_t(h) * dim;
        Ops::divide_round(packed, orow, den, nope);
        for (int d = 0; d < cfg.rope_dim; ++d) tail[d] = orow[nope + d] / den;
        rope_inverse(std::span<float>(tail, cfg.rope_dim), a.rope.cos_row(p), a.rope.sin_row(p));
        for (int d = 0; d < cfg.rope_dim; ++d) packed[nope + d] = bf16(tail[d]);
      }
      const index_t g = hg / hpg, hh = hg % hpg;
      std::memcpy(&a.o_packed(g * T + it.t, hh * dim), packed, sizeof(bf16) * std::size_t(dim));
    }
  }
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::SparseAttention, cpu::Cpu<I>> : cpu::backend_ops_sparse_attention<I> {};
}  // namespace tiledecode

namespace tiledecode::kernels {
// The CPU workspace for `threads` concurrent work items (pass ctx.exec->concurrency(); 1 for
// serial): sparse_attention_workspace_bytes(cpu::Context, ...) for any token count.
inline std::size_t sparse_attention_workspace_bytes(const ModelConfig& cfg, std::size_t threads) {
  return std::max<std::size_t>(1, threads) *
             cpu::sparse_attention_detail::SlotLayout(cfg.head_dim).bytes() +
         64;
}
}  // namespace tiledecode::kernels
