// a2a3_report: predicted latency of the decode-step kernels on the Ascend a2a3 execution model
// (backend/a2a3), at B=4, S=2 and the CSA canonical starts 8192/0/2/3.
//
//   a2a3_report                 table: indexer (fused, two-scope), sparse attention, layers,
//                               per launch the per-pipe busy time of the slowest core
//   a2a3_report --json          one JSON object (indexer_fused_us, indexer_two_scope_us,
//                               sparse_attn_us, csa_layer_us, hca_layer_us, swa_layer_us, details)
//   a2a3_report --trace FILE    also writes the Chrome trace (chrome://tracing, Perfetto) of the
//                               CSA layer (fused indexer) to FILE
//
// Inputs are seeded random fixtures of the real shapes; the compressors, the indexer (with its
// inner compressor), qkv_proj_rope and sparse attention run functionally (their results are
// checked against golden in tests/test_a2a3.cpp); hc_pre, rms_norm, the cache write and hc_post
// are timing-only tile programs (layer.hpp). Every constant comes from backend/a2a3/arch.hpp.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/backend/a2a3/arch.hpp"
#include "tiledecode/backend/a2a3/compressor.hpp"
#include "tiledecode/backend/a2a3/indexer.hpp"
#include "tiledecode/backend/a2a3/layer.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/output_projection.hpp"
#include "tiledecode/backend/a2a3/qkv_projection.hpp"
#include "tiledecode/backend/a2a3/sparse_attention.hpp"
#include "tiledecode/backend/a2a3/trace.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/kernels/compressor.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace a2 = tiledecode::a2a3;
using td::index_t;

namespace {

struct Fixture {
  td::ModelConfig cfg = td::flash_config();
  td::paged::StepShape sh{4, 2, -1};
  index_t T = 8, B = 4;
  std::vector<std::int32_t> starts{8192, 0, 2, 3};
  td::Tensor<std::int32_t, 1> pos{{8}}, lens{{4}}, wlens{{8}};
  td::Tensor<std::int32_t, 2> ori_table{{4, 128}}, cmp_table{{4, 32}}, idx_table{{4, 64}},
      widx{{8, 128}};
  // indexer
  td::Tensor<td::bf16, 2> x_n{{8, 4096}}, weights_proj{{4096, 64}},
      hadamard = td::make_hadamard_bf16(128);
  td::Tensor<std::int8_t, 2> qr{{8, 1024}}, wq_b{{1024, 8192}}, idx_kv{{64 * 128, 128}};
  td::Tensor<float, 1> qr_scale{{8}}, wq_b_scale{{8192}}, idx_scale{{64 * 128}};
  td::Tensor<float, 2> score{{8, 4096}};
  td::Tensor<std::int32_t, 2> topk{{8, 4096}};
  // sparse attention
  td::Tensor<td::bf16, 3> q{{8, 64, 512}}, wo_a{{8, 1024, 4096}};
  td::Tensor<td::bf16, 2> ori_kv{{128 * 128, 512}}, cmp_kv{{32 * 128, 512}}, out{{8, 4096}};
  td::Tensor<std::int8_t, 2> wo_b{{4096, 8192}};
  td::Tensor<float, 1> sink{{64}}, wo_b_scale{{4096}};
  // qkv projection (its q / qr / qr_scale outputs feed sparse attention and the indexer)
  td::Tensor<td::bf16, 2> wq_a{{4096, 1024}}, wkv{{4096, 512}}, kv{{8, 512}};
  td::Tensor<td::bf16, 1> gamma_cq{{1024}}, gamma_ckv{{512}};
  td::Tensor<std::int8_t, 2> wq_b_attn{{1024, 64 * 512}};
  td::Tensor<float, 1> wq_b_attn_scale{{64 * 512}};
  td::RopeTable rope_csa = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  td::RopeTable rope_swa = td::make_rope_table(cfg, td::LayerKind::swa, cfg.max_seq_len);

  Fixture() {
    tdtest::Rng rng(2026);
    td::paged::build_position_ids(pos.view(), starts, sh, cfg);
    td::paged::build_kv_seq_lens(lens.view(), starts, sh, cfg);
    td::paged::build_fixture_block_table(ori_table.view(), 128);
    td::paged::build_fixture_block_table(cmp_table.view(), 32);
    td::paged::build_fixture_block_table(idx_table.view(), 64);
    td::paged::build_window_indices(widx.view(), wlens.view(), pos.view(), ori_table.view(), 128,
                                    sh, cfg);
    rng.fill_uniform(x_n.flat(), -1.0f, 1.0f);
    rng.fill_uniform(weights_proj.flat(), -0.4f, 0.4f);
    rng.fill_int8(qr.flat());
    rng.fill_int8(wq_b.flat());
    rng.fill_int8(idx_kv.flat());
    for (auto& s : qr_scale.flat()) s = rng.uniform(0.5f, 1.5f) / 127.0f;
    for (auto& s : wq_b_scale.flat()) s = rng.uniform(0.5f, 1.5f) / 127.0f / 32.0f;
    for (auto& s : idx_scale.flat()) s = rng.uniform(0.5f, 1.5f) / 127.0f;
    rng.fill_uniform(q.flat(), -0.5f, 0.5f);
    rng.fill_uniform(ori_kv.flat(), -0.5f, 0.5f);
    rng.fill_uniform(cmp_kv.flat(), -0.5f, 0.5f);
    rng.fill_uniform(wo_a.flat(), -0.035f, 0.035f);
    rng.fill_int8(wo_b.flat());
    for (auto& x : wo_b_scale.flat()) x = rng.uniform(0.5f, 1.5f) / 127.0f / 64.0f;
    for (auto& x : sink.flat()) x = 4.0f;
    rng.fill_uniform(wq_a.flat(), -0.035f, 0.035f);
    rng.fill_uniform(wkv.flat(), -0.035f, 0.035f);
    for (auto& g : gamma_cq.flat()) g = td::bf16(rng.uniform(0.5f, 1.5f));
    for (auto& g : gamma_ckv.flat()) g = td::bf16(rng.uniform(0.5f, 1.5f));
    rng.fill_int8(wq_b_attn.flat());
    for (auto& x : wq_b_attn_scale.flat()) x = rng.uniform(0.5f, 1.5f) / 127.0f / 32.0f;
  }
  td::QkvWeights qkv_weights() const {
    return {wq_a.view(), gamma_cq.view(), wq_b_attn.view(), wq_b_attn_scale.view(),
            wkv.view(),  gamma_ckv.view()};
  }

  a2::IndexerInputs indexer_inputs() const {
    return {x_n.view(),          qr.view(),        qr_scale.view(),  wq_b.view(), wq_b_scale.view(),
            weights_proj.view(), hadamard.view(),  rope_csa.view(),  pos.view(),  lens.view(),
            idx_kv.view(),       idx_scale.view(), idx_table.view(), sh.seq,      0};
  }
  // Sparse attention + the grouped o-projection, reported as one kernel (the reference's
  // measured `decode_sparse_attn` covers both).
  td::Tensor<td::bf16, 2> o_packed{{8 * 8, 4096}};
  a2::KernelReport sparse_attention(a2::Machine& m, td::LayerKind kind) {
    const a2::Context ctx{&m, nullptr};
    std::vector<std::byte> ws(
        std::max(td::kernels::sparse_attention_workspace_bytes(ctx, cfg, kind, T),
                 td::kernels::output_projection_workspace_bytes(ctx, cfg, T)));
    m.begin_kernel(std::string("sparse_attn_") + std::string(td::to_string(kind)));
    td::kernels::sparse_attention(
        ctx, cfg, kind, o_packed.view(), q.view(), ori_kv.view(), cmp_kv.view(), widx.view(),
        wlens.view(), topk.view(), cmp_table.view(), pos.view(), lens.view(), sh.seq, sink.view(),
        kind == td::LayerKind::swa ? rope_swa.view() : rope_csa.view(), ws);
    td::kernels::output_projection(ctx, cfg, out.view(), o_packed.view(), wo_a.view(), wo_b.view(),
                                   wo_b_scale.view(), ws);
    return m.end_kernel();
  }
};

// One compressor's state, weights and metadata (spec §10.3 statistics).
struct CompressorData {
  td::kernels::CompressorSpec spec;
  bool inner;
  index_t page, blocks;
  td::Tensor<std::int32_t, 2> state_table, cmp_table;
  td::Tensor<std::int64_t, 1> state_slots{{8}}, cmp_slots{{8}};
  td::Tensor<td::bf16, 2> wkv, wgate;
  td::Tensor<float, 2> ape, state_pool;
  td::Tensor<td::bf16, 1> norm_w;
  td::a2a3::CompressorWorkspace ws;

  CompressorData(const Fixture& f, td::kernels::CompressorSpec sp, bool inner_, std::uint64_t seed)
      : spec(sp),
        inner(inner_),
        page(sp.ratio == 4 ? 4 : 8),
        blocks(sp.ratio == 4 ? 65 : 64),
        state_table({4, sp.ratio == 4 ? 4096 : 2048}),
        cmp_table({4, inner_ ? 64 : 32}),
        wkv({sp.out_dim(), 4096}),
        wgate({sp.out_dim(), 4096}),
        ape({sp.ratio, sp.out_dim()}),
        state_pool({blocks * page, 2 * sp.out_dim()}),
        norm_w({sp.head_dim}),
        ws(8, sp) {
    tdtest::Rng rng(seed);
    td::paged::build_fixture_block_table(state_table.view(), blocks);
    td::paged::build_fixture_block_table(cmp_table.view(), inner_ ? 64 : 32);
    td::paged::build_state_slot_mapping(state_slots.view(), f.pos.view(), state_table.view(),
                                        blocks, int(page), f.sh, f.cfg);
    td::paged::build_compressed_slot_mapping(cmp_slots.view(), f.pos.view(), cmp_table.view(),
                                             inner_ ? 64 : 32, sp.ratio, f.sh, f.cfg);
    rng.fill_uniform(wkv.flat(), -0.05f, 0.05f);
    rng.fill_uniform(wgate.flat(), -0.08f, 0.08f);
    rng.fill_uniform(ape.flat(), -0.25f, 0.25f);
    for (auto& x : norm_w.flat()) x = td::bf16(rng.uniform(0.6f, 1.2f));
    if (sp.ratio == 4)
      for (int b = 0; b < 4; ++b)
        for (int p = std::max(0, f.starts[std::size_t(b)] - 16); p < f.starts[std::size_t(b)]; ++p)
          for (index_t o = 0; o < 2 * sp.out_dim(); ++o)
            state_pool.view()(index_t(state_table.view()(b, p / page)) * page + p % page, o) =
                rng.uniform(-0.1f, 0.1f);
  }
  td::a2a3::CompressorInputs inputs(const Fixture& f) const {
    return {spec,
            f.x_n.view(),
            {wkv.view(), wgate.view(), ape.view(), norm_w.view()},
            {f.sh, f.pos.view(), state_slots.view(), cmp_slots.view(), state_table.view()},
            f.rope_csa.view(),
            td::kernels::InnerRopePosition::request_start,  // the CSA composition's rule
            f.hadamard.view()};
  }
};

std::string fmt(double v, int prec = 2) {
  char b[32];
  std::snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}

void print_kernel(const a2::KernelReport& k) {
  std::printf("%-28s %9s us   (GM %.2f MiB, ring %.2f MiB)\n", k.name.c_str(),
              fmt(k.latency_us()).c_str(), double(k.traffic().gm_total()) / (1 << 20),
              double(k.traffic().ring) / (1 << 20));
  std::printf("  %-30s %6s %8s %8s %8s %-7s |", "launch", "blocks", "lat_us", "core_us", "hbm_us",
              "slowest");
  for (int p = 0; p < a2::kPipes; ++p)
    std::printf(" %7s", std::string(a2::pipe_name(a2::Pipe(p))).c_str());
  std::printf("  (busy us, slowest core)\n");
  for (const auto& l : k.launches) {
    std::printf("  %-30s %6d %8s %8s %8s %-7s |", l.name.c_str(), l.blocks,
                fmt(l.latency_us).c_str(), fmt(l.core_us).c_str(), fmt(l.hbm_bound_us).c_str(),
                l.slowest_core.c_str());
    for (int p = 0; p < a2::kPipes; ++p)
      std::printf(" %7s", fmt(l.busy_slowest_us[std::size_t(p)]).c_str());
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::string trace_file;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) {
      json = true;
    } else if (!std::strcmp(argv[i], "--trace") && i + 1 < argc) {
      trace_file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--json] [--trace FILE]\n", argv[0]);
      return 2;
    }
  }
  try {
    Fixture f;
    td::ThreadPool pool;
    const td::ModelConfig& cfg = f.cfg;

    // CSA layer on a traced machine: front kernels, main compressor, indexer (fused, with its
    // inner compressor), sparse attention, hc_post.
    a2::Machine m(&pool);
    m.set_tracing(!trace_file.empty());
    a2::QkvWorkspace qws(int(f.T), cfg);
    auto run_qkv = [&](a2::Machine& mm, const td::RopeTable& rope) {
      return a2::qkv_projection(mm, f.q.view(), f.kv.view(), f.qr.view(), f.qr_scale.view(),
                                f.x_n.view(), f.qkv_weights(), rope.view(), f.pos.view(), qws, cfg);
    };
    a2::LayerReport csa{td::LayerKind::csa, a2::layer_pre_timing(m, cfg, f.T)};
    csa.kernels.push_back(run_qkv(m, f.rope_csa));
    csa.kernels.push_back(a2::cache_write_timing(m, cfg, f.T));
    CompressorData cmp4(f, td::kernels::csa_compressor_spec(cfg), false, 41);
    csa.kernels.push_back(a2::compressor(
        m, cmp4.inputs(f), {cmp4.state_pool.view(), f.cmp_kv.view(), {}, {}}, cmp4.ws, cfg, false));
    CompressorData inner(f, td::kernels::indexer_compressor_spec(cfg), true, 43);
    const a2::InnerCompressorStep inner_step{
        inner.inputs(f),
        {inner.state_pool.view(), {}, f.idx_kv.view(), f.idx_scale.view()},
        &inner.ws};
    a2::IndexerWorkspace iws(int(f.T), cfg, false);
    const a2::KernelReport fused =
        a2::indexer(m, f.indexer_inputs(), {f.score.view(), f.topk.view()}, iws, cfg,
                    a2::ScoreDesign::fused, a2::kIdxRingSlots, &inner_step);
    csa.kernels.push_back(fused);
    const a2::KernelReport sparse = f.sparse_attention(m, td::LayerKind::csa);
    csa.kernels.push_back(sparse);
    csa.kernels.push_back(a2::hc_post_timing(m, cfg, f.T));

    // Two-scope indexer (untraced machine, its own copy of the inner compressor's state).
    a2::Machine m2(&pool);
    CompressorData inner2(f, td::kernels::indexer_compressor_spec(cfg), true, 43);
    const a2::InnerCompressorStep inner_step2{
        inner2.inputs(f),
        {inner2.state_pool.view(), {}, f.idx_kv.view(), f.idx_scale.view()},
        &inner2.ws};
    a2::IndexerWorkspace iws2(int(f.T), cfg, true);
    const a2::KernelReport two =
        a2::indexer(m2, f.indexer_inputs(), {f.score.view(), f.topk.view()}, iws2, cfg,
                    a2::ScoreDesign::two_scope, a2::kIdxRingSlots, &inner_step2);

    // HCA and SWA layers at the same starts.
    a2::LayerReport hca{td::LayerKind::hca, a2::layer_pre_timing(m2, cfg, f.T)};
    hca.kernels.push_back(run_qkv(m2, f.rope_csa));
    hca.kernels.push_back(a2::cache_write_timing(m2, cfg, f.T));
    CompressorData cmp128(f, td::kernels::hca_compressor_spec(cfg), false, 47);
    hca.kernels.push_back(a2::compressor(m2, cmp128.inputs(f),
                                         {cmp128.state_pool.view(), f.cmp_kv.view(), {}, {}},
                                         cmp128.ws, cfg, false));
    hca.kernels.push_back(f.sparse_attention(m2, td::LayerKind::hca));
    hca.kernels.push_back(a2::hc_post_timing(m2, cfg, f.T));
    a2::LayerReport swa{td::LayerKind::swa, a2::layer_pre_timing(m2, cfg, f.T)};
    swa.kernels.push_back(run_qkv(m2, f.rope_swa));
    swa.kernels.push_back(a2::cache_write_timing(m2, cfg, f.T));
    swa.kernels.push_back(f.sparse_attention(m2, td::LayerKind::swa));
    swa.kernels.push_back(a2::hc_post_timing(m2, cfg, f.T));

    if (!trace_file.empty()) {
      std::ofstream os(trace_file);
      if (!os) throw td::Error("a2a3_report: cannot open trace file '" + trace_file + "'");
      a2::write_chrome_trace(os, m);
    }

    if (json) {
      std::ostringstream o;
      o << "{\"model\":\"a2a3\",\"shape\":{\"B\":4,\"S\":2,\"starts\":[8192,0,2,3]}"
        << ",\"indexer_fused_us\":" << fmt(fused.latency_us(), 3)
        << ",\"indexer_two_scope_us\":" << fmt(two.latency_us(), 3)
        << ",\"sparse_attn_us\":" << fmt(sparse.latency_us(), 3)
        << ",\"csa_layer_us\":" << fmt(csa.latency_us(), 3)
        << ",\"hca_layer_us\":" << fmt(hca.latency_us(), 3)
        << ",\"swa_layer_us\":" << fmt(swa.latency_us(), 3)
        << ",\"launch_overhead_us\":" << fmt(a2::kArch.launch_overhead_us, 3)
        << ",\"timing_only_kernels\":[\"hc_pre\",\"rms_norm\",\"cache_write\",\"hc_post\"]";
      auto layer_json = [&](const char* key, const a2::LayerReport& l) {
        o << ",\"" << key << "\":[";
        for (std::size_t i = 0; i < l.kernels.size(); ++i)
          o << (i ? "," : "") << "{\"kernel\":\"" << l.kernels[i].name
            << "\",\"latency_us\":" << fmt(l.kernels[i].latency_us(), 3) << "}";
        o << "]";
      };
      layer_json("csa_layer", csa);
      layer_json("hca_layer", hca);
      layer_json("swa_layer", swa);
      o << ",\"kernels\":{\"indexer_fused\":" << a2::kernel_json(fused)
        << ",\"indexer_two_scope\":" << a2::kernel_json(two)
        << ",\"sparse_attn\":" << a2::kernel_json(sparse) << "}}";
      std::cout << o.str() << "\n";
      return 0;
    }

    std::printf(
        "a2a3 execution model (one 910B-class die: %d AIC + %d AIV, %.2f GHz, HBM %.2f TB/s,\n"
        "launch overhead %.1f us); B=4, S=2, CSA canonical starts 8192/0/2/3\n\n",
        a2::kArch.cube_cores, a2::kArch.vector_cores(), a2::kArch.clock_hz / 1e9,
        a2::kArch.hbm_bytes_per_s / 1e12, a2::kArch.launch_overhead_us);
    print_kernel(fused);
    std::printf("\n");
    print_kernel(two);
    std::printf("\n");
    print_kernel(sparse);
    std::printf("\nlayers (kernels of spec §9.2 in sequence; * = timing-only tile program):\n");
    for (const auto* l : {&csa, &hca, &swa}) {
      std::printf("  %s layer %9s us :", std::string(td::to_string(l->kind)).c_str(),
                  fmt(l->latency_us()).c_str());
      for (const auto& k : l->kernels) {
        const bool timing_only = k.name == "hc_pre" || k.name == "rms_norm" ||
                                 k.name == "cache_write" || k.name == "hc_post";
        std::printf(" %s%s=%s", k.name.c_str(), timing_only ? "*" : "",
                    fmt(k.latency_us()).c_str());
      }
      std::printf("\n");
    }
    std::printf("\nsummary: indexer fused %.2f us vs two-scope %.2f us; sparse attention %.2f us\n",
                fused.latency_us(), two.latency_us(), sparse.latency_us());
    if (!trace_file.empty()) std::printf("trace written to %s\n", trace_file.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "a2a3_report: %s\n", e.what());
    return 1;
  }
  return 0;
}
