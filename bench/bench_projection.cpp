// q / kv projections of one layer (kernels/qkv_projection.hpp) at decode shapes, with the machine
// ceilings measured in the same process (bench/ceilings.hpp):
//   x_n @ wq_a and x_n @ wkv   BF16 weights, FP32 FMA       2·T·D·(Q_LORA + 512) FLOP
//   qr @ wq_b                  INT8 × INT8 → INT32          2·T·Q_LORA·H·512 OP
// Every weight is read once per call (the step streams them for all T tokens); `copies` weight
// sets rotate so that consecutive iterations do not find the previous one's weights in cache.
// Counters:
//   FLOP/s, OP/s        BF16-part FLOP and INT8-part OP per second (wall time)
//   weight_Bps          weight bytes per second (wall time)
//   pct_of_compute      compute roofline (FLOP / BF16 multiply-add ceiling + OP / INT8 ceiling;
//                       the machine's best loops: tdbench::bf16_mac_gflops, int8_machine_gops)
//                       ÷ measured time; one thread: CPU time against the CPU-time ceilings
//                       (robust to other tenants), several: wall time against threads × ceiling
//   pct_of_read_bw      weight bytes ÷ read ceiling (read_gbps_cpu / read_gbps(threads)) ÷ time
//   pct_of_ceiling      the larger roofline's share: at T = 8 the projections are compute bound
//                       on this CPU (INT8 at 2 OP per byte of wq_b per token), see memory_bound
// Arguments: T (tokens = B·S), threads.
#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;

namespace {

struct QkvProblem {
  static constexpr int kCopies = 3;
  td::ModelConfig cfg;
  index_t T;
  std::vector<td::Tensor<bf16, 2>> wq_a, wkv;
  std::vector<td::Tensor<std::int8_t, 2>> wq_b;
  std::vector<td::QkvPackedWqB> wq_b_packed;    // the load-time copy, where the CPU has a VNNI tier
  std::vector<td::QkvBf16Rows> bf16_rows;       // wq_a | wkv transposed (as LayerWeightsStorage)
  std::vector<td::Tensor<float, 1>> wq_a_norm;  // the q-latent rounding check's column norms
  std::vector<td::Tensor<float, 1>> wkv_norm;   // the kv rounding check's
  td::Tensor<bf16, 1> gamma_cq, gamma_ckv;
  td::Tensor<float, 1> wq_b_scale;
  td::Tensor<bf16, 2> x, kv;
  td::Tensor<bf16, 3> q;
  td::Tensor<std::int8_t, 2> qr;
  td::Tensor<float, 1> qr_scale;
  td::Tensor<float, 2> sx, scq, skv;
  td::Tensor<std::int32_t, 2> sqr;
  td::Tensor<std::int32_t, 1> pos;
  td::RopeTable rope;

  QkvProblem(const td::ModelConfig& c, index_t t) : cfg(c), T(t) {
    const index_t D = cfg.hidden, QL = cfg.q_lora, HD = cfg.head_dim, N = cfg.n_heads * HD;
    for (int k = 0; k < kCopies; ++k) {
      wq_a.emplace_back(std::array<index_t, 2>{D, QL});
      wkv.emplace_back(std::array<index_t, 2>{D, HD});
      wq_b.emplace_back(std::array<index_t, 2>{QL, N});
      auto& a = wq_a.back();
      auto& v = wkv.back();
      auto& b = wq_b.back();
      // Normal, std 1/64 (the layer's statistics): distinct values, as the q-latent's rounding
      // check sees them in a model (periodic weights tie many cq values at the row's amax).
      tdtest::Rng rng(std::uint64_t(11 + k));
      rng.fill_normal(std::span<bf16>(a.data(), a.size()), 1.0f / 64.0f);
      rng.fill_normal(std::span<bf16>(v.data(), v.size()), 1.0f / 64.0f);
      for (std::size_t i = 0; i < b.size(); ++i)
        b.data()[i] = std::int8_t(int((i * 7 + k) % 255) - 127);
      if (td::cpu::has_vnni(td::cpu::detect_isa()))
        wq_b_packed.push_back(td::kernels::pack_qkv_wq_b(cfg, b.view()));
      // As LayerWeightsStorage::pack, on every CPU.
      bf16_rows.push_back(td::kernels::pack_qkv_bf16_rows(cfg, a.view(), v.view()));
      wkv_norm.push_back(td::kernels::qkv_wkv_norms(v.view()));
      wq_a_norm.push_back(td::kernels::qkv_wq_a_norms(a.view()));
    }
    gamma_cq = td::Tensor<bf16, 1>({QL});
    gamma_ckv = td::Tensor<bf16, 1>({HD});
    for (index_t i = 0; i < QL; ++i) gamma_cq.view()(i) = bf16(1.0f);
    for (index_t i = 0; i < HD; ++i) gamma_ckv.view()(i) = bf16(1.0f);
    wq_b_scale = td::Tensor<float, 1>({N});
    for (index_t i = 0; i < N; ++i) wq_b_scale.view()(i) = 1e-3f;
    x = td::Tensor<bf16, 2>({T, D});
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = bf16(float(int(i % 17) - 8) * 0.1f);
    q = td::Tensor<bf16, 3>({T, cfg.n_heads, HD});
    kv = td::Tensor<bf16, 2>({T, HD});
    qr = td::Tensor<std::int8_t, 2>({T, QL});
    qr_scale = td::Tensor<float, 1>({T});
    sx = td::Tensor<float, 2>({T, D});
    scq = td::Tensor<float, 2>({T, QL});
    skv = td::Tensor<float, 2>({T, HD});
    sqr = td::Tensor<std::int32_t, 2>({T, QL / 2});
    pos = td::Tensor<std::int32_t, 1>({T});
    for (index_t i = 0; i < T; ++i) pos.view()(i) = std::int32_t(8190 + i % 2);
    rope = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  }
  void run(const td::cpu::Context& ctx, int k, bool packed, bool checked = true) {
    const td::QkvWeights w{
        wq_a[k].view(),
        gamma_cq.view(),
        wq_b[k].view(),
        wq_b_scale.view(),
        wkv[k].view(),
        gamma_ckv.view(),
        packed && !wq_b_packed.empty() ? &wq_b_packed[k] : nullptr,
        packed ? &bf16_rows[k] : nullptr,
        checked ? td::ConstView<float, 1>(wq_a_norm[k].view()) : td::ConstView<float, 1>{},
        checked && packed ? td::ConstView<float, 1>(wkv_norm[k].view())
                          : td::ConstView<float, 1>{}};
    td::kernels::qkv_projection(ctx, q.view(), kv.view(), qr.view(), qr_scale.view(), x.view(), w,
                                rope.view(), pos.view(),
                                td::QkvScratch{sx.view(), scq.view(), skv.view(), sqr.view()}, cfg);
  }
};

// packed: pass the load-time copies (packed wq_b, transposed wq_a | wkv: LayerWeightsStorage::pack
// makes them in the step); the "_unpacked" variant runs the AVX-VNNI tier on the plain wq_b for
// comparison, "_fma" pins Bf16Dot::fma (the 512-bit FMA x_n · [wq_a | wkv], every tier's bits)
// where the automatic choice is vdpbf16ps; "_unchecked" passes no wq_a_norm and no wkv_norm (no
// q-latent and no kv rounding check: their cost, against qkv_projection_flash; both checks'
// repairs read the transposed rows, as LayerWeightsStorage::pack makes them on every CPU; the
// "_unpacked" variant has neither the rows nor the kv check, and its q-latent repairs read wq_a's
// columns).
void bm_qkv(benchmark::State& state, td::ModelConfig cfg, bool packed, td::cpu::Bf16Dot bf16_dot,
            bool checked) {
  const index_t T = state.range(0);
  const int threads = int(state.range(1));
  QkvProblem p(cfg, T);
  std::unique_ptr<td::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
  const td::cpu::Context ctx{pool.get(), td::cpu::detect_isa(), bf16_dot};
  int k = 0;
  double cpu = 0;
  for (auto _ : state) {
    const double c0 = tdbench::process_cpu_seconds();
    p.run(ctx, k, packed, checked);
    cpu += tdbench::process_cpu_seconds() - c0;
    k = (k + 1) % QkvProblem::kCopies;
    benchmark::DoNotOptimize(p.q.data());
  }
  const double n = double(state.iterations());
  const double D = cfg.hidden, QL = cfg.q_lora, HD = cfg.head_dim, N = cfg.n_heads * HD;
  const double flops = 2.0 * double(T) * D * (QL + HD), ops = 2.0 * double(T) * QL * N;
  const double bytes = 2.0 * D * (QL + HD) + QL * N;
  using C = benchmark::Counter;
  state.counters["FLOP/s"] = C(flops * n, C::kIsRate);
  state.counters["OP/s"] = C(ops * n, C::kIsRate);
  state.counters["weight_Bps"] = C(bytes * n, C::kIsRate);
  // Roofline times per call against the per-core CPU-time ceilings. One thread: against CPU time
  // per call; several: compute ceiling × threads and read_gbps(threads) against wall time (rate
  // counters: value · iterations ÷ elapsed seconds).
  const double fma1 = tdbench::bf16_mac_gflops<true>() * 1e9;    // BF16 x_n × BF16 wq_a / wkv
  const double i8_1 = tdbench::int8_machine_gops<true>() * 1e9;  // the machine's best INT8 loop
  if (threads == 1) {
    const double t_cmp = flops / fma1 + ops / i8_1,
                 t_mem = bytes / (tdbench::read_gbps_cpu() * 1e9);
    const double c = cpu / n;
    state.counters["pct_of_compute"] = 100.0 * t_cmp / c;
    state.counters["pct_of_read_bw"] = 100.0 * t_mem / c;
    state.counters["memory_bound"] = t_mem > t_cmp ? 1 : 0;
    state.counters["pct_of_ceiling"] = 100.0 * std::max(t_cmp, t_mem) / c;
  } else {
    const double t_cmp = (flops / fma1 + ops / i8_1) / threads;
    const double t_mem = bytes / (tdbench::read_gbps(threads) * 1e9);
    state.counters["pct_of_compute"] = C(100.0 * t_cmp * n, C::kIsRate);
    state.counters["pct_of_read_bw"] = C(100.0 * t_mem * n, C::kIsRate);
    state.counters["memory_bound"] = t_mem > t_cmp ? 1 : 0;
    state.counters["pct_of_ceiling"] = C(100.0 * std::max(t_cmp, t_mem) * n, C::kIsRate);
  }
  state.counters["cpu_bf16_mac_gflops"] = fma1 * 1e-9;
  state.counters["cpu_int8_gops"] = i8_1 * 1e-9;
  state.SetLabel(std::string(td::cpu::to_string(ctx.isa)));
}

const int kRegistered = [] {
  auto* f = benchmark::RegisterBenchmark("qkv_projection_flash", bm_qkv, td::flash_config(), true,
                                         td::cpu::Bf16Dot::automatic, true);
  for (int threads : {1, 2})
    // T = B·S: B = 4 .. 32 at S = 2, and the large batches up to B = 256 (S = 2) / 64 (S = 8).
    for (int T : {8, 16, 32, 64, 128, 256, 512}) f->Args({T, threads});
  f->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  if (td::kernels::qkv_bf16_rows_useful()) {
    auto* g = benchmark::RegisterBenchmark("qkv_projection_flash_fma", bm_qkv, td::flash_config(),
                                           true, td::cpu::Bf16Dot::fma, true);
    for (int T : {8, 128, 512}) g->Args({T, 1});
    g->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  auto* u =
      benchmark::RegisterBenchmark("qkv_projection_flash_unchecked", bm_qkv, td::flash_config(),
                                   true, td::cpu::Bf16Dot::automatic, false);
  for (int threads : {1, 2}) u->Args({8, threads});
  u->Args({128, 1})->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  // Bf16Dot::exact: x_n · [wq_a | wkv] summed in double (golden's bits; issue 17), every tier.
  benchmark::RegisterBenchmark("qkv_projection_flash_exact", bm_qkv, td::flash_config(), true,
                               td::cpu::Bf16Dot::exact, true)
      ->Args({8, 1})
      ->Args({8, 2})
      ->Args({128, 1})
      ->ArgNames({"T", "threads"})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("qkv_projection_flash_unpacked", bm_qkv, td::flash_config(), false,
                               td::cpu::Bf16Dot::automatic, true)
      ->Args({8, 1})
      ->ArgNames({"T", "threads"})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("qkv_projection_pro", bm_qkv, td::pro_config(), true,
                               td::cpu::Bf16Dot::automatic, true)
      ->Args({8, 1})
      ->ArgNames({"T", "threads"})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
