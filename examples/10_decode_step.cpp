// decode_step — the main example: a DeepSeek-V4 attention stack running real decode steps.
//
// Builds the first N layers of the flash (or pro) schedule with synthetic weights at the spec's
// statistics (fixed seed), fills every layer's paged pools with a history of --context tokens for
// --batch requests, and runs --steps MTP decode steps (S = --seq tokens per request, default 2;
// commit_tokens = 1: each step processes the committed token and S - 1 draft tokens, and commits
// one token per request). The metadata bundle is built once per step and shared by every layer;
// each layer's x_out feeds the next layer's x_hc (no MoE between them here).
//
//   decode_step [--layers 4] [--preset flash|pro] [--context 8192] [--batch 4] [--steps 16]
//               [--seq 2] [--threads N] [--isa scalar|avx2|avx2_vnni|avx512] [--seed S] [--check]
//               [--dump DIR] [--dump-weights] [--backend cpu|a2a3] [--trace FILE]
//               [--bf16-dot automatic|fma|dpbf16|exact] [--compressor-check]
//
// --backend cpu (default): prints a per-kernel wall-time table, tokens/s and peak memory.
// --bf16-dot exact sums the long BF16 dots (compressor, q/kv and wo_a projections) in double, so
// every BF16 / INT8 rounding after them rounds as golden's (cpu::Bf16Dot, issue 17); automatic
// (default) takes the faster kernels of this CPU. --compressor-check turns on the compressors'
// opt-in rounding check (LayerWeightsStorage::enable_compressor_rounding_check: every emitted
// compressor row rounds as golden's from the step's inputs; CPU backend).
// --backend a2a3: the SAME decode loop runs on the Ascend a2a3 execution model (backend/a2a3/):
// every kernel of every layer is its tile program executed on the model's cores, so x_out, the
// pools and every intermediate are the model's results; the table shows each kernel's PREDICTED
// latency per step, the last step's per-kernel launch and pipe figures, and the output ends with
// `predicted_step_us=<number>`. --trace FILE writes the last step's timeline (Chrome trace).
//
// With --check (either backend) the last step of every layer is re-run by the golden layer on the
// same inputs and pools (per-layer error, not compounded); the output ends with
// `max_rel_err=<number>` (max over layers of max|x_out - golden| / max|golden|) and the exit code
// is 3 when a layer fails the spec's comparator. --dump DIR writes the inputs and outputs of the
// last step of the first SWA, CSA and HCA layer and of every kernel inside them as .npy files plus
// DIR/manifest.json.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/trace.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/golden/decode_layer.hpp"
#include "tiledecode/io/npy.hpp"

namespace td = tiledecode;
using td::index_t;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  int layers = 4;
  std::string preset = "flash";
  int context = 8192;
  int batch = 4;
  int steps = 16;
  int threads = 0;
  std::string isa;
  std::string bf16_dot;
  std::uint64_t seed = 20240601;
  bool check = false;
  std::string dump;
  bool dump_weights = false;
  std::string backend = "cpu";
  int seq = 2;
  std::string trace;
  bool compressor_check = false;
};

[[noreturn]] void usage(int code) {
  std::printf(
      "usage: decode_step [--layers N] [--preset flash|pro] [--context C] [--batch B] [--steps N]\n"
      "                   [--threads N] [--isa scalar|avx2|avx2_vnni|avx512] [--seed S] [--check] "
      "[--dump "
      "DIR]\n"
      "                   [--dump-weights] [--backend cpu|a2a3] [--seq S] [--trace FILE]\n"
      "                   [--bf16-dot automatic|fma|dpbf16|exact] [--compressor-check]\n");
  std::exit(code);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "decode_step: %s needs a value\n", a.c_str());
        usage(2);
      }
      return argv[++i];
    };
    auto next_int = [&]() {
      const std::string v = next();
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end) {
        std::fprintf(stderr, "decode_step: %s expects an integer, got '%s'\n", a.c_str(),
                     v.c_str());
        usage(2);
      }
      return int(x);
    };
    if (a == "--layers")
      o.layers = next_int();
    else if (a == "--preset")
      o.preset = next();
    else if (a == "--context")
      o.context = next_int();
    else if (a == "--batch")
      o.batch = next_int();
    else if (a == "--steps")
      o.steps = next_int();
    else if (a == "--threads")
      o.threads = next_int();
    else if (a == "--isa")
      o.isa = next();
    else if (a == "--bf16-dot")
      o.bf16_dot = next();
    else if (a == "--seed")
      o.seed = std::uint64_t(std::strtoull(next().c_str(), nullptr, 10));
    else if (a == "--check")
      o.check = true;
    else if (a == "--dump")
      o.dump = next();
    else if (a == "--dump-weights")
      o.dump_weights = true;
    else if (a == "--backend")
      o.backend = next();
    else if (a == "--seq")
      o.seq = next_int();
    else if (a == "--trace")
      o.trace = next();
    else if (a == "--compressor-check")
      o.compressor_check = true;
    else if (a == "--help" || a == "-h")
      usage(0);
    else {
      std::fprintf(stderr, "decode_step: unknown argument '%s'\n", a.c_str());
      usage(2);
    }
  }
  return o;
}

double peak_rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  }
  return 0.0;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- --dump: .npy files + manifest.json ------------------------------------------------------
class Dumper {
 public:
  explicit Dumper(std::string dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
  }

  template <class T, std::size_t R>
  void add(const std::string& sub, const std::string& name, td::View<T, R> v, int layer,
           std::string_view kind, const std::string& kernel, const std::string& role,
           const std::string& meaning) {
    std::filesystem::create_directories(dir_ + "/" + sub);
    const std::string file = sub + "/" + name + ".npy";
    td::io::write_npy(dir_ + "/" + file, td::ConstView<std::remove_const_t<T>, R>(v));
    std::string shape = "[";
    for (std::size_t d = 0; d < R; ++d) shape += (d ? ", " : "") + std::to_string(v.extent(d));
    shape += "]";
    entries_.push_back("    {\"name\": \"" + name + "\", \"file\": \"" + file + "\", \"shape\": " +
                       shape + ", \"dtype\": \"" + std::string(td::io::dtype_name<T>()) +
                       "\", \"layer\": " + std::to_string(layer) + ", \"kind\": \"" +
                       std::string(kind) + "\", \"kernel\": \"" + kernel + "\", \"role\": \"" +
                       role + "\", \"meaning\": \"" + meaning + "\"}");
    bytes_ += std::size_t(v.size()) * sizeof(T);
  }

  void finish(const std::string& header) {
    std::ofstream f(dir_ + "/manifest.json");
    f << "{\n" << header << "  \"tensors\": [\n";
    for (std::size_t i = 0; i < entries_.size(); ++i)
      f << entries_[i] << (i + 1 < entries_.size() ? ",\n" : "\n");
    f << "  ]\n}\n";
  }
  std::size_t files() const { return entries_.size(); }
  std::size_t bytes() const { return bytes_; }

 private:
  std::string dir_;
  std::vector<std::string> entries_;
  std::size_t bytes_ = 0;
};

template <class T, std::size_t R>
td::View<T, R> mut(td::ConstView<T, R> v) {
  return td::View<T, R>(const_cast<T*>(v.data()), v.shape(), v.strides());
}

void dump_layer(Dumper& d, int l, const td::decode::LayerWeights& w,
                td::decode::LayerCacheStorage& before, td::decode::LayerCacheStorage& after,
                const td::paged::StepMetadata& md, td::decode::StepViews& v,
                td::ConstView<float, 3> x_hc, td::ConstView<float, 3> x_out,
                const td::RopeTable& rope, bool weights) {
  const td::LayerKind k = w.kind;
  const auto kind = td::to_string(k);
  char sub[32];
  std::snprintf(sub, sizeof sub, "L%02d_%s", l, std::string(kind).c_str());
  const std::string s = sub;
  const bool swa = k == td::LayerKind::swa, csa = k == td::LayerKind::csa;
  auto add = [&](const std::string& name, auto view, const std::string& kernel,
                 const std::string& role, const std::string& meaning) {
    d.add(s, name, view, l, kind, kernel, role, meaning);
  };
  // metadata (spec §3.7)
  add("position_ids", mut(md.position_ids()), "metadata", "input",
      "absolute position of token t = b*S + s");
  add("kv_seq_lens", mut(md.kv_seq_lens()), "metadata", "input",
      "committed length per request (start + commit_tokens)");
  add("block_table", mut(md.tables().block_table), "metadata", "input",
      "ori KV block table [B, 128], page 128");
  add(swa ? "swa_slot_mapping" : "ori_slot_mapping", mut(md.ori_slot_mapping()), "metadata",
      "input", "kv_cache row written by each token (-1 = skip)");
  add(swa ? "swa_indices" : "window_swa_indices", mut(md.window_indices()), "metadata", "input",
      "physical kv_cache rows of each token's window, oldest to newest, -1 padded");
  add(swa ? "swa_lens" : "window_swa_lens", mut(md.window_lens()), "metadata", "input",
      "valid window length per token");
  add("freqs_cos", mut(rope.view().cos), "qkv_proj_rope", "input",
      "the layer's RoPE cos table [MAX_SEQ_LEN, 64]");
  add("freqs_sin", mut(rope.view().sin), "qkv_proj_rope", "input",
      "the layer's RoPE sin table [MAX_SEQ_LEN, 64]");
  if (!swa) {
    add("cmp_block_table", mut(md.tables().cmp_block_table), "metadata", "input",
        "compressed KV block table, page 128");
    add(csa ? "csa_cmp_slot_mapping" : "hca_cmp_slot_mapping",
        mut(csa ? md.csa_cmp_slot_mapping() : md.hca_cmp_slot_mapping()), "metadata", "input",
        "cmp_kv row emitted by a committed window boundary (-1 = none)");
    add(csa ? "csa_state_slot_mapping" : "hca_state_slot_mapping",
        mut(csa ? md.csa_state_slot_mapping() : md.hca_state_slot_mapping()), "metadata", "input",
        "compressor state row of each token");
    add(csa ? "csa_state_table" : "hca_state_table",
        mut(csa ? md.tables().csa_state_table : md.tables().hca_state_table), "metadata", "input",
        "compressor state block table (page 4 / 8)");
  }
  if (csa) {
    add("csa_idx_slot_mapping", mut(md.csa_idx_slot_mapping()), "metadata", "input",
        "index cache row emitted per token (-1 = none)");
    add("csa_inner_state_slot_mapping", mut(md.csa_inner_state_slot_mapping()), "metadata", "input",
        "indexer compressor state row of each token");
    add("csa_inner_state_table", mut(md.tables().csa_inner_state_table), "metadata", "input",
        "indexer compressor state block table");
    add("idx_block_table", mut(md.tables().idx_block_table), "metadata", "input",
        "index cache block table, page 128");
  }
  // hc_pre, rmsnorm, qkv
  add("x_hc", mut(x_hc), "hc_pre", "input", "layer input: hyper-connection stack [T, 4, D] FP32");
  add("x_mixed", v.x_mixed, "hc_pre", "output", "mixed hidden row (BF16)");
  add("post", v.post, "hc_pre", "output", "hc_post gate per output stream");
  add("comb", v.comb, "hc_pre", "output", "Sinkhorn-normalised combine [t, i, o]");
  add("x_n", v.x_n, "rmsnorm", "output",
      "attention-RMSNorm output (input of qkv, compressors, indexer)");
  add("q", v.q, "qkv_proj_rope", "output",
      "query heads after per-head RMSNorm and RoPE [T, H, 512]");
  add("kv", v.kv, "qkv_proj_rope", "output",
      "new KV row per token after RMSNorm and RoPE [T, 512]");
  add("qr", v.qr, "qkv_proj_rope", "output", "INT8 q-latent Q8(cq)");
  add("qr_scale", v.qr_scale, "qkv_proj_rope", "output", "dequant scale of qr per token");
  add("kv_cache.before", before.kv_cache.view(), "kv_cache_write", "state_before",
      "ori KV pool [blocks*128, 512] before the step");
  add("kv_cache.after", after.kv_cache.view(), "kv_cache_write", "state_after",
      "ori KV pool after the write (input of sparse_attn)");
  if (!swa) {
    add("compress_state.before", before.state.view(), "compressor", "state_before",
        "compressor state pool [rows, 2*OUT_DIM] = [kv | score]");
    add("compress_state.after", after.state.view(), "compressor", "state_after",
        "compressor state pool after the step");
    add("cmp_kv.before", before.cmp_kv.view(), "compressor", "state_before",
        "compressed KV pool [blocks*128, 512]");
    add("cmp_kv.after", after.cmp_kv.view(), "compressor", "state_after",
        "compressed KV pool after the step (input of sparse_attn)");
    add("compressor_kv_out", v.cmp_kv_out, "compressor", "output",
        "FP32 emitted compressed row per request (zero if none)");
  }
  if (csa) {
    add("idx_compress_state.before", before.inner_state.view(), "indexer_compressor",
        "state_before", "indexer compressor state pool [rows, 512]");
    add("idx_compress_state.after", after.inner_state.view(), "indexer_compressor", "state_after",
        "indexer compressor state pool after the step");
    add("idx_kv_cache.before", before.idx_kv_cache.view(), "indexer_compressor", "state_before",
        "INT8 index cache [blocks*128, 128]");
    add("idx_kv_cache.after", after.idx_kv_cache.view(), "indexer_compressor", "state_after",
        "INT8 index cache after the step (input of indexer score)");
    add("idx_kv_scale.before", before.idx_kv_scale.view(), "indexer_compressor", "state_before",
        "index cache dequant scale per row");
    add("idx_kv_scale.after", after.idx_kv_scale.view(), "indexer_compressor", "state_after",
        "index cache dequant scale after the step");
    add("idx_kv_out", v.idx_kv_out, "indexer_compressor", "output",
        "FP32 emitted inner row before Hadamard (zero if none)");
    add("idx_rope_pos", v.idx_rope_pos, "indexer_query", "input",
        "RoPE position of the indexer query per token");
    add("q_i8", v.idx_q_i8, "indexer_query", "output",
        "INT8 indexer query [T, 64, 128] after RoPE, Hadamard, Q8");
    add("q_scale", v.idx_q_scale, "indexer_query", "output", "indexer query dequant scale [T, 64]");
    add("weights", v.idx_weights, "indexer_query", "output",
        "indexer head weights (x_n @ weights_proj) / sqrt(8192)");
    add("score", v.score, "indexer_score", "output",
        "indexer score [T, 4096]; -3.4028235e38 past the visible rows");
    add("topk_idxs", v.topk_idxs, "indexer_topk", "output",
        "top-512 compressed row ids per token, -1 padded");
  }
  add("o_packed", v.o_packed, "sparse_attn", "output",
      "attention output, packed [O_GROUPS*T, 4096] BF16 after inverse RoPE");
  add("attn_out", v.attn_out, "o_proj", "output", "grouped W8A8 output projection [T, D] BF16");
  add("x_out", mut(x_out), "hc_post", "output",
      "layer output: hyper-connection stack [T, 4, D] FP32");
  if (!weights) return;
  add("attn_sink", mut(w.attn_sink), "sparse_attn", "weight", "attention sink per head");
  add("hc_fn", mut(w.hc.fn), "hc_pre", "weight", "hyper-connection mix weights [24, 4D]");
  add("hc_scale", mut(w.hc.scale), "hc_pre", "weight", "hc gate scales");
  add("hc_base", mut(w.hc.base), "hc_pre", "weight", "hc gate biases");
  add("attn_norm", mut(w.attn_norm), "rmsnorm", "weight", "attention RMSNorm weight");
  add("wq_a", mut(w.qkv.wq_a), "qkv_proj_rope", "weight", "[D, Q_LORA]");
  add("gamma_cq", mut(w.qkv.gamma_cq), "qkv_proj_rope", "weight", "q-latent RMSNorm weight");
  add("wq_b", mut(w.qkv.wq_b), "qkv_proj_rope", "weight", "INT8 [Q_LORA, H*512]");
  add("wq_b_scale", mut(w.qkv.wq_b_scale), "qkv_proj_rope", "weight", "per-column dequant scale");
  add("wkv", mut(w.qkv.wkv), "qkv_proj_rope", "weight", "[D, 512]");
  add("gamma_ckv", mut(w.qkv.gamma_ckv), "qkv_proj_rope", "weight", "kv RMSNorm weight");
  add("wo_a", mut(w.wo_a), "o_proj", "weight", "[O_GROUPS, O_LORA, O_GROUP_IN]");
  add("wo_b", mut(w.wo_b), "o_proj", "weight", "INT8 [D, O_GROUPS*O_LORA]");
  add("wo_b_scale", mut(w.wo_b_scale), "o_proj", "weight", "per-channel dequant scale");
  if (!swa) {
    add("compressor_wkv", mut(w.compressor.wkv), "compressor", "weight", "[OUT_DIM, D]");
    add("compressor_wgate", mut(w.compressor.wgate), "compressor", "weight", "[OUT_DIM, D]");
    add("compressor_ape", mut(w.compressor.ape), "compressor", "weight", "[R, OUT_DIM]");
    add("compressor_norm_w", mut(w.compressor.norm_w), "compressor", "weight", "[512]");
  }
  if (csa) {
    add("idx_wq_b", mut(w.indexer.wq_b), "indexer_query", "weight", "INT8 [Q_LORA, 64*128]");
    add("idx_wq_b_scale", mut(w.indexer.wq_b_scale), "indexer_query", "weight",
        "per-column dequant scale");
    add("weights_proj", mut(w.indexer.weights_proj), "indexer_query", "weight", "[D, 64]");
    add("hadamard_idx", mut(w.indexer.hadamard), "indexer_query", "weight", "[128, 128] rotation");
    add("idx_compressor_wkv", mut(w.indexer.compressor.wkv), "indexer_compressor", "weight",
        "[256, D]");
    add("idx_compressor_wgate", mut(w.indexer.compressor.wgate), "indexer_compressor", "weight",
        "[256, D]");
    add("idx_compressor_ape", mut(w.indexer.compressor.ape), "indexer_compressor", "weight",
        "[4, 256]");
    add("idx_compressor_norm_w", mut(w.indexer.compressor.norm_w), "indexer_compressor", "weight",
        "[128]");
  }
}

// ---- the a2a3 model's report (--backend a2a3) --------------------------------------------------
namespace a2 = tiledecode::a2a3;

// Per kernel of the last step: predicted latency summed over the layers and per-pipe busy time
// of the slowest core (launches summed).
void print_a2a3_table(const std::vector<a2::KernelReport>& reports, int layers) {
  const auto& arch = a2::kArch;
  std::printf(
      "\na2a3 execution model (backend/a2a3: one 910B-class die, %d AIC + %d AIV, %.2f GHz, HBM "
      "%.2f TB/s, launch %.1f us), last step, %d layers:\n  %-22s %6s %10s |",
      arch.cube_cores, arch.vector_cores(), arch.clock_hz / 1e9, arch.hbm_bytes_per_s / 1e12,
      arch.launch_overhead_us, layers, "kernel", "calls", "us");
  for (int p = 0; p < a2::kPipes; ++p)
    std::printf(" %7s", std::string(a2::pipe_name(a2::Pipe(p))).c_str());
  std::printf("  (busy us, slowest core)\n");
  std::vector<std::string> names;
  for (const auto& r : reports)
    if (std::find(names.begin(), names.end(), r.name) == names.end()) names.push_back(r.name);
  for (const auto& n : names) {
    double us = 0;
    int calls = 0;
    std::array<double, a2::kPipes> busy{};
    for (const auto& r : reports) {
      if (r.name != n) continue;
      us += r.latency_us();
      ++calls;
      const auto b = r.busy_slowest_us();
      for (int p = 0; p < a2::kPipes; ++p) busy[std::size_t(p)] += b[std::size_t(p)];
    }
    std::printf("  %-22s %6d %10.2f |", n.c_str(), calls, us);
    for (int p = 0; p < a2::kPipes; ++p) std::printf(" %7.2f", busy[std::size_t(p)]);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  const int B = opt.batch, S = opt.seq, L = opt.layers;
  // The context budget: the preset's 16k, raised to the next power of two the run needs (up to
  // 2^20 = 1M tokens; every table, pool view, RoPE table and workspace follows cfg.max_seq_len).
  const td::ModelConfig cfg = [&] {
    td::ModelConfig c = td::config_by_name(opt.preset);
    // The last step starts at context + steps - 1 and writes S positions from there.
    const long need = long(opt.context) + opt.steps - 1 + S;
    while (c.max_seq_len < need && c.max_seq_len < (1 << 20)) c.max_seq_len *= 2;
    return c;
  }();
  td::check_range("decode_step", "--layers", L, 1, cfg.n_layers + 1);
  td::check_range("decode_step", "--batch", B, 1, 1025);
  td::check_range("decode_step", "--seq", S, 1, 9);
  td::check_range("decode_step", "--steps", opt.steps, 1, cfg.max_seq_len);
  // The last step reads start + S positions: start = context + steps - 1.
  td::check_range("decode_step", "--context", opt.context, 0, cfg.max_seq_len - S - opt.steps + 2);
  const bool on_a2a3 = td::decode::backend_by_name(opt.backend) == td::decode::BackendKind::a2a3;
  if (!opt.trace.empty() && !on_a2a3)
    throw td::Error("decode_step: --trace records the a2a3 model's timeline; add --backend a2a3");
  const std::size_t threads =
      opt.threads > 0 ? std::size_t(opt.threads) : td::ThreadPool::default_threads();
  td::ThreadPool pool(threads);
  // The host context fills weights, pools and inputs (always the CPU).
  const td::cpu::Context host = td::cpu::make_context(&pool);
  a2::Machine machine(&pool);
  std::vector<a2::KernelReport> reports;
  td::decode::Backend be =
      on_a2a3 ? td::decode::Backend::a2a3(&machine, &reports)
      : opt.isa.empty()
          ? td::decode::Backend::cpu(&pool)
          : td::decode::Backend::cpu(&pool, td::cpu::isa_from_string("decode_step --isa", opt.isa));
  if (!opt.bf16_dot.empty()) {
    if (on_a2a3)
      throw td::Error(
          "decode_step: --bf16-dot chooses the CPU backend's BF16 dots; the a2a3 "
          "model sums as the chip does");
    be.cpu_ctx.bf16_dot = td::cpu::bf16_dot_from_string("decode_step --bf16-dot", opt.bf16_dot);
  }
  if (opt.compressor_check && on_a2a3)
    throw td::Error(
        "decode_step: --compressor-check is the CPU backend's rounding check; the a2a3 model sums "
        "as the chip does");
  const index_t T = index_t(B) * S, D = cfg.hidden;
  std::printf(
      "DeepSeek-V4-%s attention decode: %d layers, batch %d x S=%d (MTP, commit 1), context %d, "
      "%d steps (max_seq_len %d), %zu threads, backend %s\n",
      std::string(cfg.name).c_str(), L, B, S, opt.context, opt.steps, cfg.max_seq_len, threads,
      on_a2a3 ? "a2a3 (execution model on the CPU)"
              : ("cpu, isa " + std::string(td::cpu::to_string(be.cpu_ctx.isa)) + ", bf16 dots " +
                 std::string(td::cpu::to_string(td::cpu::resolved_bf16_dot(be.cpu_ctx.bf16_dot))) +
                 (opt.compressor_check ? ", compressor rounding check" : ""))
                    .c_str());

  // ---- the stack: weights, pools, tables (spec §1.3 deployment, scaled for B > 4)
  const auto t_setup = Clock::now();
  const td::paged::PoolSizes pools = td::paged::PoolSizes::for_batch(B);
  td::paged::FixtureTables fx(B, pools, false, cfg);
  std::vector<std::unique_ptr<td::decode::LayerWeightsStorage>> W;
  std::vector<std::unique_ptr<td::decode::LayerCacheStorage>> C;
  std::size_t weight_bytes = 0, cache_bytes = 0;
  for (int l = 0; l < L; ++l) {
    const td::LayerKind k = cfg.layer_kind(l);
    W.push_back(std::make_unique<td::decode::LayerWeightsStorage>(cfg, k));
    td::decode::synthetic::fill_weights(host, *W.back(), cfg, l, opt.seed);
    W.back()->pack(cfg);
    if (opt.compressor_check) W.back()->enable_compressor_rounding_check();
    C.push_back(std::make_unique<td::decode::LayerCacheStorage>(cfg, k, pools));
    td::decode::synthetic::fill_caches(host, *C.back(), cfg, l, opt.seed);
    weight_bytes += W.back()->bytes();
    cache_bytes += C.back()->bytes();
    std::fprintf(stderr, "\r  building layer %d/%d (%s)   ", l + 1, L,
                 std::string(td::to_string(k)).c_str());
  }
  std::fprintf(stderr, "\r%40s\r", "");
  const td::RopeTable rope_swa = td::make_rope_table(cfg, td::LayerKind::swa, cfg.max_seq_len);
  const td::RopeTable rope_cmp = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);
  auto rope_of = [&](td::LayerKind k) -> const td::RopeTable& {
    return k == td::LayerKind::swa ? rope_swa : rope_cmp;
  };
  std::vector<td::decode::LayerWeights> Wv;
  for (auto& w : W) Wv.push_back(w->view());
  td::paged::StepMetadata md(B, S, cfg);
  td::decode::Workspace ws(cfg, B, S, be);
  td::Tensor<float, 3> xa({T, 4, D}), xb({T, 4, D});
  std::printf("setup: weights %.0f MiB, pools %.0f MiB, workspace %.1f MiB, %.1f s\n",
              double(weight_bytes) / 1048576.0, double(cache_bytes) / 1048576.0,
              double(ws.bytes()) / 1048576.0, seconds_since(t_setup));

  // ---- decode steps
  const td::paged::StepShape sh{B, S, 1};
  std::vector<std::int32_t> starts(std::size_t(B), opt.context);
  td::decode::KernelTimes times, first_step;
  double step_seconds = 0, metadata_seconds = 0, predicted_seconds = 0, wall_seconds = 0;
  std::vector<td::decode::LayerCacheStorage> snapshot;    // pools before the last step
  std::vector<td::Tensor<float, 3>> layer_in, layer_out;  // last step, per layer
  std::unique_ptr<Dumper> dumper;
  if (!opt.dump.empty()) dumper = std::make_unique<Dumper>(opt.dump);
  bool dumped[3] = {false, false, false};
  const bool progress = opt.steps * L > 64 || on_a2a3;
  for (int step = 0; step < opt.steps; ++step) {
    const bool last = step + 1 == opt.steps;
    reports.clear();  // the a2a3 table shows the last step
    machine.set_tracing(last && !opt.trace.empty());
    td::decode::synthetic::fill_x_hc(host, xa.view(), opt.seed, step);
    td::decode::KernelTimes st;
    const auto t0 = Clock::now();
    md.build(starts, sh, fx.tables(), pools, cfg);  // once per step, shared by every layer
    const double t_md = seconds_since(t0);
    td::View<float, 3> in = xa.view(), out = xb.view();
    for (int l = 0; l < L; ++l) {
      const bool keep = last && (opt.check || dumper);
      if (keep) {
        snapshot.push_back(*C[l]);
        layer_in.emplace_back(std::array<index_t, 3>{T, 4, D});
        std::copy_n(in.data(), in.size(), layer_in.back().data());
      }
      const td::LayerKind k = Wv[l].kind;
      td::decode::KernelTimes lt;
      td::decode::layer_step(be, out, in, Wv[l], C[l]->view(), md, rope_of(k).view(), ws, cfg, {},
                             &lt);
      st += lt;
      if (keep) {
        layer_out.emplace_back(std::array<index_t, 3>{T, 4, D});
        std::copy_n(out.data(), out.size(), layer_out.back().data());
        const int ki = k == td::LayerKind::swa ? 0 : (k == td::LayerKind::csa ? 1 : 2);
        if (dumper && !dumped[ki]) {
          auto v = ws.views(B, S);
          dump_layer(*dumper, l, Wv[l], snapshot.back(), *C[l], md, v, in, out, rope_of(k),
                     opt.dump_weights);
          dumped[ki] = true;
        }
      }
      std::swap(in, out);
    }
    const double dt = seconds_since(t0);
    if (step == 0) {
      first_step = st;
    } else {
      times += st;
      step_seconds += dt;
      metadata_seconds += t_md;
    }
    predicted_seconds += st.total();
    wall_seconds += dt;
    if (progress || opt.steps <= 32) {
      if (on_a2a3)
        std::fprintf(stderr, "  step %d/%d  start %d  predicted %.1f us  (model run %.1f s)\n",
                     step + 1, opt.steps, starts[0], st.total() * 1e6, dt);
      else
        std::fprintf(stderr, "  step %d/%d  start %d  %.1f ms\n", step + 1, opt.steps, starts[0],
                     dt * 1e3);
    }
    for (auto& s : starts) s += 1;  // commit_tokens = 1
  }

  // ---- report
  const int timed = std::max(1, opt.steps - 1);
  if (opt.steps == 1) {
    times = first_step;
    step_seconds = times.total();
  }
  if (on_a2a3) {
    // The model's latency is a prediction, identical for every step of the same shapes; the mean
    // is over all steps (the first included: nothing warms up on the model).
    const double per_step_us = predicted_seconds * 1e6 / opt.steps;
    std::printf("\npredicted a2a3 latency per decode step (%d layers, mean of %d steps):\n", L,
                opt.steps);
    std::printf("  %-20s %10s %8s %8s\n", "kernel", "us/step", "share", "calls");
    td::decode::KernelTimes all = first_step;
    all += times;
    if (opt.steps == 1) all = first_step;
    for (int i = 0; i < td::decode::kNumKernels; ++i) {
      if (all.calls[i] == 0) continue;
      std::printf("  %-20s %10.2f %7.1f%% %8ld\n",
                  std::string(td::decode::to_string(td::decode::Kernel(i))).c_str(),
                  all.seconds[i] * 1e6 / opt.steps, 100.0 * all.seconds[i] / all.total(),
                  all.calls[i] / opt.steps);
    }
    print_a2a3_table(reports, L);
    std::printf("  (model run on the CPU: %.1f s per step)\n", wall_seconds / opt.steps);
    std::printf("predicted_step_us=%.2f\n", per_step_us);
    if (!opt.trace.empty()) {
      std::ofstream f(opt.trace);
      a2::write_chrome_trace(f, machine);
      std::printf("trace: last step's timeline in %s (chrome://tracing, ui.perfetto.dev)\n",
                  opt.trace.c_str());
    }
  } else {
    std::printf(
        "\nper-kernel time per decode step (%d layers, mean of %d steps after the first):\n", L,
        timed);
    std::printf("  %-20s %10s %8s %8s\n", "kernel", "ms/step", "share", "calls");
    const double total = times.total();
    for (int i = 0; i < td::decode::kNumKernels; ++i) {
      if (times.calls[i] == 0) continue;
      std::printf("  %-20s %10.3f %7.1f%% %8ld\n",
                  std::string(td::decode::to_string(td::decode::Kernel(i))).c_str(),
                  times.seconds[i] * 1e3 / timed, 100.0 * times.seconds[i] / total,
                  times.calls[i] / timed);
    }
    std::printf("  %-20s %10.3f\n", "metadata build", metadata_seconds * 1e3 / timed);
    std::printf("  %-20s %10.3f   (wall, all layers)\n", "step", step_seconds * 1e3 / timed);
    const double per_step = step_seconds / timed;
    std::printf(
        "throughput: %.1f committed tokens/s (%d per step), %.1f token rows/s (%lld per step "
        "incl. drafts)\n",
        double(B) / per_step, B, double(T) / per_step, (long long)T);
  }
  std::printf("peak memory (VmHWM): %.0f MiB\n", peak_rss_mib());
  if (dumper) {
    dumper->finish("  \"preset\": \"" + std::string(cfg.name) +
                   "\", \"batch\": " + std::to_string(B) + ", \"seq\": " + std::to_string(S) +
                   ", \"commit_tokens\": 1, \"step_start\": " + std::to_string(starts[0] - 1) +
                   ", \"backend\": \"" + opt.backend +
                   "\",\n  \"note\": \"BF16 tensors are stored as uint16 bits "
                   "(dtype bfloat16); pools are flattened to [blocks*page, width]\",\n");
    std::printf("dump: %zu files, %.0f MiB in %s (manifest.json)\n", dumper->files(),
                double(dumper->bytes()) / 1048576.0, opt.dump.c_str());
  }
  if (opt.check) {
    std::printf(
        "\ncheck: last step of every layer against the golden layer (same inputs and pools):\n");
    const std::vector<std::int32_t> last_starts(std::size_t(B), opt.context + opt.steps - 1);
    double worst = 0;
    bool all_pass = true;
    for (int l = 0; l < L; ++l) {
      const auto t0 = Clock::now();
      td::Tensor<float, 3> gold({T, 4, D});
      td::golden::decode_layer(gold.view(), layer_in[l].view(), Wv[l], snapshot[l].view(),
                               last_starts, sh, fx.tables(), rope_of(Wv[l].kind).view(), cfg);
      double max_diff = 0, max_ref = 0;
      std::size_t over = 0;
      const double thd = Wv[l].kind == td::LayerKind::csa ? 4e-3 : 3e-3;
      for (std::size_t i = 0; i < gold.size(); ++i) {
        const double a = layer_out[l].data()[i], e = gold.data()[i], d = std::fabs(a - e);
        max_diff = std::max(max_diff, d);
        max_ref = std::max(max_ref, std::fabs(e));
        const double den =
            std::max({std::fabs(a), std::fabs(e), std::ldexp(1.0, -14) / thd}) + 1e-9;
        if (!(d < thd ? d <= thd : d / den <= thd)) ++over;  // NaN counts as over
      }
      const double rel = max_diff / std::max(max_ref, 1e-30);
      const double pct = 100.0 * double(over) / double(gold.size());
      worst = std::max(worst, rel);
      all_pass = all_pass && pct <= 0.8;
      std::printf(
          "  layer %2d %-3s  max|diff| %.3e  max|ref| %.3e  rel %.3e  over %.0e: %.3f%% (%s, spec "
          "<= 0.8%%)  %.1f s\n",
          l, std::string(td::to_string(Wv[l].kind)).c_str(), max_diff, max_ref, rel, thd, pct,
          pct <= 0.8 ? "pass" : "FAIL", seconds_since(t0));
    }
    std::printf("max_rel_err=%.6e\n", worst);
    if (!all_pass) return 3;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "decode_step: %s\n", e.what());
  return 1;
}
