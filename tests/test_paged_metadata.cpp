// Paged-KV metadata (spec §3): worked example, canonical start sets and seeded random cases
// against golden, properties, and every bad input (throws, names the argument, writes nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/golden/paged.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace td = tiledecode;
namespace pg = tiledecode::paged;
namespace gd = tiledecode::golden;
using td::index_t;

namespace {

const td::ModelConfig kCfg = td::flash_config();

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

}  // namespace
