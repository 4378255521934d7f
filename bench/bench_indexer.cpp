// Lightning indexer (spec §7) benchmarks: query path, head weights, fused score, top-k and the
// whole indexer, at B = 4, S = 2 over context 1k…16k and batch 1…64 at 8k; one top-k row at
// CSA's 1M-context widths (BM_topk_row*, 4096 … 262,144 candidates).
// Counters: OP/s (2 OP per int8 multiply-add), bytes/s (bytes the kernel must touch), and for
// the score and the query the share of this machine's INT8 ceilings measured in the same process:
//   pct_of_ceiling       score: vs a register-only loop of the score kernel's own instruction mix
//                        (avx2: vpmaddwd + vpaddd; avx2_vnni: 256-bit vpdpbusd; avx512: 512-bit
//                        vpdpbusd);
//                        query: vs tdbench::int8_machine_gops()
//   pct_of_int8_peak     vs tdbench::int8_machine_gops(): the best INT8 loop of this machine,
//                        whatever tier ran (AVX2 mixes, 256-bit and 512-bit vpdpbusd)
//   isa                  0 scalar, 1 avx2, 2 avx2_vnni, 3 avx512 (BM_indexer_score_avx2 and
//                        BM_indexer_query_avx2 force avx2 for the tier comparison)
// Run: bench_indexer --benchmark_min_time=0.05 [--benchmark_format=json]

#include <benchmark/benchmark.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/tile/topk.hpp"

namespace td = tiledecode;
namespace kn = tiledecode::kernels;
using td::index_t;

namespace {

// Single-thread GOP/s of the score kernel's instruction mix, register-only (bench/ceilings.hpp):
// pre-widened int16 vpmaddwd on avx2, 256-bit vpdpbusd on avx2_vnni, 512-bit on avx512.
double score_mix_gops(td::cpu::Isa isa) {
  if (isa == td::cpu::Isa::avx512) return tdbench::int8_vnni512_gops();
  return isa == td::cpu::Isa::avx2_vnni ? tdbench::int8_vnni_gops()
                                        : tdbench::int8_mix_gops<tdbench::Int8Mix::madd16>();
}

constexpr int kSeq = 2;

// Inputs of one decode step at batch B, context `ctx_len` (start = ctx_len - S, kv_len = ctx_len).
struct Step {
  td::ModelConfig cfg = td::flash_config();
  int B = 4;
  index_t T = 8;
  td::Tensor<std::int32_t, 1> positions, kv_lens, rope_pos;
  td::Tensor<std::int32_t, 2> table;
  td::Tensor<std::int8_t, 2> cache, qr;
  td::Tensor<float, 1> kscale, qr_scale;
  td::Tensor<std::int8_t, 3> q;
  td::Tensor<float, 2> q_sc, w, score;
  td::Tensor<td::bf16, 2> x_n, weights_proj;
  td::Tensor<std::int32_t, 2> topk;
  std::int64_t score_macs = 0, visible_rows = 0;
};

struct Shared {
  td::ModelConfig cfg = td::flash_config();
  td::RopeTable rope = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  kn::IndexerQueryWeights wq;
  Shared() {
    tdtest::Rng rng(99);
    const index_t N = index_t(cfg.idx_n_heads) * 128;
    td::Tensor<std::int8_t, 2> w({cfg.q_lora, N});
    rng.fill_int8(w.flat());
    td::Tensor<float, 1> s({N});
    rng.fill_uniform(s.flat(), 0.0005f, 0.002f);
    const auto had = td::make_hadamard_bf16(128);
    wq = kn::pack_indexer_query_weights(cfg, w.view(), s.view(), had.view());
  }
};

Shared& shared() {
  static Shared s;
  return s;
}

Step& step(int B, int ctx_len) {
  static std::map<std::pair<int, int>, std::unique_ptr<Step>> cache;
  auto& slot = cache[{B, ctx_len}];
  if (slot) return *slot;
  (void)shared();  // build the packed weights and RoPE table outside any timed loop
  slot = std::make_unique<Step>();
  Step& s = *slot;
  s.B = B;
  s.T = index_t(B) * kSeq;
  const td::paged::StepShape sh{B, kSeq, -1};
  std::vector<std::int32_t> starts(std::size_t(B), ctx_len - kSeq);
  s.positions = td::Tensor<std::int32_t, 1>({s.T});
  s.kv_lens = td::Tensor<std::int32_t, 1>({B});
  s.rope_pos = td::Tensor<std::int32_t, 1>({s.T});
  td::paged::build_position_ids(s.positions.view(), starts, sh, s.cfg);
  td::paged::build_kv_seq_lens(s.kv_lens.view(), starts, sh, s.cfg);
  kn::indexer_rope_positions(s.rope_pos.view(), s.positions.view(), kSeq);
  // Disjoint pages per request (no fixture aliasing): the pool holds every visible row.
  const int pages = (std::min(ctx_len / 4, s.cfg.score_len()) + 127) / 128;
  const index_t blocks = std::max<index_t>(1, index_t(B) * pages);
  s.table = td::Tensor<std::int32_t, 2>({B, 64});
  td::paged::build_fixture_block_table(s.table.view(), blocks);
  tdtest::Rng rng(std::uint64_t(B) * 100003 + std::uint64_t(ctx_len));
  s.cache = td::Tensor<std::int8_t, 2>({blocks * 128, 128});
  rng.fill_int8(s.cache.flat());
  s.kscale = td::Tensor<float, 1>({blocks * 128});
  rng.fill_uniform(s.kscale.flat(), 0.002f, 0.02f);
  s.q = td::Tensor<std::int8_t, 3>({s.T, 64, 128});
  rng.fill_int8(s.q.flat());
  s.q_sc = td::Tensor<float, 2>({s.T, 64});
  rng.fill_uniform(s.q_sc.flat(), 0.002f, 0.02f);
  s.w = td::Tensor<float, 2>({s.T, 64});
  rng.fill_normal(s.w.flat(), 0.3f);
  s.score = td::Tensor<float, 2>({s.T, s.cfg.score_len()});
  s.topk = td::Tensor<std::int32_t, 2>({s.T, s.cfg.idx_topk});
  s.qr = td::Tensor<std::int8_t, 2>({s.T, s.cfg.q_lora});
  rng.fill_int8(s.qr.flat());
  s.qr_scale = td::Tensor<float, 1>({s.T});
  rng.fill_uniform(s.qr_scale.flat(), 0.005f, 0.02f);
  s.x_n = td::Tensor<td::bf16, 2>({s.T, s.cfg.hidden});
  rng.fill_normal(s.x_n.flat(), 1.0f);
  s.weights_proj = td::Tensor<td::bf16, 2>({s.cfg.hidden, 64});
  rng.fill_normal(s.weights_proj.flat(), 0.2313f);
  for (index_t t = 0; t < s.T; ++t) {
    const int vis =
        kn::indexer_visible_rows(s.cfg, s.positions.view()(t), s.kv_lens.view()(t / kSeq));
    s.visible_rows += vis;
    s.score_macs += std::int64_t(vis) * 64 * 128;
  }
  return s;
}

td::cpu::Context context(int threads, td::cpu::Isa isa = td::cpu::detect_isa()) {
  static td::ThreadPool pool2(2);
  return td::cpu::Context{threads > 1 ? &pool2 : nullptr, isa};
}

void run_query(const td::cpu::Context& ctx, Step& s) {
  kn::indexer_query(ctx, s.cfg, s.q.view(), s.q_sc.view(), s.qr.view(), s.qr_scale.view(),
                    shared().wq, s.rope_pos.view(), shared().rope.view());
}
void run_weights(const td::cpu::Context& ctx, Step& s) {
  kn::indexer_weights(ctx, s.cfg, s.w.view(), s.x_n.view(), s.weights_proj.view());
}
void run_score(const td::cpu::Context& ctx, Step& s) {
  kn::indexer_score(ctx, s.cfg, s.score.view(), s.q.view(), s.q_sc.view(), s.w.view(),
                    s.cache.view(), s.kscale.view(), s.table.view(), s.positions.view(),
                    s.kv_lens.view(), kSeq);
}
void run_topk(const td::cpu::Context& ctx, Step& s) {
  kn::indexer_topk(ctx, s.cfg, s.topk.view(), s.score.view(), s.positions.view(), s.kv_lens.view(),
                   kSeq, s.cfg.idx_topk, 0);
}

// Runs the benchmark loop and returns the wall seconds it took (the ceilings are wall-timed too;
// Google Benchmark's kIsRate counters divide by CPU time, which hides waiting in the pool).
template <class F>
double timed_loop(benchmark::State& st, F&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::int64_t query_macs(const Step& s) {
  return s.T * std::int64_t(s.cfg.q_lora) * 64 * 128;
}

// args: batch, context, threads
void score_bench(benchmark::State& st, td::cpu::Isa isa) {
  Step& s = step(int(st.range(0)), int(st.range(1)));
  const auto ctx = context(int(st.range(2)), isa);
  const double ceiling = tdbench::int8_machine_gops(), mix = score_mix_gops(isa);
  const double sec = timed_loop(st, [&] {
    run_score(ctx, s);
    benchmark::DoNotOptimize(s.score.data());
  });
  const double per_s = double(st.iterations()) / sec;
  const double gops = 2.0 * double(s.score_macs) * per_s * 1e-9;
  st.counters["OP/s"] = gops * 1e9;
  // Key rows + scales read per token, plus the full score rows written.
  st.counters["bytes/s"] =
      (double(s.visible_rows) * (128 + 4) + double(s.T) * s.cfg.score_len() * 4) * per_s;
  st.counters["ceiling_gops"] = ceiling;
  st.counters["mix_ceiling_gops"] = mix;
  st.counters["pct_of_ceiling"] = mix > 0 ? 100.0 * gops / mix : 0.0;
  st.counters["pct_of_int8_peak"] = ceiling > 0 ? 100.0 * gops / ceiling : 0.0;
  st.counters["isa"] = double(static_cast<int>(isa));
}

void BM_indexer_score(benchmark::State& st) {
  score_bench(st, td::cpu::detect_isa());
}

// args: batch, threads
void query_bench(benchmark::State& st, td::cpu::Isa isa) {
  Step& s = step(int(st.range(0)), 8192);
  const auto ctx = context(int(st.range(1)), isa);
  const double sec = timed_loop(st, [&] {
    run_query(ctx, s);
    benchmark::DoNotOptimize(s.q.data());
  });
  const double per_s = double(st.iterations()) / sec;
  const double gops = 2.0 * double(query_macs(s)) * per_s * 1e-9;
  st.counters["OP/s"] = gops * 1e9;
  st.counters["bytes/s"] =
      (double(s.cfg.q_lora) * 8192 + 8192 * 4 + double(s.T) * (s.cfg.q_lora + 64 * 132)) * per_s;
  st.counters["pct_of_ceiling"] = 100.0 * gops / tdbench::int8_machine_gops();
  st.counters["isa"] = double(static_cast<int>(isa));
}

void BM_indexer_query(benchmark::State& st) {
  query_bench(st, td::cpu::detect_isa());
}

// The avx2 tier on a VNNI machine (AVX-VNNI or AVX-512; skipped elsewhere): a VNNI kernel's gain,
// same process.
void avx2_tier_bench(benchmark::State& st, void (*bench)(benchmark::State&, td::cpu::Isa)) {
  if (!td::cpu::has_vnni(td::cpu::detect_isa())) {
    st.SkipWithError("no VNNI tier: the detected-ISA benchmark already runs the avx2 tier");
    return;
  }
  bench(st, td::cpu::Isa::avx2);
}
void BM_indexer_score_avx2(benchmark::State& st) {
  avx2_tier_bench(st, score_bench);
}
void BM_indexer_query_avx2(benchmark::State& st) {
  avx2_tier_bench(st, query_bench);
}

void BM_indexer_weights(benchmark::State& st) {
  Step& s = step(int(st.range(0)), 8192);
  const auto ctx = context(int(st.range(1)));
  const double sec = timed_loop(st, [&] {
    run_weights(ctx, s);
    benchmark::DoNotOptimize(s.w.data());
  });
  const double per_s = double(st.iterations()) / sec;
  st.counters["FLOP/s"] = 2.0 * double(s.T) * s.cfg.hidden * 64 * per_s;
  st.counters["bytes/s"] = (double(s.cfg.hidden) * 64 * 2 + double(s.T) * s.cfg.hidden * 2) * per_s;
  st.counters["pct_of_fma_ceiling"] =
      100.0 * 2.0 * double(s.T) * s.cfg.hidden * 64 * per_s * 1e-9 / tdbench::fp32_fma_gflops();
}

void BM_indexer_topk(benchmark::State& st) {
  Step& s = step(int(st.range(0)), int(st.range(1)));
  const auto ctx = context(1);
  run_score(ctx, s);
  const double sec = timed_loop(st, [&] {
    run_topk(ctx, s);
    benchmark::DoNotOptimize(s.topk.data());
  });
  const double per_s = double(st.iterations()) / sec;
  st.counters["rows/s"] = double(s.T) * per_s;
  st.counters["bytes/s"] = (double(s.visible_rows) * 4 + double(s.T) * s.cfg.idx_topk * 4) * per_s;
}

// The whole indexer (query, weights, score, top-k); per-stage shares of the time in percent.
void BM_indexer_whole(benchmark::State& st) {
  Step& s = step(int(st.range(0)), int(st.range(1)));
  const auto ctx = context(int(st.range(2)));
  using clk = std::chrono::steady_clock;
  double tq = 0, tw = 0, ts = 0, tk = 0;
  for (auto _ : st) {
    const auto t0 = clk::now();
    run_query(ctx, s);
    const auto t1 = clk::now();
    run_weights(ctx, s);
    const auto t2 = clk::now();
    run_score(ctx, s);
    const auto t3 = clk::now();
    run_topk(ctx, s);
    const auto t4 = clk::now();
    benchmark::DoNotOptimize(s.topk.data());
    tq += std::chrono::duration<double>(t1 - t0).count();
    tw += std::chrono::duration<double>(t2 - t1).count();
    ts += std::chrono::duration<double>(t3 - t2).count();
    tk += std::chrono::duration<double>(t4 - t3).count();
  }
  const double all = tq + tw + ts + tk, per_s = double(st.iterations()) / all;
  const double ops =
      2.0 * double(query_macs(s) + s.score_macs) + 2.0 * double(s.T) * s.cfg.hidden * 64;
  st.counters["OP/s"] = ops * per_s;
  const double bytes =
      double(s.cfg.q_lora) * 8192 + double(s.cfg.hidden) * 128 + double(s.visible_rows) * 132;
  st.counters["bytes/s"] = bytes * per_s;
  st.counters["pct_query"] = 100.0 * tq / all;
  st.counters["pct_weights"] = 100.0 * tw / all;
  st.counters["pct_score"] = 100.0 * ts / all;
  st.counters["pct_topk"] = 100.0 * tk / all;
}

void context_sweep(benchmark::internal::Benchmark* b) {
  for (int c : {1024, 2048, 4096, 8192, 16384}) b->Args({4, c, 1});
  for (int bt : {1, 16, 64}) b->Args({bt, 8192, 1});
  b->Args({4, 8192, 2});
  b->Args({64, 8192, 2});
}

BENCHMARK(BM_indexer_score)
    ->Apply(context_sweep)
    ->ArgNames({"B", "ctx", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_score_avx2)
    ->Args({4, 8192, 1})
    ->Args({4, 8192, 2})
    ->ArgNames({"B", "ctx", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_topk)
    ->ArgsProduct({{4}, {1024, 2048, 4096, 8192, 16384}})
    ->Args({64, 8192})
    ->ArgNames({"B", "ctx"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_query)
    ->ArgsProduct({{1, 4, 16, 64}, {1}})
    ->Args({4, 2})
    ->ArgNames({"B", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_query_avx2)
    ->Args({4, 1})
    ->Args({4, 2})
    ->ArgNames({"B", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_weights)
    ->ArgsProduct({{1, 4, 16, 64}, {1}})
    ->ArgNames({"B", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_indexer_whole)
    ->Apply(context_sweep)
    ->ArgNames({"B", "ctx", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// ---- One indexer top-k row at CSA's 1M-context widths (262,144 candidates = 1M / ratio 4) ----
// BM_topk_row: tile::topk_row (radix threshold select + sort of the k winners).
// docs/indexer.md also lists the select it replaced (commit dc6dd7b), measured on this fixture.
// BM_topk_row_fullsort: a full std::sort of the row's columns (what a plain top-k costs).
// Args: candidates (row width), k, dist (0: N(0, 1) scores; 1: ReLU-like indexer scores, half of
// them exactly 0; 2: 8 distinct values, ties everywhere). Time is per row; items = candidates.

struct TopkRows {
  static constexpr int kRows = 4;  // cycled, so no single row is learnt by the branch predictor
  std::vector<std::vector<float>> rows;
};

const TopkRows& topk_rows_fixture(int width, int dist) {
  static std::map<std::pair<int, int>, std::unique_ptr<TopkRows>> cache;
  auto& slot = cache[{width, dist}];
  if (slot) return *slot;
  slot = std::make_unique<TopkRows>();
  tdtest::Rng rng(std::uint64_t(width) * 7 + std::uint64_t(dist));
  for (int r = 0; r < TopkRows::kRows; ++r) {
    std::vector<float> s(static_cast<std::size_t>(width));
    for (auto& v : s) {
      if (dist == 0) v = rng.normal();
      if (dist == 1) v = std::max(0.0f, rng.normal()) * 0.03f;
      if (dist == 2) v = float(rng.integer(0, 7)) * 0.25f;
    }
    slot->rows.push_back(std::move(s));
  }
  return *slot;
}

template <class Select>
void topk_row_bench(benchmark::State& st, Select&& select) {
  const int width = int(st.range(0)), k = int(st.range(1));
  const TopkRows& f = topk_rows_fixture(width, int(st.range(2)));
  std::vector<std::int32_t> dst(static_cast<std::size_t>(k));
  int r = 0;
  for (auto _ : st) {
    select(std::span<std::int32_t>(dst), std::span<const float>(f.rows[std::size_t(r)]), k);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    r = (r + 1) % TopkRows::kRows;
  }
  st.SetItemsProcessed(std::int64_t(st.iterations()) * width);
  st.counters["candidates"] = double(width);
}

void BM_topk_row(benchmark::State& st) {
  topk_row_bench(st, [](std::span<std::int32_t> dst, std::span<const float> s, int k) {
    td::tile::topk_row(dst, s, k, 0);
  });
}
void BM_topk_row_fullsort(benchmark::State& st) {
  std::vector<std::int32_t> cols;
  topk_row_bench(st, [&](std::span<std::int32_t> dst, std::span<const float> s, int k) {
    cols.clear();
    for (std::size_t j = 0; j < s.size(); ++j)
      if (s[j] == s[j]) cols.push_back(std::int32_t(j));
    std::sort(cols.begin(), cols.end(), [&](std::int32_t a, std::int32_t b) {
      return s[std::size_t(a)] > s[std::size_t(b)] ||
             (s[std::size_t(a)] == s[std::size_t(b)] && a < b);
    });
    for (std::size_t i = 0; i < dst.size(); ++i)
      dst[i] = i < cols.size() && i < std::size_t(k) ? cols[i] : -1;
  });
}

void topk_row_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"candidates", "k", "dist"});
  b->ArgsProduct({{4096, 65536, 262144}, {512, 1024}, {0, 1, 2}});
  b->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_topk_row)->Apply(topk_row_args);
BENCHMARK(BM_topk_row_fullsort)->Apply(topk_row_args);

}  // namespace

BENCHMARK_MAIN();
