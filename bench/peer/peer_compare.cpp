// peer_compare: TileDecode against an ATen/OpenBLAS peer and the golden references, on the same
// inputs, in one process, next to this machine's ceilings measured in the same run.
//
//   peer_compare [--quick | --long-context] [--json FILE] [--threads 1,2] [--filter SUBSTR]
//                [--min-time SEC] [--golden-max-batch N] [--golden-max-context N]
//                [--batches 1,4,..] [--seqs 2,8] [--isa avx2,avx512,..]
//                [--blas-core auto|detected|NAME]
//
// Points (flash preset, max_seq_len 16384): B=4, S=2 at context 1k, 4k, 8k, 16k, and the batch
// sweep at 8k: B = 1, 4, 16, 64, 128, 256 at S = 2 and B = 1, 4, 16, 64 at S = 8 (T = B·S up to
// 512 token rows). --quick: B = 4 and 16 at S = 2, B = 4 at S = 8 (8k). --batches / --seqs
// replace the sweep by their product at 8k (--seqs alone keeps T <= 512). Golden runs up to
// --golden-max-batch requests (default 4; its double-precision loops are slow at large batch).
// --isa: the TileDecode tiers to run (default the detected one), each sampled against the same
// peer samples (one row per tier); --blas-core: the peer's OpenBLAS core (auto: measured, see
// choose_blas_core; detected: OpenBLAS's own pick; or an OPENBLAS_CORETYPE name).
// JSON rows carry kernel, threads, context, batch, seq, isa (the tier), the times, ratio_vs_peer,
// pct_of_ceiling with ceiling_kind (the ceilings it used), pct_of_tier_ceiling with
// tier_ceiling_kind and reach_vs_peer (× peer at 100 % of the tier's own ceiling); "peer" carries
// blas_core and every core measured (blas_cores_measured, sgemm GFLOP/s).
// --long-context: the context sweep as served, B=4, S=2 at 1k, 4k, 16k, 64k, 256k and 1M - 2 on
// the flash preset with max_seq_len = 2^20 (one configuration for the whole sweep, so only the
// context moves), for the kernels whose work grows with context (indexer, the three attentions,
// the CSA layer). Golden checks every point once (agreement columns) and is timed up to
// --golden-max-context (default 65536: its double-precision indexer takes ~10 s per call at 256k
// and ~40 s at 1M on one core).
// Kernels: indexer score + top-k, sparse attention CSA/HCA/SWA, output projection, the three
// compressors (context-independent: measured at the 8k points only), and a whole CSA layer
// step (decode::csa_step).
// Timing: TileDecode and every peer variant are sampled round-robin (same load for all) for at
// least --min-time seconds each and 3 rounds. The reported time of a single-thread row is the
// median CPU time of the calling thread (on a shared machine, wall time mostly measures the
// other tenants; every single-thread implementation here runs on the calling thread); of a
// 2-thread row, the minimum wall time, every sample starting with the item's threads awake
// (measure_interleaved); TileDecode's 2-thread rows also carry the samples taken with its worker
// asleep ("cold"). Wall medians and minima are in the JSON as well.
// Ratios are peer time / TileDecode time (> 1: TileDecode is faster). % of ceiling = roofline
// time (max of compute time at the machine's best FP32-FMA + BF16 × BF16 + INT8 ceilings and
// streamed bytes at the measured read bandwidth, ceilings × threads; a layer sums its kernels'
// rooflines) / measured time.

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <malloc.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ceilings.hpp"
#include "peer/aten_peer.hpp"
#include "peer/fixtures.hpp"
#include "peer/layer_case.hpp"
#include "peer/tiledecode_side.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/parallel.hpp"

namespace {

using namespace tdpeer;
namespace td = tiledecode;

struct Options {
  bool quick = false;
  std::string json;
  std::vector<int> threads{1, 2};
  std::string filter;
  double min_time = 0.1;
  int golden_max_batch = 4;
  bool long_context = false;
  int golden_max_context = 65536;
  std::vector<int> batches, seqs;  // non-empty: the batch sweep at 8k is batches × seqs
  std::vector<std::string> isas;   // TileDecode tiers to run (empty: the detected one)
  std::string blas_core = "auto";  // auto | detected | an OPENBLAS_CORETYPE name
  bool blas_probe = false;         // internal: print one probe line and exit
};

// The machine's best ceilings, whatever tier a kernel ran (bench/ceilings.hpp), and the name of
// the loop that set each (the `ceiling_kind` of a row lists those its roofline used).
struct Ceilings {
  double fma_gflops = 0, bf16_gflops = 0, int8_gops = 0, bw1 = 0, bw2 = 0;
  std::string fp32_kind = "fma256", bf16_kind = "fma256", int8_kind = "avx2_int8";
  double bw(int threads) const { return threads >= 2 ? bw2 : bw1; }
};

// Work of one kernel step: FP32 FLOP (FP32 operands), BF16 FLOP (multiply-adds whose two
// operands are BF16 already: the compressors' x_n × wkv / wgate, o-proj's o_packed × wo_a, the
// q/kv projections' x_n × wq_a / wkv; held to the BF16 ceiling like bench_projection and
// bench_compressor do), INT8 OP (2 per multiply-add), bytes that must stream. A composite step
// (the layer) lists its kernels in `parts`: its roofline is the sum of theirs.
struct Cost {
  double fp32 = 0, bf16 = 0, int8 = 0, bytes = 0;
  std::vector<Cost> parts;
  Cost& operator+=(const Cost& o) {
    fp32 += o.fp32, bf16 += o.bf16, int8 += o.int8, bytes += o.bytes;
    parts.push_back(o);
    return *this;
  }
};

double compute_s(const Cost& c, const Ceilings& ce, int threads) {
  double t = 0;
  if (ce.fma_gflops > 0) t += c.fp32 / (ce.fma_gflops * 1e9 * threads);
  if (ce.bf16_gflops > 0) t += c.bf16 / (ce.bf16_gflops * 1e9 * threads);
  if (ce.int8_gops > 0) t += c.int8 / (ce.int8_gops * 1e9 * threads);
  return t;
}
double memory_s(const Cost& c, const Ceilings& ce, int threads) {
  return ce.bw(threads) > 0 ? c.bytes / (ce.bw(threads) * 1e9) : 0;
}

double roofline_s(const Cost& c, const Ceilings& ce, int threads) {
  if (!c.parts.empty()) {
    double t = 0;
    for (const Cost& p : c.parts) t += roofline_s(p, ce, threads);
    return t;
  }
  return std::max(compute_s(c, ce, threads), memory_s(c, ce, threads));
}
const char* bound_of(const Cost& c, const Ceilings& ce, int threads) {
  if (!c.parts.empty()) return "mixed";
  if (memory_s(c, ce, threads) > compute_s(c, ce, threads)) return "bandwidth";
  if (c.int8 > c.fp32 + c.bf16) return "int8";
  return c.bf16 > c.fp32 ? "bf16" : "fp32";
}

// The ceilings the roofline of `c` used, as "dtype:loop" joined by "+": every compute term of a
// compute-bound kernel (e.g. o-proj "bf16:vdpbf16ps+int8:vpdpbusd512"), "read_bw" for a
// bandwidth-bound one; a composite step (the layer) lists the union over its parts, each once,
// in order of appearance.
void ceiling_kinds(const Cost& c, const Ceilings& ce, int threads, std::vector<std::string>& out) {
  const auto add = [&out](const std::string& k) {
    if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  };
  if (!c.parts.empty()) {
    for (const Cost& p : c.parts) ceiling_kinds(p, ce, threads, out);
  } else if (memory_s(c, ce, threads) > compute_s(c, ce, threads)) {
    add("read_bw");
  } else {
    if (c.fp32 > 0) add("fp32:" + ce.fp32_kind);
    if (c.bf16 > 0) add("bf16:" + ce.bf16_kind);
    if (c.int8 > 0) add("int8:" + ce.int8_kind);
  }
}
std::string ceiling_kind(const Cost& c, const Ceilings& ce, int threads) {
  std::vector<std::string> kinds;
  ceiling_kinds(c, ce, threads, kinds);
  std::string out;
  for (const std::string& k : kinds) out += (out.empty() ? "" : "+") + k;
  return out;
}

// The ceilings of the instructions a tier can use (its reach): the machine's for the detected
// (top) tier; for avx2 / avx2_vnni the 256-bit FMA loop (also for BF16 × BF16: no vdpbf16ps) and
// the tier's INT8 loops (tdbench::int8_ceiling_gops: the AVX2 mixes, 256-bit vpdpbusd on
// avx2_vnni). % of ceiling stays against the machine's best; this one says whether a bar is in
// reach of the tier at all (issue 19 item 6: on an AVX2-only host the indexer's INT8 is the
// vpmaddubsw/vpmaddwd mixes, a third of 256-bit vpdpbusd).
Ceilings tier_ceilings(td::cpu::Isa tier, td::cpu::Isa detected, const Ceilings& machine) {
  // avx512 is the last tier: where it runs it is the detected one and its loops are the
  // machine's best.
  if (tier == detected || tier == td::cpu::Isa::avx512) return machine;
  Ceilings c = machine;  // same read bandwidth
  static const double fma256 =
      std::max(tdbench::detail::fma_rate(true), tdbench::fp32_fma256_gflops());
  c.fma_gflops = c.bf16_gflops = fma256;
  c.fp32_kind = c.bf16_kind = "fma256";
  const double avx2 = std::max(tdbench::int8_best_gops<true>(), tdbench::int8_best_gops<false>());
  c.int8_gops =
      std::max(tdbench::int8_ceiling_gops<true>(tier), tdbench::int8_ceiling_gops<false>(tier));
  c.int8_kind = c.int8_gops > avx2 ? "vpdpbusd256" : "avx2_int8";
  return c;
}

// ---- cost models (spec shapes) --------------------------------------------------------------

int vis_of(const ModelConfig& cfg, const Case& cs, index_t t) {
  return std::min(
      {cs.kv_seq_lens.data()[t / cs.seq] / 4, (cs.positions.data()[t] + 1) / 4, cfg.score_len()});
}

Cost indexer_cost(const Weights& w, const Case& cs) {
  const auto& cfg = w.cfg;
  Cost c;
  for (index_t t = 0; t < cs.tokens(); ++t) {
    const double vis = vis_of(cfg, cs, t);
    c.int8 += 2.0 * cfg.idx_n_heads * cfg.idx_head_dim * vis;
    // Key rows (+ scale) once per token, the score row written.
    c.bytes += vis * (cfg.idx_head_dim + 4) + 4.0 * cfg.score_len();
  }
  return c;
}

Cost attention_cost(const Weights& w, const Case& cs, int ratio) {
  const auto& cfg = w.cfg;
  Cost c;
  for (index_t t = 0; t < cs.tokens(); ++t) {
    const index_t b = t / cs.seq;
    const int pos = cs.positions.data()[t];
    double valid = 0;
    for (int k = 0; k < cfg.window; ++k) valid += cs.win_idx.data()[t * cfg.window + k] >= 0;
    if (ratio == 4) {
      for (int i = 0; i < cfg.idx_topk; ++i) {
        const int raw = cs.topk.data()[t * cfg.idx_topk + i];
        valid += raw >= 0 && raw < (pos + 1) / 4;
      }
    } else if (ratio == 128) {
      valid += std::min({cfg.hca_capacity(), (pos + 1) / 128, cs.kv_seq_lens.data()[b] / 128});
    }
    c.fp32 += 4.0 * cfg.n_heads * cfg.head_dim * valid;  // Q·Kᵀ and P·V
    c.bytes += valid * cfg.head_dim * 2 + 2.0 * 2 * cfg.n_heads * cfg.head_dim;
  }
  return c;
}

Cost oproj_cost(const Weights& w, const Case& cs) {
  const auto& cfg = w.cfg;
  const double T = cs.tokens(), G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(),
               D = cfg.hidden;
  Cost c;
  c.bf16 = 2 * T * G * R * K;  // wo_a: BF16 o_packed × BF16 weights
  c.int8 = 2 * T * D * G * R;
  c.bytes = G * R * K * 2 + D * G * R + T * (G * K * 2 + D * 2);
  return c;
}

Cost compressor_cost(const Weights& w, const Case& cs, int which) {
  const auto& cfg = w.cfg;
  const CompressorWeights& cw = which == 4 ? w.c4 : (which == 128 ? w.c128 : w.inner);
  const double T = cs.tokens(), OUT = cw.out_dim, D = cfg.hidden;
  Cost c;
  c.bf16 = 4 * T * OUT * D;  // BF16 x_n × BF16 wkv and wgate
  c.bytes = 2 * OUT * D * 2 + T * D * 2;
  return c;
}

// The whole CSA layer: its kernels' costs (q/kv and indexer-query projections, both
// compressors, indexer, CSA attention, o-proj; hc_pre/post and norms are negligible).
Cost layer_cost(const Weights& w, const Case& cs) {
  const auto& cfg = w.cfg;
  const double T = cs.tokens(), D = cfg.hidden, QL = cfg.q_lora, H = cfg.n_heads, HD = cfg.head_dim;
  const double IH = cfg.idx_n_heads, ID = cfg.idx_head_dim;
  Cost qkv;
  qkv.bf16 = 2 * T * D * QL + 2 * T * D * HD;  // BF16 x_n × BF16 wq_a / wkv
  qkv.int8 = 2 * T * QL * H * HD;
  qkv.bytes = D * QL * 2 + QL * H * HD + D * HD * 2;
  Cost iq;
  iq.fp32 = 2 * T * D * IH + 2 * T * IH * ID * ID;
  iq.int8 = 2 * T * QL * IH * ID;
  iq.bytes = QL * IH * ID + D * IH * 2;
  Cost c;
  c += qkv;
  c += compressor_cost(w, cs, 4);
  c += compressor_cost(w, cs, 0);
  c += iq;
  c += indexer_cost(w, cs);
  c += attention_cost(w, cs, 4);
  c += oproj_cost(w, cs);
  return c;
}

// ---- kernels --------------------------------------------------------------------------------

// What one point offers the kernels: the per-kernel case and, for the layer, the layer case.
struct Bench {
  const Weights& w;
  Case& cs;
  const LayerModel* lm = nullptr;
  LayerCase* lc = nullptr;
};

using TdMake = std::function<TdRunner(Bench&, const td::cpu::Context*, int)>;
using Make = std::function<Runner(Bench&)>;
using CostFn = std::function<Cost(Bench&)>;

struct KernelDef {
  std::string name;
  bool context_sweep = true;  // false: context-independent, measured at the 8k points only
  TdMake td;
  std::vector<std::pair<std::string, Make>> peers;  // variants; the best one is "the peer"
  Make golden;
  CostFn cost;
};

std::vector<KernelDef> kernel_defs() {
  std::vector<KernelDef> k;
  k.push_back(
      {"indexer",
       true,
       [](Bench& b, const td::cpu::Context* x, int n) { return make_td_indexer(b.w, b.cs, x, n); },
       {{"aten", [](Bench& b) { return make_peer_indexer(b.w, b.cs); }}},
       [](Bench& b) { return make_golden_indexer(b.w, b.cs); },
       [](Bench& b) { return indexer_cost(b.w, b.cs); }});
  for (int ratio : {4, 128, 0}) {
    const std::string name = ratio == 4 ? "attn_csa" : (ratio == 128 ? "attn_hca" : "attn_swa");
    k.push_back({name,
                 true,
                 [ratio](Bench& b, const td::cpu::Context* x, int n) {
                   return make_td_attention(b.w, b.cs, ratio, x, n);
                 },
                 {{"aten", [ratio](Bench& b) { return make_peer_attention(b.w, b.cs, ratio); }}},
                 [ratio](Bench& b) { return make_golden_attention(b.w, b.cs, ratio); },
                 [ratio](Bench& b) { return attention_cost(b.w, b.cs, ratio); }});
  }
  k.push_back({"oproj",
               false,
               [](Bench& b, const td::cpu::Context* x, int) { return make_td_oproj(b.w, b.cs, x); },
               {{"aten_fp32_weights",
                 [](Bench& b) { return make_peer_oproj(b.w, b.cs, WeightMode::fp32_copy); }},
                {"aten_dequant_per_step",
                 [](Bench& b) { return make_peer_oproj(b.w, b.cs, WeightMode::dequant); }}},
               [](Bench& b) { return make_golden_oproj(b.w, b.cs); },
               [](Bench& b) { return oproj_cost(b.w, b.cs); }});
  for (int which : {4, 128, 0}) {
    const std::string name =
        which == 4 ? "compressor_csa" : (which == 128 ? "compressor_hca" : "compressor_inner");
    k.push_back({name,
                 false,
                 [which](Bench& b, const td::cpu::Context* x, int) {
                   return make_td_compressor(b.w, b.cs, which, x);
                 },
                 {{"aten_fp32_weights",
                   [which](Bench& b) {
                     return make_peer_compressor(b.w, b.cs, which, WeightMode::fp32_copy);
                   }},
                  {"aten_dequant_per_step",
                   [which](Bench& b) {
                     return make_peer_compressor(b.w, b.cs, which, WeightMode::dequant);
                   }}},
                 [which](Bench& b) { return make_golden_compressor(b.w, b.cs, which); },
                 [which](Bench& b) { return compressor_cost(b.w, b.cs, which); }});
  }
  k.push_back(
      {"layer_csa",
       true,
       [](Bench& b, const td::cpu::Context* x, int n) { return make_td_layer(*b.lm, *b.lc, x, n); },
       {{"aten_fp32_weights",
         [](Bench& b) { return make_peer_layer(*b.lm, *b.lc, WeightMode::fp32_copy); }},
        {"aten_dequant_per_step",
         [](Bench& b) { return make_peer_layer(*b.lm, *b.lc, WeightMode::dequant); }}},
       [](Bench& b) { return make_golden_layer(*b.lm, *b.lc); },
       [](Bench& b) { return layer_cost(b.w, b.cs); }});
  return k;
}

// ---- measurement ----------------------------------------------------------------------------

struct Timed {
  std::string name;
  const Runner* runner;
  std::function<void()> prepare;  // thread configuration, outside the timed region
  std::function<void()> wake;     // wakes the item's worker threads (untimed); empty: none
};

// Returns once every thread of the pool has started a task (a barrier bounded at 2 ms), so the
// workers are awake and spinning (ThreadPool::kDefaultSpin) when the timed call follows.
void wake_pool(td::Executor& ex) {
  const std::size_t n = ex.concurrency();
  if (n < 2) return;
  std::atomic<std::size_t> arrived{0};
  ex.run(n, [&](std::size_t) {
    arrived.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
    while (arrived.load() < n && std::chrono::steady_clock::now() < until) {
    }
  });
}

// Per-item statistics of the interleaved samples (microseconds).
struct Stat {
  double wall_median = NAN, wall_min = NAN, cpu_median = NAN, proc_cpu_median = NAN;
};

double process_cpu_us() {
  return tdbench::process_cpu_seconds() * 1e6;
}
double thread_cpu_us() {
  return tdbench::thread_cpu_seconds() * 1e6;
}

// Reads a 64 MiB buffer (more than the last-level cache) so that the previous sample's dirty
// cache lines are written back before the next sample starts: otherwise each side pays for the
// other's write-backs (the peer writes hundreds of MB of temporaries per layer; in
// bench_decode_step the CSA layer took 25 ms after a 256 MB read sweep, 34 ms after a 256 MB
// sweep that dirtied the cache).
void write_back_dirty_lines() {
  static const std::vector<std::uint64_t> buf((std::size_t(64) << 20) / sizeof(std::uint64_t), 1);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < buf.size(); i += 8) sum += buf[i];  // one load per 64-byte line
  volatile std::uint64_t sink = sum;
  (void)sink;
}

// Items sampled round-robin: one warm-up run each, then rounds of one timed run per item until
// `min_reps` rounds and `min_time` seconds per item have passed. Each sample records wall time
// and the calling thread's CPU time (which, for single-threaded runs, excludes the time the OS
// gave to other processes on a shared machine). Every sample starts from a clean cache (no dirty
// lines, see write_back_dirty_lines) after a 0.5 ms pause in which the previous item's threads
// go to sleep; then the item's own `wake` (if any) wakes its worker threads, untimed. Inside a
// decode step kernels follow each other and find their threads awake; waking a sleeping thread
// costs 40-1000 us on this VM (the futex wake of a halted vCPU; measured with ThreadPool), which
// would otherwise be charged to every multi-threaded sample of both sides.
std::vector<Stat> measure_interleaved(const std::vector<Timed>& items, double min_time,
                                      int min_reps, int max_reps) {
  using clk = std::chrono::steady_clock;
  for (const Timed& it : items) {
    it.prepare();
    it.runner->run();
  }
  std::vector<std::vector<double>> wall(items.size()), cpu(items.size()), pcpu(items.size());
  const auto start = clk::now();
  for (int round = 0; round < max_reps; ++round) {
    for (std::size_t i = 0; i < items.size(); ++i) {
      items[i].prepare();
      write_back_dirty_lines();
      // Let the previous item's worker threads (OpenBLAS, libgomp: bounded spins, see
      // scripts/peer_compare.sh) go to sleep before this one is timed.
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      if (items[i].wake) items[i].wake();
      const double p0 = process_cpu_us();
      const double c0 = thread_cpu_us();
      const auto t0 = clk::now();
      items[i].runner->run();
      wall[i].push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
      cpu[i].push_back(thread_cpu_us() - c0);
      pcpu[i].push_back(process_cpu_us() - p0);
    }
    const double total = std::chrono::duration<double>(clk::now() - start).count();
    if (round + 1 >= min_reps && total >= min_time * double(items.size())) break;
  }
  std::vector<Stat> st;
  for (std::size_t i = 0; i < items.size(); ++i) {
    std::sort(wall[i].begin(), wall[i].end());
    std::sort(cpu[i].begin(), cpu[i].end());
    std::sort(pcpu[i].begin(), pcpu[i].end());
    const std::size_t mid = (wall[i].size() - 1) / 2;  // lower median
    st.push_back({wall[i][mid], wall[i].front(), cpu[i][mid], pcpu[i][mid]});
  }
  return st;
}

// The time a row reports (see the header comment): single thread → median CPU time of the
// calling thread; more threads → minimum wall time.
const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// The kernel's transparent-huge-page mode, e.g. "always [madvise] never" → "madvise".
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  const auto a = line.find('['), b = line.find(']');
  return a != std::string::npos && b != std::string::npos && b > a ? line.substr(a + 1, b - a - 1)
                                                                   : "unknown";
}

double headline(const Stat& s, int threads) {
  return threads == 1 ? s.cpu_median : s.wall_min;
}

// Relative L2 difference over entries that both sides define (masked scores excluded).
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || a.empty()) return NAN;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] < -1e30f || b[i] < -1e30f) continue;
    num += double(a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Row {
  std::string kernel, td_impl, peer_variant;
  std::string isa;                // TileDecode's tier (td::cpu::to_string)
  std::string ceiling_kind;       // the ceilings pct_of_ceiling used (ceiling_kind())
  std::string tier_ceiling_kind;  // the same against the tier's own ceilings (tier_ceilings())
  double tier_pct = NAN;          // % of the tier's own ceilings
  double reach = NAN;  // peer time / the tier's roofline: × peer at 100 % of the tier's ceiling
  int threads = 1, context = 0, batch = 0, seq = 2;
  double td_us = NAN, peer_us = NAN, golden_us = NAN;
  Stat td_stat, peer_stat;
  Stat td_cold_stat;  // more than one thread: sampled without waking the pool first
  std::vector<std::pair<std::string, double>> peer_variants;
  double pct = NAN, peer_pct = NAN, rel_err = NAN, rel_err_td_golden = NAN,
         rel_err_peer_golden = NAN;
  std::string bound;
  Cost cost;
};

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream o;
  o.precision(6);
  o << v;
  return o.str();
}
std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (ch == '\n') {
      o += "\\n";
      continue;
    }
    o += ch;
  }
  return o + "\"";
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoi(item.c_str()));
  return v;
}

// ---- the peer's BLAS core -------------------------------------------------------------------
//
// OpenBLAS (Debian's is built DYNAMIC_ARCH) picks its kernel set ("core") once, when the library
// loads, from CPUID — or from OPENBLAS_CORETYPE. Its pick is not always the fastest: on a Zen 5
// machine OpenBLAS 0.3.21 ran its Haswell (AVX2) kernels, holding the peer to 256 bits. So
// peer_compare measures the detected core and every core of this OpenBLAS the CPU can run, each
// in a child process of its own (`--blas-probe`, OPENBLAS_CORETYPE set in its environment,
// since the variable is read only at load time), and then, if another core is faster,
// re-executes itself with that OPENBLAS_CORETYPE exported. The probe (1 thread, median thread
// CPU time of each product, ~0.5 s per core) times the peer's product shapes: a projection at
// decode batch (8 × 1024 × 4096, weight-streaming), one at large batch (512 × 1024 × 4096,
// compute-bound) and the attention's Q·Kᵀ (8 × bmm 64 × 640 × 512); a core's score is the
// geometric mean of the three GFLOP/s. The detected core stays unless another scores at least
// 5 % higher: on the shared 2-vCPU VM (load 6) the same kernels measured 1.5-1.6 % apart in one
// probe pass (detected SkylakeX 75.6 vs forced SkylakeX 76.8 GFLOP/s; Cooperlake 79.2 vs
// SapphireRapids, which this OpenBLAS runs as Cooperlake, 80.4) and SkylakeX vs Cooperlake,
// whose sgemm kernels are the same, 3-5 %; the margin keeps the pick from flipping between
// equal cores, while AVX-512 vs AVX2 kernels differ by 20-50 % (SkylakeX 75.6 vs Haswell 64.0;
// 143 vs 103 GFLOP/s on the large-batch projection).

struct BlasProbe {
  std::string requested;  // OPENBLAS_CORETYPE of the child ("" = detected)
  std::string core;       // openblas_get_corename() in the child
  std::vector<std::pair<std::string, double>> gflops;  // per probe shape
  double score = NAN;                                  // geometric mean of gflops
};

struct BlasChoice {
  std::string core;      // the core the peer runs (openblas_get_corename())
  std::string detected;  // what OpenBLAS picks by itself
  std::string how;       // why this core
  std::vector<BlasProbe> probes;
};

// The probe of the current process' core (1 thread): "blas_probe core=NAME shape=GFLOPS ...".
BlasProbe run_blas_probe() {
  struct Shape {
    const char* name;
    int64_t batch, m, n, k;
  };
  const Shape shapes[] = {{"proj_t8", 1, 8, 1024, 4096},
                          {"proj_t512", 1, 512, 1024, 4096},
                          {"attn_qk_bmm", 8, 64, 640, 512}};
  peer_set_threads(1, 1);
  BlasProbe p;
  p.core = peer_blas_corename();
  double log_sum = 0;
  for (const Shape& sh : shapes) {
    Runner r = make_peer_sgemm(sh.batch, sh.m, sh.n, sh.k);
    r.run();  // warm-up: packing buffers, page faults
    std::vector<double> cpu;
    double total = 0;
    while (cpu.size() < 5 || (total < 0.15 && cpu.size() < 2000)) {
      const double c0 = tdbench::thread_cpu_seconds();
      r.run();
      cpu.push_back(tdbench::thread_cpu_seconds() - c0);
      total += cpu.back();
    }
    std::sort(cpu.begin(), cpu.end());
    const double g = 2.0 * double(sh.batch * sh.m * sh.n * sh.k) / cpu[(cpu.size() - 1) / 2] * 1e-9;
    p.gflops.emplace_back(sh.name, g);
    log_sum += std::log(g);
  }
  p.score = std::exp(log_sum / double(std::size(shapes)));
  return p;
}

std::string probe_line(const BlasProbe& p) {
  std::ostringstream o;
  o.precision(4);
  o << "blas_probe requested=" << (p.requested.empty() ? "-" : p.requested) << " core=" << p.core;
  for (const auto& [name, g] : p.gflops) o << " " << name << "=" << g;
  return o.str();
}

BlasProbe parse_probe_line(const std::string& line) {
  BlasProbe p;
  std::istringstream in(line);
  std::string tok;
  in >> tok;  // "blas_probe"
  double log_sum = 0;
  while (in >> tok) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = tok.substr(0, eq), val = tok.substr(eq + 1);
    if (key == "requested")
      p.requested = val == "-" ? "" : val;
    else if (key == "core")
      p.core = val;
    else {
      p.gflops.emplace_back(key, std::atof(val.c_str()));
      log_sum += std::log(p.gflops.back().second);
    }
  }
  if (!p.gflops.empty()) p.score = std::exp(log_sum / double(p.gflops.size()));
  return p;
}

// The OPENBLAS_CORETYPE names worth measuring on this CPU (its ISA allows their kernels; forcing
// a core whose instructions the CPU lacks would SIGILL). Names this OpenBLAS does not know
// (SapphireRapids is 0.3.22+) fall back to its own pick: the probe reports the core it ran.
std::vector<std::string> blas_core_candidates() {
  std::vector<std::string> c;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, cx = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
  const bool osxsave = (cx >> 27) & 1u, fma = (cx >> 12) & 1u;
  if (!osxsave) return c;
  unsigned xlo = 0, xhi = 0;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_os = (xlo & 0x6u) == 0x6u, zmm_os = (xlo & 0xe6u) == 0xe6u;
  if (!__get_cpuid_count(7, 0, &a, &b, &cx, &d)) return c;
  const bool avx2 = (b >> 5) & 1u;
  const bool avx512 = ((b >> 16) & 1u) && ((b >> 17) & 1u) && ((b >> 28) & 1u) &&
                      ((b >> 30) & 1u) && ((b >> 31) & 1u);  // F, DQ, CD, BW, VL (SkylakeX)
  const bool fp16 = (d >> 23) & 1u, amx_tile = (d >> 24) & 1u;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1u);
  unsigned va = 0, vb = 0, vc = 0, vd = 0;
  __get_cpuid(0, &va, &vb, &vc, &vd);
  const bool amd = vb == 0x68747541u;  // "Auth"enticAMD
  if (avx2 && fma && ymm_os) {
    c.push_back("Haswell");
    if (amd) c.push_back("Zen");
  }
  if (avx512 && zmm_os) {
    c.push_back("SkylakeX");
    if (bf16) c.push_back("Cooperlake");
    if (bf16 && fp16 && amx_tile) c.push_back("SapphireRapids");
  }
#endif
  return c;
}

std::string self_exe() {
  std::vector<char> buf(4096);
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  return n > 0 ? std::string(buf.data(), std::size_t(n)) : std::string();
}

// Runs `exe --blas-probe` with OPENBLAS_CORETYPE = `core` ("" = unset); nullopt-like empty probe
// (no core) when the child failed.
BlasProbe probe_in_child(const std::string& exe, const std::string& core) {
  BlasProbe p;
  p.requested = core;
  if (exe.find('\'') != std::string::npos) return p;
  const std::string cmd =
      (core.empty() ? std::string("env -u OPENBLAS_CORETYPE") : "env OPENBLAS_CORETYPE=" + core) +
      " '" + exe + "' --blas-probe 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return p;
  char line[1024];
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "blas_probe ", 11) == 0) {
      std::string l(line);
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
      p = parse_probe_line(l);
      p.requested = core;
    }
  pclose(f);
  return p;
}

// Picks the peer's OpenBLAS core (see above); re-executes this program with OPENBLAS_CORETYPE
// exported when the pick is not the core loaded now (then does not return).
BlasChoice choose_blas_core(const Options& opt, char** argv) {
  BlasChoice bc;
  bc.core = peer_blas_corename();
  if (bc.core.empty()) {
    bc.how = "not OpenBLAS: no core to choose";
    return bc;
  }
  // The re-executed run: the parent's probes and reason travel in the environment.
  if (const char* probes = std::getenv("TDPEER_BLAS_PROBES")) {
    std::istringstream in(probes);
    std::string l;
    while (std::getline(in, l))
      if (!l.empty()) bc.probes.push_back(parse_probe_line(l));
    bc.detected = env_or("TDPEER_BLAS_DETECTED", "?");
    bc.how = env_or("TDPEER_BLAS_HOW", "probe");
    const char* forced = std::getenv("OPENBLAS_CORETYPE");
    if (forced && bc.core != forced)
      std::fprintf(stderr, "warning: OPENBLAS_CORETYPE=%s but OpenBLAS runs core %s\n", forced,
                   bc.core.c_str());
    unsetenv("TDPEER_BLAS_PROBES");
    if (bc.probes.empty()) {  // --blas-core NAME: measure the forced core here
      bc.probes.push_back(run_blas_probe());
      bc.probes.back().requested = forced ? forced : "";
    }
    return bc;
  }
  const char* env_core = std::getenv("OPENBLAS_CORETYPE");
  const bool keep = opt.blas_core == "detected" || (opt.blas_core == "auto" && env_core);
  if (keep || opt.blas_core == bc.core) {
    BlasProbe p = run_blas_probe();
    p.requested = env_core ? env_core : "";
    bc.probes.push_back(p);
    bc.detected = env_core ? "?" : bc.core;
    bc.how = opt.blas_core == "detected" ? "OpenBLAS's own pick (--blas-core detected)"
             : opt.blas_core == "auto"
                 ? "OPENBLAS_CORETYPE=" + std::string(env_core) + " set in the environment"
                 : "--blas-core " + opt.blas_core;
    return bc;
  }
  const std::string exe = self_exe();
  std::string chosen_req;  // OPENBLAS_CORETYPE to export ("" = keep the loaded core)
  if (opt.blas_core != "auto") {
    chosen_req = opt.blas_core;
    bc.detected = bc.core;
    bc.how = "--blas-core " + opt.blas_core;
  } else {
    // The detected core first: the others must beat it by 5 %.
    bc.probes.push_back(probe_in_child(exe, ""));
    for (const std::string& name : blas_core_candidates())
      bc.probes.push_back(probe_in_child(exe, name));
    const BlasProbe& det = bc.probes.front();
    bc.detected = det.core.empty() ? bc.core : det.core;
    // Candidates that ran under their own name (not a fallback), in the order listed; the
    // first of equal scores wins.
    const BlasProbe* best = &det;
    for (const BlasProbe& p : bc.probes)
      if (&p != &det && p.core == p.requested && p.score > det.score * 1.05 &&
          p.score > best->score)
        best = &p;
    if (!(det.score > 0)) {
      bc.how = "probe failed (" + exe + " --blas-probe): OpenBLAS's own pick";
      bc.probes.clear();
      return bc;
    }
    std::ostringstream how;
    how.precision(3);
    if (best == &det) {
      how << "probe: OpenBLAS's own pick " << bc.detected << " (" << det.score
          << " GFLOP/s) is the fastest or within 5 %";
    } else {
      how << "probe: " << best->core << " " << best->score << " GFLOP/s vs OpenBLAS's own pick "
          << bc.detected << " " << det.score << " GFLOP/s (+" << (best->score / det.score - 1) * 100
          << " %)";
      chosen_req = best->requested;
    }
    bc.how = how.str();
    if (chosen_req.empty()) return bc;
  }
  std::string lines;
  for (const BlasProbe& p : bc.probes) lines += probe_line(p) + "\n";
  setenv("OPENBLAS_CORETYPE", chosen_req.c_str(), 1);
  setenv("TDPEER_BLAS_PROBES", lines.c_str(), 1);
  setenv("TDPEER_BLAS_DETECTED", bc.detected.c_str(), 1);
  setenv("TDPEER_BLAS_HOW", bc.how.c_str(), 1);
  std::fflush(stdout);
  execv(exe.c_str(), argv);
  std::fprintf(stderr, "warning: could not re-execute %s with OPENBLAS_CORETYPE=%s: %s\n",
               exe.c_str(), chosen_req.c_str(), std::strerror(errno));
  bc.how += " (re-exec failed: the detected core runs)";
  return bc;
}

void usage() {
  std::puts(
      "usage: peer_compare [--quick | --long-context] [--json FILE] [--threads 1,2]\n"
      "                    [--filter SUBSTR] [--min-time SEC] [--golden-max-batch N]\n"
      "                    [--golden-max-context N] [--batches 1,4,..] [--seqs 2,8]\n"
      "                    [--isa avx2,avx512,..] [--blas-core auto|detected|NAME]");
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick")
      opt.quick = true;
    else if (a == "--json")
      opt.json = next();
    else if (a == "--threads")
      opt.threads = parse_list(next());
    else if (a == "--filter")
      opt.filter = next();
    else if (a == "--min-time")
      opt.min_time = std::atof(next());
    else if (a == "--golden-max-batch")
      opt.golden_max_batch = std::atoi(next());
    else if (a == "--long-context")
      opt.long_context = true;
    else if (a == "--golden-max-context")
      opt.golden_max_context = std::atoi(next());
    else if (a == "--batches")
      opt.batches = parse_list(next());
    else if (a == "--seqs")
      opt.seqs = parse_list(next());
    else if (a == "--isa") {
      std::stringstream ss(next());
      std::string item;
      while (std::getline(ss, item, ',')) opt.isas.push_back(item);
    } else if (a == "--blas-core")
      opt.blas_core = next();
    else if (a == "--blas-probe")
      opt.blas_probe = true;
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (opt.blas_probe) {  // a child of choose_blas_core: this process' OpenBLAS core, measured
    std::printf("%s\n", probe_line(run_blas_probe()).c_str());
    return 0;
  }
  if (opt.quick && opt.long_context) {
    std::fprintf(stderr, "--quick and --long-context are exclusive\n");
    return 2;
  }
  if (opt.quick && opt.min_time == 0.1) opt.min_time = 0.05;
  const int max_threads = *std::max_element(opt.threads.begin(), opt.threads.end());

  // TileDecode's tiers: --isa forces td::cpu::Isa through the context (every tier on the same
  // inputs against the same peer samples); default the detected one.
  const td::cpu::Isa detected_isa = td::cpu::detect_isa();
  std::vector<td::cpu::Isa> tiers;
  try {
    for (const std::string& name : opt.isas)
      tiers.push_back(td::cpu::checked_isa(td::cpu::isa_from_string("peer_compare --isa", name)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (tiers.empty()) tiers.push_back(detected_isa);
  // The tier of the main tables (JSON machine.tiledecode_isa): the detected one where it runs.
  const td::cpu::Isa primary_isa =
      std::find(tiers.begin(), tiers.end(), detected_isa) != tiers.end() ? detected_isa
                                                                         : tiers.front();

  // May re-execute this program with OPENBLAS_CORETYPE exported (before anything is printed).
  const BlasChoice blas = choose_blas_core(opt, argv);

  // The peer allocates its temporaries (up to tens of MB) at every step through ATen's CPU
  // allocator (malloc). With glibc's defaults, large blocks are mmap'ed and returned on free,
  // so every step page-faults them in again — a 2x swing in the peer's time from run to run.
  // Keep freed memory in the heap instead (what an engine gets from jemalloc/tcmalloc or
  // MALLOC_MMAP_THRESHOLD_): the peer is measured at its better. TileDecode does not allocate.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);

  const ModelConfig cfg = [&] {
    ModelConfig c = td::flash_config();
    if (opt.long_context) c.max_seq_len = 1 << 20;
    return c;
  }();
  std::string tier_names;
  for (td::cpu::Isa t : tiers)
    tier_names += (tier_names.empty() ? "" : ",") + std::string(td::cpu::to_string(t));
  std::printf(
      "peer_compare: DeepSeek-V4-flash decode kernels (max_seq_len %d), TileDecode vs ATen "
      "%s\n",
      cfg.max_seq_len, peer_version().c_str());
  std::printf("cpu: %s, %u hardware threads, TileDecode ISA %s (detected %s)\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), tier_names.c_str(),
              std::string(td::cpu::to_string(detected_isa)).c_str());
  std::printf("blas: %s\n", peer_blas_info().c_str());
  std::printf("blas core: %s (%s)\n", blas.core.c_str(), blas.how.c_str());
  for (const BlasProbe& p : blas.probes) {
    std::printf("  OPENBLAS_CORETYPE=%-15s -> core %-12s sgemm %6.1f GFLOP/s (geomean;",
                p.requested.empty() ? "(unset)" : p.requested.c_str(), p.core.c_str(), p.score);
    for (const auto& [name, g] : p.gflops) std::printf(" %s %.1f", name.c_str(), g);
    std::printf(")%s\n", !p.requested.empty() && p.core != p.requested
                             ? " [not a core of this OpenBLAS: it ran the core named]"
                             : "");
  }
  std::printf("malloc: GLIBC_TUNABLES=%s, transparent huge pages: %s\n",
              env_or("GLIBC_TUNABLES", "(unset)"), thp_mode().c_str());
  const std::string load_start = loadavg();
  std::printf("load average at start: %s\n", load_start.c_str());
  std::fflush(stdout);

  // Ceilings: the register-only loops of bench/ceilings.hpp, timed by the calling thread's CPU
  // time (median of 5; the read bandwidth at 2 threads by each reader's CPU time, the slowest
  // reader counts), which the % of ceiling uses, so that other tenants' load does not deflate
  // them; the same loops' wall-clock medians for reference (the larger of the two counts).
  // INT8: the best of the four exact s8 × s8 AVX2 mixes of ceilings.hpp (sign trick, widening,
  // pre-widened int16 vpmaddwd, wo_b tile mix), as tdbench::int8_gops(), and the vpdpbusd loops
  // the machine has (256-bit with AVX-VNNI, 512-bit with AVX-512), whatever tier runs: the
  // machine's best (tdbench::int8_machine_gops); FP32 the better of the 256- and 512-bit FMA;
  // BF16 × BF16 the better of that and vdpbf16ps (tdbench::bf16_mac_gflops).
  Ceilings wall_ce;
  wall_ce.fma_gflops = tdbench::fp32_fma_gflops();
  wall_ce.bf16_gflops = tdbench::bf16_mac_gflops();
  wall_ce.int8_gops = tdbench::int8_machine_gops();
  wall_ce.bw1 = tdbench::read_gbps(1);
  wall_ce.bw2 = max_threads >= 2 ? tdbench::read_gbps(2) : wall_ce.bw1;
  const double fma_2t = tdbench::fp32_fma_gflops_threads(2);
  const double int8_sign = tdbench::int8_mix_gops<tdbench::Int8Mix::sign, true>();
  const double int8_widen = tdbench::int8_mix_gops<tdbench::Int8Mix::widen, true>();
  const double int8_madd16 = tdbench::int8_mix_gops<tdbench::Int8Mix::madd16, true>();
  const double int8_tile = tdbench::int8_mix_gops<tdbench::Int8Mix::tile, true>();
  const double int8_vnni = tdbench::int8_machine_gops<true>();
  Ceilings ce;
  ce.fma_gflops = std::max(tdbench::fp32_fma_gflops_cpu(), wall_ce.fma_gflops);
  ce.bf16_gflops = std::max(tdbench::bf16_mac_gflops<true>(), wall_ce.bf16_gflops);
  ce.int8_gops =
      std::max({int8_sign, int8_widen, int8_madd16, int8_tile, int8_vnni, wall_ce.int8_gops});
  ce.bw1 = std::max(tdbench::read_gbps_cpu(), wall_ce.bw1);
  ce.bw2 = max_threads >= 2 ? std::max(tdbench::read_gbps_cpu_threads(2), wall_ce.bw2) : ce.bw1;
  ce.fp32_kind = tdbench::fp32_fma_kind();
  ce.bf16_kind = tdbench::bf16_mac_kind();
  ce.int8_kind = tdbench::int8_machine_kind();
  std::printf(
      "ceilings (per core): FP32 FMA %.1f GFLOP/s (%s), BF16 x BF16 %.1f GFLOP/s (%s), INT8 MAC "
      "%.1f GOP/s (%s); read bandwidth 1 core %.1f GB/s, 2 cores %.1f GB/s\n",
      ce.fma_gflops, ce.fp32_kind.c_str(), ce.bf16_gflops, ce.bf16_kind.c_str(), ce.int8_gops,
      ce.int8_kind.c_str(), ce.bw1, ce.bw2);
  std::printf(
      "  (wall-clock medians: %.1f GFLOP/s, %.1f GFLOP/s, %.1f GOP/s, %.1f GB/s, %.1f GB/s; FP32 "
      "FMA on 2 cores at once %.1f GFLOP/s)\n",
      wall_ce.fma_gflops, wall_ce.bf16_gflops, wall_ce.int8_gops, wall_ce.bw1, wall_ce.bw2, fma_2t);
  std::printf(
      "  INT8 mixes (CPU time): sign trick %.1f GOP/s, int16 vpmaddwd %.1f GOP/s, vpmovsxbw + "
      "vpmaddwd %.1f GOP/s; wo_b tile mix %.1f GOP/s; machine best %.1f GOP/s\n",
      int8_sign, int8_madd16, int8_widen, int8_tile, int8_vnni);
  std::printf(
      "times: 1 thread = median CPU time of the calling thread over interleaved samples; 2 threads "
      "= minimum wall time\n\n");

  std::printf("building weights...\n");
  std::fflush(stdout);
  const Weights w = make_weights(cfg);

  struct Point {
    int batch, seq, context;
  };
  std::vector<Point> points;
  const auto add_point = [&points](int b, int s, int c) {
    for (const Point& p : points)
      if (p.batch == b && p.seq == s && p.context == c) return;
    points.push_back({b, s, c});
  };
  // The batch sweep at 8k: decode batches 1 → 256 at S = 2 (MTP) and the reference's S = 8
  // serving tree up to B = 64 (T = B·S ≤ 512 token rows: B = 64, S = 8 is the reference's
  // per-card step; at T = 2048 the peer's attention gathers alone would take ~3 GB).
  const std::vector<int> sweep_batches{1, 4, 16, 64, 128, 256};
  if (!opt.batches.empty() || !opt.seqs.empty()) {
    const std::vector<int> bs = opt.batches.empty() ? sweep_batches : opt.batches;
    const std::vector<int> ss = opt.seqs.empty() ? std::vector<int>{2, 8} : opt.seqs;
    for (int s : ss)
      for (int b : bs)
        if (!opt.batches.empty() || b * s <= 512) add_point(b, s, 8192);
  } else if (opt.quick) {
    // A handful of points for smoke tests (~1-1.5 min on 2 vCPUs): the bars' point, a larger
    // S = 2 batch and an S = 8 one (the time-vs-batch plot gets both lines). B = 64, S = 2 in
    // their place took 3.2 min: the peer's layer step alone is ~1.3 s there.
    add_point(4, 2, 8192);
    add_point(16, 2, 8192);
    add_point(4, 8, 8192);
  } else if (opt.long_context) {
    for (int c : {1024, 4096, 16384, 65536, 262144, (1 << 20) - 2}) add_point(4, 2, c);
  } else {
    for (int c : {1024, 4096, 8192, 16384}) add_point(4, 2, c);
    for (int s : {2, 8})
      for (int b : sweep_batches)
        if (b * s <= 512) add_point(b, s, 8192);
  }
  for (const Point& p : points)
    if (p.seq < 1 || p.batch < 1 || p.context < p.seq + 4 || p.context > cfg.max_seq_len) {
      std::fprintf(stderr, "point B=%d S=%d context %d is out of range\n", p.batch, p.seq,
                   p.context);
      return 2;
    }

  td::ThreadPool pool1(1), pool2(std::max(2, max_threads));
  // One context per tier (the runners keep pointers to them: sized once, never reallocated).
  std::vector<td::cpu::Context> ctxs;
  std::vector<Ceilings> tier_ce;
  for (td::cpu::Isa t : tiers) {
    ctxs.push_back({&pool1, t});
    tier_ce.push_back(tier_ceilings(t, detected_isa, ce));
  }
  const auto defs = kernel_defs();
  const bool want_layer =
      opt.filter.empty() || std::string("layer_csa").find(opt.filter) != std::string::npos;
  std::unique_ptr<LayerModel> lm;
  if (want_layer) lm = std::make_unique<LayerModel>(cfg, &pool2);
  std::vector<Row> rows;

  std::printf("%-17s %6s %3s %2s %3s %-9s %11s %11s %11s %8s %8s %7s %-9s %8s %8s  %s\n", "kernel",
              "ctx", "B", "S", "thr", "isa", "tiledecode", "peer", "golden", "x_peer", "x_golden",
              "%ceil", "bound", "err_peer", "err_gold", "peer variant / impl");
  for (const Point& p : points) {
    Case cs = make_case(cfg, p.batch, p.context, p.seq);
    std::unique_ptr<LayerCase> lc;
    if (lm) lc = std::make_unique<LayerCase>(*lm, p.batch, p.context, max_threads, p.seq);
    Bench bench{w, cs, lm.get(), lc.get()};
    const int T = p.batch * p.seq;
    for (const KernelDef& k : defs) {
      if (!opt.filter.empty() && k.name.find(opt.filter) == std::string::npos) continue;
      if (!k.context_sweep && (p.context != 8192 || opt.long_context)) continue;
      std::vector<TdRunner> tdrs;
      for (const td::cpu::Context& c : ctxs) tdrs.push_back(k.td(bench, &c, max_threads));
      std::vector<std::pair<std::string, Runner>> peers;
      for (const auto& [name, make] : k.peers) {
        // The per-step-dequant peers convert every weight at every step; they are measured up
        // to B = 4 (the layer's only at B = 4, S = 2, 8k), where their conversion cost matters
        // most.
        if (name == "aten_dequant_per_step" && p.batch > 4) continue;
        if (k.name == "layer_csa" && name == "aten_dequant_per_step" &&
            !(p.batch == 4 && p.seq == 2 && p.context == 8192))
          continue;
        peers.emplace_back(name, make(bench));
      }
      Runner gold = p.batch <= opt.golden_max_batch ? k.golden(bench) : Runner{};
      const Cost cost = k.cost(bench);
      // Agreement on the same inputs (single thread): every tier vs the first peer variant
      // and vs golden.
      const auto use_pool1 = [&ctxs, &pool1] {
        for (td::cpu::Context& c : ctxs) c.exec = &pool1;
      };
      use_pool1();
      peer_set_threads(1, 1);
      peers.front().second.run();
      const std::vector<float> peer_out = peers.front().second.output();
      std::vector<float> g_out;
      if (gold) {
        gold.run();
        g_out = gold.output();
      }
      std::vector<double> err(tiers.size()), err_td_golden(tiers.size(), NAN);
      for (std::size_t i = 0; i < tiers.size(); ++i) {
        tdrs[i].run();
        const std::vector<float> td_out = tdrs[i].output();
        err[i] = rel_err(td_out, peer_out);
        if (gold) err_td_golden[i] = rel_err(td_out, g_out);
      }
      const double err_peer_golden = gold ? rel_err(peer_out, g_out) : NAN;

      for (int thr : opt.threads) {
        // TileDecode (every tier) and every peer variant are sampled round-robin, so a burst of
        // load from other processes on this shared machine hits all of them alike. At 2
        // threads the peer runs with ATen's pool at 2 threads and OpenBLAS at 2 or 1
        // (OpenBLAS's pthreads oversubscribe the cores when ATen calls gemm from inside its
        // own parallel region); the faster configuration counts.
        // With more than one thread every item wakes its threads before the timed call (see
        // measure_interleaved); TileDecode is also sampled without ("cold": the sleeping
        // worker's wake-up inside the timed call), reported next to it.
        std::vector<Timed> items;
        const auto use_td_pool = [&ctxs, &pool1, &pool2, thr] {
          for (td::cpu::Context& c : ctxs)
            c.exec = thr == 1 ? static_cast<td::Executor*>(&pool1) : &pool2;
        };
        std::vector<std::size_t> td_item(tiers.size()), td_cold_item(tiers.size(), 0);
        for (std::size_t i = 0; i < tiers.size(); ++i) {
          const std::string tag = "tiledecode[" + std::string(td::cpu::to_string(tiers[i])) + "]";
          td_item[i] = items.size();
          items.push_back({tag, &tdrs[i], use_td_pool,
                           thr > 1 ? std::function<void()>([&pool2] { wake_pool(pool2); })
                                   : std::function<void()>()});
          if (thr > 1) {
            td_cold_item[i] = items.size();
            items.push_back({tag + "_cold", &tdrs[i], use_td_pool, {}});
          }
        }
        const std::size_t first_peer = items.size();
        std::vector<int> blas_threads{thr};
        if (thr > 1) blas_threads.push_back(1);
        for (auto& [name, pr] : peers)
          for (int bt : blas_threads) {
            const std::string label =
                thr > 1 ? name + "[aten" + std::to_string(thr) + ",blas" + std::to_string(bt) + "]"
                        : name;
            items.push_back({label, &pr, [thr, bt] { peer_set_threads(thr, bt); },
                             thr > 1
                                 ? std::function<void()>([thr, bt] { peer_wake_threads(thr, bt); })
                                 : std::function<void()>()});
          }
        const std::vector<Stat> st = measure_interleaved(items, opt.min_time, T >= 32 ? 2 : 3, 400);
        // The peer's best variant, shared by every tier's row.
        Row peer_row;
        for (std::size_t i = first_peer; i < items.size(); ++i) {
          const double us = headline(st[i], thr);
          peer_row.peer_variants.emplace_back(items[i].name, us);
          if (!(us >= peer_row.peer_us)) {
            peer_row.peer_us = us;
            peer_row.peer_variant = items[i].name;
            peer_row.peer_stat = st[i];
          }
        }
        use_pool1();
        peer_set_threads(1, 1);
        double golden_us = NAN;
        if (gold && thr == 1 && p.context <= opt.golden_max_context)
          golden_us = measure_interleaved({{"golden", &gold, [] {}, {}}}, 0.0, 1, 1)[0].cpu_median;
        const double roof_us = roofline_s(cost, ce, thr) * 1e6;
        for (std::size_t i = 0; i < tiers.size(); ++i) {
          Row r = peer_row;
          r.kernel = k.name;
          r.td_impl = tdrs[i].impl;
          r.isa = std::string(td::cpu::to_string(tiers[i]));
          r.threads = thr;
          r.context = p.context;
          r.batch = p.batch;
          r.seq = p.seq;
          r.cost = cost;
          r.rel_err = err[i];
          r.rel_err_td_golden = err_td_golden[i];
          r.rel_err_peer_golden = err_peer_golden;
          r.golden_us = golden_us;
          r.td_stat = st[td_item[i]];
          if (thr > 1) r.td_cold_stat = st[td_cold_item[i]];
          r.td_us = headline(r.td_stat, thr);
          r.pct = 100.0 * roof_us / r.td_us;
          r.peer_pct = 100.0 * roof_us / r.peer_us;
          r.bound = bound_of(cost, ce, thr);
          r.ceiling_kind = ceiling_kind(cost, ce, thr);
          const double tier_roof_us = roofline_s(cost, tier_ce[i], thr) * 1e6;
          r.tier_pct = 100.0 * tier_roof_us / r.td_us;
          r.tier_ceiling_kind = ceiling_kind(cost, tier_ce[i], thr);
          r.reach = r.peer_us / tier_roof_us;
          std::printf(
              "%-17s %6d %3d %2d %3d %-9s %9.1fus %9.1fus %9.1fus %7.2fx %7.2fx %6.1f%% %-9s "
              "%8.1e %8.1e  %s / %s\n",
              r.kernel.c_str(), r.context, r.batch, r.seq, r.threads, r.isa.c_str(), r.td_us,
              r.peer_us, r.golden_us, r.peer_us / r.td_us, r.golden_us / r.td_us, r.pct,
              r.bound.c_str(), r.rel_err, r.rel_err_td_golden, r.peer_variant.c_str(),
              r.td_impl.c_str());
          rows.push_back(r);
        }
        std::fflush(stdout);
      }
    }
  }

  // Bars at B=4, S=2, 8k (spec of the comparison): single-thread ratio to the peer, and the
  // 1 → 2 thread scaling of TileDecode, per tier. The long-context sweep has no 8k point.
  if (!opt.long_context) {
    std::printf("\nbars at B=4, S=2, context 8k:\n");
    std::printf("%-17s %-9s %10s %6s %8s %10s %6s %6s %s\n", "kernel", "isa", "x_peer(1t)", "bar",
                "", "2t/1t", "bar", "", "2t/1t cold");
  }
  for (const td::cpu::Isa tier : tiers) {
    const std::string tier_name(td::cpu::to_string(tier));
    for (const KernelDef& k : defs) {  // prints nothing without 8k rows
      const Row* r1 = nullptr;
      const Row* r2 = nullptr;
      for (const Row& r : rows) {
        if (r.kernel != k.name || r.batch != 4 || r.seq != 2 || r.context != 8192 ||
            r.isa != tier_name)
          continue;
        if (r.threads == 1) r1 = &r;
        if (r.threads == 2) r2 = &r;
      }
      if (!r1) continue;
      double bar = 2.0;
      if (k.name == "indexer") bar = 3.0;
      if (k.name.rfind("attn_", 0) == 0) bar = 1.25;
      if (k.name == "layer_csa") bar = 3.0;
      const double x = r1->peer_us / r1->td_us;
      const bool scale_bar = k.name == "indexer" || k.name.rfind("attn_", 0) == 0;
      // As docs/performance.md (bench/report): minimum wall time at 1 thread / at 2 threads.
      const double sc = r2 ? r1->td_stat.wall_min / r2->td_stat.wall_min : NAN;
      const double sc_cold = r2 ? r1->td_stat.wall_min / r2->td_cold_stat.wall_min : NAN;
      std::printf("%-17s %-9s %9.2fx %5.2fx %8s %9.2fx %6s %6s %9.2fx\n", k.name.c_str(),
                  tier_name.c_str(), x, bar, x >= bar ? "ok" : "MISS", sc,
                  scale_bar ? "1.80x" : "-", scale_bar ? (sc >= 1.8 ? "ok" : "MISS") : "", sc_cold);
    }
  }
  // The large-batch bars of issue 19 at B = 64, 8k (S = 2: T = 128; S = 8: T = 512): the whole
  // CSA layer >= 2x the peer (1 and 2 threads), every weight-streaming projection (o-proj,
  // compressors) >= 60 % of its ceiling on one thread.
  bool printed_large = false;
  for (const Row& r : rows) {
    if (r.batch != 64 || r.context != 8192) continue;
    const bool layer = r.kernel == "layer_csa";
    const bool proj = r.kernel == "oproj" || r.kernel.rfind("compressor_", 0) == 0;
    if (!layer && !(proj && r.threads == 1)) continue;
    if (!printed_large) {
      std::printf(
          "\nlarge-batch bars at B=64, context 8k (layer: >= 2x peer; projections: >= 60 %% "
          "of ceiling, 1 thread):\n");
      printed_large = true;
    }
    const double x = r.peer_us / r.td_us;
    const bool ok = layer ? x >= 2.0 : r.pct >= 60.0;
    std::printf("%-17s S=%d thr=%d %-9s x_peer %5.2fx  %5.1f%% of ceiling (%s)  %s\n",
                r.kernel.c_str(), r.seq, r.threads, r.isa.c_str(), x, r.pct, r.ceiling_kind.c_str(),
                ok ? "ok" : "MISS");
  }

  if (!opt.json.empty()) {
    std::ofstream f(opt.json);
    f << "{\n  \"machine\": {\"cpu\": " << json_str(cpu_model())
      << ", \"hardware_threads\": " << std::thread::hardware_concurrency()
      << ", \"tiledecode_isa\": " << json_str(std::string(td::cpu::to_string(primary_isa)))
      << ", \"detected_isa\": " << json_str(std::string(td::cpu::to_string(detected_isa)))
      << ", \"isas\": [";
    for (std::size_t i = 0; i < tiers.size(); ++i)
      f << (i ? ", " : "") << json_str(std::string(td::cpu::to_string(tiers[i])));
    f << "], \"loadavg_start\": " << json_str(load_start)
      << ", \"loadavg_end\": " << json_str(loadavg()) << "},\n";
    f << "  \"peer\": {\"aten\": " << json_str(peer_version())
      << ", \"blas\": " << json_str(peer_blas_info()) << ", \"blas_core\": " << json_str(blas.core)
      << ", \"blas_core_detected\": " << json_str(blas.detected)
      << ", \"blas_core_choice\": " << json_str(blas.how) << ", \"blas_cores_measured\": [";
    for (std::size_t i = 0; i < blas.probes.size(); ++i) {
      const BlasProbe& p = blas.probes[i];
      f << (i ? ", " : "") << "{\"requested\": " << json_str(p.requested)
        << ", \"core\": " << json_str(p.core) << ", \"sgemm_gflops\": " << json_num(p.score)
        << ", \"shapes_gflops\": {";
      for (std::size_t j = 0; j < p.gflops.size(); ++j)
        f << (j ? ", " : "") << json_str(p.gflops[j].first) << ": " << json_num(p.gflops[j].second);
      f << "}}";
    }
    f << "], \"openblas_thread_timeout\": "
      << json_str(env_or("OPENBLAS_THREAD_TIMEOUT", "default"))
      << ", \"gomp_spincount\": " << json_str(env_or("GOMP_SPINCOUNT", "default"))
      << ", \"glibc_tunables\": " << json_str(env_or("GLIBC_TUNABLES", "default"))
      << ", \"thp\": " << json_str(thp_mode()) << "},\n";
    f << "  \"ceilings\": {\"fp32_fma_gflops\": " << json_num(ce.fma_gflops)
      << ", \"fp32_kind\": " << json_str(ce.fp32_kind)
      << ", \"bf16_gflops\": " << json_num(ce.bf16_gflops)
      << ", \"bf16_kind\": " << json_str(ce.bf16_kind)
      << ", \"int8_kind\": " << json_str(ce.int8_kind)
      << ", \"int8_gops\": " << json_num(ce.int8_gops) << ", \"read_gbps_1\": " << json_num(ce.bw1)
      << ", \"read_gbps_2\": " << json_num(ce.bw2)
      << ", \"wall_clock\": {\"fp32_fma_gflops\": " << json_num(wall_ce.fma_gflops)
      << ", \"bf16_gflops\": " << json_num(wall_ce.bf16_gflops)
      << ", \"int8_gops\": " << json_num(wall_ce.int8_gops)
      << ", \"read_gbps_1\": " << json_num(wall_ce.bw1)
      << ", \"read_gbps_2\": " << json_num(wall_ce.bw2)
      << ", \"fp32_fma_gflops_2t\": " << json_num(fma_2t)
      << "}, \"int8_mixes_cpu\": {\"sign_trick\": " << json_num(int8_sign)
      << ", \"widen_madd\": " << json_num(int8_madd16)
      << ", \"widen_cvt_madd\": " << json_num(int8_widen)
      << ", \"tile_mix\": " << json_num(int8_tile) << "}, \"tiers\": {";
    for (std::size_t i = 0; i < tiers.size(); ++i)
      f << (i ? ", " : "") << json_str(std::string(td::cpu::to_string(tiers[i])))
        << ": {\"fp32_fma_gflops\": " << json_num(tier_ce[i].fma_gflops)
        << ", \"fp32_kind\": " << json_str(tier_ce[i].fp32_kind)
        << ", \"bf16_gflops\": " << json_num(tier_ce[i].bf16_gflops)
        << ", \"bf16_kind\": " << json_str(tier_ce[i].bf16_kind)
        << ", \"int8_gops\": " << json_num(tier_ce[i].int8_gops)
        << ", \"int8_kind\": " << json_str(tier_ce[i].int8_kind) << "}";
    f << "}},\n";
    f << "  \"timing\": "
      << json_str(
             "1 thread: median CPU time of the calling thread over interleaved samples; 2 threads: "
             "minimum wall time over interleaved samples, each started with the sampled side's "
             "worker threads woken (untimed) after the pause; TileDecode also sampled without that "
             "wake (tiledecode_cold_*)")
      << ",\n";
    f << "  \"min_time_s\": " << json_num(opt.min_time) << ",\n";
    f << "  \"sweep\": " << json_str(opt.long_context ? "long_context" : "base") << ",\n";
    f << "  \"max_seq_len\": " << cfg.max_seq_len << ",\n";
    f << "  \"golden_max_batch\": " << opt.golden_max_batch << ",\n";
    f << "  \"quick\": " << (opt.quick ? "true" : "false") << ",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << "    {\"kernel\": " << json_str(r.kernel) << ", \"threads\": " << r.threads
        << ", \"context\": " << r.context << ", \"batch\": " << r.batch << ", \"seq\": " << r.seq
        << ", \"isa\": " << json_str(r.isa) << ", \"tiledecode_us\": " << json_num(r.td_us)
        << ", \"peer_us\": " << json_num(r.peer_us)
        << ", \"ratio_vs_peer\": " << json_num(r.peer_us / r.td_us)
        << ", \"tiledecode_wall_median_us\": " << json_num(r.td_stat.wall_median)
        << ", \"tiledecode_wall_min_us\": " << json_num(r.td_stat.wall_min)
        << ", \"tiledecode_cpu_median_us\": " << json_num(r.td_stat.cpu_median)
        << ", \"tiledecode_cold_wall_min_us\": " << json_num(r.td_cold_stat.wall_min)
        << ", \"tiledecode_cold_wall_median_us\": " << json_num(r.td_cold_stat.wall_median)
        << ", \"peer_wall_median_us\": " << json_num(r.peer_stat.wall_median)
        << ", \"peer_wall_min_us\": " << json_num(r.peer_stat.wall_min)
        << ", \"peer_cpu_median_us\": " << json_num(r.peer_stat.cpu_median)
        << ", \"tiledecode_process_cpu_median_us\": " << json_num(r.td_stat.proc_cpu_median)
        << ", \"peer_process_cpu_median_us\": " << json_num(r.peer_stat.proc_cpu_median)
        << ", \"pct_of_ceiling\": " << json_num(r.pct)
        << ", \"peer_pct_of_ceiling\": " << json_num(r.peer_pct)
        << ", \"ceiling_kind\": " << json_str(r.ceiling_kind)
        << ", \"pct_of_tier_ceiling\": " << json_num(r.tier_pct)
        << ", \"tier_ceiling_kind\": " << json_str(r.tier_ceiling_kind)
        << ", \"reach_vs_peer\": " << json_num(r.reach) << ", \"bound\": " << json_str(r.bound)
        << ", \"golden_us\": " << json_num(r.golden_us)
        << ", \"ratio_vs_golden\": " << json_num(r.golden_us / r.td_us)
        << ", \"rel_err_vs_peer\": " << json_num(r.rel_err)
        << ", \"rel_err_tiledecode_vs_golden\": " << json_num(r.rel_err_td_golden)
        << ", \"rel_err_peer_vs_golden\": " << json_num(r.rel_err_peer_golden)
        << ", \"tiledecode_impl\": " << json_str(r.td_impl)
        << ", \"peer_variant\": " << json_str(r.peer_variant) << ", \"peer_variants_us\": {";
      for (std::size_t j = 0; j < r.peer_variants.size(); ++j)
        f << (j ? ", " : "") << json_str(r.peer_variants[j].first) << ": "
          << json_num(r.peer_variants[j].second);
      f << "}, \"fp32_flop\": " << json_num(r.cost.fp32)
        << ", \"bf16_flop\": " << json_num(r.cost.bf16)
        << ", \"int8_op\": " << json_num(r.cost.int8) << ", \"bytes\": " << json_num(r.cost.bytes)
        << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
    std::printf("\nwrote %s (%zu rows)\n", opt.json.c_str(), rows.size());
  }
  return 0;
}
