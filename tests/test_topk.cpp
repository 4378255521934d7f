// Deterministic row top-k (kernels/topk.hpp) against the full-sort golden (golden/indexer.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/compare.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/kernels/topk.hpp"

namespace td = tiledecode;

namespace {

std::vector<std::int32_t> fast(const std::vector<float>& s, int k, int width,
                               std::int32_t off = 0) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(width), 12345);
  td::kernels::topk_row(out, s, k, off);
  return out;
}
std::vector<std::int32_t> gold(const std::vector<float>& s, int k, int width,
                               std::int32_t off = 0) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(width), 12345);
  td::golden::topk_row(out, s, k, off);
  return out;
}

TEST(Topk, HandComputedOrderAndTies) {
  const std::vector<float> s = {1.0f, 3.0f, 3.0f, -2.0f, 5.0f, 3.0f, 0.0f};
  // Descending score, ascending column among the three 3.0s.
  EXPECT_EQ(fast(s, 4, 6), (std::vector<std::int32_t>{4, 1, 2, 5, -1, -1}));
  // The threshold falls inside the tie: the lowest columns win.
  EXPECT_EQ(fast(s, 2, 3), (std::vector<std::int32_t>{4, 1, -1}));
  // Offset is added to winners only.
  EXPECT_EQ(fast(s, 3, 4, 128), (std::vector<std::int32_t>{132, 129, 130, -1}));
  // k larger than the row: every column, then padding.
  EXPECT_EQ(fast(s, 7, 9), (std::vector<std::int32_t>{4, 1, 2, 5, 0, 6, 3, -1, -1}));
}

TEST(Topk, NanNeverSelectedAndPadsEverySlot) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> s = {nan, 2.0f, nan, -1.0f, nan};
  EXPECT_EQ(fast(s, 4, 5), (std::vector<std::int32_t>{1, 3, -1, -1, -1}));
  const std::vector<float> all_nan(64, nan);
  EXPECT_EQ(fast(all_nan, 8, 8), std::vector<std::int32_t>(8, -1));
  // Empty row (vis = 0): everything -1.
  EXPECT_EQ(fast({}, 4, 6), std::vector<std::int32_t>(6, -1));
}

TEST(Topk, SignedZerosTieAndInfinitiesOrder) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> s = {-0.0f, 0.0f, -inf, inf, td::kNegBig, -0.0f, 1e-30f};
  // +0 and -0 are equal: ascending column. -inf below kNegBig.
  EXPECT_EQ(fast(s, 7, 7), (std::vector<std::int32_t>{3, 6, 0, 1, 5, 4, 2}));
  EXPECT_EQ(fast(s, 3, 3), (std::vector<std::int32_t>{3, 6, 0}));
  EXPECT_EQ(fast(s, 3, 3), gold(s, 3, 3));
}

TEST(Topk, AllEqualRowPicksLowestColumns) {
  const std::vector<float> s(4096, 0.25f);
  const auto r = fast(s, 512, 600);
  for (int i = 0; i < 512; ++i) ASSERT_EQ(r[static_cast<std::size_t>(i)], i);
  for (int i = 512; i < 600; ++i) ASSERT_EQ(r[static_cast<std::size_t>(i)], -1);
}

// Random rows, many ties (values on a coarse grid), narrow ranges (keys sharing the top bytes,
// so the radix select needs all four digits), NaNs sprinkled in.
TEST(Topk, MatchesGoldenExactlyOnRandomRows) {
  tdtest::Rng rng(7);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 5000 > kTopkTile exercises the tile-free path.
  const int sizes[] = {1, 2, 5, 127, 128, 129, 511, 512, 513, 1000, 2048, 4096, 5000};
  for (int n : sizes) {
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<float> s(static_cast<std::size_t>(n));
      for (auto& v : s) {
        switch (mode) {
          case 0:
            v = rng.normal() * 10.0f;
            break;
          case 1:
            v = float(rng.integer(-8, 8)) * 0.5f;
            break;  // heavy ties
          case 2:
            v = 1000.0f + rng.uniform() * 1e-3f;
            break;  // shared top bytes
          default:
            v = rng.uniform() < 0.1f ? nan : rng.normal();
            break;  // NaNs
        }
      }
      for (int k : {1, 7, 512, 1024, 4500}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " mode=" + std::to_string(mode) +
                     " k=" + std::to_string(k));
        const int width = std::max(k, 16);
        const auto a = fast(s, k, width, 3);
        const auto e = gold(s, k, width, 3);
        ASSERT_EQ(a, e);
        ASSERT_TRUE(tdtest::topk_pair_compare(
            std::span<const std::int32_t>(a), std::span<const std::int32_t>(e),
            [&](std::int32_t i) { return s[static_cast<std::size_t>(i - 3)]; }));
      }
    }
  }
}

TEST(Topk, RowsEntryPointValidatesAndRunsPerRow) {
  td::Tensor<float, 2> score({3, 16});
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < 16; ++j) score.view()(r, j) = float((j * 7 + r) % 16);
  td::Tensor<std::int32_t, 1> valid({3});
  valid.view()(0) = 16;
  valid.view()(1) = 0;
  valid.view()(2) = 5;
  td::Tensor<std::int32_t, 2> dst({3, 8});
  td::cpu::Context ctx{};
  td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 4, 0);
  for (int r = 0; r < 3; ++r) {
    std::vector<float> row;
    for (int j = 0; j < valid.view()(r); ++j) row.push_back(score.view()(r, j));
    const auto e = gold(row, 4, 8);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(dst.view()(r, i), e[static_cast<std::size_t>(i)]);
  }
  EXPECT_THROW(td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 17, 0),
               td::Error);
  EXPECT_THROW(td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 0, 0),
               td::Error);
  EXPECT_THROW(td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 9, 0),
               td::Error);
  EXPECT_THROW(td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 4, -1),
               td::Error);
  valid.view()(2) = 17;
  EXPECT_THROW(td::kernels::topk_rows(ctx, dst.view(), score.view(), valid.view(), 4, 0),
               td::Error);
}

}  // namespace
