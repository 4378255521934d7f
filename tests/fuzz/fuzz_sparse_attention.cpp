// Fuzz target: sparse attention (kernels/sparse_attention.hpp) for SWA/CSA/HCA with arbitrary
// window index lists and lengths, CSA top-k lists (any int32), compressed block tables, positions,
// kv lengths, sinks (NaN/Inf included) and workspace sizes, on a reduced model (8 heads, 1 group,
// top-k 128, mostly short windows, lists and HCA lengths; the per-head shapes are the real ones:
// head_dim 512, window 128, page 128), and NaN / ±Inf / huge finite values injected into q and the
// caches (the hot loops: score, softmax, P·V, merge). Invariants:
//  * throws tiledecode::Error iff a plain model of the documented validation says the arguments
//    are invalid, and then o_packed is byte-identical to before (q and cache values are never
//    validated: injection does not change validity);
//  * otherwise o_packed is bit-identical across 1/3 threads and a 1-slot workspace, and the
//    canaries around o_packed and around both pools are intact (pools are only read);
//  * finite inputs: o_packed matches golden::sparse_attention within 2 BF16 ulps (+1e-3) and is
//    finite;
//  * injected inputs (docs/security.md, "Numerics policy"): against a clean run (same arguments,
//    no injection) of the kernel and of golden: every output the injection cannot reach is
//    bit-identical to the kernel's clean output (q injection: every head row but the injected
//    ones; cache injection: every token whose golden output did not change); where golden is
//    NaN the kernel is NaN and vice versa (NaN injection), non-finite iff golden is (±Inf
//    injection), and finite outputs match golden within the tolerance (both). Huge finite q
//    values (FP32 overflow of q·k, a documented difference from the double golden) are checked
//    for locality and determinism only.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "fuzz_common.hpp"
#include "sparse_attention_golden.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"

namespace td = tiledecode;
namespace tk = tiledecode::kernels;
using td::bf16;
using td::index_t;
using td::LayerKind;

namespace {

using tdfuzz::g_verbose;
using tdfuzz::kFill;
using tdfuzz::Mix;
using tdfuzz::threw_error;

td::ModelConfig fuzz_config() {
  td::ModelConfig c = td::flash_config();
  c.n_heads = 8;  // the kernel needs a multiple of 8 heads (AVX2 head lanes)
  c.o_groups = 1;
  c.idx_topk = 128;  // the smallest list with window + top-k a multiple of the 128-column tile
  return c;
}

const td::RopeTable& rope(LayerKind kind) {
  static std::unique_ptr<td::RopeTable> t[2];
  const int i = kind == LayerKind::swa ? 0 : 1;
  if (!t[i]) {
    const auto cfg = fuzz_config();
    t[i] = std::make_unique<td::RopeTable>(td::make_rope_table(cfg, kind, cfg.max_seq_len));
  }
  return *t[i];
}

// n BF16 values in [-1, 1): a window of a fixed noise table at an offset the input picks (a
// memcpy, so the pools cost no per-element work in the instrumented harness).
void fill_noise(bf16* dst, std::size_t n, Mix& mix) {
  static const std::vector<bf16> noise = [] {
    Mix m{12345};
    std::vector<bf16> v(std::size_t(1) << 20);
    for (auto& x : v) x = bf16(m.sym());
    return v;
  }();
  const std::size_t off = std::size_t(mix.next() % (noise.size() - n));
  std::memcpy(static_cast<void*>(dst), noise.data() + off, sizeof(bf16) * n);
}

// `bytes` of workspace, reused across inputs without clearing (stale contents must not matter).
std::span<std::byte> workspace(std::size_t bytes) {
  static std::vector<std::byte> store;
  if (store.size() < bytes) store.resize(bytes);
  return {store.data(), bytes};
}

std::int32_t any_id(FuzzedDataProvider& in, index_t valid_hi) {
  switch (in.ConsumeIntegralInRange(0, 11)) {
    case 0:
      return -1;
    case 1:
      return -2;
    case 2:
      return std::int32_t(valid_hi);
    case 3:
      return in.ConsumeIntegral<std::int32_t>();
    default:
      return std::int32_t(
          in.ConsumeIntegralInRange<index_t>(0, std::max<index_t>(0, valid_hi - 1)));
  }
}

// A copy of n BF16 values in `buf`, a buffer kept across inputs (it only grows): memcpy, where a
// std::vector copy of BF16 (trivially copyable, not trivial) runs an ASan-checked element loop
// and fresh pages fault in at every input (together ~15 % of the run time).
const bf16* keep_copy(std::vector<bf16>& buf, const bf16* src, std::size_t n) {
  if (buf.size() < n) buf.resize(n);
  std::memcpy(buf.data(), src, n * sizeof(bf16));
  return buf.data();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  static td::ThreadPool pool3(3);
  const td::ModelConfig cfg = fuzz_config();
  FuzzedDataProvider in(data, size);
  Mix mix{in.ConsumeIntegral<std::uint64_t>()};
  static constexpr LayerKind kKinds[] = {LayerKind::swa, LayerKind::csa, LayerKind::hca};
  const LayerKind kind = in.PickValueInArray(kKinds);
  // The scalar tier now and then: instrumented it is ~30x slower than AVX2 (one coverage
  // callback per multiply-add), and at 1 in 8 it took 56 % of the run time.
  const td::cpu::Isa isa =
      mix.next() % 32 == 0 ? td::cpu::Isa::scalar : td::cpu::detect_isa();  // (input bytes skew)
  const int B = in.ConsumeIntegralInRange(1, 2), S = in.ConsumeIntegralInRange(1, 2);
  const index_t T = index_t(B) * S, H = cfg.n_heads, D = cfg.head_dim, W = cfg.window;
  const index_t page = cfg.page;

  // Pools with canaries (only read by the kernel).
  const index_t ori_rows = in.ConsumeIntegralInRange<index_t>(1, 2) * page;
  const index_t cmp_blocks = in.ConsumeIntegralInRange<index_t>(1, 2);
  const index_t cmp_rows = cmp_blocks * page + (in.ConsumeProbability<float>() < 0.03f ? 1 : 0);
  tdfuzz::Guarded<bf16> kv(std::size_t(ori_rows * D)), cmp(std::size_t(cmp_rows * D));
  fill_noise(kv.data(), kv.size(), mix);
  fill_noise(cmp.data(), cmp.size(), mix);
  std::vector<bf16> q(static_cast<std::size_t>(T * H * D));
  const float q_scale = in.ConsumeBool() ? 1.0f : 8.0f;  // sharper softmax
  fill_noise(q.data(), q.size(), mix);
  if (q_scale != 1.0f)
    for (auto& v : q) v = bf16(v.to_float() * q_scale);

  // Non-finite / huge values: into a few cache rows (NaN or ±Inf anywhere in the row) or into a
  // few q head rows (NaN, ±Inf or a huge finite value). The clean inputs are kept for the oracle.
  enum class Inject { none, kv_nan, kv_inf, q_nan, q_inf, q_huge };
  const Inject inject = in.ConsumeProbability<float>() < 0.6f
                            ? Inject::none
                            : Inject(in.ConsumeIntegralInRange(1, 5));
  static std::vector<bf16> q_keep, kv_keep, cmp_keep;
  const bf16 *q_clean = nullptr, *kv_clean = nullptr, *cmp_clean = nullptr;  // when injected
  if (inject != Inject::none) {
    q_clean = keep_copy(q_keep, q.data(), q.size());
    kv_clean = keep_copy(kv_keep, kv.data(), kv.size());
    cmp_clean = keep_copy(cmp_keep, cmp.data(), cmp.size());
  }
  std::vector<char> q_hit(static_cast<std::size_t>(T * H), 0);  // (t, h) rows injected
  if (inject == Inject::kv_nan || inject == Inject::kv_inf) {
    const int n = in.ConsumeIntegralInRange(1, 4);
    for (int i = 0; i < n; ++i) {
      const bool into_cmp = kind != LayerKind::swa && in.ConsumeBool();
      const index_t rows = into_cmp ? cmp_rows : ori_rows;
      const index_t r = in.ConsumeIntegralInRange<index_t>(0, rows - 1);
      const index_t d = in.ConsumeIntegralInRange<index_t>(0, D - 1);
      const float v = inject == Inject::kv_nan ? std::numeric_limits<float>::quiet_NaN()
                      : in.ConsumeBool()       ? std::numeric_limits<float>::infinity()
                                               : -std::numeric_limits<float>::infinity();
      (into_cmp ? cmp : kv)[std::size_t(r * D + d)] = bf16(v);
    }
  } else if (inject != Inject::none) {
    const int n = in.ConsumeIntegralInRange(1, 3);
    for (int i = 0; i < n; ++i) {
      const index_t t = in.ConsumeIntegralInRange<index_t>(0, T - 1);
      const index_t h = in.ConsumeIntegralInRange<index_t>(0, H - 1);
      const index_t d = in.ConsumeIntegralInRange<index_t>(0, D - 1);
      float v = std::numeric_limits<float>::quiet_NaN();
      if (inject == Inject::q_inf)
        v = (in.ConsumeBool() ? 1.0f : -1.0f) * std::numeric_limits<float>::infinity();
      if (inject == Inject::q_huge) {  // q·k past FLT_MAX: the whole head row of q is huge
        const float big = in.ConsumeBool() ? 1e30f : 3e38f;
        for (index_t e = 0; e < D; ++e) q[std::size_t((t * H + h) * D + e)] = bf16(big * mix.sym());
        v = big;
      }
      q[std::size_t((t * H + h) * D + d)] = bf16(v);
      q_hit[std::size_t(t * H + h)] = 1;
    }
  }

  // Metadata: mostly plausible, any value possible.
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T)), lens(static_cast<std::size_t>(B));
  std::vector<std::int32_t> wlen(static_cast<std::size_t>(T)),
      widx(static_cast<std::size_t>(T * W));
  for (auto& p : pos) {
    p = in.ConsumeProbability<float>() < 0.03f
            ? (in.ConsumeBool() ? -1 : cfg.max_seq_len)
            : std::int32_t(mix.next() % std::uint64_t(cfg.max_seq_len));
  }
  // Mostly short kv lengths (HCA: at most 16 compressed rows), sometimes any.
  const std::uint64_t lens_hi = in.ConsumeProbability<float>() < 0.25f ? cfg.max_seq_len : 2048;
  for (auto& l : lens) {
    l = in.ConsumeProbability<float>() < 0.03f ? (in.ConsumeBool() ? -1 : cfg.max_seq_len + 1)
                                               : std::int32_t(mix.next() % (lens_hi + 1));
  }
  const bool long_windows = in.ConsumeProbability<float>() < 0.25f;  // else at most 16 rows
  for (auto& l : wlen)
    l = in.ConsumeProbability<float>() < 0.03f
            ? std::int32_t(W + 1)
            : in.ConsumeIntegralInRange<std::int32_t>(0, long_windows ? std::int32_t(W) : 16);
  const bool wild_window = in.ConsumeProbability<float>() < 0.3f;
  for (auto& v : widx) {
    v = wild_window
            ? any_id(in, ori_rows)
            : (mix.next() % 8 == 0 ? -1 : std::int32_t(mix.next() % std::uint64_t(ori_rows)));
  }
  const index_t cmp_cols = in.ConsumeIntegralInRange<index_t>(0, 3);
  std::vector<std::int32_t> cmp_table(static_cast<std::size_t>(B * cmp_cols));
  for (auto& e : cmp_table)
    e = in.ConsumeIntegralInRange<std::int32_t>(-3, std::int32_t(cmp_blocks));
  const index_t topk_w = cfg.idx_topk - (in.ConsumeProbability<float>() < 0.03f ? 1 : 0);
  std::vector<std::int32_t> topk(static_cast<std::size_t>(T * topk_w));
  const bool wild_topk = in.ConsumeBool();
  // Mostly short lists (the first 0..16 entries live, -1 after), sometimes all of them.
  const index_t topk_live =
      in.ConsumeProbability<float>() < 0.25f ? topk_w : in.ConsumeIntegralInRange<index_t>(0, 16);
  for (std::size_t i = 0; i < topk.size(); ++i) {
    if (index_t(i) % topk_w >= topk_live && !wild_topk) {
      topk[i] = -1;
      continue;
    }
    topk[i] = wild_topk ? any_id(in, 600) : std::int32_t(mix.next() % 700) - 50;
  }
  std::vector<float> sink(static_cast<std::size_t>(H));
  for (auto& s : sink) s = mix.sym() * 4.0f;
  if (in.ConsumeProbability<float>() < 0.05f) {
    static constexpr float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                                     std::numeric_limits<float>::infinity(), -1e30f, 1e30f};
    sink[in.ConsumeIntegralInRange<std::size_t>(0, sink.size() - 1)] = in.PickValueInArray(kBad);
  }
  const bool small_ws = in.ConsumeProbability<float>() < 0.05f;

  // Validation model (kernels/sparse_attention.hpp: validate); `why` names the first violation.
  const char* why = nullptr;
  auto require = [&](bool ok, const char* what) {
    if (!ok && why == nullptr) why = what;
  };
  require(!small_ws, "workspace");
  for (index_t t = 0; t < T; ++t) {
    require(pos[t] >= 0 && pos[t] < cfg.max_seq_len, "positions");
    require(wlen[t] >= 0 && wlen[t] <= W, "window_lens");
    for (index_t k = 0; k < W; ++k)
      require(widx[t * W + k] >= -1 && widx[t * W + k] < ori_rows, "window_idx");
  }
  for (float s : sink) require(std::isfinite(s), "attn_sink");
  if (kind != LayerKind::swa) {
    require(cmp_rows % page == 0, "cmp_kv rows");
    require(cmp_cols >= 1, "cmp_block_table cols");
    for (auto e : cmp_table) require(e >= -1 && e < cmp_blocks, "cmp_block_table entry");
  }
  if (kind == LayerKind::hca)
    for (auto l : lens) require(l >= 0 && l <= cfg.max_seq_len, "kv_seq_lens");
  if (kind == LayerKind::csa) require(topk_w >= cfg.idx_topk, "topk width");
  const bool valid = why == nullptr;
  if (g_verbose)
    std::fprintf(stderr, "kind=%d B=%d S=%d isa=%d model: %s\n", int(kind), B, S, int(isa),
                 why ? why : "valid");

  const auto kv_before = kv.snapshot(), cmp_before = cmp.snapshot();
  const td::ConstView<bf16, 3> qv(q.data(), {T, H, D});
  const td::ConstView<bf16, 2> kvv(kv.data(), {ori_rows, D}), cmpv(cmp.data(), {cmp_rows, D});
  const td::ConstView<std::int32_t, 2> widxv(widx.data(), {T, W}), topkv(topk.data(), {T, topk_w}),
      tablev(cmp_table.data(), {index_t(B), cmp_cols});
  const td::ConstView<std::int32_t, 1> wlenv(wlen.data(), {T}), posv(pos.data(), {T}),
      lensv(lens.data(), {index_t(B)});
  const td::ConstView<float, 1> sinkv(sink.data(), {H});
  const index_t out_rows = cfg.o_groups * T, out_cols = cfg.o_group_in();
  auto run = [&](td::Executor* exec, std::size_t slots, tdfuzz::Guarded<bf16>& out) {
    // small_ws: one byte less than the documented minimum (one slot) must be rejected.
    const std::size_t bytes = small_ws ? tk::sparse_attention_workspace_bytes(cfg, 1) - 1
                                       : tk::sparse_attention_workspace_bytes(cfg, slots);
    tk::sparse_attention(td::cpu::Context{exec, isa}, cfg, kind,
                         td::View<bf16, 2>(out.data(), {out_rows, out_cols}), qv, kvv, cmpv, widxv,
                         wlenv, topkv, tablev, posv, lensv, S, sinkv, rope(kind).view(),
                         workspace(bytes));
  };
  tdfuzz::Guarded<bf16> out(std::size_t(out_rows * out_cols), kFill);
  const bool threw = threw_error([&] { run(&pool3, 3, out); });
  TDFUZZ_CHECK(threw == !valid, threw);
  TDFUZZ_CHECK(out.canaries_intact() && kv.same_as(kv_before) && cmp.same_as(cmp_before));
  if (threw) {
    TDFUZZ_CHECK(out.body_is(kFill));
    return 0;
  }
  tdfuzz::Guarded<bf16> out1(std::size_t(out_rows * out_cols), kFill);
  run(nullptr, 1, out1);
  TDFUZZ_CHECK(out1.same_as(out.snapshot()));

  const index_t n_out = out_rows * out_cols;
  auto golden = [&](std::vector<bf16>& dst, const td::ConstView<bf16, 3>& qq,
                    const td::ConstView<bf16, 2>& kk, const td::ConstView<bf16, 2>& cc) {
    dst.assign(std::size_t(n_out), bf16());
    tdfuzz::golden_sparse_attention(cfg, kind, td::View<bf16, 2>(dst.data(), {out_rows, out_cols}),
                                    qq, kk, cc, widxv, wlenv, topkv, tablev, posv, lensv, S, sinkv,
                                    rope(kind).view());
  };
  auto close = [](float a, float e) { return std::fabs(a - e) <= 1e-3f + std::fabs(e) / 64.0f; };
  std::vector<bf16> gold;
  golden(gold, qv, kvv, cmpv);
  if (inject == Inject::none) {
    for (index_t i = 0; i < n_out; ++i) {
      const float a = out[std::size_t(i)].to_float(), e = gold[std::size_t(i)].to_float();
      TDFUZZ_CHECK(std::isfinite(a), i);
      TDFUZZ_CHECK(close(a, e), i, std::llround(double(a) * 1e6));
    }
    return 0;
  }
  // The clean run: kernel and golden on the inputs before the injection.
  const td::ConstView<bf16, 3> qcv(q_clean, {T, H, D});
  const td::ConstView<bf16, 2> kvcv(kv_clean, {ori_rows, D}), cmpcv(cmp_clean, {cmp_rows, D});
  std::vector<bf16> gold_clean;
  golden(gold_clean, qcv, kvcv, cmpcv);
  tdfuzz::Guarded<bf16> clean(std::size_t(n_out), kFill);
  {
    const std::span<std::byte> ws = workspace(tk::sparse_attention_workspace_bytes(cfg, 1));
    tk::sparse_attention(td::cpu::Context{nullptr, isa}, cfg, kind,
                         td::View<bf16, 2>(clean.data(), {out_rows, out_cols}), qcv, kvcv, cmpcv,
                         widxv, wlenv, topkv, tablev, posv, lensv, S, sinkv, rope(kind).view(), ws);
  }
  // o_packed row g·T + t holds the heads of group g of token t, 512 values each (o_groups = 1).
  auto bits = [](bf16 v) { return v.bits; };
  for (index_t t = 0; t < T; ++t) {
    bool token_reached = false;  // cache injection: did golden's output of token t change?
    for (index_t i = t * out_cols; i < (t + 1) * out_cols; ++i)
      token_reached |= bits(gold[std::size_t(i)]) != bits(gold_clean[std::size_t(i)]);
    for (index_t h = 0; h < H; ++h) {
      const bool q_inject =
          inject == Inject::q_nan || inject == Inject::q_inf || inject == Inject::q_huge;
      const bool reached = q_inject ? q_hit[std::size_t(t * H + h)] != 0 : token_reached;
      for (index_t d = 0; d < D; ++d) {
        const auto i = std::size_t(t * out_cols + h * D + d);
        const float a = out[i].to_float(), e = gold[i].to_float();
        if (!reached) {
          TDFUZZ_CHECK(bits(out[i]) == bits(clean[i]), i, int(inject));
          continue;
        }
        if (inject == Inject::q_huge) continue;
        if (inject == Inject::kv_nan || inject == Inject::q_nan)
          TDFUZZ_CHECK(std::isnan(a) == std::isnan(e), i, int(inject));
        if (g_verbose && std::isfinite(a) != std::isfinite(e))
          std::fprintf(stderr, "t=%d h=%d d=%d kernel=%g golden=%g clean=%g\n", int(t), int(h),
                       int(d), double(a), double(e), double(clean[i].to_float()));
        TDFUZZ_CHECK(std::isfinite(a) == std::isfinite(e), i, int(inject));
        if (std::isfinite(a)) TDFUZZ_CHECK(close(a, e), i, std::llround(double(a) * 1e6));
      }
    }
  }
  return 0;
}
