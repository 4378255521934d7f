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
// Each layer is ONE decode::layer_step on the a2a3 backend: every kernel of spec §9.2 runs as its
// tile program on the model (the same programs the CPU runs; their results are checked against
// golden in tests/test_a2a3.cpp), with synthetic weights and pools at the spec's statistics
// (decode/synthetic.hpp). The figures the reference measured group kernels: its indexer
// (indexer_fused_us / indexer_two_scope_us) is the indexer's inner compressor + query + score +
// top-k, its `decode_sparse_attn` (sparse_attn_us) is sparse attention + the output projection.
// Every constant comes from backend/a2a3/arch.hpp.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tiledecode/backend/a2a3/arch.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/trace.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace a2 = tiledecode::a2a3;
using td::index_t;

namespace {

constexpr std::uint64_t kSeed = 2026;

// One layer of each family at the canonical starts, on one machine.
struct Stack {
  td::ModelConfig cfg = td::flash_config();
  td::paged::StepShape sh{4, 2, -1};
  std::vector<std::int32_t> starts{8192, 0, 2, 3};
  td::paged::PoolSizes pools = td::paged::PoolSizes::for_batch(4);
  td::paged::FixtureTables fx{4, pools, false, cfg};
  td::paged::StepMetadata md{4, 2, cfg};
  td::RopeTable rope_swa = td::make_rope_table(cfg, td::LayerKind::swa, cfg.max_seq_len);
  td::RopeTable rope_cmp = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  td::Tensor<float, 3> x_hc{{8, 4, cfg.hidden}}, x_out{{8, 4, cfg.hidden}};

  explicit Stack(const td::cpu::Context& host) {
    md.build(starts, sh, fx.tables(), pools, cfg);
    td::decode::synthetic::fill_x_hc(host, x_hc.view(), kSeed, 0);
  }

  // The layer's kernels as the model reports them (one KernelReport per kernel, in order).
  std::vector<a2::KernelReport> run(a2::Machine& m, const td::cpu::Context& host,
                                    td::LayerKind kind, a2::ScoreDesign design) {
    // Layer index of the family in the flash schedule (the synthetic weights are keyed by it).
    int layer = 0;
    while (cfg.layer_kind(layer) != kind) ++layer;
    td::decode::LayerWeightsStorage w(cfg, kind);
    td::decode::synthetic::fill_weights(host, w, cfg, layer, kSeed);
    w.pack(cfg);
    td::decode::LayerCacheStorage c(cfg, kind, pools);
    td::decode::synthetic::fill_caches(host, c, cfg, layer, kSeed);
    std::vector<a2::KernelReport> reports;
    const auto be = td::decode::Backend::a2a3(&m, &reports, design);
    td::decode::Workspace ws(cfg, 4, 2, be);
    td::decode::layer_step(be, x_out.view(), x_hc.view(), w.view(), c.view(), md,
                           (kind == td::LayerKind::swa ? rope_swa : rope_cmp).view(), ws, cfg);
    return reports;
  }
};

double total_us(const std::vector<a2::KernelReport>& ks) {
  double s = 0;
  for (const auto& k : ks) s += k.latency_us();
  return s;
}

// The kernels named in `names` as one report `name` (their launches in sequence).
a2::KernelReport group(const std::vector<a2::KernelReport>& ks, std::string name,
                       std::initializer_list<std::string_view> names) {
  a2::KernelReport r{std::move(name), {}};
  for (const auto& k : ks)
    for (auto n : names)
      if (k.name == n) r.launches.insert(r.launches.end(), k.launches.begin(), k.launches.end());
  return r;
}

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
    td::ThreadPool pool;
    const td::cpu::Context host = td::cpu::make_context(&pool);
    Stack st(host);

    // CSA layer on the traced machine (fused indexer); the others on a second machine.
    a2::Machine m(&pool);
    m.set_tracing(!trace_file.empty());
    const auto csa = st.run(m, host, td::LayerKind::csa, a2::ScoreDesign::fused);
    a2::Machine m2(&pool);
    const auto csa_two = st.run(m2, host, td::LayerKind::csa, a2::ScoreDesign::two_scope);
    const auto hca = st.run(m2, host, td::LayerKind::hca, a2::ScoreDesign::fused);
    const auto swa = st.run(m2, host, td::LayerKind::swa, a2::ScoreDesign::fused);

    const std::initializer_list<std::string_view> indexer_kernels = {
        "idx_compressor", "indexer_query", "indexer_score", "indexer_topk"};
    const a2::KernelReport fused = group(csa, "indexer (fused score)", indexer_kernels);
    const a2::KernelReport two = group(csa_two, "indexer (two-scope score)", indexer_kernels);
    const a2::KernelReport sparse =
        group(csa, "sparse_attn_csa + o_proj", {"sparse_attn", "o_proj"});

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
        << ",\"csa_layer_us\":" << fmt(total_us(csa), 3)
        << ",\"hca_layer_us\":" << fmt(total_us(hca), 3)
        << ",\"swa_layer_us\":" << fmt(total_us(swa), 3)
        << ",\"launch_overhead_us\":" << fmt(a2::kArch.launch_overhead_us, 3)
        << ",\"timing_only_kernels\":[]";
      auto layer_json = [&](const char* key, const std::vector<a2::KernelReport>& l) {
        o << ",\"" << key << "\":[";
        for (std::size_t i = 0; i < l.size(); ++i)
          o << (i ? "," : "") << "{\"kernel\":\"" << l[i].name
            << "\",\"latency_us\":" << fmt(l[i].latency_us(), 3) << "}";
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
    std::printf("\nlayers (one decode::layer_step each, kernels of spec §9.2 in sequence):\n");
    const std::pair<const char*, const std::vector<a2::KernelReport>*> layers[] = {
        {"csa", &csa}, {"hca", &hca}, {"swa", &swa}};
    for (const auto& [name, l] : layers) {
      std::printf("  %s layer %9s us :", name, fmt(total_us(*l)).c_str());
      for (const auto& k : *l) std::printf(" %s=%s", k.name.c_str(), fmt(k.latency_us()).c_str());
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
