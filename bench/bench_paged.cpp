// Paged-KV metadata and cache movement (spec §3), one thread:
//   BM_StepMetadata  full StepMetadata::build (positions, lens, 7 slot mappings, window lists)
//   BM_WriteCache    scatter of the step's new BF16 KV rows [T, 512] into the ori pool
//   BM_GatherWindows gather of every token's 128-row BF16 window [T, 128, 512] + validity mask
// at B ∈ {4, 64, 256}, S = 2, start positions near 8k and 16k (per request offset inside the
// page so windows straddle pages differently).
//
// Pools: PoolSizes::for_batch(B) — the spec deployment pools scaled by B/4 so each request keeps
// the fixture's per-request ring (ori: 32 blocks = 4096 tokens per request; at B = 256 the BF16
// ori pool is 8192 blocks = 1 GiB, larger than any cache, like a real per-layer pool).
//
// Counters: bytes_per_second = bytes moved (read + written) per second of wall time; bw_ratio =
// that over tdbench::read_gbps(1), the single-thread streaming read ceiling (also wall time)
// measured in this process. Small cases stay in cache, so their ratio exceeds 1.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace td = tiledecode;
namespace pg = tiledecode::paged;
using td::index_t;

namespace {

const td::ModelConfig kCfg = td::flash_config();
constexpr int kSeq = 2;
constexpr index_t kWidth = 512;

std::vector<std::int32_t> starts_for(int B, int ctx) {
  std::vector<std::int32_t> s(B);
  for (int b = 0; b < B; ++b) s[b] = std::int32_t(ctx - kSeq - (b * 37) % 128);
  return s;
}

void set_counters(benchmark::State& st, double bytes_per_iter) {
  st.SetBytesProcessed(std::int64_t(bytes_per_iter * double(st.iterations())));
  const double ceiling = tdbench::read_gbps(1) * 1e9;
  st.counters["bw_ratio"] =
      benchmark::Counter(bytes_per_iter / ceiling, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["read_GBps_ceiling"] = tdbench::read_gbps(1);
}

void BM_StepMetadata(benchmark::State& st) {
  const int B = int(st.range(0)), ctx = int(st.range(1));
  pg::FixtureTables fx(B);
  pg::StepMetadata md(B, kSeq, kCfg);
  const auto starts = starts_for(B, ctx);
  for (auto _ : st) {
    md.build(starts, {B, kSeq}, fx.tables(), fx.pools, kCfg);
    benchmark::DoNotOptimize(md.window_indices().data());
    benchmark::ClobberMemory();
  }
  const double T = double(B) * kSeq;
  // Written: positions, lens, windows (T x 129 INT32), 7 INT64 slot mappings.
  const double bytes = T * 4 + B * 4 + T * 129 * 4 + 7 * T * 8;
  set_counters(st, bytes);
  st.counters["tokens"] = T;
}

void BM_WriteCache(benchmark::State& st) {
  const int B = int(st.range(0)), ctx = int(st.range(1));
  pg::FixtureTables fx(B);
  pg::StepMetadata md(starts_for(B, ctx), {B, kSeq}, fx.tables(), fx.pools, kCfg);
  const index_t T = index_t(B) * kSeq;
  td::Tensor<td::bf16, 2> pool({fx.pools.ori * kCfg.page, kWidth}), kv({T, kWidth});
  tdtest::Rng rng(1);
  rng.fill_uniform(kv.flat(), -1.0f, 1.0f);
  for (auto _ : st) {
    pg::write_cache(pool.view(), kv.view(), md.ori_slot_mapping());
    benchmark::ClobberMemory();
  }
  set_counters(st, 2.0 * double(T) * kWidth * sizeof(td::bf16));  // read + write
}

void BM_GatherWindows(benchmark::State& st) {
  const int B = int(st.range(0)), ctx = int(st.range(1));
  pg::FixtureTables fx(B);
  pg::StepMetadata md(starts_for(B, ctx), {B, kSeq}, fx.tables(), fx.pools, kCfg);
  const index_t T = index_t(B) * kSeq;
  td::Tensor<td::bf16, 2> pool({fx.pools.ori * kCfg.page, kWidth});
  tdtest::Rng rng(2);
  rng.fill_uniform(pool.flat(), -1.0f, 1.0f);
  td::Tensor<td::bf16, 3> dst({T, kCfg.window, kWidth});
  td::Tensor<std::uint8_t, 2> valid({T, kCfg.window});
  for (auto _ : st) {
    pg::gather_windows(dst.view(), valid.view(), pool.view(), md.window_indices());
    benchmark::ClobberMemory();
  }
  // Read + written row bytes (the INT32 lists and the mask are < 1 % more).
  set_counters(st, 2.0 * double(T) * kCfg.window * kWidth * sizeof(td::bf16));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "ctx"});
  for (int B : {4, 64, 256})
    for (int ctx : {8192, 16384}) b->Args({B, ctx});
}

// Wall-clock time, like the ceiling it is divided by (on a shared machine both see the same load).
BENCHMARK(BM_StepMetadata)->Apply(shapes)->UseRealTime();
BENCHMARK(BM_WriteCache)->Apply(shapes)->UseRealTime();
BENCHMARK(BM_GatherWindows)->Apply(shapes)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
