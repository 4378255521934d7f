#pragma once
// Lightning indexer (kernels/indexer.hpp) on the CPU backend: the query path, the head weights,
// the fused INT8 score and top-k for every ISA tier, with the AVX2 micro-kernels (and the AVX-VNNI
// score and query-GEMM kernels of Isa::avx2_vnni) in backend/cpu/indexer_avx2.hpp, and the
// 512-bit VNNI ones of Isa::avx512 in backend/cpu/indexer_avx512.hpp.
// The scalar twins below perform the same floating-point operations in the same order, so the
// scalar and AVX2 paths are bit-identical, and every output element is produced by exactly one
// task with a fixed order, so results are bit-identical for any thread count.
//   query    parallel over heads, token tiles of 4: the INT32 GEMM per (head, tile) (avx2 widens
//            the tile's qr rows to int16 for vpmaddwd; avx2_vnni reads the INT8 rows in place and
//            runs vpdpbusd on the same packed weights, offset to u8 in registers, accumulators
//            starting at -128·Σ_k qr[t][k]: no extra packed memory, bit-identical outputs), the
//            epilogue fused (dequant, RoPE, BF16, Hadamard — a FWHT for the Sylvester matrix — Q8)
//   weights  an FP32 FMA chain over ascending d, token tiles of 4
//   score    tasks (token, 512-column chunk): per 16-row key block all 64 head dots are computed
//            and reduced (dequant, ReLU, weight, head sum, key scale) while the INT32 results are
//            in registers; no scratch
//   top-k    tile/topk.hpp's radix select, one task per token
// INT8 dot: int16 widening + vpmaddwd, exact for all int8 inputs including -128 (see
// indexer_avx2.hpp for the choice and the INT32 bounds); no clamping or validation of values.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/indexer_avx2.hpp"
#include "tiledecode/backend/cpu/indexer_avx512.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/kernels/indexer.hpp"
#include "tiledecode/tile/topk.hpp"

namespace tiledecode::kernels {

namespace detail {

// Query pairs for the row-lane score kernel: qp[h*64 + 2c + e] = int16 pair
// (q[h][4c+e], q[h][4c+e+2]) packed low/high into an int32 (the key side's pairing).
inline void pack_query_pairs(std::int32_t* qp, const std::int8_t* q, index_t head_stride,
                             int n_heads) {
  const auto pair = [](std::int8_t lo, std::int8_t hi) {
    return std::int32_t(std::uint32_t(std::uint16_t(std::int16_t(lo))) |
                        (std::uint32_t(std::uint16_t(std::int16_t(hi))) << 16));
  };
  for (int h = 0; h < n_heads; ++h) {
    const std::int8_t* r = q + h * head_stride;
    for (int c = 0; c < 32; ++c) {
      qp[h * 64 + 2 * c] = pair(r[4 * c], r[4 * c + 2]);
      qp[h * 64 + 2 * c + 1] = pair(r[4 * c + 1], r[4 * c + 3]);
    }
  }
}

// Query operands of the avx2_vnni score (cpu::avx2_vnni::score_rows16): qd[h*32 + c] = bytes
// 4c..4c+3 of head h's row; q_bias[h] = -128 * Σ_d q[h][d], the start value that cancels the
// keys' +128 offset.
inline void pack_query_vnni(std::int32_t* qd, std::int32_t* q_bias, const std::int8_t* q,
                            index_t head_stride, int n_heads) {
  for (int h = 0; h < n_heads; ++h) {
    const std::int8_t* r = q + h * head_stride;
    std::memcpy(qd + h * 32, r, 128);
    std::int32_t sum = 0;
    for (int d = 0; d < 128; ++d) sum += r[d];
    q_bias[h] = -128 * sum;
  }
}

// Scalar twin of cpu::avx2::score_block16 for `n` rows (only the valid ones are computed).
inline void score_rows_scalar(float* out, int n, const std::int8_t* rows, index_t stride,
                              const float* ksc, const std::int8_t* q, index_t head_stride,
                              const float* coef, int n_heads) {
  for (int r = 0; r < n; ++r) {
    const std::int8_t* k = rows + r * stride;
    float s = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      const std::int8_t* qh = q + h * head_stride;
      std::int32_t dot = 0;
      for (int d = 0; d < kIndexerHeadDim; ++d) dot += std::int32_t(qh[d]) * std::int32_t(k[d]);
      s = std::fma(coef[h], std::max(float(dot), 0.0f), s);
    }
    out[r] = s * ksc[r];
  }
}

// Scalar twins of the query epilogue (see indexer_avx2.hpp for the operation order).
inline void query_dequant_rope_scalar(float* x, const std::int32_t* acc, float qs, const float* ws,
                                      const float* rc, const float* rs) {
  double v[kIndexerHeadDim];
  for (int d = 0; d < kIndexerHeadDim; ++d) v[d] = double(acc[d]) * double(qs) * double(ws[d]);
  for (int i = 0; i < 32; ++i) {
    const double e = v[64 + 2 * i], o = v[64 + 2 * i + 1];
    v[64 + 2 * i] = e * double(rc[2 * i]) + o * double(rs[2 * i]);
    v[64 + 2 * i + 1] = o * double(rc[2 * i + 1]) + e * double(rs[2 * i + 1]);
  }
  for (int d = 0; d < kIndexerHeadDim; ++d) x[d] = round_bf16(float(v[d]));
}

inline void hadamard_row_scalar(float* qh, const float* x, const float* had) {
  for (int j = 0; j < kIndexerHeadDim; ++j) {
    float acc = 0.0f;
    for (int i = 0; i < kIndexerHeadDim; ++i)
      acc = std::fma(x[i], had[i * kIndexerHeadDim + j], acc);
    qh[j] = acc;
  }
}

// Scalar twin of cpu::avx2::fwht_128: in-place butterflies of stride 1, 2, …, 64, then × s.
inline void fwht_128_scalar(float* qh, const float* x, float s) {
  float v[kIndexerHeadDim];
  std::copy(x, x + kIndexerHeadDim, v);
  for (int len = 1; len < kIndexerHeadDim; len <<= 1)
    for (int i = 0; i < kIndexerHeadDim; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = a + b;
        v[j + len] = a - b;
      }
  for (int j = 0; j < kIndexerHeadDim; ++j) qh[j] = v[j] * s;
}

// INT32 products of one token's q-latent (int16-widened) with the 128 columns of one head,
// read from the packed weight (the same pair sums as the AVX2 tile; integers, so exact anyway).
inline void query_head_scalar(std::int32_t* out, const std::int16_t* a16, index_t K,
                              const std::int8_t* wpk) {
  const index_t KP = K / 2;
  for (int nb = 0; nb < 8; ++nb) {
    std::int32_t acc[16] = {};
    const std::int8_t* wp = wpk + nb * KP * 32;
    for (index_t kp = 0; kp < KP; ++kp)
      for (int c = 0; c < 16; ++c)
        acc[c] += std::int32_t(wp[kp * 32 + 2 * c]) * a16[2 * kp] +
                  std::int32_t(wp[kp * 32 + 2 * c + 1]) * a16[2 * kp + 1];
    for (int c = 0; c < 16; ++c) out[nb * 16 + c] = acc[c];
  }
}

#if TILEDECODE_X86
// One token tile of one head on the vector tiers: the INT32 GEMM (avx2: int16-widened a16 on
// vpmaddwd; avx2_vnni / avx512: the INT8 rows a8 (row stride lda) on 256- / 512-bit vpdpbusd,
// the same exact integers),
// then the shared epilogue.
template <int TT>
inline void query_tile_avx2(cpu::Isa isa, std::int32_t* acc, float* x, float* qh,
                            const std::int16_t* a16, const std::int8_t* a8, index_t lda, index_t K,
                            const std::int8_t* wpk, const float* qs, const float* ws,
                            const float* rc, const float* rs, const IndexerQueryWeights& wq,
                            std::int8_t* const* q_out, float* const* sc_out) {
  if (isa == cpu::Isa::avx512) {
    std::int32_t a_sum[TT];
    for (int tt = 0; tt < TT; ++tt) a_sum[tt] = cpu::avx512::i8_sum(a8 + tt * lda, K);
    cpu::avx512::query_head_tile<TT>(acc, a8, lda, a_sum, K, wpk);
  } else if (isa == cpu::Isa::avx2_vnni) {
    std::int32_t a_sum[TT];
    for (int tt = 0; tt < TT; ++tt) a_sum[tt] = cpu::avx2_vnni::i8_sum(a8 + tt * lda, K);
    cpu::avx2_vnni::query_head_tile<TT>(acc, a8, lda, a_sum, K, wpk);
  } else {
    cpu::avx2::query_head_tile<TT>(acc, a16, K, wpk);
  }
  for (int tt = 0; tt < TT; ++tt)
    cpu::avx2::query_dequant_rope(x + tt * 128, acc + tt * 128, qs[tt], ws, rc + tt * 64,
                                  rs + tt * 64);
  if (wq.sylvester) {
    for (int tt = 0; tt < TT; ++tt)
      cpu::avx2::fwht_128(qh + tt * 128, x + tt * 128, wq.hadamard_scale);
  } else {
    cpu::avx2::hadamard_tile<TT>(qh, x, wq.hadamard.data());
  }
  for (int tt = 0; tt < TT; ++tt)
    *sc_out[tt] = cpu::avx2::quantize_q8_128(q_out[tt], qh + tt * 128);
}
#endif

}  // namespace detail

// Packs idx_wq_b (Q_LORA, heads*128) INT8, idx_wq_b_scale (heads*128) FP32 and the rotation
// hadamard (128, 128) BF16 for indexer_query. Call once at load time (allocates).
inline IndexerQueryWeights pack_indexer_query_weights(const ModelConfig& cfg,
                                                      ConstView<std::int8_t, 2> idx_wq_b,
                                                      ConstView<float, 1> idx_wq_b_scale,
                                                      ConstView<bf16, 2> hadamard) {
  constexpr std::string_view where = "pack_indexer_query_weights";
  detail::check_indexer_config(where, cfg);
  const index_t K = cfg.q_lora, N = index_t(cfg.idx_n_heads) * kIndexerHeadDim;
  check_equal(where, "idx_wq_b.extent(0)", idx_wq_b.extent(0), K);
  check_equal(where, "idx_wq_b.extent(1)", idx_wq_b.extent(1), N);
  check_equal(where, "idx_wq_b_scale.extent(0)", idx_wq_b_scale.extent(0), N);
  check_equal<index_t>(where, "hadamard.extent(0)", hadamard.extent(0), kIndexerHeadDim);
  check_equal<index_t>(where, "hadamard.extent(1)", hadamard.extent(1), kIndexerHeadDim);
  IndexerQueryWeights p = IndexerQueryWeights::views(cfg, idx_wq_b, idx_wq_b_scale, hadamard);
  p.wq_b = Buffer<std::int8_t>(std::size_t(K * N));
  p.wq_b_scale = Buffer<float>(std::size_t(N));
  p.hadamard = Buffer<float>(std::size_t(kIndexerHeadDim * kIndexerHeadDim));
  const index_t KP = K / 2;
  for (index_t nb = 0; nb < N / 16; ++nb)
    for (index_t kp = 0; kp < KP; ++kp)
      for (index_t c = 0; c < 16; ++c)
        for (index_t e = 0; e < 2; ++e)
          p.wq_b[std::size_t(((nb * KP + kp) * 16 + c) * 2 + e)] =
              idx_wq_b(2 * kp + e, nb * 16 + c);
  for (index_t n = 0; n < N; ++n) p.wq_b_scale[std::size_t(n)] = idx_wq_b_scale(n);
  for (index_t i = 0; i < kIndexerHeadDim; ++i)
    for (index_t j = 0; j < kIndexerHeadDim; ++j)
      p.hadamard[std::size_t(i * kIndexerHeadDim + j)] = hadamard(i, j).to_float();
  // Exact Sylvester pattern with one positive magnitude → FWHT in the query path.
  const float sc = p.hadamard[0];
  bool syl = sc > 0.0f && std::isfinite(sc);
  for (index_t i = 0; i < kIndexerHeadDim && syl; ++i)
    for (index_t j = 0; j < kIndexerHeadDim && syl; ++j) {
      const bool neg = std::popcount(static_cast<std::uint64_t>(i & j)) & 1;
      syl = p.hadamard[std::size_t(i * kIndexerHeadDim + j)] == (neg ? -sc : sc);
    }
  p.sylvester = syl;
  p.hadamard_scale = syl ? sc : 0.0f;
  return p;
}

}  // namespace tiledecode::kernels

namespace tiledecode::cpu {

template <Isa I>
struct backend_ops_indexer_query {
  static constexpr bool vnni = has_vnni(I);
  static void check(const Cpu<I>&, const kernels::IndexerQueryArgs& a) {
    if (!a.wq->packed())
      throw_arg("indexer_query", "wq", "views only",
                "weights prepared by kernels::pack_indexer_query_weights (the CPU packed layout)");
  }
  // The GEMM and the epilogue of every (head, token tile) in one task (registers between them).
  static void project(const Cpu<I>& be, const kernels::IndexerQueryArgs& a) {
    using namespace kernels;
    const ModelConfig& cfg = *a.cfg;
    const IndexerQueryWeights& wq = *a.wq;
    const index_t T = a.tokens(), K = cfg.q_lora, H = cfg.idx_n_heads;
    // avx2_vnni: the GEMM reads qr's INT8 rows directly (no per-head int16 widening).
    static_assert(
        std::int64_t{kIndexerMaxQLora} * (128 * 128 + 255 * 128) < (std::int64_t{1} << 31),
        "the avx2_vnni query GEMM's INT32 bound (cpu::avx2_vnni::query_head_tile)");
    constexpr int TT = 4;  // token tile: 4 tokens × 16 columns = 8 INT32 accumulators
    be.tasks(H, [&](std::int64_t h) {
      alignas(32) std::int16_t a16[TT * kIndexerMaxQLora];
      alignas(32) std::int32_t acc[TT * 128];
      alignas(32) float x[TT * 128], qh[TT * 128], rc[TT * 64], rs[TT * 64];
      float qs[TT];
      std::int8_t* q_out[TT];
      float* sc_out[TT];
      const std::int8_t* wpk = wq.wq_b.data() + h * 8 * (K / 2) * 32;
      const float* ws = wq.wq_b_scale.data() + h * 128;
      for (index_t t0 = 0; t0 < T; t0 += TT) {
        const int nt = int(std::min<index_t>(TT, T - t0));
        for (int tt = 0; tt < nt; ++tt) {
          const index_t t = t0 + tt;
          if (!vnni)
            for (index_t k = 0; k < K; ++k) a16[tt * K + k] = a.qr(t, k);
          const bf16* c = a.rope.cos_row(a.rope_pos(t));
          const bf16* s = a.rope.sin_row(a.rope_pos(t));
          for (int i = 0; i < 32; ++i) {
            rc[tt * 64 + 2 * i] = rc[tt * 64 + 2 * i + 1] = c[i].to_float();
            rs[tt * 64 + 2 * i] = -s[i].to_float();
            rs[tt * 64 + 2 * i + 1] = s[i].to_float();
          }
          qs[tt] = a.qr_scale(t);
          q_out[tt] = &a.q_i8(t, h, 0);
          sc_out[tt] = &a.q_sc(t, h);
        }
#if TILEDECODE_X86
        if constexpr (has_avx2(I)) {
          const auto tile = [&]<int N>() {
            kernels::detail::query_tile_avx2<N>(I, acc, x, qh, a16, &a.qr(t0, 0), a.qr.stride(0), K,
                                                wpk, qs, ws, rc, rs, wq, q_out, sc_out);
          };
          switch (nt) {
            case 4:
              tile.template operator()<4>();
              break;
            case 3:
              tile.template operator()<3>();
              break;
            case 2:
              tile.template operator()<2>();
              break;
            default:
              tile.template operator()<1>();
              break;
          }
          continue;
        }
#endif
        for (int tt = 0; tt < nt; ++tt) {
          kernels::detail::query_head_scalar(acc, a16 + tt * K, K, wpk);
          kernels::detail::query_dequant_rope_scalar(x, acc, qs[tt], ws, rc + tt * 64,
                                                     rs + tt * 64);
          if (wq.sylvester) {
            kernels::detail::fwht_128_scalar(qh, x, wq.hadamard_scale);
          } else {
            kernels::detail::hadamard_row_scalar(qh, x, wq.hadamard.data());
          }
          *sc_out[tt] = quantize_q8(std::span<std::int8_t>(q_out[tt], kIndexerHeadDim),
                                    std::span<const float>(qh, kIndexerHeadDim));
        }
      }
    });
  }
  static void epilogue(const Cpu<I>&, const kernels::IndexerQueryArgs&) {}  // fused above
};

template <Isa I>
struct backend_ops_indexer_weights {
  // w[t,h] = (x_n[t] @ weights_proj)[h] * index_weights_scale: an FP32 FMA chain over ascending d,
  // parallel over token tiles of 4.
  static void weights(const Cpu<I>& be, const kernels::IndexerWeightsArgs& a) {
    const ModelConfig& cfg = *a.cfg;
    const index_t T = a.tokens(), D = cfg.hidden, H = cfg.idx_n_heads;
    const float scale = cfg.index_weights_scale();
    constexpr int TT = 4;
    be.tasks((T + TT - 1) / TT, [&](std::int64_t tile) {
      const index_t t0 = tile * TT;
      const int nt = int(std::min<index_t>(TT, T - t0));
#if TILEDECODE_X86
      if constexpr (has_avx2(I)) {
        for (index_t h0 = 0; h0 < H; h0 += 16) {
          const auto run = [&]<int N>() {
            avx2::weights_tile<N>(&a.w(t0, h0), a.w.stride(0), &a.x_n(t0, 0), a.x_n.stride(0),
                                  &a.weights_proj(0, h0), a.weights_proj.stride(0), D, scale);
          };
          switch (nt) {
            case 4:
              run.template operator()<4>();
              break;
            case 3:
              run.template operator()<3>();
              break;
            case 2:
              run.template operator()<2>();
              break;
            default:
              run.template operator()<1>();
              break;
          }
        }
        return;
      }
#endif
      for (index_t t = t0; t < t0 + nt; ++t)
        for (index_t h = 0; h < H; ++h) {
          float acc = 0.0f;
          for (index_t d = 0; d < D; ++d)
            acc = std::fma(a.x_n(t, d).to_float(), a.weights_proj(d, h).to_float(), acc);
          a.w(t, h) = acc * scale;
        }
    });
  }
};

template <Isa I>
struct backend_ops_indexer_score {
  static constexpr index_t kChunk = 512;  // columns per task: 4 pages
  static void check(const Cpu<I>&, const kernels::IndexerScoreArgs&) {}
  struct Lane {
    float coef[kernels::kIndexerMaxHeads];
    alignas(32) std::int32_t qp[kernels::kIndexerMaxHeads * 64];  // avx2: int16 pairs; vnni: dwords
    alignas(32) std::int32_t q_bias[kernels::kIndexerMaxHeads];
    index_t c0 = 0, c1 = 0;  // the task's columns
  };
  // Tasks (token, 512-column chunk): a chunk's pages; every column is written by one task.
  template <class Body>
  static void for_items(const Cpu<I>& be, const kernels::IndexerScoreArgs& a, Body&& body) {
    const index_t width = a.score.extent(1), page = a.page_rows();
    const index_t n_chunks = (width + kChunk - 1) / kChunk;
    be.tasks(a.tokens() * n_chunks, [&](std::int64_t task) {
      const index_t t = task / n_chunks, c0 = (task % n_chunks) * kChunk;
      Lane lane;
      lane.c0 = c0;
      lane.c1 = std::min(width, c0 + kChunk);
      const index_t vis = a.visible(t);
      const index_t v1 = std::min(lane.c1, vis);
      // The chunk's visible pages (none when the chunk starts past vis).
      const index_t first = c0 / page, last = c0 < v1 ? (v1 + page - 1) / page : first;
      body(lane, kernels::ScoreItem{t, vis, first, last, 1});
    });
  }
  static void begin_item(Lane& z, const kernels::IndexerScoreArgs& a,
                         const kernels::ScoreItem& it) {
    if (it.first >= it.last) return;
    const int n_heads = a.cfg->idx_n_heads;
    for (int h = 0; h < n_heads; ++h) z.coef[h] = a.q_sc(it.t, h) * a.w(it.t, h);
    const std::int8_t* q = &a.q_i8(it.t, 0, 0);
    if constexpr (has_vnni(I)) {
      kernels::detail::pack_query_vnni(z.qp, z.q_bias, q, a.q_i8.stride(1), n_heads);
    } else if constexpr (has_avx2(I)) {
      kernels::detail::pack_query_pairs(z.qp, q, a.q_i8.stride(1), n_heads);
    }
  }
  // The page's visible rows of the chunk in 16-row key blocks.
  static void score_page(Lane& z, const kernels::IndexerScoreArgs& a, const kernels::ScoreItem& it,
                         index_t p) {
    const index_t page = a.page_rows(), b = it.t / a.seq;
    const int n_heads = a.cfg->idx_n_heads;
    float* out = &a.score(it.t, 0);
    const index_t j0 = std::max(z.c0, p * page);
    const index_t j1 = std::min({z.c1, it.vis, (p + 1) * page});
    [[maybe_unused]] const std::int8_t* q = &a.q_i8(it.t, 0, 0);
    for (index_t j = j0; j < j1; j += 16) {
      const index_t row = rules::indexer_key_row(a.idx_block_table, b, j, page);
      const int n = int(std::min<index_t>(16, j1 - j));
      const std::int8_t* k = &a.idx_kv_cache(row, 0);
      const float* ksc = &a.idx_kv_scale(row);
#if TILEDECODE_X86
      if constexpr (I == Isa::avx512) {
        alignas(64) float tmp[16];
        avx512::score_block16(tmp, k, a.idx_kv_cache.stride(0), ksc, z.qp, z.q_bias, z.coef,
                              n_heads);
        std::memcpy(out + j, tmp, sizeof(float) * std::size_t(n));
        continue;
      } else if constexpr (I == Isa::avx2_vnni) {
        alignas(32) float tmp[16];
        avx2_vnni::score_block16(tmp, k, a.idx_kv_cache.stride(0), ksc, z.qp, z.q_bias, z.coef,
                                 n_heads);
        std::memcpy(out + j, tmp, sizeof(float) * std::size_t(n));
        continue;
      } else if constexpr (has_avx2(I)) {
        alignas(32) float tmp[16];
        avx2::score_block16(tmp, k, a.idx_kv_cache.stride(0), ksc, z.qp, z.coef, n_heads);
        std::memcpy(out + j, tmp, sizeof(float) * std::size_t(n));
        continue;
      }
#endif
      kernels::detail::score_rows_scalar(out + j, n, k, a.idx_kv_cache.stride(0), ksc, q,
                                         a.q_i8.stride(1), z.coef, n_heads);
    }
  }
  static void end_item(Lane& z, const kernels::IndexerScoreArgs& a, const kernels::ScoreItem& it) {
    float* out = &a.score(it.t, 0);
    std::fill(out + std::max(z.c0, std::min(z.c1, it.vis)), out + z.c1, kNegBig);
  }
};

template <Isa I>
struct backend_ops_indexer_topk {
  static void check(const Cpu<I>&, const kernels::IndexerTopkArgs&) {}
  struct Lane {};
  template <class Body>
  static void for_rows(const Cpu<I>& be, const kernels::IndexerTopkArgs& a, Body&& body) {
    be.tasks(a.tokens(), [&](std::int64_t t) {
      Lane lane;
      body(lane, t);
    });
  }
  static void topk_row(Lane&, const kernels::IndexerTopkArgs& a, index_t t) {
    tile::topk_row(std::span<std::int32_t>(&a.topk_idxs(t, 0), std::size_t(a.topk_idxs.extent(1))),
                   std::span<const float>(&a.score(t, 0), std::size_t(a.visible(t))), a.topk,
                   a.offset);
  }
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::IndexerQuery, cpu::Cpu<I>> : cpu::backend_ops_indexer_query<I> {};
template <cpu::Isa I>
struct backend_ops<kernels::IndexerWeights, cpu::Cpu<I>> : cpu::backend_ops_indexer_weights<I> {};
template <cpu::Isa I>
struct backend_ops<kernels::IndexerScore, cpu::Cpu<I>> : cpu::backend_ops_indexer_score<I> {};
template <cpu::Isa I>
struct backend_ops<kernels::IndexerTopk, cpu::Cpu<I>> : cpu::backend_ops_indexer_topk<I> {};
}  // namespace tiledecode
