// Fuzz target: one whole decode-layer step (decode::layer_step) of a SWA, CSA or HCA layer on a
// narrow flash model (every cache and paging constant of flash: head_dim 512, rope 64, page 128,
// window 128, max_seq_len 16384, state pages 4/8, idx_topk 512; dense widths cut: hidden 512,
// 8 heads, q_lora 256, o_lora 128, 2 output groups, 16 indexer heads), small pools (the fixture
// tables wrap and alias, which is defined behaviour), B <= 2, S <= 3.
// The input picks the family, B, S, commit_tokens, the starts, the ISA, and corrupts some
// arguments: table entries (-1, -2, out of range, any int32), tensor shapes (short / long /
// negative extents, missing views, views without data), NaN / Inf sinks, RoPE tables shorter
// than the positions or than 32 columns, an invalid LayerKind, NaN / Inf / huge index-cache
// scales (not rejected: they propagate into the scores, where top-k skips NaN).
// Invariants:
//  * StepMetadata::build either throws tiledecode::Error and leaves the previous bundle
//    byte-identical, or builds;
//  * layer_step either throws tiledecode::Error, and then x_out, every workspace buffer and every
//    pool are byte-identical to before (nothing written), or it runs, and then x_out matches
//    golden::decode_layer on its own copy of the pools within the spec tolerance
//    (ratio_reldiff(4e-3 CSA / 3e-3, 0.8 %, max 1), tests/common/compare.hpp), and is finite;
//  * a corruption documented as invalid (shapes, NaN/Inf sink, LayerKind, short RoPE) throws.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/narrow_config.hpp"
#include "fuzz_common.hpp"
#include "layer_step_golden.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/synthetic.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::LayerKind;

namespace {

using tdfuzz::g_verbose;
using tdfuzz::Mix;

constexpr int kMaxB = 2, kMaxS = 3;

using tdtest::narrow_config;

// Small pools: the fixture tables (entry (j * B + b) % blocks) wrap around them.
td::paged::PoolSizes small_pools() {
  td::paged::PoolSizes p;
  p.ori = 4;
  p.cmp = 2;
  p.idx = 3;
  p.hca_state = 5;
  p.csa_state = 7;
  p.csa_inner_state = 7;
  return p;
}

// tests/common/compare.hpp's ratio_reldiff (spec §10.1), without gtest.
bool ratio_reldiff(const float* a, const float* e, std::size_t n, double diff_thd, double pct_thd,
                   double max_diff_hd, double* worst_out) {
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) {
      *worst_out = INFINITY;
      return false;
    }
    const double d = std::fabs(double(a[i]) - double(e[i]));
    const double den = std::max({std::fabs(double(a[i])), std::fabs(double(e[i])),
                                 std::ldexp(1.0, -14) / diff_thd}) +
                       1e-9;
    const double rd = d < diff_thd ? d : d / den;
    if (rd > diff_thd) {
      ++bad;
      worst = std::max(worst, rd);
    }
  }
  *worst_out = worst;
  return (n == 0 ? 0.0 : double(bad) / double(n)) <= pct_thd && worst < max_diff_hd;
}

struct LayerState {
  LayerKind kind;
  td::decode::LayerWeightsStorage weights;
  td::decode::LayerCacheStorage pristine, live, gold;
  td::RopeTable rope;
};

struct World {
  td::ModelConfig cfg = narrow_config();
  td::paged::PoolSizes pools = small_pools();
  td::ThreadPool pool{2};
  std::unique_ptr<LayerState> layers[3];
  td::paged::StepMetadata md{kMaxB, kMaxS, cfg};
  td::decode::Workspace ws{cfg, kMaxB, kMaxS, std::size_t(2)};
  td::Tensor<float, 3> x_hc{{index_t(kMaxB) * kMaxS, 4, cfg.hidden}};
  td::Tensor<float, 3> x_out{{index_t(kMaxB) * kMaxS, 4, cfg.hidden}};
  td::Tensor<float, 3> x_gold{{index_t(kMaxB) * kMaxS, 4, cfg.hidden}};

  World() {
    const td::cpu::Context ctx = td::cpu::make_context(&pool);
    const LayerKind kinds[3] = {LayerKind::swa, LayerKind::csa, LayerKind::hca};
    for (int l = 0; l < 3; ++l) {
      auto s = std::make_unique<LayerState>();
      s->kind = kinds[l];
      s->weights = td::decode::LayerWeightsStorage(cfg, kinds[l]);
      td::decode::synthetic::fill_weights(ctx, s->weights, cfg, l, 31337);
      s->weights.pack(cfg);
      s->pristine = td::decode::LayerCacheStorage(cfg, kinds[l], pools);
      td::decode::synthetic::fill_caches(ctx, s->pristine, cfg, l, 31337);
      s->live = s->pristine;
      s->gold = s->pristine;
      s->rope = td::make_rope_table(cfg, kinds[l], cfg.max_seq_len);
      layers[l] = std::move(s);
    }
    td::decode::synthetic::fill_x_hc(ctx, x_hc.view(), 7, 0);
  }
};

World& world() {
  static World w;
  return w;
}

template <class T>
void restore(td::Tensor<T, 2>& dst, const td::Tensor<T, 2>& src) {
  std::copy_n(src.data(), src.size(), dst.data());
}
void restore(td::decode::LayerCacheStorage& dst, const td::decode::LayerCacheStorage& src) {
  restore(dst.kv_cache, src.kv_cache);
  restore(dst.cmp_kv, src.cmp_kv);
  restore(dst.state, src.state);
  restore(dst.inner_state, src.inner_state);
  restore(dst.idx_kv_cache, src.idx_kv_cache);
  std::copy_n(src.idx_kv_scale.data(), src.idx_kv_scale.size(), dst.idx_kv_scale.data());
}

// Byte copies of everything a step may write.
struct Bytes {
  std::vector<std::vector<unsigned char>> parts;
  template <class T, std::size_t R>
  void add(td::View<T, R> v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    parts.emplace_back(p, p + (p ? std::size_t(v.size()) * sizeof(T) : 0));
  }
  void add(std::span<std::byte> s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    parts.emplace_back(p, p + s.size());
  }
  bool operator==(const Bytes& o) const { return parts == o.parts; }
};

Bytes snapshot(World& w, LayerState& L) {
  Bytes b;
  b.add(w.x_out.view());
  b.add(L.live.kv_cache.view());
  b.add(L.live.cmp_kv.view());
  b.add(L.live.state.view());
  b.add(L.live.inner_state.view());
  b.add(L.live.idx_kv_cache.view());
  b.add(L.live.idx_kv_scale.view());
  const auto v = w.ws.views(kMaxB, kMaxS);
  b.add(v.x_mixed), b.add(v.post), b.add(v.comb), b.add(v.hc_ws), b.add(v.x_n), b.add(v.q);
  b.add(v.kv), b.add(v.qr), b.add(v.qr_scale), b.add(v.qkv_scratch.x), b.add(v.qkv_scratch.cq);
  b.add(v.qkv_scratch.kvf), b.add(v.qkv_scratch.qr_pairs), b.add(v.qkv_scratch.extra);
  b.add(v.compressor_ws), b.add(v.cmp_kv_out), b.add(v.idx_kv_out), b.add(v.idx_q_i8);
  b.add(v.idx_q_scale), b.add(v.idx_weights), b.add(v.idx_rope_pos), b.add(v.score);
  b.add(v.topk_idxs), b.add(v.o_packed), b.add(v.attn_ws), b.add(v.attn_out), b.add(v.oproj_ws);
  return b;
}

Bytes md_snapshot(const td::paged::StepMetadata& md) {
  Bytes b;
  if (!md.built()) return b;
  b.add(md.position_ids());
  b.add(md.kv_seq_lens());
  for (int g = 0; g < td::rules::kNumTables; ++g) b.add(md.slot_mapping(td::paged::Table(g)));
  b.add(md.window_indices());
  b.add(md.window_lens());
  return b;
}

std::int32_t pick_start(FuzzedDataProvider& in, int S, int max_len) {
  static constexpr std::int32_t kEdges[] = {0,    1,    2,    3,    4,     7,    126,  127,
                                            128,  254,  255,  256,  511,   2047, 2048, 4095,
                                            4096, 8188, 8191, 8192, 12287, 16380};
  switch (in.ConsumeIntegralInRange(0, 15)) {
    case 0:
      return std::min<std::int32_t>(in.PickValueInArray(kEdges), max_len - S);
    case 1:
      return in.ConsumeIntegralInRange<std::int32_t>(0, max_len - S);
    case 2:  // invalid: past the end / negative
      return in.ConsumeBool() ? max_len - S + 1 : -1;
    default:  // mostly short contexts: the golden layer stays cheap
      return in.ConsumeIntegralInRange<std::int32_t>(0, 600);
  }
}

std::int32_t wild_entry(FuzzedDataProvider& in, index_t blocks) {
  switch (in.ConsumeIntegralInRange(0, 4)) {
    case 0:
      return -1;
    case 1:
      return -2;
    case 2:
      return std::int32_t(blocks);
    case 3:
      return in.ConsumeIntegral<std::int32_t>();
    default:
      return in.ConsumeIntegralInRange<std::int32_t>(0, std::int32_t(blocks - 1));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  World& w = world();
  const td::ModelConfig& cfg = w.cfg;
  FuzzedDataProvider in(data, size);
  const int fam = in.ConsumeIntegralInRange(0, 2);
  LayerState& L = *w.layers[fam];
  const int B = in.ConsumeIntegralInRange(1, kMaxB), S = in.ConsumeIntegralInRange(1, kMaxS);
  static constexpr int kCommit[] = {-1, 1, 0};
  const int commit = std::min(in.PickValueInArray(kCommit), S);
  // The scalar tier now and then (instrumented it is ~20x slower than AVX2).
  const td::cpu::Isa isa =
      in.ConsumeIntegralInRange(0, 7) == 7 ? td::cpu::Isa::scalar : td::cpu::detect_isa();
  const auto be = td::decode::Backend::cpu(&w.pool, isa);
  std::vector<std::int32_t> starts(static_cast<std::size_t>(B));
  for (auto& s : starts) s = pick_start(in, S, cfg.max_seq_len);
  const index_t T = index_t(B) * S;

  // Tables (the fixture's, B rows or more), then a few corrupted entries.
  const int rows = B + in.ConsumeIntegralInRange(0, 1);  // a max-batch table is legal
  td::paged::FixtureTables fx(rows, w.pools, in.ConsumeBool(), cfg);
  const int n_bad_entries =
      in.ConsumeProbability<float>() < 0.3f ? in.ConsumeIntegralInRange(1, 3) : 0;
  for (int i = 0; i < n_bad_entries; ++i) {
    td::Tensor<std::int32_t, 2>* tabs[] = {&fx.block_table,     &fx.cmp_block_table,
                                           &fx.idx_block_table, &fx.hca_state_table,
                                           &fx.csa_state_table, &fx.csa_inner_state_table};
    const index_t blocks[] = {w.pools.ori,       w.pools.cmp,       w.pools.idx,
                              w.pools.hca_state, w.pools.csa_state, w.pools.csa_inner_state};
    const int k = in.ConsumeIntegralInRange(0, 5);
    auto& t = *tabs[k];
    const index_t b = in.ConsumeIntegralInRange<index_t>(0, rows - 1);
    // Near the columns the step touches (else the entry is rarely read).
    const index_t page = k == 3 ? cfg.c128_state_page : (k >= 4 ? cfg.c4_state_page : cfg.page);
    const index_t ratio = (k == 1 || k == 2) ? 4 : 1;
    const index_t base = starts[std::size_t(std::min<index_t>(b, B - 1))] / ratio / page;
    const index_t col =
        std::clamp<index_t>(base + in.ConsumeIntegralInRange<index_t>(-20, 2), 0, t.extent(1) - 1);
    t.view()(b, col) = wild_entry(in, blocks[k]);
  }
  const td::paged::StepShape sh{B, S, commit};
  if (g_verbose) {
    std::fprintf(stderr, "family=%s B=%d S=%d commit=%d isa=%s rows=%d bad_entries=%d starts:",
                 std::string(td::to_string(L.kind)).c_str(), B, S, commit,
                 std::string(td::cpu::to_string(isa)).c_str(), rows, n_bad_entries);
    for (auto s : starts) std::fprintf(stderr, " %d", s);
    std::fprintf(stderr, "\n");
  }
  {
    const Bytes before = md_snapshot(w.md);
    if (tdfuzz::threw_error([&] { w.md.build(starts, sh, fx.tables(), w.pools, cfg); })) {
      TDFUZZ_CHECK(md_snapshot(w.md) == before);
      return 0;
    }
  }

  // Arguments, then corruptions (each `must` = documented invalid).
  restore(L.live, L.pristine);  // both layers start from the same pools
  restore(L.gold, L.pristine);
  td::View<float, 3> x_out(w.x_out.data(), {T, 4, cfg.hidden});
  td::ConstView<float, 3> x_hc(w.x_hc.data(), {T, 4, cfg.hidden});
  td::decode::LayerWeights wv = L.weights.view();
  td::decode::LayerCaches cv = L.live.view();
  td::RopeTableView rope = L.rope.view();
  td::Tensor<float, 1> sink, scale;
  bool must_reject = false;
  const int n_corrupt = in.ConsumeProbability<float>() < 0.4f ? in.ConsumeIntegralInRange(1, 2) : 0;
  for (int i = 0; i < n_corrupt; ++i) {
    const int c = in.ConsumeIntegralInRange(0, 15);
    switch (c) {
      case 0: {  // NaN / Inf sink
        static constexpr float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                                         std::numeric_limits<float>::infinity(),
                                         -std::numeric_limits<float>::infinity()};
        // From the layer's own sinks, not wv.attn_sink: when this case is drawn twice, wv
        // points at the previous `sink`, which the assignment below frees (a heap-use-after-free
        // of this harness that fuzz_layer_step found itself; corpus/layer_step/sink_twice).
        const float* orig = L.weights.view().attn_sink.data();
        sink = td::Tensor<float, 1>({cfg.n_heads});
        std::copy_n(orig, cfg.n_heads, sink.data());
        sink.data()[in.ConsumeIntegralInRange<index_t>(0, cfg.n_heads - 1)] =
            in.PickValueInArray(kBad);
        wv.attn_sink = sink.view();
        must_reject = true;
        break;
      }
      case 1:  // wo_b_scale extent
        wv.wo_b_scale = wv.wo_b_scale.slice(0, 0, cfg.hidden - in.ConsumeIntegralInRange(1, 8));
        must_reject = true;
        break;
      case 2:  // wo_a missing or negative
        wv.wo_a = in.ConsumeBool() ? td::ConstView<bf16, 3>()
                                   : td::ConstView<bf16, 3>(wv.wo_a.data(),
                                                            {cfg.o_groups, -1, cfg.o_group_in()});
        must_reject = true;
        break;
      case 3:  // x_hc shape
        x_hc = in.ConsumeBool() ? td::ConstView<float, 3>(x_hc.data(), {T, 4, -1})
                                : td::ConstView<float, 3>(x_hc.data(), {T, 4, cfg.hidden - 8});
        must_reject = true;
        break;
      case 4:  // kv_cache negative or smaller than the pool sizes
        cv.kv_cache = in.ConsumeBool() ? td::View<bf16, 2>(cv.kv_cache.data(), {-1, cfg.head_dim})
                                       : cv.kv_cache.slice(0, 0, cv.kv_cache.extent(0) - cfg.page);
        must_reject = true;
        break;
      case 5:  // invalid layer kind
        wv.kind = LayerKind(in.ConsumeBool() ? 7 : 1);
        must_reject = true;
        break;
      case 6: {  // RoPE: sin half shorter, or both halves shorter than the positions
        const index_t maxpos = *std::max_element(starts.begin(), starts.end()) + S - 1;
        const index_t rows_left = std::max<index_t>(1, maxpos - in.ConsumeIntegralInRange(0, 3));
        rope.sin = rope.sin.slice(0, 0, rows_left);
        if (in.ConsumeBool()) rope.cos = rope.cos.slice(0, 0, rows_left);
        must_reject = true;
        break;
      }
      case 7:  // RoPE narrower than 32 columns
        rope.sin = rope.sin.slice(1, 0, in.ConsumeIntegralInRange(0, 31));
        must_reject = true;
        break;
      case 8:  // compressor ape / norm_w (CSA, HCA)
        if (L.kind == LayerKind::swa) break;
        if (in.ConsumeBool())
          wv.compressor.ape = wv.compressor.ape.slice(0, 0, wv.compressor.ape.extent(0) - 1);
        else
          wv.compressor.norm_w = td::ConstView<bf16, 1>(nullptr, {cfg.head_dim});
        must_reject = true;
        break;
      case 9:  // indexer hadamard / weights_proj (CSA)
        if (L.kind != LayerKind::csa) break;
        if (in.ConsumeBool())
          wv.indexer.hadamard = wv.indexer.hadamard.slice(0, 0, 127);
        else
          wv.indexer.weights_proj = wv.indexer.weights_proj.slice(1, 0, cfg.idx_n_heads - 1);
        must_reject = true;
        break;
      case 10:  // missing index-cache scales (CSA)
        if (L.kind != LayerKind::csa) break;
        cv.idx_kv_scale = {};
        must_reject = true;
        break;
      case 11: {  // NaN / Inf / huge index-cache scales: not rejected (propagate, top-k skips NaN)
        if (L.kind != LayerKind::csa) break;
        static constexpr float kOdd[] = {std::numeric_limits<float>::quiet_NaN(),
                                         std::numeric_limits<float>::infinity(), 1e38f, 0.0f};
        const index_t n = cv.idx_kv_scale.extent(0);
        const int k = in.ConsumeIntegralInRange(1, 8);
        const float v = in.PickValueInArray(kOdd);
        for (int j = 0; j < k; ++j) {
          const index_t r = in.ConsumeIntegralInRange<index_t>(0, n - 1);
          L.live.idx_kv_scale.data()[r] = v;
          L.gold.idx_kv_scale.data()[r] = v;  // the golden layer sees the same pools
        }
        break;
      }
      case 12:  // a state pool smaller than the metadata's pool sizes
        if (L.kind == LayerKind::swa) break;
        cv.state = cv.state.slice(0, 0, cv.state.extent(0) - 1);
        must_reject = true;
        break;
      default:
        break;
    }
  }
  if (g_verbose)
    std::fprintf(stderr, "  corruptions=%d must_reject=%d\n", n_corrupt, int(must_reject));

  const auto t0 = std::chrono::steady_clock::now();
  const Bytes before = snapshot(w, L);
  const auto t1 = std::chrono::steady_clock::now();
  const bool threw = tdfuzz::threw_error(
      [&] { td::decode::layer_step(be, x_out, x_hc, wv, cv, w.md, rope, w.ws, cfg); });
  const auto t2 = std::chrono::steady_clock::now();
  if (threw) {
    TDFUZZ_CHECK(snapshot(w, L) == before);
    return 0;
  }
  TDFUZZ_CHECK(!must_reject);

  // It ran: the golden layer on its own copy of the same pools.
  td::View<float, 3> x_gold(w.x_gold.data(), {T, 4, cfg.hidden});
  tdfuzz::golden_layer(x_gold, x_hc, L.weights.view(), L.gold.view(), starts, sh, fx.tables(),
                       L.rope.view(), cfg);
  const auto t3 = std::chrono::steady_clock::now();
  if (g_verbose) {
    auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::fprintf(stderr, "  snapshot %.1f ms, step %.1f ms, golden %.1f ms\n", ms(t0, t1),
                 ms(t1, t2), ms(t2, t3));
  }
  double worst = 0;
  const bool ok = ratio_reldiff(x_out.data(), x_gold.data(), std::size_t(x_out.size()),
                                L.kind == LayerKind::csa ? 4e-3 : 3e-3, 0.008, 1.0, &worst);
  if (!ok || g_verbose)
    std::fprintf(stderr, "  x_out vs golden: %s (worst reldiff %g)\n", ok ? "ok" : "FAILED", worst);
  TDFUZZ_CHECK(ok);
  return 0;
}
