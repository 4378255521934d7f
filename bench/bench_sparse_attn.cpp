// Sparse attention (SWA 128 cols, HCA 256, CSA 640, pro CSA 1152) and the grouped W8A8 output
// projection, with the machine ceilings measured in the same process (bench/ceilings.hpp).
// The machine is shared (2 vCPUs, other jobs), so wall-clock rates swing with the load. Every
// compute ceiling is therefore also taken in CPU time (tdbench::*_cpu(): the register-only loops
// timed with the calling thread's CPU clock), and compute efficiencies are CPU-time ratios: FLOP
// per CPU-second of the kernel (process CPU time, all its threads) ÷ FLOP per CPU-second of the
// FMA loop. That ratio is the share of the FMA ceiling per busy core, and it does not move with
// the load. The output projection's INT8 ceiling is the best exact s8 × s8 loop of the machine
// (tdbench::int8_machine_gops<true>(): the AVX2 mixes, 256-bit vpdpbusd where the CPU has
// AVX-VNNI, 512-bit where it has AVX-512), whatever tier ran, and the FMA ceiling the better of
// the 256- and 512-bit loops; oproj_flash_avx2 forces the avx2 tier on a VNNI machine and
// sparse_attn_csa_avx2 on an AVX-512 one (A/B against the 16-lane attention tiles). The
// `ceilings` row's label names the loops that set them.
//   sparse attention: FLOP = Σ_t valid_cols(t) · H · 512 · 4 (QKᵀ and PV, 2 FLOP per FMA lane);
//     pct_of_ceiling      = (FLOP / kernel CPU-s) ÷ cpu_fma_gflops          (per busy core)
//     pct_of_ceiling_wall = (FLOP / wall-s) ÷ (tdbench::fp32_fma_gflops() · threads)
//   output projection: weights read once per call (wo_a BF16 + wo_b INT8);
//     pct_of_compute = (wo_a FLOP / cpu BF16 MAC ceiling + wo_b OP / cpu_int8) ÷ kernel CPU-s
//     pct_of_read_bw = one thread: (bytes / kernel CPU-s) ÷ tdbench::read_gbps_cpu() (the
//                      read_gbps(1) loop in CPU time); more threads: (bytes / wall-s) ÷
//                      tdbench::read_gbps(threads)
//     pct_of_ceiling = the one of the two whose roofline time is larger (the binding bound).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "common/sparse_attn_fixture.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::LayerKind;

namespace {

using tdbench::process_cpu_seconds;

// Per-CPU-second ceilings (bench/ceilings.hpp), under the counter names this file reports.
double cpu_fma_gflops() {
  return tdbench::fp32_fma_gflops_cpu();
}
double cpu_int8_gops() {
  return tdbench::int8_machine_gops<true>();
}
double cpu_read_gbps() {
  return tdbench::read_gbps_cpu();
}

constexpr index_t kOriBlocks = 128, kCmpBlocks = 32;

struct AttnProblem : tdtest::SparseAttnMetadata {
  td::ModelConfig cfg;
  LayerKind kind;
  td::Tensor<bf16, 2> kv, cmp, o;
  td::Tensor<bf16, 3> q;
  td::Tensor<std::int32_t, 2> topk;
  td::Tensor<float, 1> sink;
  td::RopeTable rope;
  double flops = 0, bytes = 0;

  // Every request starts at 8192 (16382 for HCA), 2 tokens each.
  AttnProblem(const td::ModelConfig& c, LayerKind k, int batch)
      : SparseAttnMetadata(
            c, std::vector<std::int32_t>(std::size_t(batch), k == LayerKind::hca ? 16382 : 8192), 2,
            kOriBlocks, kCmpBlocks),
        cfg(c),
        kind(k) {
    tdtest::Rng rng(7);
    kv = td::Tensor<bf16, 2>({kOriBlocks * cfg.page, cfg.head_dim});
    cmp = td::Tensor<bf16, 2>({kCmpBlocks * cfg.page, cfg.head_dim});
    rng.fill_uniform(std::span<bf16>(kv.data(), kv.size()), -0.5f, 0.5f);
    rng.fill_uniform(std::span<bf16>(cmp.data(), cmp.size()), -0.5f, 0.5f);
    q = td::Tensor<bf16, 3>({T, cfg.n_heads, cfg.head_dim});
    rng.fill_uniform(std::span<bf16>(q.data(), q.size()), -0.5f, 0.5f);
    o = td::Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
    topk = td::Tensor<std::int32_t, 2>({T, cfg.idx_topk});
    for (index_t t = 0; t < T; ++t)
      for (int i = 0; i < cfg.idx_topk; ++i)
        topk.view()(t, i) = (i * 3 + int(t)) % 2048;  // distinct, visible
    sink = td::Tensor<float, 1>({cfg.n_heads});
    rope = td::make_rope_table(cfg, kind, cfg.max_seq_len);
    // Valid columns per token (all compressed ids visible at these starts).
    for (index_t t = 0; t < T; ++t) {
      const int p = pos.view()(t);
      double cols = win_lens.view()(t);
      if (kind == LayerKind::csa) cols += cfg.idx_topk;
      if (kind == LayerKind::hca) cols += std::min({128, (p + 1) / 128, lens.view()(t / S) / 128});
      flops += cols * cfg.n_heads * cfg.head_dim * 4.0;
      bytes += cols * cfg.head_dim * 2.0;
    }
    bytes += double(q.size() + o.size()) * 2.0;
  }
};

std::map<std::string, std::unique_ptr<AttnProblem>>& attn_cache() {
  static std::map<std::string, std::unique_ptr<AttnProblem>> m;
  return m;
}

void bm_sparse_attn(benchmark::State& state, td::ModelConfig cfg, LayerKind kind, int batch,
                    int threads, td::cpu::Isa isa) {
  auto& slot = attn_cache()[std::string(cfg.name) + std::string(td::to_string(kind)) +
                            std::to_string(batch)];
  if (!slot) slot = std::make_unique<AttnProblem>(cfg, kind, batch);
  AttnProblem& p = *slot;
  std::unique_ptr<td::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
  const td::cpu::Context ctx{pool.get(), isa};
  std::vector<std::byte> ws(td::kernels::sparse_attention_workspace_bytes(cfg, threads));
  double secs = 0, cpu = 0;
  for (auto _ : state) {
    const double c0 = process_cpu_seconds();
    const auto t0 = tdbench::clock_type::now();
    td::kernels::sparse_attention(ctx, cfg, kind, p.o.view(), p.q.view(), p.kv.view(), p.cmp.view(),
                                  p.win_idx.view(), p.win_lens.view(), p.topk.view(),
                                  p.cmp_table.view(), p.pos.view(), p.lens.view(), p.S,
                                  p.sink.view(), p.rope.view(), ws);
    secs += std::chrono::duration<double>(tdbench::clock_type::now() - t0).count();
    cpu += process_cpu_seconds() - c0;
    benchmark::DoNotOptimize(p.o.data());
  }
  const double n = double(state.iterations());
  const double wall_ceiling = tdbench::fp32_fma_gflops() * threads;
  state.counters["FLOP/s"] = benchmark::Counter(p.flops * n, benchmark::Counter::kIsRate);
  state.counters["bytes/s"] = benchmark::Counter(p.bytes * n, benchmark::Counter::kIsRate);
  state.counters["cpu_fma_gflops"] = cpu_fma_gflops();
  state.counters["gflop_per_cpu_s"] = p.flops * n / cpu * 1e-9;
  state.counters["pct_of_ceiling"] = 100.0 * (p.flops * n / cpu * 1e-9) / cpu_fma_gflops();
  state.counters["pct_of_ceiling_wall"] = 100.0 * (p.flops * n / secs * 1e-9) / wall_ceiling;
}

struct OprojProblem {
  td::ModelConfig cfg;
  index_t T;
  td::Tensor<bf16, 3> wo_a;
  td::Tensor<std::int8_t, 2> wo_b;
  td::Tensor<float, 1> scale;
  td::Tensor<float, 2> norm;  // wo_a's row norms: the rounding check, as the decode step runs it
  td::Tensor<bf16, 2> o, out;
  OprojProblem(const td::ModelConfig& c, index_t t) : cfg(c), T(t) {
    tdtest::Rng rng(3);
    wo_a = td::Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, cfg.o_group_in()});
    // Normal, std 0.02 (decode/synthetic.hpp's wo_a): rows with distinct norms and no ties, as
    // the rounding check (wo_a_norm) sees them in a model.
    rng.fill_normal(wo_a.flat(), 0.02f);
    norm = td::kernels::output_projection_row_norms(wo_a.view());
    wo_b = td::Tensor<std::int8_t, 2>({cfg.hidden, index_t(cfg.o_groups) * cfg.o_lora});
    for (std::size_t i = 0; i < wo_b.size(); ++i)
      wo_b.data()[i] = std::int8_t(int(i * 7 % 255) - 127);
    scale = td::Tensor<float, 1>({cfg.hidden});
    for (index_t n = 0; n < cfg.hidden; ++n) scale.view()(n) = 1e-3f;
    o = td::Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
    rng.fill_uniform(std::span<bf16>(o.data(), o.size()), -0.1f, 0.1f);
    out = td::Tensor<bf16, 2>({T, cfg.hidden});
  }
};

void bm_oproj(benchmark::State& state, td::ModelConfig cfg, int batch, int seq, int threads,
              td::cpu::Isa isa, td::cpu::Bf16Dot bf16_dot, bool checked) {
  if (!td::cpu::cpu_supports(isa)) {
    state.SkipWithError("ISA not supported by this CPU");
    return;
  }
  static std::map<std::string, std::unique_ptr<OprojProblem>> cache;
  auto& slot = cache[std::string(cfg.name) + std::to_string(batch * seq)];
  if (!slot) slot = std::make_unique<OprojProblem>(cfg, index_t(batch) * seq);
  OprojProblem& p = *slot;
  std::unique_ptr<td::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
  const td::cpu::Context ctx{pool.get(), isa, bf16_dot};
  std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(cfg, p.T));
  double secs = 0, cpu = 0;
  for (auto _ : state) {
    const double c0 = process_cpu_seconds();
    const auto t0 = tdbench::clock_type::now();
    td::kernels::output_projection(ctx, cfg, p.out.view(), p.o.view(), p.wo_a.view(), p.wo_b.view(),
                                   p.scale.view(), ws,
                                   checked ? p.norm.view() : td::ConstView<float, 2>{});
    secs += std::chrono::duration<double>(tdbench::clock_type::now() - t0).count();
    cpu += process_cpu_seconds() - c0;
    benchmark::DoNotOptimize(p.out.data());
  }
  const double n = double(state.iterations());
  const double G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(), N = cfg.hidden,
               T = double(p.T);
  const double flops_a = T * G * R * K * 2, ops_b = T * N * G * R * 2;
  const double bytes = G * R * K * 2 + N * G * R + T * G * K * 2 + T * N * 2;
  // Roofline times: memory (wall, `threads` readers) and compute (CPU-s of one core).
  const double t_mem = bytes / (tdbench::read_gbps(threads) * 1e9);
  // wo_a multiplies BF16 o_packed by BF16 weights: the machine's BF16 multiply-add ceiling.
  const double c_cmp =
      flops_a / (tdbench::bf16_mac_gflops<true>() * 1e9) + ops_b / (cpu_int8_gops() * 1e9);
  const double t = secs / n, c = cpu / n;
  // One thread: bandwidth per CPU-second against the CPU-time read ceiling (robust to the load);
  // several threads: wall-clock bandwidth against read_gbps(threads).
  const double pct_mem =
      threads == 1 ? 100.0 * (bytes / c * 1e-9) / cpu_read_gbps() : 100.0 * t_mem / t;
  const double pct_cmp = 100.0 * c_cmp / c;
  state.counters["FLOP/s"] = benchmark::Counter((flops_a + ops_b) * n, benchmark::Counter::kIsRate);
  state.counters["bytes/s"] = benchmark::Counter(bytes * n, benchmark::Counter::kIsRate);
  state.counters["read_ceiling_gbps"] = tdbench::read_gbps(threads);
  state.counters["cpu_read_gbps"] = cpu_read_gbps();
  state.counters["gbytes_per_cpu_s"] = bytes / c * 1e-9;
  state.counters["cpu_int8_gops"] = cpu_int8_gops();
  state.counters["isa"] = double(static_cast<int>(isa));
  state.counters["pct_of_read_bw"] = pct_mem;
  state.counters["pct_of_compute"] = pct_cmp;
  // Binding bound: one thread compares CPU-time rooflines, several compare wall-clock ones.
  const bool mem_bound =
      threads == 1 ? bytes / (cpu_read_gbps() * 1e9) > c_cmp : t_mem > c_cmp / threads;
  state.counters["memory_bound"] = mem_bound ? 1 : 0;
  state.counters["pct_of_ceiling"] = mem_bound ? pct_mem : pct_cmp;
}

void bm_ceilings(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(tdbench::fp32_fma_gflops());
  state.counters["fp32_fma_gflops"] = tdbench::fp32_fma_gflops();
  state.counters["int8_gops"] = tdbench::int8_gops();
  state.counters["read_gbps_1"] = tdbench::read_gbps(1);
  state.counters["read_gbps_2"] = tdbench::read_gbps(2);
  state.counters["fp32_fma_gflops_2t"] = tdbench::fp32_fma_gflops_threads(2);
  state.counters["cpu_fma_gflops"] = cpu_fma_gflops();
  state.counters["cpu_int8_gops"] = cpu_int8_gops();
  state.counters["cpu_read_gbps"] = cpu_read_gbps();
  state.counters["cpu_int8_sign_gops"] = tdbench::int8_mix_gops<tdbench::Int8Mix::sign, true>();
  state.counters["cpu_int8_vnni_gops"] = tdbench::int8_vnni_gops<true>();
  state.counters["cpu_int8_vnni512_gops"] = tdbench::int8_vnni512_gops<true>();
  state.counters["cpu_fma512_gflops"] = tdbench::fp32_fma512_gflops<true>();
  state.counters["cpu_bf16_dot_gflops"] = tdbench::bf16_dot_gflops<true>();
  state.SetLabel(std::string("fp32 ceiling ") + tdbench::fp32_fma_kind() + ", bf16 ceiling " +
                 tdbench::bf16_mac_kind() + ", int8 ceiling " + tdbench::int8_machine_kind());
}

const int kRegistered = [] {
  benchmark::RegisterBenchmark("ceilings", bm_ceilings)->Iterations(1);
  struct Case {
    const char* name;
    td::ModelConfig cfg;
    LayerKind kind;
  };
  const Case cases[] = {{"sparse_attn_swa", td::flash_config(), LayerKind::swa},
                        {"sparse_attn_hca", td::flash_config(), LayerKind::hca},
                        {"sparse_attn_csa", td::flash_config(), LayerKind::csa},
                        {"sparse_attn_pro_csa", td::pro_config(), LayerKind::csa}};
  for (const auto& c : cases)
    for (int batch : {4, 16, 64})
      for (int threads : {1, 2}) {
        if (c.cfg.name == "pro" && batch > 16) continue;
        const std::string name = std::string(c.name) + "/B:" + std::to_string(batch) +
                                 "/S:2/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), bm_sparse_attn, c.cfg, c.kind, batch, threads,
                                     td::cpu::detect_isa())
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  // The avx512 tier's 16-lane attention tiles against the AVX2 ones (same bits), in one process.
  if (td::cpu::detect_isa() == td::cpu::Isa::avx512)
    for (int batch : {4, 64}) {
      const std::string name = "sparse_attn_csa_avx2/B:" + std::to_string(batch) + "/S:2/threads:1";
      benchmark::RegisterBenchmark(name.c_str(), bm_sparse_attn, td::flash_config(), LayerKind::csa,
                                   batch, 1, td::cpu::Isa::avx2)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  // B = 64 at S = 2 and S = 8: T = 128 and the serving tree's T = 512.
  for (auto [batch, seq] : {std::pair{4, 2}, std::pair{64, 2}, std::pair{64, 8}})
    for (int threads : {1, 2}) {
      const std::string name = "oproj_flash/B:" + std::to_string(batch) +
                               "/S:" + std::to_string(seq) + "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), bm_oproj, td::flash_config(), batch, seq, threads,
                                   td::cpu::detect_isa(), td::cpu::Bf16Dot::automatic, true)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      // The same without wo_a_norm (no rounding check): the check's cost, interleaved.
      if (seq == 8) continue;
      const std::string unchecked = "oproj_flash_unchecked/B:" + std::to_string(batch) +
                                    "/S:" + std::to_string(seq) +
                                    "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(unchecked.c_str(), bm_oproj, td::flash_config(), batch, seq,
                                   threads, td::cpu::detect_isa(), td::cpu::Bf16Dot::automatic,
                                   false)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  // Bf16Dot::exact: wo_a summed in double (golden's bits; issue 17), at decode batch sizes.
  for (int threads : {1, 2}) {
    const std::string name = "oproj_flash_exact/B:4/S:2/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark(name.c_str(), bm_oproj, td::flash_config(), 4, 2, threads,
                                 td::cpu::detect_isa(), td::cpu::Bf16Dot::exact, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("oproj_pro/B:4/S:2/threads:1", bm_oproj, td::pro_config(), 4, 2, 1,
                               td::cpu::detect_isa(), td::cpu::Bf16Dot::automatic, true)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  if (td::cpu::has_vnni(td::cpu::detect_isa())) {
    benchmark::RegisterBenchmark("oproj_flash_avx2/B:4/S:2/threads:1", bm_oproj, td::flash_config(),
                                 4, 2, 1, td::cpu::Isa::avx2, td::cpu::Bf16Dot::automatic, true)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
