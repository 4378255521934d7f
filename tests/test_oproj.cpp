// Grouped W8A8 output projection (spec §8.5): kernels::output_projection (scalar and AVX2)
// against golden::output_projection. Tolerance: attn_out ratio_allclose(1e-4, 1/128, 0.5%)
// (spec §10.2); the INT8 stage is also checked exactly through a crafted case.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "common/compare.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/golden/output_projection.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;

namespace {

std::vector<td::cpu::Isa> isas() {
  return td::cpu::supported_isas();  // scalar, avx2, avx2_vnni (the vpdpbusd wo_b tile)
}

struct Weights {
  td::ModelConfig cfg;
  td::Tensor<bf16, 3> wo_a;
  td::Tensor<std::int8_t, 2> wo_b;
  td::Tensor<float, 1> scale;
  Weights(const td::ModelConfig& c, std::uint64_t seed) : cfg(c) {
    tdtest::Rng rng(seed);
    wo_a = td::Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, cfg.o_group_in()});
    wo_b = td::Tensor<std::int8_t, 2>({cfg.hidden, index_t(cfg.o_groups) * cfg.o_lora});
    // Cheap deterministic fill (splitmix64): wo_a uniform in [-0.035, 0.035), wo_b the full int8
    // range including -128 (allowed: see kernels/output_projection.hpp).
    std::uint64_t x = seed;
    auto next = [&x] {
      std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    };
    for (std::size_t i = 0; i < wo_a.size(); ++i)
      wo_a.data()[i] = bf16(float(std::int32_t(next() >> 40) - (1 << 23)) * (0.035f / (1 << 23)));
    for (std::size_t i = 0; i < wo_b.size(); i += 8) {
      const std::uint64_t z = next();
      for (std::size_t j = 0; j < 8 && i + j < wo_b.size(); ++j)
        wo_b.data()[i + j] = std::int8_t(std::uint8_t(z >> (8 * j)));
    }
    scale = td::Tensor<float, 1>({cfg.hidden});
    for (index_t n = 0; n < cfg.hidden; ++n) scale.view()(n) = 1e-3f * (0.5f + rng.uniform());
  }
};

td::Tensor<bf16, 2> random_o(const td::ModelConfig& cfg, index_t T, std::uint64_t seed) {
  tdtest::Rng rng(seed);
  td::Tensor<bf16, 2> o({index_t(cfg.o_groups) * T, cfg.o_group_in()});
  rng.fill_normal(std::span<bf16>(o.data(), o.size()), 0.05f);
  return o;
}

td::Tensor<bf16, 2> run_kernel(const Weights& w, const td::Tensor<bf16, 2>& o, index_t T,
                               td::cpu::Isa isa, td::Executor* exec = nullptr,
                               td::cpu::Bf16Dot bf16_dot = td::cpu::Bf16Dot::automatic,
                               td::ConstView<float, 2> wo_a_norm = {}) {
  td::Tensor<bf16, 2> out({T, w.cfg.hidden});
  std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(w.cfg, T));
  td::kernels::output_projection(td::cpu::Context{exec, td::cpu::checked_isa(isa), bf16_dot}, w.cfg,
                                 out.view(), o.view(), w.wo_a.view(), w.wo_b.view(), w.scale.view(),
                                 ws, wo_a_norm);
  return out;
}

// With the rounding check (wo_a's row norms).
td::Tensor<bf16, 2> run_checked(const Weights& w, const td::Tensor<bf16, 2>& o, index_t T,
                                td::cpu::Isa isa, td::Executor* exec = nullptr) {
  const auto norm = td::kernels::output_projection_row_norms(w.wo_a.view());
  return run_kernel(w, o, T, isa, exec, td::cpu::Bf16Dot::automatic, norm.view());
}

// Bytes equal, any two NaNs equal (payload and sign unspecified).
long bytes_differ(const td::Tensor<bf16, 2>& a, const td::Tensor<bf16, 2>& b) {
  long n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bf16 x = a.data()[i], y = b.data()[i];
    n += !(x.bits == y.bits || (std::isnan(x.to_float()) && std::isnan(y.to_float())));
  }
  return n;
}

td::Tensor<bf16, 2> run_golden(const Weights& w, const td::Tensor<bf16, 2>& o, index_t T) {
  td::Tensor<bf16, 2> out({T, w.cfg.hidden});
  td::golden::output_projection(w.cfg, out.view(), o.view(), w.wo_a.view(), w.wo_b.view(),
                                w.scale.view());
  return out;
}

std::vector<float> floats(const td::Tensor<bf16, 2>& t) {
  return tdtest::to_floats(std::span<const bf16>(t.data(), t.size()));
}

const Weights& flash_weights() {
  static const Weights w(td::flash_config(), 1);
  return w;
}

TEST(Oproj, FlashT8MatchesGolden) {
  const auto& w = flash_weights();
  const auto o = random_o(w.cfg, 8, 2);
  const auto g = run_golden(w, o, 8);
  for (auto isa : isas()) {
    EXPECT_TRUE(
        tdtest::ratio_allclose(floats(run_kernel(w, o, 8, isa)), floats(g), 1e-4, 1.0 / 128, 0.005))
        << td::cpu::to_string(isa);
  }
}

TEST(Oproj, OddTokenCountsAndThreadsBitIdentical) {
  const auto& w = flash_weights();
  for (index_t T : {1, 13}) {
    const auto o = random_o(w.cfg, T, 3 + T);
    for (auto isa : isas()) {
      const auto ref = run_kernel(w, o, T, isa);
      for (std::size_t n : {2, 7}) {
        td::ThreadPool pool(n);
        const auto x = run_kernel(w, o, T, isa, &pool);
        EXPECT_EQ(0, std::memcmp(ref.data(), x.data(), x.size() * sizeof(bf16)))
            << "T=" << T << " threads=" << n << " " << td::cpu::to_string(isa);
      }
    }
  }
  const auto o = random_o(w.cfg, 3, 6);
  const auto g = run_golden(w, o, 3);
  for (auto isa : isas())
    EXPECT_TRUE(tdtest::ratio_allclose(floats(run_kernel(w, o, 3, isa)), floats(g), 1e-4, 1.0 / 128,
                                       0.005));
}

// Bf16Dot::exact (backend/cpu/bf16_exact.hpp) on every tier this CPU has: wo_a's o_r are golden's
// double sums in golden's order, rounded once as golden rounds them, so the Q8 activations are
// golden's, the INT8 stage is exact and the combine is golden's: the output is golden's bytes,
// and every tier and thread count gives them, at T = 1, 13 and 21 (the exact kernels' 8-token
// groups, a partial one, and the avx512 tier's blocked-wo_b token counts).
TEST(Oproj, ExactDotsOnEveryTier) {
  const auto& w = flash_weights();
  for (index_t T : {1, 13, 21}) {
    const auto o = random_o(w.cfg, T, 50 + T);
    const auto g = run_golden(w, o, T);
    const auto ref = run_kernel(w, o, T, td::cpu::Isa::scalar, nullptr, td::cpu::Bf16Dot::exact);
    EXPECT_EQ(0, std::memcmp(ref.data(), g.data(), g.size() * sizeof(bf16))) << "golden, T=" << T;
    for (auto isa : isas())
      for (std::size_t n : {1, 2, 7}) {
        td::ThreadPool pool(n);
        const auto x = run_kernel(w, o, T, isa, &pool, td::cpu::Bf16Dot::exact);
        EXPECT_EQ(0, std::memcmp(ref.data(), x.data(), x.size() * sizeof(bf16)))
            << "T=" << T << " threads=" << n << " " << td::cpu::to_string(isa);
      }
  }
}

// Batch invariance across the kernels' token blocking: from 16 tokens on, the avx512 tier runs
// wo_a and wo_b on cache-blocked kernels (chunks of 64 tokens, register tiles of 6) that must give
// the bits of its small-batch kernels, and every tier must give each token the bits it gets
// decoded alone or in a batch of 8. T = 70: two chunks, a partial register tile in each.
TEST(Oproj, LargeBatchBitIdenticalToSmallBatches) {
  const auto& w = flash_weights();
  const index_t T = 70, G = w.cfg.o_groups, K = w.cfg.o_group_in(), N = w.cfg.hidden;
  const auto o = random_o(w.cfg, T, 77);
  const auto rows = [&](index_t t0, index_t n) {  // tokens [t0, t0 + n) of o, every group
    td::Tensor<bf16, 2> sub({G * n, K});
    for (index_t g = 0; g < G; ++g)
      std::memcpy(&sub.view()(g * n, 0), &o.view()(g * T + t0, 0),
                  std::size_t(n * K) * sizeof(bf16));
    return sub;
  };
  for (auto isa : isas()) {
    SCOPED_TRACE(td::cpu::to_string(isa));
    const auto all = run_kernel(w, o, T, isa);
    td::ThreadPool pool(2);
    const auto two = run_kernel(w, o, T, isa, &pool);
    EXPECT_EQ(0, std::memcmp(all.data(), two.data(), all.size() * sizeof(bf16))) << "2 threads";
    for (index_t n : {1, 8}) {
      for (index_t t0 = 0; t0 + n <= T; t0 += n == 1 ? 23 : n) {
        const auto part = run_kernel(w, rows(t0, n), n, isa);
        EXPECT_EQ(0,
                  std::memcmp(&all.view()(t0, 0), part.data(), std::size_t(n * N) * sizeof(bf16)))
            << "tokens " << t0 << ".." << t0 + n - 1 << " decoded in a batch of " << n;
      }
    }
  }
}

// The avx2_vnni tier changes only the INT8 wo_b dot, which is exact on every tier: outputs must
// be bit-identical to avx2 (weights span the full int8 range, -128 included).
void expect_tier_bit_identical_to_avx2(td::cpu::Isa tier) {
  const auto& w = flash_weights();
  for (index_t T : {1, 8, 13}) {
    const auto o = random_o(w.cfg, T, 40 + T);
    const auto a = run_kernel(w, o, T, td::cpu::Isa::avx2);
    const auto v = run_kernel(w, o, T, tier);
    EXPECT_EQ(0, std::memcmp(a.data(), v.data(), a.size() * sizeof(bf16))) << "T=" << T;
  }
}

TEST(Oproj, VnniTierBitIdenticalToAvx2) {
  if (!td::cpu::cpu_has_avx2_vnni()) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  expect_tier_bit_identical_to_avx2(td::cpu::Isa::avx2_vnni);
}

// The avx512 tier runs wo_a on vdpbf16ps (BF16 activations, its own summation order) and wo_b on
// the 512-bit vpdpbusd: not bit-identical to avx2, so checked against golden and against the avx2
// tier at the per-family tolerance (T = 1, 8, 13; thread counts in
// OddTokenCountsAndThreadsBitIdentical, every tier).
TEST(Oproj, Avx512TierMatchesGolden) {
  if (!td::cpu::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  const auto& w = flash_weights();
  for (index_t T : {1, 8, 13}) {
    const auto o = random_o(w.cfg, T, 40 + T);
    const auto g = run_golden(w, o, T);
    const auto v = run_kernel(w, o, T, td::cpu::Isa::avx512);
    EXPECT_TRUE(tdtest::ratio_allclose(floats(v), floats(g), 1e-4, 1.0 / 128, 0.005)) << "T=" << T;
    const auto a = run_kernel(w, o, T, td::cpu::Isa::avx2);
    EXPECT_TRUE(tdtest::ratio_allclose(floats(v), floats(a), 1e-4, 1.0 / 128, 0.005)) << "T=" << T;
  }
}

// The avx512 tier's wo_a (vdpbf16ps) treats subnormal inputs as zero (DAZ; docs/security.md).
// o_packed of BF16 subnormals (|x| < 2^-126): avx512 gives o_r = 0, Q8 scale 0 and attn_out +0
// exactly; the FMA tiers and golden keep the subnormal products, but their attn_out lies below
// BF16 resolution too (golden's output is all zero here), so the difference stays inside o_r:
// every tier is within the per-family tolerance of golden. Subnormals mixed into normal rows
// (every other element) change attn_out by less than that tolerance.
TEST(Oproj, Avx512WoaTreatsSubnormalActivationsAsZero) {
  if (!td::cpu::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  const auto& w = flash_weights();
  const index_t T = 2;
  for (bool mixed : {false, true}) {
    SCOPED_TRACE(mixed ? "subnormals mixed into normal rows" : "all subnormal");
    auto o = random_o(w.cfg, T, 77);
    for (std::size_t i = mixed ? 1 : 0; i < o.size(); i += mixed ? 2 : 1)  // 1e-39 ... 9e-39
      o.data()[i] = bf16(float(1 + i % 9) * 1e-39f * (i % 4 < 2 ? 1.0f : -1.0f));
    const auto g = run_golden(w, o, T);
    const auto v = run_kernel(w, o, T, td::cpu::Isa::avx512);
    if (!mixed) {
      for (float x : floats(v)) ASSERT_EQ(x, 0.0f) << "avx512: subnormal activations are zero";
    }
    EXPECT_TRUE(tdtest::ratio_allclose(floats(v), floats(g), 1e-4, 1.0 / 128, 0.005));
    const auto a = run_kernel(w, o, T, td::cpu::Isa::avx2);
    EXPECT_TRUE(tdtest::ratio_allclose(floats(a), floats(g), 1e-4, 1.0 / 128, 0.005));
  }
}

// Exact integer path: o_packed chosen so o_r is exactly representable and Q8 is exact, then
// attn_out is a known integer combination.
TEST(Oproj, IntegerStageIsExact) {
  td::ModelConfig cfg = td::flash_config();
  Weights w(cfg, 4);
  // wo_a[g] = I on the first 1024 inputs (rows r ← input r), zero elsewhere.
  std::memset(static_cast<void*>(w.wo_a.data()), 0, w.wo_a.size() * sizeof(bf16));
  for (index_t g = 0; g < cfg.o_groups; ++g)
    for (index_t r = 0; r < cfg.o_lora; ++r) w.wo_a.view()(g, r, r) = bf16(1.0f);
  const index_t T = 2;
  td::Tensor<bf16, 2> o({index_t(cfg.o_groups) * T, cfg.o_group_in()});
  // o_r values are integers in [-127, 127] with amax exactly 127 → Q8 is the identity, dq = 1.
  for (index_t row = 0; row < o.extent(0); ++row)
    for (index_t r = 0; r < cfg.o_lora; ++r)
      o.view()(row, r) = bf16(float((r * 37 + row * 11) % 255 - 127));
  for (index_t n = 0; n < cfg.hidden; ++n) w.scale.view()(n) = 1.0f / 1024.0f;
  for (auto isa : isas()) {
    const auto out = run_kernel(w, o, T, isa);
    for (index_t t = 0; t < T; ++t)
      for (index_t n = 0; n < cfg.hidden; n += 97) {
        std::int64_t acc = 0;
        for (index_t g = 0; g < cfg.o_groups; ++g)
          for (index_t r = 0; r < cfg.o_lora; ++r)
            acc += std::int64_t(o.view()(g * T + t, r).to_float()) *
                   w.wo_b.view()(n, g * cfg.o_lora + r);
        ASSERT_EQ(out.view()(t, n).bits, bf16(float(double(acc) / 1024.0)).bits)
            << "t=" << t << " n=" << n << " " << td::cpu::to_string(isa);
      }
  }
}

TEST(Oproj, ProPresetT1) {
  const Weights w(td::pro_config(), 5);
  const auto o = random_o(w.cfg, 1, 7);
  const auto g = run_golden(w, o, 1);
  for (auto isa : isas())
    EXPECT_TRUE(
        tdtest::ratio_allclose(floats(run_kernel(w, o, 1, isa)), floats(g), 1e-4, 1.0 / 128, 0.005))
        << td::cpu::to_string(isa);
}

// The rounding check (wo_a_norm; backend/cpu/output_projection.hpp, "Rounding check"): the
// default dots' o_r whose Q8 rounding their FP32 error could change are recomputed as golden
// computes them, so the output is golden's bytes, on every tier and thread count, at T = 1, 13,
// 21 and 70 (a partial 8-token check task; the avx512 tier's blocked kernels from 16 tokens);
// without the check the same data flip Q8 activations on every tier (so the test can fail).
TEST(Oproj, RoundingCheckGivesGoldensBytesOnEveryTier) {
  const auto& w = flash_weights();
  std::vector<long> unchecked(isas().size(), 0);
  for (index_t T : {1, 13, 21, 70}) {
    const auto o = random_o(w.cfg, T, 90 + T);
    const auto g = run_golden(w, o, T);
    for (std::size_t i = 0; i < isas().size(); ++i) {
      const auto isa = isas()[i];
      unchecked[i] += bytes_differ(run_kernel(w, o, T, isa), g);
      for (std::size_t n : {1, 2, 7}) {
        td::ThreadPool pool(n);
        EXPECT_EQ(bytes_differ(run_checked(w, o, T, isa, &pool), g), 0)
            << "T=" << T << " threads=" << n << " " << td::cpu::to_string(isa);
      }
    }
  }
  for (std::size_t i = 0; i < isas().size(); ++i)
    EXPECT_GT(unchecked[i], 0) << td::cpu::to_string(isas()[i]);
}

// A row with a NaN or an Inf in o_packed is not checked (Q8's non-finite policy, core/quant.hpp,
// applies to it as without the check): that token's outputs are golden's NaN / Inf classes, and
// every other token's are golden's bytes.
TEST(Oproj, RoundingCheckLeavesNonFiniteRowsToTheQ8Policy) {
  const auto& w = flash_weights();
  const index_t T = 9, K = w.cfg.o_group_in();
  auto o = random_o(w.cfg, T, 120);
  o.view()(2 * T + 1, 17) = bf16(std::numeric_limits<float>::quiet_NaN());    // token 1, group 2
  o.view()(5 * T + 4, K - 1) = bf16(std::numeric_limits<float>::infinity());  // token 4, group 5
  const auto g = run_golden(w, o, T);
  for (auto isa : isas())
    EXPECT_EQ(bytes_differ(run_checked(w, o, T, isa), g), 0) << td::cpu::to_string(isa);
}

// Ties: every row of group 0 the same, so each (token, group 0) row has O_LORA candidates for its
// amax, more than a row lists (kRowRepairs). The check then repairs what it listed and leaves the
// rest: the output stays within the spec's tolerance of golden (not its bytes), and a token's
// bits are the same in any batch (the quota is per row).
TEST(Oproj, RoundingCheckPastItsRowQuotaStaysWithinTolerance) {
  static Weights w(td::flash_config(), 1);
  const index_t R = w.cfg.o_lora, K = w.cfg.o_group_in();
  for (index_t r = 1; r < R; ++r)
    std::memcpy(&w.wo_a.view()(0, r, 0), &w.wo_a.view()(0, 0, 0), std::size_t(K) * sizeof(bf16));
  const index_t T = 8, G = w.cfg.o_groups, N = w.cfg.hidden;
  const auto o = random_o(w.cfg, T, 130);
  const auto g = run_golden(w, o, T);
  td::Tensor<bf16, 2> o1({G, K});  // token 5 alone
  for (index_t gg = 0; gg < G; ++gg)
    std::memcpy(&o1.view()(gg, 0), &o.view()(gg * T + 5, 0), std::size_t(K) * sizeof(bf16));
  for (auto isa : isas()) {
    const auto all = run_checked(w, o, T, isa);
    EXPECT_TRUE(tdtest::ratio_allclose(floats(all), floats(g), 1e-4, 1.0 / 128, 0.005))
        << td::cpu::to_string(isa);
    const auto one = run_checked(w, o1, 1, isa);
    EXPECT_EQ(0, std::memcmp(&all.view()(5, 0), one.data(), std::size_t(N) * sizeof(bf16)))
        << td::cpu::to_string(isa);
  }
}

// The check's window on one row (rounding_check::check_row, every tier): x's largest |x| = 1 and
// row norms 1000 make the FP32 error bound a · |w| = 16 · 2^-24 · 1000 = 9.5e-4 (1.2e-3 Q8 steps
// at sq = 127 / 100), well above the window's other terms (2.8e-4 steps). Listed: a value whose
// scaled interval holds a midpoint (v = 10.5 + 6e-4) and a value that can be the largest after
// repair (100 - 4.7e-4); not listed: v = 10.5 + 3e-3, 100 - 0.01, and values near integers
// (v = i + 0.02). With κ = 0 the first two are missed: the bound's term is what this test pins.
// Without exact_scale (the q-latent) the largest's candidates are listed only in a row that lists
// a midpoint value too. A row with a NaN in o, or an Inf in x, is not checked; an all-zero row
// lists nothing (its Q8 scale is the floor's, whatever the repairs).
TEST(Oproj, RoundingCheckListsTheValuesItsWindowCannotDecide) {
  namespace oc = td::cpu::rounding_check;
  constexpr index_t R = 64, K = 8;
  const float sq = 127.0f / 100.0f, aw = 16.0f * 0x1p-24f * 1000.0f;
  std::vector<bf16> x(K, bf16(0.5f));
  x[3] = bf16(-1.0f);
  std::vector<float> nrm(R, 1000.0f), o(R);
  for (index_t r = 0; r < R; ++r) o[std::size_t(r)] = (float(r % 40) + 0.02f) / sq;
  o[0] = 100.0f;
  o[5] = 100.0f - 0.5f * aw;     // listed: may be the largest after repair
  o[6] = 100.0f - 0.01f;         // not listed
  o[9] = (10.5f + 6e-4f) / sq;   // listed: its interval holds the midpoint 10.5
  o[12] = (10.5f + 3e-3f) / sq;  // not listed
  for (auto isa : isas()) {
    SCOPED_TRACE(td::cpu::to_string(isa));
    const auto list = [&](const std::vector<float>& row, bool exact_scale) {
      oc::Repairs rep;
      oc::check_row(isa, x.data(), K, row.data(), nrm.data(), R, 1000.0f, 3, rep, exact_scale);
      std::vector<index_t> listed;
      for (int i = 0; i < rep.n; ++i) {
        EXPECT_EQ(rep.t[i], 3);
        listed.push_back(rep.r[i]);
      }
      return listed;
    };
    EXPECT_EQ(list(o, true), (std::vector<index_t>{0, 5, 9}));
    EXPECT_EQ(list(o, false), (std::vector<index_t>{0, 5, 9}));
    // Without a value near a midpoint the largest candidates are listed only for an exact scale.
    auto decided = o;
    decided[9] = (10.5f + 3e-3f) / sq;
    EXPECT_EQ(list(decided, true), (std::vector<index_t>{0, 5}));
    EXPECT_EQ(list(decided, false), (std::vector<index_t>{}));
    // A midpoint value in the last chunk (pass 0 searches the whole row).
    decided[R - 1] = (-20.5f - 6e-4f) / sq;
    EXPECT_EQ(list(decided, false), (std::vector<index_t>{0, 5, R - 1}));
    auto nan_o = o;
    nan_o[40] = std::numeric_limits<float>::quiet_NaN();
    oc::Repairs none;
    for (bool exact_scale : {true, false}) {
      oc::check_row(isa, x.data(), K, nan_o.data(), nrm.data(), R, 1000.0f, 0, none, exact_scale);
      auto inf_x = x;
      inf_x[K - 1] = bf16(std::numeric_limits<float>::infinity());
      oc::check_row(isa, inf_x.data(), K, o.data(), nrm.data(), R, 1000.0f, 0, none, exact_scale);
      const std::vector<bf16> zero_x(K, bf16(0.0f));  // an all-zero row: nothing to decide
      const std::vector<float> zero_o(R, 0.0f);
      oc::check_row(isa, zero_x.data(), K, zero_o.data(), nrm.data(), R, 1000.0f, 0, none,
                    exact_scale);
    }
    EXPECT_EQ(none.n, 0);
  }
}

// wo_a_norm is validated before anything is written: shape (O_GROUPS, O_LORA), every value >= 0
// (NaN and negative rejected; +Inf accepted: that row trusts nothing); a bad one throws naming it
// and leaves the output as it was. output_projection_row_norms gives +Inf to a row with a NaN.
TEST(Oproj, RoundingCheckRejectsBadNorms) {
  const auto& w = flash_weights();
  const index_t T = 2, G = w.cfg.o_groups, R = w.cfg.o_lora;
  const auto o = random_o(w.cfg, T, 140);
  std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(w.cfg, T));
  const auto good = td::kernels::output_projection_row_norms(w.wo_a.view());
  const auto expect_rejected = [&](td::ConstView<float, 2> norm, const char* what) {
    td::Tensor<bf16, 2> out({T, w.cfg.hidden});
    for (std::size_t i = 0; i < out.size(); ++i) out.data()[i].bits = std::uint16_t(0x1234 + i);
    const td::Tensor<bf16, 2> before = out;
    try {
      td::kernels::output_projection(td::cpu::Context{}, w.cfg, out.view(), o.view(), w.wo_a.view(),
                                     w.wo_b.view(), w.scale.view(), ws, norm);
      ADD_FAILURE() << what << ": no throw";
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find("wo_a_norm"), std::string::npos) << e.what();
    }
    EXPECT_EQ(0, std::memcmp(out.data(), before.data(), out.size() * sizeof(bf16))) << what;
  };
  td::Tensor<float, 2> shape({G, R + 1});
  expect_rejected(shape.view(), "shape");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -1.0f, -0.5e-30f}) {
    td::Tensor<float, 2> n = good;
    n.view()(G - 1, 7) = bad;
    expect_rejected(n.view(), "value");
  }
  td::Tensor<float, 2> inf = good;
  inf.view()(0, 3) = std::numeric_limits<float>::infinity();
  td::Tensor<bf16, 2> out({T, w.cfg.hidden});
  EXPECT_NO_THROW(td::kernels::output_projection(td::cpu::Context{}, w.cfg, out.view(), o.view(),
                                                 w.wo_a.view(), w.wo_b.view(), w.scale.view(), ws,
                                                 inf.view()));
  Weights nan_w(w.cfg, 2);
  nan_w.wo_a.view()(1, 9, 100) = bf16(std::numeric_limits<float>::quiet_NaN());
  const auto nn = td::kernels::output_projection_row_norms(nan_w.wo_a.view());
  EXPECT_EQ(nn.view()(1, 9), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(nn.view()(1, 10)));
}

// The norms bound the rows' Euclidean norms from above, within a few FP32 ulps.
TEST(Oproj, RowNormsBoundTheNormsFromAbove) {
  const auto& w = flash_weights();
  const auto n = td::kernels::output_projection_row_norms(w.wo_a.view());
  const index_t G = w.cfg.o_groups, R = w.cfg.o_lora, K = w.cfg.o_group_in();
  for (index_t g = 0; g < G; g += 3)
    for (index_t r = 0; r < R; r += 37) {
      double s = 0;
      for (index_t k = 0; k < K; ++k) s += std::pow(double(w.wo_a.view()(g, r, k).to_float()), 2);
      const double e = std::sqrt(s), b = n.view()(g, r);
      EXPECT_GE(b, e);
      EXPECT_LE(b, e * (1.0 + 4.0 * 0x1p-24));
    }
}

TEST(Oproj, RejectsBadShapesAndSmallWorkspace) {
  const auto& w = flash_weights();
  const auto o = random_o(w.cfg, 2, 8);
  td::Tensor<bf16, 2> out({2, w.cfg.hidden});
  std::vector<std::byte> small(100);
  EXPECT_THROW(td::kernels::output_projection(td::cpu::Context{}, w.cfg, out.view(), o.view(),
                                              w.wo_a.view(), w.wo_b.view(), w.scale.view(), small),
               td::Error);
  std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(w.cfg, 3));
  td::Tensor<bf16, 2> out3({3, w.cfg.hidden});
  EXPECT_THROW(td::kernels::output_projection(td::cpu::Context{}, w.cfg, out3.view(), o.view(),
                                              w.wo_a.view(), w.wo_b.view(), w.scale.view(), ws),
               td::Error);
}

}  // namespace
