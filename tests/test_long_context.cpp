// Long context (issue: DeepSeek-V4 as it is served): whole SWA, HCA and CSA layer steps with
// max_seq_len = 2^20 at the addendum's long-context start sets (§12.5 [DSP]: contexts 128, 16K,
// 1M and the mixed list 16K / 16K / 128K / 512K; plus 8192 and 2^20 - 2, the last position pair a
// 1M request can decode), against the golden layer on its own copy of the pools (spec §10.2 x_out
// rule, every pool). HCA attends min((p + 1) / 128, kv_len / 128, cap) compressed rows with
// cap = max_seq_len / 128 = 8192 (addendum §5.1: never the top-k size), CSA scores up to 262,144
// candidates per token and selects 512 (flash) / 1024 (pro). The RoPE tables cover 2^20 rows
// (dual profiles, YaRN on the compressed layers: addendum §4).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/compare.hpp"
#include "common/decode_fixture.hpp"
#include "common/tolerances.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/golden/decode_layer.hpp"

namespace td = tiledecode;
using td::index_t;

namespace {

constexpr int kOneM = 1 << 20;

td::ModelConfig long_config(const char* preset = "flash") {
  td::ModelConfig c = td::config_by_name(preset);
  c.max_seq_len = kOneM;
  return c;
}

// One layer step (MTP: S = 2, commit 1) on the CPU backend against golden: x_out by the spec's
// layer rule, every pool.
void check_long(td::LayerKind kind, std::vector<std::int32_t> starts,
                const td::ModelConfig& cfg = long_config()) {
  const int B = int(starts.size()), S = 2;
  td::ThreadPool pool(2);
  const auto be = td::decode::Backend::cpu(&pool);
  td::paged::FixtureTables fx(B, cfg);
  tdtest::LayerSetup L(cfg, kind, fx.pools, 3, 2020, be.cpu_ctx);
  td::decode::LayerCacheStorage gold = L.caches;
  const td::paged::StepShape sh{B, S, 1};
  td::paged::StepMetadata md(B, S, cfg);
  md.build(starts, sh, fx.tables(), fx.pools, cfg);
  td::decode::Workspace ws(cfg, B, S, be);
  const index_t T = index_t(B) * S;
  td::Tensor<float, 3> x_hc({T, 4, cfg.hidden}), x_out({T, 4, cfg.hidden}),
      x_gold({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(be.cpu_ctx, x_hc.view(), 5, 0);
  const auto w = L.weights.view();
  td::decode::layer_step(be, x_out.view(), x_hc.view(), w, L.caches.view(), md, L.rope.view(), ws,
                         cfg);
  td::golden::decode_layer(x_gold.view(), x_hc.view(), w, gold.view(), starts, sh, fx.tables(),
                           L.rope.view(), cfg);
  namespace tol = tdtest::tol;
  const std::vector<float> a(x_out.data(), x_out.data() + x_out.size()),
      e(x_gold.data(), x_gold.data() + x_gold.size());
  EXPECT_TRUE(
      tol::check(kind == td::LayerKind::csa ? tol::layer_x_out_csa : tol::layer_x_out, a, e));
  tdtest::expect_caches_close(L.caches, gold, std::string(td::to_string(kind)).c_str());
}

std::vector<std::int32_t> all(std::int32_t s) {
  return {s, s, s, s};
}
const std::vector<std::int32_t> kMixed = {16384, 16384, 131072, 524288};
constexpr std::int32_t kLast = kOneM - 2;

// The shape facts the tests rely on.
TEST(LongContext, long_context_shapes) {
  const auto cfg = long_config();
  EXPECT_EQ(cfg.hca_capacity(), 8192);
  EXPECT_EQ(cfg.score_len(), 262144);
  EXPECT_EQ(cfg.attn_cols(td::LayerKind::hca), 128 + 8192);
  // The newest HCA rows at 1M are visible (the base spec's cap at index_topk would drop them).
  EXPECT_EQ(td::rules::hca_visible_rows(cfg.hca_capacity(), kLast + 1, kLast + 1), 8191);
  EXPECT_EQ(td::rules::indexer_visible_rows(cfg, kLast + 1, kLast + 1), 262143);
}

TEST(LongContext, long_context_swa_128) {
  check_long(td::LayerKind::swa, all(128));
}
TEST(LongContext, long_context_swa_8192) {
  check_long(td::LayerKind::swa, all(8192));
}
TEST(LongContext, long_context_swa_mixed) {
  check_long(td::LayerKind::swa, kMixed);
}
TEST(LongContext, long_context_swa_1m) {
  check_long(td::LayerKind::swa, all(kLast));
}
TEST(LongContext, long_context_hca_16k) {
  check_long(td::LayerKind::hca, all(16384));
}
TEST(LongContext, long_context_hca_mixed) {
  check_long(td::LayerKind::hca, kMixed);
}
TEST(LongContext, long_context_hca_1m) {
  check_long(td::LayerKind::hca, all(kLast));
}
TEST(LongContext, long_context_csa_mixed) {
  check_long(td::LayerKind::csa, kMixed);
}
TEST(LongContext, long_context_csa_1m) {
  check_long(td::LayerKind::csa, {kLast, 8192, 131072, kLast - 1});
}
// Pro: 128 heads, top-1024, HCA-heavy schedule.
TEST(LongContext, long_context_pro_hca_1m) {
  check_long(td::LayerKind::hca, all(kLast), long_config("pro"));
}

}  // namespace
