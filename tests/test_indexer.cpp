// Lightning indexer (spec §7): fast path (scalar and AVX2) against the golden with the §10.2
// tolerances, bit-identity across ISAs and thread counts, edge cases and validation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/compare.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace kn = tiledecode::kernels;
using td::index_t;

namespace {

std::vector<td::cpu::Isa> isas() {
  return td::cpu::supported_isas();  // scalar, avx2, avx2_vnni (the VNNI indexer score)
}

template <class T, std::size_t R>
std::vector<T> flat(const td::Tensor<T, R>& t) {
  return std::vector<T>(t.flat().begin(), t.flat().end());
}

// One decode step's score inputs: metadata, a paged index cache, quantised queries and weights.
struct ScoreCase {
  td::ModelConfig cfg = td::flash_config();
  int B = 4, S = 2;
  index_t pool_blocks = 64;
  td::Tensor<std::int32_t, 1> positions, kv_lens;
  td::Tensor<std::int32_t, 2> table;
  td::Tensor<std::int8_t, 2> cache;
  td::Tensor<float, 1> kscale;
  td::Tensor<std::int8_t, 3> q;
  td::Tensor<float, 2> q_sc, w;

  index_t T() const { return index_t(B) * S; }
  int vis(index_t t) const {
    return td::golden::indexer_visible_rows(cfg, positions.view()(t), kv_lens.view()(t / S));
  }
};

// starts: one per request. Pool rows are random Q8-range INT8 (with some -128), scales > 0.
ScoreCase make_case(const std::vector<std::int32_t>& starts, int S, index_t pool_blocks,
                    std::uint64_t seed, index_t table_cols = 64) {
  ScoreCase c;
  c.B = int(starts.size());
  c.S = S;
  c.pool_blocks = pool_blocks;
  const td::paged::StepShape sh{c.B, S, -1};
  c.positions = td::Tensor<std::int32_t, 1>({c.T()});
  c.kv_lens = td::Tensor<std::int32_t, 1>({c.B});
  td::paged::build_position_ids(c.positions.view(), starts, sh, c.cfg);
  td::paged::build_kv_seq_lens(c.kv_lens.view(), starts, sh, c.cfg);
  c.table = td::Tensor<std::int32_t, 2>({c.B, table_cols});
  td::paged::build_fixture_block_table(c.table.view(), pool_blocks);
  tdtest::Rng rng(seed);
  c.cache = td::Tensor<std::int8_t, 2>({pool_blocks * 128, 128});
  rng.fill_int8(c.cache.flat());
  c.kscale = td::Tensor<float, 1>({pool_blocks * 128});
  rng.fill_uniform(c.kscale.flat(), 0.002f, 0.02f);
  const index_t H = c.cfg.idx_n_heads;
  c.q = td::Tensor<std::int8_t, 3>({c.T(), H, 128});
  rng.fill_int8(c.q.flat());
  c.q_sc = td::Tensor<float, 2>({c.T(), H});
  rng.fill_uniform(c.q_sc.flat(), 0.002f, 0.02f);
  c.w = td::Tensor<float, 2>({c.T(), H});
  rng.fill_normal(c.w.flat(), 0.3f);
  return c;
}

void run_score(const td::cpu::Context& ctx, const ScoreCase& c, td::Tensor<float, 2>& score) {
  kn::indexer_score(ctx, c.cfg, score.view(), c.q.view(), c.q_sc.view(), c.w.view(), c.cache.view(),
                    c.kscale.view(), c.table.view(), c.positions.view(), c.kv_lens.view(), c.S);
}

td::Tensor<float, 2> golden_score(const ScoreCase& c) {
  td::Tensor<float, 2> score({c.T(), c.cfg.score_len()});
  td::golden::indexer_score(c.cfg, score.view(), c.q.view(), c.q_sc.view(), c.w.view(),
                            c.cache.view(), c.kscale.view(), c.table.view(), c.positions.view(),
                            c.kv_lens.view(), c.S);
  return score;
}

// §10.2: valid region ratio_allclose(1e-4, 1/128, 0.5%); tail exactly kNegBig; then top-k
// (offset 0 and WIN = 128): tie-tolerant vs golden top-k of the golden score, and exact equality
// with the golden rule applied to the kernel's own score.
void expect_matches_golden(const ScoreCase& c, const td::Tensor<float, 2>& got,
                           const td::Tensor<float, 2>& want, const td::cpu::Context& ctx) {
  const index_t N = c.cfg.score_len();
  for (index_t t = 0; t < c.T(); ++t) {
    SCOPED_TRACE("token " + std::to_string(t) + " vis " + std::to_string(c.vis(t)));
    const int vis = c.vis(t);
    const std::span<const float> a(&got.view()(t, 0), std::size_t(N)),
        e(&want.view()(t, 0), std::size_t(N));
    ASSERT_TRUE(tdtest::ratio_allclose(a.subspan(0, std::size_t(vis)),
                                       e.subspan(0, std::size_t(vis)), 1e-4, 1.0 / 128, 0.005));
    for (index_t j = vis; j < N; ++j) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(a[std::size_t(j)]),
                std::bit_cast<std::uint32_t>(td::kNegBig))
          << "tail column " << j;
    }
  }
  for (std::int32_t offset : {0, 128}) {
    const int k = c.cfg.idx_topk;
    td::Tensor<std::int32_t, 2> ta({c.T(), N}), te({c.T(), N}), tr({c.T(), N});
    kn::indexer_topk(ctx, c.cfg, ta.view(), got.view(), c.positions.view(), c.kv_lens.view(), c.S,
                     k, offset);
    td::golden::indexer_topk(c.cfg, te.view(), want.view(), c.positions.view(), c.kv_lens.view(),
                             c.S, k, offset);
    td::golden::indexer_topk(c.cfg, tr.view(), got.view(), c.positions.view(), c.kv_lens.view(),
                             c.S, k, offset);
    ASSERT_EQ(flat(ta), flat(tr)) << "deterministic rule, offset " << offset;
    for (index_t t = 0; t < c.T(); ++t) {
      const std::span<const std::int32_t> ra(&ta.view()(t, 0), std::size_t(k)),
          re(&te.view()(t, 0), std::size_t(k));
      const auto score_of = [&](std::int32_t i) {
        const index_t j = std::clamp<index_t>(i - offset, 0, N - 1);
        return got.view()(t, j);
      };
      ASSERT_TRUE(tdtest::topk_pair_compare(ra, re, score_of))
          << "token " << t << " offset " << offset;
      for (index_t i = k; i < N; ++i) ASSERT_EQ(ta.view()(t, i), -1);
      const int n = std::min(k, c.vis(t));
      for (int i = 0; i < n; ++i) {
        ASSERT_GE(ra[std::size_t(i)], offset);
        ASSERT_LT(ra[std::size_t(i)], offset + c.vis(t));
      }
      for (int i = n; i < k; ++i) ASSERT_EQ(ra[std::size_t(i)], -1);
    }
  }
}

// Score on every ISA vs golden, plus every SIMD tier == scalar bit for bit.
void check_score_case(const ScoreCase& c) {
  const auto want = golden_score(c);
  std::vector<float> first;
  for (auto isa : isas()) {
    SCOPED_TRACE(std::string("isa ") + std::string(td::cpu::to_string(isa)));
    td::cpu::Context ctx{nullptr, isa};
    td::Tensor<float, 2> got({c.T(), c.cfg.score_len()});
    std::fill(got.flat().begin(), got.flat().end(), 12345.0f);  // stale data must be overwritten
    run_score(ctx, c, got);
    expect_matches_golden(c, got, want, ctx);
    if (first.empty()) {
      first = flat(got);
    } else {
      ASSERT_EQ(first, flat(got)) << "differs from the scalar path";
    }
  }
}

TEST(IndexerScore, CanonicalCsaStarts) {
  check_score_case(make_case({8192, 0, 2, 3}, 2, 64, 1));
}

TEST(IndexerScore, Start16382AliasedTable) {
  // vis 4095 / 4096 = 32 pages per request, but each request owns only 16 of the 64 fixture
  // blocks: logical pages c and c+16 alias (spec §3.8) and both paths read through the table.
  auto c = make_case({16382, 16382, 16382, 16382}, 2, 64, 2);
  EXPECT_EQ(c.vis(0), 4095);
  EXPECT_EQ(c.vis(1), 4096);
  EXPECT_EQ(c.table.view()(1, 0), c.table.view()(1, 16));
  check_score_case(c);
}

TEST(IndexerScore, VisibleLengthEdges) {
  // One token per request, pos = 4*vis - 1 and kv_len = 4*vis give exactly `vis` rows.
  const int vis[] = {0, 1, 127, 128, 129, 511, 512, 513, 4096};
  std::vector<std::int32_t> starts;
  for (int v : vis) starts.push_back(v == 0 ? 2 : 4 * v - 1);
  auto c = make_case(starts, 1, 64 * 9, 3);
  for (std::size_t i = 0; i < starts.size(); ++i) ASSERT_EQ(c.vis(index_t(i)), vis[i]);
  check_score_case(c);
}

TEST(IndexerScore, Batch64) {
  std::vector<std::int32_t> starts;
  tdtest::Rng rng(11);
  for (int b = 0; b < 64; ++b) starts.push_back(std::int32_t(rng.integer(0, 2046)));
  starts[5] = 3;
  starts[9] = 2045;
  check_score_case(make_case(starts, 2, 256, 4));
}

TEST(IndexerScore, NegativeAndZeroWeights) {
  auto c = make_case({8192, 513, 1030, 3}, 2, 64, 5);
  for (index_t t = 0; t < c.T(); ++t)
    for (index_t h = 0; h < c.cfg.idx_n_heads; ++h) {
      float& w = c.w.view()(t, h);
      if (t % 2 == 0) w = -std::fabs(w);  // all negative: scores <= 0
      if (h % 3 == 0) w = 0.0f;
    }
  check_score_case(c);
  // All weights zero: every visible score is exactly 0, top-k = 0, 1, 2, ... (ties by column).
  for (auto& v : c.w.flat()) v = 0.0f;
  check_score_case(c);
  td::Tensor<float, 2> got({c.T(), 4096});
  td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
  run_score(ctx, c, got);
  td::Tensor<std::int32_t, 2> top({c.T(), 512});
  kn::indexer_topk(ctx, c.cfg, top.view(), got.view(), c.positions.view(), c.kv_lens.view(), c.S,
                   512, 0);
  for (index_t t = 0; t < c.T(); ++t) {
    for (int j = 0; j < c.vis(t); ++j) ASSERT_EQ(got.view()(t, j), 0.0f);
    for (int i = 0; i < 512; ++i) ASSERT_EQ(top.view()(t, i), i < c.vis(t) ? i : -1);
  }
}

TEST(IndexerScore, AllEqualScoresRow) {
  // Every cache row identical (and one scale) → one score value per token; top-k must be the
  // lowest columns in ascending order.
  auto c = make_case({8192, 8192, 4000, 3}, 2, 64, 6);
  auto cache = c.cache.view();
  for (index_t r = 1; r < cache.extent(0); ++r)
    for (index_t d = 0; d < 128; ++d) cache(r, d) = cache(0, d);
  for (auto& s : c.kscale.flat()) s = 0.01f;
  check_score_case(c);
  td::Tensor<float, 2> got({c.T(), 4096});
  td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
  run_score(ctx, c, got);
  td::Tensor<std::int32_t, 2> top({c.T(), 4096});
  kn::indexer_topk(ctx, c.cfg, top.view(), got.view(), c.positions.view(), c.kv_lens.view(), c.S,
                   512, 0);
  for (index_t t = 0; t < c.T(); ++t) {
    for (int j = 1; j < c.vis(t); ++j) ASSERT_EQ(got.view()(t, j), got.view()(t, 0));
    for (int i = 0; i < 4096; ++i)
      ASSERT_EQ(top.view()(t, i), i < std::min(512, c.vis(t)) ? i : -1);
  }
}

TEST(IndexerScore, ExactAtTheInt8Extremes) {
  // The int16-widening dot (avx2) is exact for -128 × -128 (the vpmaddubsw sign trick is not);
  // the VNNI dot offsets the key to k + 128 in [0, 255] and starts at -128 Σ q, so the extremes
  // of both operands (k = -128 → 0, k = 127 → 255; q = -128 and 127) are checked on every tier.
  auto c = make_case({8192, 8192, 8192, 8192}, 2, 64, 7);
  auto cache = c.cache.view();
  tdtest::Rng rng(8);
  for (index_t r = 0; r < cache.extent(0); ++r)
    for (index_t d = 0; d < 128; ++d)
      cache(r, d) = (r % 3 == 0)   ? std::int8_t(-128)
                    : (r % 3 == 1) ? std::int8_t(127)
                                   : std::int8_t(rng.integer(-128, 127));
  for (auto& v : c.q_sc.flat()) v = 1.0f;
  for (auto& v : c.kscale.flat()) v = 1.0f;
  for (auto& v : c.w.flat()) v = 0.0f;
  for (index_t t = 0; t < c.T(); ++t) c.w.view()(t, 0) = 1.0f;  // score = relu(dot of head 0)
  for (int q_value : {-128, 127}) {
    for (auto& v : c.q.flat()) v = std::int8_t(q_value);
    for (auto isa : isas()) {
      td::cpu::Context ctx{nullptr, isa};
      td::Tensor<float, 2> got({c.T(), 4096});
      run_score(ctx, c, got);
      for (index_t t = 0; t < c.T(); ++t)
        for (int j = 0; j < c.vis(t); ++j) {
          const index_t row = index_t(c.table.view()(t / c.S, j / 128)) * 128 + j % 128;
          std::int64_t dot = 0;
          for (index_t d = 0; d < 128; ++d) dot += std::int64_t(q_value) * cache(row, d);
          ASSERT_EQ(got.view()(t, j), float(std::max<std::int64_t>(dot, 0)))
              << td::cpu::to_string(isa) << " q " << q_value << " t " << t << " j " << j;
          if (row % 3 == 0 && q_value == -128) {
            ASSERT_EQ(got.view()(t, j), 2097152.0f);  // 128 · 128 · 128
          }
          if (row % 3 == 1 && q_value == 127) {
            ASSERT_EQ(got.view()(t, j), 2064512.0f);  // 127 · 127 · 128
          }
        }
    }
  }
}

TEST(IndexerScore, BitIdenticalForAnyThreadCount) {
  auto c = make_case({8192, 0, 2, 16382}, 2, 64, 9);
  for (auto isa : isas()) {
    std::vector<float> ref;
    for (std::size_t threads : {1, 2, 7}) {
      td::ThreadPool pool(threads);
      td::cpu::Context ctx{&pool, isa};
      td::Tensor<float, 2> got({c.T(), 4096});
      run_score(ctx, c, got);
      td::Tensor<std::int32_t, 2> top({c.T(), 512});
      kn::indexer_topk(ctx, c.cfg, top.view(), got.view(), c.positions.view(), c.kv_lens.view(),
                       c.S, 512, 0);
      auto v = flat(got);
      for (auto i : flat(top)) v.push_back(float(i));
      if (ref.empty()) ref = v;
      ASSERT_EQ(ref, v) << td::cpu::to_string(isa) << " threads " << threads;
    }
  }
}

TEST(IndexerScore, RejectsBadArgumentsBeforeWriting) {
  auto c = make_case({8192, 0, 2, 3}, 2, 64, 10);
  td::cpu::Context ctx{nullptr, td::cpu::Isa::scalar};
  td::Tensor<float, 2> got({c.T(), 4096});
  const auto expect_throw_untouched = [&](const ScoreCase& bad) {
    std::fill(got.flat().begin(), got.flat().end(), 7.0f);
    EXPECT_THROW(run_score(ctx, bad, got), td::Error);
    for (float v : got.flat()) ASSERT_EQ(v, 7.0f);
  };
  {
    auto bad = make_case({8192, 0, 2, 3}, 2, 64, 10);
    bad.table.view()(2, 40) = 64;  // >= pool blocks (outside any visible range: still an error)
    expect_throw_untouched(bad);
    bad.table.view()(2, 40) = -2;  // < -1
    expect_throw_untouched(bad);
    bad.table.view()(2, 40) = -1;  // unmapped outside the visible range: fine
    EXPECT_NO_THROW(run_score(ctx, bad, got));
    bad.table.view()(0, 15) = -1;  // unmapped page inside request 0's 2048 visible rows
    expect_throw_untouched(bad);
  }
  {
    auto bad = make_case({8192, 0, 2, 3}, 2, 64, 10);
    bad.q_sc.view()(3, 5) = 0.0f;
    expect_throw_untouched(bad);
  }
  {
    auto bad = make_case({8192, 0, 2, 3}, 2, 64, 10, /*table_cols=*/8);  // 16 pages needed
    expect_throw_untouched(bad);
  }
  {
    auto bad = make_case({8192, 0, 2, 3}, 2, 64, 10);
    bad.positions.view()(1) = 16384;
    expect_throw_untouched(bad);
  }
  {
    auto bad = make_case({8192, 0, 2, 3}, 2, 64, 10);
    bad.S = 1;  // T != B * S
    expect_throw_untouched(bad);
  }
  td::Tensor<float, 2> narrow({c.T(), 2048});
  EXPECT_THROW(kn::indexer_score(ctx, c.cfg, narrow.view(), c.q.view(), c.q_sc.view(), c.w.view(),
                                 c.cache.view(), c.kscale.view(), c.table.view(),
                                 c.positions.view(), c.kv_lens.view(), c.S),
               td::Error);
  // Top-k arguments.
  run_score(ctx, c, got);
  td::Tensor<std::int32_t, 2> top({c.T(), 512});
  const auto topk = [&](int k, std::int32_t off) {
    kn::indexer_topk(ctx, c.cfg, top.view(), got.view(), c.positions.view(), c.kv_lens.view(), c.S,
                     k, off);
  };
  EXPECT_THROW(topk(4097, 0), td::Error);  // > row width
  EXPECT_THROW(topk(513, 0), td::Error);   // > dst width
  EXPECT_THROW(topk(0, 0), td::Error);
  EXPECT_THROW(topk(512, -1), td::Error);
  EXPECT_THROW(topk(512, std::numeric_limits<std::int32_t>::max() - 100), td::Error);
  EXPECT_NO_THROW(topk(512, 128));
}

TEST(IndexerTopk, NanScoresNeverSelected) {
  auto c = make_case({8192, 0, 2, 3}, 2, 64, 12);
  td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
  td::Tensor<float, 2> got({c.T(), 4096});
  run_score(ctx, c, got);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int j = 0; j < 2048; j += 3) got.view()(0, j) = nan;
  for (int j = 0; j < 2048; ++j) got.view()(1, j) = (j < 2000) ? nan : got.view()(1, j);
  td::Tensor<std::int32_t, 2> top({c.T(), 600}), want({c.T(), 600});
  kn::indexer_topk(ctx, c.cfg, top.view(), got.view(), c.positions.view(), c.kv_lens.view(), c.S,
                   512, 0);
  td::golden::indexer_topk(c.cfg, want.view(), got.view(), c.positions.view(), c.kv_lens.view(),
                           c.S, 512, 0);
  EXPECT_EQ(flat(top), flat(want));
  for (int i = 0; i < 600; ++i) {
    const std::int32_t j = top.view()(0, i);
    if (j >= 0) {
      ASSERT_FALSE(std::isnan(got.view()(0, j)));
    }
  }
  for (int i = 0; i < 600; ++i) ASSERT_EQ(top.view()(1, i) >= 0, i < 48) << i;  // 48 non-NaN left
}

// ---------------------------------------------------------------------------------------------
// Query path and weights.

struct QueryCase {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 8;
  td::Tensor<std::int8_t, 2> qr, wq_b;
  td::Tensor<float, 1> qr_scale, wq_scale;
  td::Tensor<td::bf16, 2> hadamard;
  td::Tensor<std::int32_t, 1> rope_pos;
  td::RopeTable rope;
};

QueryCase make_query_case(index_t T, bool sylvester, std::uint64_t seed) {
  QueryCase c;
  c.T = T;
  tdtest::Rng rng(seed);
  c.qr = td::Tensor<std::int8_t, 2>({T, c.cfg.q_lora});
  rng.fill_int8(c.qr.flat());
  c.qr.view()(0, 0) = -128;  // not produced by Q8, still exact here
  c.qr_scale = td::Tensor<float, 1>({T});
  rng.fill_uniform(c.qr_scale.flat(), 0.005f, 0.02f);
  const index_t N = index_t(c.cfg.idx_n_heads) * 128;
  c.wq_b = td::Tensor<std::int8_t, 2>({c.cfg.q_lora, N});
  rng.fill_int8(c.wq_b.flat());
  c.wq_b.view()(3, 5) = -128;
  c.wq_scale = td::Tensor<float, 1>({N});
  rng.fill_uniform(c.wq_scale.flat(), 0.0005f, 0.002f);
  if (sylvester) {
    c.hadamard = td::make_hadamard_bf16(128);
  } else {  // the standalone reference test's random non-orthogonal rand(128,128)/sqrt(128)
    c.hadamard = td::Tensor<td::bf16, 2>({128, 128});
    for (auto& v : c.hadamard.flat()) v = td::bf16(rng.uniform() / std::sqrt(128.0f));
  }
  c.rope_pos = td::Tensor<std::int32_t, 1>({T});
  for (index_t t = 0; t < T; ++t) c.rope_pos.view()(t) = std::int32_t(rng.integer(0, 16383));
  c.rope = td::make_rope_table(c.cfg, td::LayerKind::csa, c.cfg.max_seq_len);
  return c;
}

// golden::indexer_query of a case: q_i8 (T, H, 128) and q_sc (T, H).
struct QueryGolden {
  td::Tensor<std::int8_t, 3> q;
  td::Tensor<float, 2> s;
  explicit QueryGolden(const QueryCase& c)
      : q({c.T, c.cfg.idx_n_heads, 128}), s({c.T, c.cfg.idx_n_heads}) {
    td::golden::indexer_query(c.cfg, q.view(), s.view(), c.qr.view(), c.qr_scale.view(),
                              c.wq_b.view(), c.wq_scale.view(), c.rope_pos.view(), c.rope.view(),
                              c.hadamard.view());
  }
};

void check_query_case(const QueryCase& c) {
  const index_t T = c.T, H = c.cfg.idx_n_heads;
  const QueryGolden g(c);
  const td::Tensor<std::int8_t, 3>& qe = g.q;
  const td::Tensor<float, 2>& se = g.s;
  const auto packed =
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
  std::vector<std::int8_t> first_q;
  std::vector<float> first_s;
  for (auto isa : isas()) {
    SCOPED_TRACE(std::string("isa ") + std::string(td::cpu::to_string(isa)));
    // The scalar GEMM is slow: one thread count there, 1/2/7 on the vector path.
    const std::vector<std::size_t> counts = isa == td::cpu::Isa::scalar
                                                ? std::vector<std::size_t>{2}
                                                : std::vector<std::size_t>{1, 2, 7};
    for (std::size_t threads : counts) {
      td::ThreadPool pool(threads);
      td::cpu::Context ctx{&pool, isa};
      td::Tensor<std::int8_t, 3> qa({T, H, 128});
      td::Tensor<float, 2> sa({T, H});
      kn::indexer_query(ctx, c.cfg, qa.view(), sa.view(), c.qr.view(), c.qr_scale.view(), packed,
                        c.rope_pos.view(), c.rope.view());
      if (first_q.empty()) {
        first_q = flat(qa);
        first_s = flat(sa);
        // Against golden: scales ratio_allclose, INT8 values within 1 (Q8 rounding of an FP32 vs
        // double Hadamard sum), at most 1% of them off.
        ASSERT_TRUE(tdtest::ratio_allclose(sa.flat(), se.flat(), 1e-7, 1e-4, 0.0));
        std::size_t off = 0;
        for (std::size_t i = 0; i < first_q.size(); ++i) {
          const int d = std::abs(int(qa.flat()[i]) - int(qe.flat()[i]));
          ASSERT_LE(d, 1) << "element " << i;
          off += d != 0;
        }
        EXPECT_LE(double(off) / double(first_q.size()), 0.01);
        for (auto v : first_q) ASSERT_NE(v, -128);
      } else {
        ASSERT_EQ(first_q, flat(qa)) << "threads " << threads;
        ASSERT_EQ(first_s, flat(sa)) << "threads " << threads;
      }
    }
  }
}

TEST(IndexerQuery, MatchesGoldenSylvesterHadamard) {
  // The exact Sylvester pattern takes the FWHT path.
  auto c = make_query_case(8, true, 21);
  EXPECT_TRUE(
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view())
          .sylvester);
  check_query_case(c);
}

TEST(IndexerQuery, MatchesGoldenAlmostSylvesterTakesTheMatrixPath) {
  auto c = make_query_case(6, true, 28);
  c.hadamard.view()(17, 93) = td::bf16(-c.hadamard.view()(17, 93).to_float());
  EXPECT_FALSE(
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view())
          .sylvester);
  check_query_case(c);
}

TEST(IndexerQuery, MatchesGoldenRandomRotationOddTokenCount) {
  check_query_case(make_query_case(7, false, 22));  // token tiles 4 + 3
}

TEST(IndexerQuery, RopePositionIsAnExplicitPerTokenInput) {
  // CSA composition: rope_pos[t] = start_b for both tokens ([QUIRK] §5); build it from
  // position_ids and check it against golden, and that it differs from rotating at pos_t.
  auto c = make_query_case(8, true, 23);
  const std::vector<std::int32_t> starts = {8192, 0, 2, 16382};
  td::Tensor<std::int32_t, 1> positions({8});
  td::paged::build_position_ids(positions.view(), starts, {4, 2, -1}, c.cfg);
  kn::indexer_rope_positions(c.rope_pos.view(), positions.view(), 2);
  for (index_t t = 0; t < 8; ++t) ASSERT_EQ(c.rope_pos.view()(t), starts[std::size_t(t / 2)]);
  check_query_case(c);

  const auto packed =
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
  td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
  td::Tensor<std::int8_t, 3> q_start({8, 64, 128}), q_pos({8, 64, 128});
  td::Tensor<float, 2> s_start({8, 64}), s_pos({8, 64});
  kn::indexer_query(ctx, c.cfg, q_start.view(), s_start.view(), c.qr.view(), c.qr_scale.view(),
                    packed, c.rope_pos.view(), c.rope.view());
  kn::indexer_query(ctx, c.cfg, q_pos.view(), s_pos.view(), c.qr.view(), c.qr_scale.view(), packed,
                    positions.view(), c.rope.view());
  for (index_t t = 0; t < 8; ++t) {
    const bool same = std::equal(&q_start.view()(t, 0, 0), &q_start.view()(t, 0, 0) + 64 * 128,
                                 &q_pos.view()(t, 0, 0));
    EXPECT_EQ(same, t % 2 == 0) << "token " << t;  // s = 0 rotates at start_b = pos_t
  }
  EXPECT_THROW(kn::indexer_rope_positions(c.rope_pos.view(), positions.view(), 3), td::Error);
}

TEST(IndexerQuery, RejectsBadArguments) {
  auto c = make_query_case(4, true, 24);
  const auto packed =
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
  td::cpu::Context ctx{nullptr, td::cpu::Isa::scalar};
  td::Tensor<std::int8_t, 3> q({4, 64, 128});
  td::Tensor<float, 2> s({4, 64});
  c.rope_pos.view()(2) = 16384;
  EXPECT_THROW(kn::indexer_query(ctx, c.cfg, q.view(), s.view(), c.qr.view(), c.qr_scale.view(),
                                 packed, c.rope_pos.view(), c.rope.view()),
               td::Error);
  c.rope_pos.view()(2) = 0;
  td::Tensor<float, 2> s_bad({4, 32});
  EXPECT_THROW(kn::indexer_query(ctx, c.cfg, q.view(), s_bad.view(), c.qr.view(), c.qr_scale.view(),
                                 packed, c.rope_pos.view(), c.rope.view()),
               td::Error);
  td::Tensor<td::bf16, 2> had_bad({64, 128});
  EXPECT_THROW(
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), had_bad.view()),
      td::Error);
  auto pro = td::pro_config();  // Q_LORA 1536: the flash pack does not fit
  EXPECT_THROW(kn::indexer_query(ctx, pro, q.view(), s.view(), c.qr.view(), c.qr_scale.view(),
                                 packed, c.rope_pos.view(), c.rope.view()),
               td::Error);
}

// Rounding accuracy of the query (issue: values rounded to BF16 / INT8 are exact first): qi =
// acc·qr_scale·idx_wq_b_scale and its rotation run in double, so bf16(qi) is the exact value
// rounded once (the INT32 dot is exact); the FWHT sums 128 BF16 values in FP32 (exact while
// their exponents lie within 16 bits of each other) and scales once. Measured: q_i8 against
// golden (double throughout) at 64 tokens × 64 heads × 128: 0 of 524288 differ on every tier
// (q_sc: 33 of 4096 differ in the last bits, the FWHT's FP32 amax). Bar: 1e-5.
TEST(rounding, IndexerQueryQ8MatchesTheExactQuery) {
  const QueryCase c = make_query_case(64, true, 71);
  const index_t T = c.T, H = c.cfg.idx_n_heads;
  const QueryGolden g(c);
  const td::Tensor<std::int8_t, 3>& qe = g.q;
  const td::Tensor<float, 2>& se = g.s;
  const auto packed =
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
  for (auto isa : isas()) {
    SCOPED_TRACE(std::string(td::cpu::to_string(isa)));
    td::ThreadPool pool(2);
    td::Tensor<std::int8_t, 3> qa({T, H, 128});
    td::Tensor<float, 2> sa({T, H});
    kn::indexer_query(td::cpu::Context{&pool, isa}, c.cfg, qa.view(), sa.view(), c.qr.view(),
                      c.qr_scale.view(), packed, c.rope_pos.view(), c.rope.view());
    std::size_t off = 0, scale_off = 0;
    for (std::size_t i = 0; i < qa.size(); ++i) off += qa.flat()[i] != qe.flat()[i];
    for (std::size_t i = 0; i < sa.size(); ++i) scale_off += sa.flat()[i] != se.flat()[i];
    std::printf("  indexer q_i8 %-10s %zu / %zu differ, q_sc %zu / %zu\n",
                std::string(td::cpu::to_string(isa)).c_str(), off, qa.size(), scale_off, sa.size());
    EXPECT_LE(double(off) / double(qa.size()), 1e-5);
  }
}

TEST(IndexerQuery, ProPresetQLora1536AndTopk1024) {
  auto c = make_query_case(5, true, 25);
  c.cfg = td::pro_config();
  tdtest::Rng rng(26);
  c.qr = td::Tensor<std::int8_t, 2>({5, c.cfg.q_lora});
  rng.fill_int8(c.qr.flat());
  c.wq_b = td::Tensor<std::int8_t, 2>({c.cfg.q_lora, 64 * 128});
  rng.fill_int8(c.wq_b.flat());
  check_query_case(c);

  auto sc = make_case({8192, 16382}, 2, 64, 27);
  sc.cfg = td::pro_config();
  const auto want = golden_score(sc);
  td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
  td::Tensor<float, 2> got({sc.T(), 4096});
  run_score(ctx, sc, got);
  expect_matches_golden(sc, got, want, ctx);  // top-k with k = cfg.idx_topk = 1024
}

// The VNNI query GEMMs (avx2_vnni: 256-bit vpdpbusd, avx512: 512-bit vpdpbusd, on the offset
// weights) against the avx2 tier (vpmaddwd on int16-widened operands): the integer dots are exact,
// so q_i8 and q_sc must match bit for bit.
// Shapes: the flash preset (token tiles 4 + 4 and 4 + 3), Q_LORA = 130 (K % 4 == 2: the last
// pair row alone, and the i8_sum tail) and Q_LORA = 4096 (the INT32 bound's limit).
struct QueryTierShape {
  int q_lora, heads;
  index_t T;
};
constexpr QueryTierShape kQueryTierShapes[] = {
    {1024, 64, 8}, {1024, 64, 7}, {130, 16, 5}, {4096, 16, 4}};

QueryCase make_query_tier_case(const QueryTierShape& sh, std::uint64_t seed) {
  auto c = make_query_case(sh.T, true, seed);
  c.cfg.q_lora = sh.q_lora;
  c.cfg.idx_n_heads = sh.heads;
  c.qr = td::Tensor<std::int8_t, 2>({sh.T, sh.q_lora});
  c.wq_b = td::Tensor<std::int8_t, 2>({sh.q_lora, index_t(sh.heads) * 128});
  c.wq_scale = td::Tensor<float, 1>({index_t(sh.heads) * 128});
  tdtest::Rng rng(seed + 1);
  for (auto& v : c.qr.flat()) v = std::int8_t(rng.integer(-128, 127));
  for (auto& v : c.wq_b.flat()) v = std::int8_t(rng.integer(-128, 127));
  rng.fill_uniform(c.wq_scale.flat(), 0.0005f, 0.002f);
  return c;
}

// Runs the avx2 tier and `tier` (1 and 3 threads) and memcmp's q_i8 and q_sc.
void expect_vnni_query_matches_avx2(td::cpu::Isa tier, const QueryCase& c,
                                    const std::string& what) {
  SCOPED_TRACE(what);
  const index_t T = c.T, H = c.cfg.idx_n_heads;
  const auto packed =
      kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
  const auto run = [&](td::cpu::Isa isa, std::size_t threads) {
    td::ThreadPool pool(threads);
    td::cpu::Context ctx{&pool, isa};
    std::pair<td::Tensor<std::int8_t, 3>, td::Tensor<float, 2>> out{
        td::Tensor<std::int8_t, 3>({T, H, 128}), td::Tensor<float, 2>({T, H})};
    kn::indexer_query(ctx, c.cfg, out.first.view(), out.second.view(), c.qr.view(),
                      c.qr_scale.view(), packed, c.rope_pos.view(), c.rope.view());
    return out;
  };
  const auto want = run(td::cpu::Isa::avx2, 1);
  for (std::size_t threads : {1, 3}) {
    const auto got = run(tier, threads);
    ASSERT_EQ(std::memcmp(got.first.data(), want.first.data(), std::size_t(T * H * 128)), 0)
        << "q_i8, threads " << threads;
    ASSERT_EQ(
        std::memcmp(got.second.data(), want.second.data(), sizeof(float) * std::size_t(T * H)), 0)
        << "q_sc, threads " << threads;
  }
}

void expect_query_tier_bit_identical(td::cpu::Isa tier) {
  std::uint64_t seed = 40;
  for (const auto& sh : kQueryTierShapes) {
    auto c = make_query_tier_case(sh, seed++);
    expect_vnni_query_matches_avx2(
        tier, c, "random, q_lora " + std::to_string(sh.q_lora) + " T " + std::to_string(sh.T));
    c.hadamard = td::Tensor<td::bf16, 2>({128, 128});  // the dense-rotation epilogue
    tdtest::Rng rng(seed++);
    for (auto& v : c.hadamard.flat()) v = td::bf16(rng.uniform() / std::sqrt(128.0f));
    expect_vnni_query_matches_avx2(tier, c, "random rotation, q_lora " + std::to_string(sh.q_lora));
  }
}

TEST(IndexerQuery, VnniTierBitIdenticalToAvx2) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2_vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  expect_query_tier_bit_identical(td::cpu::Isa::avx2_vnni);
}

TEST(IndexerQuery, Avx512TierBitIdenticalToAvx2) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  expect_query_tier_bit_identical(td::cpu::Isa::avx512);
}

// qr = -128 everywhere (the offset's start value -128 Σ qr at its largest, 2^14 K) against
// weights -128 (offset to 0), 127 (offset to 255) and a -128 / 127 mix; plus qr = 127 and a
// mixed qr. At Q_LORA = 4096 the dots reach 2^26 = 128 · 128 · 4096.
void expect_query_tier_exact_at_extremes(td::cpu::Isa tier) {
  const auto mix = [](index_t i, index_t j) {
    return std::int8_t((i * 7 + j * 3) % 5 < 2 ? -128 : 127);
  };
  for (const auto& sh : kQueryTierShapes) {
    auto c = make_query_tier_case(sh, 60);
    const auto N = index_t(sh.heads) * 128;
    for (int qv : {-128, 127, 0}) {    // 0: the mixed qr
      for (int wv : {-128, 127, 0}) {  // 0: the mixed weights
        for (index_t t = 0; t < sh.T; ++t)
          for (index_t k = 0; k < sh.q_lora; ++k)
            c.qr.view()(t, k) = qv != 0 ? std::int8_t(qv) : mix(t, k);
        for (index_t k = 0; k < sh.q_lora; ++k)
          for (index_t n = 0; n < N; ++n)
            c.wq_b.view()(k, n) = wv != 0 ? std::int8_t(wv) : mix(k, n);
        expect_vnni_query_matches_avx2(tier, c,
                                       "q_lora " + std::to_string(sh.q_lora) + " T " +
                                           std::to_string(sh.T) + " qr " + std::to_string(qv) +
                                           " w " + std::to_string(wv));
      }
    }
  }
}

TEST(IndexerQuery, VnniTierExactAtTheInt8Extremes) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2_vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  expect_query_tier_exact_at_extremes(td::cpu::Isa::avx2_vnni);
}

TEST(IndexerQuery, Avx512TierExactAtTheInt8Extremes) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  expect_query_tier_exact_at_extremes(td::cpu::Isa::avx512);
}

TEST(IndexerWeights, MatchesGoldenAndHandlesZeroWeights) {
  const auto cfg = td::flash_config();
  for (index_t T : {1, 8, 13}) {
    tdtest::Rng rng(31 + std::uint64_t(T));
    td::Tensor<td::bf16, 2> x({T, cfg.hidden}), wp({cfg.hidden, 64});
    rng.fill_normal(x.flat(), 1.0f);
    rng.fill_normal(wp.flat(), 0.2313f);
    td::Tensor<float, 2> want({T, 64});
    td::golden::indexer_weights(cfg, want.view(), x.view(), wp.view());
    std::vector<float> first;
    for (auto isa : isas()) {
      for (std::size_t threads : {1, 2, 7}) {
        td::ThreadPool pool(threads);
        td::cpu::Context ctx{&pool, isa};
        td::Tensor<float, 2> got({T, 64});
        kn::indexer_weights(ctx, cfg, got.view(), x.view(), wp.view());
        ASSERT_TRUE(tdtest::ratio_allclose(got.flat(), want.flat(), 1e-5, 1e-4, 0.0));
        if (first.empty()) first = flat(got);
        ASSERT_EQ(first, flat(got)) << td::cpu::to_string(isa) << " threads " << threads;
      }
    }
    // Zero and sign-flipped projections.
    for (index_t d = 0; d < cfg.hidden; ++d)
      for (index_t h = 0; h < 64; ++h) {
        if (h % 2 == 0) wp.view()(d, h) = td::bf16(0.0f);
      }
    td::cpu::Context ctx{nullptr, td::cpu::detect_isa()};
    td::Tensor<float, 2> got({T, 64});
    kn::indexer_weights(ctx, cfg, got.view(), x.view(), wp.view());
    for (index_t t = 0; t < T; ++t)
      for (index_t h = 0; h < 64; h += 2) ASSERT_EQ(got.view()(t, h), 0.0f);
  }
}

// The whole indexer chained (query → weights → score → top-k) against the golden chain.
TEST(IndexerPipeline, EndToEndAgainstGolden) {
  auto qc = make_query_case(8, true, 41);
  auto sc = make_case({8192, 0, 2, 3}, 2, 64, 42);
  td::paged::build_position_ids(sc.positions.view(), std::vector<std::int32_t>{8192, 0, 2, 3},
                                {4, 2, -1}, sc.cfg);
  kn::indexer_rope_positions(qc.rope_pos.view(), sc.positions.view(), 2);
  tdtest::Rng rng(43);
  td::Tensor<td::bf16, 2> x({8, sc.cfg.hidden}), wp({sc.cfg.hidden, 64});
  rng.fill_normal(x.flat(), 1.0f);
  rng.fill_normal(wp.flat(), 0.2313f);
  // Golden chain.
  td::golden::indexer_query(sc.cfg, sc.q.view(), sc.q_sc.view(), qc.qr.view(), qc.qr_scale.view(),
                            qc.wq_b.view(), qc.wq_scale.view(), qc.rope_pos.view(), qc.rope.view(),
                            qc.hadamard.view());
  td::golden::indexer_weights(sc.cfg, sc.w.view(), x.view(), wp.view());
  const auto want = golden_score(sc);
  // Fast chain.
  const auto packed = kn::pack_indexer_query_weights(sc.cfg, qc.wq_b.view(), qc.wq_scale.view(),
                                                     qc.hadamard.view());
  td::ThreadPool pool(2);
  td::cpu::Context ctx{&pool, td::cpu::detect_isa()};
  ScoreCase fc = make_case({8192, 0, 2, 3}, 2, 64, 42);  // same cache and metadata
  kn::indexer_query(ctx, fc.cfg, fc.q.view(), fc.q_sc.view(), qc.qr.view(), qc.qr_scale.view(),
                    packed, qc.rope_pos.view(), qc.rope.view());
  kn::indexer_weights(ctx, fc.cfg, fc.w.view(), x.view(), wp.view());
  td::Tensor<float, 2> got({fc.T(), 4096});
  run_score(ctx, fc, got);
  for (index_t t = 0; t < fc.T(); ++t) {
    const int vis = fc.vis(t);
    ASSERT_TRUE(tdtest::ratio_allclose(std::span<const float>(&got.view()(t, 0), std::size_t(vis)),
                                       std::span<const float>(&want.view()(t, 0), std::size_t(vis)),
                                       1e-4, 1.0 / 128, 0.005));
  }
}

}  // namespace
