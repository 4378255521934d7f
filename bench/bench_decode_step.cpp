// Decode-step benchmarks: one whole SWA / CSA / HCA layer step and a 4-layer step (SWA, SWA,
// CSA, HCA — the first layers of the flash schedule) at B = 4, S = 2 (MTP, commit 1), 8k
// context, flash shapes, synthetic weights at the spec statistics. Counters:
//   share_<kernel>  fraction of the step spent in each primitive (from decode::KernelTimes)
//   weight_GBps     weight bytes of the layers / step time (the step reads every weight once)
//   pct_of_ceiling  weight_GBps as % of the measured streaming read bandwidth with the same
//                   number of threads (the step at T = 8 is weight-bandwidth bound, except for
//                   the attention and indexer cores, which are compute bound and small)
// Arguments: threads (1, 2).
//
// BM_decode_step_context/<family>/<context>: one layer step (0 SWA, 1 CSA, 2 HCA) on 2 threads
// with max_seq_len = 2^20, every request at `context` tokens (1k .. 1M - 2), counters
// us_<kernel> = microseconds per step in each primitive: the sweep behind the time-vs-context
// plot (indexer linear in the visible rows, CSA attention flat, HCA linear in n_t, SWA flat).
#include <benchmark/benchmark.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/synthetic.hpp"

namespace td = tiledecode;
using td::index_t;

namespace {

constexpr int kB = 4, kS = 2, kContext = 8192;

struct Stack {
  td::ModelConfig cfg = td::flash_config();
  td::paged::FixtureTables fx{kB, cfg};
  std::vector<std::unique_ptr<td::decode::LayerWeightsStorage>> w;
  std::vector<std::unique_ptr<td::decode::LayerCacheStorage>> c;
  td::RopeTable rope_swa, rope_cmp;
  Stack() {
    td::ThreadPool pool(2);
    const auto ctx = td::cpu::make_context(&pool);
    const td::LayerKind kinds[4] = {td::LayerKind::swa, td::LayerKind::swa, td::LayerKind::csa,
                                    td::LayerKind::hca};
    for (int l = 0; l < 4; ++l) {
      w.push_back(std::make_unique<td::decode::LayerWeightsStorage>(cfg, kinds[l]));
      td::decode::synthetic::fill_weights(ctx, *w.back(), cfg, l, 7);
      w.back()->pack(cfg);
      c.push_back(std::make_unique<td::decode::LayerCacheStorage>(cfg, kinds[l], fx.pools));
      td::decode::synthetic::fill_caches(ctx, *c.back(), cfg, l, 7);
    }
    rope_swa = td::make_rope_table(cfg, td::LayerKind::swa, cfg.max_seq_len);
    rope_cmp = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  }
  const td::RopeTable& rope(td::LayerKind k) const {
    return k == td::LayerKind::swa ? rope_swa : rope_cmp;
  }
};

Stack& stack() {
  static Stack s;
  return s;
}

// Runs layers [first, last) as one step per iteration.
void run_steps(benchmark::State& state, int first, int last) {
  Stack& st = stack();
  const auto& cfg = st.cfg;
  const int threads = int(state.range(0));
  td::ThreadPool pool{static_cast<std::size_t>(threads)};
  const auto be = td::decode::Backend::cpu(&pool);
  td::paged::StepMetadata md(kB, kS, cfg);
  td::decode::Workspace ws(cfg, kB, kS, be.concurrency());
  const index_t T = kB * kS;
  td::Tensor<float, 3> xa({T, 4, cfg.hidden}), xb({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(be.cpu_ctx, xa.view(), 3, 0);
  const std::array<std::int32_t, kB> starts{kContext, kContext, kContext, kContext};
  const td::paged::StepShape sh{kB, kS, 1};
  std::vector<td::decode::LayerWeights> wv;
  std::size_t weight_bytes = 0;
  for (int l = first; l < last; ++l) {
    wv.push_back(st.w[l]->view());
    weight_bytes += st.w[l]->bytes();
  }
  td::decode::KernelTimes times;
  for (auto _ : state) {
    md.build(starts, sh, st.fx.tables(), st.fx.pools, cfg);
    td::View<float, 3> in = xa.view(), out = xb.view();
    for (int l = first; l < last; ++l) {
      td::decode::layer_step(be, out, in, wv[l - first], st.c[l]->view(), md,
                             st.rope(wv[l - first].kind).view(), ws, cfg, {}, &times);
      std::swap(in, out);
    }
    benchmark::DoNotOptimize(xb.data());
  }
  const double total = times.total();
  for (int i = 0; i < td::decode::kNumKernels; ++i) {
    if (times.calls[i] == 0) continue;
    state.counters["share_" + std::string(td::decode::to_string(td::decode::Kernel(i)))] =
        times.seconds[i] / total;
  }
  const double secs_per_step = total / double(state.iterations());
  const double gbps = double(weight_bytes) / secs_per_step * 1e-9;
  state.counters["weight_GBps"] = gbps;
  state.counters["read_ceiling_GBps"] = tdbench::read_gbps(threads);
  state.counters["pct_of_ceiling"] = 100.0 * gbps / tdbench::read_gbps(threads);
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(kB), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_decode_step_swa(benchmark::State& s) {
  run_steps(s, 0, 1);
}
void BM_decode_step_csa(benchmark::State& s) {
  run_steps(s, 2, 3);
}
void BM_decode_step_hca(benchmark::State& s) {
  run_steps(s, 3, 4);
}
void BM_decode_step_4layers(benchmark::State& s) {
  run_steps(s, 0, 4);
}

// The context sweep on a 1M-token stack (built on first use: ~0.5 GB of weights, 1 GB of RoPE).
struct LongStack {
  td::ModelConfig cfg = [] {
    td::ModelConfig c = td::flash_config();
    c.max_seq_len = 1 << 20;
    return c;
  }();
  td::paged::FixtureTables fx{kB, cfg};
  std::vector<std::unique_ptr<td::decode::LayerWeightsStorage>> w;
  std::vector<std::unique_ptr<td::decode::LayerCacheStorage>> c;
  td::RopeTable rope_swa, rope_cmp;
  LongStack() {
    td::ThreadPool pool(2);
    const auto ctx = td::cpu::make_context(&pool);
    const td::LayerKind kinds[3] = {td::LayerKind::swa, td::LayerKind::csa, td::LayerKind::hca};
    for (int l = 0; l < 3; ++l) {
      w.push_back(std::make_unique<td::decode::LayerWeightsStorage>(cfg, kinds[l]));
      td::decode::synthetic::fill_weights(ctx, *w.back(), cfg, l, 7);
      w.back()->pack(cfg);
      c.push_back(std::make_unique<td::decode::LayerCacheStorage>(cfg, kinds[l], fx.pools));
      td::decode::synthetic::fill_caches(ctx, *c.back(), cfg, l, 7);
    }
    rope_swa = td::make_rope_table(cfg, td::LayerKind::swa, cfg.max_seq_len, td::kDefaultRopeAngles,
                                   &pool);
    rope_cmp = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len, td::kDefaultRopeAngles,
                                   &pool);
  }
};

LongStack& long_stack() {
  static LongStack s;
  return s;
}

void BM_decode_step_context(benchmark::State& state) {
  LongStack& st = long_stack();
  const auto& cfg = st.cfg;
  const int l = int(state.range(0));
  const std::int32_t context = std::int32_t(state.range(1));
  td::ThreadPool pool{2};
  const auto be = td::decode::Backend::cpu(&pool);
  td::paged::StepMetadata md(kB, kS, cfg);
  td::decode::Workspace ws(cfg, kB, kS, be);
  const index_t T = kB * kS;
  td::Tensor<float, 3> xa({T, 4, cfg.hidden}), xb({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(be.cpu_ctx, xa.view(), 3, 0);
  const std::array<std::int32_t, kB> starts{context, context, context, context};
  const td::paged::StepShape sh{kB, kS, 1};
  md.build(starts, sh, st.fx.tables(), st.fx.pools, cfg);
  const td::decode::LayerWeights w = st.w[std::size_t(l)]->view();
  const td::RopeTable& rope = w.kind == td::LayerKind::swa ? st.rope_swa : st.rope_cmp;
  td::decode::KernelTimes times;
  for (auto _ : state) {
    td::decode::layer_step(be, xb.view(), xa.view(), w, st.c[std::size_t(l)]->view(), md,
                           rope.view(), ws, cfg, {}, &times);
    benchmark::DoNotOptimize(xb.data());
  }
  for (int i = 0; i < td::decode::kNumKernels; ++i) {
    if (times.calls[i] == 0) continue;
    state.counters["us_" + std::string(td::decode::to_string(td::decode::Kernel(i)))] =
        times.seconds[i] * 1e6 / double(state.iterations());
  }
  state.counters["context"] = double(context);
  state.SetLabel(std::string(td::to_string(w.kind)));
}

void context_args(benchmark::internal::Benchmark* b) {
  for (int l = 0; l < 3; ++l)
    for (std::int64_t c : {1024, 4096, 16384, 65536, 262144, 1048574}) b->Args({l, c});
}

BENCHMARK(BM_decode_step_swa)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_step_csa)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_step_hca)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_step_4layers)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_step_context)
    ->Apply(context_args)
    ->ArgNames({"family", "context"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
