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
// Tiers: Cpu<scalar> runs the plain twins below (the same operations as the AVX2 micro-kernels
// but std::exp, so its own bits); avx2 and avx2_vnni run the AVX2 micro-kernels, avx512 their
// 16-lane twins (sparse_attention_avx512.hpp: the same bits).
//
// Exact probabilities (issue 17). The spec rounds the probabilities, P = bf16(e), e = exp(s − m).
// A score s is a 512-long FP32 FMA chain; its error (~1e-6 at logits of a few units) is a
// relative error of e, and where e lies that close to a BF16 midpoint P rounds the other way: a
// whole 2⁻⁸ step of one probability, which moves its whole head row (o_packed then differed from
// golden's rounding in up to 3.4e-3 of its values, sparse_attn.rounding.PackedOutputRounds…).
// So, per block and head:
//   * softmax_block also returns the FP32 argmax column and flags every e within
//       band = kBandSigma · scale · ||q_h|| · (||k_j|| + max_j ||k_j||) + 2 (|s − m| + |m|) + 4
//     FP32 ulps of a BF16 midpoint. The first term is kBandSigma times the FP32 chain's error
//     estimate 2⁻²⁴ · scale · ||q|| · ||k|| for s and for m (measured: at most 1.2 of it, rms 0.10,
//     over 262144 scores); the second the roundings of s, m and s − m; the third the exp's error.
//     Row norms come with the BF16 → FP32 load, query norms with the queries' transposition.
//   * mex = the exact score of the argmax column (exact_dot: the BF16 × BF16 products are exact
//     in FP32 and summed in double), at least the block's floor, as golden's maximum; every
//     flagged P becomes golden's bf16(float(exp(s_exact − mex))).
//   * The merge runs in double against mex: the block sum lb (Σ e relative to the FP32 m) is
//     rescaled by e^(m − mex) except for the argmax column's e, which is exactly 1 either way; α
//     and γ are rounded once to FP32 for the P·V tile; the normalisation divides in double.
// An unflagged P already rounds as golden's (its e is further from a midpoint than its error),
// and a flagged one is recomputed, so the probabilities match golden's unless the error exceeds
// the band (kBandSigma = 4: 3.3× the largest measured); what is left of o_packed's rate (≤ 1e-4)
// comes from the FP32 P·V sums. A head whose band would exceed kMaxBandUlps (logits hundreds of
// units wide) keeps the FP32 statistics, self-consistent as before. The flags, argmax, norms and
// exact dots are the same bits on avx2 and avx512 (the avx512 tier runs avx2's norms and keeps
// their lanes), so the tiers stay bit-identical. Cost against the build before them, one thread,
// Zen 5 (bench_sparse_attn, fixture logits, minimum of 24 runs), after the norms' vector sums,
// the fused query norms and the vector RoPE tail paid part of it back: B = 4 +1.3–2.3 % (SWA),
// +2.2–3.7 % (HCA), +3.0–4.9 % (CSA) over two runs; B = 64 −0.6 %, +5.4 %, +5.4 %
// (docs/sparse_attention.md).

#include <algorithm>
#include <bit>
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
// The flag band in units of the FP32 score error estimate 2⁻²⁴ · scale · ||q_h|| · ||k_j||: the
// error of a 512-long FP32 chain measured at most 1.2 of it (rms 0.10) over 262144 scores.
inline constexpr float kBandSigma = 4.0f;
// Heads whose band would exceed this many ulps (2⁻¹² of e: logits hundreds of units wide, where
// an eighth of the probabilities would be flagged) keep the FP32 path (no exact maximum, no
// repairs): its statistics are self-consistent, and the spec's tolerance holds there.
inline constexpr float kMaxBandUlps = 4096.0f;

constexpr std::size_t round16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// Per-slot workspace layout, in floats; every part starts on a 64-byte boundary.
struct SlotLayout {
  int ldk, lds, dim, heads;
  std::size_t kf, qf, s, o, stats, knorm, band, jmax, flags, dstats, total;  // offsets (floats)
  explicit SlotLayout(int head_dim)
      : ldk(head_dim + 16), lds(kHeadsPerItem), dim(head_dim), heads(kHeadsPerItem) {
    kf = 0;
    qf = kf + round16(std::size_t(kBlock) * ldk);
    s = qf + round16(std::size_t(heads) * dim);
    o = s + round16(std::size_t(kBlock) * lds);
    stats = o + round16(std::size_t(heads) * dim);
    knorm = stats + round16(std::size_t(4) * heads);
    band = knorm + round16(kBlock);
    jmax = band + round16(std::size_t(heads));
    flags = jmax + round16(std::size_t(heads));
    dstats = flags + round16(std::size_t(2) * kBlock);
    total = dstats + round16(std::size_t(6) * heads);
  }
  std::size_t bytes() const { return total * sizeof(float); }
};

// Plain C++ block primitives (the always-compiled twin of backend/cpu/sparse_attention_avx2.hpp).
struct ScalarOps {
  // With k2: also ||row||², 32 lanes as avx2::sa_load_rows (separate multiply and add here).
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim,
                        float* k2 = nullptr) {
    for (int i = 0; i < n; ++i) {
      float l[32] = {};
      for (int d = 0; d < dim; ++d) {
        const float x = rows[i][d].to_float();
        kf[std::int64_t(i) * ldk + d] = x;
        l[d % 32] += x * x;
      }
      if (k2 != nullptr) k2[i] = sum_lanes32(l);
    }
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
  static void softmax_block(float* st, int lds, int nh, int nc, float floor, float* mb, float* lb,
                            const SoftmaxFlags* f = nullptr) {
    for (int h = 0; h < nh; ++h) {
      float m = std::max(floor, st[h]);
      int arg = 0;
      for (int j = 1; j < nc; ++j) {
        const float v = st[std::int64_t(j) * lds + h];
        if (v > m) arg = j;
        m = std::max(m, v);
      }
      float l = 0;
      for (int j = 0; j < nc; ++j) {
        float& x = st[std::int64_t(j) * lds + h];
        const float xm = x - m;
        const float e = std::exp(xm);
        l += e;
        x = round_bf16(e);
        if (f != nullptr) {  // the vector tiers' flag test, lane for lane
          std::uint32_t bits;
          std::memcpy(&bits, &e, sizeof bits);
          const float dist = float(std::abs(int(bits & 0xffffu) - 0x8000));
          const float band = f->band_q[h] * (f->knorm[j] + f->kmax) +
                             2.0f * (std::fabs(xm) + std::fabs(m)) + kExpUlps;
          if (dist <= band) f->flags[j] |= std::uint64_t(1) << (f->shift + h);
        }
      }
      if (f != nullptr) f->jmax[h] = arg;
      mb[h] = m;
      lb[h] = l;
    }
  }
  // avx2::sa_exact_dot's lanes and sum tree (the same bits: every product is exact).
  static double exact_dot(const bf16* q, const float* k, int n) {
    double l[32] = {};
    for (int d = 0; d < n; ++d) l[d % 32] += double(q[d].to_float() * k[d]);
    double a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = (l[i] + l[i + 16]) + (l[i + 8] + l[i + 24]);
    for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
  static void scale_round(bf16* dst, const float* src, double rden, int n) {
    for (int d = 0; d < n; ++d) dst[d] = bf16(float(double(src[d]) * rden));
  }
  // With q2: also q2[h] = Σ_d q[h][d]², one chain per head in ascending d (multiply, then add).
  static void load_q_transposed(float* qt, int ldq, const bf16* const* q, int nh, int dim,
                                float* q2 = nullptr) {
    for (int h = 0; h < nh; ++h) {
      float acc = 0.0f;
      for (int d = 0; d < dim; ++d) {
        const float x = q[h][d].to_float();
        qt[std::int64_t(d) * ldq + h] = x;
        acc += x * x;
      }
      if (q2 != nullptr) q2[h] = acc;
    }
  }
  // dst[d] = bf16 of rope_inverse(float(double(src) · rden)) for d < n <= 64 (the packed row's
  // tail: rope_dim, validated to be 64).
  static void rope_tail(bf16* dst, const float* src, double rden, const bf16* cos_row,
                        const bf16* sin_row, int n) {
    float tail[64];
    for (int d = 0; d < n; ++d) tail[d] = float(double(src[d]) * rden);
    rope_inverse(std::span<float>(tail, std::size_t(n)), cos_row, sin_row);
    for (int d = 0; d < n; ++d) dst[d] = bf16(tail[d]);
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
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim,
                        float* k2 = nullptr) {
    avx2::sa_load_rows(kf, ldk, rows, n, dim, k2);
  }
  static void qk(float* s, int lds, const float* q, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    avx2::sa_qk(s, lds, q, ldq, nh, kf, ldk, nc, dim, scale);
  }
  static void softmax_block(float* s, int lds, int nh, int nc, float floor, float* mb, float* lb,
                            const SoftmaxFlags* f = nullptr) {
    avx2::sa_softmax_block(s, lds, nh, nc, floor, mb, lb, f);
  }
  static double exact_dot(const bf16* q, const float* k, int n) {
    return avx2::sa_exact_dot(q, k, n);
  }
  static void scale_round(bf16* dst, const float* src, double rden, int n) {
    avx2::sa_scale_round(dst, src, rden, n);
  }
  static void load_q_transposed(float* qt, int ldq, const bf16* const* q, int nh, int dim,
                                float* q2 = nullptr) {
    avx2::sa_load_q_transposed(qt, ldq, q, nh, dim, q2);
  }
  static void rope_tail(bf16* dst, const float* src, double rden, const bf16* cos_row,
                        const bf16* sin_row, int n) {
    avx2::sa_rope_tail(dst, src, rden, cos_row, sin_row, n);
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    avx2::sa_pv_merge(o, ldo, p, ldp, nh, kf, ldk, nc, dim, alpha, gamma, first);
  }
};

// The avx512 tier's primitives (backend/cpu/sparse_attention_avx512.hpp): the AVX2 contract and
// bits on 16-lane vectors, except load_q_transposed, scale_round and the exact probabilities'
// norms and dots (avx2's: under 2 % of the kernel, and one code gives one bits).
struct Avx512Ops : Avx2Ops {
  static void load_rows(float* kf, int ldk, const bf16* const* rows, int n, int dim,
                        float* k2 = nullptr) {
    avx512::sa_load_rows(kf, ldk, rows, n, dim, k2);
  }
  static void scale_round(bf16* dst, const float* src, double rden, int n) {
    avx512::sa_scale_round(dst, src, rden, n);
  }
  static void qk(float* s, int lds, const float* q, int ldq, int nh, const float* kf, int ldk,
                 int nc, int dim, float scale) {
    avx512::sa_qk(s, lds, q, ldq, nh, kf, ldk, nc, dim, scale);
  }
  static void softmax_block(float* s, int lds, int nh, int nc, float floor, float* mb, float* lb,
                            const SoftmaxFlags* f = nullptr) {
    avx512::sa_softmax_block(s, lds, nh, nc, floor, mb, lb, f);
  }
  static void pv_merge(float* o, int ldo, const float* p, int ldp, int nh, const float* kf, int ldk,
                       int nc, int dim, const float* alpha, const float* gamma, bool first) {
    avx512::sa_pv_merge(o, ldo, p, ldp, nh, kf, ldk, nc, dim, alpha, gamma, first);
  }
  static double exact_dot(const bf16* q, const float* k, int n) {
    return avx512::sa_exact_dot(q, k, n);
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
  float *mb, *lb, *alpha, *gamma;   // FP32 block statistics and merge factors
  float* knorm;                     // (≤128): ||k_j|| of the block's rows
  float* band;                      // (heads): the flag band's scale per head
  int* jmax;                        // (heads): the block's argmax column per head
  std::uint64_t* flags;             // (≤128): flagged heads per column
  double *m, *l, *mex;              // (heads): running max and sum, the block's exact max
  float kmax = 0.0f;                // max_j knorm
  float scale = 0.0f;               // the softmax scale
  const bf16* qrow[kHeadsPerItem];  // the item's BF16 query rows
  bool first = true;                // no block merged yet
  int prepared = -1;                // block whose row list is ready (computed one block ahead)
  int cur = 0;                      // row buffer of the current block
  int n_rows[2] = {0, 0};
  const bf16* rows[2][kBlock];

  Lane(const SlotLayout& layout, float* ws)
      : L(&layout),
        kf(ws + layout.kf),
        qt(ws + layout.qf),
        s(ws + layout.s),
        o(ws + layout.o),
        mb(ws + layout.stats),
        lb(mb + layout.heads),
        alpha(lb + layout.heads),
        gamma(alpha + layout.heads),
        knorm(ws + layout.knorm),
        band(ws + layout.band),
        jmax(reinterpret_cast<int*>(ws + layout.jmax)),
        flags(reinterpret_cast<std::uint64_t*>(ws + layout.flags)),
        m(reinterpret_cast<double*>(ws + layout.dstats)),
        l(m + layout.heads),
        mex(l + layout.heads) {}
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
    for (int h = 0; h < it.nh; ++h) z.qrow[h] = &a.q(it.t, it.h0 + h, 0);
    // With the flag band's scale per head: kBandSigma · scale · ||q_h||.
    float q2[sparse_attention_detail::kHeadsPerItem];
    Ops::load_q_transposed(z.qt, z.L->heads, z.qrow, it.nh, z.L->dim, q2);
    z.scale = a.cfg->softmax_scale();
    for (int h = 0; h < z.L->heads; ++h)
      z.band[h] =
          h < it.nh ? sparse_attention_detail::kBandSigma * z.scale * std::sqrt(q2[h]) : 0.0f;
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
    const int n = z.n_rows[z.cur];
    Ops::load_rows(z.kf, z.L->ldk, z.rows[z.cur], n, z.L->dim, z.knorm);
    float kmax = 0.0f;
    for (int j = 0; j < n; ++j) {
      z.knorm[j] = std::sqrt(z.knorm[j]);
      kmax = std::max(kmax, z.knorm[j]);
    }
    z.kmax = kmax;
  }
  static void scores(Lane& z, const kernels::AttentionItem& it, float scale) {
    Ops::qk(z.s, z.L->lds, z.qt, z.L->heads, it.nh, z.kf, z.L->ldk, z.n_rows[z.cur], z.L->dim,
            scale);
  }
  // The block maximum includes kMaskNeg when the 128-column tile has invalid columns: the spec
  // (§8.2) scores them kMaskNeg, and this op set drops them instead of computing e^(kMaskNeg - m)
  // = 0. Finite scores are above kMaskNeg, so this changes nothing for them; for scores that are
  // all -Inf (or below -1e20) it gives golden's weights (0, output 0) instead of e^(-Inf + Inf).
  // Then the exact probabilities (see the top of the file).
  static void block_softmax(Lane& z, const kernels::AttentionItem& it) {
    const int n = z.n_rows[z.cur];
    const float floor =
        n < sparse_attention_detail::kBlock ? kMaskNeg : -std::numeric_limits<float>::infinity();
    std::fill(z.flags, z.flags + n, std::uint64_t(0));
    const SoftmaxFlags f{z.band, z.knorm, z.kmax, z.jmax, z.flags, 0};
    Ops::softmax_block(z.s, z.L->lds, it.nh, n, floor, z.mb, z.lb, &f);
    exact_probabilities(z, it, n, floor);
  }
  // mex[h] = the exact score of the block's FP32 argmax column (at least `floor`, as golden's
  // maximum); every flagged P recomputed as golden does: bf16(float(exp(s - mex))) from the exact
  // score. A head whose FP32 maximum is not finite keeps the FP32 path (mex = NaN).
  static void exact_probabilities(Lane& z, const kernels::AttentionItem& it, int n, float floor) {
    const int dim = z.L->dim, ldk = z.L->ldk, lds = z.L->lds;
    const double scale = z.scale;
    for (int h = 0; h < it.nh; ++h) {
      z.mex[h] = std::numeric_limits<double>::quiet_NaN();
      const float wide = z.band[h] * 2.0f * z.kmax + 2.0f * std::fabs(z.mb[h]);
      if (!std::isfinite(z.mb[h]) || !(wide <= sparse_attention_detail::kMaxBandUlps)) continue;
      const double s = scale * Ops::exact_dot(z.qrow[h], z.kf + std::int64_t(z.jmax[h]) * ldk, dim);
      z.mex[h] = std::max(double(floor), s);
    }
    for (int j = 0; j < n; ++j)
      for (std::uint64_t bits = z.flags[j]; bits != 0; bits &= bits - 1) {
        const int h = std::countr_zero(bits);
        if (!std::isfinite(z.mex[h])) continue;
        const double s = scale * Ops::exact_dot(z.qrow[h], z.kf + std::int64_t(j) * ldk, dim);
        // e <= 1 but where the FP32 argmax is not the exact one (then e^(tiny)); the clamp only
        // keeps the conversion defined for inputs the band misjudges.
        const double e =
            std::min(std::exp(s - z.mex[h]), double(std::numeric_limits<float>::max()));
        z.s[std::int64_t(j) * lds + h] = round_bf16(float(e));
      }
  }
  // e^x for the difference of an FP32 and the exact block maximum (|x| < 2⁻¹² but for inputs the
  // band misjudges): 1 + x + x²/2 + x³/6 there (the next term < 2⁻⁵² relative), else std::exp.
  static double exp_small(double x) {
    if (!(std::fabs(x) < 0x1p-12)) return std::exp(x);
    return 1.0 + x * (1.0 + x * (0.5 + x * (1.0 / 6.0)));
  }
  // Online merge of the block statistics (spec §8.3), fused with O = α·O + γ·(P·K). The maxima,
  // sums and factors in double, against the exact block maximum where there is one (lb sums e
  // relative to the FP32 mb: rescaled by e^(mb - mex)); α and γ rounded once to FP32 for the tile.
  static void merge_block(Lane& z, const kernels::AttentionItem& it) {
    for (int h = 0; h < it.nh; ++h) {
      double mb = z.mb[h], lb = z.lb[h];
      if (std::isfinite(z.mex[h])) {  // the argmax column's e is exactly 1 either way
        lb = (lb - 1.0) * exp_small(mb - z.mex[h]) + 1.0;
        mb = z.mex[h];
      }
      if (z.first) {
        z.m[h] = mb, z.l[h] = lb, z.alpha[h] = 0.0f, z.gamma[h] = 1.0f;
      } else {
        // One of the two factors is e^0 = 1 (std::exp(0) is exactly 1: only the other is taken).
        const double mn = std::max(z.m[h], mb);
        const double alpha = z.m[h] == mn ? 1.0 : std::exp(z.m[h] - mn);
        const double gamma = mb == mn ? 1.0 : std::exp(mb - mn);
        z.l[h] = alpha * z.l[h] + gamma * lb;
        z.m[h] = mn;
        z.alpha[h] = float(alpha);
        z.gamma[h] = float(gamma);
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
    alignas(64) bf16 packed[sparse_attention_detail::kMaxDim];
    for (int h = 0; h < it.nh; ++h) {
      const int hg = it.h0 + h;
      if (z.first) {
        std::fill(packed, packed + dim, bf16(0.0f));
      } else {
        const double den = z.l[h] + std::exp(double(a.attn_sink(hg)) - z.m[h]), rden = 1.0 / den;
        const float* orow = z.o + std::int64_t(h) * dim;
        Ops::scale_round(packed, orow, rden, nope);
        Ops::rope_tail(packed + nope, orow + nope, rden, a.rope.cos_row(p), a.rope.sin_row(p),
                       cfg.rope_dim);
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
