// Sparse attention (SWA 128 cols, HCA 256, CSA 640, pro CSA 1152) and the grouped W8A8 output
// projection, with the machine ceilings measured in the same process (bench/ceilings.hpp).
// The machine is shared (2 vCPUs, other jobs), so wall-clock rates swing with the load. Every
// compute ceiling is therefore also measured in CPU time (register-only loops timed with
// CLOCK_PROCESS_CPUTIME_ID), and compute efficiencies are CPU-time ratios: FLOP per CPU-second of
// the kernel ÷ FLOP per CPU-second of the FMA loop. That ratio is what "share of the FMA
// ceiling" means per busy core, and it does not move with the load. The CPU-time ceiling loops
// are this file's fma_peak_loop / int8_peak_loop, not ceilings.hpp's fma_loop / int8_sign_loop,
// which the compiler collapses (see the comment above fma_peak_loop); the collapsed figures are
// still reported as *_merged_loop counters. The wall-clock counters (fp32_fma_gflops, int8_gops,
// pct_of_ceiling_wall) still come from ceilings.hpp and carry the same over-count.
//   sparse attention: FLOP = Σ_t valid_cols(t) · H · 512 · 4 (QKᵀ and PV, 2 FLOP per FMA lane);
//     pct_of_ceiling      = (FLOP / kernel CPU-s) ÷ cpu_fma_gflops          (per busy core)
//     pct_of_ceiling_wall = (FLOP / wall-s) ÷ (tdbench::fp32_fma_gflops() · threads)
//   output projection: weights read once per call (wo_a BF16 + wo_b INT8);
//     pct_of_compute = (wo_a FLOP / cpu_fma + wo_b OP / cpu_int8) ÷ kernel CPU-s
//     pct_of_read_bw = one thread: (bytes / kernel CPU-s) ÷ cpu_read_gbps (same loop as
//                      read_gbps(1), timed in CPU time); more threads: (bytes / wall-s) ÷
//                      tdbench::read_gbps(threads)
//     pct_of_ceiling = the one of the two whose roofline time is larger (the binding bound).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/kernels/output_projection.hpp"
#include "tiledecode/kernels/sparse_attention.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::LayerKind;

namespace {

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

template <class F>
double median_cpu_seconds(F&& f, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = process_cpu_seconds();
    f();
    t.push_back(process_cpu_seconds() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Register-only ceiling loops, per CPU-second of one thread.
// tdbench::fma_loop and tdbench::int8_sign_loop (bench/ceilings.hpp) are NOT used as the
// ceilings: GCC 12 -O3 proves their accumulators (resp. their inputs) identical and merges them.
// fma_loop compiles to ONE vfmadd132ps per iteration (a single 4-cycle latency chain) while
// counting 10, so it reports 10·16 FLOP per 4 cycles = 40 FLOP/cycle, 1.25× the hardware peak of
// 2 FMA × 8 lanes × 2 = 32 FLOP/cycle; int8_sign_loop keeps 2 vpmaddubsw per iteration while
// counting 8. The loops below give each chain its own opaque start value (resp. re-opaque the
// inputs every iteration), so every counted instruction is executed (checked with objdump -d).
// Both old figures are still reported (`*_merged_loop` counters) for comparison.
// Marks a register value as modified without emitting an instruction.
#define SA_OPAQUE(v) __asm__ volatile("" : "+x"(v))

TILEDECODE_TARGET_AVX2 [[gnu::noinline]] float fma_peak_loop(std::int64_t iters) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) {
    a[i] = _mm256_set1_ps(0.1f + 0.01f * float(i));
    SA_OPAQUE(a[i]);
  }
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  return _mm256_cvtss_f32(s);
}

// Exact s8 × s8 sign-trick mix of the wo_b tile (2 weight vectors × 4 token vectors): per 32
// pairs vpsignb + vpmaddubsw + vpmaddwd + vpaddd, plus one |w| per weight vector per 4 tokens.
TILEDECODE_TARGET_AVX2 [[gnu::noinline]] int int8_peak_loop(std::int64_t iters) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(-5);
  __m256i x0 = _mm256_set1_epi8(7), x1 = _mm256_set1_epi8(-9), x2 = _mm256_set1_epi8(11),
          x3 = _mm256_set1_epi8(13);
  __m256i c[8];
  for (auto& v : c) v = _mm256_setzero_si256();
  for (std::int64_t it = 0; it < iters; ++it) {
    SA_OPAQUE(w0);
    SA_OPAQUE(w1);
    SA_OPAQUE(x0);
    SA_OPAQUE(x1);
    SA_OPAQUE(x2);
    SA_OPAQUE(x3);
    const __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
    const __m256i xs[4] = {x0, x1, x2, x3};
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      c[2 * t] = _mm256_add_epi32(
          c[2 * t],
          _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xs[t], w0)), ones));
      c[2 * t + 1] = _mm256_add_epi32(
          c[2 * t + 1],
          _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xs[t], w1)), ones));
    }
  }
  __m256i s = c[0];
  for (int k = 1; k < 8; ++k) s = _mm256_add_epi32(s, c[k]);
  return _mm256_extract_epi32(s, 0);
}
#undef SA_OPAQUE

double cpu_fma_gflops() {
  static const double v = [] {
    if (!td::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 20'000'000;
    volatile float sink = 0;
    const double s = median_cpu_seconds([&] { sink = sink + fma_peak_loop(iters); });
    return double(iters) * 12 * 8 * 2 / s * 1e-9;
  }();
  return v;
}
double cpu_int8_gops() {
  static const double v = [] {
    if (!td::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 10'000'000;
    volatile int sink = 0;
    const double s = median_cpu_seconds([&] { sink = sink + int8_peak_loop(iters); });
    return double(iters) * 8 * 32 * 2 / s * 1e-9;
  }();
  return v;
}
// The ceilings.hpp loops in CPU time (see above: they over-count executed instructions).
double cpu_fma_gflops_merged_loop() {
  static const double v = [] {
    if (!td::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 20'000'000;
    volatile float sink = 0;
    const double s = median_cpu_seconds([&] { sink = sink + tdbench::fma_loop(iters); });
    return double(iters) * 10 * 8 * 2 / s * 1e-9;
  }();
  return v;
}
double cpu_int8_gops_merged_loop() {
  static const double v = [] {
    if (!td::cpu::cpu_has_avx2()) return 0.0;
    const std::int64_t iters = 10'000'000;
    volatile int sink = 0;
    const double s = median_cpu_seconds([&] { sink = sink + tdbench::int8_sign_loop(iters); });
    return double(iters) * 8 * 32 * 2 / s * 1e-9;
  }();
  return v;
}

// Single-thread streaming read bandwidth per CPU-second (GB/s), same loop shape as
// tdbench::read_gbps over a 256 MiB buffer: the memory ceiling in the same units as the kernel's
// CPU time (a wall-clock bandwidth swings with the other jobs on this shared machine).
double cpu_read_gbps() {
  static const double v = [] {
    const std::size_t n = (std::size_t(256) << 20) / sizeof(std::uint64_t);
    std::vector<std::uint64_t> buf(n, 1);
    volatile std::uint64_t sink = 0;
    const double s = median_cpu_seconds([&] {
      std::uint64_t a = 0, b = 0, c = 0, d = 0;
      for (std::size_t i = 0; i + 4 <= n; i += 4) {
        a += buf[i];
        b += buf[i + 1];
        c += buf[i + 2];
        d += buf[i + 3];
      }
      sink = sink + a + b + c + d;
    });
    return double(n * sizeof(std::uint64_t)) / s * 1e-9;
  }();
  return v;
}

struct AttnProblem {
  td::ModelConfig cfg;
  LayerKind kind;
  int B, S = 2;
  index_t T;
  td::Tensor<bf16, 2> kv, cmp, o;
  td::Tensor<bf16, 3> q;
  td::Tensor<std::int32_t, 1> pos, lens, win_lens;
  td::Tensor<std::int32_t, 2> ori_table, cmp_table, win_idx, topk;
  td::Tensor<float, 1> sink;
  td::RopeTable rope;
  double flops = 0, bytes = 0;

  AttnProblem(const td::ModelConfig& c, LayerKind k, int batch)
      : cfg(c), kind(k), B(batch), T(index_t(batch) * 2) {
    tdtest::Rng rng(7);
    const index_t ori_blocks = 128, cmp_blocks = 32;
    const std::vector<std::int32_t> starts(B, k == LayerKind::hca ? 16382 : 8192);
    const td::paged::StepShape sh{B, S, -1};
    kv = td::Tensor<bf16, 2>({ori_blocks * cfg.page, cfg.head_dim});
    cmp = td::Tensor<bf16, 2>({cmp_blocks * cfg.page, cfg.head_dim});
    rng.fill_uniform(std::span<bf16>(kv.data(), kv.size()), -0.5f, 0.5f);
    rng.fill_uniform(std::span<bf16>(cmp.data(), cmp.size()), -0.5f, 0.5f);
    q = td::Tensor<bf16, 3>({T, cfg.n_heads, cfg.head_dim});
    rng.fill_uniform(std::span<bf16>(q.data(), q.size()), -0.5f, 0.5f);
    o = td::Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
    pos = td::Tensor<std::int32_t, 1>({T});
    lens = td::Tensor<std::int32_t, 1>({B});
    win_lens = td::Tensor<std::int32_t, 1>({T});
    td::paged::build_position_ids(pos.view(), starts, sh, cfg);
    td::paged::build_kv_seq_lens(lens.view(), starts, sh, cfg);
    ori_table = td::Tensor<std::int32_t, 2>({B, cfg.ori_table_cols()});
    cmp_table = td::Tensor<std::int32_t, 2>({B, 32});
    td::paged::build_fixture_block_table(ori_table.view(), ori_blocks);
    td::paged::build_fixture_block_table(cmp_table.view(), cmp_blocks);
    win_idx = td::Tensor<std::int32_t, 2>({T, cfg.window});
    td::paged::build_window_indices(win_idx.view(), win_lens.view(), pos.view(), ori_table.view(),
                                    ori_blocks, sh, cfg);
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
                    int threads) {
  auto& slot = attn_cache()[std::string(cfg.name) + std::string(td::to_string(kind)) +
                            std::to_string(batch)];
  if (!slot) slot = std::make_unique<AttnProblem>(cfg, kind, batch);
  AttnProblem& p = *slot;
  std::unique_ptr<td::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
  const td::cpu::Context ctx{pool.get(), td::cpu::detect_isa()};
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
  state.counters["pct_of_merged_loop"] =
      100.0 * (p.flops * n / cpu * 1e-9) / cpu_fma_gflops_merged_loop();
}

struct OprojProblem {
  td::ModelConfig cfg;
  index_t T;
  td::Tensor<bf16, 3> wo_a;
  td::Tensor<std::int8_t, 2> wo_b;
  td::Tensor<float, 1> scale;
  td::Tensor<bf16, 2> o, out;
  OprojProblem(const td::ModelConfig& c, index_t t) : cfg(c), T(t) {
    tdtest::Rng rng(3);
    wo_a = td::Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, cfg.o_group_in()});
    for (std::size_t i = 0; i < wo_a.size(); ++i)
      wo_a.data()[i] = bf16(float(int(i % 61) - 30) * 1e-3f);
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

void bm_oproj(benchmark::State& state, td::ModelConfig cfg, int batch, int threads) {
  static std::map<std::string, std::unique_ptr<OprojProblem>> cache;
  auto& slot = cache[std::string(cfg.name) + std::to_string(batch)];
  if (!slot) slot = std::make_unique<OprojProblem>(cfg, index_t(batch) * 2);
  OprojProblem& p = *slot;
  std::unique_ptr<td::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
  const td::cpu::Context ctx{pool.get(), td::cpu::detect_isa()};
  std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(cfg, p.T));
  double secs = 0, cpu = 0;
  for (auto _ : state) {
    const double c0 = process_cpu_seconds();
    const auto t0 = tdbench::clock_type::now();
    td::kernels::output_projection(ctx, cfg, p.out.view(), p.o.view(), p.wo_a.view(), p.wo_b.view(),
                                   p.scale.view(), ws);
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
  const double c_cmp = flops_a / (cpu_fma_gflops() * 1e9) + ops_b / (cpu_int8_gops() * 1e9);
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
  state.counters["pct_of_read_bw"] = pct_mem;
  state.counters["pct_of_compute"] = pct_cmp;
  state.counters["pct_of_compute_merged_loops"] = 100.0 *
                                                  (flops_a / (cpu_fma_gflops_merged_loop() * 1e9) +
                                                   ops_b / (cpu_int8_gops_merged_loop() * 1e9)) /
                                                  c;
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
  state.counters["cpu_fma_gflops"] = cpu_fma_gflops();
  state.counters["cpu_int8_gops"] = cpu_int8_gops();
  state.counters["cpu_read_gbps"] = cpu_read_gbps();
  state.counters["cpu_fma_gflops_merged_loop"] = cpu_fma_gflops_merged_loop();
  state.counters["cpu_int8_gops_merged_loop"] = cpu_int8_gops_merged_loop();
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
        benchmark::RegisterBenchmark(name.c_str(), bm_sparse_attn, c.cfg, c.kind, batch, threads)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (int batch : {4, 64})
    for (int threads : {1, 2}) {
      const std::string name =
          "oproj_flash/B:" + std::to_string(batch) + "/S:2/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), bm_oproj, td::flash_config(), batch, threads)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  benchmark::RegisterBenchmark("oproj_pro/B:4/S:2/threads:1", bm_oproj, td::pro_config(), 4, 1)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
