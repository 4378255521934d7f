// Compressors (spec §6): kernels::compressor_step / indexer_compressor_step against the golden
// twins, on the scalar and (where the CPU has it) AVX2 paths, with the §10.2 tolerances:
//   kv_out and emitted cache rows ratio_allclose(1e-4, 1/128, 0%), state (1e-3, 1e-3, 0%),
//   INT8 index cache atol 1 / rtol 0 with <= 1% mismatches, index scales (1e-4, 1/128, 1%).
// Rows that must not be written are compared bit-exactly with their initial contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/compare.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/golden/compressor.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace tk = tiledecode::kernels;
using td::bf16;
using td::index_t;

namespace {

enum class Kind { csa, hca, inner };

const td::ModelConfig& cfg() {
  static const td::ModelConfig c = td::flash_config();
  return c;
}

tk::CompressorSpec spec_of(Kind k) {
  switch (k) {
    case Kind::csa:
      return tk::csa_compressor_spec(cfg());
    case Kind::hca:
      return tk::hca_compressor_spec(cfg());
    case Kind::inner:
      return tk::indexer_compressor_spec(cfg());
  }
  return {};
}

// One RoPE table per profile, shared by every test (CSA and HCA layers use the YaRN profile).
const td::RopeTable& rope_table() {
  static const td::RopeTable t = td::make_rope_table(cfg(), td::LayerKind::csa, cfg().max_seq_len);
  return t;
}

// Weights at the checkpoint statistics of spec §10.3 (HCA: the spec gives none; the CSA main
// statistics are used). Built once per kind.
struct Weights {
  td::Tensor<bf16, 2> wkv, wgate;
  td::Tensor<float, 2> ape;
  td::Tensor<bf16, 1> norm_w;
  tk::CompressorWeights view() const {
    return {wkv.view(), wgate.view(), ape.view(), norm_w.view()};
  }
};

const Weights& weights(Kind k) {
  static std::unique_ptr<Weights> cache[3];
  auto& w = cache[int(k)];
  if (w) return *w;
  const auto sp = spec_of(k);
  const index_t out = sp.out_dim(), d = cfg().hidden;
  const bool inner = k == Kind::inner;
  w = std::make_unique<Weights>();
  tdtest::Rng rng(1000 + int(k));
  w->wkv = td::Tensor<bf16, 2>({out, d});
  w->wgate = td::Tensor<bf16, 2>({out, d});
  w->ape = td::Tensor<float, 2>({sp.ratio, out});
  w->norm_w = td::Tensor<bf16, 1>({sp.head_dim});
  rng.fill_normal(w->wkv.flat(), inner ? 0.0293f : 0.0245f);
  rng.fill_normal(w->wgate.flat(), inner ? 0.0512f : 0.0388f);
  rng.fill_normal(w->ape.flat(), inner ? 0.1528f : 0.1243f);
  for (auto& v : w->norm_w.flat())
    v = bf16(inner ? 0.685f + 0.26f * rng.normal() : 0.9666f + 0.19f * rng.normal());
  return *w;
}

struct Options {
  Kind kind = Kind::csa;
  std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  int seq = 2;
  int commit = -1;
  bool permuted = false;
  bool random_hadamard = false;
  std::uint64_t seed = 1;
  // (request, logical state-table column) pairs to unmap (set to -1) before the slot mappings
  // are built.
  std::vector<std::pair<int, int>> unmap = {};
  // A production allocator's state table instead of the fixtures' aliased one (spec §3.8): each
  // request's columns from its window reach before its start to past its last token own blocks
  // of their own (ids in request order); the other columns are unmapped.
  bool disjoint = false;
};

// The inputs of one step, built like the reference fixtures (spec §3, §10.3).
struct Fixture {
  Options opt;
  tk::CompressorSpec spec;
  td::paged::StepShape shape;
  index_t state_page = 0, state_blocks = 0, cache_rows = 0;
  td::Tensor<bf16, 2> x_n;
  td::Tensor<std::int32_t, 1> positions;
  td::Tensor<std::int32_t, 2> state_table, cmp_table;
  td::Tensor<std::int64_t, 1> state_slots, cmp_slots;
  td::Tensor<float, 2> state_pool;      // initial contents
  td::Tensor<bf16, 2> cmp_pool;         // initial contents (main)
  td::Tensor<std::int8_t, 2> idx_pool;  // initial contents (inner)
  td::Tensor<float, 1> idx_scale;
  td::Tensor<bf16, 2> hadamard;

  tk::CompressorMetadata meta() const {
    return {shape, positions.view(), state_slots.view(), cmp_slots.view(), state_table.view()};
  }
  int emitted() const {
    int n = 0;
    for (auto v : cmp_slots.flat()) n += v >= 0;
    return n;
  }
};

Fixture make_fixture(const Options& o) {
  const auto& c = cfg();
  Fixture f;
  f.opt = o;
  f.spec = spec_of(o.kind);
  f.shape = {static_cast<int>(o.starts.size()), o.seq, o.commit};
  const index_t B = f.shape.batch, T = f.shape.tokens();
  const bool r4 = f.spec.ratio == 4;
  f.state_page = r4 ? c.c4_state_page : c.c128_state_page;
  f.state_blocks = r4 ? 65 : 64;  // spec §1.3: CSA main / inner 65, HCA 64
  const index_t cols = c.max_seq_len / f.state_page;
  tdtest::Rng rng(o.seed);

  f.positions = td::Tensor<std::int32_t, 1>({T});
  td::paged::build_position_ids(f.positions.view(), o.starts, f.shape, c);
  f.state_table = td::Tensor<std::int32_t, 2>({B, cols});
  td::paged::build_fixture_block_table(f.state_table.view(), f.state_blocks, o.permuted);
  if (o.disjoint) {
    std::int32_t next = 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t col = 0; col < cols; ++col) {
        const index_t p = col * f.state_page, s0 = o.starts[std::size_t(b)];
        const bool used = p + f.state_page > s0 - 2 * f.spec.ratio - 128 && p < s0 + o.seq;
        f.state_table.view()(b, col) = used ? next++ : -1;
      }
    f.state_blocks = next;
  }
  for (auto [b, col] : o.unmap) f.state_table.view()(b, col) = -1;
  f.state_slots = td::Tensor<std::int64_t, 1>({T});
  td::paged::build_state_slot_mapping(f.state_slots.view(), f.positions.view(),
                                      f.state_table.view(), f.state_blocks, int(f.state_page),
                                      f.shape, c);
  const bool inner = o.kind == Kind::inner;
  const index_t cmp_blocks = inner ? 64 : 32;  // IDX_KV_BLOCK_NUM / CMP_KV_BLOCK_NUM
  f.cmp_table = td::Tensor<std::int32_t, 2>({B, cmp_blocks});
  td::paged::build_fixture_block_table(f.cmp_table.view(), cmp_blocks, o.permuted);
  f.cmp_slots = td::Tensor<std::int64_t, 1>({T});
  td::paged::build_compressed_slot_mapping(f.cmp_slots.view(), f.positions.view(),
                                           f.cmp_table.view(), cmp_blocks, f.spec.ratio, f.shape,
                                           c);
  f.cache_rows = cmp_blocks * c.page;

  f.x_n = td::Tensor<bf16, 2>({T, index_t(c.hidden)});
  rng.fill_normal(f.x_n.flat());

  // States: ratio 4 starts as kv 0 / score -inf, HCA as zeros (spec §6.3 fixture note); then
  // history rows before each request's start get 0.05·randn in both halves (the last 64
  // positions for ratio 4; for HCA only the last 100, so a window can reach unwritten history).
  const index_t sw = f.spec.state_width(), out = f.spec.out_dim();
  f.state_pool = td::Tensor<float, 2>({f.state_blocks * f.state_page, sw});
  auto sp = f.state_pool.view();
  if (r4) {
    for (index_t r = 0; r < sp.extent(0); ++r)
      for (index_t i = out; i < sw; ++i) sp(r, i) = td::kNegBig;
  }
  const index_t hist = r4 ? 64 : 100;
  for (index_t b = 0; b < B; ++b) {
    for (index_t p = std::max<index_t>(0, o.starts[b] - hist); p < o.starts[b]; ++p) {
      const auto slot = td::paged::paged_slot("fixture", "state_table", f.state_table.view(), b, p,
                                              f.state_page, f.state_blocks);
      if (slot < 0) continue;
      for (index_t i = 0; i < sw; ++i) sp(slot, i) = 0.05f * rng.normal();
    }
  }
  if (inner) {
    f.idx_pool = td::Tensor<std::int8_t, 2>({f.cache_rows, 128});
    rng.fill_int8(f.idx_pool.flat());
    f.idx_scale = td::Tensor<float, 1>({f.cache_rows});
    rng.fill_uniform(f.idx_scale.flat(), 1e-3f, 2e-2f);
    if (o.random_hadamard) {
      // The standalone tests' non-orthogonal stand-in: rand(128,128)/sqrt(128) (spec §6.4).
      f.hadamard = td::Tensor<bf16, 2>({128, 128});
      for (auto& v : f.hadamard.flat()) v = bf16(rng.uniform() / std::sqrt(128.0f));
    } else {
      f.hadamard = td::make_hadamard_bf16(128);
    }
  } else {
    f.cmp_pool = td::Tensor<bf16, 2>({f.cache_rows, f.spec.head_dim});
    rng.fill_normal(f.cmp_pool.flat());
  }
  return f;
}

// Outputs of one run (copies of the in/out pools).
struct Outputs {
  td::Tensor<float, 2> state;
  td::Tensor<bf16, 2> cmp;
  td::Tensor<std::int8_t, 2> idx;
  td::Tensor<float, 1> scale;
  td::Tensor<float, 2> kv_out;
};

Outputs fresh_outputs(const Fixture& f) {
  Outputs o{f.state_pool, f.cmp_pool, f.idx_pool, f.idx_scale,
            td::Tensor<float, 2>({index_t(f.shape.batch), index_t(f.spec.head_dim)})};
  return o;
}

Outputs run_golden(const Fixture& f,
                   tk::InnerRopePosition rule = tk::InnerRopePosition::window_start) {
  Outputs o = fresh_outputs(f);
  const auto& w = weights(f.opt.kind);
  if (f.opt.kind == Kind::inner) {
    td::golden::indexer_compressor_step(cfg(), o.state.view(), o.idx.view(), o.scale.view(),
                                        o.kv_out.view(), f.x_n.view(), w.view(), f.hadamard.view(),
                                        f.meta(), rope_table().view(), rule);
  } else {
    td::golden::compressor_step(cfg(), f.spec, o.state.view(), o.cmp.view(), o.kv_out.view(),
                                f.x_n.view(), w.view(), f.meta(), rope_table().view());
  }
  return o;
}

// bf16: the avx512 tier's BF16 row products (automatic: this CPU's choice, fma on Intel, dpbf16
// on AMD; the other tiers ignore it).
Outputs run_kernel(const Fixture& f, td::cpu::Isa isa, int threads,
                   tk::InnerRopePosition rule = tk::InnerRopePosition::window_start,
                   td::cpu::Bf16Dot bf16 = td::cpu::Bf16Dot::automatic) {
  Outputs o = fresh_outputs(f);
  const auto& w = weights(f.opt.kind);
  std::optional<td::ThreadPool> pool;
  if (threads > 1) pool.emplace(threads);
  const td::cpu::Context ctx{pool ? &*pool : nullptr, td::cpu::checked_isa(isa), bf16};
  td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
  if (f.opt.kind == Kind::inner) {
    tk::indexer_compressor_step(ctx, cfg(), o.state.view(), o.idx.view(), o.scale.view(),
                                o.kv_out.view(), f.x_n.view(), w.view(), f.hadamard.view(),
                                f.meta(), rope_table().view(), ws.view(), rule);
  } else {
    tk::compressor_step(ctx, cfg(), f.spec, o.state.view(), o.cmp.view(), o.kv_out.view(),
                        f.x_n.view(), w.view(), f.meta(), rope_table().view(), ws.view());
  }
  return o;
}

std::vector<td::cpu::Isa> isas() {
  // avx2_vnni runs this kernel's avx2 code unchanged (only the INT8 indexer score and wo_b have
  // VNNI paths), so it is not run twice here; test_layer covers every tier end to end. avx512 has
  // its own pooling (8 double lanes, backend/cpu/compressor_avx512.hpp).
  std::vector<td::cpu::Isa> v{td::cpu::Isa::scalar};
  if (td::cpu::cpu_has_avx2()) v.push_back(td::cpu::Isa::avx2);
  if (td::cpu::cpu_has_avx512()) v.push_back(td::cpu::Isa::avx512);
  return v;
}

template <class T>
std::span<const T> row_span(const td::Tensor<T, 2>& t, index_t r) {
  const index_t w = t.extent(1);
  return std::span<const T>(t.data() + r * w, std::size_t(w));
}

std::vector<float> floats(std::span<const bf16> v) {
  return tdtest::to_floats(v);
}
std::vector<float> floats(std::span<const std::int8_t> v) {
  return {v.begin(), v.end()};
}

// Compares a kernel run with the golden run and with the initial pools.
void expect_matches(const Fixture& f, const Outputs& a, const Outputs& e, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(tdtest::ratio_allclose(a.state.flat(), e.state.flat(), 1e-3, 1e-3, 0.0)) << "state";
  EXPECT_TRUE(tdtest::ratio_allclose(a.kv_out.flat(), e.kv_out.flat(), 1e-4, 1.0 / 128, 0.0))
      << "kv_out";
  std::set<index_t> written;
  for (auto s : f.cmp_slots.flat())
    if (s >= 0) written.insert(s);
  if (f.opt.kind == Kind::inner) {
    std::vector<float> qa, qe, sa, se;
    for (index_t r : written) {
      auto ra = floats(row_span(a.idx, r)), re = floats(row_span(e.idx, r));
      qa.insert(qa.end(), ra.begin(), ra.end());
      qe.insert(qe.end(), re.begin(), re.end());
      sa.push_back(a.scale.data()[r]);
      se.push_back(e.scale.data()[r]);
    }
    EXPECT_TRUE(tdtest::ratio_allclose(qa, qe, 1.0, 0.0, 0.01)) << "idx_kv_cache";
    EXPECT_TRUE(tdtest::ratio_allclose(sa, se, 1e-4, 1.0 / 128, 0.01)) << "idx_kv_scale";
    for (index_t r = 0; r < f.cache_rows; ++r) {
      if (written.count(r)) continue;
      ASSERT_EQ(std::memcmp(row_span(a.idx, r).data(), row_span(f.idx_pool, r).data(), 128), 0)
          << "idx row " << r << " written without a slot";
      ASSERT_EQ(a.scale.data()[r], f.idx_scale.data()[r]) << "scale row " << r;
    }
  } else {
    std::vector<float> ca, ce;
    for (index_t r : written) {
      auto ra = floats(row_span(a.cmp, r)), re = floats(row_span(e.cmp, r));
      ca.insert(ca.end(), ra.begin(), ra.end());
      ce.insert(ce.end(), re.begin(), re.end());
    }
    EXPECT_TRUE(tdtest::ratio_allclose(ca, ce, 1e-4, 1.0 / 128, 0.0)) << "cmp_kv rows";
    const std::size_t bytes = sizeof(bf16) * std::size_t(f.spec.head_dim);
    for (index_t r = 0; r < f.cache_rows; ++r) {
      if (written.count(r)) continue;
      ASSERT_EQ(std::memcmp(row_span(a.cmp, r).data(), row_span(f.cmp_pool, r).data(), bytes), 0)
          << "cmp row " << r << " written without a slot";
    }
  }
}

void expect_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  SCOPED_TRACE(what);
  auto same = [](auto x, auto y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size_bytes()) == 0);
  };
  EXPECT_TRUE(same(a.state.flat(), b.state.flat())) << "state";
  EXPECT_TRUE(same(a.cmp.flat(), b.cmp.flat())) << "cmp";
  EXPECT_TRUE(same(a.idx.flat(), b.idx.flat())) << "idx";
  EXPECT_TRUE(same(a.scale.flat(), b.scale.flat())) << "scale";
  EXPECT_TRUE(same(a.kv_out.flat(), b.kv_out.flat())) << "kv_out";
}

// Golden once, then every ISA (2 threads) against it.
void check_case(const Options& o, int expected_emitted) {
  const Fixture f = make_fixture(o);
  ASSERT_EQ(f.emitted(), expected_emitted) << "fixture does not exercise what the test claims";
  const Outputs e = run_golden(f);
  for (auto isa : isas())
    expect_matches(f, run_kernel(f, isa, 2), e, std::string(td::cpu::to_string(isa)));
}

// --- CSA main compressor (ratio 4, overlapping) ----------------------------------------------

// The rounding check's rounds for ρ pick their parts (backend_ops_compressor::next_parts): the
// listed channels' parts not yet repaired first, in their order and once each (a repaired part's
// bounds are 0, of both kinds), then the other parts by what they remove of ρ's sum of squares,
// Σ_d p_d² (b_k + b_s)² (b: bound_r, kv's and the scores'): a channel's larger part L, p_d² L (L +
// 2S), its smaller one, p_d² S² (kv's part the larger on a tie; no part without a gain: repaired,
// p = 0, NaN), ranked by buckets of an eighth of an octave below the largest share (the last
// bucket everything past 16 octaves), channel order within a bucket; whole buckets while they fit
// the round (kRhoParts in all) and leave more than keep of the sum, then the next bucket's parts
// until keep is reached or the round is full, at least one part. Checked against that rule
// written plainly (a stable sort), with the listed channels filling part of a round, none, and
// all of it, channels with one part repaired (the other still counts), a channel whose kv bound
// dwarfs its scores' (its kv part taken, its scores' part not), keep fractions that end inside a
// bucket, and that a round reaches keep where its parts can.
TEST(CsaCompressor, RoundingCheckRoundsForRhoPickTheLargestGains) {
  using Ops = td::cpu::backend_ops_compressor<td::cpu::Isa::scalar>;
  constexpr int B = Ops::kRhoParts, HD = 128, NB = Ops::kGainBuckets;
  std::vector<float> pooled(HD), z(HD), bound(2 * HD), bound_r(2 * HD);
  std::vector<std::int32_t> hit(HD, 7);  // next_parts' scratch (the listing's flags)
  tdtest::Rng rng(404);
  const auto at = [](int d) { return std::size_t(d); };
  for (int d = 0; d < HD; ++d) {
    pooled[at(d)] = rng.uniform(-2.0f, 2.0f);
    z[at(d)] = pooled[at(d)] * 0x1p-30f;
    for (int h : {0, HD}) {
      bound[at(h + d)] = rng.uniform(0.5f, 1.0f) * 1e-6f;
      bound_r[at(h + d)] = bound[at(h + d)] * 0.25f;
    }
  }
  for (int d : {3, 9, 40, 41})  // repaired
    for (int h : {0, HD}) bound[at(h + d)] = bound_r[at(h + d)] = 0.0f;
  bound[5] = bound_r[5] = 0.0f;                          // kv repaired, the scores not
  bound[at(HD + 60)] = bound_r[at(HD + 60)] = 0.0f;      // the scores repaired, kv not
  pooled[7] = z[7] = 0.0f;                               // no share
  pooled[11] = std::numeric_limits<float>::quiet_NaN();  // no share
  pooled[20] = pooled[21] = 1.5f, z[20] = z[21] = 0.0f;  // equal parts
  for (int d : {20, 21})
    for (int h : {0, HD}) bound[at(h + d)] = bound_r[at(h + d)] = 0.375e-6f;
  pooled[30] = 2.0f, z[30] = 0.0f;  // kv's bound dwarfs the scores'
  bound[30] = 4e-6f, bound_r[30] = 1e-6f;
  bound[at(HD + 30)] = 4e-12f, bound_r[at(HD + 30)] = 1e-12f;
  td::kernels::detail::CompressorWorkspace ws{};
  ws.pooled = pooled.data(), ws.z = z.data(), ws.bound = bound.data(), ws.bound_r = bound_r.data();
  ws.hit = hit.data();
  const auto has = [&](int p) { return bound[at(p)] != 0.0f || bound_r[at(p)] != 0.0f; };
  const auto key = [](double g) { return std::int64_t(std::bit_cast<std::uint64_t>(g) >> 49); };
  const auto listed_in = [](const std::vector<int>& ch, int d) {
    return std::find(ch.begin(), ch.end(), d) != ch.end();
  };
  const auto expected = [&](const std::vector<int>& ch, double keep) {
    std::vector<int> e;
    for (int c : ch)
      for (int p : {c, c + HD})
        if (has(p) && std::find(e.begin(), e.end(), p) == e.end()) e.push_back(p);
    if (int(e.size()) >= B) return std::vector<int>(e.begin(), e.begin() + B);
    const int cap = B - int(e.size());
    const bool full = !(keep > 0.0);
    double sum = 0.0, listed_share = 0.0, top = 0.0;
    struct Item {
      int bucket, part;
      double gain;
    };
    std::vector<Item> items;  // channel order, the larger part first
    for (int d = 0; d < HD; ++d) {
      const double bk = bound_r[at(d)], bs = bound_r[at(HD + d)];
      const double p = double(pooled[at(d)]) + double(z[at(d)]);
      const double share = p * p * (bk + bs) * (bk + bs);
      if (!(share > 0.0)) continue;  // 0, NaN
      sum += share;
      if (listed_in(ch, d)) listed_share += share;
      if (share > top) top = share;
    }
    for (int d = 0; d < HD; ++d) {
      const double bk = bound_r[at(d)], bs = bound_r[at(HD + d)];
      const double p = double(pooled[at(d)]) + double(z[at(d)]);
      const bool kv = bk >= bs;
      const double L = kv ? bk : bs, S = kv ? bs : bk;
      if (listed_in(ch, d)) continue;
      for (const auto& [gain, part] : {std::pair{p * p * L * (L + 2.0 * S), kv ? d : HD + d},
                                       std::pair{p * p * S * S, kv ? HD + d : d}})
        if (gain > 0.0)  // not 0, not NaN
          items.push_back({int(std::min<std::int64_t>(key(top) - key(gain), NB - 1)), part, gain});
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& x, const Item& y) { return x.bucket < y.bucket; });
    double left = sum - listed_share;
    const auto done = [&] { return !full && left <= keep * sum; };
    std::size_t i = 0;
    int taken = 0;
    while (i < items.size()) {  // whole buckets
      std::size_t j = i;
      double gs = 0.0;
      for (; j < items.size() && items[j].bucket == items[i].bucket; ++j) gs += items[j].gain;
      if (taken + int(j - i) > cap || done() || (!full && left - gs <= keep * sum)) break;
      taken += int(j - i);
      left -= gs;
      for (; i < j; ++i) e.push_back(items[i].part);
    }
    bool want = i < items.size() && (!done() || e.empty());
    for (std::size_t j = i;
         j < items.size() && items[j].bucket == items[i].bucket && want && taken < cap;
         ++j, ++taken) {
      e.push_back(items[j].part);
      left -= items[j].gain;
      want = !done();
    }
    return e;
  };
  // The same parts: the listed ones first, in order; the rest as a set (next_parts lists them in
  // channel order).
  const auto canon = [&](std::vector<int> v, std::size_t listed) {
    std::sort(v.begin() + std::ptrdiff_t(std::min(listed, v.size())), v.end(), [&](int x, int y) {
      return std::pair{x % HD, x} < std::pair{y % HD, y};
    });
    return v;
  };
  std::vector<int> all(HD);
  for (int d = 0; d < HD; ++d) all[std::size_t(d)] = d;
  const std::vector<std::vector<int>> lists = {
      {},
      {5, 3, 5, 60},
      {21, 9, 20},
      std::vector<int>(all.begin() + 50, all.begin() + 50 + B / 2),  // 63 parts (60's scores: none)
      std::vector<int>(all.begin() + 82, all.begin() + 82 + B / 2)};  // the whole round
  for (const auto& ch : lists)
    for (double keep : {0.0, 0.97, 0.9, 0.75, 0.5, 0.3, 0.1, 1e-3, 1.0}) {
      int next[B];
      const int m = Ops::next_parts(ws, HD, ch.data(), int(ch.size()), next, keep);
      const std::vector<int> want = expected(ch, keep);
      std::vector<int> lp;  // the listed channels' parts
      for (int c : ch)
        for (int p : {c, c + HD})
          if (has(p) && std::find(lp.begin(), lp.end(), p) == lp.end()) lp.push_back(p);
      const std::size_t listed = lp.size();
      EXPECT_EQ(canon(std::vector<int>(next, next + m), listed), canon(want, listed))
          << "listed " << ch.size() << " keep " << keep;
      if (ch.empty() && keep > 0.0 && m < B) {  // it stopped at keep: the parts reach it
        double sum = 0.0, left = 0.0;
        for (int d = 0; d < HD; ++d) {
          const double p = double(pooled[at(d)]) + double(z[at(d)]);
          const double b = double(bound_r[at(d)]) + double(bound_r[at(HD + d)]);
          double bk = bound_r[at(d)], bs = bound_r[at(HD + d)];
          if (std::find(next, next + m, d) != next + m) bk = 0.0;
          if (std::find(next, next + m, HD + d) != next + m) bs = 0.0;
          if (b == 0.0 || std::isnan(p)) continue;
          sum += p * p * b * b;
          left += p * p * (bk + bs) * (bk + bs);
        }
        EXPECT_LE(left, keep * sum * (1.0 + 1e-12)) << "keep " << keep;
      }
    }
  {  // by hand: channel 30's kv part taken (its share dwarfs every other), its scores' part not;
     // 20's and 21's larger parts taken; no part without a gain
    int next[B];
    const int m = Ops::next_parts(ws, HD, nullptr, 0, next);
    ASSERT_EQ(m, B);
    const auto pos = [&](int p) { return int(std::find(next, next + m, p) - next); };
    EXPECT_LT(pos(30), m);
    EXPECT_EQ(pos(HD + 30), m);
    EXPECT_LT(pos(20), m);
    EXPECT_LT(pos(21), m);
    for (int p : {3, 9, 40, 41, 5, HD + 3, HD + 9, HD + 40, HD + 41, HD + 60, 7, HD + 7, 11})
      EXPECT_EQ(pos(p), m) << "part " << p << " has nothing to remove";
    const int one = Ops::next_parts(ws, HD, nullptr, 0, next, 1.0);  // keep all: still one part
    ASSERT_EQ(one, 1);
    EXPECT_EQ(next[0], 30);
  }
  // Everything repaired or without a share: no part left (the check then repairs every one).
  std::fill(bound_r.begin(), bound_r.end(), 0.0f);
  std::fill(bound.begin(), bound.end(), 0.0f);
  int next[B];
  EXPECT_EQ(Ops::next_parts(ws, HD, nullptr, 0, next), 0);
}

// The rounding check's softmax weights for its bound (compressor_check::exp_le0, branch-free so
// the tiers vectorize it): within 4e-4 of e^x for x in [-87, 0] (measured here at most 2.8e-4,
// the degree-5 Taylor tail on (-1, 0]); below -87 (and -Inf) e^-87 within the same 4e-4; x >= 0,
// +0, -0 and a NaN with the sign clear give 1, a NaN with the sign set e^-87 (a row with a NaN is
// not checked). A dropped polynomial term or a floor off by one fails it.
TEST(CsaCompressor, RoundingCheckExpIsWithinItsBound) {
  namespace cc = td::cpu::compressor_check;
  const auto rel = [](float x, double want) {
    return std::fabs(double(cc::exp_le0(x)) / want - 1);
  };
  double worst = 0.0;
  for (int i = 0; i <= 870000; ++i) {
    const float x = -0.0001f * float(i);
    worst = std::max(worst, rel(x, std::exp(double(x))));
  }
  EXPECT_LE(worst, 4e-4);
  EXPECT_GE(worst, 1e-4) << "the polynomial's tail is visible at this sampling";
  for (float x : {-87.5f, -100.0f, -1e30f, -std::numeric_limits<float>::infinity()})
    EXPECT_LE(rel(x, std::exp(-87.0)), 4e-4) << x;
  for (float x : {0.0f, -0.0f, 1.0f, 1e30f, std::numeric_limits<float>::quiet_NaN()})
    EXPECT_EQ(cc::exp_le0(x), 1.0f) << x;
  EXPECT_LE(rel(-std::numeric_limits<float>::quiet_NaN(), std::exp(-87.0)), 4e-4);
}

// The check's vectorized listing (compressor_check::list_row, backend/cpu/compressor.hpp
// listed_channels) lists, on every tier, exactly the channels rounding_check::list_bf16_row lists
// with the check's own, scale and value (the twin it replaced), and rho_sums gives the four
// chains' sums of the plain loop bit for bit: rows of 512 and 128 values (the last 64 RoPE pairs)
// whose y sits within a few bounds of a BF16 rounding boundary, so that about half the values
// are listed, with random bounds, ρ, norm_w and rotations. Then rows at the edges of list_row's
// FP32 first pass (maybe_near, which must keep every value the double test lists): y at 0-3 times
// its interval from a boundary; y just above a power of two (the nearest boundary is then the
// binade below's, 2^14 of y's FP32 ulps away where its own segment's is near 2^15) with
// intervals up to twice that distance; y below 2^-102 (exponent field under 25, where the first
// pass keeps everything). A first pass without its ulp to spare, or without the binade below,
// fails it (run).
TEST(CsaCompressor, RoundingCheckListingIsListBf16RowsOnEveryTier) {
  namespace cc = td::cpu::compressor_check;
  tdtest::Rng rng(41);
  long listed = 0, values = 0, edge_listed = 0, edge_values = 0;
  for (int mode = 0; mode < 4; ++mode)
    for (const index_t hd : {index_t(512), index_t(128)})
      for (int row = 0; row < 64; ++row) {
        const index_t rope = 64;
        std::vector<float> y(hd), y_lo(hd), pooled(hd), plo(hd), nw(hd), bound(2 * hd), br(2 * hd);
        std::vector<bf16> cs(rope / 2), sn(rope / 2);
        rng.fill_normal(std::span<float>(pooled), 0.3f);
        rng.fill_uniform(std::span<float>(nw), 0.8f, 1.2f);
        rng.fill_uniform(std::span<float>(bound), 0.0f, 2e-6f);
        rng.fill_uniform(std::span<float>(br), 0.0f, 5e-7f);
        for (index_t k = 0; k < rope / 2; ++k) {
          const float a = rng.uniform(0.0f, 6.2831853f);
          cs[std::size_t(k)] = bf16(std::cos(a)), sn[std::size_t(k)] = bf16(std::sin(a));
        }
        for (index_t i = 0; i < 2 * hd; i += 7) bound[std::size_t(i)] = 0.0f;  // repaired parts
        const double r = rng.uniform(2.0f, 4.0f), rho = rng.uniform(0.0f, 1e-6f);
        for (index_t i = 0; i < hd; ++i) {
          const std::size_t u = std::size_t(i);
          plo[u] = pooled[u] * 0x1p-30f;
          // A BF16 rounding boundary (a midpoint) near r · p · nw, then y within ~3 bounds of it.
          const float b = bf16(float(r * pooled[u] * nw[u])).to_float();
          const float mid = std::bit_cast<float>(std::bit_cast<std::uint32_t>(b) + 0x8000u);
          const double own =
              r * double(nw[u]) * (double(bound[u]) + double(bound[std::size_t(hd + i)]));
          double yd = double(mid) + double(rng.uniform(-2e-5f, 2e-5f));
          if (mode == 1)  // 0-3 times the value's own interval from the boundary
            yd = double(mid) + (rng.uniform() < 0.5f ? -1 : 1) * double(rng.uniform(0.0f, 3.0f)) *
                                   (own + std::fabs(double(mid)) * rho);
          if (mode == 2) {  // just above ±2^k: the boundary below is 2^(k - 9) away
            const int k = int(rng.uniform(-20.0f, 20.0f));
            const double p2 =
                std::ldexp(1.0, k) * (1.0 + double(int(rng.uniform(0.0f, 9.0f))) * 0x1p-23);
            yd = (pooled[u] < 0 ? -1 : 1) * p2;
            const double want = double(rng.uniform(0.0f, 2.0f)) * std::ldexp(1.0, k - 9);
            const float each = float(want / (2.0 * r * double(nw[u])));
            bound[u] = each, bound[std::size_t(hd + i)] = each;
          }
          if (mode == 3) {  // exponent fields below 25: y and its bounds scaled by 2^-110
            yd *= 0x1p-110;
            bound[u] *= 0x1p-110f, bound[std::size_t(hd + i)] *= 0x1p-110f;
          }
          y[u] = float(yd);
          y_lo[u] = float(yd - double(y[u]));
        }
        const auto scale = [&](index_t i) { return std::fabs(r * double(nw[std::size_t(i)])); };
        const auto pabs = [&](index_t i) {
          return std::fabs(double(pooled[std::size_t(i)]) + double(plo[std::size_t(i)]));
        };
        std::vector<int> want(std::size_t(hd) + 1);
        const int nwant = td::cpu::rounding_check::list_bf16_row(
            hd, rope, cs.data(), sn.data(), rho, 0.0,
            [&](index_t i) {
              return scale(i) *
                     (double(bound[std::size_t(i)]) + double(bound[std::size_t(hd + i)]));
            },
            [&](index_t i) { return pabs(i) * scale(i); },
            [&](index_t i) { return double(y[std::size_t(i)]) + double(y_lo[std::size_t(i)]); },
            want.data(), int(hd));
        want.resize(std::size_t(nwant));
        (mode == 0 ? listed : edge_listed) += nwant;
        (mode == 0 ? values : edge_values) += hd;
        double s4[4] = {}, q4[4] = {};
        for (index_t i = 0; i < hd; ++i) {
          const double p = double(pooled[std::size_t(i)]) + double(plo[std::size_t(i)]);
          const double e = p * (double(br[std::size_t(i)]) + double(br[std::size_t(hd + i)]));
          s4[i % 4] += p * p;
          q4[i % 4] += e * e;
        }
        const double ss = (s4[0] + s4[1]) + (s4[2] + s4[3]), q = (q4[0] + q4[1]) + (q4[2] + q4[3]);
        for (td::cpu::Isa isa : td::cpu::supported_isas()) {
          std::vector<std::int32_t> hit(std::size_t(hd), -1);
          cc::list_row(isa, hit.data(), y.data(), y_lo.data(), pooled.data(), plo.data(),
                       bound.data(), nw.data(), r, rho, cs.data(), sn.data(), hd, rope);
          std::vector<int> got;
          for (index_t i = 0; i < hd; ++i)
            if (hit[std::size_t(i)] != 0) got.push_back(int(i));
          EXPECT_EQ(got, want) << td::cpu::to_string(isa) << " hd " << hd << " row " << row;
          double gs = -1.0, gq = -1.0;
          cc::rho_sums(isa, pooled.data(), plo.data(), br.data(), hd, &gs, &gq);
          EXPECT_EQ(std::bit_cast<std::uint64_t>(gs), std::bit_cast<std::uint64_t>(ss))
              << td::cpu::to_string(isa);
          EXPECT_EQ(std::bit_cast<std::uint64_t>(gq), std::bit_cast<std::uint64_t>(q))
              << td::cpu::to_string(isa);
        }
      }
  EXPECT_GT(listed, values / 5) << "values near boundaries are listed";
  EXPECT_LT(listed, values * 4 / 5) << "values farther from them are not";
  EXPECT_GT(edge_listed, edge_values / 10) << "the edge rows list values";
  EXPECT_LT(edge_listed, edge_values * 9 / 10) << "and leave others";
}

// CompressorWeights::row_norms (the opt-in rounding check) is validated before anything is
// written: extent 2·OUT_DIM, every value >= 0 (NaN and negative rejected, naming the element);
// compressor_row_norms bounds each row's norm from above and gives +Inf to a row with a NaN.
TEST(CsaCompressor, RoundingCheckRejectsBadNorms) {
  const Fixture f = make_fixture({.kind = Kind::csa, .starts = {8192, 0, 2, 3}});
  const auto& w = weights(Kind::csa);
  const index_t OUT = f.spec.out_dim(), D = cfg().hidden;
  const td::Tensor<float, 1> good = tk::compressor_row_norms(w.wkv.view(), w.wgate.view());
  for (index_t r : {index_t(0), OUT - 1, OUT, 2 * OUT - 1}) {
    const bf16* row = r < OUT ? &w.wkv.view()(r, 0) : &w.wgate.view()(r - OUT, 0);
    double ss = 0.0;
    for (index_t k = 0; k < D; ++k) ss += double(row[k].to_float()) * row[k].to_float();
    EXPECT_GE(double(good.view()(r)), std::sqrt(ss)) << r;
    EXPECT_LE(double(good.view()(r)), std::sqrt(ss) * (1.0 + 0x1p-21)) << r;
  }
  const auto expect_rejected = [&](td::ConstView<float, 1> norms, const char* want) {
    Outputs o = fresh_outputs(f);
    tk::CompressorWeights cw = w.view();
    cw.row_norms = norms;
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
    try {
      tk::compressor_step(td::cpu::make_context(nullptr), cfg(), f.spec, o.state.view(),
                          o.cmp.view(), o.kv_out.view(), f.x_n.view(), cw, f.meta(),
                          rope_table().view(), ws.view());
      ADD_FAILURE() << want << ": no throw";
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::memcmp(o.state.data(), f.state_pool.data(), o.state.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(o.cmp.data(), f.cmp_pool.data(), o.cmp.size() * sizeof(bf16)), 0);
  };
  td::Tensor<float, 1> shape({2 * OUT + 1});
  expect_rejected(shape.view(), "w.row_norms");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -1.0f}) {
    td::Tensor<float, 1> n = good;
    n.view()(OUT + 3) = bad;
    expect_rejected(n.view(), ("w.row_norms[" + std::to_string(OUT + 3) + "]").c_str());
  }
  td::Tensor<bf16, 2> wk = w.wkv;
  wk.view()(9, 100) = bf16(std::numeric_limits<float>::quiet_NaN());
  const td::Tensor<float, 1> nn = tk::compressor_row_norms(wk.view(), w.wgate.view());
  EXPECT_EQ(nn.view()(9), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(nn.view()(10)));
  EXPECT_THROW(tk::compressor_row_norms(w.wkv.view(), w.wgate.view().slice(0, 0, OUT - 1)),
               td::Error);
}

TEST(CsaCompressor, CanonicalStarts) {
  // 8192: no boundary; 0: none; 2: boundary on the 2nd token (c = 0); 3: on the 1st (c = 0).
  check_case({.kind = Kind::csa, .starts = {8192, 0, 2, 3}}, 2);
}

TEST(CsaCompressor, Start8702PreviousWindowPresent) {
  // 8702 % 4 = 2: boundary at pos 8703, c = 2175, the previous window's front halves pool in.
  check_case({.kind = Kind::csa, .starts = {8702, 8702, 8702, 8702}, .seed = 2}, 4);
}

TEST(CsaCompressor, MixedStartsWithHistory) {
  check_case({.kind = Kind::csa, .starts = {7, 127, 511, 255}, .seed = 3}, 4);
}

TEST(CsaCompressor, DraftBoundaryWithCommitOneWritesNothing) {
  // Start 2 and 8702: boundary on the draft token s = 1, masked by commit_tokens = 1.
  // Start 3: boundary on the committed token s = 0, still written.
  const Options o{.kind = Kind::csa, .starts = {2, 8702, 3, 8192}, .commit = 1, .seed = 4};
  const Fixture f = make_fixture(o);
  ASSERT_EQ(f.emitted(), 1);
  const Outputs e = run_golden(f);
  for (auto isa : isas()) {
    const Outputs a = run_kernel(f, isa, 2);
    expect_matches(f, a, e, std::string(td::cpu::to_string(isa)));
    // No kv_out for the masked requests (rows stay zero), and their states were still written.
    for (index_t b : {0, 1, 3})
      for (index_t i = 0; i < f.spec.head_dim; ++i) ASSERT_EQ(a.kv_out.view()(b, i), 0.0f);
    EXPECT_NE(a.kv_out.view()(2, 0), 0.0f);
    const index_t draft_slot = f.state_slots.view()(1);
    ASSERT_GE(draft_slot, 0);
    EXPECT_NE(
        std::memcmp(row_span(a.state, draft_slot).data(), row_span(f.state_pool, draft_slot).data(),
                    sizeof(float) * f.spec.state_width()),
        0);
  }
}

TEST(CsaCompressor, UnmappedStatePages) {
  // Boundary at pos 8703 (c = 2175: previous window = column 2174, current = column 2175).
  // Request 0: previous window unmapped; 1: current window unmapped (its own state rows are not
  // written and read as score -inf); 2: both (pools to 0); 3: all mapped.
  const Options o{.kind = Kind::csa,
                  .starts = {8702, 8702, 8702, 8702},
                  .seed = 5,
                  .unmap = {{0, 2174}, {1, 2175}, {2, 2174}, {2, 2175}}};
  const Fixture f = make_fixture(o);
  ASSERT_EQ(f.state_slots.view()(2), -1);
  ASSERT_EQ(f.emitted(), 4);
  const Outputs e = run_golden(f);
  for (auto isa : isas()) {
    const Outputs a = run_kernel(f, isa, 2);
    expect_matches(f, a, e, std::string(td::cpu::to_string(isa)));
    for (index_t i = 0; i < f.spec.head_dim; ++i) ASSERT_EQ(a.kv_out.view()(2, i), 0.0f);
  }
}

TEST(CsaCompressor, LongerStepsAndSixteenRequests) {
  // T = 32 (B = 16) and S = 5 (several boundaries per request where S >= R).
  std::vector<std::int32_t> starts;
  for (int b = 0; b < 16; ++b) starts.push_back(8192 + 37 * b);
  check_case({.kind = Kind::csa, .starts = starts, .seed = 6}, 8);
  check_case({.kind = Kind::csa, .starts = {3, 8190, 100}, .seq = 5, .seed = 7}, 4);
}

TEST(CsaCompressor, BitIdenticalForAnyThreadCount) {
  const Fixture f = make_fixture({.kind = Kind::csa, .starts = {8702, 3, 2, 8191}, .seed = 8});
  for (auto isa : isas()) {
    const Outputs one = run_kernel(f, isa, 1);
    expect_identical(one, run_kernel(f, isa, 2), "2 threads");
    expect_identical(one, run_kernel(f, isa, 7), "7 threads");
  }
}

// --- HCA compressor (ratio 128) ---------------------------------------------------------------

TEST(HcaCompressor, CanonicalStartsPermutedTables) {
  // 8192: none; 127: boundary at s = 0 (c = 0); 128: none; 255: s = 0 (c = 1).
  check_case({.kind = Kind::hca, .starts = {8192, 127, 128, 255}, .permuted = true, .seed = 11}, 2);
}

TEST(HcaCompressor, CanonicalStartsPlainTables) {
  check_case({.kind = Kind::hca, .starts = {8192, 127, 128, 255}, .seed = 12}, 2);
}

TEST(HcaCompressor, Start8702) {
  // 8702 % 128 = 126: boundary at pos 8703 (c = 67) on the 2nd token.
  check_case({.kind = Kind::hca, .starts = {8702, 8702, 8702, 8702}, .permuted = true, .seed = 13},
             4);
}

TEST(HcaCompressor, UnmappedStatePages) {
  // Window of pos 8703 = positions 8576..8703 = state columns 1072..1087.
  const Options o{.kind = Kind::hca,
                  .starts = {8702, 8702, 8702, 8702},
                  .seed = 14,
                  .unmap = {{0, 1072}, {0, 1080}, {1, 1087}, {2, 1075}, {2, 1076}, {2, 1077}}};
  check_case(o, 4);
}

TEST(HcaCompressor, DraftBoundaryWithCommitOneWritesNothing) {
  const Options o{.kind = Kind::hca, .starts = {126, 8702, 254, 8192}, .commit = 1, .seed = 15};
  const Fixture f = make_fixture(o);
  ASSERT_EQ(f.emitted(), 0);
  const Outputs e = run_golden(f);
  for (auto isa : isas()) {
    const Outputs a = run_kernel(f, isa, 2);
    expect_matches(f, a, e, std::string(td::cpu::to_string(isa)));
    for (float v : a.kv_out.flat()) ASSERT_EQ(v, 0.0f);
  }
}

TEST(HcaCompressor, BitIdenticalForAnyThreadCount) {
  const Fixture f = make_fixture({.kind = Kind::hca, .starts = {8702, 127, 255, 8192}, .seed = 16});
  for (auto isa : isas()) {
    const Outputs one = run_kernel(f, isa, 1);
    expect_identical(one, run_kernel(f, isa, 2), "2 threads");
    expect_identical(one, run_kernel(f, isa, 7), "7 threads");
  }
}

// --- Indexer inner compressor (ratio 4, head dim 128, Hadamard + Q8) --------------------------

TEST(IndexerCompressor, CanonicalStarts) {
  check_case({.kind = Kind::inner, .starts = {8192, 0, 2, 3}, .seed = 21}, 2);
}

TEST(IndexerCompressor, Start8702) {
  check_case({.kind = Kind::inner, .starts = {8702, 8702, 8702, 8702}, .seed = 22}, 4);
}

TEST(IndexerCompressor, RandomNonOrthogonalRotation) {
  check_case(
      {.kind = Kind::inner, .starts = {8702, 3, 2, 511}, .random_hadamard = true, .seed = 23}, 4);
}

TEST(IndexerCompressor, UnmappedStatePagesAndCommitMask) {
  const Options o{.kind = Kind::inner,
                  .starts = {8702, 8702, 2, 3},
                  .commit = 1,
                  .seed = 24,
                  .unmap = {{0, 2174}, {1, 2175}}};
  // 8702: boundary on the draft token (masked); 2: masked; 3: boundary at s = 0.
  check_case(o, 1);
}

TEST(IndexerCompressor, RopePositionRule) {
  // Start 3: the boundary closes row c = 0, so window_start rotates at 0, request_start at 3.
  const Fixture f = make_fixture({.kind = Kind::inner, .starts = {3, 8702, 8190, 2}, .seed = 25});
  ASSERT_EQ(f.emitted(), 4);
  for (auto rule : {tk::InnerRopePosition::window_start, tk::InnerRopePosition::request_start}) {
    const Outputs e = run_golden(f, rule);
    for (auto isa : isas()) {
      const Outputs a = run_kernel(f, isa, 2, rule);
      expect_matches(f, a, e, std::string(td::cpu::to_string(isa)));
    }
  }
  const Outputs ws = run_kernel(f, td::cpu::Isa::scalar, 1, tk::InnerRopePosition::window_start);
  const Outputs rs = run_kernel(f, td::cpu::Isa::scalar, 1, tk::InnerRopePosition::request_start);
  // Dims 0..63 are not rotated: identical under both rules; the rotary dims differ for request 0
  // (rotation at 0 vs 3), request 1 (8700 vs 8702) and request 3 (0 vs 2)...
  for (index_t b = 0; b < 4; ++b)
    for (index_t i = 0; i < 64; ++i) ASSERT_EQ(ws.kv_out.view()(b, i), rs.kv_out.view()(b, i));
  for (index_t b : {0, 1, 3}) {
    bool differs = false;
    for (index_t i = 64; i < 128; ++i) differs |= ws.kv_out.view()(b, i) != rs.kv_out.view()(b, i);
    EXPECT_TRUE(differs) << "request " << b;
  }
  // ... and request 2 (start 8190, boundary 8191 = window 8188..8191) rotates at 8188 vs 8190.
  // Window start of request 0 is 0: its rotary half equals the un-rotated normalised row, so
  // rotating the request_start row back by 3 must give the window_start row.
  std::vector<float> back(rs.kv_out.data() + 64, rs.kv_out.data() + 128);
  td::rope_inverse(back, rope_table().view(), 3);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(back[i], ws.kv_out.view()(0, 64 + i), 2e-2);
}

TEST(IndexerCompressor, BitIdenticalForAnyThreadCount) {
  const Fixture f = make_fixture({.kind = Kind::inner, .starts = {8702, 3, 2, 8191}, .seed = 26});
  for (auto isa : isas()) {
    const Outputs one = run_kernel(f, isa, 1);
    expect_identical(one, run_kernel(f, isa, 2), "2 threads");
    expect_identical(one, run_kernel(f, isa, 7), "7 threads");
  }
}

// --- Request lanes (backend/cpu/compressor.hpp for_requests) ---------------------------------

// The arguments that backend_ops_compressor::independent reads (the metadata, the geometry and the
// workspace for its entries).
bool lanes_independent(const Fixture& f, td::Tensor<float, 1>& ws) {
  tk::CompressorArgs a;
  a.cfg = &cfg();
  a.spec = f.spec;
  a.inner = f.opt.kind == Kind::inner;
  a.meta = f.meta();
  a.workspace = ws.view();
  return td::cpu::backend_ops_compressor<td::cpu::Isa::scalar>::independent(a);
}

// The lanes' independence test: the fixtures' aliased state pools (spec §3.8: 65 blocks shared by
// every request) are not independent; a production allocator's disjoint tables are; a
// block one request reads and another writes, or a cache slot two requests write, makes them
// dependent again; a block two requests read and neither writes does not.
TEST(CompressorLanes, OnlyRequestsThatTouchNothingAnotherWritesAreIndependent) {
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner}) {
    SCOPED_TRACE(int(k));
    const std::vector<std::int32_t> starts = {8702, 127, 255, 8191};
    Fixture f = make_fixture({.kind = k, .starts = starts, .seed = 41});
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
    // The fixtures' tables (build_fixture_block_table: (4 c + b) mod P for B = 4) alias across
    // requests in ratio 4's 65 blocks; in HCA's 64 each request keeps its own (b mod 4).
    EXPECT_EQ(lanes_independent(f, ws), k == Kind::hca) << "the fixtures' pools";
    Fixture d = make_fixture({.kind = k, .starts = starts, .seed = 41, .disjoint = true});
    EXPECT_TRUE(lanes_independent(d, ws)) << "disjoint tables";
    ASSERT_GE(d.emitted(), 1);
    // Request 1 (start 127) closes a window (ratio 4: positions 120-127; HCA: 0-127) and writes
    // positions 127 and 128. Request 3's first window column (history: not written) becomes the
    // block of request 1's position 128: dependent. It becomes instead the first block of request
    // 1's window (read by both, written by neither): still independent.
    const index_t page = d.state_page, S = d.shape.seq, R = d.spec.ratio;
    const auto first_col = [&](index_t b) {
      const index_t c = starts[std::size_t(b)] / R;
      return td::rules::compressor_first_position(int(R), d.spec.overlap, c) / page;
    };
    const index_t w1 = d.state_slots.data()[2 * S - 1] / page;  // position 128's block
    const index_t c3 = first_col(3);
    ASSERT_GE(d.state_table.view()(3, c3), 0);
    Fixture e = d;
    e.state_table.view()(3, c3) = std::int32_t(w1);
    EXPECT_FALSE(lanes_independent(e, ws)) << "request 3 reads a block request 1 writes";
    Fixture g = d;
    g.state_table.view()(3, c3) = d.state_table.view()(1, first_col(1));
    EXPECT_TRUE(lanes_independent(g, ws)) << "a block two requests read, none writes";
    Fixture h = d;
    index_t emit1 = -1, emit3 = -1;
    for (index_t s = 0; s < S; ++s) {
      if (d.cmp_slots.data()[1 * S + s] >= 0) emit1 = 1 * S + s;
      if (d.cmp_slots.data()[3 * S + s] >= 0) emit3 = 3 * S + s;
    }
    ASSERT_GE(emit1, 0);
    ASSERT_GE(emit3, 0);
    h.cmp_slots.view()(emit3) = d.cmp_slots.data()[emit1];
    EXPECT_FALSE(lanes_independent(h, ws)) << "two requests write one cache slot";
  }
}

// Independent requests on lanes (two and five threads, B = 12 over 8 lanes, S = 3 with windows
// closing at every step position, the rounding check on) give the serial run's bits: pools, cache
// rows, scales and kv_out; and golden's rows.
TEST(CompressorLanes, IndependentRequestsOnLanesGiveTheSerialBits) {
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner}) {
    SCOPED_TRACE(int(k));
    std::vector<std::int32_t> starts;
    for (int b = 0; b < 12; ++b)
      starts.push_back(k == Kind::hca ? 8192 + 128 * b + 125 + b % 3 : 8192 + 8 * b + b % 4);
    const Fixture f =
        make_fixture({.kind = k, .starts = starts, .seq = 3, .seed = 43, .disjoint = true});
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
    ASSERT_TRUE(lanes_independent(f, ws));
    ASSERT_GE(f.emitted(), 9);
    const auto& w = weights(k);
    const td::Tensor<float, 1> norms = tk::compressor_row_norms(w.wkv.view(), w.wgate.view());
    for (auto isa : isas()) {
      const auto run = [&](int threads) {
        Outputs o = fresh_outputs(f);
        std::optional<td::ThreadPool> pool;
        if (threads > 1) pool.emplace(threads);
        const td::cpu::Context ctx{pool ? &*pool : nullptr, td::cpu::checked_isa(isa)};
        tk::CompressorWeights cw = w.view();
        cw.row_norms = norms.view();
        td::Tensor<float, 1> wsp({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
        if (k == Kind::inner)
          tk::indexer_compressor_step(ctx, cfg(), o.state.view(), o.idx.view(), o.scale.view(),
                                      o.kv_out.view(), f.x_n.view(), cw, f.hadamard.view(),
                                      f.meta(), rope_table().view(), wsp.view());
        else
          tk::compressor_step(ctx, cfg(), f.spec, o.state.view(), o.cmp.view(), o.kv_out.view(),
                              f.x_n.view(), cw, f.meta(), rope_table().view(), wsp.view());
        return o;
      };
      const Outputs one = run(1);
      expect_matches(f, one, run_golden(f), std::string(td::cpu::to_string(isa)));
      expect_identical(one, run(2), "2 threads");
      expect_identical(one, run(5), "5 threads");
    }
  }
}

// The rounding check's re-pooling from the pooling's kept sums (avx2:: and
// avx512::compressor_pool_resume): keeping them does not move the pooling's bits; after the last
// 1-2 candidates change (an FP32 ulp of every kv and score), a block whose max did not move gets
// the bits of pooling the changed window again, and a block whose max moved (a changed score
// raised past it, or the max itself lowered) returns false and writes nothing. Windows of 8 and
// 128 candidates, with masked (kNegBig) candidates before the tail in a quarter of them. Pool(hi,
// lo, kv, sc, n, c0, c1, mx, ls, pre, mp, j0) and Resume(hi, lo, kv, sc, n, c, j0, pre, mp, mx):
// the tier's two kernels.
template <class Pool, class Resume>
void expect_pool_resume_is_the_poolings_bits(Pool pool, Resume resume) {
  const auto bits = [](float v) { return std::bit_cast<std::uint32_t>(v); };
  tdtest::Rng rng(23);
  constexpr index_t HD = 32;  // four blocks of 8 channels
  int resumed = 0, moved = 0;
  for (int n : {8, 128})
    for (int tail : {1, 2})
      for (int rep = 0; rep < 16; ++rep) {
        std::vector<float> kvs(static_cast<std::size_t>(n * HD)), scs(kvs.size());
        rng.fill_normal(kvs, 1.0f);
        rng.fill_normal(scs, 2.0f);
        if (rep % 4 == 1)
          for (index_t c = 0; c < HD; ++c) scs[std::size_t(c)] = td::kNegBig;  // masked
        std::vector<const float*> kv(static_cast<std::size_t>(n)), sc(static_cast<std::size_t>(n));
        for (int j = 0; j < n; ++j) {
          kv[std::size_t(j)] = kvs.data() + j * HD;
          sc[std::size_t(j)] = scs.data() + j * HD;
        }
        const int j0 = n - tail;
        std::vector<float> hi(HD), lo(HD), mx(HD), ls(HD), mp(HD), h0(HD), l0(HD);
        std::vector<double> pre(2 * HD);
        pool(hi.data(), lo.data(), kv.data(), sc.data(), n, 0, HD, mx.data(), ls.data(), pre.data(),
             mp.data(), j0);
        pool(h0.data(), l0.data(), kv.data(), sc.data(), n, 0, HD, nullptr, nullptr, nullptr,
             nullptr, 0);
        for (index_t c = 0; c < HD; ++c)
          ASSERT_TRUE(bits(hi[c]) == bits(h0[c]) && bits(lo[c]) == bits(l0[c])) << "kept sums";
        for (std::size_t i = std::size_t(j0 * HD); i < kvs.size(); ++i) {
          kvs[i] = std::nextafter(kvs[i], 1e30f);
          scs[i] = std::nextafter(scs[i], rep % 3 == 0 ? 1e30f : -1e30f);
        }
        if (rep % 2 == 1) {  // a changed score past its block's max
          const index_t c = 8 * ((rep / 2) % 4) + 3;
          scs[std::size_t((n - 1) * HD + c)] = mx[std::size_t(c)] + 1.0f;
        }
        std::vector<float> hf(HD), lf(HD);
        pool(hf.data(), lf.data(), kv.data(), sc.data(), n, 0, HD, nullptr, nullptr, nullptr,
             nullptr, 0);
        for (index_t c0 = 0; c0 < HD; c0 += 8) {
          bool same_max = true;
          for (index_t c = c0; c < c0 + 8; ++c) {
            float m = td::kNegBig;
            for (int j = 0; j < n; ++j) m = std::max(m, scs[std::size_t(j * HD + c)]);
            same_max = same_max && bits(m) == bits(mx[std::size_t(c)]);
          }
          std::vector<float> hr = hi, lr = lo;
          const bool ok = resume(hr.data(), lr.data(), kv.data(), sc.data(), n, c0, j0, pre.data(),
                                 mp.data(), mx.data());
          EXPECT_EQ(ok, same_max) << "n " << n << " rep " << rep << " block " << c0;
          for (index_t c = c0; c < c0 + 8; ++c) {
            const std::size_t u = std::size_t(c);
            if (ok)
              EXPECT_TRUE(bits(hr[u]) == bits(hf[u]) && bits(lr[u]) == bits(lf[u]))
                  << "n " << n << " rep " << rep << " channel " << c;
            else
              EXPECT_TRUE(bits(hr[u]) == bits(hi[u]) && bits(lr[u]) == bits(lo[u]))
                  << "written where the max moved: n " << n << " channel " << c;
          }
          (ok ? resumed : moved) += 1;
        }
      }
  EXPECT_GT(resumed, 100);
  EXPECT_GT(moved, 20);
}

TEST(CompressorTiers, Avx2PoolResumeIsThePoolingsBits) {
#if TILEDECODE_X86
  if (!td::cpu::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  namespace avx2 = td::cpu::avx2;
  expect_pool_resume_is_the_poolings_bits(
      [](auto... args) { avx2::compressor_pool_channels(args...); },
      [](auto... args) { return avx2::compressor_pool_resume(args...); });
#else
  GTEST_SKIP() << "AVX2 is x86 only";
#endif
}

// The same for the AVX-512 pooling (its own layout of the kept sums; no next window to prefetch);
// its bits are avx2's (BitIdenticalAcrossTiers).
TEST(CompressorTiers, Avx512PoolResumeIsThePoolingsBits) {
#if TILEDECODE_X86
  if (!td::cpu::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  namespace avx512 = td::cpu::avx512;
  expect_pool_resume_is_the_poolings_bits(
      [](float* hi, float* lo, const float* const* kv, const float* const* sc, int n, index_t c0,
         index_t c1, float* mx, float* ls, double* pre, float* mp, int j0) {
        avx512::compressor_pool_channels(hi, lo, kv, sc, n, c0, c1, {}, mx, ls, pre, mp, j0);
      },
      [](auto... args) { return avx512::compressor_pool_resume(args...); });
#else
  GTEST_SKIP() << "AVX-512 is x86 only";
#endif
}

// --- Every tier gives the same bits ------------------------------------------------------------
// The projections share one order (backend/cpu/bf16_rows_avx2.hpp; on avx512 with
// Bf16Dot::fma), and the pooling in double, the norm, the RoPE and the Hadamard are the same
// operations on every tier (kernels/compressor.hpp, "Pooling in double"), so every tier this
// machine has must match the scalar tier bit for bit. Bf16Dot::dpbf16 (vdpbf16ps, another
// summation order) is held to golden instead (Avx512Bf16DotMatchesGolden below).
TEST(CompressorTiers, BitIdenticalAcrossTiers) {
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner}) {
    SCOPED_TRACE(int(k));
    const Fixture f = make_fixture({.kind = k, .starts = {8702, 3, 2, 8190}, .seed = 31});
    ASSERT_GT(f.emitted(), 0);
    const Outputs ref = run_kernel(f, td::cpu::Isa::scalar, 2);
    for (td::cpu::Isa isa : td::cpu::supported_isas())
      expect_identical(
          ref, run_kernel(f, isa, 2, tk::InnerRopePosition::window_start, td::cpu::Bf16Dot::fma),
          std::string(td::cpu::to_string(isa)));
  }
}

// More than 8 tokens: the avx512 tier's projections then run avx512::bf16_rows_dot_fma (the same
// bits on 512-bit FMA, backend/cpu/bf16_rows_avx512.hpp) instead of the avx2 kernel.
TEST(CompressorTiers, BitIdenticalAcrossTiersAtLargerBatch) {
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner}) {
    SCOPED_TRACE(int(k));
    const Fixture f = make_fixture(
        {.kind = k, .starts = {8702, 3, 2, 8190, 126, 127, 4094}, .seq = 3, .seed = 32});
    ASSERT_GT(f.emitted(), 0);
    const Outputs ref = run_kernel(f, td::cpu::Isa::scalar, 2);
    for (td::cpu::Isa isa : td::cpu::supported_isas())
      expect_identical(
          ref, run_kernel(f, isa, 2, tk::InnerRopePosition::window_start, td::cpu::Bf16Dot::fma),
          std::string(td::cpu::to_string(isa)));
  }
}

// Bf16Dot::exact (backend/cpu/bf16_exact.hpp) on every tier this CPU has: the projections are
// golden's double sums in golden's order, so the state rows the step writes equal golden's bit
// for bit (the FP32-accumulating fma and dpbf16 paths fail this: 59-68 % of their dots are not
// the correctly rounded value, rounding.Bf16RowDotRoundsAsTheExactDot; the order within double
// is ExactDots.EveryTierAndShapeIsTheSequentialDoubleSum's), the emitted rows match golden at the
// family tolerances,
// and every tier at 1, 2 and 7 threads gives the scalar tier's bits, at 1 and 3 tokens per
// request (the kernels' 8-token groups and their partial last group).
TEST(CompressorTiers, ExactDotsAreGoldensOnEveryTier) {
  constexpr auto rule = tk::InnerRopePosition::window_start;
  constexpr auto exact = td::cpu::Bf16Dot::exact;
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner})
    for (int seq : {1, 3}) {
      const Fixture f = make_fixture(
          {.kind = k, .starts = {8702, 3, 2, 8190, 126, 127, 4094}, .seq = seq, .seed = 35});
      const std::string at = "kind " + std::to_string(int(k)) + " seq " + std::to_string(seq);
      const Outputs e = run_golden(f);
      const Outputs ref = run_kernel(f, td::cpu::Isa::scalar, 1, rule, exact);
      long differ = 0;
      for (std::size_t i = 0; i < ref.state.size(); ++i)
        differ += std::bit_cast<std::uint32_t>(ref.state.data()[i]) !=
                  std::bit_cast<std::uint32_t>(e.state.data()[i]);
      EXPECT_EQ(differ, 0) << at << ": state values off golden's";
      expect_matches(f, ref, e, at);
      for (td::cpu::Isa isa : isas())
        for (int threads : {1, 2, 7})
          expect_identical(ref, run_kernel(f, isa, threads, rule, exact),
                           at + " " + std::string(td::cpu::to_string(isa)) + " " +
                               std::to_string(threads) + " threads");
    }
}

#if TILEDECODE_X86
// The avx512 tier with each BF16 choice, whatever this CPU's automatic one: against golden at
// the family tolerances (expect_matches), 1 against 2 and 7 threads bit for bit, and at 2 and 21
// tokens per step (the vdpbf16ps projections' small-batch kernel and, from 16 tokens, the
// blocked one; their bits are the same: Avx512Bf16RowsBlockedBitIdentical).
TEST(CompressorTiers, Avx512Bf16DotMatchesGolden) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  constexpr auto avx512 = td::cpu::Isa::avx512;
  constexpr auto rule = tk::InnerRopePosition::window_start;
  for (Kind k : {Kind::csa, Kind::hca, Kind::inner})
    for (int seq : {1, 3}) {
      const Fixture f = make_fixture(
          {.kind = k, .starts = {8702, 3, 2, 8190, 126, 127, 4094}, .seq = seq, .seed = 33});
      const Outputs e = run_golden(f);
      for (auto b : {td::cpu::Bf16Dot::fma, td::cpu::Bf16Dot::dpbf16}) {
        const std::string at = "kind " + std::to_string(int(k)) + " seq " + std::to_string(seq) +
                               " " + std::string(td::cpu::to_string(b));
        const Outputs one = run_kernel(f, avx512, 1, rule, b);
        expect_matches(f, one, e, at);
        expect_identical(one, run_kernel(f, avx512, 2, rule, b), at + " 2 threads");
        expect_identical(one, run_kernel(f, avx512, 7, rule, b), at + " 7 threads");
      }
    }
}

// vdpbf16ps rows: bf16_rows_dot_blocked (from kBf16BlockedMinTokens tokens, on the token panel)
// against bf16_rows_dot, every output bit, for token counts around the 16-token panel tiles and
// the 64-token groups (16-31 and the last 7 or 2 tokens of 71 / 130 lane per row on the panel;
// groups of 4, 3 (100: 64 + 36) and 2 (40) panel vectors), row counts around the 16-row lanes,
// the 6 / 8 / 12-row tiles and the 48-row panels, with rows to prefetch past them, reductions
// with a partial last 64-k block (4650, 1050, 34: 17 pairs, a partial 16-pair piece), one pair
// (2), with fold groups of 4 blocks and a partial last one (4650: 73 blocks), both = and +=; and
// bf16_rows_dot on each token alone against all of them at once (its 8-token passes and 64-token
// chunks): a request's projection does not depend on its batch. At d = 1050 a NaN of each side
// meets at the same k (x and w with different payloads and signs): vdpbf16ps returns its first
// source's, so both arrangements must pass w's pairs first.
TEST(CompressorTiers, Avx512Bf16RowsBlockedBitIdentical) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  namespace a5 = td::cpu::avx512;
  tdtest::Rng rng(92);
  for (index_t d : {4096, 4650, 1050, 34, 2})
    for (index_t rows : {49, 17, 13, 6, 1})
      for (index_t T : {16, 17, 31, 40, 64, 71, 100, 130}) {
        const index_t rows_pf = rows + 7;  // w's rows past `rows`, which the kernels may prefetch
        std::vector<bf16> x(std::size_t(T * d)), w(std::size_t(rows_pf * d));
        for (auto& v : x) v = bf16(rng.normal());
        for (auto& v : w) v = bf16(rng.normal() * 0.125f);
        if (d == 1050) {
          x[std::size_t((T - 1) * d + 5)] = bf16::from_bits(0x7fc1);
          w[std::size_t((rows - 1) * d + 5)] = bf16::from_bits(0xffc3);
        }
        const index_t ld = rows + 3;
        std::vector<float> a(std::size_t(T * ld));
        for (auto& v : a) v = rng.normal();
        std::vector<float> b = a, c = a, e = a, one = a;
        // The blocked kernel's token panel; filled with NaN first, so a read of a slot the packing
        // does not write would show.
        std::vector<bf16> xp(std::size_t(a5::bf16_panel_elems(T, d)), bf16::from_bits(0x7fc0));
        for (index_t p = 0; p < a5::bf16_panel_tiles(T); ++p)
          a5::pack_bf16_panel_tile(xp.data(), x.data(), d, T, d, p);
        const index_t ld_tile = a5::bf16_panel_tile_elems(d);
        a5::bf16_rows_dot<false>(a.data(), ld, x.data(), d, T, w.data(), d, rows, d, rows_pf);
        a5::bf16_rows_dot_blocked<false>(b.data(), ld, xp.data(), ld_tile, T, w.data(), d, rows, d,
                                         rows_pf);
        a5::bf16_rows_dot<true>(c.data(), ld, x.data(), d, T, w.data(), d, rows, d, rows_pf);
        a5::bf16_rows_dot_blocked<true>(e.data(), ld, xp.data(), ld_tile, T, w.data(), d, rows, d,
                                        rows_pf);
        for (index_t t = 0; t < T; ++t)
          a5::bf16_rows_dot<false>(one.data() + t * ld, ld, x.data() + t * d, d, 1, w.data(), d,
                                   rows, d, rows);
        const std::string at =
            "d=" + std::to_string(d) + " rows=" + std::to_string(rows) + " T=" + std::to_string(T);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << at;
        EXPECT_EQ(0, std::memcmp(c.data(), e.data(), c.size() * 4)) << at << " (+=)";
        EXPECT_EQ(0, std::memcmp(a.data(), one.data(), a.size() * 4)) << at << " (one token)";
      }
}

// The kernel alone against avx2::bf16_rows_dot: every output bit, for token counts around its
// 6-token tiles and 96-token chunks, row counts around its 8-row blocks, reductions with a partial
// last block of 1024 and shorter than one block, both = and +=.
TEST(CompressorTiers, Avx512FmaRowsBitIdenticalToAvx2) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  tdtest::Rng rng(91);
  for (index_t d : {4096, 1032, 8})
    for (index_t rows : {24, 7, 1})
      for (index_t T : {9, 13, 96, 97, 200}) {
        std::vector<float> x(std::size_t(T * d));
        std::vector<bf16> w(std::size_t((rows + 8) * d));  // 8 more rows: the prefetched ones
        for (auto& v : x) v = bf16(rng.normal()).to_float();
        for (auto& v : w) v = bf16(rng.normal() * 0.125f);
        const index_t ld = rows + 3;
        std::vector<float> a(std::size_t(T * ld)), b;
        for (auto& v : a) v = rng.normal();
        b = a;
        std::vector<float> c = a, e = a;
        td::cpu::avx2::bf16_rows_dot<false>(a.data(), ld, x.data(), d, T, w.data(), d, rows, d,
                                            rows + 8);
        td::cpu::avx512::bf16_rows_dot_fma<false>(b.data(), ld, x.data(), d, T, w.data(), d, rows,
                                                  d, rows + 8);
        td::cpu::avx2::bf16_rows_dot<true>(c.data(), ld, x.data(), d, T, w.data(), d, rows, d,
                                           rows);
        td::cpu::avx512::bf16_rows_dot_fma<true>(e.data(), ld, x.data(), d, T, w.data(), d, rows, d,
                                                 rows);
        const std::string at =
            "d=" + std::to_string(d) + " rows=" + std::to_string(rows) + " T=" + std::to_string(T);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << at;
        EXPECT_EQ(0, std::memcmp(c.data(), e.data(), c.size() * 4)) << at << " (+=)";
      }
}
#endif

// --- Validation: every bad argument throws before anything is written --------------------------

struct BadCall {
  Fixture f;
  Outputs o;
  td::Tensor<float, 1> ws;
  tk::CompressorSpec spec;
  td::Tensor<bf16, 2> x_n;
  BadCall(const Options& opt)
      : f(make_fixture(opt)), o(fresh_outputs(f)), spec(f.spec), x_n(f.x_n) {
    ws = td::Tensor<float, 1>({tk::compressor_workspace_size(cfg(), f.spec, f.shape.tokens())});
  }
  void call(tk::CompressorMetadata meta, td::View<float, 2> kv_out, td::View<float, 1> w,
            const td::RopeTableView& rope) {
    const td::cpu::Context ctx{nullptr, td::cpu::Isa::scalar};
    if (f.opt.kind == Kind::inner) {
      tk::indexer_compressor_step(ctx, cfg(), o.state.view(), o.idx.view(), o.scale.view(), kv_out,
                                  x_n.view(), weights(f.opt.kind).view(), f.hadamard.view(), meta,
                                  rope, w);
    } else {
      tk::compressor_step(ctx, cfg(), spec, o.state.view(), o.cmp.view(), kv_out, x_n.view(),
                          weights(f.opt.kind).view(), meta, rope, w);
    }
  }
  void call() { call(f.meta(), o.kv_out.view(), ws.view(), rope_table().view()); }
  // The call threw a tiledecode::Error naming `arg`, and nothing was written.
  void expect_rejected(const std::string& arg, const std::function<void()>& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << arg;
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::memcmp(o.state.data(), f.state_pool.data(), o.state.size() * sizeof(float)), 0);
    if (f.opt.kind == Kind::inner) {
      EXPECT_EQ(std::memcmp(o.idx.data(), f.idx_pool.data(), o.idx.size()), 0);
    } else {
      EXPECT_EQ(std::memcmp(o.cmp.data(), f.cmp_pool.data(), o.cmp.size() * sizeof(bf16)), 0);
    }
    for (float v : o.kv_out.flat()) EXPECT_EQ(v, 0.0f);
  }
};

TEST(CompressorValidation, StateSlotPastPool) {
  BadCall c({.kind = Kind::csa, .starts = {8702, 3, 2, 0}});
  c.f.state_slots.view()(7) = c.f.state_pool.extent(0);  // one past the last row
  c.expect_rejected("state_slot_mapping[7]", [&] { c.call(); });
  c.f.state_slots.view()(7) = -2;
  c.expect_rejected("state_slot_mapping[7]", [&] { c.call(); });
}

TEST(CompressorValidation, StateTableIdPastPool) {
  BadCall c({.kind = Kind::hca, .starts = {8702, 127, 128, 255}});
  c.f.state_table.view()(1, 3) = 64;  // request 1's window 0..127 reads columns 0..15
  c.expect_rejected("state_table[1,3]", [&] { c.call(); });
}

TEST(CompressorValidation, CmpSlotOffBoundaryOrPastCache) {
  BadCall c({.kind = Kind::inner, .starts = {8702, 3, 2, 0}});
  c.f.cmp_slots.view()(0) = 5;  // position 8702 closes no window
  c.expect_rejected("cmp_slot_mapping[0]", [&] { c.call(); });
  c.f.cmp_slots.view()(0) = -1;
  c.f.cmp_slots.view()(1) = c.f.cache_rows;
  c.expect_rejected("cmp_slot_mapping[1]", [&] { c.call(); });
}

TEST(CompressorValidation, ShapesWorkspaceRopeAndSpec) {
  BadCall c({.kind = Kind::csa, .starts = {8702, 3, 2, 0}});
  c.x_n = td::Tensor<bf16, 2>({9, index_t(cfg().hidden)});
  c.expect_rejected("x_n.extent(0)", [&] { c.call(); });
  c.x_n = c.f.x_n;
  td::Tensor<float, 2> bad_kv({4, 511});
  c.expect_rejected("kv_out.extent(1)",
                    [&] { c.call(c.f.meta(), bad_kv.view(), c.ws.view(), rope_table().view()); });
  c.expect_rejected("workspace.extent(0)", [&] {
    c.call(c.f.meta(), c.o.kv_out.view(), c.ws.view().slice(0, 0, c.ws.extent(0) - 1),
           rope_table().view());
  });
  // A table too short for the rotation position of the emitted rows (8700).
  const td::RopeTableView shortr{rope_table().cos.view().slice(0, 0, 8000),
                                 rope_table().sin.view().slice(0, 0, 8000)};
  c.expect_rejected("rope position",
                    [&] { c.call(c.f.meta(), c.o.kv_out.view(), c.ws.view(), shortr); });
  c.f.positions.view()(3) = cfg().max_seq_len;
  c.expect_rejected("positions[3]", [&] { c.call(); });
  c.f.positions.view()(3) = 4;
  c.spec.ratio = 8;
  c.expect_rejected("spec.ratio", [&] { c.call(); });
}

TEST(CompressorSpecs, Geometry) {
  const auto csa = tk::csa_compressor_spec(cfg());
  const auto hca = tk::hca_compressor_spec(cfg());
  const auto inner = tk::indexer_compressor_spec(cfg());
  EXPECT_EQ(csa.out_dim(), 1024);
  EXPECT_EQ(csa.state_width(), 2048);
  EXPECT_EQ(csa.window(), 8);
  EXPECT_EQ(hca.out_dim(), 512);
  EXPECT_EQ(hca.state_width(), 1024);
  EXPECT_EQ(hca.window(), 128);
  EXPECT_EQ(inner.out_dim(), 256);
  EXPECT_EQ(inner.state_width(), 512);
  EXPECT_EQ(tk::compressor_state_page(cfg(), csa), 4);
  EXPECT_EQ(tk::compressor_state_page(cfg(), hca), 8);
}

}  // namespace
