// Deterministic row top-k (tile/topk.hpp, kernels/topk.hpp) against the full-sort golden
// (golden/indexer.hpp) and, at CSA's 1M-context widths (4096 / 65536 / 262144 candidates, k = 512
// and 1024), against a plain std::stable_sort reference of (score, column) pairs, NaN last.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/compare.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/parallel.hpp"
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
  // Sizes on both sides of kTopkShortRow (1024: in-memory path / row-histogram path).
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

// ---- CSA at 1M context: exact equality with a plain reference at the real widths ----

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Every column in rank order: std::stable_sort of (score, column) pairs by descending score, NaN
// after every number (so equal scores, +0 / -0 included, keep ascending column). Written without
// tile/topk.hpp's keys or golden's comparator.
std::vector<std::int32_t> reference_rank(const std::vector<float>& s) {
  std::vector<std::pair<float, std::int32_t>> p;
  p.reserve(s.size());
  for (std::size_t j = 0; j < s.size(); ++j) p.emplace_back(s[j], static_cast<std::int32_t>(j));
  std::stable_sort(p.begin(), p.end(), [](const auto& a, const auto& b) {
    const bool an = std::isnan(a.first), bn = std::isnan(b.first);
    if (an || bn) return !an && bn;
    return a.first > b.first;
  });
  std::vector<std::int32_t> rank;
  for (const auto& [v, j] : p)
    if (!std::isnan(v)) rank.push_back(j);
  return rank;
}

// The first min(k, non-NaN) ranked columns + off, then -1 up to `width` slots.
std::vector<std::int32_t> reference_topk(const std::vector<std::int32_t>& rank, int k, int width,
                                         std::int32_t off = 0) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(width), -1);
  const std::size_t n = std::min(rank.size(), static_cast<std::size_t>(k));
  for (std::size_t i = 0; i < n; ++i) out[i] = rank[i] + off;
  return out;
}

// dst pre-filled with garbage, so an unwritten slot shows.
std::vector<std::int32_t> fast_filled(const std::vector<float>& s, int k, int width,
                                      std::int32_t off, std::int32_t fill) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(width), fill);
  td::tile::topk_row(out, s, k, off);
  return out;
}

// First position where two selections differ, for a readable failure.
testing::AssertionResult same_selection(const std::vector<std::int32_t>& a,
                                        const std::vector<std::int32_t>& e) {
  if (a.size() != e.size()) return testing::AssertionFailure() << "size " << a.size();
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != e[i]) {
      return testing::AssertionFailure()
             << "slot " << i << ": got " << a[i] << ", reference " << e[i];
    }
  return testing::AssertionSuccess();
}

enum class Row {
  normal,       // N(0, 10): distinct keys spread over many buckets
  tiny_set,     // 5 distinct values: huge single-value threshold buckets
  all_equal,    // one value everywhere: the lowest columns win
  specials,     // NaN, +-inf, kNegBig, +-0, FLT_MAX, denormals and normals mixed
  few_valid,    // < 512 non-NaN: padding -1 after them
  narrow,       // 1000 + U(0, 1e-3): keys share the top bits, every digit level needed
  indexer,      // ReLU-like: ~half exact zeros, the rest positive (CSA score shape)
  neg_big_tail  // a finite head, then kNegBig (the masked tail), with -inf and NaN inside
};

const char* row_name(Row r) {
  switch (r) {
    case Row::normal:
      return "normal";
    case Row::tiny_set:
      return "tiny_set";
    case Row::all_equal:
      return "all_equal";
    case Row::specials:
      return "specials";
    case Row::few_valid:
      return "few_valid";
    case Row::narrow:
      return "narrow";
    case Row::indexer:
      return "indexer";
    default:
      return "neg_big_tail";
  }
}

float special_value(tdtest::Rng& rng) {
  static constexpr float kSpecial[] = {kNan,
                                       kInf,
                                       -kInf,
                                       td::kNegBig,
                                       -td::kNegBig,
                                       0.0f,
                                       -0.0f,
                                       std::numeric_limits<float>::denorm_min(),
                                       -std::numeric_limits<float>::denorm_min(),
                                       1.0f,
                                       -1.0f};
  return kSpecial[rng.integer(0, std::size(kSpecial) - 1)];
}

std::vector<float> make_row(Row kind, int width, tdtest::Rng& rng) {
  std::vector<float> s(static_cast<std::size_t>(width));
  const int head = width / 3;
  for (int j = 0; j < width; ++j) {
    float& v = s[static_cast<std::size_t>(j)];
    switch (kind) {
      case Row::normal:
        v = rng.normal() * 10.0f;
        break;
      case Row::tiny_set: {
        static constexpr float kSet[] = {-2.0f, 0.0f, 0.5f, 0.75f, 3.0f};
        v = kSet[rng.integer(0, 4)];
        break;
      }
      case Row::all_equal:
        v = -0.125f;
        break;
      case Row::specials:
        v = rng.uniform() < 0.5f ? special_value(rng) : rng.normal();
        break;
      case Row::few_valid:
        v = rng.integer(0, width - 1) < 300 ? rng.normal() : kNan;
        break;
      case Row::narrow:
        v = 1000.0f + rng.uniform() * 1e-3f;
        break;
      case Row::indexer:
        v = std::max(0.0f, rng.normal()) * 0.03f;
        break;
      default:
        v = j < head ? rng.normal() : td::kNegBig;
        if (rng.uniform() < 0.01f) v = rng.uniform() < 0.5f ? -kInf : kNan;
        break;
    }
  }
  return s;
}

// The task's matrix: widths 4096 / 65536 / 262144, k = 512 and 1024, every row kind; the
// reference and the golden must both agree bit for bit, and every dst slot must be written.
TEST(Topk, CsaWidthsMatchStableSortReference) {
  tdtest::Rng rng(20261);
  const Row kinds[] = {Row::normal,    Row::tiny_set, Row::all_equal, Row::specials,
                       Row::few_valid, Row::narrow,   Row::indexer,   Row::neg_big_tail};
  for (int width : {4096, 65536, 262144}) {
    for (Row kind : kinds) {
      const auto s = make_row(kind, width, rng);
      const auto rank = reference_rank(s);
      for (int k : {512, 1024}) {
        SCOPED_TRACE(std::string(row_name(kind)) + " width=" + std::to_string(width) +
                     " k=" + std::to_string(k));
        const int slots = k + 8;
        const auto got = fast_filled(s, k, slots, 7, 0x5a5a5a5a);
        ASSERT_TRUE(same_selection(got, reference_topk(rank, k, slots, 7)));
        ASSERT_TRUE(same_selection(got, gold(s, k, slots, 7)));
        // Deterministic: another garbage fill, another run, the same selection.
        ASSERT_EQ(got, fast_filled(s, k, slots, 7, -77));
      }
      if (kind == Row::few_valid) {
        const auto got = fast(s, 1024, 1024);
        ASSERT_LT(rank.size(), 512u);  // the row really has fewer valid candidates than k
        for (std::size_t i = rank.size(); i < got.size(); ++i) ASSERT_EQ(got[i], -1) << i;
      }
    }
  }
}

// Hand-computed answers at a real width: kNegBig is a number (selected after the finite scores,
// lowest columns first, above -inf); NaN never; all-NaN rows and the empty row pad with -1.
TEST(Topk, WideRowNegBigInfNanHandChecked) {
  const int W = 65536;
  std::vector<float> s(W, td::kNegBig);
  s[40000] = 1.0f;
  s[50000] = -kInf;
  s[60000] = kNan;
  s[60001] = kInf;
  auto got = fast(s, 512, 512);
  ASSERT_EQ(got[0], 60001);
  ASSERT_EQ(got[1], 40000);
  for (int i = 2; i < 512; ++i) ASSERT_EQ(got[std::size_t(i)], i - 2) << i;
  // k = W: every number; -inf last, the NaN column never, one -1.
  got = fast(s, W, W);
  std::vector<std::int32_t> want = {60001, 40000};
  for (int j = 0; j < W; ++j)
    if (j != 40000 && j != 50000 && j != 60000 && j != 60001) want.push_back(j);
  want.push_back(50000);
  want.push_back(-1);
  ASSERT_TRUE(same_selection(got, want));
  // All NaN, wide: every slot -1.
  const std::vector<float> nans(262144, kNan);
  ASSERT_EQ(fast(nans, 1024, 1100), std::vector<std::int32_t>(1100, -1));
  // All equal, wide: the lowest columns, then padding.
  const std::vector<float> eq(262144, 3.5f);
  got = fast(eq, 1024, 1030);
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(got[std::size_t(i)], i);
  for (int i = 1024; i < 1030; ++i) ASSERT_EQ(got[std::size_t(i)], -1);
}

// k beyond the row (k > width), k == width and k > 2048 (winners sorted in place instead of by
// the stack radix sort) on both row paths.
TEST(Topk, LargeKAndKBeyondWidth) {
  tdtest::Rng rng(5);
  for (int width : {100, 1024, 1025, 4096, 4097, 65536}) {
    auto s = make_row(Row::tiny_set, width, rng);
    for (int j = 0; j < width; j += 97) s[std::size_t(j)] = kNan;
    const auto rank = reference_rank(s);
    for (int k : {width - 1, width, width + 1, 2 * width, 2047, 2048, 2049, 3000}) {
      if (k < 1) continue;
      SCOPED_TRACE("width=" + std::to_string(width) + " k=" + std::to_string(k));
      const int slots = k + 3;
      ASSERT_TRUE(
          same_selection(fast_filled(s, k, slots, 11, 999), reference_topk(rank, k, slots, 11)));
    }
  }
}

// Threshold buckets at and around the in-memory candidate capacity (4096 pairs), buckets that
// stay oversized after the second digit, single-value buckets larger than the buffer, and
// buckets taken whole: the paths of the select, each against the reference.
TEST(Topk, ThresholdBucketEdges) {
  tdtest::Rng rng(77);
  const int W = 65536;
  // Row: `above` winners (10 + i), `bucket` keys sharing 1.0's top digits, the rest below.
  // spread: 0 = bucket keys all 1.0; 1 = distinct ulps over 1.0 (one level-0 bucket);
  // 2 = only 512 distinct ulps (same level-1 digit too: resolved at level 2); 3 = keys on the
  // first and last values of digit buckets (1.0's low 21 key bits are 0: 0x1fffff is the last
  // key of its level-0 bucket, 0x3ff / 0x400 the edge between two level-1 buckets); 4 = all of
  // the bucket's keys on its last value.
  static constexpr std::uint32_t kEdge[] = {0,     1,        0x3fe,    0x3ff,    0x400,
                                            0x401, 0x1ffbff, 0x1ffc00, 0x1ffffe, 0x1fffff};
  const auto row = [&](int above, int bucket, int spread) {
    std::vector<float> s(W);
    for (auto& v : s) v = -1.0f - rng.uniform();
    std::vector<int> cols(W);
    for (int j = 0; j < W; ++j) cols[std::size_t(j)] = j;
    for (int i = 0; i < above + bucket; ++i)  // partial Fisher-Yates: random distinct columns
      std::swap(cols[std::size_t(i)], cols[std::size_t(rng.integer(i, W - 1))]);
    for (int i = 0; i < above; ++i) s[std::size_t(cols[std::size_t(i)])] = 10.0f + float(i);
    for (int i = 0; i < bucket; ++i) {
      std::uint32_t ulp = spread == 0 ? 0u : spread == 1 ? std::uint32_t(i) : i % 512u;
      if (spread == 3) ulp = kEdge[rng.integer(0, std::size(kEdge) - 1)];
      if (spread == 4) ulp = 0x1fffff;  // every bucket key on the bucket's last value
      s[std::size_t(cols[std::size_t(above + i)])] =
          std::bit_cast<float>(std::bit_cast<std::uint32_t>(1.0f) + ulp);
    }
    return s;
  };
  for (int bucket : {411, 412, 413, 4095, 4096, 4097, 4608, 30000}) {
    for (int spread : {0, 1, 2, 3, 4}) {
      const auto s = row(100, bucket, spread);
      const auto rank = reference_rank(s);
      for (int k : {100, 101, 512, 1024}) {
        SCOPED_TRACE("bucket=" + std::to_string(bucket) + " spread=" + std::to_string(spread) +
                     " k=" + std::to_string(k));
        ASSERT_TRUE(same_selection(fast(s, k, k), reference_topk(rank, k, k)));
      }
    }
  }
}

// Seeded fuzz-style cases: random widths (1 … 300000, log-spread), k, offsets and per-element
// mixtures of the row kinds; each against the reference, the golden and with every slot written.
TEST(Topk, SeededFuzzAgainstReference) {
  tdtest::Rng rng(0x70b4);
  const Row kinds[] = {Row::normal,    Row::tiny_set, Row::all_equal, Row::specials,
                       Row::few_valid, Row::narrow,   Row::indexer,   Row::neg_big_tail};
  for (int c = 0; c < 160; ++c) {
    const int width = std::max(1, int(std::exp(rng.uniform() * std::log(300000.0f))));
    // Two kinds interleaved in runs: bucket boundaries and ties fall anywhere.
    const auto a = make_row(kinds[rng.integer(0, 7)], width, rng);
    const auto b = make_row(kinds[rng.integer(0, 7)], width, rng);
    std::vector<float> s(static_cast<std::size_t>(width));
    const int run = int(rng.integer(1, 5000));
    for (int j = 0; j < width; ++j) s[std::size_t(j)] = ((j / run) % 2 ? a : b)[std::size_t(j)];
    int k = 0;
    switch (rng.integer(0, 3)) {
      case 0:
        k = rng.uniform() < 0.5f ? 512 : 1024;
        break;
      case 1:
        k = int(rng.integer(1, 64));
        break;
      case 2:
        k = int(rng.integer(1, width + 10));
        break;
      default:
        k = int(rng.integer(1, 2100));
        break;
    }
    const int slots = k + int(rng.integer(0, 9));
    const std::int32_t off = std::int32_t(rng.integer(0, 1 << 20));
    SCOPED_TRACE("case=" + std::to_string(c) + " width=" + std::to_string(width) +
                 " k=" + std::to_string(k) + " run=" + std::to_string(run));
    const auto got = fast_filled(s, k, slots, off, std::int32_t(rng.integer(-5, 5)));
    ASSERT_TRUE(same_selection(got, reference_topk(reference_rank(s), k, slots, off)));
    ASSERT_TRUE(same_selection(got, gold(s, k, slots, off)));
  }
}

// The row entry point at a CSA width: per-row valid lengths (the rest of a row is never read:
// garbage there must not change the answer), 2 threads == 1 thread.
TEST(Topk, RowsEntryPointAtCsaWidth) {
  tdtest::Rng rng(3);
  const int W = 262144, R = 3;
  td::Tensor<float, 2> score({R, W});
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) score.view()(r, j) = rng.normal();
  td::Tensor<std::int32_t, 1> valid({R});
  valid.view()(0) = W;
  valid.view()(1) = 70000;
  valid.view()(2) = 700;
  for (int j = 70000; j < W; ++j) score.view()(1, j) = 1e30f;  // past valid: must be ignored
  td::Tensor<std::int32_t, 2> one({R, 1024}), two({R, 1024});
  td::ThreadPool pool(2);
  td::kernels::topk_rows(td::cpu::Context{}, one.view(), score.view(), valid.view(), 1024, 5);
  td::kernels::topk_rows(td::cpu::Context{&pool}, two.view(), score.view(), valid.view(), 1024, 5);
  for (int r = 0; r < R; ++r) {
    std::vector<float> row(static_cast<std::size_t>(valid.view()(r)));
    for (std::size_t j = 0; j < row.size(); ++j) row[j] = score.view()(r, td::index_t(j));
    const auto e = reference_topk(reference_rank(row), 1024, 1024, 5);
    for (int i = 0; i < 1024; ++i) {
      ASSERT_EQ(one.view()(r, i), e[std::size_t(i)]) << r << " " << i;
      ASSERT_EQ(two.view()(r, i), e[std::size_t(i)]) << r << " " << i;
    }
  }
}

}  // namespace
