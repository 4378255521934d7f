// peer_compare: TileDecode against an ATen/OpenBLAS peer and the golden references, on the same
// inputs, in one process, next to this machine's ceilings measured in the same run.
//
//   peer_compare [--quick | --long-context] [--json FILE] [--threads 1,2] [--filter SUBSTR]
//                [--min-time SEC] [--golden-max-batch N] [--golden-max-context N]
//
// Points: B=4, S=2 at context 1k, 4k, 8k, 16k, and batch 1..64 at 8k (--quick: B=4 at 8k), on
// the flash preset (max_seq_len 16384).
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
// time (max of compute time at the FP32-FMA + INT8 ceilings and streamed bytes at the measured
// read bandwidth, ceilings × threads; a layer sums its kernels' rooflines) / measured time.

#include <malloc.h>
#include <algorithm>
#include <atomic>
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
};

struct Ceilings {
  double fma_gflops = 0, int8_gops = 0, bw1 = 0, bw2 = 0;
  double bw(int threads) const { return threads >= 2 ? bw2 : bw1; }
};

// Work of one kernel step: FP32 FLOP, INT8 OP (2 per multiply-add), bytes that must stream.
// A composite step (the layer) lists its kernels in `parts`: its roofline is the sum of theirs.
struct Cost {
  double fp32 = 0, int8 = 0, bytes = 0;
  std::vector<Cost> parts;
  Cost& operator+=(const Cost& o) {
    fp32 += o.fp32, int8 += o.int8, bytes += o.bytes;
    parts.push_back(o);
    return *this;
  }
};

double roofline_s(const Cost& c, const Ceilings& ce, int threads) {
  if (!c.parts.empty()) {
    double t = 0;
    for (const Cost& p : c.parts) t += roofline_s(p, ce, threads);
    return t;
  }
  double compute = 0;
  if (ce.fma_gflops > 0) compute += c.fp32 / (ce.fma_gflops * 1e9 * threads);
  if (ce.int8_gops > 0) compute += c.int8 / (ce.int8_gops * 1e9 * threads);
  const double mem = ce.bw(threads) > 0 ? c.bytes / (ce.bw(threads) * 1e9) : 0;
  return std::max(compute, mem);
}
const char* bound_of(const Cost& c, const Ceilings& ce, int threads) {
  if (!c.parts.empty()) return "mixed";
  double compute = 0;
  if (ce.fma_gflops > 0) compute += c.fp32 / (ce.fma_gflops * 1e9 * threads);
  if (ce.int8_gops > 0) compute += c.int8 / (ce.int8_gops * 1e9 * threads);
  const double mem = ce.bw(threads) > 0 ? c.bytes / (ce.bw(threads) * 1e9) : 0;
  if (mem > compute) return "bandwidth";
  return c.int8 > c.fp32 ? "int8" : "fp32";
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
  c.fp32 = 2 * T * G * R * K;
  c.int8 = 2 * T * D * G * R;
  c.bytes = G * R * K * 2 + D * G * R + T * (G * K * 2 + D * 2);
  return c;
}

Cost compressor_cost(const Weights& w, const Case& cs, int which) {
  const auto& cfg = w.cfg;
  const CompressorWeights& cw = which == 4 ? w.c4 : (which == 128 ? w.c128 : w.inner);
  const double T = cs.tokens(), OUT = cw.out_dim, D = cfg.hidden;
  Cost c;
  c.fp32 = 4 * T * OUT * D;
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
  qkv.fp32 = 2 * T * D * QL + 2 * T * D * HD;
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
  int threads = 1, context = 0, batch = 0;
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

void usage() {
  std::puts(
      "usage: peer_compare [--quick | --long-context] [--json FILE] [--threads 1,2]\n"
      "                    [--filter SUBSTR] [--min-time SEC] [--golden-max-batch N]\n"
      "                    [--golden-max-context N]");
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
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (opt.quick && opt.long_context) {
    std::fprintf(stderr, "--quick and --long-context are exclusive\n");
    return 2;
  }
  if (opt.quick && opt.min_time == 0.1) opt.min_time = 0.05;
  const int max_threads = *std::max_element(opt.threads.begin(), opt.threads.end());

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
  const td::cpu::Isa isa = td::cpu::detect_isa();
  std::printf(
      "peer_compare: DeepSeek-V4-flash decode kernels (max_seq_len %d), TileDecode vs ATen "
      "%s\n",
      cfg.max_seq_len, peer_version().c_str());
  std::printf("cpu: %s, %u hardware threads, TileDecode ISA %s\n", cpu_model().c_str(),
              std::thread::hardware_concurrency(), std::string(td::cpu::to_string(isa)).c_str());
  std::printf("blas: %s\n", peer_blas_info().c_str());
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
  // machine's best (tdbench::int8_machine_gops); FP32 the better of the 256- and 512-bit FMA.
  Ceilings wall_ce;
  wall_ce.fma_gflops = tdbench::fp32_fma_gflops();
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
  ce.int8_gops =
      std::max({int8_sign, int8_widen, int8_madd16, int8_tile, int8_vnni, wall_ce.int8_gops});
  ce.bw1 = std::max(tdbench::read_gbps_cpu(), wall_ce.bw1);
  ce.bw2 = max_threads >= 2 ? std::max(tdbench::read_gbps_cpu_threads(2), wall_ce.bw2) : ce.bw1;
  std::printf(
      "ceilings (per core): FP32 FMA %.1f GFLOP/s, INT8 MAC %.1f GOP/s; read bandwidth 1 core %.1f "
      "GB/s, 2 cores %.1f GB/s\n",
      ce.fma_gflops, ce.int8_gops, ce.bw1, ce.bw2);
  std::printf(
      "  (wall-clock medians: %.1f GFLOP/s, %.1f GOP/s, %.1f GB/s, %.1f GB/s; FP32 FMA on 2 cores "
      "at once %.1f GFLOP/s)\n",
      wall_ce.fma_gflops, wall_ce.int8_gops, wall_ce.bw1, wall_ce.bw2, fma_2t);
  std::printf(
      "  INT8 mixes (CPU time): sign trick %.1f GOP/s, int16 vpmaddwd %.1f GOP/s, vpmovsxbw + "
      "vpmaddwd %.1f GOP/s; wo_b tile mix %.1f GOP/s; vpdpbusd %.1f GOP/s (0: no VNNI tier); "
      "the ceiling is the best (FP32: %s, INT8: %s)\n",
      int8_sign, int8_madd16, int8_widen, int8_tile, int8_vnni, tdbench::fp32_fma_kind(),
      tdbench::int8_machine_kind());
  std::printf(
      "times: 1 thread = median CPU time of the calling thread over interleaved samples; 2 threads "
      "= minimum wall time\n\n");

  std::printf("building weights...\n");
  std::fflush(stdout);
  const Weights w = make_weights(cfg);

  struct Point {
    int batch, context;
  };
  std::vector<Point> points;
  if (opt.quick) {
    points = {{4, 8192}};
  } else if (opt.long_context) {
    for (int c : {1024, 4096, 16384, 65536, 262144, (1 << 20) - 2}) points.push_back({4, c});
  } else {
    for (int c : {1024, 4096, 8192, 16384}) points.push_back({4, c});
    for (int b : {1, 2, 8, 16, 32, 64}) points.push_back({b, 8192});
  }

  td::ThreadPool pool1(1), pool2(std::max(2, max_threads));
  td::cpu::Context ctx{&pool1, isa};
  const auto defs = kernel_defs();
  const bool want_layer =
      opt.filter.empty() || std::string("layer_csa").find(opt.filter) != std::string::npos;
  std::unique_ptr<LayerModel> lm;
  if (want_layer) lm = std::make_unique<LayerModel>(cfg, &pool2);
  std::vector<Row> rows;

  std::printf("%-17s %6s %3s %3s %11s %11s %11s %8s %8s %7s %-9s %8s %8s  %s\n", "kernel", "ctx",
              "B", "thr", "tiledecode", "peer", "golden", "x_peer", "x_golden", "%ceil", "bound",
              "err_peer", "err_gold", "peer variant / impl");
  for (const Point& p : points) {
    Case cs = make_case(cfg, p.batch, p.context);
    std::unique_ptr<LayerCase> lc;
    if (lm) lc = std::make_unique<LayerCase>(*lm, p.batch, p.context, max_threads);
    Bench bench{w, cs, lm.get(), lc.get()};
    for (const KernelDef& k : defs) {
      if (!opt.filter.empty() && k.name.find(opt.filter) == std::string::npos) continue;
      if (!k.context_sweep && (p.context != 8192 || opt.long_context)) continue;
      TdRunner tdr = k.td(bench, &ctx, max_threads);
      std::vector<std::pair<std::string, Runner>> peers;
      for (const auto& [name, make] : k.peers) {
        // The per-step-dequant peers convert every weight at every step; they are measured up
        // to B = 4 (the layer's only at B = 4, 8k), where their conversion cost matters most.
        if (name == "aten_dequant_per_step" && p.batch > 4) continue;
        if (k.name == "layer_csa" && name == "aten_dequant_per_step" &&
            !(p.batch == 4 && p.context == 8192))
          continue;
        peers.emplace_back(name, make(bench));
      }
      Runner gold = p.batch <= opt.golden_max_batch ? k.golden(bench) : Runner{};
      const Cost cost = k.cost(bench);
      // Agreement on the same inputs (single thread): TileDecode vs the first peer variant.
      ctx.exec = &pool1;
      peer_set_threads(1, 1);
      tdr.run();
      const std::vector<float> td_out = tdr.output();
      peers.front().second.run();
      const std::vector<float> peer_out = peers.front().second.output();
      const double err = rel_err(td_out, peer_out);
      double err_td_golden = NAN, err_peer_golden = NAN;
      if (gold) {
        gold.run();
        const std::vector<float> g_out = gold.output();
        err_td_golden = rel_err(td_out, g_out);
        err_peer_golden = rel_err(peer_out, g_out);
      }

      for (int thr : opt.threads) {
        Row r;
        r.kernel = k.name;
        r.td_impl = tdr.impl;
        r.threads = thr;
        r.context = p.context;
        r.batch = p.batch;
        r.cost = cost;
        r.rel_err = err;
        r.rel_err_td_golden = err_td_golden;
        r.rel_err_peer_golden = err_peer_golden;
        // TileDecode and every peer variant are sampled round-robin, so a burst of load from
        // other processes on this shared machine hits all of them alike. At 2 threads the peer
        // runs with ATen's pool at 2 threads and OpenBLAS at 2 or 1 (OpenBLAS's pthreads
        // oversubscribe the cores when ATen calls gemm from inside its own parallel region);
        // the faster configuration counts.
        // With more than one thread every item wakes its threads before the timed call (see
        // measure_interleaved); TileDecode is also sampled without (item 1, "cold": the
        // sleeping worker's wake-up inside the timed call), reported next to it.
        std::vector<Timed> items;
        const auto use_td_pool = [&ctx, &pool1, &pool2, thr] {
          ctx.exec = thr == 1 ? static_cast<td::Executor*>(&pool1) : &pool2;
        };
        items.push_back({"tiledecode", &tdr, use_td_pool,
                         thr > 1 ? std::function<void()>([&pool2] { wake_pool(pool2); })
                                 : std::function<void()>()});
        if (thr > 1) items.push_back({"tiledecode_cold", &tdr, use_td_pool, {}});
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
        const std::vector<Stat> st =
            measure_interleaved(items, opt.min_time, p.batch >= 16 ? 2 : 3, 400);
        r.td_stat = st[0];
        if (thr > 1) r.td_cold_stat = st[1];
        r.td_us = headline(st[0], thr);
        for (std::size_t i = first_peer; i < items.size(); ++i) {
          const double us = headline(st[i], thr);
          r.peer_variants.emplace_back(items[i].name, us);
          if (!(us >= r.peer_us)) {
            r.peer_us = us;
            r.peer_variant = items[i].name;
            r.peer_stat = st[i];
          }
        }
        ctx.exec = &pool1;
        peer_set_threads(1, 1);
        if (gold && thr == 1 && p.context <= opt.golden_max_context)
          r.golden_us =
              measure_interleaved({{"golden", &gold, [] {}, {}}}, 0.0, 1, 1)[0].cpu_median;
        const double roof_us = roofline_s(cost, ce, thr) * 1e6;
        r.pct = 100.0 * roof_us / r.td_us;
        r.peer_pct = 100.0 * roof_us / r.peer_us;
        r.bound = bound_of(cost, ce, thr);
        std::printf(
            "%-17s %6d %3d %3d %9.1fus %9.1fus %9.1fus %7.2fx %7.2fx %6.1f%% %-9s %8.1e %8.1e  %s "
            "/ %s\n",
            r.kernel.c_str(), r.context, r.batch, r.threads, r.td_us, r.peer_us, r.golden_us,
            r.peer_us / r.td_us, r.golden_us / r.td_us, r.pct, r.bound.c_str(), r.rel_err,
            r.rel_err_td_golden, r.peer_variant.c_str(), r.td_impl.c_str());
        std::fflush(stdout);
        rows.push_back(r);
      }
    }
  }

  // Bars at B=4, S=2, 8k (spec of the comparison): single-thread ratio to the peer, and the
  // 1 → 2 thread scaling of TileDecode. The long-context sweep has no 8k point.
  if (!opt.long_context) {
    std::printf("\nbars at B=4, S=2, context 8k:\n");
    std::printf("%-17s %10s %6s %8s %10s %6s %6s %s\n", "kernel", "x_peer(1t)", "bar", "", "2t/1t",
                "bar", "", "2t/1t cold");
  }
  for (const KernelDef& k : defs) {  // prints nothing without 8k rows
    const Row* r1 = nullptr;
    const Row* r2 = nullptr;
    for (const Row& r : rows) {
      if (r.kernel != k.name || r.batch != 4 || r.context != 8192) continue;
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
    std::printf("%-17s %9.2fx %5.2fx %8s %9.2fx %6s %6s %9.2fx\n", k.name.c_str(), x, bar,
                x >= bar ? "ok" : "MISS", sc, scale_bar ? "1.80x" : "-",
                scale_bar ? (sc >= 1.8 ? "ok" : "MISS") : "", sc_cold);
  }

  if (!opt.json.empty()) {
    std::ofstream f(opt.json);
    f << "{\n  \"machine\": {\"cpu\": " << json_str(cpu_model())
      << ", \"hardware_threads\": " << std::thread::hardware_concurrency()
      << ", \"tiledecode_isa\": " << json_str(std::string(td::cpu::to_string(isa)))
      << ", \"loadavg_start\": " << json_str(load_start)
      << ", \"loadavg_end\": " << json_str(loadavg()) << "},\n";
    f << "  \"peer\": {\"aten\": " << json_str(peer_version())
      << ", \"blas\": " << json_str(peer_blas_info())
      << ", \"openblas_thread_timeout\": " << json_str(env_or("OPENBLAS_THREAD_TIMEOUT", "default"))
      << ", \"gomp_spincount\": " << json_str(env_or("GOMP_SPINCOUNT", "default"))
      << ", \"glibc_tunables\": " << json_str(env_or("GLIBC_TUNABLES", "default"))
      << ", \"thp\": " << json_str(thp_mode()) << "},\n";
    f << "  \"ceilings\": {\"fp32_fma_gflops\": " << json_num(ce.fma_gflops)
      << ", \"fp32_kind\": " << json_str(tdbench::fp32_fma_kind())
      << ", \"int8_kind\": " << json_str(tdbench::int8_machine_kind())
      << ", \"int8_gops\": " << json_num(ce.int8_gops) << ", \"read_gbps_1\": " << json_num(ce.bw1)
      << ", \"read_gbps_2\": " << json_num(ce.bw2)
      << ", \"wall_clock\": {\"fp32_fma_gflops\": " << json_num(wall_ce.fma_gflops)
      << ", \"int8_gops\": " << json_num(wall_ce.int8_gops)
      << ", \"read_gbps_1\": " << json_num(wall_ce.bw1)
      << ", \"read_gbps_2\": " << json_num(wall_ce.bw2)
      << ", \"fp32_fma_gflops_2t\": " << json_num(fma_2t)
      << "}, \"int8_mixes_cpu\": {\"sign_trick\": " << json_num(int8_sign)
      << ", \"widen_madd\": " << json_num(int8_madd16)
      << ", \"widen_cvt_madd\": " << json_num(int8_widen)
      << ", \"tile_mix\": " << json_num(int8_tile) << "}},\n";
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
    f << "  \"quick\": " << (opt.quick ? "true" : "false") << ",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << "    {\"kernel\": " << json_str(r.kernel) << ", \"threads\": " << r.threads
        << ", \"context\": " << r.context << ", \"batch\": " << r.batch
        << ", \"tiledecode_us\": " << json_num(r.td_us) << ", \"peer_us\": " << json_num(r.peer_us)
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
        << ", \"bound\": " << json_str(r.bound) << ", \"golden_us\": " << json_num(r.golden_us)
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
        << ", \"int8_op\": " << json_num(r.cost.int8) << ", \"bytes\": " << json_num(r.cost.bytes)
        << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
    std::printf("\nwrote %s (%zu rows)\n", opt.json.c_str(), rows.size());
  }
  return 0;
}
