#pragma once
// q / kv projections with RoPE and the INT8 q-latent (spec §4 step 3, golden semantics):
//   cq   = rmsnorm(x_n @ wq_a, gamma_cq)                      FP32 [T, Q_LORA] (not rounded)
//   qr, qr_scale = Q8(cq)                                     per token (core/quant.hpp)
//   qf   = ((qr @ wq_b)_int32 * qr_scale) * wq_b_scale          FP32 [T, H*512] → [T, H, 512]
//   qf   = qf * rsqrt(mean_over_512(qf^2) + eps)             per-head RMSNorm, no weight
//   q    = bf16([qf[:448], rope_fwd(qf[448:], pos_t)])
//   kvf  = rmsnorm(x_n @ wkv, gamma_ckv)                      FP32 [T, 512]
//   kv   = bf16([kvf[:448], rope_fwd(kvf[448:], pos_t)])
// Numerical contract (the golden twin follows it too):
//   * x_n @ wq_a and x_n @ wkv: BF16 × BF16 products (exact in FP32) summed in FP32 in ascending
//     k — the spec's "FP32 accumulation" with its order fixed, so fast path and golden agree
//     bit for bit; qr @ wq_b: exact INT32.
//   * everything after the matmuls runs in double: the RMSNorms (Σx² , r = 1/sqrt(Σx²/n + eps),
//     x·r·gamma), the dequant acc·qr_scale·wq_b_scale, the per-head RMSNorm and the forward RoPE
//     (interleaved pairs, BF16 table values); results are stored as FP32 (cq, kvf) or rounded
//     to BF16 via FP32 (q, kv). Negligible cost, and it keeps cq on the reference's side of Q8's
//     rounding boundaries (one flipped qr value changes a whole token's q).
// The RoPE table is the layer's (SWA: plain; CSA/HCA: YaRN), read at pos_t = position_ids[t].
//
// Fast path: the weights are streamed once per step for all T tokens (axpy order, see
// backend/cpu/decode_avx2.hpp). Tasks: 256-column tiles of wq_a and wkv; then one task per token
// (norms, Q8, kv RoPE); then one task per query head (its 512 columns of wq_b, tokens in chunks
// of 8; on Isa::avx2_vnni the wq_b matmul runs on vpdpbusd, on the load-time packed copy
// QkvWeights::wq_b_packed when the caller provides one: one contiguous 512 KB stream per head,
// register-resident accumulators: all 64 heads at T = 8 on one thread 2.0 → 1.4 ms; see
// cpu::avx2_vnni::matmul_i8_packed). Every output element has one
// producer and a fixed order: results do not depend on the thread count, and the scalar, AVX2
// and AVX-VNNI paths give identical matmul results.

#include <cmath>
#include <cstdint>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/backend/cpu/quant.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/rmsnorm.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tiledecode {

// wq_b repacked for the avx2_vnni tier (kernels::pack_qkv_wq_b, layout at
// cpu::avx2_vnni::matmul_i8_packed): u8 (w + 128) k-quads of 8 columns, column-vector-major, so
// one head's 512 columns × Q_LORA rows are one contiguous run (512 KB for flash) and every 32-byte
// load is a vpdpbusd operand. A second copy of wq_b, same size (flash: 32 MB per layer); the
// original stays (the avx2 / scalar tiers, the golden layer and the a2a3 backend read it).
struct QkvPackedWqB {
  index_t q_lora = 0;  // K
  index_t cols = 0;    // H*512
  Buffer<std::uint8_t> data;
};

// The q/kv projection weights of one layer (spec §2 layouts, used as x @ W).
struct QkvWeights {
  ConstView<bf16, 2> wq_a;         // (D, Q_LORA)
  ConstView<bf16, 1> gamma_cq;     // (Q_LORA)
  ConstView<std::int8_t, 2> wq_b;  // (Q_LORA, H*512)
  ConstView<float, 1> wq_b_scale;  // (H*512) per output column
  ConstView<bf16, 2> wkv;          // (D, 512)
  ConstView<bf16, 1> gamma_ckv;    // (512)
  // Optional packed copy of wq_b: used on Isa::avx2_vnni when present (same results).
  const QkvPackedWqB* wq_b_packed = nullptr;
};

// Caller scratch of qkv_projection (FP32 / INT32, T rows).
struct QkvScratch {
  View<float, 2> x;                // (T, D)       x_n widened to FP32
  View<float, 2> cq;               // (T, Q_LORA)  normed q-latent
  View<float, 2> kvf;              // (T, 512)     normed kv before RoPE
  View<std::int32_t, 2> qr_pairs;  // (T, Q_LORA/2) the INT8 matmul's operand staging: qr packed
                                   // as int16 pairs (avx2, scalar); [t, 0] = Σ_k qr[t, k] on
                                   // avx2_vnni (the sum that undoes vpdpbusd's u8 offset)
};

namespace kernels {

namespace detail {
// Scalar twins of the AVX2 axpy matmuls (same order of summation).
inline void matmul_bf16_axpy_scalar(float* dst, index_t dst_ld, const float* x, index_t x_ld, int T,
                                    const bf16* w, index_t w_ld, index_t K, index_t n0,
                                    index_t n1) {
  for (int t = 0; t < T; ++t)
    for (index_t n = n0; n < n1; ++n) dst[t * dst_ld + n] = 0.0f;
  for (index_t k = 0; k < K; ++k) {
    const bf16* wr = w + k * w_ld;
    for (int t = 0; t < T; ++t) {
      const float a = x[t * x_ld + k];
      float* d = dst + t * dst_ld;
      for (index_t n = n0; n < n1; ++n) d[n] += a * wr[n].to_float();
    }
  }
}

// Forward interleaved rotation of n dims in double with the BF16 table row (spec §5).
inline void rope_forward_f64(double* x, const bf16* cos_row, const bf16* sin_row, index_t n) {
  for (index_t i = 0; i < n / 2; ++i) {
    const double c = cos_row[i].to_float(), sn = sin_row[i].to_float();
    const double e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * sn;
    x[2 * i + 1] = e * sn + o * c;
  }
}

inline void matmul_i8_axpy_scalar(std::int32_t* acc, index_t acc_ld, const std::int8_t* a,
                                  index_t a_ld, int T, const std::int8_t* w, index_t w_ld,
                                  index_t K, index_t n0, index_t n1) {
  for (int t = 0; t < T; ++t)
    for (index_t j = 0; j < n1 - n0; ++j) acc[t * acc_ld + j] = 0;
  for (index_t k = 0; k < K; ++k) {
    const std::int8_t* wr = w + k * w_ld + n0;
    for (int t = 0; t < T; ++t) {
      const std::int32_t av = a[t * a_ld + k];
      std::int32_t* d = acc + t * acc_ld;
      for (index_t j = 0; j < n1 - n0; ++j) d[j] += av * std::int32_t(wr[j]);
    }
  }
}
}  // namespace detail

// Packs wq_b (Q_LORA, H*512) INT8 for the avx2_vnni tier (see QkvPackedWqB). Call once at load
// time (allocates Q_LORA·H·512 bytes); only useful where cpu::cpu_supports(Isa::avx2_vnni).
inline QkvPackedWqB pack_qkv_wq_b(const ModelConfig& cfg, ConstView<std::int8_t, 2> wq_b) {
  constexpr std::string_view where = "pack_qkv_wq_b";
  const index_t K = cfg.q_lora, N = index_t(cfg.n_heads) * cfg.head_dim;
  if (K % 4 != 0) throw_arg(where, "cfg.q_lora", K, "a multiple of 4");
  if (N % 8 != 0) throw_arg(where, "cfg.n_heads * cfg.head_dim", N, "a multiple of 8");
  check_equal(where, "wq_b.extent(0)", wq_b.extent(0), K);
  check_equal(where, "wq_b.extent(1)", wq_b.extent(1), N);
  QkvPackedWqB p;
  p.q_lora = K;
  p.cols = N;
  p.data = Buffer<std::uint8_t>(std::size_t(K * N));
  const index_t KQ = K / 4;
  // Rows in order (sequential reads); byte 4j + i of quad q of vector v = w[4q + i][8v + j] + 128.
  for (index_t k = 0; k < K; ++k)
    for (index_t n = 0; n < N; ++n)
      p.data[std::size_t(((n / 8) * KQ + k / 4) * 32 + (n % 8) * 4 + k % 4)] =
          std::uint8_t(std::uint8_t(wq_b(k, n)) ^ 0x80u);
  return p;
}

// q (T, H, 512) BF16, kv (T, 512) BF16, qr (T, Q_LORA) INT8, qr_scale (T) FP32
//   ← x_n (T, D) BF16, the layer's QkvWeights, its RoPE table, position_ids (T).
// position_ids[t] must lie in [0, rope.length()). Scratch views per QkvScratch.
// Throws tiledecode::Error on any shape or position mismatch, before writing anything.
inline void qkv_projection(const cpu::Context& ctx, View<bf16, 3> q, View<bf16, 2> kv,
                           View<std::int8_t, 2> qr, View<float, 1> qr_scale, ConstView<bf16, 2> x_n,
                           const QkvWeights& w, RopeTableView rope,
                           ConstView<std::int32_t, 1> position_ids, QkvScratch s,
                           const ModelConfig& cfg) {
  constexpr std::string_view where = "qkv_projection";
  const index_t T = x_n.extent(0), D = cfg.hidden, QL = cfg.q_lora, H = cfg.n_heads;
  const index_t HD = cfg.head_dim, NOPE = cfg.nope_dim(), RD = cfg.rope_dim;
  constexpr index_t kMaxHeadDim = 512;
  if (HD > kMaxHeadDim || HD % 16 != 0)
    throw_arg(where, "cfg.head_dim", HD, "a multiple of 16 <= 512");
  if (QL % 256 != 0) throw_arg(where, "cfg.q_lora", QL, "a multiple of 256");
  if (HD % 256 != 0) throw_arg(where, "cfg.head_dim", HD, "a multiple of 256");
  // INT32 bound of the q-latent matmul: Q_LORA · 127 · 127 < 2^31.
  check_range<index_t>(where, "cfg.q_lora", QL, 2, 2 * 65536);
  check_equal<index_t>(where, "x_n.extent(1)", x_n.extent(1), D);
  check_equal<index_t>(where, "x_n.stride(1)", x_n.stride(1), 1);
  check_equal<index_t>(where, "w.wq_a.extent(0)", w.wq_a.extent(0), D);
  check_equal<index_t>(where, "w.wq_a.extent(1)", w.wq_a.extent(1), QL);
  check_equal<index_t>(where, "w.wq_a.stride(1)", w.wq_a.stride(1), 1);
  check_equal<index_t>(where, "w.gamma_cq.extent(0)", w.gamma_cq.extent(0), QL);
  check_equal<index_t>(where, "w.wq_b.extent(0)", w.wq_b.extent(0), QL);
  check_equal<index_t>(where, "w.wq_b.extent(1)", w.wq_b.extent(1), H * HD);
  check_equal<index_t>(where, "w.wq_b.stride(1)", w.wq_b.stride(1), 1);
  check_equal<index_t>(where, "w.wq_b_scale.extent(0)", w.wq_b_scale.extent(0), H * HD);
  check_equal<index_t>(where, "w.wkv.extent(0)", w.wkv.extent(0), D);
  check_equal<index_t>(where, "w.wkv.extent(1)", w.wkv.extent(1), HD);
  check_equal<index_t>(where, "w.wkv.stride(1)", w.wkv.stride(1), 1);
  check_equal<index_t>(where, "w.gamma_ckv.extent(0)", w.gamma_ckv.extent(0), HD);
  check_equal<index_t>(where, "q.extent(0)", q.extent(0), T);
  check_equal<index_t>(where, "q.extent(1)", q.extent(1), H);
  check_equal<index_t>(where, "q.extent(2)", q.extent(2), HD);
  check_equal<index_t>(where, "q.stride(2)", q.stride(2), 1);
  check_equal<index_t>(where, "kv.extent(0)", kv.extent(0), T);
  check_equal<index_t>(where, "kv.extent(1)", kv.extent(1), HD);
  check_equal<index_t>(where, "kv.stride(1)", kv.stride(1), 1);
  check_equal<index_t>(where, "qr.extent(0)", qr.extent(0), T);
  check_equal<index_t>(where, "qr.extent(1)", qr.extent(1), QL);
  check_equal<index_t>(where, "qr.stride(1)", qr.stride(1), 1);
  check_equal<index_t>(where, "qr_scale.extent(0)", qr_scale.extent(0), T);
  check_equal<index_t>(where, "position_ids.extent(0)", position_ids.extent(0), T);
  check_equal<index_t>(where, "scratch.x.extent(0)", s.x.extent(0), T);
  check_equal<index_t>(where, "scratch.x.extent(1)", s.x.extent(1), D);
  check_equal<index_t>(where, "scratch.cq.extent(0)", s.cq.extent(0), T);
  check_equal<index_t>(where, "scratch.cq.extent(1)", s.cq.extent(1), QL);
  check_equal<index_t>(where, "scratch.kvf.extent(0)", s.kvf.extent(0), T);
  check_equal<index_t>(where, "scratch.kvf.extent(1)", s.kvf.extent(1), HD);
  check_equal<index_t>(where, "scratch.qr_pairs.extent(0)", s.qr_pairs.extent(0), T);
  check_equal<index_t>(where, "scratch.qr_pairs.extent(1)", s.qr_pairs.extent(1), QL / 2);
  check_equal<index_t>(where, "rope.cos.extent(1)", rope.cos.extent(1), RD);
  for (index_t t = 0; t < T; ++t) check_rope_position(where, rope, position_ids(t));

  [[maybe_unused]] const bool avx2 = cpu::has_avx2(cpu::checked_isa(ctx.isa)) && TILEDECODE_X86;
  // avx2_vnni: the wq_b matmul on vpdpbusd (exact, identical results); its INT32 bound needs
  // Q_LORA <= 65536 and 32-column multiples (head_dim 512), otherwise the avx2 matmul runs.
  [[maybe_unused]] const bool vnni =
      avx2 && ctx.isa == cpu::Isa::avx2_vnni && QL <= 65536 && HD % 32 == 0;
  // ... and on the packed copy of wq_b when the caller has one (a contiguous stream per head).
  const QkvPackedWqB* packed = w.wq_b_packed;
  if (packed) {
    check_equal(where, "w.wq_b_packed->q_lora", packed->q_lora, QL);
    check_equal(where, "w.wq_b_packed->cols", packed->cols, H * HD);
  }
  [[maybe_unused]] const bool vnni_packed = vnni && packed != nullptr;
  // 1. x_n → FP32 (exact), once, so the matmul broadcasts floats.
  for (index_t t = 0; t < T; ++t)
    for (index_t k = 0; k < D; ++k) s.x(t, k) = x_n(t, k).to_float();

  // 2. cq_raw = x @ wq_a and kvf_raw = x @ wkv, 256-column tiles (wq_a tiles first).
  // 256-column tiles: each weight row segment is 512 contiguous bytes (see decode_avx2.hpp).
  constexpr index_t kTile = 256;
  const index_t q_tiles = QL / kTile, kv_tiles = HD / kTile;
  ctx.parallel_for(0, q_tiles + kv_tiles, 1, [&](std::int64_t task) {
    const bool is_q = task < q_tiles;
    const index_t n0 = (is_q ? task : task - q_tiles) * kTile;
    const ConstView<bf16, 2>& wm = is_q ? w.wq_a : w.wkv;
    View<float, 2> dst = is_q ? s.cq : s.kvf;
    for (index_t t0 = 0; t0 < T; t0 += 8) {
      const int tc = int(std::min<index_t>(8, T - t0));
#if TILEDECODE_X86
      if (avx2) {
        cpu::avx2::matmul_bf16_axpy(dst.data() + t0 * dst.stride(0), dst.stride(0),
                                    s.x.data() + t0 * s.x.stride(0), s.x.stride(0), tc, wm.data(),
                                    wm.stride(0), D, n0, n0 + kTile);
        continue;
      }
#endif
      detail::matmul_bf16_axpy_scalar(dst.data() + t0 * dst.stride(0), dst.stride(0),
                                      s.x.data() + t0 * s.x.stride(0), s.x.stride(0), tc, wm.data(),
                                      wm.stride(0), D, n0, n0 + kTile);
    }
  });

  // 3. Per token: the two RMSNorms, Q8 of cq, kv RoPE + BF16 (double epilogue).
  ctx.parallel_for(0, T, 1, [&](std::int64_t t) {
    float* cq = s.cq.data() + t * s.cq.stride(0);
    rmsnorm_row_f64(cq, w.gamma_cq.data(), QL, cfg.rms_eps, ctx.isa);
    std::int8_t* qrt = qr.data() + t * qr.stride(0);
    qr_scale(t) = cpu::quantize_q8_row(ctx.isa, qrt, cq, QL);
    if (vnni) {
      std::int32_t sum = 0;
      for (index_t k = 0; k < QL; ++k) sum += qrt[k];
      s.qr_pairs(t, 0) = sum;
    } else {
      for (index_t k = 0; k < QL; k += 2) {
        const auto lo = std::uint32_t(std::uint16_t(std::int16_t(qrt[k])));
        const auto hi = std::uint32_t(std::uint16_t(std::int16_t(qrt[k + 1])));
        s.qr_pairs(t, k / 2) = std::int32_t(lo | (hi << 16));
      }
    }
    const float* kvr = s.kvf.data() + t * s.kvf.stride(0);
    double kd[kMaxHeadDim];
    const double r =
        1.0 / std::sqrt(sum_squares_f64(kvr, HD, ctx.isa) / double(HD) + double(cfg.rms_eps));
    for (index_t i = 0; i < HD; ++i) kd[i] = double(kvr[i]) * r * double(w.gamma_ckv(i).to_float());
    const index_t pos = position_ids(t);
    detail::rope_forward_f64(kd + NOPE, rope.cos_row(pos), rope.sin_row(pos), RD);
    bf16* kvd = kv.data() + t * kv.stride(0);
    for (index_t i = 0; i < HD; ++i) kvd[i] = bf16(float(kd[i]));
  });

  // 4. Per head: INT32 qr @ wq_b[:, head], dequant, per-head RMSNorm, RoPE, BF16 store.
  ctx.parallel_for(0, H, 1, [&](std::int64_t h) {
    // Padded stride: rows 2 KB apart would alias in the 4K store/load check (see decode_avx2).
    constexpr index_t kAccLd = kMaxHeadDim + 16;
    alignas(64) std::int32_t acc[8 * kAccLd];
    double qf[kMaxHeadDim];
    const index_t n0 = h * HD;
    for (index_t t0 = 0; t0 < T; t0 += 8) {
      const int tc = int(std::min<index_t>(8, T - t0));
#if TILEDECODE_X86
      if (vnni) {
        std::int32_t a_sum[8];
        for (int tt = 0; tt < tc; ++tt) a_sum[tt] = s.qr_pairs(t0 + tt, 0);  // step 3's Σ qr
        if (vnni_packed) {
          cpu::avx2_vnni::matmul_i8_packed(acc, kAccLd, qr.data() + t0 * qr.stride(0), qr.stride(0),
                                           a_sum, tc, packed->data.data() + std::size_t(n0 * QL),
                                           QL, HD);
        } else {
          cpu::avx2_vnni::matmul_i8_axpy(acc, kAccLd, qr.data() + t0 * qr.stride(0), qr.stride(0),
                                         a_sum, tc, w.wq_b.data(), w.wq_b.stride(0), QL, n0,
                                         n0 + HD);
        }
      } else if (avx2) {
        cpu::avx2::matmul_i8_axpy(acc, kAccLd, s.qr_pairs.data() + t0 * s.qr_pairs.stride(0),
                                  s.qr_pairs.stride(0), tc, w.wq_b.data(), w.wq_b.stride(0), QL, n0,
                                  n0 + HD);
      } else
#endif
      {
        detail::matmul_i8_axpy_scalar(acc, kAccLd, qr.data() + t0 * qr.stride(0), qr.stride(0), tc,
                                      w.wq_b.data(), w.wq_b.stride(0), QL, n0, n0 + HD);
      }
      for (int tt = 0; tt < tc; ++tt) {
        const index_t t = t0 + tt;
        const double qs = qr_scale(t);
        double ss = 0.0;
        for (index_t n = 0; n < HD; ++n) {
          qf[n] = double(acc[tt * kAccLd + n]) * qs * double(w.wq_b_scale(n0 + n));
          ss += qf[n] * qf[n];
        }
        const double r = 1.0 / std::sqrt(ss / double(HD) + double(cfg.rms_eps));
        for (index_t n = 0; n < HD; ++n) qf[n] *= r;
        const index_t pos = position_ids(t);
        detail::rope_forward_f64(qf + NOPE, rope.cos_row(pos), rope.sin_row(pos), RD);
        bf16* qd = q.data() + t * q.stride(0) + h * q.stride(1);
        for (index_t n = 0; n < HD; ++n) qd[n] = bf16(float(qf[n]));
      }
    }
  });
}

}  // namespace kernels
}  // namespace tiledecode
