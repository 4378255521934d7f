#pragma once
// What one attention layer of the decode step reads and writes (spec §2, §9.2):
//   LayerWeights  views of the engine's weights of one layer (layouts of spec §2);
//   LayerCaches   views of the engine's pools of one layer (each layer has its own slice of
//                 every pool, spec §3.7), flattened to rows: blocks × page rows.
// Plus owning storage with the spec deployment sizes (for tests, examples and benchmarks; an
// engine keeps its own memory and only builds the views).
//
// Which fields a family uses (the others may stay empty views):
//   all      hc, attn_norm, qkv, attn_sink, wo_a, wo_b, wo_b_scale; caches.kv_cache
//   CSA      compressor (ratio 4 overlapping, OUT_DIM 1024), indexer (incl. its inner
//            compressor and the Hadamard rotation); caches.cmp_kv, state (2048 wide),
//            idx_kv_cache, idx_kv_scale, inner_state (512 wide)
//   HCA      compressor (ratio 128, OUT_DIM 512); caches.cmp_kv, state (1024 wide)
//   SWA      nothing more

#include <cstdint>

#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/kernels/output_projection.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace tiledecode::decode {

// Lightning-indexer weights of a CSA layer (spec §2, §6.4, §7.1).
struct IndexerWeights {
  ConstView<std::int8_t, 2> wq_b;         // idx_wq_b (Q_LORA, 64*128) INT8
  ConstView<float, 1> wq_b_scale;         // (64*128) per output column
  ConstView<bf16, 2> weights_proj;        // (D, 64)
  ConstView<bf16, 2> hadamard;            // (128, 128) rotation (Sylvester H / sqrt(128))
  kernels::CompressorWeights compressor;  // inner compressor: wkv/wgate (256, D), ape (4, 256),
                                          // norm_w (128)
  // wq_b, wq_b_scale and hadamard packed for kernels::indexer_query, made once at load time by
  // kernels::pack_indexer_query_weights (LayerWeightsStorage::pack does it). Required by the
  // CPU CSA step; the golden layer reads the plain views above.
  const kernels::IndexerQueryWeights* packed_query = nullptr;
};

// RoPE positions of the CSA indexer (spec §5 table, §11 items 1–2), one choice per layer call:
//   absolute (default): the indexer query rotates at its own position pos_t and the inner
//       compressor's row at its window start c*4 — the rule q/kv and the main compressors use,
//       so query·key rotations differ by the true distance;
//   reference: both at start_b (the pypto-lib CSA composition, [QUIRK] §11.1 and the CSA
//       reading of [AMBIGUOUS] §11.2), reproducing the reference bit for bit.
enum class IndexerRope : std::uint8_t { absolute, reference };

struct LayerOptions {
  IndexerRope indexer_rope = IndexerRope::absolute;
};

struct LayerWeights {
  LayerKind kind = LayerKind::swa;
  HcWeights hc;                           // hc_fn (24, 4D), hc_scale (3), hc_base (24) FP32
  ConstView<bf16, 1> attn_norm;           // (D) attention RMSNorm weight
  QkvWeights qkv;                         // wq_a, gamma_cq, wq_b(+scale), wkv, gamma_ckv
  ConstView<float, 1> attn_sink;          // (H)
  ConstView<bf16, 3> wo_a;                // (O_GROUPS, O_LORA, O_GROUP_IN)
  ConstView<std::int8_t, 2> wo_b;         // (D, O_GROUPS*O_LORA)
  ConstView<float, 1> wo_b_scale;         // (D)
  ConstView<float, 2> wo_a_norm;          // (O_GROUPS, O_LORA) optional: the o-proj's check
  kernels::CompressorWeights compressor;  // CSA main / HCA compressor
  IndexerWeights indexer;                 // CSA only
};

struct LayerCaches {
  View<bf16, 2> kv_cache;             // ori KV (ori_blocks*128, 512)
  View<bf16, 2> cmp_kv;               // compressed KV (cmp_blocks*128, 512)          CSA, HCA
  View<float, 2> state;               // compressor state (rows, 2*OUT_DIM)            CSA, HCA
  View<std::int8_t, 2> idx_kv_cache;  // index cache (idx_blocks*128, 128)            CSA
  View<float, 1> idx_kv_scale;        // (idx_blocks*128) dequant scale per row        CSA
  View<float, 2> inner_state;         // indexer compressor state (rows, 512)          CSA
};

// Owning weights of one layer with the spec shapes (zero-filled; see decode/synthetic.hpp).
struct LayerWeightsStorage {
  LayerKind kind = LayerKind::swa;
  Tensor<float, 2> hc_fn;
  Tensor<float, 1> hc_scale, hc_base;
  Tensor<bf16, 1> attn_norm, gamma_cq, gamma_ckv;
  Tensor<bf16, 2> wq_a, wkv;
  Tensor<std::int8_t, 2> wq_b;
  Tensor<float, 1> wq_b_scale, attn_sink;
  Tensor<bf16, 3> wo_a;
  Tensor<std::int8_t, 2> wo_b;
  Tensor<float, 1> wo_b_scale;
  // compressor (CSA main / HCA)
  Tensor<bf16, 2> cmp_wkv, cmp_wgate;
  Tensor<float, 2> cmp_ape;
  Tensor<bf16, 1> cmp_norm_w;
  // indexer (CSA)
  Tensor<std::int8_t, 2> idx_wq_b;
  Tensor<float, 1> idx_wq_b_scale;
  Tensor<bf16, 2> weights_proj, hadamard, inner_wkv, inner_wgate;
  Tensor<float, 2> inner_ape;
  Tensor<bf16, 1> inner_norm_w;
  kernels::IndexerQueryWeights idx_packed;  // filled by pack()
  // wq_b for the VNNI q/kv projection (avx2_vnni, avx512), filled by pack() where the CPU has
  // one of those tiers, in the layout of the best one (16 columns per vector where the CPU has
  // AVX-512, else 8; a step forced to the other VNNI tier runs its matmul on the plain wq_b, same
  // integers): a second copy of wq_b (Q_LORA·H·512 bytes, flash 32 MB per layer), not counted in
  // bytes().
  QkvPackedWqB wq_b_packed;
  // wq_a | wkv transposed, filled by pack() on every CPU: a second copy ((Q_LORA + 512)·D BF16,
  // flash 12.6 MB per layer), not counted in bytes(). Two readers:
  //   * the q-latent's and the kv rounding checks' repairs (one contiguous row per dot instead of
  //     a cache line per k of a column; on an Intel Xeon with AVX-512, T = 8: the kv check
  //     +10-12 % from wkv's columns, +2.3-2.9 % from the rows, the q-latent check 3-6 % cheaper
  //     from the rows; see docs/compressors.md, "kv check cost");
  //   * the avx512 tier's vdpbf16ps q/kv projection where the automatic BF16 choice resolves to
  //     dpbf16 (kernels::qkv_bf16_rows_useful: AMD with AVX-512). A step pinned to Bf16Dot::fma
  //     (every tier's bits) or Bf16Dot::exact (double sums from wq_a | wkv themselves) runs its
  //     dots on wq_a | wkv.
  QkvBf16Rows qkv_rows;
  // Per wo_a row an upper bound of its norm (kernels::output_projection_row_norms), filled by
  // pack(): the scale of the CPU o-proj's rounding check, which makes the default BF16 dots give
  // golden's Q8 activations (O_GROUPS·O_LORA floats, not counted in bytes()).
  Tensor<float, 2> wo_a_norm;
  // Per wq_a column an upper bound of its norm (kernels::qkv_wq_a_norms), filled by pack(): the
  // scale of the CPU q-latent's rounding check, which makes the default BF16 dots give golden's
  // qr (Q_LORA floats, not counted in bytes()).
  Tensor<float, 1> wq_a_norm;
  // Per wkv column an upper bound of its norm (kernels::qkv_wkv_norms), filled by pack() (beside
  // qkv_rows, which the kv check's repairs read): the scale of the CPU kv rounding check, which
  // makes the default dots give golden's kv (HEAD_DIM floats, not counted in bytes()).
  Tensor<float, 1> wkv_norm;
  // Per wkv and wgate row of the main and the inner compressor an upper bound of its norm
  // (kernels::compressor_row_norms), opt-in: pack() leaves them empty; a caller that sets them
  // (enable_compressor_rounding_check) turns on the CPU compressors' rounding check, which makes
  // their BF16 rows round as golden's do from the step's inputs, at a cost that exceeds the 5 %
  // budget on steps that close windows (docs/compressors.md; 2·OUT_DIM floats each, not counted
  // in bytes()).
  Tensor<float, 1> cmp_row_norms, inner_row_norms;

  LayerWeightsStorage() = default;
  LayerWeightsStorage(const ModelConfig& cfg, LayerKind k) : kind(k) {
    const index_t D = cfg.hidden, H = cfg.n_heads, HD = cfg.head_dim, QL = cfg.q_lora;
    hc_fn = Tensor<float, 2>({kHcMixes, index_t(kHcStreams) * D});
    hc_scale = Tensor<float, 1>({3});
    hc_base = Tensor<float, 1>({kHcMixes});
    attn_norm = Tensor<bf16, 1>({D});
    wq_a = Tensor<bf16, 2>({D, QL});
    gamma_cq = Tensor<bf16, 1>({QL});
    wq_b = Tensor<std::int8_t, 2>({QL, H * HD});
    wq_b_scale = Tensor<float, 1>({H * HD});
    wkv = Tensor<bf16, 2>({D, HD});
    gamma_ckv = Tensor<bf16, 1>({HD});
    attn_sink = Tensor<float, 1>({H});
    wo_a = Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, cfg.o_group_in()});
    wo_b = Tensor<std::int8_t, 2>({D, index_t(cfg.o_groups) * cfg.o_lora});
    wo_b_scale = Tensor<float, 1>({D});
    if (k == LayerKind::swa) return;
    const auto spec =
        k == LayerKind::csa ? kernels::csa_compressor_spec(cfg) : kernels::hca_compressor_spec(cfg);
    cmp_wkv = Tensor<bf16, 2>({spec.out_dim(), D});
    cmp_wgate = Tensor<bf16, 2>({spec.out_dim(), D});
    cmp_ape = Tensor<float, 2>({spec.ratio, spec.out_dim()});
    cmp_norm_w = Tensor<bf16, 1>({spec.head_dim});
    if (k != LayerKind::csa) return;
    const auto ispec = kernels::indexer_compressor_spec(cfg);
    const index_t IH = cfg.idx_n_heads, ID = cfg.idx_head_dim;
    idx_wq_b = Tensor<std::int8_t, 2>({QL, IH * ID});
    idx_wq_b_scale = Tensor<float, 1>({IH * ID});
    weights_proj = Tensor<bf16, 2>({D, IH});
    hadamard = Tensor<bf16, 2>({ID, ID});
    inner_wkv = Tensor<bf16, 2>({ispec.out_dim(), D});
    inner_wgate = Tensor<bf16, 2>({ispec.out_dim(), D});
    inner_ape = Tensor<float, 2>({ispec.ratio, ispec.out_dim()});
    inner_norm_w = Tensor<bf16, 1>({ispec.head_dim});
  }

  LayerWeights view() const {
    LayerWeights w;
    w.kind = kind;
    w.hc = {hc_fn.view(), hc_scale.view(), hc_base.view()};
    w.attn_norm = attn_norm.view();
    w.qkv = {wq_a.view(),
             gamma_cq.view(),
             wq_b.view(),
             wq_b_scale.view(),
             wkv.view(),
             gamma_ckv.view(),
             wq_b_packed.q_lora > 0 ? &wq_b_packed : nullptr,
             qkv_rows.hidden > 0 ? &qkv_rows : nullptr};
    w.attn_sink = attn_sink.view();
    w.wo_a = wo_a.view();
    w.wo_b = wo_b.view();
    w.wo_b_scale = wo_b_scale.view();
    if (wo_a_norm.size() > 0) w.wo_a_norm = wo_a_norm.view();
    if (wq_a_norm.size() > 0) w.qkv.wq_a_norm = wq_a_norm.view();
    if (wkv_norm.size() > 0) w.qkv.wkv_norm = wkv_norm.view();
    w.compressor = {cmp_wkv.view(), cmp_wgate.view(), cmp_ape.view(), cmp_norm_w.view()};
    if (cmp_row_norms.size() > 0) w.compressor.row_norms = cmp_row_norms.view();
    w.indexer = {idx_wq_b.view(),
                 idx_wq_b_scale.view(),
                 weights_proj.view(),
                 hadamard.view(),
                 {inner_wkv.view(), inner_wgate.view(), inner_ape.view(), inner_norm_w.view()},
                 kind == LayerKind::csa && idx_packed.q_lora > 0 ? &idx_packed : nullptr};
    if (inner_row_norms.size() > 0) w.indexer.compressor.row_norms = inner_row_norms.view();
    return w;
  }

  // Load-time preparation after the weights are filled: packs wq_b for the VNNI q/kv projection
  // (only where the CPU has AVX-VNNI or AVX-512), transposes wq_a | wkv (the rounding checks'
  // repairs; the vdpbf16ps q/kv projection where that is the automatic choice), bounds wo_a's row
  // norms, wq_a's and wkv's column norms (the o-proj's, the q-latent's and the kv rounding checks)
  // and packs the indexer query weights (CSA).
  void pack(const ModelConfig& cfg) {
    wo_a_norm = kernels::output_projection_row_norms(wo_a.view());
    wq_a_norm = kernels::qkv_wq_a_norms(wq_a.view());
    wkv_norm = kernels::qkv_wkv_norms(wkv.view());
    if (cpu::cpu_supports(cpu::Isa::avx2_vnni) || cpu::cpu_supports(cpu::Isa::avx512))
      wq_b_packed = kernels::pack_qkv_wq_b(cfg, wq_b.view());
    qkv_rows = kernels::pack_qkv_bf16_rows(cfg, wq_a.view(), wkv.view());
    if (kind != LayerKind::csa) return;
    idx_packed = kernels::pack_indexer_query_weights(cfg, idx_wq_b.view(), idx_wq_b_scale.view(),
                                                     hadamard.view());
  }

  // Opt-in: the compressors' rounding check (CompressorWeights::row_norms) for this layer's
  // compressors (none on SWA).
  void enable_compressor_rounding_check() {
    if (kind == LayerKind::swa) return;
    cmp_row_norms = kernels::compressor_row_norms(cmp_wkv.view(), cmp_wgate.view());
    if (kind == LayerKind::csa)
      inner_row_norms = kernels::compressor_row_norms(inner_wkv.view(), inner_wgate.view());
  }

  std::size_t bytes() const {
    std::size_t n = 0;
    const auto add = [&](const auto& t) { n += t.size() * sizeof(*t.data()); };
    add(hc_fn), add(hc_scale), add(hc_base), add(attn_norm), add(gamma_cq), add(gamma_ckv);
    add(wq_a), add(wkv), add(wq_b), add(wq_b_scale), add(attn_sink), add(wo_a), add(wo_b);
    add(wo_b_scale), add(cmp_wkv), add(cmp_wgate), add(cmp_ape), add(cmp_norm_w), add(idx_wq_b);
    add(idx_wq_b_scale), add(weights_proj), add(hadamard), add(inner_wkv), add(inner_wgate);
    add(inner_ape), add(inner_norm_w);
    return n;
  }
};

// Owning pools of one layer, sized by paged::PoolSizes (spec §1.3 deployment by default).
struct LayerCacheStorage {
  LayerKind kind = LayerKind::swa;
  Tensor<bf16, 2> kv_cache, cmp_kv;
  Tensor<float, 2> state, inner_state;
  Tensor<std::int8_t, 2> idx_kv_cache;
  Tensor<float, 1> idx_kv_scale;

  LayerCacheStorage() = default;
  // Pools in the pages of `layout` (paged::StepTables::layout): the compressed and index pools of
  // the prefix-caching layout hold cfg.page / R rows per page (HCA 1, CSA and index 32) and the
  // HCA / CSA compressed pools are separate (pools.hca_cmp / pools.csa_cmp); the base and
  // device-ring layouts share pools.cmp pages of cfg.page rows.
  LayerCacheStorage(const ModelConfig& cfg, LayerKind k, const paged::PoolSizes& pools,
                    paged::Layout layout = paged::Layout::base)
      : kind(k) {
    const bool prefix = layout == paged::Layout::prefix_caching;
    kv_cache = Tensor<bf16, 2>({pools.ori * cfg.page, cfg.head_dim});
    if (k == LayerKind::swa) return;
    const int ratio = k == LayerKind::hca ? 128 : 4;
    const index_t cmp_pages =
        !prefix ? pools.cmp : (k == LayerKind::hca ? pools.hca_cmp : pools.csa_cmp);
    cmp_kv = Tensor<bf16, 2>(
        {cmp_pages * rules::compressed_rows_per_page(layout, cfg.page, ratio), cfg.head_dim});
    if (k == LayerKind::hca) {
      state = Tensor<float, 2>(
          {pools.hca_state * cfg.c128_state_page, kernels::hca_compressor_spec(cfg).state_width()});
      return;
    }
    state = Tensor<float, 2>(
        {pools.csa_state * cfg.c4_state_page, kernels::csa_compressor_spec(cfg).state_width()});
    inner_state = Tensor<float, 2>({pools.csa_inner_state * cfg.c4_state_page,
                                    kernels::indexer_compressor_spec(cfg).state_width()});
    const index_t idx_rows = pools.idx * rules::compressed_rows_per_page(layout, cfg.page, 4);
    idx_kv_cache = Tensor<std::int8_t, 2>({idx_rows, cfg.idx_head_dim});
    idx_kv_scale = Tensor<float, 1>({idx_rows});
  }

  LayerCaches view() {
    return {kv_cache.view(),     cmp_kv.view(),       state.view(),
            idx_kv_cache.view(), idx_kv_scale.view(), inner_state.view()};
  }

  std::size_t bytes() const {
    return kv_cache.size() * 2 + cmp_kv.size() * 2 + state.size() * 4 + inner_state.size() * 4 +
           idx_kv_cache.size() + idx_kv_scale.size() * 4;
  }
};

}  // namespace tiledecode::decode
