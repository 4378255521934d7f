#pragma once
// q / kv projections (kernels/qkv_projection.hpp) on the CPU backend.
// Numerical contract (the golden twin follows it too):
//   * x_n @ wq_a and x_n @ wkv: BF16 × BF16 products (exact in FP32) summed in FP32 over groups
//     of 64 consecutive k, the groups in double (decode_avx2.hpp, matmul_bf16_axpy): at least the
//     spec's "FP32 accumulation", with its order fixed so every tier gives the same bits, and
//     close enough to the exact dot that Q8 of cq and BF16 of kv round as the exact values do
//     (rates in tests/test_numerics.cpp, "rounding"); golden sums in double; qr @ wq_b: exact
//     INT32.
//   * everything after the matmuls runs in double: the RMSNorms (Σx² , r = 1/sqrt(Σx²/n + eps),
//     x·r·gamma), the dequant acc·qr_scale·wq_b_scale, the per-head RMSNorm and the forward RoPE
//     (interleaved pairs, BF16 table values); results are stored as FP32 (cq, kvf) or rounded
//     to BF16 via FP32 (q, kv). Negligible cost, and it keeps cq on the reference's side of Q8's
//     rounding boundaries (one flipped qr value changes a whole token's q).
// Schedule: the weights are streamed once per step for all T tokens. Tasks: 256-column tiles of
// wq_a and wkv (axpy order in passes of 8 tokens, see backend/cpu/decode_avx2.hpp; Isa::avx512:
// avx512::matmul_bf16_tiled, the same FP32 FMAs in the same order, blocked over up to 128 tokens
// per read of the weights); then one task per token (norms, Q8, kv RoPE); then one task per
// query head (its 512 columns of wq_b, tokens in chunks of 8, the epilogue fused; on
// Isa::avx2_vnni the wq_b matmul runs on vpdpbusd, on the load-time packed copy
// QkvWeights::wq_b_packed (8-column layout) when the caller provides one: one contiguous 512 KB
// stream per head, register-resident accumulators; see cpu::avx2_vnni::matmul_i8_packed;
// Isa::avx512 runs the 16-column packed copy on the 512-bit vpdpbusd in chunks of 24 tokens,
// cpu::avx512::matmul_i8_packed, and the avx2 matmul without it). Every output element has one
// producer and a fixed order: results do not depend on the thread count or on T (batch
// invariance), and the scalar, AVX2, AVX-VNNI and AVX-512 paths give identical results. The
// exceptions, by the caller's choice: Bf16Dot::exact (every tier) sums x_n · [wq_a | wkv] in
// double in ascending k (bf16_exact.hpp: golden's double sums rounded once to FP32 cq / kvf; golden
// normalises the unrounded sums); and
// Isa::avx512 with Bf16Dot::dpbf16 (automatic on AMD) and the
// transposed copy QkvWeights::bf16_rows runs x_n · [wq_a | wkv] on the vdpbf16ps row kernels
// (bf16_rows_avx512.hpp), another summation order held to golden and to the rounding bars, still
// thread- and batch-invariant (Zen 5, T = 128: 27.9-28.1 → 20.2-20.4 ms for the projection).
// Given QkvWeights::wq_a_norm the q-latent's rounding check (q_latent) recomputes as golden does
// the cq values whose Q8 rounding the FP32 dots cannot decide, from bf16_rows where present, else
// from wq_a's columns: qr, and with it q, is golden's on every tier (tests/test_rounding.cpp).
// Given QkvWeights::wkv_norm the kv rounding check (check_kv) does the same for kv, whose BF16
// follows the RMS norm and the RoPE: the listed dots, and every dot of a token whose golden r is
// needed; kv is golden's on every tier.
// Measured (Xeon, Sapphire Rapids class, one thread, flash, T = 128 = B 64 × S 2; perf profile
// of bench_projection): x_n · [wq_a | wkv] 24 → 12.3 ms (axpy passes → tiled, 61 % of the
// 512-bit FMA ceiling); qr · wq_b 18 → 14.6 ms (packed 8-column, 4-token tiles → 16-column,
// 6-token tiles in L1 chunks; 76 % of the vpdpbusd ceiling); the epilogue 7 → 5.6 ms. The
// epilogue is built per tier (qkv_detail::q_head_epilogue: the same double operations, now in
// 512- / 256-bit lanes): AMD EPYC Zen 4, T = 128, its share of the projection 13 → 7 %; T = 8
// 5.5-5.7 → 4.9-5.2 ms.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/backend/cpu/decode_avx512.hpp"
#include "tiledecode/backend/cpu/quant.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/backend/cpu/rounding_check.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/qkv_projection.hpp"

namespace tiledecode {
namespace kernels {

namespace detail {
// Scalar twins of the AVX2 axpy matmuls (same order of summation: for the BF16 one, groups of
// cpu::avx2::kBf16GroupRows rows summed in FP32, the groups in double; see decode_avx2.hpp).
// T <= 8.
inline constexpr int kBf16GroupRows = 64;  // = cpu::avx2::kBf16GroupRows (x86 only)
#if TILEDECODE_X86
static_assert(kBf16GroupRows == cpu::avx2::kBf16GroupRows, "the tiers' BF16 matmul groups differ");
#endif
inline void matmul_bf16_axpy_scalar(float* dst, index_t dst_ld, const float* x, index_t x_ld, int T,
                                    const bf16* w, index_t w_ld, index_t K, index_t n0,
                                    index_t n1) {
  constexpr index_t kTile = 256;
  double acc[8][kTile];
  float part[8][kTile];
  for (index_t c0 = n0; c0 < n1; c0 += kTile) {
    const index_t width = std::min(kTile, n1 - c0);
    for (int t = 0; t < T; ++t)
      for (index_t n = 0; n < width; ++n) acc[t][n] = 0.0;
    for (index_t k0 = 0; k0 < K; k0 += kBf16GroupRows) {
      const index_t k1 = std::min<index_t>(K, k0 + kBf16GroupRows);
      for (int t = 0; t < T; ++t)
        for (index_t n = 0; n < width; ++n) part[t][n] = 0.0f;
      for (index_t k = k0; k < k1; ++k) {
        const bf16* wr = w + k * w_ld + c0;
        for (int t = 0; t < T; ++t) {
          const float a = x[t * x_ld + k];
          for (index_t n = 0; n < width; ++n) part[t][n] += a * wr[n].to_float();
        }
      }
      for (int t = 0; t < T; ++t)
        for (index_t n = 0; n < width; ++n) acc[t][n] += double(part[t][n]);
    }
    for (int t = 0; t < T; ++t)
      for (index_t n = 0; n < width; ++n) dst[t * dst_ld + c0 + n] = float(acc[t][n]);
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

// The packed layout the best VNNI tier of this CPU reads: 16 columns per vector where it has
// AVX-512 (cpu::avx512::matmul_i8_packed), else 8 (cpu::avx2_vnni::matmul_i8_packed).
inline index_t qkv_wq_b_vector_cols() {
  return cpu::cpu_supports(cpu::Isa::avx512) ? 16 : 8;
}

// Packs wq_b (Q_LORA, H*512) INT8 for the VNNI tiers (see QkvPackedWqB). Call once at load time
// (allocates Q_LORA·H·512 bytes); only useful where the CPU has AVX-VNNI or AVX-512. Layout: byte
// 4j + i of quad q of vector v = u8(w[4q + i][VC·v + j] + 128), VC = vector_cols; vector v's
// Q_LORA/4 quads are consecutive (Q_LORA·VC bytes).
inline QkvPackedWqB pack_qkv_wq_b(const ModelConfig& cfg, ConstView<std::int8_t, 2> wq_b,
                                  index_t vector_cols = qkv_wq_b_vector_cols()) {
  constexpr std::string_view where = "pack_qkv_wq_b";
  const index_t K = cfg.q_lora, N = index_t(cfg.n_heads) * cfg.head_dim, VC = vector_cols;
  if (VC != 8 && VC != 16) throw_arg(where, "vector_cols", VC, "8 or 16");
  if (K % 4 != 0) throw_arg(where, "cfg.q_lora", K, "a multiple of 4");
  if (N % VC != 0) throw_arg(where, "cfg.n_heads * cfg.head_dim", N, "a multiple of vector_cols");
  check_equal(where, "wq_b.extent(0)", wq_b.extent(0), K);
  check_equal(where, "wq_b.extent(1)", wq_b.extent(1), N);
  QkvPackedWqB p;
  p.q_lora = K;
  p.cols = N;
  p.vector_cols = VC;
  p.data = Buffer<std::uint8_t>(std::size_t(K * N));
  const index_t KQ = K / 4;
  // Rows in order (sequential reads).
  for (index_t k = 0; k < K; ++k)
    for (index_t n = 0; n < N; ++n)
      p.data[std::size_t(((n / VC) * KQ + k / 4) * 4 * VC + (n % VC) * 4 + k % 4)] =
          std::uint8_t(std::uint8_t(wq_b(k, n)) ^ 0x80u);
  return p;
}

// Where the q/kv projection's dots would read QkvWeights::bf16_rows: the avx512 tier with the
// automatic BF16 choice resolving to vdpbf16ps (AMD). LayerWeightsStorage::pack makes the copy on
// every CPU: the rounding checks' repairs read it everywhere.
inline bool qkv_bf16_rows_useful() {
  return cpu::cpu_supports(cpu::Isa::avx512) &&
         cpu::resolved_bf16_dot(cpu::Bf16Dot::automatic) == cpu::Bf16Dot::dpbf16;
}

// wq_a (D, Q_LORA) and wkv (D, HEAD_DIM) transposed into one QkvBf16Rows (see there). Call once
// at load time (allocates (Q_LORA + HEAD_DIM)·D BF16; flash: 12.6 MB). Blocked 64 × 64 so both
// the reads and the writes stay in cache lines.
inline QkvBf16Rows pack_qkv_bf16_rows(const ModelConfig& cfg, ConstView<bf16, 2> wq_a,
                                      ConstView<bf16, 2> wkv) {
  constexpr std::string_view where = "pack_qkv_bf16_rows";
  const index_t D = cfg.hidden, QL = cfg.q_lora, HD = cfg.head_dim;
  check_equal(where, "wq_a.extent(0)", wq_a.extent(0), D);
  check_equal(where, "wq_a.extent(1)", wq_a.extent(1), QL);
  check_equal(where, "wkv.extent(0)", wkv.extent(0), D);
  check_equal(where, "wkv.extent(1)", wkv.extent(1), HD);
  QkvBf16Rows r;
  r.hidden = D;
  r.q_rows = QL;
  r.kv_rows = HD;
  r.data = Buffer<bf16>(std::size_t((QL + HD) * D));
  constexpr index_t B = 64;
  for (int m = 0; m < 2; ++m) {
    const ConstView<bf16, 2>& w = m == 0 ? wq_a : wkv;
    const index_t N = m == 0 ? QL : HD, row0 = m == 0 ? 0 : QL;
    for (index_t k0 = 0; k0 < D; k0 += B)
      for (index_t n0 = 0; n0 < N; n0 += B)
        for (index_t k = k0; k < std::min(D, k0 + B); ++k)
          for (index_t n = n0; n < std::min(N, n0 + B); ++n)
            r.data[std::size_t((row0 + n) * D + k)] = w(k, n);
  }
  return r;
}

}  // namespace kernels

namespace cpu {

namespace qkv_detail {

// One token's head of q after its wq_b matmul: dequant, per-head RMSNorm, RoPE, BF16 store.
struct QHeadEpilogue {
  const std::int32_t* acc;  // [HD] INT32 qr · wq_b
  double qr_scale;
  const float* ws;  // wq_b_scale of the head's first column, ws_ld apart
  index_t ws_ld, HD, NOPE, RD;
  double eps;
  const bf16 *cos_row, *sin_row;
  bf16* q;  // [HD]
};

// The epilogue's arithmetic, in double and in one fixed order on every tier: each operation is
// an IEEE double operation (lane for lane when the compiler vectorises a loop; the library is
// built with -ffp-contract=off, so no multiply-add is fused), hence the same bits from the
// SSE2 baseline, the AVX2 and the AVX-512 instantiations below. It runs T·H·HD times per step:
// at T = 128 the SSE2 build of it took 13 % of the projection.
__attribute__((always_inline)) inline void q_head_epilogue_body(const QHeadEpilogue& e,
                                                                double* qf) {
  const index_t HD = e.HD;
  for (index_t n = 0; n < HD; ++n)
    qf[n] = double(e.acc[n]) * e.qr_scale * double(e.ws[n * e.ws_ld]);
  // Σ qf² in four interleaved double partials (n mod 4), joined pairwise: the order is fixed,
  // and four chains instead of one keep the add latency off the critical path.
  // The four partials are the lanes of one 4-double vector (GCC/Clang vector extension: one
  // ymm, or two SSE2 registers on the baseline; lane j adds qf[n + j]² in ascending n).
  using d4 = double __attribute__((vector_size(32)));
  d4 ss4 = {0.0, 0.0, 0.0, 0.0};
  index_t n = 0;
  for (; n + 4 <= HD; n += 4) {
    d4 v;
    std::memcpy(&v, qf + n, sizeof v);
    ss4 += v * v;
  }
  for (; n < HD; ++n) ss4[n % 4] += qf[n] * qf[n];
  const double ss = (ss4[0] + ss4[1]) + (ss4[2] + ss4[3]);
  const double r = 1.0 / std::sqrt(ss / double(HD) + e.eps);
  for (index_t i = 0; i < HD; ++i) qf[i] *= r;
  rope_forward_f64(qf + e.NOPE, e.cos_row, e.sin_row, e.RD);
  for (index_t i = 0; i < HD; ++i) e.q[i] = bf16(float(qf[i]));
}

#if TILEDECODE_X86
TILEDECODE_TARGET_AVX512 inline void q_head_epilogue_avx512(const QHeadEpilogue& e, double* qf) {
  q_head_epilogue_body(e, qf);
}
TILEDECODE_TARGET_AVX2 inline void q_head_epilogue_avx2(const QHeadEpilogue& e, double* qf) {
  q_head_epilogue_body(e, qf);
}
#endif
inline void q_head_epilogue_base(const QHeadEpilogue& e, double* qf) {
  q_head_epilogue_body(e, qf);
}

template <Isa I>
inline void q_head_epilogue(const QHeadEpilogue& e, double* qf) {
#if TILEDECODE_X86
  if constexpr (I == Isa::avx512) return q_head_epilogue_avx512(e, qf);
  if constexpr (has_avx2(I)) return q_head_epilogue_avx2(e, qf);
#endif
  q_head_epilogue_base(e, qf);
}

}  // namespace qkv_detail

template <Isa I>
struct backend_ops_qkv_projection {
  static constexpr index_t kMaxHeadDim = 512;
  static constexpr index_t kMaxCheckedQLora = 2048;  // the check's per-value factors on the stack
  static constexpr index_t kTile = 256;  // columns per task: each weight row segment is 512 B

  static std::size_t workspace_bytes(const Cpu<I>&, const ModelConfig&, index_t) { return 0; }
  static void check(const Cpu<I>&, const kernels::QkvArgs&) {}

  // Which INT8 matmul runs project_b: the VNNI ones need Q_LORA <= 65536 (their INT32 bound) and
  // 32-column multiples (head_dim 512); avx512 runs only on the packed copy of wq_b (made by
  // LayerWeightsStorage::pack where the CPU has a VNNI tier). Otherwise the avx2 matmul runs
  // (same integers).
  static bool vnni(const kernels::QkvArgs& a) {
    const bool fits = a.cfg->q_lora <= 65536 && a.cfg->head_dim % 32 == 0;
    if constexpr (I == Isa::avx512)
      return fits && a.w.wq_b_packed != nullptr && a.w.wq_b_packed->vector_cols == 16;
    return I == Isa::avx2_vnni && fits;
  }
  // The avx2_vnni tier reads the packed copy only in its own layout (else its axpy kernel).
  static const QkvPackedWqB* packed_8(const kernels::QkvArgs& a) {
    const QkvPackedWqB* p = a.w.wq_b_packed;
    return p != nullptr && p->vector_cols == 8 ? p : nullptr;
  }

  // Whether project_a runs on vdpbf16ps: avx512, Bf16Dot::dpbf16 and the transposed copy.
  static bool dpbf16_rows(const Cpu<I>& be, const kernels::QkvArgs& a) {
    return I == Isa::avx512 && be.bf16_dot == Bf16Dot::dpbf16 && a.w.bf16_rows != nullptr &&
           a.cfg->hidden % 2 == 0;  // the kernels' pairs
  }

  // x_n → FP32 (exact) once, then cq_raw = x @ wq_a and kvf_raw = x @ wkv in 256-column tiles
  // (wq_a tiles first), 8 tokens per pass over a weight row. On avx512 with Bf16Dot::dpbf16 and
  // QkvWeights::bf16_rows: the o-proj wo_a / compressor vdpbf16ps row kernels on the BF16 x_n and
  // the transposed rows (bf16_rows_avx512.hpp: their own summation order, one bits for any T:
  // bf16_rows_dot below kBf16BlockedMinTokens tokens, blocked from there).
  static void project_a(const Cpu<I>& be, const kernels::QkvArgs& a) {
    const index_t T = a.tokens(), D = a.cfg->hidden, QL = a.cfg->q_lora, HD = a.cfg->head_dim;
    const QkvScratch& s = a.s;
    const bool exact = be.bf16_dot == Bf16Dot::exact;  // every tier (bf16_exact.hpp)
    const bool rows = !exact && dpbf16_rows(be, a);
#if TILEDECODE_X86
    // The blocked vdpbf16ps kernel reads x_n as a token panel, packed once here into the FP32
    // copy's space (unused on that path; a caller's contiguous (T, D) scratch), shared by every
    // column task.
    [[maybe_unused]] const bool panel =
        rows && s.x.is_contiguous() && avx512::bf16_panel_fits(T, D, 2 * s.x.size());
    [[maybe_unused]] bf16* const xp = reinterpret_cast<bf16*>(s.x.data());
    if (panel) avx512::pack_bf16_panel(be, xp, a.x_n.data(), a.x_n.stride(0), T, D);
#endif
    if (!rows && !exact)
      for (index_t t = 0; t < T; ++t)
        for (index_t k = 0; k < D; ++k) s.x(t, k) = a.x_n(t, k).to_float();
    const index_t q_tiles = QL / kTile, kv_tiles = HD / kTile;
    be.tasks(q_tiles + kv_tiles, [&](std::int64_t task) {
      const bool is_q = task < q_tiles;
      const index_t n0 = (is_q ? task : task - q_tiles) * kTile;
      const ConstView<bf16, 2>& wm = is_q ? a.w.wq_a : a.w.wkv;
      const View<float, 2> dst = is_q ? s.cq : s.kvf;
      if (exact) {  // golden's double sums in ascending k from the BF16 x_n, rounded once
        bf16_cols_dot_exact(I, dst.data(), dst.stride(0), a.x_n.data(), a.x_n.stride(0), T,
                            wm.data(), wm.stride(0), D, n0, n0 + kTile);
        return;
      }
#if TILEDECODE_X86
      if constexpr (I == Isa::avx512) {
        if (rows) {
          const index_t N = is_q ? QL : HD;
          const bf16* wr = a.w.bf16_rows->data.data() + ((is_q ? 0 : QL) + n0) * D;
          if (panel) {
            avx512::bf16_rows_dot_blocked<false>(dst.data() + n0, dst.stride(0), xp,
                                                 avx512::bf16_panel_tile_elems(D), T, wr, D, kTile,
                                                 D, N - n0);
          } else {
            avx512::bf16_rows_dot<false>(dst.data() + n0, dst.stride(0), a.x_n.data(),
                                         a.x_n.stride(0), T, wr, D, kTile, D, N - n0);
          }
          return;
        }
        // All T tokens per pass over the weights (same bits as the 8-token axpy passes).
        avx512::matmul_bf16_tiled(dst.data(), dst.stride(0), s.x.data(), s.x.stride(0), T,
                                  wm.data(), wm.stride(0), D, n0, n0 + kTile);
        return;
      }
#endif
      for (index_t t0 = 0; t0 < T; t0 += 8) {
        const int tc = int(std::min<index_t>(8, T - t0));
#if TILEDECODE_X86
        if constexpr (has_avx2(I)) {
          avx2::matmul_bf16_axpy(dst.data() + t0 * dst.stride(0), dst.stride(0),
                                 s.x.data() + t0 * s.x.stride(0), s.x.stride(0), tc, wm.data(),
                                 wm.stride(0), D, n0, n0 + kTile);
          continue;
        }
#endif
        kernels::detail::matmul_bf16_axpy_scalar(dst.data() + t0 * dst.stride(0), dst.stride(0),
                                                 s.x.data() + t0 * s.x.stride(0), s.x.stride(0), tc,
                                                 wm.data(), wm.stride(0), D, n0, n0 + kTile);
      }
    });
  }

  struct Lane {
    bool check = false;     // the q-latent's rounding check (below)
    bool check_kv = false;  // the kv rounding check (kv_row)
  };
  template <class Body>
  static void for_tokens(const Cpu<I>& be, const kernels::QkvArgs& a, Body&& body) {
    const bool check = be.bf16_dot != Bf16Dot::exact && a.w.wq_a_norm.data() != nullptr &&
                       a.cfg->q_lora <= kMaxCheckedQLora;
    const bool check_kv = be.bf16_dot != Bf16Dot::exact && a.w.wkv_norm.data() != nullptr;
    be.tasks(a.tokens(), [&](std::int64_t t) {
      Lane lane{check, check_kv};
      body(lane, t);
    });
  }
  // RMSNorm of cq (double), Q8 → qr, and the INT8 matmul's operand staging.
  //
  // Rounding check (issue 17), given QkvWeights::wq_a_norm and dots that are not Bf16Dot::exact:
  // the check of rounding_check.hpp on the row cq = d · r · gamma_cq, d the FP32 dots. Each d_n is
  // within κ · 2^-24 · max|x_n| · |wq_a[:, n]| of the exact dot (the same measured bound: FP32
  // partials over 64-k blocks, then double), so cq_n within r · |gamma_n| times that, plus two
  // FP32 ulps; the listed values get cq_n = float(d_n · r · gamma_n) from d_n summed as golden sums
  // it (bf16_pair_dots_exact, unrounded, as golden uses it; from the transposed rows where
  // QkvWeights::bf16_rows is given, else from wq_a's column: a cache line per k). r itself comes
  // from the FP32 dots, not golden's; it scales every cq_n of the token and Q8 is scale-invariant
  // (amax scales with it), so it moves a Q8 decision only through the FP32 rounding of cq, inside
  // the ulps the interval holds. It and an unrepaired amax move qr_scale (an FP32 output, not a
  // rounding) by their relative errors, which q's per-head RMSNorm undoes: so the row's largest
  // values are recomputed only in a row where another value is listed (exact_scale = false), and
  // most rows list none (measured, Zen 5, T = 8: 2.3-2.6 of 8 rows a call list any, 5.2-5.9
  // repairs a call where every row's largest took 10.9).
  static void q_latent(Lane& lane, const kernels::QkvArgs& a, index_t t) {
    const index_t QL = a.cfg->q_lora;
    const QkvScratch& s = a.s;
    float* cq = s.cq.data() + t * s.cq.stride(0);
    const double r = kernels::rmsnorm_row_f64(cq, a.w.gamma_cq.data(), QL, a.cfg->rms_eps, I);
    if (lane.check) check_q_latent(a, t, cq, r);
    std::int8_t* qrt = a.qr.data() + t * a.qr.stride(0);
    a.qr_scale(t) = quantize_q8_row(I, qrt, cq, QL);
    if (vnni(a)) {
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
  }
  // The listed values of cq = float(d · r · gamma_cq) (rmsnorm_row_f64's, r its factor) repaired.
  static void check_q_latent(const kernels::QkvArgs& a, index_t t, float* cq, double r) {
    const index_t QL = a.cfg->q_lora, D = a.cfg->hidden;
    const bf16* g = a.w.gamma_cq.data();
    // Per value the factor of the bound's κ · 2^-24 · max|x|: r · |gamma_n| · |wq_a[:, n]|.
    float eff[kMaxCheckedQLora];
    float emax = 0.0f;
    for (index_t n = 0; n < QL; ++n) {
      eff[n] = float(r * std::fabs(double(g[n].to_float())) * double(a.w.wq_a_norm(n)) *
                     (1.0 + 0x1p-20));
      emax = std::max(emax, eff[n]);
    }
    const bf16* x = a.x_n.data() + t * a.x_n.stride(0);
    rounding_check::Repairs rep;
    rounding_check::check_row(I, x, D, cq, eff, QL, emax, 0, rep, false);
    const auto x_of = [&](int, index_t) { return x; };
    const auto store = [&](int, index_t n, double d) {
      cq[n] = float(d * r * double(g[n].to_float()));
    };
    if (const QkvBf16Rows* rows = a.w.bf16_rows) {  // wq_a's column n as a row: D contiguous
      rounding_check::repair(
          I, rep, D, x_of,
          [&](int, index_t n) { return rows->data.data() + std::size_t(n) * std::size_t(D); },
          store);
    } else {  // the column itself: a cache line per k
      rounding_check::repair(
          I, rep, D, x_of, [&](int, index_t n) { return &a.w.wq_a(0, n); }, store,
          a.w.wq_a.stride(0));
    }
  }
  // kv = bf16([kvf·r·gamma_ckv][:448], rope_fwd(..[448:], pos_t)) in double.
  static void kv_row(Lane& lane, const kernels::QkvArgs& a, index_t t) {
    const index_t HD = a.cfg->head_dim;
    const float* kvr = a.s.kvf.data() + t * a.s.kvf.stride(0);
    double d[kMaxHeadDim], kd[kMaxHeadDim];
    for (index_t i = 0; i < HD; ++i) d[i] = kvr[i];
    const double r =
        1.0 / std::sqrt(kernels::sum_squares_f64(kvr, HD, I) / double(HD) + double(a.cfg->rms_eps));
    kv_values(a, t, d, r, kd);
    if (lane.check_kv) check_kv(a, t, kvr, d, kd);
    bf16* kvd = a.kv.data() + t * a.kv.stride(0);
    for (index_t i = 0; i < HD; ++i) kvd[i] = bf16(float(kd[i]));
  }
  // kd = [d·r·gamma_ckv][:448], rope_fwd(..[448:], pos_t), in double.
  static void kv_values(const kernels::QkvArgs& a, index_t t, const double* d, double r,
                        double* kd) {
    const index_t HD = a.cfg->head_dim, NOPE = a.cfg->nope_dim(), RD = a.cfg->rope_dim;
    for (index_t i = 0; i < HD; ++i) kd[i] = d[i] * r * double(a.w.gamma_ckv(i).to_float());
    const index_t pos = a.positions(t);
    rope_forward_f64(kd + NOPE, a.rope.cos_row(pos), a.rope.sin_row(pos), RD);
  }

  // Rounding check of kv (issue 17), given QkvWeights::wkv_norm and dots that are not
  // Bf16Dot::exact. kv is BF16 after the RMS norm and the RoPE, so unlike Q8 it is not
  // scale-invariant: golden's r (from its unrounded double dots) matters, not only each dot. Per
  // token, with d the FP32 dots (64-k block sums, or vdpbf16ps) and golden's the exact ones:
  //   * each d_n within E_n = κ · 2^-24 · max|x_n| · |wkv[:, n]| + one FP32 rounding (2^-23 |d_n|,
  //     golden keeps its double) of golden's (κ = 16, rounding_check.hpp's measured bound);
  //   * r within a relative ρ = sqrt(Σ_n (d_n E'_n)²) / (Σ_n d_n² + hd · eps), E' as E with κ_r = 4
  //     (compressor_check.hpp: the root of the sum of squares of independent roundings; measured
  //     over 1024 tokens, |r / r_golden − 1| <= 0.85 of it at κ_r = 1);
  //   * value i within Y_i = |r · gamma_i| · E_i + |kv_i| · ρ (the RoPE pairs: |cos| Y_even + |sin|
  //     Y_odd and back), plus 2^-40 |kv_i| and 2^-10 of the whole for the arithmetic; listed when
  //     bf16(fp32(kv_i − Y_i)) != bf16(fp32(kv_i + Y_i)).
  // Repairs: the listed values' dots as golden sums them (bf16_pair_dots_exact, unrounded: golden
  // normalises its double sums), then, if a value is still listed, every dot of the token and
  // golden's r in golden's order (Σ d² ascending, 1 / sqrt(Σ / hd + eps)), so its kv is golden's.
  // Measured (1024 tokens, flash statistics, both dot orders): 98 % of tokens list a value, 4.2
  // dots repaired a token (a RoPE pair lists both), 13 tokens (1.3 %) need every dot. The dots
  // are read from bf16_rows where present (a contiguous row each, all of a token's in one
  // bf16_rows_gather_dots_exact), else from wkv's columns (a cache line per k): on an Intel Xeon
  // (flash, T = 8) the check costs +1.9 % (one thread) / +2.6 % (two) of the call from the rows,
  // +10-12 % from the columns (docs/compressors.md, "kv check cost"); LayerWeightsStorage::pack
  // makes the rows.
  static constexpr int kMaxKvRepairs = 32;  // dot repairs a token; past that, every dot
  static constexpr float kKvKappaR = 4.0f;
  static void check_kv(const kernels::QkvArgs& a, index_t t, const float* kvr, double* d,
                       double* kd) {
    const index_t HD = a.cfg->head_dim, D = a.cfg->hidden;
    for (index_t i = 0; i < HD; ++i)
      if (!std::isfinite(kd[i])) return;  // the NaN / Inf policy is the kernel's
    const double xa =
        0x1p-24 * double(rounding_check::bf16_abs_max(I, a.x_n.data() + t * a.x_n.stride(0), D));
    double e[kMaxHeadDim], er[kMaxHeadDim];
    for (index_t n = 0; n < HD; ++n) {
      const double nrm = double(a.w.wkv_norm(n)), rd = 0x1p-23 * std::fabs(double(kvr[n]));
      e[n] = double(rounding_check::kKappa) * xa * nrm + rd;
      er[n] = double(kKvKappaR) * xa * nrm + rd;
    }
    int ch[kMaxKvRepairs + 1];
    int n = kv_listed(a, t, d, kd, e, er, ch);
    if (n == 0) return;
    if (n <= kMaxKvRepairs) {
      kv_repair(a, t, d, ch, n);
      for (int i = 0; i < n; ++i) e[ch[i]] = er[ch[i]] = 0.0;
      kv_values(a, t, d, kv_r(a, d), kd);
      n = kv_listed(a, t, d, kd, e, er, ch);
      if (n == 0) return;
    }
    int all[kMaxHeadDim];
    for (index_t i = 0; i < HD; ++i) all[i] = int(i);
    kv_repair(a, t, d, all, int(HD));
    kv_values(a, t, d, kv_r(a, d), kd);
  }
  // Golden's r: Σ d² in ascending order (golden/qkv_projection.hpp).
  static double kv_r(const kernels::QkvArgs& a, const double* d) {
    const index_t HD = a.cfg->head_dim;
    double ss = 0.0;
    for (index_t n = 0; n < HD; ++n) ss += d[n] * d[n];
    return 1.0 / std::sqrt(ss / double(HD) + double(a.cfg->rms_eps));
  }
  // d[ch[i]] = golden's unrounded dot x_n[t] · wkv[:, ch[i]]: from the transposed rows, one
  // gather (bf16_rows_gather_dots_exact); from the columns, kPairDots at a time.
  static void kv_repair(const kernels::QkvArgs& a, index_t t, double* d, const int* ch, int n) {
    const index_t D = a.cfg->hidden;
    const bf16* x = a.x_n.data() + t * a.x_n.stride(0);
    const QkvBf16Rows* rows = a.w.bf16_rows;
    if (rows) {
      const bf16* rp[kMaxHeadDim] = {};  // (= {}: GCC 12 takes a const pointer for a read of all)
      double s[kMaxHeadDim];
      for (int i = 0; i < n; ++i)
        rp[i] = rows->data.data() + std::size_t(rows->q_rows + ch[i]) * std::size_t(D);
      bf16_rows_gather_dots_exact(I, n, x, rp, D, s);
      for (int i = 0; i < n; ++i) d[ch[i]] = s[i];
      return;
    }
    const bf16* xp[kPairDots];
    const bf16* wp[kPairDots];
    double s[kPairDots];
    for (int i = 0; i < n; i += kPairDots) {
      const int m = std::min(kPairDots, n - i);
      for (int j = 0; j < m; ++j) {
        xp[j] = x;
        wp[j] = &a.w.wkv(0, ch[i + j]);
      }
      bf16_pair_dots_exact(I, m, xp, wp, D, s, a.w.wkv.stride(0));
      for (int j = 0; j < m; ++j) d[ch[i + j]] = s[j];
    }
  }
  // The channels of the values of kv whose interval holds a BF16 rounding boundary (the RoPE
  // pairs: both), in ch; returns their number, or kMaxKvRepairs + 1 past kMaxKvRepairs.
  static int kv_listed(const kernels::QkvArgs& a, index_t t, const double* d, const double* kd,
                       const double* e, const double* er, int* ch) {
    const index_t HD = a.cfg->head_dim, RD = a.cfg->rope_dim;
    double ss = 0.0, q = 0.0;
    for (index_t i = 0; i < HD; ++i) {
      ss += d[i] * d[i];
      q += (d[i] * er[i]) * (d[i] * er[i]);
    }
    const double r = 1.0 / std::sqrt(ss / double(HD) + double(a.cfg->rms_eps));
    const double rho = std::sqrt(q) / (ss + double(HD) * double(a.cfg->rms_eps));
    const auto gam = [&](index_t i) { return std::fabs(double(a.w.gamma_ckv(i).to_float())); };
    const index_t pos = a.positions(t);
    return rounding_check::list_bf16_row(
        HD, RD, a.rope.cos_row(pos), a.rope.sin_row(pos), rho, 0x1p-10,
        [&](index_t i) { return r * gam(i) * e[i]; },
        [&](index_t i) { return r * gam(i) * std::fabs(d[i]); }, [&](index_t i) { return kd[i]; },
        ch, kMaxKvRepairs);
  }
  // Per head: INT32 qr @ wq_b[:, head], dequant, per-head RMSNorm, RoPE, BF16 store (fused).
  static void project_b(const Cpu<I>& be, const kernels::QkvArgs& a) {
    const index_t T = a.tokens(), QL = a.cfg->q_lora, H = a.cfg->n_heads;
    const index_t HD = a.cfg->head_dim, NOPE = a.cfg->nope_dim(), RD = a.cfg->rope_dim;
    [[maybe_unused]] const QkvScratch& s = a.s;
    [[maybe_unused]] const bool use_vnni = vnni(a);
    [[maybe_unused]] const QkvPackedWqB* packed = !use_vnni          ? nullptr
                                                  : I == Isa::avx512 ? a.w.wq_b_packed
                                                                     : packed_8(a);
    be.tasks(H, [&](std::int64_t h) {
      // Padded stride: rows 2 KB apart would alias in the 4K store/load check (see decode_avx2).
      // Tokens per matmul call: 8 (the axpy kernels' register tile), on avx512 24 (four of its
      // 6-token tiles share each L1 chunk of the head's weights).
      constexpr index_t kAccLd = kMaxHeadDim + 16;
      constexpr index_t kChunk = I == Isa::avx512 ? 24 : 8;
      alignas(64) std::int32_t acc[kChunk * kAccLd];
      double qf[kMaxHeadDim];
      const index_t n0 = h * HD;
      const index_t step = use_vnni ? kChunk : 8;
      for (index_t t0 = 0; t0 < T; t0 += step) {
        const int tc = int(std::min<index_t>(step, T - t0));
#if TILEDECODE_X86
        if (use_vnni) {
          std::int32_t a_sum[kChunk];
          for (int tt = 0; tt < tc; ++tt) a_sum[tt] = s.qr_pairs(t0 + tt, 0);  // q_latent's Σ qr
          if constexpr (I == Isa::avx512) {
            avx512::matmul_i8_packed(acc, kAccLd, a.qr.data() + t0 * a.qr.stride(0), a.qr.stride(0),
                                     a_sum, tc, packed->data.data() + std::size_t(n0 * QL), QL, HD);
          } else if (packed) {
            avx2_vnni::matmul_i8_packed(acc, kAccLd, a.qr.data() + t0 * a.qr.stride(0),
                                        a.qr.stride(0), a_sum, tc,
                                        packed->data.data() + std::size_t(n0 * QL), QL, HD);
          } else {
            avx2_vnni::matmul_i8_axpy(acc, kAccLd, a.qr.data() + t0 * a.qr.stride(0),
                                      a.qr.stride(0), a_sum, tc, a.w.wq_b.data(),
                                      a.w.wq_b.stride(0), QL, n0, n0 + HD);
          }
        } else if constexpr (has_avx2(I)) {
          avx2::matmul_i8_axpy(acc, kAccLd, s.qr_pairs.data() + t0 * s.qr_pairs.stride(0),
                               s.qr_pairs.stride(0), tc, a.w.wq_b.data(), a.w.wq_b.stride(0), QL,
                               n0, n0 + HD);
        } else
#endif
        {
          kernels::detail::matmul_i8_axpy_scalar(acc, kAccLd, a.qr.data() + t0 * a.qr.stride(0),
                                                 a.qr.stride(0), tc, a.w.wq_b.data(),
                                                 a.w.wq_b.stride(0), QL, n0, n0 + HD);
        }
        for (int tt = 0; tt < tc; ++tt) {
          const index_t t = t0 + tt;
          const index_t pos = a.positions(t);
          const qkv_detail::QHeadEpilogue e{acc + tt * kAccLd,
                                            a.qr_scale(t),
                                            a.w.wq_b_scale.data() + n0 * a.w.wq_b_scale.stride(0),
                                            a.w.wq_b_scale.stride(0),
                                            HD,
                                            NOPE,
                                            RD,
                                            double(a.cfg->rms_eps),
                                            a.rope.cos_row(pos),
                                            a.rope.sin_row(pos),
                                            a.q.data() + t * a.q.stride(0) + h * a.q.stride(1)};
          qkv_detail::q_head_epilogue<I>(e, qf);
        }
      }
    });
  }
};

}  // namespace cpu

template <cpu::Isa I>
struct backend_ops<kernels::QkvProjection, cpu::Cpu<I>> : cpu::backend_ops_qkv_projection<I> {};

}  // namespace tiledecode
