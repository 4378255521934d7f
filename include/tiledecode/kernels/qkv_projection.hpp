#pragma once
// q / kv projections with RoPE and the INT8 q-latent (spec §4 step 3) — contract and tile program:
//   cq   = rmsnorm(x_n @ wq_a, gamma_cq)                      FP32 [T, Q_LORA] (not rounded)
//   qr, qr_scale = Q8(cq)                                     per token (core/quant.hpp)
//   qf   = ((qr @ wq_b)_int32 * qr_scale) * wq_b_scale          FP32 [T, H*512] → [T, H, 512]
//   qf   = qf * rsqrt(mean_over_512(qf^2) + eps)             per-head RMSNorm, no weight
//   q    = bf16([qf[:448], rope_fwd(qf[448:], pos_t)])
//   kvf  = rmsnorm(x_n @ wkv, gamma_ckv)                      FP32 [T, 512]
//   kv   = bf16([kvf[:448], rope_fwd(kvf[448:], pos_t)])
// The RoPE table is the layer's (SWA: plain; CSA/HCA: YaRN), read at pos_t = position_ids[t].
//
// Program: project_a (the BF16 tile matmul x_n · [wq_a | wkv]), then per token the q-latent
// (RMSNorm, Q8) and the kv row (RMSNorm, RoPE, BF16), then project_b (the INT8 tile matmul
// qr · wq_b with its epilogue: dequant, per-head RMSNorm, RoPE, BF16). Backends
// (backend_ops<QkvProjection, B>):
//   CPU   weights streamed once for all T tokens in axpy order; the epilogues in double (they keep
//         cq on the reference's side of Q8's rounding boundaries); project_b per query head with
//         the epilogue fused (backend/cpu/qkv_projection.hpp);
//   a2a3  a_mm (cube) -> norm (vector) -> b_mm (cube, INT32 to GM) -> q_post (vector), FP32.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode {

// wq_b repacked for the CPU's VNNI tiers, avx2_vnni and avx512 (kernels::pack_qkv_wq_b): u8
// (w + 128) k-quads of `vector_cols` columns, column-vector-major, so one head's 512 columns ×
// Q_LORA rows are one contiguous run (512 KB for flash). vector_cols = 8 is the avx2_vnni layout
// (cpu::avx2_vnni::matmul_i8_packed: one 256-bit operand per quad), 16 the avx512 one
// (cpu::avx512::matmul_i8_packed: one 512-bit operand per quad); a tier given the other layout
// runs its matmul on the plain wq_b instead (the same integers). A second copy of wq_b, same size
// (flash: 32 MB per layer), made at load time only where the CPU has a VNNI tier; the original
// stays (the other tiers, golden and the a2a3 backend read it).
struct QkvPackedWqB {
  index_t q_lora = 0;       // K
  index_t cols = 0;         // H*512
  index_t vector_cols = 8;  // columns per packed vector: 8 or 16
  Buffer<std::uint8_t> data;
};

// wq_a and wkv transposed for the avx512 tier's vdpbf16ps row kernels
// (kernels::pack_qkv_bf16_rows): row n holds output column n's D weights, k contiguous (rows[n·D +
// k] = w[k, n]), wq_a's Q_LORA rows then wkv's HEAD_DIM rows. vdpbf16ps multiplies pairs of
// consecutive k, which the (D, N) layout keeps N apart. Read only by Isa::avx512 with
// Bf16Dot::dpbf16 (automatic on AMD, where vdpbf16ps retires twice the FP32 FMA rate); a second
// copy of both matrices (flash: 12.6 MB per layer), made at load time only where that choice
// resolves to dpbf16.
struct QkvBf16Rows {
  index_t hidden = 0;   // D
  index_t q_rows = 0;   // Q_LORA
  index_t kv_rows = 0;  // HEAD_DIM
  Buffer<bf16> data;    // ((Q_LORA + HEAD_DIM), D)
};

// The q/kv projection weights of one layer (spec §2 layouts, used as x @ W).
struct QkvWeights {
  ConstView<bf16, 2> wq_a;         // (D, Q_LORA)
  ConstView<bf16, 1> gamma_cq;     // (Q_LORA)
  ConstView<std::int8_t, 2> wq_b;  // (Q_LORA, H*512)
  ConstView<float, 1> wq_b_scale;  // (H*512) per output column
  ConstView<bf16, 2> wkv;          // (D, 512)
  ConstView<bf16, 1> gamma_ckv;    // (512)
  // Optional packed copy of wq_b: used by the CPU's VNNI tiers when present (same results).
  const QkvPackedWqB* wq_b_packed = nullptr;
  // Optional transposed copy of wq_a | wkv: used by Isa::avx512 with Bf16Dot::dpbf16 when
  // present (vdpbf16ps: another summation order, within the spec's tolerances and the rounding
  // bars); without it that tier runs the 512-bit FMA kernel (every tier's bits). The rounding
  // checks' repairs read it on every tier where present (one contiguous row per dot).
  const QkvBf16Rows* bf16_rows = nullptr;
  // Optional: per column of wq_a an upper bound of its Euclidean norm (qkv_wq_a_norms), each >= 0
  // (+Inf: a bound that trusts nothing). Given it, the CPU backend's q-latent rounding check
  // (backend/cpu/qkv_projection.hpp) recomputes as golden does the cq values whose Q8 rounding
  // the default FP32 dots cannot decide, from bf16_rows where present, else from wq_a's columns.
  ConstView<float, 1> wq_a_norm = {};  // (Q_LORA)
  // Optional: per column of wkv an upper bound of its Euclidean norm (qkv_wkv_norms), each >= 0.
  // Given it, the CPU backend's kv rounding check recomputes as golden does the kv dots whose
  // BF16 rounding (after the RMS norm and the RoPE) the default FP32 dots cannot decide, and the
  // token's every dot where golden's RMS factor is needed, from bf16_rows where present, else from
  // wkv's columns (a cache line per k: on an Intel Xeon, T = 8, +10-12 % for the call against
  // +2.3-2.9 % from the rows; decode/layer.hpp's pack makes both).
  ConstView<float, 1> wkv_norm = {};  // (HEAD_DIM)
};

// Caller scratch of qkv_projection (FP32 / INT32, T rows), plus `extra` bytes for backends that
// need more (qkv_projection_workspace_bytes; 0 for the CPU).
struct QkvScratch {
  View<float, 2> x;                // (T, D)       x_n widened to FP32
  View<float, 2> cq;               // (T, Q_LORA)  normed q-latent
  View<float, 2> kvf;              // (T, 512)     normed kv before RoPE
  View<std::int32_t, 2> qr_pairs;  // (T, Q_LORA/2) the INT8 matmul's operand staging: qr packed
                                   // as int16 pairs (avx2, scalar); [t, 0] = Σ_k qr[t, k] on
                                   // VNNI tiers (the sum that undoes vpdpbusd's u8 offset)
  std::span<std::byte> extra = {};
};

namespace kernels {

struct QkvProjection {
  static constexpr std::string_view kernel_name = "qkv_proj_rope";
};

struct QkvArgs {
  const ModelConfig* cfg = nullptr;
  View<bf16, 3> q;          // (T, H, 512)
  View<bf16, 2> kv;         // (T, 512)
  View<std::int8_t, 2> qr;  // (T, Q_LORA)
  View<float, 1> qr_scale;  // (T)
  ConstView<bf16, 2> x_n;   // (T, D)
  QkvWeights w;
  RopeTableView rope;
  ConstView<std::int32_t, 1> positions;  // (T)
  QkvScratch s;
  index_t tokens() const { return x_n.extent(0); }
};

inline void validate(const QkvArgs& a) {
  constexpr std::string_view where = "qkv_projection";
  const ModelConfig& cfg = *a.cfg;
  const index_t D = cfg.hidden, QL = cfg.q_lora, H = cfg.n_heads;
  const index_t HD = cfg.head_dim, RD = cfg.rope_dim;
  if (HD > 512 || HD % 256 != 0) throw_arg(where, "cfg.head_dim", HD, "256 or 512");
  if (QL % 256 != 0) throw_arg(where, "cfg.q_lora", QL, "a multiple of 256");
  // INT32 bound of the q-latent matmul: Q_LORA · 127 · 127 < 2^31.
  check_range<index_t>(where, "cfg.q_lora", QL, 2, 2 * 65536);
  check_equal<index_t>(where, "cfg.rope_dim", RD, 64);
  check_view(where, "x_n", a.x_n);
  const index_t T = a.x_n.extent(0);
  check_rows(where, "x_n", a.x_n, {T, D});
  check_rows(where, "w.wq_a", a.w.wq_a, {D, QL});
  check_extents(where, "w.gamma_cq", a.w.gamma_cq, {QL});
  check_rows(where, "w.wq_b", a.w.wq_b, {QL, H * HD});
  check_extents(where, "w.wq_b_scale", a.w.wq_b_scale, {H * HD});
  check_rows(where, "w.wkv", a.w.wkv, {D, HD});
  check_extents(where, "w.gamma_ckv", a.w.gamma_ckv, {HD});
  check_rows(where, "q", a.q, {T, H, HD});
  check_rows(where, "kv", a.kv, {T, HD});
  check_rows(where, "qr", a.qr, {T, QL});
  check_extents(where, "qr_scale", a.qr_scale, {T});
  check_extents(where, "position_ids", a.positions, {T});
  check_rows(where, "scratch.x", a.s.x, {T, D});
  check_rows(where, "scratch.cq", a.s.cq, {T, QL});
  check_rows(where, "scratch.kvf", a.s.kvf, {T, HD});
  check_rows(where, "scratch.qr_pairs", a.s.qr_pairs, {T, QL / 2});
  check_rope_table(where, a.rope);
  check_equal<index_t>(where, "rope.cos.extent(1)", a.rope.cos.extent(1), RD);
  for (index_t t = 0; t < T; ++t) {
    const index_t p = a.positions(t);
    if (p < 0 || p >= a.rope.length())
      check_range<index_t>(where, nth_name("position_ids", t), p, 0, a.rope.length());
  }
  if (const QkvPackedWqB* pk = a.w.wq_b_packed) {
    check_equal(where, "w.wq_b_packed->q_lora", pk->q_lora, QL);
    check_equal(where, "w.wq_b_packed->cols", pk->cols, H * HD);
    check_equal(where, "w.wq_b_packed->data.size()", index_t(pk->data.size()), QL * H * HD);
    if (pk->vector_cols != 8 && pk->vector_cols != 16)
      throw_arg(where, "w.wq_b_packed->vector_cols", pk->vector_cols, "8 or 16");
  }
  if (const QkvBf16Rows* r = a.w.bf16_rows) {
    check_equal(where, "w.bf16_rows->hidden", r->hidden, D);
    check_equal(where, "w.bf16_rows->q_rows", r->q_rows, QL);
    check_equal(where, "w.bf16_rows->kv_rows", r->kv_rows, HD);
    check_equal(where, "w.bf16_rows->data.size()", index_t(r->data.size()), (QL + HD) * D);
  }
  if (a.w.wq_a_norm.data() != nullptr) {
    check_extents(where, "w.wq_a_norm", a.w.wq_a_norm, {QL});
    check_nonnegative(where, "w.wq_a_norm", a.w.wq_a_norm, "a value >= 0 (qkv_wq_a_norms)");
  }
  if (a.w.wkv_norm.data() != nullptr) {
    check_extents(where, "w.wkv_norm", a.w.wkv_norm, {HD});
    check_nonnegative(where, "w.wkv_norm", a.w.wkv_norm, "a value >= 0 (qkv_wkv_norms)");
  }
}

// Per column n of wq_a (D, Q_LORA) an upper bound of its Euclidean norm (bf16_norm_bound: FP32,
// rounded up; +Inf past FLT_MAX or for a column with a NaN): QkvWeights::wq_a_norm. A load-time
// preparation (decode/layer.hpp LayerWeightsStorage::pack) that reads wq_a a column at a time.
inline Tensor<float, 1> qkv_wq_a_norms(ConstView<bf16, 2> wq_a) {
  const index_t D = wq_a.extent(0), QL = wq_a.extent(1);
  Tensor<float, 1> r({QL});
  for (index_t n = 0; n < QL; ++n) r.data()[n] = bf16_norm_bound(&wq_a(0, n), D, wq_a.stride(0));
  return r;
}

// Per column n of wkv (D, HEAD_DIM) the same: QkvWeights::wkv_norm.
inline Tensor<float, 1> qkv_wkv_norms(ConstView<bf16, 2> wkv) {
  return qkv_wq_a_norms(wkv);
}

// The tile program (both backends).
template <class B>
void qkv_projection_program(const B& be, const QkvArgs& a) {
  using Ops = ops_for<QkvProjection, B>;
  Ops::project_a(be, a);  // [cq | kvf] = x_n · [wq_a | wkv]   (FP32, BF16 × BF16)
  Ops::for_tokens(be, a, [&](auto& lane, index_t t) {
    Ops::q_latent(lane, a, t);  // cq = rmsnorm(cq)·gamma_cq; qr, qr_scale = Q8(cq)
    Ops::kv_row(lane, a, t);    // kv = bf16([kvf·r·gamma][:448], rope_fwd([..][448:], pos_t))
  });
  Ops::project_b(be, a);  // q = bf16(rope(head_rmsnorm((qr · wq_b)·qr_scale·wq_b_scale)))
}

template <class Be>
std::size_t qkv_projection_workspace_bytes(const Be& be, const ModelConfig& cfg, index_t tokens) {
  return dispatch(be, [&](const auto& b) {
    return ops_for<QkvProjection, decltype(b)>::workspace_bytes(b, cfg, tokens);
  });
}

// Owning scratch of one call for T tokens on backend `be` (tests and tools; the decode Workspace
// holds its own).
struct QkvScratchStorage {
  Tensor<float, 2> x, cq, kvf;
  Tensor<std::int32_t, 2> qr_pairs;
  Buffer<std::byte> extra;
  template <class Be>
  QkvScratchStorage(const Be& be, const ModelConfig& cfg, index_t T)
      : x({T, cfg.hidden}),
        cq({T, cfg.q_lora}),
        kvf({T, cfg.head_dim}),
        qr_pairs({T, cfg.q_lora / 2}),
        extra(qkv_projection_workspace_bytes(be, cfg, T)) {}
  QkvScratch view() { return {x.view(), cq.view(), kvf.view(), qr_pairs.view(), extra.span()}; }
};

// q (T, H, 512) BF16, kv (T, 512) BF16, qr (T, Q_LORA) INT8, qr_scale (T) FP32
//   ← x_n (T, D) BF16, the layer's QkvWeights, its RoPE table, position_ids (T), on backend `be`.
// position_ids[t] must lie in [0, rope.length()). Scratch views per QkvScratch (s.extra >=
// qkv_projection_workspace_bytes(be, cfg, T)). Throws tiledecode::Error on any shape or position
// mismatch, before writing anything.
template <class Be>
void qkv_projection(const Be& be, View<bf16, 3> q, View<bf16, 2> kv, View<std::int8_t, 2> qr,
                    View<float, 1> qr_scale, ConstView<bf16, 2> x_n, const QkvWeights& w,
                    RopeTableView rope, ConstView<std::int32_t, 1> position_ids, QkvScratch s,
                    const ModelConfig& cfg) {
  const QkvArgs a{&cfg, q, kv, qr, qr_scale, x_n, w, rope, position_ids, s};
  dispatch(be, [&](const auto& b) {
    validate(a);
    ops_for<QkvProjection, decltype(b)>::check(b, a);
    if (a.tokens() == 0) return;
    b.kernel(QkvProjection::kernel_name, [&] { qkv_projection_program(b, a); });
  });
}

}  // namespace kernels
}  // namespace tiledecode
