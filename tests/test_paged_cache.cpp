// Paged cache write (scatter by slot mapping) and gather (by slot list, by window list, by
// logical row through a block-table row) against golden; -1 semantics in both directions; bad
// inputs throw naming the argument and write nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/golden/paged.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace td = tiledecode;
namespace pg = tiledecode::paged;
namespace gd = tiledecode::golden;
using td::bf16;
using td::index_t;

namespace {

const td::ModelConfig kCfg = td::flash_config();

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

template <class E, std::size_t R>
bool same_bytes(const td::Tensor<E, R>& a, const td::Tensor<E, R>& b) {
  // memcmp's pointers must be non-null even for 0 bytes, and an empty tensor holds none.
  return a.size() == b.size() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size() * sizeof(E)) == 0);
}

template <class E>
void fill_random(tdtest::Rng& rng, std::span<E> v) {
  if constexpr (std::is_same_v<E, bf16>) {
    rng.fill_uniform(v, -1.0f, 1.0f);
  } else if constexpr (std::is_same_v<E, float>) {
    rng.fill_uniform(v, -1.0f, 1.0f);
  } else {
    rng.fill_int8(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Write.

// Writes T rows of width W of type E with `slots` into a random pool: fast path == golden, and
// rows with slot -1 are skipped (the pool elsewhere is unchanged).
template <class E>
void check_write(tdtest::Rng& rng, index_t pool_rows, index_t W,
                 const std::vector<std::int64_t>& slots) {
  const index_t T = index_t(slots.size());
  td::Tensor<E, 2> pool({pool_rows, W}), rows({T, W});
  fill_random<E>(rng, pool.flat());
  fill_random<E>(rng, rows.flat());
  td::Tensor<E, 2> gold = pool, before = pool;
  const td::ConstView<std::int64_t, 1> sv(slots.data(), {T});
  pg::write_cache(pool.view(), rows.view(), sv);
  gd::write_cache(gold.view(), rows.view(), sv);
  EXPECT_TRUE(same_bytes(pool, gold));
  // Rows not named by any slot are untouched.
  std::vector<bool> hit(pool_rows, false);
  for (auto s : slots)
    if (s >= 0) hit[s] = true;
  for (index_t r = 0; r < pool_rows; ++r)
    if (!hit[r]) {
      ASSERT_EQ(std::memcmp(&pool.view()(r, 0), &before.view()(r, 0), W * sizeof(E)), 0) << r;
    }
}

TEST(Write, StepMetadataSlotsForEveryPoolKind) {
  tdtest::Rng rng(1);
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::FixtureTables fx(4);
  pg::StepMetadata md(starts, {4, 2, 1}, fx.tables(), fx.pools, kCfg);
  auto vec = [](td::ConstView<std::int64_t, 1> v) {
    return std::vector<std::int64_t>(v.data(), v.data() + v.extent(0));
  };
  // BF16 ori KV rows [T, 512].
  check_write<bf16>(rng, fx.pools.ori * 128, 512, vec(md.ori_slot_mapping()));
  // BF16 compressed rows (mostly -1: boundaries only).
  check_write<bf16>(rng, fx.pools.cmp * 128, 512, vec(md.csa_cmp_slot_mapping()));
  // INT8 index rows [T, 128] and their FP32 scales [T, 1].
  check_write<std::int8_t>(rng, fx.pools.idx * 128, 128, vec(md.csa_idx_slot_mapping()));
  check_write<float>(rng, fx.pools.idx * 128, 1, vec(md.csa_idx_slot_mapping()));
  // FP32 compressor state rows (CSA main 2048, inner 512, HCA 1024 wide).
  check_write<float>(rng, fx.pools.csa_state * 4, 2048, vec(md.csa_state_slot_mapping()));
  check_write<float>(rng, fx.pools.csa_inner_state * 4, 512,
                     vec(md.csa_inner_state_slot_mapping()));
  check_write<float>(rng, fx.pools.hca_state * 8, 1024, vec(md.hca_state_slot_mapping()));
}

TEST(Write, MinusOneSkipsAndLaterTokenWinsOnDuplicates) {
  tdtest::Rng rng(2);
  // All -1: nothing written.
  check_write<bf16>(rng, 64, 16, std::vector<std::int64_t>(8, -1));
  // Duplicates (aliasing fixture pools, spec §3.8): token order, the later one wins.
  const std::vector<std::int64_t> slots = {5, -1, 5, 63, 0, 63};
  check_write<float>(rng, 64, 8, slots);
  td::Tensor<float, 2> pool({64, 2}), rows({6, 2});
  for (index_t t = 0; t < 6; ++t) rows.view()(t, 0) = float(t);
  pg::write_cache(pool.view(), rows.view(), td::ConstView<std::int64_t, 1>(slots.data(), {6}));
  EXPECT_EQ(pool.view()(5, 0), 2.0f);
  EXPECT_EQ(pool.view()(63, 0), 5.0f);
  EXPECT_EQ(pool.view()(0, 0), 4.0f);
}

TEST(Write, RandomSeededCases) {
  tdtest::Rng rng(3);
  for (int iter = 0; iter < 50; ++iter) {
    const index_t rows = rng.integer(1, 600), T = rng.integer(0, 40), W = rng.integer(1, 70);
    std::vector<std::int64_t> slots(T);
    for (auto& s : slots) s = rng.integer(0, 4) == 0 ? -1 : rng.integer(0, rows - 1);
    check_write<bf16>(rng, rows, W, slots);
    check_write<std::int8_t>(rng, rows, W, slots);
  }
}

TEST(Write, StridedPoolRows) {
  // A pool row view with a row stride larger than the width (e.g. one head of a wider row).
  tdtest::Rng rng(4);
  td::Tensor<bf16, 2> base({32, 24}), rows({3, 16});
  fill_random<bf16>(rng, base.flat());
  fill_random<bf16>(rng, rows.flat());
  td::Tensor<bf16, 2> gold_base = base;
  const std::vector<std::int64_t> slots = {31, -1, 7};
  const td::ConstView<std::int64_t, 1> sv(slots.data(), {3});
  pg::write_cache(base.view().slice(1, 4, 20), rows.view(), sv);
  gd::write_cache(gold_base.view().slice(1, 4, 20), rows.view(), sv);
  EXPECT_TRUE(same_bytes(base, gold_base));
}

TEST(Write, BadInputWritesNothing) {
  td::Tensor<bf16, 2> pool({256, 8}), rows({4, 8});
  tdtest::Rng rng(5);
  fill_random<bf16>(rng, pool.flat());
  fill_random<bf16>(rng, rows.flat());
  const td::Tensor<bf16, 2> poison = pool;
  auto run = [&](std::vector<std::int64_t> slots) {
    pg::write_cache(pool.view(), rows.view(),
                    td::ConstView<std::int64_t, 1>(slots.data(), {index_t(slots.size())}));
  };
  // The bad slot is the LAST one: the earlier valid ones must not have been written either.
  expect_error(
      [&] {
        run({0, 1, 2, 256});
      },
      {"write_cache", "slot_mapping[3]", "256", "[-1, 256)"});
  expect_error([&] { run({0, 1, 2, -2}); }, {"slot_mapping[3]", "-2"});
  expect_error([&] { run({0, 1, 2}); }, {"slot_mapping.extent(0)", "3"});
  expect_error(
      [&] {
        pg::write_cache(
            pool.view(), rows.view().slice(1, 0, 7),
            td::ConstView<std::int64_t, 1>(std::vector<std::int64_t>{0, 1, 2, 3}.data(), {4}));
      },
      {"rows.extent(1)", "7"});
  // Inner dimension must be contiguous.
  td::Tensor<bf16, 2> wide({256, 16});
  const std::vector<std::int64_t> ok = {0, 1, 2, 3};
  td::View<bf16, 2> strided(wide.data(), {256, 8}, {16, 2});
  expect_error(
      [&] {
        pg::write_cache(strided, rows.view(), td::ConstView<std::int64_t, 1>(ok.data(), {4}));
      },
      {"pool.stride(1)", "2"});
  EXPECT_TRUE(same_bytes(pool, poison));
  // -1 is not an error: it skips.
  run({-1, -1, -1, -1});
  EXPECT_TRUE(same_bytes(pool, poison));
}

// ---------------------------------------------------------------------------------------------
// Gather.

template <class E, class I>
void check_gather_rows(tdtest::Rng& rng, index_t pool_rows, index_t W,
                       const std::vector<I>& slots) {
  const index_t N = index_t(slots.size());
  td::Tensor<E, 2> pool({pool_rows, W}), dst({N, W}), gold({N, W});
  td::Tensor<std::uint8_t, 1> valid({N}), gvalid({N});
  fill_random<E>(rng, pool.flat());
  fill_random<E>(rng, dst.flat());  // garbage in the output must be overwritten
  std::fill(valid.flat().begin(), valid.flat().end(), std::uint8_t(7));
  const td::ConstView<I, 1> sv(slots.data(), {N});
  pg::gather_rows(dst.view(), valid.view(), pool.view(), sv);
  gd::gather_rows<E, I>(gold.view(), gvalid.view(), pool.view(), sv);
  EXPECT_TRUE(same_bytes(dst, gold));
  EXPECT_TRUE(same_bytes(valid, gvalid));
  for (index_t i = 0; i < N; ++i) {
    EXPECT_EQ(valid.view()(i), slots[i] >= 0 ? 1 : 0);
    if (slots[i] < 0) {
      for (index_t j = 0; j < W; ++j) {
        E zero{};
        std::memset(static_cast<void*>(&zero), 0, sizeof(E));
        ASSERT_EQ(std::memcmp(&dst.view()(i, j), &zero, sizeof(E)), 0);
      }
    }
  }
}

TEST(GatherRows, Int32AndInt64ListsAgainstGolden) {
  tdtest::Rng rng(6);
  for (int iter = 0; iter < 40; ++iter) {
    const index_t rows = rng.integer(1, 500), N = rng.integer(0, 50), W = rng.integer(1, 80);
    std::vector<std::int32_t> s32(N);
    std::vector<std::int64_t> s64(N);
    for (index_t i = 0; i < N; ++i)
      s64[i] = s32[i] = std::int32_t(rng.integer(0, 3) == 0 ? -1 : rng.integer(0, rows - 1));
    check_gather_rows<bf16, std::int32_t>(rng, rows, W, s32);
    check_gather_rows<float, std::int64_t>(rng, rows, W, s64);
    check_gather_rows<std::int8_t, std::int32_t>(rng, rows, W, s32);
  }
}

// Write the step's KV rows, then gather every window: fast == golden; the current token's row
// (last valid column) equals what was written; columns past lens are zero and invalid.
void check_window_roundtrip(const std::vector<std::int32_t>& starts, int S,
                            const pg::FixtureTables& fx, const td::cpu::Context& ctx) {
  const int B = int(starts.size());
  const index_t T = index_t(B) * S, W = 512;
  pg::StepMetadata md(starts, {B, S}, fx.tables(), fx.pools, kCfg);
  tdtest::Rng rng(99);
  td::Tensor<bf16, 2> pool({fx.pools.ori * 128, W}), kv({T, W});
  fill_random<bf16>(rng, pool.flat());
  fill_random<bf16>(rng, kv.flat());
  pg::write_cache(pool.view(), kv.view(), md.ori_slot_mapping());
  td::Tensor<bf16, 3> dst({T, 128, W}), gold({T, 128, W});
  td::Tensor<std::uint8_t, 2> valid({T, 128}), gvalid({T, 128});
  fill_random<bf16>(rng, dst.flat());
  pg::gather_windows(dst.view(), valid.view(), pool.view(), md.window_indices(), ctx);
  gd::gather_windows(gold.view(), gvalid.view(), pool.view(), md.window_indices());
  EXPECT_TRUE(same_bytes(dst, gold));
  EXPECT_TRUE(same_bytes(valid, gvalid));
  for (index_t t = 0; t < T; ++t) {
    const index_t len = md.window_lens()(t);
    EXPECT_EQ(std::memcmp(&dst.view()(t, len - 1, 0), &kv.view()(t, 0), W * sizeof(bf16)), 0);
    for (index_t k = 0; k < 128; ++k) EXPECT_EQ(valid.view()(t, k), k < len ? 1 : 0);
    // Token s = 1 sees token s = 0 just before itself (the staircase).
    if (t % S > 0) {
      EXPECT_EQ(std::memcmp(&dst.view()(t, len - 2, 0), &kv.view()(t - 1, 0), W * sizeof(bf16)), 0);
    }
  }
}

TEST(GatherWindows, CanonicalStartSetsRoundTrip) {
  pg::FixtureTables fx(4);
  for (const auto& starts : std::vector<std::vector<std::int32_t>>{
           {8192, 127, 31, 8192}, {8192, 127, 128, 255}, {8192, 0, 2, 3}, {16382, 0, 1, 126}}) {
    check_window_roundtrip(starts, 2, fx, {});
  }
}

TEST(GatherWindows, ThreadCountDoesNotChangeTheResult) {
  td::ThreadPool pool(3);
  pg::FixtureTables fx(16, pg::PoolSizes::for_batch(16));
  std::vector<std::int32_t> starts(16);
  tdtest::Rng rng(12);
  for (auto& s : starts) s = std::int32_t(rng.integer(0, 16382));
  check_window_roundtrip(starts, 2, fx, td::cpu::Context{&pool, td::cpu::Isa::scalar});
}

TEST(GatherWindows, UnmappedPageIsZeroAndInvalid) {
  pg::FixtureTables fx(4);
  fx.block_table.view()(0, 63) = -1;  // the page before pos 8192
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  pg::StepMetadata md(starts, {4, 2}, fx.tables(), fx.pools, kCfg);
  td::Tensor<bf16, 2> pool({128 * 128, 8});
  for (auto& x : pool.flat()) x = bf16(1.0f);
  td::Tensor<bf16, 3> dst({8, 128, 8});
  td::Tensor<std::uint8_t, 2> valid({8, 128});
  pg::gather_windows(dst.view(), valid.view(), pool.view(), md.window_indices());
  for (index_t k = 0; k < 127; ++k) {
    EXPECT_EQ(valid.view()(0, k), 0);
    EXPECT_EQ(dst.view()(0, k, 3).bits, 0);
  }
  EXPECT_EQ(valid.view()(0, 127), 1);
  EXPECT_EQ(dst.view()(0, 127, 3).to_float(), 1.0f);
}

TEST(GatherLogical, ThroughBlockTableRowAgainstGolden) {
  tdtest::Rng rng(13);
  for (int iter = 0; iter < 40; ++iter) {
    const index_t page = rng.integer(0, 1) ? 128 : 4, blocks = rng.integer(1, 40);
    const index_t cols = rng.integer(1, 40), N = rng.integer(0, 60), W = rng.integer(1, 64);
    td::Tensor<std::int32_t, 1> table({cols});
    for (auto& e : table.flat())
      e = rng.integer(0, 5) == 0 ? -1 : std::int32_t(rng.integer(0, blocks - 1));
    std::vector<std::int32_t> rows(N);
    // -1, rows inside the table, rows past the table width.
    for (auto& r : rows)
      r = std::int32_t(rng.integer(0, 6) == 0 ? -1 : rng.integer(0, (cols + 2) * page - 1));
    td::Tensor<bf16, 2> pool({blocks * page, W}), dst({N, W}), gold({N, W});
    td::Tensor<std::uint8_t, 1> valid({N}), gvalid({N});
    fill_random<bf16>(rng, pool.flat());
    fill_random<bf16>(rng, dst.flat());
    const td::ConstView<std::int32_t, 1> rv(rows.data(), {N});
    pg::gather_logical_rows(dst.view(), valid.view(), pool.view(), table.view(), rv, page);
    gd::gather_logical_rows(gold.view(), gvalid.view(), pool.view(), table.view(), rv, page);
    ASSERT_TRUE(same_bytes(dst, gold));
    ASSERT_TRUE(same_bytes(valid, gvalid));
  }
}

TEST(GatherLogical, CompressedRowsOfTheWorkedExample) {
  // Request 3 at start 3 wrote compressed row 0 to slot 384 (physical block 3, row 0).
  pg::FixtureTables fx(4);
  td::Tensor<bf16, 2> cmp({32 * 128, 4});
  cmp.view()(384, 0) = bf16(5.0f);
  const std::vector<std::int32_t> rows = {0, -1, 1};
  td::Tensor<bf16, 2> dst({3, 4});
  td::Tensor<std::uint8_t, 1> valid({3});
  pg::gather_logical_rows(dst.view(), valid.view(), cmp.view(), fx.cmp_block_table.view().row(3),
                          td::ConstView<std::int32_t, 1>(rows.data(), {3}), 128);
  EXPECT_EQ(dst.view()(0, 0).to_float(), 5.0f);
  EXPECT_EQ(valid.view()(0), 1);
  EXPECT_EQ(valid.view()(1), 0);
  EXPECT_EQ(valid.view()(2), 1);
}

TEST(Gather, BadInputWritesNothing) {
  tdtest::Rng rng(14);
  td::Tensor<bf16, 2> pool({256, 8});
  fill_random<bf16>(rng, pool.flat());
  td::Tensor<bf16, 2> dst({4, 8});
  td::Tensor<std::uint8_t, 1> valid({4});
  fill_random<bf16>(rng, dst.flat());
  std::fill(valid.flat().begin(), valid.flat().end(), std::uint8_t(0x5a));
  const td::Tensor<bf16, 2> dst0 = dst;
  const td::Tensor<std::uint8_t, 1> valid0 = valid;
  auto rows = [&](std::vector<std::int32_t> s) {
    pg::gather_rows(dst.view(), valid.view(), pool.view(),
                    td::ConstView<std::int32_t, 1>(s.data(), {index_t(s.size())}));
  };
  auto rows64 = [&](std::vector<std::int64_t> s) {
    pg::gather_rows(dst.view(), valid.view(), pool.view(),
                    td::ConstView<std::int64_t, 1>(s.data(), {index_t(s.size())}));
  };
  expect_error([&] { rows({0, 1, 2, 256}); }, {"gather_rows", "slots[3]", "256", "[-1, 256)"});
  expect_error([&] { rows({0, 1, 2, -2}); }, {"slots[3]", "-2"});
  expect_error([&] { rows64({0, 1, 2, 1000000000000}); }, {"slots[3]", "1000000000000"});
  expect_error([&] { rows({0, 1, 2}); }, {"dst.extent(0)", "4"});
  expect_error(
      [&] {
        pg::gather_rows(
            dst.view().slice(1, 0, 7), valid.view(), pool.view(),
            td::ConstView<std::int32_t, 1>(std::vector<std::int32_t>{0, 1, 2, 3}.data(), {4}));
      },
      {"dst.extent(1)", "7"});
  expect_error(
      [&] {
        pg::gather_rows(
            dst.view(), valid.view().slice(0, 0, 3), pool.view(),
            td::ConstView<std::int32_t, 1>(std::vector<std::int32_t>{0, 1, 2, 3}.data(), {4}));
      },
      {"valid.extent(0)", "3"});

  // Windows: bad entry in the last list.
  td::Tensor<bf16, 3> wdst({2, 128, 8});
  td::Tensor<std::uint8_t, 2> wvalid({2, 128});
  td::Tensor<std::int32_t, 2> widx({2, 128});
  for (auto& e : widx.flat()) e = 3;
  widx.view()(1, 127) = 256;
  fill_random<bf16>(rng, wdst.flat());
  const td::Tensor<bf16, 3> wdst0 = wdst;
  expect_error([&] { pg::gather_windows(wdst.view(), wvalid.view(), pool.view(), widx.view()); },
               {"gather_windows", "window_indices[1,127]", "256"});
  widx.view()(1, 127) = -9;
  expect_error([&] { pg::gather_windows(wdst.view(), wvalid.view(), pool.view(), widx.view()); },
               {"window_indices[1,127]", "-9"});
  widx.view()(1, 127) = 3;
  expect_error(
      [&] {
        pg::gather_windows(wdst.view(), wvalid.view().slice(1, 0, 64), pool.view(), widx.view());
      },
      {"valid.extent(1)", "64"});
  EXPECT_TRUE(same_bytes(wdst, wdst0));

  // Logical: bad row, bad table entry (only entries read are checked), pool not a page multiple.
  td::Tensor<std::int32_t, 1> table({2});
  table.view()(0) = 1;
  table.view()(1) = 2;
  auto logical = [&](std::vector<std::int32_t> r, index_t page) {
    pg::gather_logical_rows(dst.view(), valid.view(), pool.view(), table.view(),
                            td::ConstView<std::int32_t, 1>(r.data(), {index_t(r.size())}), page);
  };
  expect_error([&] { logical({0, 1, 2, -3}, 128); }, {"gather_logical_rows", "rows[3]", "-3"});
  expect_error([&] { logical({0, 1, 2, 128}, 128); }, {"table_row[1]", "2", "[-1, 2)"});
  table.view()(1) = -4;
  expect_error([&] { logical({0, 1, 2, 128}, 128); }, {"table_row[1]", "-4"});
  expect_error([&] { logical({0, 1, 2, 3}, 100); }, {"pool.extent(0) % page", "56"});
  expect_error([&] { logical({0, 1, 2, 3}, 0); }, {"page", "0"});
  EXPECT_TRUE(same_bytes(dst, dst0));
  EXPECT_TRUE(same_bytes(valid, valid0));
  // -1 is not an error: zero row, invalid. A row past the table is invalid too.
  logical({-1, 0, 300, 1}, 128);
  EXPECT_EQ(valid.view()(0), 0);
  EXPECT_EQ(valid.view()(1), 1);
  EXPECT_EQ(valid.view()(2), 0);
  EXPECT_EQ(dst.view()(0, 0).bits, 0);
  EXPECT_EQ(std::memcmp(&dst.view()(3, 0), &pool.view()(129, 0), 8 * sizeof(bf16)), 0);
}

}  // namespace
