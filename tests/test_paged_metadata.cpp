// Paged-KV metadata (spec §3; HEAD addendum §2, §3, §6, §7, §8): worked examples, canonical
// start sets and seeded random cases against golden in the base, #862 device-ring and #955
// prefix-caching layouts, properties, long context (tests named long_context_*), and every bad
// input (throws, names the argument, writes nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/golden/paged.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/paged/step_metadata.hpp"

#include "common/counting_new.hpp"  // StepMetadata::build must not allocate

namespace td = tiledecode;
namespace pg = tiledecode::paged;
namespace gd = tiledecode::golden;
using td::index_t;

namespace {

const td::ModelConfig kCfg = td::flash_config();

// TILEDECODE_SANITIZE_LEAN=1 (scripts/ci_sanitize.sh): fewer random iterations and timing
// repeats under ASan + checked views (same cases, same checks).
bool lean() {
  return std::getenv("TILEDECODE_SANITIZE_LEAN") != nullptr;
}

template <class T, std::size_t R>
std::vector<std::remove_const_t<T>> to_vec(td::View<T, R> v) {
  std::vector<std::remove_const_t<T>> out;
  if constexpr (R == 1) {
    for (index_t i = 0; i < v.extent(0); ++i) out.push_back(v(i));
  } else {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j) out.push_back(v(i, j));
  }
  return out;
}

// Runs `fn`, expects tiledecode::Error whose message contains every needle.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no tiledecode::Error thrown";
  } catch (const td::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << msg << " lacks " << n;
  }
}

// Golden bundle for one step, from the golden builders.
struct GoldenStep {
  std::vector<std::int32_t> pos, lens, win, wlens;
  std::vector<std::int64_t> ori, hca_cmp, csa_cmp, csa_idx, hca_state, csa_state, csa_inner;
};

GoldenStep golden_step(std::span<const std::int32_t> starts, const pg::StepShape& sh,
                       const pg::StepTables& tb, const pg::PoolSizes& pools) {
  const index_t T = sh.tokens(), B = sh.batch;
  GoldenStep g;
  g.pos.resize(T);
  g.lens.resize(B);
  g.win.resize(T * 128);
  g.wlens.resize(T);
  for (auto* v :
       {&g.ori, &g.hca_cmp, &g.csa_cmp, &g.csa_idx, &g.hca_state, &g.csa_state, &g.csa_inner})
    v->resize(T);
  td::View<std::int32_t, 1> pos(g.pos.data(), {T});
  gd::build_position_ids(pos, starts, sh, kCfg);
  gd::build_kv_seq_lens(td::View<std::int32_t, 1>(g.lens.data(), {B}), starts, sh, kCfg);
  auto v1 = [&](std::vector<std::int64_t>& v) { return td::View<std::int64_t, 1>(v.data(), {T}); };
  gd::build_ori_slot_mapping(v1(g.ori), pos, tb.block_table, pools.ori, sh, kCfg);
  gd::build_window_indices(td::View<std::int32_t, 2>(g.win.data(), {T, 128}),
                           td::View<std::int32_t, 1>(g.wlens.data(), {T}), pos, tb.block_table,
                           pools.ori, sh, kCfg);
  gd::build_compressed_slot_mapping(v1(g.hca_cmp), pos, tb.cmp_block_table, pools.cmp, 128, sh,
                                    kCfg);
  gd::build_compressed_slot_mapping(v1(g.csa_cmp), pos, tb.cmp_block_table, pools.cmp, 4, sh, kCfg);
  gd::build_compressed_slot_mapping(v1(g.csa_idx), pos, tb.idx_block_table, pools.idx, 4, sh, kCfg);
  gd::build_state_slot_mapping(v1(g.hca_state), pos, tb.hca_state_table, pools.hca_state, 8, sh,
                               kCfg);
  gd::build_state_slot_mapping(v1(g.csa_state), pos, tb.csa_state_table, pools.csa_state, 4, sh,
                               kCfg);
  gd::build_state_slot_mapping(v1(g.csa_inner), pos, tb.csa_inner_state_table,
                               pools.csa_inner_state, 4, sh, kCfg);
  return g;
}

void expect_matches_golden(const pg::StepMetadata& md, const GoldenStep& g) {
  EXPECT_EQ(to_vec(md.position_ids()), g.pos);
  EXPECT_EQ(to_vec(md.kv_seq_lens()), g.lens);
  EXPECT_EQ(to_vec(md.ori_slot_mapping()), g.ori);
  EXPECT_EQ(to_vec(md.swa_slot_mapping()), g.ori);
  EXPECT_EQ(to_vec(md.window_indices()), g.win);
  EXPECT_EQ(to_vec(md.window_lens()), g.wlens);
  EXPECT_EQ(to_vec(md.hca_cmp_slot_mapping()), g.hca_cmp);
  EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()), g.csa_cmp);
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()), g.csa_idx);
  EXPECT_EQ(to_vec(md.hca_state_slot_mapping()), g.hca_state);
  EXPECT_EQ(to_vec(md.csa_state_slot_mapping()), g.csa_state);
  EXPECT_EQ(to_vec(md.csa_inner_state_slot_mapping()), g.csa_inner);
}

// Every public builder individually against its golden twin.
void expect_builders_match_golden(std::span<const std::int32_t> starts, const pg::StepShape& sh,
                                  const pg::StepTables& tb, const pg::PoolSizes& pools) {
  const GoldenStep g = golden_step(starts, sh, tb, pools);
  const index_t T = sh.tokens(), B = sh.batch;
  std::vector<std::int32_t> pos(T, -7), lens(B, -7), win(T * 128, -7), wlens(T, -7);
  td::View<std::int32_t, 1> pv(pos.data(), {T});
  pg::build_position_ids(pv, starts, sh, kCfg);
  pg::build_kv_seq_lens(td::View<std::int32_t, 1>(lens.data(), {B}), starts, sh, kCfg);
  EXPECT_EQ(pos, g.pos);
  EXPECT_EQ(lens, g.lens);
  auto slots = [&](auto&& build) {
    std::vector<std::int64_t> v(T, -7);
    build(td::View<std::int64_t, 1>(v.data(), {T}));
    return v;
  };
  EXPECT_EQ(slots([&](auto d) {
              pg::build_ori_slot_mapping(d, pv, tb.block_table, pools.ori, sh, kCfg);
            }),
            g.ori);
  EXPECT_EQ(slots([&](auto d) {
              pg::build_compressed_slot_mapping(d, pv, tb.cmp_block_table, pools.cmp, 128, sh,
                                                kCfg);
            }),
            g.hca_cmp);
  EXPECT_EQ(slots([&](auto d) {
              pg::build_compressed_slot_mapping(d, pv, tb.cmp_block_table, pools.cmp, 4, sh, kCfg);
            }),
            g.csa_cmp);
  EXPECT_EQ(slots([&](auto d) {
              pg::build_compressed_slot_mapping(d, pv, tb.idx_block_table, pools.idx, 4, sh, kCfg);
            }),
            g.csa_idx);
  EXPECT_EQ(slots([&](auto d) {
              pg::build_state_slot_mapping(d, pv, tb.hca_state_table, pools.hca_state, 8, sh, kCfg);
            }),
            g.hca_state);
  EXPECT_EQ(slots([&](auto d) {
              pg::build_state_slot_mapping(d, pv, tb.csa_state_table, pools.csa_state, 4, sh, kCfg);
            }),
            g.csa_state);
  pg::build_window_indices(td::View<std::int32_t, 2>(win.data(), {T, 128}),
                           td::View<std::int32_t, 1>(wlens.data(), {T}), pv, tb.block_table,
                           pools.ori, sh, kCfg);
  EXPECT_EQ(win, g.win);
  EXPECT_EQ(wlens, g.wlens);
}

std::vector<std::int32_t> range_list(std::int32_t lo, std::int32_t hi) {  // [lo, hi]
  std::vector<std::int32_t> v(hi - lo + 1);
  std::iota(v.begin(), v.end(), lo);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Spec §3.9 worked example: plain tables, B = 4, S = 2, starts 8192 / 0 / 2 / 3.

TEST(WorkedExample, LiteralNumbers) {
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::FixtureTables fx(4);
  pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, kCfg);

  EXPECT_EQ(to_vec(md.position_ids()), (std::vector<std::int32_t>{8192, 8193, 0, 1, 2, 3, 3, 4}));
  EXPECT_EQ(to_vec(md.kv_seq_lens()), (std::vector<std::int32_t>{8194, 2, 4, 5}));
  // Request 0: logical block 64 → physical 0 → ori slots [0, 1].
  EXPECT_EQ(to_vec(md.ori_slot_mapping()),
            (std::vector<std::int64_t>{0, 1, 128, 129, 258, 259, 387, 388}));
  // No ratio-128 boundary anywhere; ratio-4 boundaries at pos 3 (request 2 s=1, request 3 s=0).
  EXPECT_EQ(to_vec(md.hca_cmp_slot_mapping()), std::vector<std::int64_t>(8, -1));
  EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()),
            (std::vector<std::int64_t>{-1, -1, -1, -1, -1, 256, 384, -1}));
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()),
            (std::vector<std::int64_t>{-1, -1, -1, -1, -1, 256, 384, -1}));
  EXPECT_EQ(to_vec(md.hca_state_slot_mapping()),
            (std::vector<std::int64_t>{0, 1, 8, 9, 18, 19, 27, 28}));
  // Request 3: CSA state slots [15, 28].
  EXPECT_EQ(to_vec(md.csa_state_slot_mapping()),
            (std::vector<std::int64_t>{8, 9, 4, 5, 10, 11, 15, 28}));
  EXPECT_EQ(to_vec(md.csa_inner_state_slot_mapping()),
            (std::vector<std::int64_t>{8, 9, 4, 5, 10, 11, 15, 28}));

  EXPECT_EQ(to_vec(md.window_lens()), (std::vector<std::int32_t>{128, 128, 1, 2, 3, 4, 4, 5}));
  auto window = [&](index_t t) {
    std::vector<std::int32_t> v;
    for (index_t k = 0; k < md.window_lens()(t); ++k) v.push_back(md.window_indices()(t, k));
    for (index_t k = md.window_lens()(t); k < 128; ++k) EXPECT_EQ(md.window_indices()(t, k), -1);
    return v;
  };
  // pos 8192: positions 8065..8192 = physical rows 15873..15999 (block 124), then row 0.
  auto w0 = range_list(15873, 15999);
  w0.push_back(0);
  EXPECT_EQ(window(0), w0);
  auto w1 = range_list(15874, 15999);
  w1.push_back(0);
  w1.push_back(1);
  EXPECT_EQ(window(1), w1);
  EXPECT_EQ(window(2), (std::vector<std::int32_t>{128}));
  EXPECT_EQ(window(3), (std::vector<std::int32_t>{128, 129}));
  EXPECT_EQ(window(4), range_list(256, 258));
  EXPECT_EQ(window(5), range_list(256, 259));
  EXPECT_EQ(window(6), range_list(384, 387));
  EXPECT_EQ(window(7), range_list(384, 388));
}

TEST(WorkedExample, MtpCommitMasksDraftBoundary) {
  // commit_tokens = 1: request 2's boundary at s = 1 is not committed; request 3's (s = 0) is.
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::FixtureTables fx(4);
  pg::StepMetadata md(starts, {4, 2, 1}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(to_vec(md.kv_seq_lens()), (std::vector<std::int32_t>{8193, 1, 3, 4}));
  EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()),
            (std::vector<std::int64_t>{-1, -1, -1, -1, -1, -1, 384, -1}));
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()),
            (std::vector<std::int64_t>{-1, -1, -1, -1, -1, -1, 384, -1}));
  // Ori and state writes are not commit-masked.
  EXPECT_EQ(to_vec(md.ori_slot_mapping()),
            (std::vector<std::int64_t>{0, 1, 128, 129, 258, 259, 387, 388}));
  EXPECT_EQ(to_vec(md.csa_state_slot_mapping()),
            (std::vector<std::int64_t>{8, 9, 4, 5, 10, 11, 15, 28}));
}

TEST(FixtureTables, SpecFormulaAndWidths) {
  pg::FixtureTables fx(4);
  EXPECT_EQ(fx.block_table.extent(1), 128);
  EXPECT_EQ(fx.cmp_block_table.extent(1), 32);
  EXPECT_EQ(fx.idx_block_table.extent(1), 64);
  EXPECT_EQ(fx.hca_state_table.extent(1), 2048);
  EXPECT_EQ(fx.csa_state_table.extent(1), 4096);
  EXPECT_EQ(fx.csa_inner_state_table.extent(1), 4096);
  // ori P = 128, B = 4: request b owns blocks ≡ b (mod 4); logical c and c + 32 alias.
  EXPECT_EQ(fx.block_table.view()(1, 0), 1);
  EXPECT_EQ(fx.block_table.view()(1, 5), 21);
  EXPECT_EQ(fx.block_table.view()(1, 37), 21);
  // CSA state P = 65: request 1 block 17 ↔ request 0 block 1 (spec §3.8).
  EXPECT_EQ(fx.csa_state_table.view()(1, 17), fx.csa_state_table.view()(0, 1));
  // Permuted: phys(c) = (c * 7 + 3) mod P.
  td::Tensor<std::int32_t, 2> perm({4, 128}), gold({4, 128});
  pg::build_fixture_block_table(perm.view(), 128, true);
  gd::build_fixture_block_table(gold.view(), 128, true);
  EXPECT_EQ(to_vec(perm.view()), to_vec(gold.view()));
  EXPECT_EQ(perm.view()(2, 1), (10 * 4 + 2) % 128);
  // Scaled pools: B <= 4 is the spec deployment.
  const auto p4 = pg::PoolSizes::for_batch(4), p64 = pg::PoolSizes::for_batch(64);
  EXPECT_EQ(p4.ori, 128);
  EXPECT_EQ(p4.csa_state, 65);
  EXPECT_EQ(p64.ori, 2048);
  EXPECT_EQ(p64.csa_inner_state, 1025);
}

// ---------------------------------------------------------------------------------------------
// Canonical start sets (spec §10.3) and seeded random cases against golden.

TEST(Golden, CanonicalStartSets) {
  const std::vector<std::vector<std::int32_t>> sets = {
      {8192, 127, 31, 8192}, {8192, 127, 128, 255}, {8192, 0, 2, 3}, {16382, 16382, 0, 8702}};
  for (bool permuted : {false, true}) {
    pg::FixtureTables fx(4, pg::PoolSizes{}, permuted);
    for (const auto& starts : sets) {
      for (int commit : {-1, 1}) {
        SCOPED_TRACE(::testing::Message()
                     << "start " << starts[0] << "," << starts[1] << "," << starts[2] << ","
                     << starts[3] << " commit " << commit << " permuted " << permuted);
        const pg::StepShape sh{4, 2, commit};
        pg::StepMetadata md(starts, sh, fx.tables(), fx.pools, kCfg);
        expect_matches_golden(md, golden_step(starts, sh, fx.tables(), fx.pools));
        expect_builders_match_golden(starts, sh, fx.tables(), fx.pools);
      }
    }
  }
}

// Random tables: entries are random blocks of the pool, some -1 (unmapped), random width
// (sometimes narrower than max_seq_len needs).
td::Tensor<std::int32_t, 2> random_table(tdtest::Rng& rng, index_t rows, index_t cols,
                                         index_t blocks) {
  td::Tensor<std::int32_t, 2> t({rows, cols});
  for (auto& e : t.flat())
    e = rng.integer(0, 9) == 0 ? -1 : std::int32_t(rng.integer(0, blocks - 1));
  return t;
}

TEST(Golden, RandomSeededCases) {
  tdtest::Rng rng(20260101);
  for (int iter = 0; iter < 200; ++iter) {
    const int B = int(rng.integer(1, 9)), S = int(rng.integer(1, 5));
    const int commit = int(rng.integer(-1, S));
    pg::PoolSizes pools{rng.integer(1, 300), rng.integer(1, 80),  rng.integer(1, 90),
                        rng.integer(1, 100), rng.integer(1, 100), rng.integer(1, 100)};
    const index_t extra_rows = rng.integer(0, 2);
    // Mostly full widths, sometimes narrower (columns past the table map to -1).
    auto width = [&](index_t full) { return rng.integer(0, 3) == 0 ? rng.integer(1, full) : full; };
    auto t_ori = random_table(rng, B + extra_rows, width(128), pools.ori);
    auto t_cmp = random_table(rng, B + extra_rows, width(32), pools.cmp);
    auto t_idx = random_table(rng, B + extra_rows, width(64), pools.idx);
    auto t_hst = random_table(rng, B + extra_rows, width(2048), pools.hca_state);
    auto t_cst = random_table(rng, B + extra_rows, width(4096), pools.csa_state);
    auto t_ist = random_table(rng, B + extra_rows, width(4096), pools.csa_inner_state);
    const pg::StepTables tb{t_ori.view(), t_cmp.view(), t_idx.view(),
                            t_hst.view(), t_cst.view(), t_ist.view()};
    std::vector<std::int32_t> starts(B);
    for (auto& s : starts) {
      // Bias towards boundaries and page edges.
      switch (rng.integer(0, 3)) {
        case 0:
          s = std::int32_t(rng.integer(0, 16384 - S));
          break;
        case 1:
          s = std::int32_t(rng.integer(0, 300));
          break;
        case 2:
          s = std::int32_t(
              std::min<index_t>(16384 - S, rng.integer(1, 127) * 128 - rng.integer(0, 3)));
          break;
        default:
          s = std::int32_t(16384 - S - rng.integer(0, 5));
          break;
      }
    }
    const pg::StepShape sh{B, S, commit};
    SCOPED_TRACE(::testing::Message() << "iter " << iter << " B " << B << " S " << S);
    pg::StepMetadata md(9, 5, kCfg);
    md.build(starts, sh, tb, pools, kCfg);
    expect_matches_golden(md, golden_step(starts, sh, tb, pools));
    expect_builders_match_golden(starts, sh, tb, pools);
  }
}

TEST(StepMetadata, RebuildReusesBuffersAndTracksShape) {
  pg::FixtureTables fx(8);
  pg::StepMetadata md(8, 2, kCfg);
  const auto* pos_ptr = md.position_ids().data();
  const std::vector<std::int32_t> a = {8192, 0, 2, 3, 4, 5, 6, 7};
  const std::vector<std::int32_t> b = {100, 200};
  md.build(a, {8, 2}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.position_ids().extent(0), 16);
  md.build(b, {2, 1}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.position_ids().data(), pos_ptr);  // no reallocation
  EXPECT_EQ(md.position_ids().extent(0), 2);
  EXPECT_EQ(md.kv_seq_lens().extent(0), 2);
  EXPECT_EQ(md.window_indices().extent(0), 2);
  expect_matches_golden(md, golden_step(b, {2, 1}, fx.tables(), fx.pools));
  // Tables with more rows than B are accepted (rows 0..B-1 used).
  EXPECT_EQ(md.tables().block_table.extent(0), 8);
}

// ---------------------------------------------------------------------------------------------
// Properties.

TEST(Properties, SlotsInsidePoolAndOneBoundaryPerRequest) {
  tdtest::Rng rng(7);
  for (int iter = 0; iter < 100; ++iter) {
    const int B = int(rng.integer(1, 16));
    const int S = int(rng.integer(1, 3));  // S < 4 = smallest ratio
    pg::FixtureTables fx(B, pg::PoolSizes::for_batch(B), rng.integer(0, 1) == 1);
    std::vector<std::int32_t> starts(B);
    for (auto& s : starts) s = std::int32_t(rng.integer(0, 16384 - S));
    pg::StepMetadata md(starts, {B, S}, fx.tables(), fx.pools, kCfg);
    const auto& p = fx.pools;
    auto inside = [](td::ConstView<std::int64_t, 1> m, index_t rows) {
      for (index_t t = 0; t < m.extent(0); ++t) {
        EXPECT_GE(m(t), -1);
        EXPECT_LT(m(t), rows);
      }
    };
    inside(md.ori_slot_mapping(), p.ori * 128);
    inside(md.hca_cmp_slot_mapping(), p.cmp * 128);
    inside(md.csa_cmp_slot_mapping(), p.cmp * 128);
    inside(md.csa_idx_slot_mapping(), p.idx * 128);
    inside(md.hca_state_slot_mapping(), p.hca_state * 8);
    inside(md.csa_state_slot_mapping(), p.csa_state * 4);
    inside(md.csa_inner_state_slot_mapping(), p.csa_inner_state * 4);
    for (index_t t = 0; t < md.window_indices().extent(0); ++t)
      for (index_t k = 0; k < 128; ++k) {
        EXPECT_GE(md.window_indices()(t, k), -1);
        EXPECT_LT(md.window_indices()(t, k), p.ori * 128);
      }
    for (int b = 0; b < B; ++b) {
      int n4 = 0, n128 = 0;
      for (int s = 0; s < S; ++s) {
        n4 += md.csa_cmp_slot_mapping()(b * S + s) >= 0;
        n128 += md.hca_cmp_slot_mapping()(b * S + s) >= 0;
      }
      EXPECT_LE(n4, 1);
      EXPECT_LE(n128, 1);
      // The boundary sits at s* = R - 1 - start % R when start % R + S >= R (spec §3.5).
      for (int R : {4, 128}) {
        const int sstar = R - 1 - starts[b] % R;
        const auto& m = R == 4 ? md.csa_cmp_slot_mapping() : md.hca_cmp_slot_mapping();
        for (int s = 0; s < S; ++s) EXPECT_EQ(m(b * S + s) >= 0, s == sstar) << "R " << R;
      }
    }
  }
}

TEST(Properties, WindowsOldestToNewestEndingAtTheToken) {
  // Non-aliasing random tables (every (b, c) gets its own block) so a slot maps back to a unique
  // position.
  tdtest::Rng rng(11);
  for (int iter = 0; iter < 30; ++iter) {
    const int B = int(rng.integer(1, 6)), S = int(rng.integer(1, 4));
    const index_t cols = 128, blocks = B * cols;
    std::vector<std::int32_t> perm(blocks);
    std::iota(perm.begin(), perm.end(), 0);
    for (index_t i = blocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.integer(0, i)]);
    td::Tensor<std::int32_t, 2> table({B, cols});
    std::map<std::int64_t, std::pair<int, index_t>> owner;  // block → (b, col)
    for (int b = 0; b < B; ++b)
      for (index_t c = 0; c < cols; ++c) {
        table.view()(b, c) = perm[b * cols + c];
        owner[perm[b * cols + c]] = {b, c};
      }
    std::vector<std::int32_t> starts(B);
    for (auto& s : starts) s = std::int32_t(rng.integer(0, 16384 - S));
    const pg::StepShape sh{B, S};
    const index_t T = sh.tokens();
    std::vector<std::int32_t> pos(T), win(T * 128), lens(T);
    std::vector<std::int64_t> ori(T);
    td::View<std::int32_t, 1> pv(pos.data(), {T});
    pg::build_position_ids(pv, starts, sh, kCfg);
    pg::build_window_indices(td::View<std::int32_t, 2>(win.data(), {T, 128}),
                             td::View<std::int32_t, 1>(lens.data(), {T}), pv, table.view(), blocks,
                             sh, kCfg);
    pg::build_ori_slot_mapping(td::View<std::int64_t, 1>(ori.data(), {T}), pv, table.view(), blocks,
                               sh, kCfg);
    for (index_t t = 0; t < T; ++t) {
      const int b = int(t / S);
      const index_t len = lens[t];
      ASSERT_EQ(len, std::min<index_t>(128, pos[t] + 1));
      index_t prev = -1;
      for (index_t k = 0; k < len; ++k) {
        const std::int64_t slot = win[t * 128 + k];
        ASSERT_GE(slot, 0);
        const auto [ob, col] = owner.at(slot / 128);
        EXPECT_EQ(ob, b);
        const index_t p = col * 128 + slot % 128;
        if (k > 0) {
          EXPECT_EQ(p, prev + 1);  // strictly oldest → newest, contiguous
        }
        prev = p;
      }
      EXPECT_EQ(prev, pos[t]);                    // ends at the token itself
      EXPECT_EQ(win[t * 128 + len - 1], ori[t]);  // = the token's own ori slot
      for (index_t k = len; k < 128; ++k) EXPECT_EQ(win[t * 128 + k], -1);
      // Causality (S > 1): no token lists a later position of its own request.
      if (t % S + 1 < S) {
        for (index_t k = 0; k < 128; ++k) EXPECT_NE(win[t * 128 + k], ori[t + 1]);
      }
    }
  }
}

TEST(Properties, UnmappedPageGivesMinusOneRun) {
  // Page 63 of request 0 unmapped: the window of pos 8192 has -1 for positions 8065..8191 and the
  // token's own slot last; ori slot of a token in an unmapped page is -1.
  pg::FixtureTables fx(4);
  fx.block_table.view()(0, 63) = -1;
  fx.block_table.view()(1, 0) = -1;
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.window_lens()(0), 128);
  for (index_t k = 0; k < 127; ++k) EXPECT_EQ(md.window_indices()(0, k), -1);
  EXPECT_EQ(md.window_indices()(0, 127), 0);
  EXPECT_EQ(md.ori_slot_mapping()(2), -1);
  EXPECT_EQ(md.window_indices()(2, 0), -1);
  expect_matches_golden(md, golden_step(starts, {4, 2}, fx.tables(), fx.pools));
}

TEST(Properties, ColumnsPastTheTableAreMinusOne) {
  // A table narrower than max_seq_len / page is allowed: positions past it get -1 slots.
  td::Tensor<std::int32_t, 2> table({1, 2});
  table.view()(0, 0) = 5;
  table.view()(0, 1) = 6;
  const std::vector<std::int32_t> pos = {255, 256};
  std::vector<std::int64_t> out(2, -7);
  pg::build_ori_slot_mapping(td::View<std::int64_t, 1>(out.data(), {2}),
                             td::ConstView<std::int32_t, 1>(pos.data(), {2}), table.view(), 8,
                             {1, 2}, kCfg);
  EXPECT_EQ(out, (std::vector<std::int64_t>{6 * 128 + 127, -1}));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: Error names the argument and the value; the output is untouched (poisoned).

constexpr std::int32_t kPoison32 = 0x5a5a5a5a;
constexpr std::int64_t kPoison64 = 0x5a5a5a5a5a5a5a5aLL;

TEST(BadInput, PositionIdsAndLens) {
  const pg::StepShape sh{4, 2};
  std::vector<std::int32_t> out(8, kPoison32), lens(4, kPoison32);
  td::View<std::int32_t, 1> ov(out.data(), {8}), lv(lens.data(), {4});
  auto both = [&](std::vector<std::int32_t> starts, pg::StepShape s,
                  std::initializer_list<std::string> needles) {
    expect_error([&] { pg::build_position_ids(ov, starts, s, kCfg); }, needles);
    expect_error([&] { pg::build_kv_seq_lens(lv, starts, s, kCfg); }, needles);
  };
  both({8192, -1, 2, 3}, sh, {"start[1]", "-1"});                  // start < 0
  both({8192, 0, 16383, 3}, sh, {"start[2]", "16383", "16383)"});  // start + S > max
  both({8192, 0, 2}, sh, {"start.size()", "3"});                   // batch mismatch
  both({1, 2, 3, 4}, {0, 2}, {"shape.batch", "0"});
  both({1, 2, 3, 4}, {4, 0}, {"shape.seq", "0"});
  both({1, 2, 3, 4}, {4, 2, 3}, {"shape.commit_tokens", "3"});
  expect_error(
      [&] {
        pg::build_position_ids(ov.slice(0, 0, 7), std::vector<std::int32_t>{1, 2, 3, 4}, sh, kCfg);
      },
      {"position_ids.extent(0)", "7"});
  expect_error(
      [&] {
        pg::build_kv_seq_lens(lv.slice(0, 0, 3), std::vector<std::int32_t>{1, 2, 3, 4}, sh, kCfg);
      },
      {"kv_seq_lens.extent(0)", "3"});
  EXPECT_EQ(out, std::vector<std::int32_t>(8, kPoison32));
  EXPECT_EQ(lens, std::vector<std::int32_t>(4, kPoison32));
  // The largest valid start is accepted.
  pg::build_position_ids(ov, std::vector<std::int32_t>{16382, 0, 0, 0}, sh, kCfg);
  EXPECT_EQ(out[1], 16383);
}

struct SlotCase {
  pg::FixtureTables fx{4};
  std::vector<std::int32_t> pos = {8192, 8193, 0, 1, 2, 3, 3, 4};
  std::vector<std::int64_t> out = std::vector<std::int64_t>(8, kPoison64);
  std::vector<std::int32_t> win = std::vector<std::int32_t>(8 * 128, kPoison32);
  std::vector<std::int32_t> wlens = std::vector<std::int32_t>(8, kPoison32);
  td::ConstView<std::int32_t, 1> pv() const { return {pos.data(), {index_t(pos.size())}}; }
  td::View<std::int64_t, 1> ov() { return {out.data(), {8}}; }
  td::View<std::int32_t, 2> wv() { return {win.data(), {8, 128}}; }
  td::View<std::int32_t, 1> lv() { return {wlens.data(), {8}}; }
  void expect_untouched() const {
    EXPECT_EQ(out, std::vector<std::int64_t>(8, kPoison64));
    EXPECT_EQ(win, std::vector<std::int32_t>(8 * 128, kPoison32));
    EXPECT_EQ(wlens, std::vector<std::int32_t>(8, kPoison32));
  }
};

TEST(BadInput, OriSlotMapping) {
  const pg::StepShape sh{4, 2};
  SlotCase c;
  auto run = [&](td::ConstView<std::int32_t, 2> table, index_t P) {
    pg::build_ori_slot_mapping(c.ov(), c.pv(), table, P, sh, kCfg);
  };
  c.fx.block_table.view()(3, 0) = 128;  // block id >= pool size (read by token 6, last)
  expect_error([&] { run(c.fx.block_table.view(), 128); },
               {"block_table[3,0]", "128", "[-1, 128)"});
  c.fx.block_table.view()(3, 0) = -2;  // < -1
  expect_error([&] { run(c.fx.block_table.view(), 128); }, {"block_table[3,0]", "-2"});
  c.fx.block_table.view()(3, 0) = 3;
  // Table too narrow: fewer rows than B.
  expect_error([&] { run(c.fx.block_table.view().slice(0, 0, 3), 128); },
               {"block_table.extent(0)", "3", ">= 4"});
  expect_error([&] { run(c.fx.block_table.view(), 0); }, {"num_blocks", "0"});
  // Shape mismatches.
  expect_error(
      [&] {
        pg::build_ori_slot_mapping(c.ov().slice(0, 0, 7), c.pv(), c.fx.block_table.view(), 128, sh,
                                   kCfg);
      },
      {"slot_mapping.extent(0)", "7"});
  expect_error(
      [&] {
        pg::build_ori_slot_mapping(c.ov(), c.pv().slice(0, 0, 6), c.fx.block_table.view(), 128, sh,
                                   kCfg);
      },
      {"position_ids.extent(0)", "6"});
  c.pos[5] = 16384;  // position past max_seq_len
  expect_error([&] { run(c.fx.block_table.view(), 128); }, {"position_ids[5]", "16384"});
  c.pos[5] = -3;
  expect_error([&] { run(c.fx.block_table.view(), 128); }, {"position_ids[5]", "-3"});
  c.expect_untouched();
}

TEST(BadInput, CompressedAndStateSlotMappings) {
  const pg::StepShape sh{4, 2};
  SlotCase c;
  auto cmp = [&](int ratio, index_t P) {
    pg::build_compressed_slot_mapping(c.ov(), c.pv(), c.fx.cmp_block_table.view(), P, ratio, sh,
                                      kCfg);
  };
  expect_error([&] { cmp(5, 32); }, {"ratio", "5"});
  // The boundary token (request 3, pos 3) reads column 0 of row 3.
  c.fx.cmp_block_table.view()(3, 0) = 32;
  expect_error([&] { cmp(4, 32); }, {"cmp_block_table[3,0]", "32", "[-1, 32)"});
  // Only entries actually read are validated: with commit_tokens = 0 nothing is read.
  pg::build_compressed_slot_mapping(c.ov(), c.pv(), c.fx.cmp_block_table.view(), 32, 4, {4, 2, 0},
                                    kCfg);
  EXPECT_EQ(c.out, std::vector<std::int64_t>(8, -1));
  std::fill(c.out.begin(), c.out.end(), kPoison64);
  c.fx.cmp_block_table.view()(3, 0) = 3;
  expect_error(
      [&] {
        pg::build_compressed_slot_mapping(
            c.ov(), c.pv(), c.fx.cmp_block_table.view().slice(0, 0, 2), 32, 4, sh, kCfg);
      },
      {"cmp_block_table.extent(0)", "2"});
  std::fill(c.out.begin(), c.out.end(), kPoison64);

  auto st = [&](int page, index_t P) {
    pg::build_state_slot_mapping(c.ov(), c.pv(), c.fx.csa_state_table.view(), P, page, sh, kCfg);
  };
  expect_error([&] { st(5, 65); }, {"state_page", "5"});
  c.fx.csa_state_table.view()(1, 0) = 65;
  expect_error([&] { st(4, 65); }, {"state_table[1,0]", "65", "[-1, 65)"});
  c.fx.csa_state_table.view()(1, 0) = -5;
  expect_error([&] { st(4, 65); }, {"state_table[1,0]", "-5"});
  c.expect_untouched();
}

TEST(BadInput, WindowIndices) {
  const pg::StepShape sh{4, 2};
  SlotCase c;
  auto run = [&](index_t P) {
    pg::build_window_indices(c.wv(), c.lv(), c.pv(), c.fx.block_table.view(), P, sh, kCfg);
  };
  // pos 8192's window reaches back into logical block 63 (the previous page).
  c.fx.block_table.view()(0, 63) = 200;
  expect_error([&] { run(128); }, {"block_table[0,63]", "200"});
  c.fx.block_table.view()(0, 63) = 124;
  expect_error([&] { run((index_t(1) << 24) + 1); }, {"num_blocks", "16777217"});  // INT32 slots
  expect_error(
      [&] {
        pg::build_window_indices(c.wv().slice(1, 0, 127), c.lv(), c.pv(), c.fx.block_table.view(),
                                 128, sh, kCfg);
      },
      {"window_indices.extent(1)", "127"});
  expect_error(
      [&] {
        pg::build_window_indices(c.wv(), c.lv().slice(0, 0, 4), c.pv(), c.fx.block_table.view(),
                                 128, sh, kCfg);
      },
      {"window_lens.extent(0)", "4"});
  expect_error(
      [&] {
        pg::build_window_indices(c.wv().slice(0, 0, 4), c.lv(), c.pv(), c.fx.block_table.view(),
                                 128, sh, kCfg);
      },
      {"window_indices.extent(0)", "4"});
  expect_error(
      [&] {
        pg::build_window_indices(c.wv(), c.lv(), c.pv(), c.fx.block_table.view().slice(0, 0, 1),
                                 128, sh, kCfg);
      },
      {"block_table.extent(0)", "1"});
  c.expect_untouched();
}

TEST(BadInput, StepMetadataBuildIsAllOrNothing) {
  const std::vector<std::int32_t> good = {8192, 0, 2, 3};
  pg::FixtureTables fx(4);
  pg::StepMetadata md(good, {4, 2}, fx.tables(), fx.pools, kCfg);
  const GoldenStep before = golden_step(good, {4, 2}, fx.tables(), fx.pools);
  const std::vector<std::int32_t> other = {100, 200, 300, 400};
  auto bad_build = [&](std::vector<std::int32_t> starts, pg::StepShape sh, const pg::StepTables& tb,
                       pg::PoolSizes pools, std::initializer_list<std::string> needles) {
    expect_error([&] { md.build(starts, sh, tb, pools, kCfg); }, needles);
    expect_matches_golden(md, before);
    EXPECT_EQ(md.shape().seq, 2);
  };
  bad_build({100, 200, -1, 400}, {4, 2}, fx.tables(), fx.pools, {"start[2]", "-1"});
  bad_build({100, 200, 16383, 400}, {4, 2}, fx.tables(), fx.pools, {"start[2]", "16383"});
  bad_build(other, {5, 2}, fx.tables(), fx.pools, {"shape.batch", "5"});  // > max_batch
  bad_build(other, {4, 3}, fx.tables(), fx.pools, {"shape.seq", "3"});    // > max_seq
  pg::PoolSizes small = fx.pools;
  small.csa_inner_state = 0;
  bad_build(other, {4, 2}, fx.tables(), small, {"pools.csa_inner_state", "0"});
  // A bad entry in the LAST table validated: every earlier output must stay untouched.
  auto tb = fx.tables();
  td::Tensor<std::int32_t, 2> inner = fx.csa_inner_state_table;
  inner.view()(3, 100) = 65;  // request 3 at start 400 → pos 400 / 4 = column 100
  tb.csa_inner_state_table = inner.view();
  bad_build(other, {4, 2}, tb, fx.pools, {"csa_inner_state_table[3,100]", "65"});
  tb = fx.tables();
  tb.idx_block_table = fx.idx_block_table.view().slice(0, 0, 3);  // too narrow
  bad_build(other, {4, 2}, tb, fx.pools, {"idx_block_table.extent(0)", "3"});
  pg::StepMetadata empty;
  expect_error(
      [&] {
        empty.build(good, {4, 2}, fx.tables(), fx.pools, kCfg);
      },
      {"default-constructed"});
}

// =============================================================================================
// HEAD addendum layouts: #862 device ring (§2) and #955 prefix caching (§3).

using pg::Layout;
using pg::Table;

// Golden bundle for any layout and config, from the golden twins: ori and windows as in the base
// spec (no ring, §2.3.1), compressed / index / state slots through the addendum's own formulas
// (§2.2 #862 form, §3.2 prefix form). Groups whose table has no columns are not served (-1).
GoldenStep golden_step_cfg(std::span<const std::int32_t> starts, const pg::StepShape& sh,
                           const pg::StepTables& tb, const td::ModelConfig& cfg) {
  const index_t T = sh.tokens(), B = sh.batch, W = cfg.window;
  GoldenStep g;
  g.pos.resize(T);
  g.lens.resize(B);
  g.win.resize(T * W);
  g.wlens.resize(T);
  for (auto* v :
       {&g.ori, &g.hca_cmp, &g.csa_cmp, &g.csa_idx, &g.hca_state, &g.csa_state, &g.csa_inner})
    v->assign(T, -1);
  td::View<std::int32_t, 1> pos(g.pos.data(), {T});
  gd::build_position_ids(pos, starts, sh, cfg);
  gd::build_kv_seq_lens(td::View<std::int32_t, 1>(g.lens.data(), {B}), starts, sh, cfg);
  auto v1 = [&](std::vector<std::int64_t>& v) { return td::View<std::int64_t, 1>(v.data(), {T}); };
  gd::build_ori_slot_mapping(v1(g.ori), pos, tb.block_table, 0, sh, cfg);
  gd::build_window_indices(td::View<std::int32_t, 2>(g.win.data(), {T, W}),
                           td::View<std::int32_t, 1>(g.wlens.data(), {T}), pos, tb.block_table, 0,
                           sh, cfg);
  if (tb.layout == Layout::base) {
    gd::build_compressed_slot_mapping(v1(g.hca_cmp), pos, tb.cmp_block_table, 0, 128, sh, cfg);
    gd::build_compressed_slot_mapping(v1(g.csa_cmp), pos, tb.cmp_block_table, 0, 4, sh, cfg);
    gd::build_compressed_slot_mapping(v1(g.csa_idx), pos, tb.idx_block_table, 0, 4, sh, cfg);
    gd::build_state_slot_mapping(v1(g.hca_state), pos, tb.hca_state_table, 0, cfg.c128_state_page,
                                 sh, cfg);
    gd::build_state_slot_mapping(v1(g.csa_state), pos, tb.csa_state_table, 0, cfg.c4_state_page, sh,
                                 cfg);
    gd::build_state_slot_mapping(v1(g.csa_inner), pos, tb.csa_inner_state_table, 0,
                                 cfg.c4_state_page, sh, cfg);
    return g;
  }
  const auto bc = tb.block_counts;
  auto served = [](td::ConstView<std::int32_t, 2> t) { return t.extent(1) > 0; };
  int col_hs = 4, col_cs = 5, col_ci = 6;
  if (tb.layout == Layout::device_ring) {  // #862 groups: 0 ori, 1 cmp, 2 idx, 3..5 states
    col_hs = 3, col_cs = 4, col_ci = 5;
    if (served(tb.cmp_block_table)) {
      gd::build_ring862_compressed_slot_mapping(v1(g.hca_cmp), pos, tb.cmp_block_table, bc, 1, 128,
                                                sh, cfg);
      if (served(tb.csa_state_table))
        gd::build_ring862_compressed_slot_mapping(v1(g.csa_cmp), pos, tb.cmp_block_table, bc, 1, 4,
                                                  sh, cfg);
    }
    if (served(tb.idx_block_table))
      gd::build_ring862_compressed_slot_mapping(v1(g.csa_idx), pos, tb.idx_block_table, bc, 2, 4,
                                                sh, cfg);
  } else {  // §3.1 groups: 1 HCA cmp, 2 CSA cmp, 3 idx, 4..6 states
    if (served(tb.hca_cmp_block_table))
      gd::build_prefix_compressed_slot_mapping(v1(g.hca_cmp), pos, tb.hca_cmp_block_table, bc, 1,
                                               128, sh, cfg);
    if (served(tb.csa_cmp_block_table))
      gd::build_prefix_compressed_slot_mapping(v1(g.csa_cmp), pos, tb.csa_cmp_block_table, bc, 2, 4,
                                               sh, cfg);
    if (served(tb.idx_block_table))
      gd::build_prefix_compressed_slot_mapping(v1(g.csa_idx), pos, tb.idx_block_table, bc, 3, 4, sh,
                                               cfg);
  }
  if (served(tb.hca_state_table))
    gd::build_ring_state_slot_mapping(v1(g.hca_state), pos, tb.hca_state_table, bc, col_hs,
                                      cfg.c128_state_page, sh);
  if (served(tb.csa_state_table))
    gd::build_ring_state_slot_mapping(v1(g.csa_state), pos, tb.csa_state_table, bc, col_cs,
                                      cfg.c4_state_page, sh);
  if (served(tb.csa_inner_state_table))
    gd::build_ring_state_slot_mapping(v1(g.csa_inner), pos, tb.csa_inner_state_table, bc, col_ci,
                                      cfg.c4_state_page, sh);
  return g;
}

// Every written slot lies in its pool, and (periodic tables, option (a)) the row a ring writer
// wrote is the row the unwrapped reader reads: compressed row c through golden's reader rule with
// md.rows_per_page, state position p through table[b, p / SB].
void expect_readers_agree(const pg::StepMetadata& md) {
  const auto& sh = md.shape();
  const auto pos = md.position_ids();
  for (int g = 0; g < td::rules::kNumTables; ++g) {
    const Table tb = Table(g);
    const auto map = md.slot_mapping(tb);
    const index_t rows = md.rows_per_page(tb);
    for (index_t t = 0; t < map.extent(0); ++t) {
      const std::int64_t slot = map(t);
      ASSERT_GE(slot, -1);
      ASSERT_LT(slot, md.pool_rows(tb)) << "table " << g << " token " << t;
      if (slot < 0) continue;
      const index_t b = t / sh.seq, p = pos(t);
      const int ratio = td::rules::table_ratio(tb);
      const bool state = td::rules::is_state_table(tb);
      const index_t row = (state || tb == Table::ori) ? p : p / ratio;
      EXPECT_EQ(gd::compressed_row_slot(md.table(tb), b, row, rows), slot)
          << "table " << g << " token " << t;
    }
  }
}

// A periodic ring table: row b repeats n_b entries (pages of the pool, ~10 % -1) over the full
// width; n_b is written to counts(b, col) (option (a) tables, what every reference fixture does).
td::Tensor<std::int32_t, 2> ring_table(tdtest::Rng& rng, index_t rows, index_t width,
                                       index_t blocks, td::Tensor<std::int32_t, 2>& counts,
                                       int col) {
  td::Tensor<std::int32_t, 2> t({rows, width});
  for (index_t b = 0; b < rows; ++b) {
    const index_t n = rng.integer(0, 2) == 0 ? rng.integer(1, std::min<index_t>(width, 9))
                                             : rng.integer(1, width);
    if (b < counts.extent(0)) counts.view()(b, col) = std::int32_t(n);
    std::vector<std::int32_t> e(n);
    for (auto& x : e) x = rng.integer(0, 9) == 0 ? -1 : std::int32_t(rng.integer(0, blocks - 1));
    for (index_t c = 0; c < width; ++c) t.view()(b, c) = e[c % n];
  }
  return t;
}

// Random periodic tables of a ring layout, widths covering cfg.max_seq_len.
struct RingSetup {
  td::ModelConfig cfg;
  pg::PoolSizes pools;
  Layout layout = Layout::prefix_caching;
  td::Tensor<std::int32_t, 2> ori, cmp, idx, hst, cst, ist, hcmp, ccmp, counts;
  pg::StepTables tables() const {
    pg::StepTables t{ori.view(), cmp.view(), idx.view(), hst.view(), cst.view(), ist.view()};
    t.layout = layout;
    t.hca_cmp_block_table = hcmp.view();
    t.csa_cmp_block_table = ccmp.view();
    t.block_counts = counts.view();
    return t;
  }
};

RingSetup random_ring_setup(tdtest::Rng& rng, Layout layout, int B, const td::ModelConfig& cfg) {
  RingSetup r;
  r.cfg = cfg;
  r.layout = layout;
  r.pools = pg::PoolSizes{rng.integer(1, 300), rng.integer(1, 80),  rng.integer(1, 90),
                          rng.integer(1, 100), rng.integer(1, 100), rng.integer(1, 100),
                          rng.integer(1, 80),  rng.integer(1, 80)};
  const index_t rows = B + rng.integer(0, 2);
  auto cdiv = [](index_t a, index_t b) { return (a + b - 1) / b; };
  const index_t ori_cols = cdiv(cfg.max_seq_len, cfg.page);
  r.counts = td::Tensor<std::int32_t, 2>({rows, td::rules::block_counts_width(layout)});
  // Column 0 (ori) is never read (§2.3.1): garbage there must not matter.
  for (index_t b = 0; b < rows; ++b) r.counts.view()(b, 0) = std::int32_t(rng.integer(-5, 5));
  r.ori = random_table(rng, rows, ori_cols, r.pools.ori);
  const int c = layout == Layout::prefix_caching ? 1 : 0;  // prefix columns are one further
  if (layout == Layout::prefix_caching) {
    r.hcmp = ring_table(rng, rows, ori_cols, r.pools.hca_cmp, r.counts, 1);
    r.ccmp = ring_table(rng, rows, ori_cols, r.pools.csa_cmp, r.counts, 2);
    r.idx = ring_table(rng, rows, ori_cols, r.pools.idx, r.counts, 3);
  } else {
    const index_t cmp_cols = cdiv(cfg.score_len(), cfg.page);
    r.cmp = ring_table(rng, rows, cmp_cols, r.pools.cmp, r.counts, 1);
    r.idx = ring_table(rng, rows, 2 * cmp_cols, r.pools.idx, r.counts, 2);
  }
  r.hst = ring_table(rng, rows, cdiv(cfg.max_seq_len, cfg.c128_state_page), r.pools.hca_state,
                     r.counts, 3 + c);
  r.cst = ring_table(rng, rows, cdiv(cfg.max_seq_len, cfg.c4_state_page), r.pools.csa_state,
                     r.counts, 4 + c);
  r.ist = ring_table(rng, rows, cdiv(cfg.max_seq_len, cfg.c4_state_page), r.pools.csa_inner_state,
                     r.counts, 5 + c);
  return r;
}

td::ModelConfig with_pages(int page, int c4, int c128, int max_seq = 16384) {
  td::ModelConfig c = td::flash_config();
  c.page = page;
  c.c4_state_page = c4;
  c.c128_state_page = c128;
  c.max_seq_len = max_seq;
  return c;
}

// The three compressor-state page pairings of addendum §7 (ratio-4 / ratio-128 SB).
constexpr int kStatePairs[3][2] = {{4, 8}, {8, 32}, {2, 8}};

std::vector<std::int32_t> random_starts(tdtest::Rng& rng, int B, int S, int max_seq) {
  std::vector<std::int32_t> starts(B);
  for (auto& s : starts) {
    switch (rng.integer(0, 3)) {
      case 0:
        s = std::int32_t(rng.integer(0, max_seq - S));
        break;
      case 1:
        s = std::int32_t(rng.integer(0, 300));
        break;
      case 2:
        s = std::int32_t(std::min<index_t>(
            max_seq - S, rng.integer(1, max_seq / 128 - 1) * 128 - rng.integer(0, 9)));
        break;
      default:
        s = std::int32_t(max_seq - S - rng.integer(0, 9));
        break;
    }
  }
  return starts;
}

// ---------------------------------------------------------------------------------------------
// Addendum §2.4: the #862 standalone fixture (B = 4, S = 2, page 128, 6 count groups).

struct Fixture862 {
  // Request r has counts (2 + r, ..., 7 + r) for groups 0..5; entries 1000 (g + 1) + 100 r + i.
  // `periodic`: every table repeats its n_g entries over the full width (option (a)); otherwise
  // cmp / idx fill only their first n_g columns (the rest -1), as the reference fixture does.
  explicit Fixture862(bool periodic) {
    const index_t widths[6] = {128, 32, 64, 2048, 4096, 4096};
    for (int g = 0; g < 6; ++g) t[g] = td::Tensor<std::int32_t, 2>({4, widths[g]});
    counts = td::Tensor<std::int32_t, 2>({4, 6});
    for (index_t r = 0; r < 4; ++r) {
      for (int g = 0; g < 6; ++g) {
        const index_t n = 2 + r + g;
        counts.view()(r, g) = std::int32_t(n);
        const bool repeat = periodic || g == 0 || g >= 3;
        for (index_t c = 0; c < widths[g]; ++c) {
          const bool live = repeat || c < n;
          t[g].view()(r, c) = live ? std::int32_t(1000 * (g + 1) + 100 * r + c % n) : -1;
        }
      }
    }
  }
  pg::StepTables tables() const {
    pg::StepTables tb{t[0].view(), t[1].view(), t[2].view(), t[3].view(), t[4].view(), t[5].view()};
    tb.layout = Layout::device_ring;
    tb.block_counts = counts.view();
    return tb;
  }
  static pg::PoolSizes pools() { return pg::PoolSizes{7000, 7000, 7000, 7000, 7000, 7000}; }
  td::Tensor<std::int32_t, 2> t[6], counts;
};

TEST(DeviceRing, WorkedExample862) {
  // Positions [126,127, 3,4, 8191,8192, 16382,16383].
  const std::vector<std::int32_t> starts = {126, 3, 8191, 16382};
  Fixture862 fx(true);
  pg::StepMetadata md(starts, {4, 2}, fx.tables(), Fixture862::pools(), kCfg);
  EXPECT_EQ(to_vec(md.position_ids()),
            (std::vector<std::int32_t>{126, 127, 3, 4, 8191, 8192, 16382, 16383}));
  // Request 2, p = 8191 (token 4): a ratio-4 and a ratio-128 boundary.
  EXPECT_EQ(md.ori_slot_mapping()(4), 154111);             // column 63 → 1200 + 63 mod 4 = 1203
  EXPECT_EQ(md.csa_cmp_slot_mapping()(4), 281727);         // c 2047, 15 mod 5 = 0 → 2200
  EXPECT_EQ(md.hca_cmp_slot_mapping()(4), 281663);         // c 63, column 0 mod 5 → 2200
  EXPECT_EQ(md.csa_idx_slot_mapping()(4), 410111);         // 15 mod 6 = 3 → 3203
  EXPECT_EQ(md.hca_state_slot_mapping()(4), 33615);        // 1023 mod 7 = 1 → 4201
  EXPECT_EQ(md.csa_state_slot_mapping()(4), 20831);        // 2047 mod 8 = 7 → 5207
  EXPECT_EQ(md.csa_inner_state_slot_mapping()(4), 24819);  // 2047 mod 9 = 4 → 6204
  expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, fx.tables(), kCfg));
  expect_readers_agree(md);
  EXPECT_EQ(md.rows_per_page(Table::csa_cmp), 128);
  EXPECT_EQ(md.csa_cmp_block_table().data(), md.hca_cmp_block_table().data());  // shared (#862)
}

TEST(DeviceRing, ReferenceFixtureIsNotPeriodicAndRejected) {
  // [AMBIGUOUS addendum §2.3.2] option (a): the literal #862 fixture fills only the first n_g
  // columns of cmp / idx, so the readers of request 2 (p = 8192: CSA rows 0..2047 = columns
  // 0..15) would read columns the ring writers never address. Rejected, naming the entry.
  const std::vector<std::int32_t> starts = {126, 3, 8191, 16382};
  Fixture862 lit(false), per(true);
  pg::StepMetadata md(4, 2, kCfg);
  expect_error(
      [&] {
        md.build(starts, {4, 2}, lit.tables(), Fixture862::pools(), kCfg);
      },
      {"cmp_block_table[2,5]", "-1", "cmp_block_table[2,0] = 2200", "block_counts[2,1]", "periodic",
       "§2.3.2"});
  EXPECT_FALSE(md.built());
  auto tb = lit.tables();
  tb.cmp_block_table = per.t[1].view();
  expect_error(
      [&] {
        md.build(starts, {4, 2}, tb, Fixture862::pools(), kCfg);
      },
      {"idx_block_table[2,6]", "idx_block_table[2,0] = 3200"});
  tb.idx_block_table = per.t[2].view();
  md.build(starts, {4, 2}, tb, Fixture862::pools(), kCfg);
  EXPECT_EQ(md.csa_cmp_slot_mapping()(4), 281727);
}

// ---------------------------------------------------------------------------------------------
// Addendum §3.5: prefix-caching worked examples with the [MTP] fixture tables.

TEST(PrefixCaching, WorkedExampleB2) {
  const std::vector<std::int32_t> starts = {8318, 127};
  pg::FixtureTables fx(2, pg::PoolSizes{}, Layout::prefix_caching);
  // Decode-forward count convention n = (P_ori, P_c/B, P_c/B, P_i/B, P_hs, P_cs, P_ci).
  for (index_t b = 0; b < 2; ++b)
    EXPECT_EQ(to_vec(fx.block_counts.view().row(b)),
              (std::vector<std::int32_t>{128, 16, 16, 32, 64, 65, 65}));
  for (auto* t :
       {&fx.block_table, &fx.hca_cmp_block_table, &fx.csa_cmp_block_table, &fx.idx_block_table})
    EXPECT_EQ(t->extent(1), 128);              // 16384 / 128 source tokens per column
  EXPECT_EQ(fx.cmp_block_table.extent(1), 0);  // no shared table in this layout
  pg::StepMetadata md(starts, {2, 2}, fx.tables(), fx.pools, kCfg);
  using V = std::vector<std::int64_t>;
  EXPECT_EQ(to_vec(md.ori_slot_mapping()), (V{126, 127, 255, 384}));
  EXPECT_EQ(to_vec(md.hca_cmp_slot_mapping()), (V{-1, 0, 1, -1}));
  EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()), (V{-1, 31, 63, -1}));
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()), (V{-1, 31, 63, -1}));
  EXPECT_EQ(to_vec(md.hca_state_slot_mapping()), (V{246, 247, 255, 264}));
  EXPECT_EQ(to_vec(md.csa_state_slot_mapping()), (V{254, 255, 255, 0}));
  EXPECT_EQ(to_vec(md.csa_inner_state_slot_mapping()), (V{254, 255, 255, 0}));
  expect_matches_golden(md, golden_step_cfg(starts, {2, 2}, fx.tables(), kCfg));
  // Readers: CSA row c = 2079 through the unwrapped column 64 → 0·32 + 2079 mod 32 = 31; HCA row
  // 64 → hca[0, 64] = 0.
  EXPECT_EQ(md.rows_per_page(Table::csa_cmp), 32);
  EXPECT_EQ(md.rows_per_page(Table::idx), 32);
  EXPECT_EQ(md.rows_per_page(Table::hca_cmp), 1);
  EXPECT_EQ(td::rules::slot_of(md.csa_cmp_block_table(), 0, 2079, 32), 31);
  EXPECT_EQ(td::rules::slot_of(md.hca_cmp_block_table(), 0, 64, 1), 0);
  expect_readers_agree(md);
  EXPECT_EQ(md.pool_rows(Table::csa_cmp), 32 * 32);  // 32 pages of 32 rows (§3.4: not rescaled)
  EXPECT_EQ(md.pool_rows(Table::hca_cmp), 32);
  // [AMBIGUOUS §3.5] the two requests write CSA state row 255: build() reproduces it, the opt-in
  // allocator assertion names it.
  expect_error(
      [&] { md.check_disjoint_rows(); },
      {"csa_state_slot_mapping[2]", "255", "csa_state_slot_mapping[1]", "requests 0 and 1"});
  // Nothing changed.
  EXPECT_EQ(to_vec(md.csa_state_slot_mapping()), (V{254, 255, 255, 0}));
}

TEST(PrefixCaching, WorkedExampleB4CanonicalSets) {
  pg::FixtureTables fx(4, pg::PoolSizes{}, Layout::prefix_caching);
  for (index_t b = 0; b < 4; ++b)
    EXPECT_EQ(to_vec(fx.block_counts.view().row(b)),
              (std::vector<std::int32_t>{128, 8, 8, 16, 64, 65, 65}));
  using V = std::vector<std::int64_t>;
  {
    const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
    pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, kCfg);
    EXPECT_EQ(to_vec(md.ori_slot_mapping()), (V{0, 1, 128, 129, 258, 259, 387, 388}));
    // b = 2 (p = 3) → 64, b = 3 (p = 3) → 96 (base spec: 384 for b = 3).
    EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()), (V{-1, -1, -1, -1, -1, 64, 96, -1}));
    EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()), (V{-1, -1, -1, -1, -1, 64, 96, -1}));
    EXPECT_EQ(md.csa_state_slot_mapping()(6), 15);
    EXPECT_EQ(md.csa_state_slot_mapping()(7), 28);
    expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, fx.tables(), kCfg));
    expect_readers_agree(md);
  }
  {
    const std::vector<std::int32_t> starts = {8192, 127, 128, 255};
    pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, kCfg);
    // b = 1 (p = 127) → 1, b = 3 (p = 255) → page hca[3, 1] = 7.
    EXPECT_EQ(to_vec(md.hca_cmp_slot_mapping()), (V{-1, -1, 1, -1, -1, -1, 7, -1}));
    EXPECT_EQ(fx.hca_cmp_block_table.view()(3, 1), 7);
    expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, fx.tables(), kCfg));
  }
  // Every canonical set (spec §10.3, addendum §12.5), both commit modes, against golden.
  for (const auto& starts : std::vector<std::vector<std::int32_t>>{
           {8192, 127, 31, 8192}, {8192, 0, 2, 3}, {10, 2, 3, 4}, {16382, 16382, 0, 8702}}) {
    for (int commit : {-1, 1}) {
      pg::StepMetadata md(starts, {4, 2, commit}, fx.tables(), fx.pools, kCfg);
      expect_matches_golden(md, golden_step_cfg(starts, {4, 2, commit}, fx.tables(), kCfg));
      expect_readers_agree(md);
    }
  }
}

TEST(HeadLayouts, RandomPeriodicTablesAgainstGolden) {
  tdtest::Rng rng(20270216);
  for (int iter = 0; iter < (lean() ? 60 : 240); ++iter) {
    const Layout layout = iter % 2 ? Layout::prefix_caching : Layout::device_ring;
    const auto& pair = kStatePairs[rng.integer(0, 2)];
    const int page = layout == Layout::prefix_caching ? 128 : (rng.integer(0, 1) ? 32 : 128);
    const td::ModelConfig cfg =
        with_pages(page, pair[0], pair[1], rng.integer(0, 3) ? 16384 : 4096);
    static constexpr int kSeqs[] = {1, 2, 4, 8};
    const int B = int(rng.integer(1, 9)), S = kSeqs[rng.integer(0, 3)];
    const int commit = int(rng.integer(-1, S));
    RingSetup r = random_ring_setup(rng, layout, B, cfg);
    const auto starts = random_starts(rng, B, S, cfg.max_seq_len);
    const pg::StepShape sh{B, S, commit};
    SCOPED_TRACE(::testing::Message()
                 << "iter " << iter << " layout " << int(layout) << " B " << B << " S " << S
                 << " page " << page << " SB " << pair[0] << "/" << pair[1]);
    pg::StepMetadata md(9, 8, cfg);
    md.build(starts, sh, r.tables(), r.pools, cfg);
    expect_matches_golden(md, golden_step_cfg(starts, sh, r.tables(), cfg));
    expect_readers_agree(md);
  }
}

TEST(HeadLayouts, UnmappedEntryGivesExactlyMinusOne) {
  // [AMBIGUOUS addendum §2.3.4]: the device builder yields -P + r for a -1 entry; here exactly -1.
  pg::FixtureTables fx(2, pg::PoolSizes{}, Layout::prefix_caching);
  fx.csa_cmp_block_table.view()(0, 0) = -1;  // ring column 64 mod 16 = 0 (and, periodic, 16, ...)
  for (index_t c = 16; c < 128; c += 16) fx.csa_cmp_block_table.view()(0, c) = -1;
  fx.hca_cmp_block_table.view()(1, 0) = -1;
  for (index_t c = 16; c < 128; c += 16) fx.hca_cmp_block_table.view()(1, c) = -1;
  fx.csa_state_table.view()(1, 31) = -1;  // p = 127 → column 31 (< 65: no repetition in range)
  const std::vector<std::int32_t> starts = {8318, 127};
  pg::StepMetadata md(starts, {2, 2}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.csa_cmp_slot_mapping()(1), -1);
  EXPECT_EQ(md.hca_cmp_slot_mapping()(2), -1);
  EXPECT_EQ(md.csa_state_slot_mapping()(2), -1);
  EXPECT_EQ(md.csa_idx_slot_mapping()(1), 31);  // untouched tables unchanged
  expect_matches_golden(md, golden_step_cfg(starts, {2, 2}, fx.tables(), kCfg));
}

TEST(HeadLayouts, GroupsNotServedAreMinusOneAndUnread) {
  // A zero-column table = a group the deployment does not serve: slots -1, counts not read.
  pg::FixtureTables fx(4, pg::PoolSizes{}, Layout::prefix_caching);
  auto tb = fx.tables();
  tb.idx_block_table = {};
  tb.csa_inner_state_table = {};
  td::Tensor<std::int32_t, 2> counts = fx.block_counts;
  for (index_t b = 0; b < 4; ++b) counts.view()(b, 3) = counts.view()(b, 6) = 0;
  tb.block_counts = counts.view();
  pg::PoolSizes pools = fx.pools;
  pools.idx = 0;  // unread too
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::StepMetadata md(starts, {4, 2}, tb, pools, kCfg);
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()), std::vector<std::int64_t>(8, -1));
  EXPECT_EQ(to_vec(md.csa_inner_state_slot_mapping()), std::vector<std::int64_t>(8, -1));
  EXPECT_EQ(md.csa_cmp_slot_mapping()(5), 64);
  expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, tb, kCfg));
}

TEST(HeadLayouts, BaseLayoutIgnoresTheNewFields) {
  // The base layout stays bit-identical: block_counts and the split tables are never read.
  pg::FixtureTables fx(4);
  auto tb = fx.tables();
  td::Tensor<std::int32_t, 2> junk({4, 7});
  for (auto& e : junk.flat()) e = -77;
  tb.block_counts = junk.view();
  tb.hca_cmp_block_table = junk.view();
  tb.csa_cmp_block_table = junk.view();
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::StepMetadata md(starts, {4, 2}, tb, fx.pools, kCfg);
  expect_matches_golden(md, golden_step(starts, {4, 2}, fx.tables(), fx.pools));
  EXPECT_EQ(md.layout(), Layout::base);
  EXPECT_EQ(md.rows_per_page(Table::hca_cmp), 128);
  EXPECT_EQ(md.hca_cmp_block_table().data(), fx.cmp_block_table.data());
  EXPECT_EQ(md.pool_blocks(Table::csa_cmp), fx.pools.cmp);
}

TEST(HeadLayouts, CheckDisjointRowsPassesWithPerRequestPools) {
  // PoolSizes::per_request + the fixture generator: table[b, j] = j B + b, every slot disjoint.
  for (Layout layout : {Layout::base, Layout::device_ring, Layout::prefix_caching}) {
    for (int B : {1, 4, 64}) {
      const auto pools = pg::PoolSizes::per_request(B, layout, kCfg);
      pg::FixtureTables fx(B, pools, layout);
      tdtest::Rng rng(B);
      const auto starts = random_starts(rng, B, 8, kCfg.max_seq_len);
      pg::StepMetadata md(starts, {B, 8}, fx.tables(), fx.pools, kCfg);
      md.check_disjoint_rows();
      expect_matches_golden(md, golden_step_cfg(starts, {B, 8}, fx.tables(), kCfg));
    }
  }
  const auto p = pg::PoolSizes::per_request(4, Layout::prefix_caching, kCfg);
  EXPECT_EQ(p.csa_cmp, 512);  // addendum §3.4: 4 · 4096 / 32
  EXPECT_EQ(p.idx, 512);
  EXPECT_EQ(p.hca_cmp, 512);  // 4 · 128 one-row pages
  // The base fixture's CSA state pool (65, spec §3.8) collides too.
  pg::FixtureTables fx(4);
  pg::StepMetadata md(std::vector<std::int32_t>{4, 68, 0, 0}, {4, 1}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.csa_state_slot_mapping()(0), md.csa_state_slot_mapping()(1));
  expect_error([&] { md.check_disjoint_rows(); }, {"csa_state_slot_mapping[1]"});
}

TEST(HeadLayouts, RingBuildersAgainstGolden) {
  // The free ring builders (the pieces of StepMetadata::build) on the §3.5 B = 2 tables.
  pg::FixtureTables fx(2, pg::PoolSizes{}, Layout::prefix_caching);
  const std::vector<std::int32_t> pos = {8318, 8319, 127, 128};
  const td::ConstView<std::int32_t, 1> pv(pos.data(), {4});
  const pg::StepShape sh{2, 2};
  std::vector<std::int64_t> out(4, -7), want(4, -7);
  td::View<std::int64_t, 1> ov(out.data(), {4}), wv(want.data(), {4});
  pg::RingTable csa{"csa_cmp_block_table",
                    fx.csa_cmp_block_table.view(),
                    fx.block_counts.view(),
                    2,
                    32,
                    32,
                    4,
                    false};
  pg::build_ring_compressed_slot_mapping(ov, pv, csa, sh, kCfg);
  gd::build_prefix_compressed_slot_mapping(wv, pv, fx.csa_cmp_block_table.view(),
                                           fx.block_counts.view(), 2, 4, sh, kCfg);
  EXPECT_EQ(out, want);
  EXPECT_EQ(out, (std::vector<std::int64_t>{-1, 31, 63, -1}));
  pg::RingTable cs{
      "csa_state_table", fx.csa_state_table.view(), fx.block_counts.view(), 5, 65, 4, 4, true};
  pg::build_ring_state_slot_mapping(ov, pv, cs, sh, kCfg);
  gd::build_ring_state_slot_mapping(wv, pv, fx.csa_state_table.view(), fx.block_counts.view(), 5, 4,
                                    sh);
  EXPECT_EQ(out, want);
  EXPECT_EQ(out, (std::vector<std::int64_t>{254, 255, 255, 0}));
  // Bad inputs: named, nothing written.
  std::fill(out.begin(), out.end(), kPoison64);
  auto bad = csa;
  bad.ratio = 5;
  expect_error([&] { pg::build_ring_compressed_slot_mapping(ov, pv, bad, sh, kCfg); },
               {"ring.ratio", "5"});
  bad = cs;
  bad.rows_per_page = 8;
  expect_error([&] { pg::build_ring_state_slot_mapping(ov, pv, bad, sh, kCfg); },
               {"ring.rows_per_page", "8"});
  bad = csa;
  bad.count_col = 7;
  expect_error([&] { pg::build_ring_compressed_slot_mapping(ov, pv, bad, sh, kCfg); },
               {"block_counts.extent(1)", "7"});
  EXPECT_EQ(out, std::vector<std::int64_t>(4, kPoison64));
}

// ---------------------------------------------------------------------------------------------
// Addendum §7: compressor-state page pairings 4/8 ([MTP]/[PRO]), 8/32 (#909), 2/8 (#928 HEAD).

TEST(StatePages, AllThreePairingsInEveryLayout) {
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  // Request 3 (p = 3, 4): CSA state rows per pairing with the fixture P = 65, HCA P = 64.
  const std::int64_t want_csa[3][2] = {{15, 28}, {27, 28}, {15, 22}};
  const std::int64_t want_hca[3][2] = {{27, 28}, {99, 100}, {27, 28}};
  for (int k = 0; k < 3; ++k) {
    const td::ModelConfig cfg = with_pages(128, kStatePairs[k][0], kStatePairs[k][1]);
    for (Layout layout : {Layout::base, Layout::device_ring, Layout::prefix_caching}) {
      SCOPED_TRACE(::testing::Message() << "SB " << kStatePairs[k][0] << "/" << kStatePairs[k][1]
                                        << " layout " << int(layout));
      pg::FixtureTables fx(4, pg::PoolSizes{}, layout, false, cfg);
      // Widths ceil(max_seq / SB).
      EXPECT_EQ(fx.csa_state_table.extent(1), 16384 / kStatePairs[k][0]);
      EXPECT_EQ(fx.csa_inner_state_table.extent(1), 16384 / kStatePairs[k][0]);
      EXPECT_EQ(fx.hca_state_table.extent(1), 16384 / kStatePairs[k][1]);
      pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, cfg);
      EXPECT_EQ(md.rows_per_page(Table::csa_state), kStatePairs[k][0]);
      EXPECT_EQ(md.rows_per_page(Table::hca_state), kStatePairs[k][1]);
      EXPECT_EQ(md.csa_state_slot_mapping()(6), want_csa[k][0]);
      EXPECT_EQ(md.csa_state_slot_mapping()(7), want_csa[k][1]);
      EXPECT_EQ(md.hca_state_slot_mapping()(6), want_hca[k][0]);
      EXPECT_EQ(md.hca_state_slot_mapping()(7), want_hca[k][1]);
      expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, fx.tables(), cfg));
      expect_readers_agree(md);
    }
  }
  // The [DSP] HEAD deployment: 32-row pages with 2/8 state pages, device ring.
  const td::ModelConfig dsp = with_pages(32, 2, 8);
  pg::FixtureTables fx(4, pg::PoolSizes{512, 256, 256, 256, 260, 260}, Layout::device_ring, false,
                       dsp);
  EXPECT_EQ(fx.block_table.extent(1), 512);      // addendum §1.2 [DSP]: ori 512
  EXPECT_EQ(fx.cmp_block_table.extent(1), 128);  // cmp 128 (32 rows / entry)
  EXPECT_EQ(fx.idx_block_table.extent(1), 256);  // idx 256
  EXPECT_EQ(fx.csa_state_table.extent(1), 8192);
  pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, dsp);
  expect_matches_golden(md, golden_step_cfg(starts, {4, 2}, fx.tables(), dsp));
  // A ratio-4 window of 8 state rows spans 4 pages of 2 rows: pooling row c of p = 8191 reads
  // positions 8184..8191 = columns 4092..4095, all inside the periodicity check.
  const std::vector<std::int32_t> s2 = {8190, 8186, 3, 0};
  md.build(s2, {4, 2}, fx.tables(), fx.pools, dsp);
  expect_matches_golden(md, golden_step_cfg(s2, {4, 2}, fx.tables(), dsp));
}

TEST(StatePages, PoolingReadRangeIsValidated) {
  // The HCA pooling of p = 8319 (row 64) reads state positions 8192..8319 = columns 1024..1039 at
  // SB 8, though this step writes only 1039: a non-periodic entry there is rejected.
  pg::FixtureTables fx(2, pg::PoolSizes{}, Layout::prefix_caching);
  const std::vector<std::int32_t> starts = {8318, 127};
  fx.hca_state_table.view()(0, 1024) = 5;  // ring column 1024 mod 64 = 0 holds 0
  pg::StepMetadata md(2, 2, kCfg);
  expect_error(
      [&] {
        md.build(starts, {2, 2}, fx.tables(), fx.pools, kCfg);
      },
      {"hca_state_table[0,1024]", "5", "hca_state_table[0,0] = 0"});
  // Ratio 4 (overlapping): row c = 2079 of p = 8319 also reads the previous window 8312..8315.
  fx.hca_state_table.view()(0, 1024) = 0;
  fx.csa_state_table.view()(0, 2078) = 3;  // 2078 mod 65 = 63
  expect_error(
      [&] {
        md.build(starts, {2, 2}, fx.tables(), fx.pools, kCfg);
      },
      {"csa_state_table[0,2078]", "3"});
  fx.csa_state_table.view()(0, 2078) = fx.csa_state_table.view()(0, 63);
  md.build(starts, {2, 2}, fx.tables(), fx.pools, kCfg);
}

// ---------------------------------------------------------------------------------------------
// Addendum §8: S in {1, 2, 4, 8}, commit tokens 0..S, any B up to the constructed maximum.

TEST(Mtp, S8TwoRatio4BoundariesEachGetTheirOwnRow) {
  // [AMBIGUOUS addendum §7, S > R] option (b): both boundaries of a request write a row.
  const std::vector<std::int32_t> starts = {1, 8189, 124, 0};
  for (Layout layout : {Layout::base, Layout::device_ring, Layout::prefix_caching}) {
    pg::FixtureTables fx(4, pg::PoolSizes{}, layout);
    for (int commit : {-1, 8, 4, 0}) {
      SCOPED_TRACE(::testing::Message() << "layout " << int(layout) << " commit " << commit);
      const pg::StepShape sh{4, 8, commit};
      pg::StepMetadata md(starts, sh, fx.tables(), fx.pools, kCfg);
      const auto cmp = md.csa_cmp_slot_mapping(), idx = md.csa_idx_slot_mapping();
      for (int b = 0; b < 4; ++b) {
        std::vector<int> at;
        std::set<std::int64_t> rows;
        for (int s = 0; s < 8; ++s) {
          if (cmp(b * 8 + s) >= 0) {
            at.push_back(s);
            rows.insert(cmp(b * 8 + s));
          }
          EXPECT_EQ(cmp(b * 8 + s) >= 0, idx(b * 8 + s) >= 0);
        }
        // Boundaries at s* = 3 - start % 4 and s* + 4; committed ones only.
        const int s0 = 3 - starts[b] % 4;
        std::vector<int> want;
        for (int s : {s0, s0 + 4})
          if (commit < 0 || s < commit) want.push_back(s);
        EXPECT_EQ(at, want) << "request " << b;
        EXPECT_EQ(rows.size(), want.size());  // distinct rows c and c + 1
      }
      // b = 1 (positions 8189..8196) also closes HCA row 63 at s = 2.
      EXPECT_EQ(md.hca_cmp_slot_mapping()(8 + 2) >= 0, commit < 0 || commit > 2);
      expect_matches_golden(md, golden_step_cfg(starts, sh, fx.tables(), kCfg));
      expect_readers_agree(md);
      // The states and ori are written for every token (no commit masking).
      for (index_t t = 0; t < 32; ++t) EXPECT_GE(md.csa_state_slot_mapping()(t), 0);
    }
  }
  // Prefix caching, b = 0 (positions 1..8): rows c = 0, 1 of column 0 → csa[0,0]·32 + 0, + 1.
  pg::FixtureTables fx(4, pg::PoolSizes{}, Layout::prefix_caching);
  pg::StepMetadata md(starts, {4, 8}, fx.tables(), fx.pools, kCfg);
  EXPECT_EQ(md.csa_cmp_slot_mapping()(2), 0);
  EXPECT_EQ(md.csa_cmp_slot_mapping()(6), 1);
}

TEST(Mtp, AnyBatchUpTo256WithoutRebuildingOrAllocating) {
  for (Layout layout : {Layout::base, Layout::device_ring, Layout::prefix_caching}) {
    SCOPED_TRACE(::testing::Message() << "layout " << int(layout));
    pg::FixtureTables fx(256, pg::PoolSizes::for_batch(256), layout);
    pg::StepMetadata md(256, 8, kCfg);
    tdtest::Rng rng(256 + int(layout));
    std::vector<std::vector<std::int32_t>> starts;
    const int batches[] = {1, 2, 3, 17, 64, 255, 256};
    for (int B : batches) starts.push_back(random_starts(rng, B, 8, kCfg.max_seq_len));
    md.build(starts[0], {1, 1}, fx.tables(), fx.pools, kCfg);
    const auto* pos_ptr = md.position_ids().data();
    const auto* slot_ptr = md.csa_cmp_slot_mapping().data();
    for (int i = 0; i < 7; ++i) {
      for (int S : {1, 2, 4, 8}) {
        const pg::StepShape sh{batches[i], S, S > 1 ? 1 : -1};
        std::vector<std::int32_t> st = starts[i];
        for (auto& s : st) s = std::min<std::int32_t>(s, kCfg.max_seq_len - S);
        g_allocs = 0;
        g_counting = true;
        md.build(st, sh, fx.tables(), fx.pools, kCfg);
        g_counting = false;
        EXPECT_EQ(g_allocs.load(), 0) << "B " << batches[i] << " S " << S;
        EXPECT_EQ(md.position_ids().data(), pos_ptr);
        EXPECT_EQ(md.csa_cmp_slot_mapping().data(), slot_ptr);
        EXPECT_EQ(md.position_ids().extent(0), index_t(batches[i]) * S);
        if (S == 8 || batches[i] <= 3)
          expect_matches_golden(md, golden_step_cfg(st, sh, fx.tables(), kCfg));
      }
    }
  }
}

TEST(Mtp, BuildTimeB256S8) {
  // Measured: StepMetadata::build at B = 256, S = 8 (T = 2048), 16k context, per layout.
  for (Layout layout : {Layout::base, Layout::device_ring, Layout::prefix_caching}) {
    pg::FixtureTables fx(256, pg::PoolSizes::for_batch(256), layout);
    pg::StepMetadata md(256, 8, kCfg);
    tdtest::Rng rng(5);
    const auto starts = random_starts(rng, 256, 8, kCfg.max_seq_len);
    md.build(starts, {256, 8}, fx.tables(), fx.pools, kCfg);
    const int reps = lean() ? 2 : 50;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) md.build(starts, {256, 8}, fx.tables(), fx.pools, kCfg);
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        reps;
    std::printf("[ measured ] StepMetadata::build B=256 S=8 16k layout %d: %.1f us\n", int(layout),
                us);
    RecordProperty("build_us_layout_" + std::to_string(int(layout)), std::to_string(us));
    expect_matches_golden(md, golden_step_cfg(starts, {256, 8}, fx.tables(), kCfg));
  }
}

// ---------------------------------------------------------------------------------------------
// Ring layouts: bad inputs (named; the previous step's metadata is untouched).

TEST(BadInput, RingBuildIsAllOrNothing) {
  const std::vector<std::int32_t> good = {8192, 0, 2, 3};
  pg::FixtureTables fx(4, pg::PoolSizes{}, Layout::prefix_caching);
  pg::StepMetadata md(good, {4, 2}, fx.tables(), fx.pools, kCfg);
  const GoldenStep before = golden_step_cfg(good, {4, 2}, fx.tables(), kCfg);
  const std::vector<std::int32_t> other = {8193, 100, 200, 300};
  auto bad_build = [&](const pg::StepTables& tb, pg::PoolSizes pools, const td::ModelConfig& cfg,
                       std::initializer_list<std::string> needles,
                       std::vector<std::int32_t> starts = {}) {
    if (starts.empty()) starts = other;
    expect_error([&] { md.build(starts, {4, 2}, tb, pools, cfg); }, needles);
    expect_matches_golden(md, before);
  };
  std::vector<std::unique_ptr<td::Tensor<std::int32_t, 2>>> keep;  // the modified counts
  auto with_counts = [&](index_t b, index_t c, std::int32_t v) {
    keep.push_back(std::make_unique<td::Tensor<std::int32_t, 2>>(fx.block_counts));
    keep.back()->view()(b, c) = v;
    auto tb = fx.tables();
    tb.block_counts = keep.back()->view();
    return tb;
  };
  bad_build(with_counts(2, 2, 0), fx.pools, kCfg, {"block_counts[2,2]", "0", "[1, 128]"});
  bad_build(with_counts(1, 3, 129), fx.pools, kCfg, {"block_counts[1,3]", "129"});
  bad_build(with_counts(0, 6, -1), fx.pools, kCfg, {"block_counts[0,6]", "-1"});
  // Column 0 (ori) is never read (addendum §2.3.1).
  {
    pg::StepMetadata ok(4, 2, kCfg);
    ok.build(good, {4, 2}, with_counts(3, 0, -9), fx.pools, kCfg);
    expect_matches_golden(ok, before);
  }
  auto tb = fx.tables();
  tb.block_counts = fx.block_counts.view().slice(1, 0, 6);
  bad_build(tb, fx.pools, kCfg, {"tables.block_counts.extent(1)", "6", "exactly 7"});
  tb = fx.tables();
  tb.block_counts = fx.block_counts.view().slice(0, 0, 3);
  bad_build(tb, fx.pools, kCfg, {"tables.block_counts.extent(0)", "3", ">= 4"});
  tb = fx.tables();
  tb.block_counts = {};
  bad_build(tb, fx.pools, kCfg, {"tables.block_counts.extent(0)", "0"});
  // Non-periodic entry inside the readers' range (request 0 at 8193, 8194: CSA rows 0..2047 =
  // columns 0..63).
  td::Tensor<std::int32_t, 2> csa = fx.csa_cmp_block_table;
  csa.view()(0, 40) = 5;
  tb = fx.tables();
  tb.csa_cmp_block_table = csa.view();
  bad_build(tb, fx.pools, kCfg, {"csa_cmp_block_table[0,40]", "5", "csa_cmp_block_table[0,0]"});
  // ... outside it (column 100) is never touched: accepted.
  csa.view()(0, 40) = csa.view()(0, 0);
  csa.view()(0, 100) = 5;
  {
    pg::StepMetadata ok(4, 2, kCfg);
    ok.build(other, {4, 2}, tb, fx.pools, kCfg);
  }
  // Table too narrow for the readers ([AMBIGUOUS §2.3.4]: assert L < width).
  tb = fx.tables();
  tb.csa_cmp_block_table = fx.csa_cmp_block_table.view().slice(1, 0, 41);
  bad_build(tb, fx.pools, kCfg,
            {"csa_cmp_block_table.extent(1)", "41", ">= 64", "logical column 63"});
  tb = fx.tables();
  tb.hca_state_table = fx.hca_state_table.view().slice(1, 0, 1024);
  bad_build(tb, fx.pools, kCfg, {"hca_state_table.extent(1)", "1024", ">= 1025"});
  tb = fx.tables();
  tb.idx_block_table = fx.idx_block_table.view().slice(0, 0, 2);
  bad_build(tb, fx.pools, kCfg, {"idx_block_table.extent(0)", "2", ">= 4"});
  // Entries outside the pool / below -1 (ring column 5 of request 0's HCA table is read).
  td::Tensor<std::int32_t, 2> hca = fx.hca_cmp_block_table;
  for (index_t c = 5; c < 128; c += 8) hca.view()(0, c) = 32;
  tb = fx.tables();
  tb.hca_cmp_block_table = hca.view();
  bad_build(tb, fx.pools, kCfg, {"hca_cmp_block_table[0,5]", "32", "[-1, 32)"});
  for (index_t c = 5; c < 128; c += 8) hca.view()(0, c) = -2;
  bad_build(tb, fx.pools, kCfg, {"hca_cmp_block_table[0,5]", "-2"});
  // Pools.
  pg::PoolSizes pools = fx.pools;
  pools.csa_cmp = 0;
  bad_build(fx.tables(), pools, kCfg, {"pools.csa_cmp", "0"});
  pools = fx.pools;
  pools.hca_cmp = 0;
  bad_build(fx.tables(), pools, kCfg, {"pools.hca_cmp", "0"});
  pools = fx.pools;
  pools.ori = (index_t(1) << 24) + 1;  // window lists are INT32: ori rows must fit 2^31
  bad_build(fx.tables(), pools, kCfg, {"pools.ori", "16777217"});
  // Config and layout.
  td::ModelConfig c64 = kCfg;
  c64.page = 64;
  bad_build(fx.tables(), fx.pools, c64, {"cfg.page", "64", "multiple of 128"});
  td::ModelConfig c0 = kCfg;
  c0.c4_state_page = 0;
  bad_build(fx.tables(), fx.pools, c0, {"cfg.c4_state_page", "0"});
  tb = fx.tables();
  tb.layout = Layout(7);
  bad_build(tb, fx.pools, kCfg, {"tables.layout", "7"});
  // Shape: S and commit tokens.
  expect_error([&] { md.build(other, {4, 3}, fx.tables(), fx.pools, kCfg); }, {"shape.seq", "3"});
  expect_error(
      [&] {
        md.build(other, {4, 2, 3}, fx.tables(), fx.pools, kCfg);
      },
      {"shape.commit_tokens", "3"});
  expect_error(
      [&] {
        md.build(other, {4, 2, -2}, fx.tables(), fx.pools, kCfg);
      },
      {"shape.commit_tokens", "-2"});
  expect_matches_golden(md, before);
  // device_ring wants the 6 #862 columns.
  pg::FixtureTables dr(4, pg::PoolSizes{}, Layout::device_ring);
  tb = dr.tables();
  tb.block_counts = fx.block_counts.view();
  bad_build(tb, dr.pools, kCfg, {"tables.block_counts.extent(1)", "7", "exactly 6"});
}

// ---------------------------------------------------------------------------------------------
// Long context (addendum §1.3, §5.2, §6): positions up to 2^20, INT64 slots, INT32 windows.

td::ModelConfig long_cfg(int page = 32, int c4 = 2, int c128 = 8) {
  return with_pages(page, c4, c128, 1 << 20);
}

TEST(LongContext, long_context_swa_1m_window_ring) {
  // Addendum §6: B = 1, p = 1,048,575, 32-row pages, ori table width 32768 with the 512-page
  // ring table[b, c] = ((c mod 512)·B + b) mod 512 encoded in the table (no count, no modulo).
  const td::ModelConfig cfg = long_cfg();
  pg::PoolSizes pools;
  pools.ori = 512;
  for (Layout layout : {Layout::base, Layout::device_ring}) {
    pg::FixtureTables fx(1, pools, layout, false, cfg);
    ASSERT_EQ(fx.block_table.extent(1), 32768);
    EXPECT_EQ(fx.block_table.view()(0, 32767), 511);
    const std::vector<std::int32_t> starts = {1048575};
    pg::StepMetadata md(starts, {1, 1}, fx.tables(), fx.pools, cfg);
    EXPECT_EQ(md.ori_slot_mapping()(0), 16383);  // 511·32 + 31
    EXPECT_EQ(md.window_lens()(0), 128);         // positions 1,048,448 .. 1,048,575
    for (index_t k = 0; k < 128; ++k) EXPECT_EQ(md.window_indices()(0, k), 16256 + k);
    expect_matches_golden(md, golden_step_cfg(starts, {1, 1}, fx.tables(), cfg));
    expect_readers_agree(md);
  }
}

TEST(LongContext, long_context_hca_1m_device_ring) {
  // Addendum §5.2 [DSP] 1M HCA example: B = 1, start 2^20 - 8, S = 8, 32-row pages, 2/8 state
  // pages; ori pages 32763..32767 → physical 0..4; a contiguous 256-page HCA cmp table; no CSA
  // family at 1M (its tables are empty: not served).
  const td::ModelConfig cfg = long_cfg();
  td::Tensor<std::int32_t, 2> ori({1, 32768}), cmp({1, 256}), hst({1, 131072}), counts({1, 6});
  for (auto& e : ori.flat()) e = -1;
  for (index_t c = 32763; c < 32768; ++c) ori.view()(0, c) = std::int32_t(c - 32763);
  for (index_t c = 0; c < 256; ++c) cmp.view()(0, c) = std::int32_t(c);
  for (index_t c = 0; c < 131072; ++c) hst.view()(0, c) = std::int32_t(c % 256);
  const std::int32_t n[6] = {5, 256, 0, 256, 0, 0};
  for (int g = 0; g < 6; ++g) counts.view()(0, g) = n[g];
  pg::StepTables tb{ori.view(), cmp.view(), {}, hst.view(), {}, {}};
  tb.layout = Layout::device_ring;
  tb.block_counts = counts.view();
  pg::PoolSizes pools{5, 256, 0, 256, 0, 0};
  const std::vector<std::int32_t> starts = {(1 << 20) - 8};
  pg::StepMetadata md(starts, {1, 8}, tb, pools, cfg);
  EXPECT_EQ(to_vec(md.position_ids())[7], 1048575);
  EXPECT_EQ(to_vec(md.kv_seq_lens()), (std::vector<std::int32_t>{1 << 20}));
  EXPECT_EQ(md.ori_slot_mapping()(7), 159);  // 4·32 + 31
  // s = 7 closes compressed row 8191 → 255·32 + 31 = 8191; nothing else is a boundary.
  std::vector<std::int64_t> hca(8, -1);
  hca[7] = 8191;
  EXPECT_EQ(to_vec(md.hca_cmp_slot_mapping()), hca);
  EXPECT_EQ(to_vec(md.csa_cmp_slot_mapping()), std::vector<std::int64_t>(8, -1));
  EXPECT_EQ(to_vec(md.csa_idx_slot_mapping()), std::vector<std::int64_t>(8, -1));
  // The raw window of s = 0 spans pages 32763..32767 (physical 0..4): rows 25..152.
  for (index_t k = 0; k < 128; ++k) EXPECT_EQ(md.window_indices()(0, k), 25 + k);
  EXPECT_EQ(md.hca_state_slot_mapping()(0), 255 * 8 + 0);
  expect_matches_golden(md, golden_step_cfg(starts, {1, 8}, tb, cfg));
  expect_readers_agree(md);
  // The HCA readers need all 256 columns (rows 0..8191 at 32 per page): a 255-wide table fails
  // (first on its count of 256, then, with 255 live columns, on its width).
  tb.cmp_block_table = cmp.view().slice(1, 0, 255);
  expect_error(
      [&] {
        md.build(starts, {1, 8}, tb, pools, cfg);
      },
      {"block_counts[0,1]", "256", "[1, 255]"});
  counts.view()(0, 1) = 255;
  expect_error(
      [&] {
        md.build(starts, {1, 8}, tb, pools, cfg);
      },
      {"cmp_block_table.extent(1)", "255", ">= 256"});
  EXPECT_EQ(md.hca_cmp_slot_mapping()(7), 8191);
}

TEST(LongContext, long_context_positions_and_starts) {
  const td::ModelConfig cfg = long_cfg(128, 4, 8);
  pg::FixtureTables fx(2, pg::PoolSizes{}, Layout::prefix_caching, false, cfg);
  EXPECT_EQ(fx.csa_cmp_block_table.extent(1), 8192);  // 2^20 / 128
  EXPECT_EQ(fx.hca_state_table.extent(1), 131072);    // 2^20 / 8
  pg::StepMetadata md(2, 8, cfg);
  md.build(std::vector<std::int32_t>{(1 << 20) - 8, 1048000}, {2, 8}, fx.tables(), fx.pools, cfg);
  EXPECT_EQ(md.position_ids()(7), 1048575);
  expect_matches_golden(md, golden_step_cfg(std::vector<std::int32_t>{(1 << 20) - 8, 1048000},
                                            {2, 8}, fx.tables(), cfg));
  expect_readers_agree(md);
  expect_error(
      [&] {
        md.build(std::vector<std::int32_t>{(1 << 20) - 7, 0}, {2, 8}, fx.tables(), fx.pools, cfg);
      },
      {"start[0]", "1048569", "[0, 1048569)"});
  // A 16k config rejects 1M positions.
  expect_error(
      [&] {
        md.build(std::vector<std::int32_t>{20000, 0}, {2, 8}, fx.tables(), fx.pools, kCfg);
      },
      {"start[0]", "20000"});
  std::vector<std::int32_t> pos = {1 << 20};
  std::vector<std::int64_t> out(1);
  td::Tensor<std::int32_t, 2> t({1, 32768});
  expect_error(
      [&] {
        pg::build_ori_slot_mapping(td::View<std::int64_t, 1>(out.data(), {1}),
                                   td::ConstView<std::int32_t, 1>(pos.data(), {1}), t.view(), 1,
                                   {1, 1}, cfg);
      },
      {"position_ids[0]", "1048576"});
}

TEST(LongContext, long_context_int64_slots_beyond_int32) {
  // Slot mappings are INT64: a state pool of 2^30 + 1 pages of 8 rows has rows past 2^33.
  const td::ModelConfig cfg = long_cfg(128, 4, 8);
  pg::FixtureTables fx(1, pg::PoolSizes{}, Layout::device_ring, false, cfg);
  const index_t big = index_t(1) << 30;
  for (index_t c = 0; c < fx.hca_state_table.extent(1); ++c)
    fx.hca_state_table.view()(0, c) = std::int32_t(big - (c % 64));
  pg::PoolSizes pools = fx.pools;
  pools.hca_state = big + 1;
  const std::vector<std::int32_t> starts = {(1 << 20) - 2};
  pg::StepMetadata md(starts, {1, 2}, fx.tables(), pools, cfg);
  // p = 1,048,574: column 131071 → ring column 131071 mod 64 = 63 → page 2^30 - 63.
  EXPECT_EQ(md.hca_state_slot_mapping()(0), (big - 63) * 8 + 6);
  EXPECT_GT(md.hca_state_slot_mapping()(0), std::int64_t(1) << 32);
  expect_matches_golden(md, golden_step_cfg(starts, {1, 2}, fx.tables(), cfg));
}

TEST(LongContext, long_context_random_ring_layouts_against_golden) {
  tdtest::Rng rng(1 << 20);
  for (int iter = 0; iter < (lean() ? 6 : 24); ++iter) {
    const Layout layout = iter % 2 ? Layout::prefix_caching : Layout::device_ring;
    const auto& pair = kStatePairs[iter % 3];
    const td::ModelConfig cfg =
        long_cfg(layout == Layout::prefix_caching ? 128 : 32, pair[0], pair[1]);
    const int B = int(rng.integer(1, 3)), S = iter % 4 == 0 ? 1 : 8;
    RingSetup r = random_ring_setup(rng, layout, B, cfg);
    const auto starts = random_starts(rng, B, S, cfg.max_seq_len);
    SCOPED_TRACE(::testing::Message() << "iter " << iter);
    pg::StepMetadata md(starts, {B, S, int(rng.integer(-1, S))}, r.tables(), r.pools, cfg);
    expect_matches_golden(md, golden_step_cfg(starts, md.shape(), r.tables(), cfg));
    expect_readers_agree(md);
  }
}

TEST(LongContext, long_context_build_time_1m) {
  // Measured: build at 1M context, prefix caching, B = 16, S = 8, every request near 2^20 (the
  // periodicity check walks 8192 columns per compressed table and request).
  const td::ModelConfig cfg = long_cfg(128, 4, 8);
  pg::FixtureTables fx(16, pg::PoolSizes::for_batch(16), Layout::prefix_caching, false, cfg);
  std::vector<std::int32_t> starts(16);
  for (int b = 0; b < 16; ++b) starts[b] = (1 << 20) - 8 - b;
  pg::StepMetadata md(starts, {16, 8}, fx.tables(), fx.pools, cfg);
  const int reps = lean() ? 2 : 20;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) md.build(starts, {16, 8}, fx.tables(), fx.pools, cfg);
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
      reps;
  std::printf("[ measured ] StepMetadata::build B=16 S=8 1M prefix caching: %.1f us\n", us);
  RecordProperty("build_us", std::to_string(us));
  expect_matches_golden(md, golden_step_cfg(starts, {16, 8}, fx.tables(), cfg));
}

}  // namespace
