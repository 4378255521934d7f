// Fuzz target: sparse attention (kernels/sparse_attention.hpp) for SWA/CSA/HCA with arbitrary
// window index lists and lengths, CSA top-k lists (any int32), compressed block tables, positions,
// kv lengths, sinks (NaN/Inf included) and workspace sizes, on a reduced model (8 heads, 1 group;
// the per-head shapes are the real ones: head_dim 512, window 128, page 128).
// Invariants:
//  * throws tiledecode::Error iff a plain model of the documented validation says the arguments
//    are invalid, and then o_packed is byte-identical to before;
//  * otherwise o_packed matches golden::sparse_attention within 2 BF16 ulps (+1e-3), is finite
//    (inputs are finite), is bit-identical across 1/3 threads and a 1-slot workspace, and the
//    canaries around o_packed and around both pools are intact (pools are only read).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "fuzz_common.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/golden/sparse_attention.hpp"

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
  c.idx_topk = 128;
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  static td::ThreadPool pool3(3);
  const td::ModelConfig cfg = fuzz_config();
  FuzzedDataProvider in(data, size);
  Mix mix{in.ConsumeIntegral<std::uint64_t>()};
  static constexpr LayerKind kKinds[] = {LayerKind::swa, LayerKind::csa, LayerKind::hca};
  const LayerKind kind = in.PickValueInArray(kKinds);
  const td::cpu::Isa isa = in.ConsumeBool() ? td::cpu::detect_isa() : td::cpu::Isa::scalar;
  const int B = in.ConsumeIntegralInRange(1, 2), S = in.ConsumeIntegralInRange(1, 2);
  const index_t T = index_t(B) * S, H = cfg.n_heads, D = cfg.head_dim, W = cfg.window;
  const index_t page = cfg.page;

  // Pools with canaries (only read by the kernel).
  const index_t ori_rows = in.ConsumeIntegralInRange<index_t>(1, 2) * page;
  const index_t cmp_blocks = in.ConsumeIntegralInRange<index_t>(1, 2);
  const index_t cmp_rows = cmp_blocks * page + (in.ConsumeProbability<float>() < 0.03f ? 1 : 0);
  tdfuzz::Guarded<bf16> kv(std::size_t(ori_rows * D)), cmp(std::size_t(cmp_rows * D));
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = bf16(mix.sym());
  for (std::size_t i = 0; i < cmp.size(); ++i) cmp[i] = bf16(mix.sym());
  const auto kv_before = kv.snapshot(), cmp_before = cmp.snapshot();
  std::vector<bf16> q(static_cast<std::size_t>(T * H * D));
  const float q_scale = in.ConsumeBool() ? 1.0f : 8.0f;  // sharper softmax
  for (auto& v : q) v = bf16(mix.sym() * q_scale);

  // Metadata: mostly plausible, any value possible.
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T)), lens(static_cast<std::size_t>(B));
  std::vector<std::int32_t> wlen(static_cast<std::size_t>(T)),
      widx(static_cast<std::size_t>(T * W));
  for (auto& p : pos) {
    p = in.ConsumeProbability<float>() < 0.03f
            ? (in.ConsumeBool() ? -1 : cfg.max_seq_len)
            : std::int32_t(mix.next() % std::uint64_t(cfg.max_seq_len));
  }
  for (auto& l : lens) {
    l = in.ConsumeProbability<float>() < 0.03f
            ? (in.ConsumeBool() ? -1 : cfg.max_seq_len + 1)
            : std::int32_t(mix.next() % std::uint64_t(cfg.max_seq_len + 1));
  }
  for (auto& l : wlen)
    l = in.ConsumeProbability<float>() < 0.03f
            ? std::int32_t(W + 1)
            : in.ConsumeIntegralInRange<std::int32_t>(0, std::int32_t(W));
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
  for (auto& v : topk) v = wild_topk ? any_id(in, 600) : std::int32_t(mix.next() % 700) - 50;
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
    for (auto e : cmp_table) require(e < cmp_blocks, "cmp_block_table entry");
  }
  if (kind == LayerKind::hca)
    for (auto l : lens) require(l >= 0 && l <= cfg.max_seq_len, "kv_seq_lens");
  if (kind == LayerKind::csa) require(topk_w >= cfg.idx_topk, "topk width");
  const bool valid = why == nullptr;
  if (g_verbose)
    std::fprintf(stderr, "kind=%d B=%d S=%d isa=%d model: %s\n", int(kind), B, S, int(isa),
                 why ? why : "valid");

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
    std::vector<std::byte> ws(bytes);
    tk::sparse_attention(td::cpu::Context{exec, isa}, cfg, kind,
                         td::View<bf16, 2>(out.data(), {out_rows, out_cols}), qv, kvv, cmpv, widxv,
                         wlenv, topkv, tablev, posv, lensv, S, sinkv, rope(kind).view(), ws);
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

  std::vector<bf16> gold(static_cast<std::size_t>(out_rows * out_cols));
  td::golden::sparse_attention(cfg, kind, td::View<bf16, 2>(gold.data(), {out_rows, out_cols}), qv,
                               kvv, cmpv, widxv, wlenv, topkv, tablev, posv, lensv, S, sinkv,
                               rope(kind).view());
  for (index_t i = 0; i < out_rows * out_cols; ++i) {
    const float a = out[std::size_t(i)].to_float(), e = gold[std::size_t(i)].to_float();
    TDFUZZ_CHECK(std::isfinite(a), i);
    TDFUZZ_CHECK(std::fabs(a - e) <= 1e-3f + std::fabs(e) / 64.0f, i,
                 std::llround(double(a) * 1e6));
  }
  return 0;
}
