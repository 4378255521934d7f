// Compressor steps (spec §6): CSA main (ratio 4, OUT_DIM 1024), HCA (ratio 128, OUT_DIM 512)
// and the indexer's inner compressor (ratio 4, OUT_DIM 256), at B=4, S=2 (T=8) and T up to 512
// (B = 256 at S = 2, 64 at S = 8), on 1 and 2 threads, on the detected tier.
//
// The projections stream 2 × OUT_DIM × D BF16 weights per step. To measure them from memory
// (as in a real decode step, where 43 layers of weights do not fit in cache) every iteration
// uses the next of several weight copies spanning 256 MiB, the size of the read-bandwidth
// probe's buffer.
//
// Counters (per benchmark):
//   bytes_per_second  weights + x_n + state rows written
//   weight_Bps        projection weight bytes per second
//   FLOP/s            2 × 2·OUT_DIM × D × T per step
//   pct_of_ceiling    the roofline: max(pct_of_read_bw, pct_of_fma), the bound that applies
//   pct_of_read_bw    weight_Bps ÷ single-core streaming read bandwidth (tdbench::read_gbps(1),
//                     measured in this process) × 100 (the bound at decode batch sizes)
//   pct_of_fma        FLOP/s ÷ (threads × single-core BF16 multiply-add ceiling) × 100 (the
//                     FP32 FMA loop, or vdpbf16ps where the CPU has it and it is faster)
//   pct_of_ceiling_cpu  (1 thread) pct_of_ceiling over the thread's CPU time instead of wall time
//                       (and read bandwidth × threads: the per-core figure)
//   cpu_us_per_step     (1 thread) the thread's CPU time per step, µs
// Shared machines: run with --benchmark_repetitions=N; the `median` and `max` aggregates of the
// rate counters bracket the typical and the least disturbed run.
// The state tables are a production allocator's (each request its own blocks, so the requests'
// tails may run at once on two threads; the fixtures' tables alias across requests, spec §3.8).
// `_boundary` variants put a window boundary on every request's second token (pooling, norm,
// rope and the cache store on top of the projections; `_boundary_checked` with the opt-in rounding
// check's row norms); `_boundary_avx2` runs them on the avx2 tier
// (the pooling's 4-lane double path) on a CPU whose default is avx512, and is skipped elsewhere.
// They run at T = 8 and at T = 128 (B = 64: what a large-batch step pays on top of the projection
// roofline when every request closes a window; Zen 5, one thread, medians of 3 runs: CSA +0.3 ms
// on 7.9, HCA +2.2 ms on 3.9, inner +0.4 ms on 2.0 over the plain T = 128 rows).
#include <benchmark/benchmark.h>

#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace tk = tiledecode::kernels;
using td::bf16;
using td::index_t;

namespace {

enum class Kind { csa, hca, inner };

const td::ModelConfig& cfg() {
  static const td::ModelConfig c = td::flash_config();
  return c;
}

tk::CompressorSpec spec_of(Kind k) {
  return k == Kind::csa   ? tk::csa_compressor_spec(cfg())
         : k == Kind::hca ? tk::hca_compressor_spec(cfg())
                          : tk::indexer_compressor_spec(cfg());
}

// 256 MiB of BF16 weights shared by all benchmarks, filled with small finite values.
constexpr std::size_t kWeightPoolBytes = std::size_t(256) << 20;
td::Buffer<bf16>& weight_pool() {
  static td::Buffer<bf16> pool = [] {
    td::Buffer<bf16> p(kWeightPoolBytes / sizeof(bf16));
    std::uint32_t s = 12345;
    for (auto& v : p) {
      s = s * 1664525u + 1013904223u;
      // sign | exponent 2^-7..2^-6 | random mantissa: |w| ~ 0.01, like the checkpoint weights.
      v = bf16::from_bits(
          static_cast<std::uint16_t>(((s >> 16) & 0x8000u) | 0x3c00u | ((s >> 8) & 0xffu)));
    }
    return p;
  }();
  return pool;
}

// Per pool row of D weights an upper bound of its norm (kernels::compressor_row_norms): copy k's
// CompressorWeights::row_norms start at row k · 2 · OUT_DIM (wkv's rows, then wgate's).
const td::Buffer<float>& pool_row_norms() {
  static const td::Buffer<float> n = [] {
    const index_t D = cfg().hidden, rows = index_t(weight_pool().size()) / D;
    td::Buffer<float> r(static_cast<std::size_t>(rows));
    for (index_t i = 0; i < rows; ++i)
      r[std::size_t(i)] = td::bf16_norm_bound(weight_pool().data() + i * D, D);
    return r;
  }();
  return n;
}

const td::RopeTable& rope_table() {
  static const td::RopeTable t = td::make_rope_table(cfg(), td::LayerKind::csa, cfg().max_seq_len);
  return t;
}

td::ThreadPool& pool2() {
  static td::ThreadPool p(2);
  return p;
}

struct Setup {
  Kind kind;
  tk::CompressorSpec spec;
  td::paged::StepShape shape;
  index_t copies = 1, copy_elems = 0;
  td::Tensor<float, 2> ape;
  td::Tensor<bf16, 1> norm_w;
  td::Tensor<bf16, 2> x_n, cmp, hadamard;
  td::Tensor<std::int8_t, 2> idx;
  td::Tensor<float, 1> idx_scale, ws;
  td::Tensor<float, 2> state, kv_out;
  td::Tensor<std::int32_t, 1> positions;
  td::Tensor<std::int32_t, 2> state_table, cmp_table;
  td::Tensor<std::int64_t, 1> state_slots, cmp_slots;

  // state_sigma: the spread of the state rows the windows pool (the fixtures' 0.05, or the
  // projections' own, ~0.72 for this weight pool and N(0, 1) rows of x_n). seed: x_n's and the
  // state rows' draw.
  Setup(Kind k, int tokens, bool boundary, float state_sigma = 0.05f, std::uint64_t seed = 7)
      : kind(k), spec(spec_of(k)) {
    const auto& c = cfg();
    shape = {tokens / 2, 2, -1};
    const index_t T = tokens, B = shape.batch, D = c.hidden, OUT = spec.out_dim();
    copy_elems = 2 * OUT * D;
    copies = index_t(weight_pool().size()) / copy_elems;
    tdtest::Rng rng(7);
    ape = td::Tensor<float, 2>({spec.ratio, OUT});
    rng.fill_normal(ape.flat(), 0.12f);
    norm_w = td::Tensor<bf16, 1>({spec.head_dim});
    rng.fill_uniform(norm_w.flat(), 0.8f, 1.2f);
    x_n = td::Tensor<bf16, 2>({T, D});
    tdtest::Rng data(seed);
    data.fill_normal(x_n.flat());
    // Starts between 4k and 12k, multiples of R, one per request; with `boundary` the second token
    // closes a window.
    std::vector<std::int32_t> starts;
    for (index_t b = 0; b < B; ++b) {
      const std::int32_t base = 4096 + std::int32_t(b * 3 * spec.ratio) % 8192;
      starts.push_back(boundary ? base + spec.ratio - 2 : base);
    }
    positions = td::Tensor<std::int32_t, 1>({T});
    td::paged::build_position_ids(positions.view(), starts, shape, c);
    // A production allocator's state table: each request's columns from its window reach to its
    // last token own blocks of their own (the fixtures' 65-block pools alias across requests,
    // spec §3.8, which keeps the requests' tails in order); the other columns are unmapped.
    const index_t page = tk::compressor_state_page(c, spec), cols = c.max_seq_len / page;
    state_table = td::Tensor<std::int32_t, 2>({B, cols});
    std::int32_t blocks = 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t col = 0; col < cols; ++col) {
        const index_t p = col * page, s0 = starts[std::size_t(b)];
        const bool used = p + page > s0 - 2 * spec.ratio && p < s0 + shape.seq;
        state_table.view()(b, col) = used ? blocks++ : -1;
      }
    state_slots = td::Tensor<std::int64_t, 1>({T});
    td::paged::build_state_slot_mapping(state_slots.view(), positions.view(), state_table.view(),
                                        blocks, int(page), shape, c);
    const index_t cmp_blocks = k == Kind::inner ? 64 : 32;
    cmp_table = td::Tensor<std::int32_t, 2>({B, cmp_blocks});
    td::paged::build_fixture_block_table(cmp_table.view(), cmp_blocks);
    cmp_slots = td::Tensor<std::int64_t, 1>({T});
    td::paged::build_compressed_slot_mapping(cmp_slots.view(), positions.view(), cmp_table.view(),
                                             cmp_blocks, spec.ratio, shape, c);
    state = td::Tensor<float, 2>({blocks * page, spec.state_width()});
    data.fill_normal(state.flat(), state_sigma);
    kv_out = td::Tensor<float, 2>({B, spec.head_dim});
    cmp = td::Tensor<bf16, 2>({cmp_blocks * c.page, spec.head_dim});
    idx = td::Tensor<std::int8_t, 2>({cmp_blocks * c.page, 128});
    idx_scale = td::Tensor<float, 1>({cmp_blocks * c.page});
    hadamard = td::make_hadamard_bf16(128);
    ws = td::Tensor<float, 1>({tk::compressor_workspace_size(c, spec, T)});
  }

  // checked: with the opt-in rounding check's row norms (CompressorWeights::row_norms).
  void step(const td::cpu::Context& ctx, index_t copy, bool checked) {
    const index_t OUT = spec.out_dim(), D = cfg().hidden;
    const bf16* w = weight_pool().data() + copy * copy_elems;
    tk::CompressorWeights wt{td::ConstView<bf16, 2>(w, {OUT, D}),
                             td::ConstView<bf16, 2>(w + OUT * D, {OUT, D}), ape.view(),
                             norm_w.view()};
    if (checked)
      wt.row_norms = td::ConstView<float, 1>(pool_row_norms().data() + copy * 2 * OUT, {2 * OUT});
    const tk::CompressorMetadata meta{shape, positions.view(), state_slots.view(), cmp_slots.view(),
                                      state_table.view()};
    if (kind == Kind::inner) {
      tk::indexer_compressor_step(ctx, cfg(), state.view(), idx.view(), idx_scale.view(),
                                  kv_out.view(), x_n.view(), wt, hadamard.view(), meta,
                                  rope_table().view(), ws.view());
    } else {
      tk::compressor_step(ctx, cfg(), spec, state.view(), cmp.view(), kv_out.view(), x_n.view(), wt,
                          meta, rope_table().view(), ws.view());
    }
  }
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

inline constexpr int kLiveDraws = 17;  // odd: every pairing with the (power of two) weight copies

void run(benchmark::State& st, Kind kind, bool boundary, bool force_avx2 = false,
         td::cpu::Bf16Dot bf16_dot = td::cpu::Bf16Dot::automatic, bool checked = false,
         float state_sigma = 0.05f) {
  const int T = int(st.range(0)), threads = int(st.range(1));
  if (force_avx2 && td::cpu::detect_isa() != td::cpu::Isa::avx512) {
    st.SkipWithError("the default tier is already avx2 or lower (see the _boundary rows)");
    return;
  }
  const double read_bw = tdbench::read_gbps(1) * 1e9;   // measured once per process
  const double fma = tdbench::bf16_mac_gflops() * 1e9;  // BF16 inputs × BF16 weights
  // The live windows at T = 8: kLiveDraws draws of x_n and the state rows, one after the other
  // with the weight copies, so a checked row's mean is over 4 · kLiveDraws · copies windows. The
  // check's cost is mostly a few rare rows' (one that recomputes every channel costs about half a
  // step): with one draw (64 CSA windows) its share of the step measured +4.7 % on the fixtures'
  // tables and +15.1 % on these (Zen 3, in the kernel), over the 17 draws +3.8–4.5 %.
  const bool draws = state_sigma != 0.05f && T <= 8;
  std::vector<std::unique_ptr<Setup>> v;
  for (int i = 0; i < (draws ? kLiveDraws : 1); ++i)
    v.push_back(std::make_unique<Setup>(kind, T, boundary, state_sigma, 7 + std::uint64_t(i)));
  const Setup& s = *v[0];
  const td::cpu::Context ctx{threads > 1 ? &pool2() : nullptr,
                             force_avx2 ? td::cpu::Isa::avx2 : td::cpu::detect_isa(), bf16_dot};
  index_t copy = 0;
  std::size_t draw = 0;
  const double cpu0 = thread_cpu_seconds();
  for (auto _ : st) {
    v[draw]->step(ctx, copy, checked);
    copy = (copy + 1) % s.copies;
    draw = (draw + 1) % v.size();
    benchmark::ClobberMemory();
  }
  const double cpu_s = thread_cpu_seconds() - cpu0;
  const double D = cfg().hidden, OUT = s.spec.out_dim();
  const double wbytes = 2 * OUT * D * sizeof(bf16);
  const double bytes = wbytes + T * D * sizeof(bf16) + T * s.spec.state_width() * sizeof(float);
  const double flops = 2.0 * 2 * OUT * D * T;
  const double it = double(st.iterations());
  using C = benchmark::Counter;
  st.SetBytesProcessed(std::int64_t(bytes * it));
  st.counters["weight_Bps"] = C(wbytes * it, C::kIsRate);
  st.counters["FLOP/s"] = C(flops * it, C::kIsRate);
  // Per call: the roofline time of each bound over the measured time (the rate counters are
  // value · iterations ÷ elapsed seconds).
  const double bw_pct = wbytes / read_bw * 100,
               fma_pct = fma > 0 ? flops / (fma * threads) * 100 : 0;
  st.counters["pct_of_read_bw"] = C(bw_pct * it, C::kIsRate);
  if (fma > 0) st.counters["pct_of_fma"] = C(fma_pct * it, C::kIsRate);
  st.counters["pct_of_ceiling"] = C(std::max(bw_pct, fma_pct) * it, C::kIsRate);
  if (threads == 1 && cpu_s > 0) {
    // The same ratio over the thread's CPU time: what it reaches while it actually runs, when
    // other processes time-slice the core (shared machines).
    st.counters["pct_of_ceiling_cpu"] = std::max(bw_pct, fma_pct) * it / cpu_s;
    // The thread's CPU time per step (µs): an A/B on a shared machine compares these, which
    // time-slicing by other processes does not inflate (wall time does).
    st.counters["cpu_us_per_step"] = cpu_s / it * 1e6;
  }
  st.counters["read_GBps_1t"] = read_bw * 1e-9;
  st.counters["bf16_mac_GFLOPs_1t"] = fma * 1e-9;
  st.SetLabel(std::string(td::cpu::to_string(ctx.isa)));
}

// With --benchmark_repetitions: the largest value over the repetitions. For the rate counters
// (pct_of_ceiling, weight_Bps, FLOP/s) that is the least disturbed run on a shared machine.
double max_of(const std::vector<double>& v) {
  double m = v.empty() ? 0.0 : v[0];
  for (double x : v) m = std::max(m, x);
  return m;
}

void args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2})
    for (int T : {8, 16, 32, 64, 128, 256, 512}) b->Args({T, threads});  // B = T / 2 <= 256
  b->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
  b->ComputeStatistics("max", max_of);
}
void boundary_args(benchmark::internal::Benchmark* b) {
  b->Args({8, 1})->Args({8, 2})->Args({128, 1})->ArgNames({"T", "threads"})->UseRealTime();
  b->Unit(benchmark::kMicrosecond)->ComputeStatistics("max", max_of);
}

void BM_csa_compressor(benchmark::State& st) {
  run(st, Kind::csa, false);
}
void BM_hca_compressor(benchmark::State& st) {
  run(st, Kind::hca, false);
}
void BM_indexer_compressor(benchmark::State& st) {
  run(st, Kind::inner, false);
}
void BM_csa_compressor_boundary(benchmark::State& st) {
  run(st, Kind::csa, true);
}
void BM_hca_compressor_boundary(benchmark::State& st) {
  run(st, Kind::hca, true);
}
void BM_indexer_compressor_boundary(benchmark::State& st) {
  run(st, Kind::inner, true);
}
// The same with the opt-in rounding check (CompressorWeights::row_norms): its cost, same process.
void BM_csa_compressor_boundary_checked(benchmark::State& st) {
  run(st, Kind::csa, true, false, td::cpu::Bf16Dot::automatic, true);
}
void BM_hca_compressor_boundary_checked(benchmark::State& st) {
  run(st, Kind::hca, true, false, td::cpu::Bf16Dot::automatic, true);
}
void BM_indexer_compressor_boundary_checked(benchmark::State& st) {
  run(st, Kind::inner, true, false, td::cpu::Bf16Dot::automatic, true);
}
// The windows at the projections' statistics (their state rows as spread as the step's own), with
// and without the check.
void BM_csa_compressor_boundary_live(benchmark::State& st) {
  run(st, Kind::csa, true, false, td::cpu::Bf16Dot::automatic, false, 0.72f);
}
void BM_hca_compressor_boundary_live(benchmark::State& st) {
  run(st, Kind::hca, true, false, td::cpu::Bf16Dot::automatic, false, 0.72f);
}
void BM_indexer_compressor_boundary_live(benchmark::State& st) {
  run(st, Kind::inner, true, false, td::cpu::Bf16Dot::automatic, false, 0.72f);
}
void BM_csa_compressor_boundary_live_checked(benchmark::State& st) {
  run(st, Kind::csa, true, false, td::cpu::Bf16Dot::automatic, true, 0.72f);
}
void BM_hca_compressor_boundary_live_checked(benchmark::State& st) {
  run(st, Kind::hca, true, false, td::cpu::Bf16Dot::automatic, true, 0.72f);
}
void BM_indexer_compressor_boundary_live_checked(benchmark::State& st) {
  run(st, Kind::inner, true, false, td::cpu::Bf16Dot::automatic, true, 0.72f);
}
void BM_csa_compressor_boundary_avx2(benchmark::State& st) {
  run(st, Kind::csa, true, true);
}
void BM_hca_compressor_boundary_avx2(benchmark::State& st) {
  run(st, Kind::hca, true, true);
}
void BM_indexer_compressor_boundary_avx2(benchmark::State& st) {
  run(st, Kind::inner, true, true);
}

// Bf16Dot::exact (the projections summed in double, golden's bits; issue 17): its cost against
// the rows above, same process.
void BM_csa_compressor_exact(benchmark::State& st) {
  run(st, Kind::csa, false, false, td::cpu::Bf16Dot::exact);
}
void BM_hca_compressor_exact(benchmark::State& st) {
  run(st, Kind::hca, false, false, td::cpu::Bf16Dot::exact);
}
void BM_indexer_compressor_exact(benchmark::State& st) {
  run(st, Kind::inner, false, false, td::cpu::Bf16Dot::exact);
}

BENCHMARK(BM_csa_compressor)->Apply(args);
BENCHMARK(BM_hca_compressor)->Apply(args);
BENCHMARK(BM_indexer_compressor)->Apply(args);
BENCHMARK(BM_csa_compressor_boundary)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_boundary)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_boundary)->Apply(boundary_args);
BENCHMARK(BM_csa_compressor_boundary_checked)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_boundary_checked)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_boundary_checked)->Apply(boundary_args);
BENCHMARK(BM_csa_compressor_boundary_live)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_boundary_live)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_boundary_live)->Apply(boundary_args);
BENCHMARK(BM_csa_compressor_boundary_live_checked)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_boundary_live_checked)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_boundary_live_checked)->Apply(boundary_args);
BENCHMARK(BM_csa_compressor_boundary_avx2)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_boundary_avx2)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_boundary_avx2)->Apply(boundary_args);
BENCHMARK(BM_csa_compressor_exact)->Apply(boundary_args);
BENCHMARK(BM_hca_compressor_exact)->Apply(boundary_args);
BENCHMARK(BM_indexer_compressor_exact)->Apply(boundary_args);

}  // namespace

BENCHMARK_MAIN();
