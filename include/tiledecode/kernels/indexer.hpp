#pragma once
// Lightning indexer (spec §7), CPU fast path: query path, head weights, fused score, top-k.
// The algorithm is written once here against views; the AVX2 micro-kernels (and the AVX-VNNI
// score and query-GEMM kernels of Isa::avx2_vnni) live in backend/cpu/indexer_avx2.hpp and are
// chosen by ctx.isa (the caller's single dispatch point).
// The scalar twins below perform the same floating-point operations in the same order, so the
// scalar and AVX2 paths are bit-identical, and every output element is produced by exactly one
// task with a fixed order, so results are bit-identical for any thread count.
//
// Decode-step composition (CSA layer, spec §9.2):
//   indexer_rope_positions(rope_pos, positions, S)             rope_pos[t] = start_b  [QUIRK]
//   indexer_query(ctx, cfg, q_i8, q_sc, qr, qr_scale, packed_wq, rope_pos, rope_csa)
//   indexer_weights(ctx, cfg, w, x_n, weights_proj)
//   (inner compressor writes idx_kv_cache / idx_kv_scale)
//   indexer_score(ctx, cfg, score, q_i8, q_sc, w, idx_kv_cache, idx_kv_scale, idx_block_table,
//                 positions, kv_seq_lens, S)
//   indexer_topk(ctx, cfg, topk_idxs, score, positions, kv_seq_lens, S, cfg.idx_topk, 0)
//
// Choices for the spec's open points:
//  * [QUIRK §5/§11.1] The query RoPE position is an explicit per-token input `rope_pos[t]`; the
//    reference CSA composition rotates both S tokens at start_b (indexer_rope_positions builds
//    that list). Passing position_ids instead gives the "pos_t" variant.
//  * [§11.4] The score tail j >= vis_t is written with kNegBig over the whole row, never stale.
//  * An unmapped page (-1, or a column past the table width) inside a token's visible range is
//    an error: the row the score must read does not exist. -1 outside every visible range is fine.
//  * [§11.3] Top-k ties: descending score, ascending column; NaN is never selected; all slots of
//    the output row are written (-1 padding), also when NaN leaves fewer than min(k, vis) winners.
//  * INT8 dot: int16 widening + vpmaddwd, exact for all int8 inputs including -128 (see
//    indexer_avx2.hpp for the choice and the INT32 bounds); no clamping or validation of values.
//    On Isa::avx2_vnni the score and the query GEMM run on vpdpbusd with one operand offset to u8
//    and the offset undone exactly (same integers, so outputs are bit-identical to avx2).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/indexer_avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/topk.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode::kernels {

// Fixed tile limits of this implementation (stack tiles, no allocation on the hot path).
inline constexpr int kIndexerHeadDim = 128;    // idx_head_dim (the micro-kernels' row width)
inline constexpr int kIndexerMaxHeads = 64;    // idx_n_heads, a multiple of 16
inline constexpr int kIndexerMaxQLora = 4096;  // q_lora, even (INT32 bounds: avx2 < 2^17,
                                               // avx2_vnni <= 43804; indexer_avx2.hpp)

// Visible compressed rows of a token (spec §7.2): min(kv_len // 4, (pos + 1) // 4, score_len).
inline int indexer_visible_rows(const ModelConfig& cfg, int pos, int kv_len) {
  return std::min({kv_len / 4, (pos + 1) / 4, cfg.score_len()});
}

// rope_pos[t] = positions[(t / seq) * seq] = start_b: the indexer query rotation position of the
// reference CSA composition (spec §5 [QUIRK]). dst and positions are (T) INT32, T % seq == 0.
inline void indexer_rope_positions(View<std::int32_t, 1> dst, ConstView<std::int32_t, 1> positions,
                                   int seq) {
  constexpr std::string_view where = "indexer_rope_positions";
  check_range(where, "seq", seq, 1, 1 << 20);
  check_equal(where, "dst.extent(0)", dst.extent(0), positions.extent(0));
  if (positions.extent(0) % seq != 0) {
    throw_arg(where, "positions.extent(0)", positions.extent(0), "a multiple of seq");
  }
  for (index_t t = 0; t < positions.extent(0); ++t) dst(t) = positions((t / seq) * seq);
}

// idx_wq_b, its column scales and the Hadamard matrix, packed once at load time.
//   wq_b       (N/16, Q_LORA/2, 16 columns, 2 k) INT8, N = heads * 128: column block nb holds
//              columns nb*16..nb*16+15; byte [c*2 + (k & 1)] of pair row kp is W[2kp + (k&1), col]
//   wq_b_scale (N) FP32
//   hadamard   (128, 128) FP32 (exact values of the BF16 matrix)
//   sylvester  the matrix is exactly s·(-1)^popcount(i&j) with s = hadamard_scale > 0 (the CSA
//              rotation): the query path then uses a fast Walsh–Hadamard transform (7·128
//              adds instead of 128² FMAs); any other matrix (e.g. the standalone reference
//              test's random one) is multiplied as given.
struct IndexerQueryWeights {
  int q_lora = 0;
  int n_heads = 0;
  Buffer<std::int8_t> wq_b;
  Buffer<float> wq_b_scale;
  Buffer<float> hadamard;
  bool sylvester = false;
  float hadamard_scale = 0.0f;
};

namespace detail {

inline void check_indexer_config(std::string_view where, const ModelConfig& cfg) {
  check_equal(where, "cfg.idx_head_dim", cfg.idx_head_dim, kIndexerHeadDim);
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, 64);
  if (cfg.idx_n_heads < 16 || cfg.idx_n_heads > kIndexerMaxHeads || cfg.idx_n_heads % 16 != 0) {
    throw_arg(where, "cfg.idx_n_heads", cfg.idx_n_heads, "a multiple of 16 in [16, 64]");
  }
  if (cfg.q_lora < 2 || cfg.q_lora > kIndexerMaxQLora || cfg.q_lora % 2 != 0) {
    throw_arg(where, "cfg.q_lora", cfg.q_lora, "an even value in [2, 4096]");
  }
  check_equal(where, "cfg.page", cfg.page, 128);
}

template <class V>
void check_unit_stride(std::string_view where, std::string_view arg, const V& v) {
  constexpr std::size_t last = std::tuple_size_v<typename V::Extents> - 1;
  if (v.extent(last) > 1 && v.stride(last) != 1) {
    throw_arg(where, std::string(arg) + ".stride(" + std::to_string(last) + ")", v.stride(last),
              "1 (contiguous rows)");
  }
}

// Validates positions (T) / kv_seq_lens (B) / seq; returns B.
inline index_t check_indexer_metadata(std::string_view where, const ModelConfig& cfg,
                                      ConstView<std::int32_t, 1> positions,
                                      ConstView<std::int32_t, 1> kv_seq_lens, int seq) {
  check_range(where, "seq", seq, 1, 1 << 20);
  const index_t B = kv_seq_lens.extent(0);
  check_at_least<index_t>(where, "kv_seq_lens.extent(0)", B, 1);
  check_equal<index_t>(where, "positions.extent(0)", positions.extent(0), B * seq);
  for (index_t t = 0; t < positions.extent(0); ++t) {
    check_range(where, "positions[" + std::to_string(t) + "]", positions(t), 0, cfg.max_seq_len);
  }
  for (index_t b = 0; b < B; ++b) {
    check_range(where, "kv_seq_lens[" + std::to_string(b) + "]", kv_seq_lens(b), 0,
                cfg.max_seq_len + 1);
  }
  return B;
}

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
  for (int d = 0; d < kIndexerHeadDim; ++d) x[d] = float(acc[d]) * qs * ws[d];
  for (int i = 0; i < 32; ++i) {
    const float e = x[64 + 2 * i], o = x[64 + 2 * i + 1];
    x[64 + 2 * i] = std::fma(o, rs[2 * i], e * rc[2 * i]);
    x[64 + 2 * i + 1] = std::fma(e, rs[2 * i + 1], o * rc[2 * i + 1]);
  }
  for (int d = 0; d < kIndexerHeadDim; ++d) x[d] = round_bf16(x[d]);
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
// vpmaddwd; avx2_vnni: the INT8 rows a8 (row stride lda) on vpdpbusd, the same exact integers),
// then the shared epilogue.
template <int TT>
inline void query_tile_avx2(bool vnni, std::int32_t* acc, float* x, float* qh,
                            const std::int16_t* a16, const std::int8_t* a8, index_t lda, index_t K,
                            const std::int8_t* wpk, const float* qs, const float* ws,
                            const float* rc, const float* rs, const IndexerQueryWeights& wq,
                            std::int8_t* const* q_out, float* const* sc_out) {
  if (vnni) {
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
  IndexerQueryWeights p;
  p.q_lora = cfg.q_lora;
  p.n_heads = cfg.idx_n_heads;
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

// Indexer query path (spec §7.1), per token t and head h:
//   qi = (qr[t] @ idx_wq_b)_int32 * qr_scale[t] * idx_wq_b_scale
//   x  = bf16([qi[0:64], rope_forward(qi[64:128], rope_pos[t])])      (interleaved pairs)
//   qh = x @ hadamard (a FWHT when the packed matrix is Sylvester) ; q_i8, q_sc = Q8(qh)
// Shapes: q_i8 (T, heads, 128) INT8, q_sc (T, heads) FP32, qr (T, Q_LORA) INT8 (any value,
// -128 included), qr_scale (T) FP32, rope_pos (T) INT32 in [0, rope.length()); rope: the
// layer's table (CSA: compress_rope_theta + YaRN). Parallel over heads, token tiles of 4.
// The INT32 GEMM per (head, tile): avx2 widens the tile's qr rows to int16 (vpmaddwd);
// avx2_vnni reads the INT8 rows in place and runs vpdpbusd on the same packed weights, offset
// to u8 in registers, with accumulators starting at -128·Σ_k qr[t][k] (exactness bound at
// cpu::avx2_vnni::query_head_tile): no extra packed memory, bit-identical outputs.
inline void indexer_query(const cpu::Context& ctx, const ModelConfig& cfg,
                          View<std::int8_t, 3> q_i8, View<float, 2> q_sc,
                          ConstView<std::int8_t, 2> qr, ConstView<float, 1> qr_scale,
                          const IndexerQueryWeights& wq, ConstView<std::int32_t, 1> rope_pos,
                          const RopeTableView& rope) {
  constexpr std::string_view where = "indexer_query";
  detail::check_indexer_config(where, cfg);
  const index_t T = qr.extent(0), K = cfg.q_lora, H = cfg.idx_n_heads;
  check_equal(where, "wq.q_lora", wq.q_lora, cfg.q_lora);
  check_equal(where, "wq.n_heads", wq.n_heads, cfg.idx_n_heads);
  check_equal(where, "qr.extent(1)", qr.extent(1), K);
  check_equal(where, "qr_scale.extent(0)", qr_scale.extent(0), T);
  check_equal(where, "rope_pos.extent(0)", rope_pos.extent(0), T);
  check_equal(where, "q_i8.extent(0)", q_i8.extent(0), T);
  check_equal(where, "q_i8.extent(1)", q_i8.extent(1), H);
  check_equal<index_t>(where, "q_i8.extent(2)", q_i8.extent(2), kIndexerHeadDim);
  check_equal(where, "q_sc.extent(0)", q_sc.extent(0), T);
  check_equal(where, "q_sc.extent(1)", q_sc.extent(1), H);
  check_equal<index_t>(where, "rope.cos.extent(1)", rope.cos.extent(1), 64);
  check_equal<index_t>(where, "rope.sin.extent(1)", rope.sin.extent(1), 64);
  check_equal(where, "rope.sin.extent(0)", rope.sin.extent(0), rope.cos.extent(0));
  detail::check_unit_stride(where, "q_i8", q_i8);
  detail::check_unit_stride(where, "qr", qr);
  detail::check_unit_stride(where, "rope.cos", rope.cos);
  detail::check_unit_stride(where, "rope.sin", rope.sin);
  for (index_t t = 0; t < T; ++t) {
    check_range<index_t>(where, "rope_pos[" + std::to_string(t) + "]", rope_pos(t), 0,
                         rope.length());
  }
  const cpu::Isa isa = cpu::checked_isa(ctx.isa);
  // avx2_vnni: the GEMM reads qr's INT8 rows directly (no per-head int16 widening).
  static_assert(std::int64_t{kIndexerMaxQLora} * (128 * 128 + 255 * 128) < (std::int64_t{1} << 31),
                "the avx2_vnni query GEMM's INT32 bound (cpu::avx2_vnni::query_head_tile)");
  const bool vnni = isa == cpu::Isa::avx2_vnni;
  constexpr int TT = 4;  // token tile: 4 tokens × 16 columns = 8 INT32 accumulators
  ctx.parallel_for(0, H, 1, [&](std::int64_t h) {
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
          for (index_t k = 0; k < K; ++k) a16[tt * K + k] = qr(t, k);
        const bf16* c = rope.cos_row(rope_pos(t));
        const bf16* s = rope.sin_row(rope_pos(t));
        for (int i = 0; i < 32; ++i) {
          rc[tt * 64 + 2 * i] = rc[tt * 64 + 2 * i + 1] = c[i].to_float();
          rs[tt * 64 + 2 * i] = -s[i].to_float();
          rs[tt * 64 + 2 * i + 1] = s[i].to_float();
        }
        qs[tt] = qr_scale(t);
        q_out[tt] = &q_i8(t, h, 0);
        sc_out[tt] = &q_sc(t, h);
      }
#if TILEDECODE_X86
      if (cpu::has_avx2(isa)) {
        const auto tile = [&]<int N>() {
          detail::query_tile_avx2<N>(vnni, acc, x, qh, a16, &qr(t0, 0), qr.stride(0), K, wpk, qs,
                                     ws, rc, rs, wq, q_out, sc_out);
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
        detail::query_head_scalar(acc, a16 + tt * K, K, wpk);
        detail::query_dequant_rope_scalar(x, acc, qs[tt], ws, rc + tt * 64, rs + tt * 64);
        if (wq.sylvester) {
          detail::fwht_128_scalar(qh, x, wq.hadamard_scale);
        } else {
          detail::hadamard_row_scalar(qh, x, wq.hadamard.data());
        }
        *sc_out[tt] = quantize_q8(std::span<std::int8_t>(q_out[tt], kIndexerHeadDim),
                                  std::span<const float>(qh, kIndexerHeadDim));
      }
    }
  });
}

// Head weights (spec §7.1): w[t,h] = (x_n[t] @ weights_proj)[h] * index_weights_scale, an FP32
// FMA chain over ascending d. w (T, heads) FP32, x_n (T, D) BF16, weights_proj (D, heads) BF16.
// Parallel over token tiles of 4.
inline void indexer_weights(const cpu::Context& ctx, const ModelConfig& cfg, View<float, 2> w,
                            ConstView<bf16, 2> x_n, ConstView<bf16, 2> weights_proj) {
  constexpr std::string_view where = "indexer_weights";
  detail::check_indexer_config(where, cfg);
  const index_t T = x_n.extent(0), D = cfg.hidden, H = cfg.idx_n_heads;
  check_equal(where, "x_n.extent(1)", x_n.extent(1), D);
  check_equal(where, "weights_proj.extent(0)", weights_proj.extent(0), D);
  check_equal(where, "weights_proj.extent(1)", weights_proj.extent(1), H);
  check_equal(where, "w.extent(0)", w.extent(0), T);
  check_equal(where, "w.extent(1)", w.extent(1), H);
  detail::check_unit_stride(where, "w", w);
  detail::check_unit_stride(where, "x_n", x_n);
  detail::check_unit_stride(where, "weights_proj", weights_proj);
  const cpu::Isa isa = cpu::checked_isa(ctx.isa);
  const float scale = cfg.index_weights_scale();
  constexpr int TT = 4;
  ctx.parallel_for(0, (T + TT - 1) / TT, 1, [&](std::int64_t tile) {
    const index_t t0 = tile * TT;
    const int nt = int(std::min<index_t>(TT, T - t0));
#if TILEDECODE_X86
    if (cpu::has_avx2(isa)) {
      for (index_t h0 = 0; h0 < H; h0 += 16) {
        const auto run = [&]<int N>() {
          cpu::avx2::weights_tile<N>(&w(t0, h0), w.stride(0), &x_n(t0, 0), x_n.stride(0),
                                     &weights_proj(0, h0), weights_proj.stride(0), D, scale);
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
          acc = std::fma(x_n(t, d).to_float(), weights_proj(d, h).to_float(), acc);
        w(t, h) = acc * scale;
      }
  });
}

// Fused indexer score (spec §7.2). For token t of request b = t / seq:
//   vis_t = min(kv_seq_lens[b] // 4, (positions[t] + 1) // 4, 4096)
//   score[t, j] = k_sc[j] * Σ_h w[t,h] * relu(q_sc[t,h] * (q_i8[t,h] · k_i8[j]))   j < vis_t
//   score[t, j] = kNegBig                                                           j >= vis_t
// Key j of request b is pool row idx_block_table[b, j / 128] * 128 + j % 128.
// Shapes: score (T, 4096) FP32; q_i8 (T, heads, 128) INT8; q_sc (T, heads) FP32, > 0 (Q8 scales;
// the ReLU is applied to the integer dot); w (T, heads) FP32 (any sign); idx_kv_cache
// (blocks*128, 128) INT8 (any value); idx_kv_scale (blocks*128) FP32; idx_block_table (B, cols)
// INT32, entries in [-1, blocks), -1 = unmapped (an error inside a visible range); positions (T)
// INT32 absolute positions; kv_seq_lens (B) INT32 raw (uncompressed) lengths; T = B * seq.
// One pass per 128-row page: for each 16-row block all 64 head dots are computed and reduced
// (dequant, ReLU, weight, head sum, key scale) while the INT32 results are in registers; no
// scratch. Tasks: (token, 512-column chunk); each column is written by exactly one task.
inline void indexer_score(const cpu::Context& ctx, const ModelConfig& cfg, View<float, 2> score,
                          ConstView<std::int8_t, 3> q_i8, ConstView<float, 2> q_sc,
                          ConstView<float, 2> w, ConstView<std::int8_t, 2> idx_kv_cache,
                          ConstView<float, 1> idx_kv_scale,
                          ConstView<std::int32_t, 2> idx_block_table,
                          ConstView<std::int32_t, 1> positions,
                          ConstView<std::int32_t, 1> kv_seq_lens, int seq) {
  constexpr std::string_view where = "indexer_score";
  detail::check_indexer_config(where, cfg);
  const index_t B = detail::check_indexer_metadata(where, cfg, positions, kv_seq_lens, seq);
  const index_t T = positions.extent(0), H = cfg.idx_n_heads, page = cfg.page;
  check_equal<index_t>(where, "score.extent(0)", score.extent(0), T);
  check_equal<index_t>(where, "score.extent(1)", score.extent(1), cfg.score_len());
  check_equal(where, "q_i8.extent(0)", q_i8.extent(0), T);
  check_equal(where, "q_i8.extent(1)", q_i8.extent(1), H);
  check_equal<index_t>(where, "q_i8.extent(2)", q_i8.extent(2), kIndexerHeadDim);
  check_equal(where, "q_sc.extent(0)", q_sc.extent(0), T);
  check_equal(where, "q_sc.extent(1)", q_sc.extent(1), H);
  check_equal(where, "w.extent(0)", w.extent(0), T);
  check_equal(where, "w.extent(1)", w.extent(1), H);
  check_equal<index_t>(where, "idx_kv_cache.extent(1)", idx_kv_cache.extent(1), kIndexerHeadDim);
  const index_t rows = idx_kv_cache.extent(0);
  if (rows < page || rows % page != 0) {
    throw_arg(where, "idx_kv_cache.extent(0)", rows, "a positive multiple of 128 (pool rows)");
  }
  const index_t blocks = rows / page;
  check_equal(where, "idx_kv_scale.extent(0)", idx_kv_scale.extent(0), rows);
  check_equal(where, "idx_block_table.extent(0)", idx_block_table.extent(0), B);
  detail::check_unit_stride(where, "score", score);
  detail::check_unit_stride(where, "q_i8", q_i8);
  detail::check_unit_stride(where, "idx_kv_cache", idx_kv_cache);
  detail::check_unit_stride(where, "idx_kv_scale", idx_kv_scale);
  for (index_t t = 0; t < T; ++t)
    for (index_t h = 0; h < H; ++h)
      if (!(q_sc(t, h) > 0.0f) || !std::isfinite(q_sc(t, h))) {
        throw_arg(where, "q_sc[" + std::to_string(t) + "," + std::to_string(h) + "]", q_sc(t, h),
                  "a finite value > 0 (a Q8 scale)");
      }
  for (index_t b = 0; b < B; ++b)
    for (index_t c = 0; c < idx_block_table.extent(1); ++c) {
      const std::int32_t blk = idx_block_table(b, c);
      if (blk < -1 || blk >= blocks) {
        throw_arg(where, "idx_block_table[" + std::to_string(b) + "," + std::to_string(c) + "]",
                  blk, "[-1, " + std::to_string(blocks) + ") (pool blocks)");
      }
    }
  for (index_t t = 0; t < T; ++t) {
    const index_t b = t / seq;
    const int vis = indexer_visible_rows(cfg, positions(t), kv_seq_lens(b));
    const index_t pages = (vis + page - 1) / page;
    if (pages > idx_block_table.extent(1)) {
      throw_arg(
          where, "idx_block_table.extent(1)", idx_block_table.extent(1),
          ">= " + std::to_string(pages) + " (visible pages of token " + std::to_string(t) + ")");
    }
    for (index_t c = 0; c < pages; ++c)
      if (idx_block_table(b, c) < 0) {
        throw_arg(where, "idx_block_table[" + std::to_string(b) + "," + std::to_string(c) + "]",
                  idx_block_table(b, c),
                  "a mapped block: page inside the visible range of token " + std::to_string(t));
      }
  }

  const cpu::Isa isa = cpu::checked_isa(ctx.isa);
  constexpr index_t kChunk = 512;  // columns per task: 4 pages
  const index_t width = score.extent(1);
  const index_t n_chunks = (width + kChunk - 1) / kChunk;
  const int n_heads = int(H);
  ctx.parallel_for(0, T * n_chunks, 1, [&](std::int64_t task) {
    const index_t t = task / n_chunks, c0 = (task % n_chunks) * kChunk;
    const index_t c1 = std::min(width, c0 + kChunk);
    const index_t b = t / seq;
    const index_t vis = indexer_visible_rows(cfg, positions(t), kv_seq_lens(b));
    float* out = &score(t, 0);
    const index_t v1 = std::min(c1, vis);
    if (c0 < v1) {
      float coef[kIndexerMaxHeads];
      for (int h = 0; h < n_heads; ++h) coef[h] = q_sc(t, h) * w(t, h);
      const std::int8_t* q = &q_i8(t, 0, 0);
      alignas(32) std::int32_t qp[kIndexerMaxHeads * 64];  // avx2: int16 pairs; vnni: dwords
      alignas(32) std::int32_t q_bias[kIndexerMaxHeads];
      if (isa == cpu::Isa::avx2_vnni) {
        detail::pack_query_vnni(qp, q_bias, q, q_i8.stride(1), n_heads);
      } else if (cpu::has_avx2(isa)) {
        detail::pack_query_pairs(qp, q, q_i8.stride(1), n_heads);
      }
      for (index_t j = c0; j < v1; j += 16) {
        const index_t blk = idx_block_table(b, j / page);
        const index_t row = blk * page + j % page;
        const int n = int(std::min<index_t>(16, v1 - j));
        const std::int8_t* k = &idx_kv_cache(row, 0);
        const float* ksc = &idx_kv_scale(row);
#if TILEDECODE_X86
        if (isa == cpu::Isa::avx2_vnni) {
          alignas(32) float tmp[16];
          cpu::avx2_vnni::score_block16(tmp, k, idx_kv_cache.stride(0), ksc, qp, q_bias, coef,
                                        n_heads);
          std::memcpy(out + j, tmp, sizeof(float) * std::size_t(n));
          continue;
        }
        if (cpu::has_avx2(isa)) {
          alignas(32) float tmp[16];
          cpu::avx2::score_block16(tmp, k, idx_kv_cache.stride(0), ksc, qp, coef, n_heads);
          std::memcpy(out + j, tmp, sizeof(float) * std::size_t(n));
          continue;
        }
#endif
        detail::score_rows_scalar(out + j, n, k, idx_kv_cache.stride(0), ksc, q, q_i8.stride(1),
                                  coef, n_heads);
      }
    }
    std::fill(out + std::max(c0, std::min(c1, vis)), out + c1, kNegBig);
  });
}

// Indexer top-k (spec §7.3): row t takes the min(topk, vis_t) best of score[t, 0:vis_t]
// (descending score, ascending column on ties, NaN never selected), adds `offset` (0 in the CSA
// composition, 128 = WIN in the standalone reference test) and writes -1 into every other slot.
// topk_idxs (T, W) INT32 with W >= topk; score (T, N) FP32 with N >= 1; topk in [1, N] (512
// flash, 1024 pro); offset in [0, INT32_MAX - N]; vis_t as in indexer_score (clamped to N).
// Selection is O(vis) per row, then the winners are sorted. Parallel over tokens.
inline void indexer_topk(const cpu::Context& ctx, const ModelConfig& cfg,
                         View<std::int32_t, 2> topk_idxs, ConstView<float, 2> score,
                         ConstView<std::int32_t, 1> positions,
                         ConstView<std::int32_t, 1> kv_seq_lens, int seq, int topk,
                         std::int32_t offset) {
  constexpr std::string_view where = "indexer_topk";
  detail::check_indexer_metadata(where, cfg, positions, kv_seq_lens, seq);
  const index_t T = positions.extent(0), N = score.extent(1);
  check_equal(where, "score.extent(0)", score.extent(0), T);
  check_equal(where, "topk_idxs.extent(0)", topk_idxs.extent(0), T);
  check_at_least<index_t>(where, "score.extent(1)", N, 1);
  check_range<index_t>(where, "topk", topk, 1, N + 1);
  check_at_least<index_t>(where, "topk_idxs.extent(1)", topk_idxs.extent(1), topk);
  check_range<index_t>(where, "offset", offset, 0,
                       index_t(std::numeric_limits<std::int32_t>::max()) - N + 1);
  detail::check_unit_stride(where, "topk_idxs", topk_idxs);
  detail::check_unit_stride(where, "score", score);
  ctx.parallel_for(0, T, 1, [&](std::int64_t t) {
    const index_t vis =
        std::min<index_t>(indexer_visible_rows(cfg, positions(t), kv_seq_lens(t / seq)), N);
    topk_row(std::span<std::int32_t>(&topk_idxs(t, 0), std::size_t(topk_idxs.extent(1))),
             std::span<const float>(&score(t, 0), std::size_t(vis)), topk, offset);
  });
}

}  // namespace tiledecode::kernels
