// Decode-layer front-end primitives (hyper-connections, attention RMSNorm, q/kv projection) and
// one whole SWA / CSA / HCA layer step against the golden layer (spec §4, §9.2, §10.2).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/compare.hpp"
#include "common/decode_fixture.hpp"
#include "common/qkv_fixture.hpp"
#include "common/random.hpp"
#include "common/tolerances.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/golden/decode_layer.hpp"
#include "tiledecode/golden/hyper_connection.hpp"
#include "tiledecode/golden/qkv_projection.hpp"
#include "tiledecode/golden/rmsnorm.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using tdtest::QkvFixture;
using tdtest::QkvOut;
using tdtest::run_qkv;

namespace {

std::vector<td::cpu::Isa> isas() {
  return td::cpu::supported_isas();  // scalar, avx2, avx2_vnni (VNNI INT8 kernels)
}

template <class T, std::size_t R>
std::vector<float> floats(const td::Tensor<T, R>& t) {
  std::vector<float> r(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>) {
      r[i] = t.data()[i].to_float();
    } else {
      r[i] = float(t.data()[i]);
    }
  }
  return r;
}

struct HcFixture {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 8;
  td::Tensor<float, 3> x_hc{{T, 4, cfg.hidden}};
  td::Tensor<float, 2> fn{{td::kHcMixes, 4 * cfg.hidden}};
  td::Tensor<float, 1> scale{{3}}, base{{td::kHcMixes}};
  explicit HcFixture(std::uint64_t seed, index_t tokens = 8)
      : T(tokens), x_hc({tokens, 4, cfg.hidden}) {
    tdtest::Rng rng(seed);
    rng.fill_normal(x_hc.flat(), 1.0f);
    rng.fill_normal(fn.flat(), 1.0f / 128.0f);
    scale.data()[0] = 0.5f;
    scale.data()[1] = 0.7f;
    scale.data()[2] = 1.3f;
    rng.fill_normal(base.flat(), 0.5f);
  }
  td::HcWeights weights() const { return {fn.view(), scale.view(), base.view()}; }
};

// hc_pre's outputs and its mix scratch for one fixture.
struct HcPreOut {
  td::Tensor<bf16, 2> xm;
  td::Tensor<float, 2> post;
  td::Tensor<double, 2> mixes;
  td::Tensor<float, 3> comb;
  HcPreOut(const HcFixture& f, const td::cpu::Context& ctx)
      : xm({f.T, f.cfg.hidden}), post({f.T, 4}), mixes({f.T, td::kHcMixes}), comb({f.T, 4, 4}) {
    td::kernels::hc_pre(ctx, xm.view(), post.view(), comb.view(), f.x_hc.view(), f.weights(),
                        mixes.view(), f.cfg);
  }
};

TEST(HyperConnection, PreMatchesGoldenBothIsas) {
  HcFixture f(11);
  const index_t T = f.T, D = f.cfg.hidden;
  td::Tensor<bf16, 2> xm_g({T, D});
  td::Tensor<float, 2> post_g({T, 4});
  td::Tensor<float, 3> comb_g({T, 4, 4});
  td::golden::hc_pre(xm_g.view(), post_g.view(), comb_g.view(), f.x_hc.view(), f.weights(), f.cfg);
  for (auto isa : isas()) {
    td::ThreadPool pool(2);
    const HcPreOut o(f, td::cpu::Context{&pool, isa});
    EXPECT_TRUE(tdtest::ratio_allclose(floats(o.xm), floats(xm_g), 1e-4, 1.0 / 128, 0.0));
    EXPECT_TRUE(tdtest::ratio_allclose(floats(o.post), floats(post_g), 1e-5, 1e-4, 0.0));
    EXPECT_TRUE(tdtest::ratio_allclose(floats(o.comb), floats(comb_g), 1e-5, 1e-4, 0.0));
  }
}

// The AVX2 mix pass runs register tiles of 3 rows × 2 tokens (and 3 × 1 for an odd token
// count); each mix must equal, bit for bit, the single dot_f32_f64 of its row and token, which
// the RMS pass and earlier versions use. T = 5 covers the odd tail.
TEST(HyperConnection, MixTilesBitIdenticalToSingleDots) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2)) GTEST_SKIP() << "no AVX2";
#if TILEDECODE_X86
  HcFixture f(12, 5);
  const index_t T = f.T, n = 4 * f.cfg.hidden;
  td::ThreadPool pool(2);
  HcPreOut o(f, td::cpu::Context{&pool, td::cpu::Isa::avx2});
  int differ = 0;
  for (index_t t = 0; t < T; ++t)
    for (int j = 0; j < td::kHcMixes; ++j) {
      const double want = td::cpu::avx2::dot_f32_f64(f.fn.data() + j * n, f.x_hc.data() + t * n, n);
      differ += std::memcmp(&want, &o.mixes.view()(t, j), sizeof(double)) != 0;
    }
  EXPECT_EQ(differ, 0);
#endif
}

TEST(HyperConnection, SinkhornCombIsDoublyStochastic) {
  HcFixture f(12);
  const index_t T = f.T, D = f.cfg.hidden;
  td::Tensor<bf16, 2> xm({T, D});
  td::Tensor<float, 2> post({T, 4});
  td::Tensor<double, 2> mixes({T, td::kHcMixes});
  td::Tensor<float, 3> comb({T, 4, 4});
  td::kernels::hc_pre(td::cpu::Context{}, xm.view(), post.view(), comb.view(), f.x_hc.view(),
                      f.weights(), mixes.view(), f.cfg);
  for (index_t t = 0; t < T; ++t) {
    for (int k = 0; k < 4; ++k) {
      float rs = 0, cs = 0;
      for (int j = 0; j < 4; ++j) {
        rs += comb.view()(t, k, j);
        cs += comb.view()(t, j, k);
        EXPECT_GT(comb.view()(t, k, j), 0.0f);
      }
      EXPECT_NEAR(cs, 1.0f, 1e-5f) << "column sum (last normalisation) t=" << t;
      EXPECT_NEAR(rs, 1.0f, 1e-3f) << "row sum t=" << t;
      EXPECT_GT(post.view()(t, k), 0.0f);
      EXPECT_LT(post.view()(t, k), 2.0f);
    }
  }
}

TEST(HyperConnection, PostMatchesGoldenBothIsasAndIsThreadInvariant) {
  HcFixture f(13);
  const index_t T = f.T, D = f.cfg.hidden;
  tdtest::Rng rng(14);
  td::Tensor<bf16, 2> a({T, D});
  rng.fill_normal(a.flat(), 1.0f);
  td::Tensor<float, 2> post({T, 4});
  td::Tensor<float, 3> comb({T, 4, 4});
  rng.fill_uniform(post.flat(), 0.0f, 2.0f);
  rng.fill_uniform(comb.flat(), 0.0f, 0.5f);
  td::Tensor<float, 3> yg({T, 4, D});
  td::golden::hc_post(yg.view(), a.view(), f.x_hc.view(), post.view(), comb.view(), f.cfg);
  for (auto isa : isas()) {
    td::Tensor<float, 3> y1({T, 4, D}), y2({T, 4, D});
    td::kernels::hc_post(td::cpu::Context{nullptr, isa}, y1.view(), a.view(), f.x_hc.view(),
                         post.view(), comb.view(), f.cfg);
    td::ThreadPool pool(3);
    td::kernels::hc_post(td::cpu::Context{&pool, isa}, y2.view(), a.view(), f.x_hc.view(),
                         post.view(), comb.view(), f.cfg);
    EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
    EXPECT_TRUE(tdtest::ratio_allclose(floats(y1), floats(yg), 1e-5, 1e-5, 0.0));
  }
}

TEST(HyperConnection, RejectsBadShapesBeforeWriting) {
  HcFixture f(15);
  td::Tensor<bf16, 2> xm({f.T, f.cfg.hidden});
  td::Tensor<float, 2> post({f.T, 4});
  td::Tensor<double, 2> mixes({f.T, 23});
  td::Tensor<float, 3> comb({f.T, 4, 4});
  EXPECT_THROW(td::kernels::hc_pre(td::cpu::Context{}, xm.view(), post.view(), comb.view(),
                                   f.x_hc.view(), f.weights(), mixes.view(), f.cfg),
               td::Error);
  td::Tensor<float, 3> y({f.T, 4, f.cfg.hidden});
  EXPECT_THROW(td::kernels::hc_post(td::cpu::Context{}, y.view(), xm.view(), y.view(), post.view(),
                                    comb.view(), f.cfg),
               td::Error);
}

TEST(RmsNorm, MatchesGoldenBothIsas) {
  const auto cfg = td::flash_config();
  const index_t T = 8, D = cfg.hidden;
  tdtest::Rng rng(21);
  td::Tensor<bf16, 2> x({T, D});
  td::Tensor<bf16, 1> w({D});
  rng.fill_normal(x.flat(), 3.0f);
  rng.fill_uniform(w.flat(), 0.5f, 1.5f);
  td::Tensor<bf16, 2> g({T, D});
  td::golden::rmsnorm(g.view(), x.view(), w.view(), cfg.rms_eps);
  for (auto isa : isas()) {
    td::Tensor<bf16, 2> y({T, D});
    td::kernels::rmsnorm(td::cpu::Context{nullptr, isa}, y.view(), x.view(), w.view(), cfg.rms_eps);
    EXPECT_TRUE(tdtest::ratio_allclose(floats(y), floats(g), 1e-4, 1.0 / 128, 0.0));
  }
  td::Tensor<bf16, 1> bad({D - 1});
  EXPECT_THROW(td::kernels::rmsnorm(td::cpu::Context{}, x.view(), x.view(), bad.view(), 1e-6f),
               td::Error);
}

void expect_qkv_close(const QkvOut& a, const QkvOut& g) {
  EXPECT_TRUE(tdtest::ratio_allclose(floats(a.q), floats(g.q), 1e-4, 1.0 / 128, 0.0));
  EXPECT_TRUE(tdtest::ratio_allclose(floats(a.kv), floats(g.kv), 1e-4, 1.0 / 128, 0.0));
  EXPECT_TRUE(tdtest::ratio_allclose(floats(a.qr), floats(g.qr), 1.0, 0.0, 0.0));
  EXPECT_TRUE(tdtest::ratio_allclose(floats(a.qr_scale), floats(g.qr_scale), 2.5e-5, 5e-3, 0.0));
}

TEST(QkvProjection, MatchesGoldenBothIsasFlash) {
  QkvFixture f(td::flash_config(), 8, 31);
  QkvOut g(f.cfg, f.T);
  td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(), f.x_n.view(),
                             f.weights(), f.rope.view(), f.pos.view(), f.cfg);
  for (auto isa : isas()) {
    SCOPED_TRACE(std::string(td::cpu::to_string(isa)));
    QkvOut o(f.cfg, f.T);
    td::ThreadPool pool(2);
    run_qkv(f, o, td::cpu::Context{&pool, isa});
    expect_qkv_close(o, g);
  }
}

TEST(QkvProjection, ThreadInvariantAndOddTokenCount) {
  // T = 11 exercises a partial chunk of 8 tokens.
  QkvFixture f(td::flash_config(), 11, 32);
  for (auto isa : isas()) {
    QkvOut a(f.cfg, f.T), b(f.cfg, f.T);
    run_qkv(f, a, td::cpu::Context{nullptr, isa});
    td::ThreadPool pool(3);
    run_qkv(f, b, td::cpu::Context{&pool, isa});
    EXPECT_EQ(0, std::memcmp(a.q.data(), b.q.data(), a.q.size() * 2));
    EXPECT_EQ(0, std::memcmp(a.kv.data(), b.kv.data(), a.kv.size() * 2));
    EXPECT_EQ(0, std::memcmp(a.qr.data(), b.qr.data(), a.qr.size()));
  }
}

// Every tier against the scalar one, every output byte (T = 5): the matmuls' orders are shared,
// and the double epilogues (per-tier target builds of one body, vectorised differently) are
// IEEE operations in one fixed order.
TEST(QkvProjection, EveryTierBitIdenticalToScalar) {
  QkvFixture f(td::flash_config(), 5, 36);
  QkvOut s(f.cfg, f.T);
  run_qkv(f, s, td::cpu::Context{nullptr, td::cpu::Isa::scalar});
  for (auto isa : isas()) {
    SCOPED_TRACE(std::string(td::cpu::to_string(isa)));
    QkvOut o(f.cfg, f.T);
    run_qkv(f, o, td::cpu::Context{nullptr, isa});
    EXPECT_EQ(0, std::memcmp(s.q.data(), o.q.data(), s.q.size() * 2));
    EXPECT_EQ(0, std::memcmp(s.kv.data(), o.kv.data(), s.kv.size() * 2));
    EXPECT_EQ(0, std::memcmp(s.qr.data(), o.qr.data(), s.qr.size()));
    EXPECT_EQ(0, std::memcmp(s.qr_scale.data(), o.qr_scale.data(), s.qr_scale.size() * 4));
  }
}

// The avx2_vnni wq_b matmul (vpdpbusd, weights offset to u8) is exact like the avx2 one: the
// outputs must be bit-identical, also with weights at both int8 extremes.
TEST(QkvProjection, VnniTierBitIdenticalToAvx2) {
  if (!td::cpu::cpu_has_avx2_vnni()) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  for (index_t T : {8, 11}) {
    QkvFixture f(td::flash_config(), T, 34 + std::uint64_t(T));
    auto* wb = f.wq_b.data();
    for (std::size_t i = 0; i < f.wq_b.size(); i += 7) wb[i] = (i / 7) % 2 ? -128 : 127;
    QkvOut a(f.cfg, f.T), v(f.cfg, f.T);
    run_qkv(f, a, td::cpu::Context{nullptr, td::cpu::Isa::avx2});
    run_qkv(f, v, td::cpu::Context{nullptr, td::cpu::Isa::avx2_vnni});
    EXPECT_EQ(0, std::memcmp(a.q.data(), v.q.data(), a.q.size() * 2)) << "T=" << T;
    EXPECT_EQ(0, std::memcmp(a.kv.data(), v.kv.data(), a.kv.size() * 2)) << "T=" << T;
    EXPECT_EQ(0, std::memcmp(a.qr.data(), v.qr.data(), a.qr.size())) << "T=" << T;
  }
}

// The packed wq_b path (kernels::pack_qkv_wq_b + avx2_vnni::matmul_i8_packed, or
// avx512::matmul_i8_packed) against the avx2 tier on the plain wq_b: every output byte, T = 8,
// odd T = 5 (a partial token tile) and T = 29 (past avx512's 24-token chunk), 1 and 2 threads, with
// INT8 extremes (-128 / 127) in wq_b and a wq_b column block all -128 / all 127.
void expect_packed_tier_bit_identical(td::cpu::Isa tier) {
  for (index_t T : {8, 5, 29}) {
    QkvFixture f(td::flash_config(), T, 40 + std::uint64_t(T));
    auto* wb = f.wq_b.data();
    for (std::size_t i = 0; i < f.wq_b.size(); i += 5) wb[i] = (i / 5) % 2 ? -128 : 127;
    const index_t N = f.wq_b.view().extent(1);
    for (index_t k = 0; k < f.cfg.q_lora; ++k)
      for (index_t n = 0; n < 16; ++n) wb[k * N + 512 + n] = n < 8 ? -128 : 127;  // head 1
    // The tier's own layout (avx512: 16 columns per vector, avx2_vnni: 8).
    const td::QkvPackedWqB packed =
        td::kernels::pack_qkv_wq_b(f.cfg, f.wq_b.view(), tier == td::cpu::Isa::avx512 ? 16 : 8);
    for (int threads : {1, 2}) {
      std::unique_ptr<td::ThreadPool> pool;
      if (threads > 1) pool = std::make_unique<td::ThreadPool>(threads);
      QkvOut a(f.cfg, f.T), v(f.cfg, f.T);
      run_qkv(f, a, td::cpu::Context{pool.get(), td::cpu::Isa::avx2});
      run_qkv(f, v, td::cpu::Context{pool.get(), tier}, &packed);
      const std::string at = "T=" + std::to_string(T) + " threads=" + std::to_string(threads);
      EXPECT_EQ(0, std::memcmp(a.q.data(), v.q.data(), a.q.size() * 2)) << at;
      EXPECT_EQ(0, std::memcmp(a.kv.data(), v.kv.data(), a.kv.size() * 2)) << at;
      EXPECT_EQ(0, std::memcmp(a.qr.data(), v.qr.data(), a.qr.size())) << at;
      EXPECT_EQ(0, std::memcmp(a.qr_scale.data(), v.qr_scale.data(), a.qr_scale.size() * 4)) << at;
    }
  }
}

TEST(QkvProjection, PackedVnniBitIdenticalToAvx2) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2_vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  expect_packed_tier_bit_identical(td::cpu::Isa::avx2_vnni);
}

TEST(QkvProjection, PackedAvx512BitIdenticalToAvx2) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  expect_packed_tier_bit_identical(td::cpu::Isa::avx512);
}

// The packed kernel alone against the scalar twin, on activations the projection cannot produce
// (Q8 stops at ±127): random INT8 incl. -128, all -128 × all -128 (the largest |sum|) and
// -128 × 127, T = 1..8 and 11..26, K = 1024 and 256, several column widths (register-tile tails;
// the avx512 kernel takes multiples of 16 columns, the avx2_vnni one multiples of 8).
#if TILEDECODE_X86
template <class Matmul>
void expect_packed_matmul_exact(Matmul&& matmul, index_t vector_cols,
                                std::initializer_list<index_t> widths) {
  tdtest::Rng rng(77);
  for (index_t K : {1024, 256}) {
    td::ModelConfig cfg = td::flash_config();
    cfg.q_lora = int(K);
    cfg.n_heads = 1;
    const index_t N = cfg.head_dim;
    constexpr int kMaxT = 26;  // past the avx512 kernel's 24-token chunk of its projection
    td::Tensor<std::int8_t, 2> w({K, N}), a({kMaxT, K});
    for (int mode = 0; mode < 3; ++mode) {
      for (index_t i = 0; i < K * N; ++i)
        w.data()[i] = mode == 0 ? std::int8_t(rng.integer(-128, 127)) : std::int8_t(-128);
      for (index_t i = 0; i < kMaxT * K; ++i)
        a.data()[i] = mode == 0   ? std::int8_t(rng.integer(-128, 127))
                      : mode == 1 ? std::int8_t(-128)
                                  : std::int8_t(127);
      const td::QkvPackedWqB p = td::kernels::pack_qkv_wq_b(cfg, w.view(), vector_cols);
      std::int32_t a_sum[kMaxT];
      for (int t = 0; t < kMaxT; ++t) {
        a_sum[t] = 0;
        for (index_t k = 0; k < K; ++k) a_sum[t] += a.data()[t * K + k];
      }
      constexpr index_t kLd = 520;
      for (int T : {1, 2, 3, 4, 5, 6, 7, 8, 11, 17, 24, kMaxT})
        for (index_t width : widths) {
          if (width == 0) width = N;
          std::vector<std::int32_t> ref(kMaxT * kLd, -1), got(kMaxT * kLd, -1);
          td::kernels::detail::matmul_i8_axpy_scalar(ref.data(), kLd, a.data(), K, T, w.data(), N,
                                                     K, 0, width);
          matmul(got.data(), kLd, a.data(), K, a_sum, T, p.data.data(), K, width);
          EXPECT_EQ(ref, got) << "K=" << K << " mode=" << mode << " T=" << T << " width=" << width;
        }
    }
  }
}

TEST(QkvProjection, PackedVnniMatmulExactOnExtremes) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx2_vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  // 0: the whole head (N columns).
  expect_packed_matmul_exact([](auto... args) { td::cpu::avx2_vnni::matmul_i8_packed(args...); }, 8,
                             {0, 40, 16, 8});
}

TEST(QkvProjection, PackedAvx512MatmulExactOnExtremes) {
  if (!td::cpu::cpu_supports(td::cpu::Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  expect_packed_matmul_exact([](auto... args) { td::cpu::avx512::matmul_i8_packed(args...); }, 16,
                             {0, 144, 48, 32, 16});
}
#else
TEST(QkvProjection, PackedVnniMatmulExactOnExtremes) {
  GTEST_SKIP() << "the AVX-VNNI tier exists on x86 only";
}
TEST(QkvProjection, PackedAvx512MatmulExactOnExtremes) {
  GTEST_SKIP() << "the AVX-512 tier exists on x86 only";
}
#endif

// Bf16Dot::exact (backend/cpu/bf16_exact.hpp) on every tier this CPU has: x_n · [wq_a | wkv] are
// golden's double sums rounded once, so q, kv and qr match golden (the rounding tests count the
// values that differ: none at these sizes), and every tier, thread count and batch split gives the
// scalar tier's bytes (T = 19: the column kernels' token groups, 8 on avx512 and 4 on avx2, and a
// partial last one).
TEST(QkvProjection, ExactDotsMatchGoldenOnEveryTier) {
  const QkvFixture f(td::flash_config(), 19, 41);
  QkvOut g(f.cfg, f.T);
  td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(), f.x_n.view(),
                             f.weights(), f.rope.view(), f.pos.view(), f.cfg);
  const auto ctx = [](td::Executor* e, td::cpu::Isa isa) {
    return td::cpu::Context{e, isa, td::cpu::Bf16Dot::exact};
  };
  const auto same = [](const QkvOut& a, const QkvOut& b) {
    return std::memcmp(a.q.data(), b.q.data(), a.q.size() * 2) == 0 &&
           std::memcmp(a.kv.data(), b.kv.data(), a.kv.size() * 2) == 0 &&
           std::memcmp(a.qr.data(), b.qr.data(), a.qr.size()) == 0 &&
           std::memcmp(a.qr_scale.data(), b.qr_scale.data(), a.qr_scale.size() * 4) == 0;
  };
  QkvOut ref(f.cfg, f.T);
  run_qkv(f, ref, ctx(nullptr, td::cpu::Isa::scalar));
  expect_qkv_close(ref, g);
  // The roundings to INT8 and BF16 are golden's; qr_scale (FP32, amax / 127 of cq) may be an ulp or
  // two off: the kernel's cq is the FP32 dot normalised (spec: FP32 cq), golden's its double dot.
  EXPECT_EQ(0, std::memcmp(ref.q.data(), g.q.data(), g.q.size() * 2)) << "q";
  EXPECT_EQ(0, std::memcmp(ref.kv.data(), g.kv.data(), g.kv.size() * 2)) << "kv";
  EXPECT_EQ(0, std::memcmp(ref.qr.data(), g.qr.data(), g.qr.size())) << "qr";
  for (index_t t = 0; t < f.T; ++t)
    EXPECT_LE(std::fabs(ref.qr_scale.view()(t) - g.qr_scale.view()(t)),
              std::ldexp(std::fabs(g.qr_scale.view()(t)), -22))
        << t;
  for (td::cpu::Isa isa : td::cpu::supported_isas()) {
    SCOPED_TRACE(td::cpu::to_string(isa));
    for (std::size_t n : {1, 2, 7}) {
      td::ThreadPool pool(n);
      QkvOut o(f.cfg, f.T);
      run_qkv(f, o, ctx(&pool, isa));
      EXPECT_TRUE(same(o, ref)) << n << " threads";
    }
    QkvOut o(f.cfg, f.T);
    for (index_t t0 = 0; t0 < f.T; t0 += 5)
      run_qkv(f, o, ctx(nullptr, isa), nullptr, nullptr, t0, std::min(f.T, t0 + 5));
    EXPECT_TRUE(same(o, ref)) << "tokens in batches of 5";
  }
}

// The avx512 tier's vdpbf16ps x_n · [wq_a | wkv] (Bf16Dot::dpbf16 with the transposed load-time
// copy QkvWeights::bf16_rows): another summation order than the other tiers, so held to golden
// (expect_qkv_close) and to the rounding bars (test_rounding), not to their bits. It must be the
// path taken (outputs differ from the FMA path's somewhere), give the same bytes for 1, 2 and 7
// threads, and for a token decoded in any batch: T = 70 (blocked kernel, 4-token tiles and a
// partial 64-token chunk) against every token alone and batches of 8 and 16 (the small-batch
// kernel below 16 tokens, the blocked one from there).
TEST(QkvProjection, Avx512Bf16RowsMatchGoldenAndAreBatchInvariant) {
  if (!td::cpu::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  const QkvFixture f(td::flash_config(), 70, 37);
  const td::QkvBf16Rows rows = td::kernels::pack_qkv_bf16_rows(f.cfg, f.wq_a.view(), f.wkv.view());
  for (index_t k : {index_t(0), index_t(1234), index_t(f.cfg.hidden - 1)})
    for (index_t n : {index_t(0), index_t(777), index_t(f.cfg.q_lora - 1)})
      ASSERT_EQ(rows.data[std::size_t(n * f.cfg.hidden + k)].bits, f.wq_a.view()(k, n).bits);
  ASSERT_EQ(rows.data[std::size_t((f.cfg.q_lora + 5) * f.cfg.hidden + 9)].bits,
            f.wkv.view()(9, 5).bits);
  QkvOut g(f.cfg, f.T);
  td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(), f.x_n.view(),
                             f.weights(), f.rope.view(), f.pos.view(), f.cfg);
  const auto ctx = [](td::Executor* e) {
    return td::cpu::Context{e, td::cpu::Isa::avx512, td::cpu::Bf16Dot::dpbf16};
  };
  QkvOut all(f.cfg, f.T), fma(f.cfg, f.T);
  run_qkv(f, all, ctx(nullptr), nullptr, &rows);
  expect_qkv_close(all, g);
  run_qkv(f, fma, td::cpu::Context{nullptr, td::cpu::Isa::avx512, td::cpu::Bf16Dot::fma}, nullptr,
          &rows);
  EXPECT_NE(0, std::memcmp(all.kv.data(), fma.kv.data(), all.kv.size() * 2))
      << "dpbf16 with bf16_rows gave the FMA path's bytes: the rows path did not run";
  const auto same = [](const QkvOut& a, const QkvOut& b) {
    return std::memcmp(a.q.data(), b.q.data(), a.q.size() * 2) == 0 &&
           std::memcmp(a.kv.data(), b.kv.data(), a.kv.size() * 2) == 0 &&
           std::memcmp(a.qr.data(), b.qr.data(), a.qr.size()) == 0 &&
           std::memcmp(a.qr_scale.data(), b.qr_scale.data(), a.qr_scale.size() * 4) == 0;
  };
  for (std::size_t n : {2, 7}) {
    td::ThreadPool pool(n);
    QkvOut o(f.cfg, f.T);
    run_qkv(f, o, ctx(&pool), nullptr, &rows);
    EXPECT_TRUE(same(o, all)) << n << " threads";
  }
  for (index_t batch : {1, 8, 16}) {
    QkvOut o(f.cfg, f.T);
    for (index_t t0 = 0; t0 < f.T; t0 += batch)
      run_qkv(f, o, ctx(nullptr), nullptr, &rows, t0, std::min(f.T, t0 + batch));
    EXPECT_TRUE(same(o, all)) << "tokens in batches of " << batch;
  }
  // A copy of other dimensions is rejected before anything is written.
  td::QkvBf16Rows bad = td::kernels::pack_qkv_bf16_rows(f.cfg, f.wq_a.view(), f.wkv.view());
  bad.hidden -= 1;
  QkvOut o(f.cfg, f.T);
  std::memset(static_cast<void*>(o.q.data()), 0x55, o.q.size() * 2);
  try {
    run_qkv(f, o, ctx(nullptr), nullptr, &bad);
    ADD_FAILURE() << "no throw";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("w.bf16_rows->hidden"), std::string::npos) << e.what();
  }
  EXPECT_EQ(o.q.data()[0].bits, 0x5555) << "nothing written before the throw";
}

// The q-latent's rounding check (wq_a_norm) gives the same bytes for any thread count and for a
// token decoded in any batch, on every tier: its repairs from wq_a's columns (the FMA dots, no
// rows: AVX2-only and Intel CPUs) and, where AVX-512 runs, from the transposed rows (FMA and
// vdpbf16ps dots). T = 24 against 2 and 7 threads, every token alone and batches of 8. Two
// weight sets: the fixture's, and one whose wq_a columns repeat with period 64 and gamma_cq = 1,
// so every cq value of a row appears 16 times (the row's largest too: its repairs fill the row's
// quota), which stays within the tolerances of golden.
TEST(QkvProjection, RoundingCheckIsThreadAndBatchInvariant) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied columns" : "random columns");
    QkvFixture f(td::flash_config(), 24, 38);
    if (tied) {
      for (index_t k = 0; k < f.cfg.hidden; ++k)
        for (index_t n = 64; n < f.cfg.q_lora; ++n) f.wq_a.view()(k, n) = f.wq_a.view()(k, n % 64);
      for (index_t n = 0; n < f.cfg.q_lora; ++n) f.gamma_cq.view()(n) = bf16(1.0f);
      QkvOut g(f.cfg, f.T), o(f.cfg, f.T);
      td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(),
                                 f.x_n.view(), f.weights(), f.rope.view(), f.pos.view(), f.cfg);
      const td::Tensor<float, 1> nrm = td::kernels::qkv_wq_a_norms(f.wq_a.view());
      run_qkv(f, o, td::cpu::make_context(nullptr), nullptr, nullptr, 0, -1, nrm.view());
      expect_qkv_close(o, g);
    }
    const td::Tensor<float, 1> norm = td::kernels::qkv_wq_a_norms(f.wq_a.view());
    const td::Tensor<float, 1> kvn = td::kernels::qkv_wkv_norms(f.wkv.view());  // the kv check
    td::QkvBf16Rows rows;
    struct Path {
      td::cpu::Isa isa;
      td::cpu::Bf16Dot dot;
      const td::QkvBf16Rows* rows;
    };
    std::vector<Path> paths;
    for (auto isa : isas()) paths.push_back({isa, td::cpu::Bf16Dot::fma, nullptr});
    if (td::cpu::cpu_supports(td::cpu::Isa::avx512)) {
      rows = td::kernels::pack_qkv_bf16_rows(f.cfg, f.wq_a.view(), f.wkv.view());
      paths.push_back({td::cpu::Isa::avx512, td::cpu::Bf16Dot::fma, &rows});
      paths.push_back({td::cpu::Isa::avx512, td::cpu::Bf16Dot::dpbf16, &rows});
    }
    const auto same = [](const QkvOut& a, const QkvOut& b) {
      return std::memcmp(a.q.data(), b.q.data(), a.q.size() * 2) == 0 &&
             std::memcmp(a.kv.data(), b.kv.data(), a.kv.size() * 2) == 0 &&
             std::memcmp(a.qr.data(), b.qr.data(), a.qr.size()) == 0 &&
             std::memcmp(a.qr_scale.data(), b.qr_scale.data(), a.qr_scale.size() * 4) == 0;
    };
    for (const Path& p : paths) {
      SCOPED_TRACE(std::string(td::cpu::to_string(p.isa)) +
                   (p.dot == td::cpu::Bf16Dot::dpbf16 ? "/dpbf16" : "") +
                   (p.rows ? ", rows" : ", columns"));
      const auto ctx = [&](td::Executor* e) { return td::cpu::Context{e, p.isa, p.dot}; };
      QkvOut all(f.cfg, f.T);
      run_qkv(f, all, ctx(nullptr), nullptr, p.rows, 0, -1, norm.view(), kvn.view());
      for (std::size_t n : {2, 7}) {
        td::ThreadPool pool(n);
        QkvOut o(f.cfg, f.T);
        run_qkv(f, o, ctx(&pool), nullptr, p.rows, 0, -1, norm.view(), kvn.view());
        EXPECT_TRUE(same(o, all)) << n << " threads";
      }
      for (index_t batch : {1, 8}) {
        QkvOut o(f.cfg, f.T);
        for (index_t t0 = 0; t0 < f.T; t0 += batch)
          run_qkv(f, o, ctx(nullptr), nullptr, p.rows, t0, std::min(f.T, t0 + batch), norm.view(),
                  kvn.view());
        EXPECT_TRUE(same(o, all)) << "tokens in batches of " << batch;
      }
    }
  }
}

// wq_a_norm (the q-latent's rounding check) is validated before anything is written: extent
// Q_LORA, every value >= 0 (NaN and negative rejected, naming the element; +Inf accepted: that
// column trusts nothing); qkv_wq_a_norms bounds each column's norm from above (within a few FP32
// ulps) and gives +Inf to a column with a NaN.
TEST(QkvProjection, RoundingCheckRejectsBadNorms) {
  QkvFixture f(td::flash_config(), 2, 35);
  const index_t D = f.cfg.hidden, QL = f.cfg.q_lora;
  const td::Tensor<float, 1> good = td::kernels::qkv_wq_a_norms(f.wq_a.view());
  for (index_t n : {index_t(0), index_t(511), QL - 1}) {
    double ss = 0.0;
    for (index_t k = 0; k < D; ++k)
      ss += double(f.wq_a.view()(k, n).to_float()) * f.wq_a.view()(k, n).to_float();
    EXPECT_GE(double(good.view()(n)), std::sqrt(ss)) << n;
    EXPECT_LE(double(good.view()(n)), std::sqrt(ss) * (1.0 + 0x1p-21)) << n;
  }
  const auto expect_rejected = [&](td::ConstView<float, 1> norm, const char* want) {
    QkvOut o(f.cfg, f.T);
    std::memset(static_cast<void*>(o.q.data()), 0x55, o.q.size() * 2);
    std::memset(static_cast<void*>(o.qr.data()), 0x55, o.qr.size());
    try {
      run_qkv(f, o, td::cpu::make_context(nullptr), nullptr, nullptr, 0, -1, norm);
      ADD_FAILURE() << want << ": no throw";
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(o.q.data()[0].bits, 0x5555) << want << ": written before the throw";
    EXPECT_EQ(o.qr.data()[o.qr.size() - 1], 0x55) << want << ": written before the throw";
  };
  td::Tensor<float, 1> shape({QL + 1});
  expect_rejected(shape.view(), "w.wq_a_norm");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -1.0f, -0.5e-30f}) {
    td::Tensor<float, 1> n = good;
    n.view()(QL - 3) = bad;
    expect_rejected(n.view(), "w.wq_a_norm[1021]");
  }
  {  // the kv check's norms (qkv_wkv_norms): the same rules
    td::Tensor<float, 1> kvn = td::kernels::qkv_wkv_norms(f.wkv.view());
    kvn.view()(5) = std::numeric_limits<float>::quiet_NaN();
    QkvOut o(f.cfg, f.T);
    std::memset(static_cast<void*>(o.kv.data()), 0x55, o.kv.size() * 2);
    try {
      run_qkv(f, o, td::cpu::make_context(nullptr), nullptr, nullptr, 0, -1, good.view(),
              kvn.view());
      ADD_FAILURE() << "w.wkv_norm[5]: no throw";
    } catch (const td::Error& e) {
      EXPECT_NE(std::string(e.what()).find("w.wkv_norm[5]"), std::string::npos) << e.what();
    }
    EXPECT_EQ(o.kv.data()[0].bits, 0x5555) << "w.wkv_norm: written before the throw";
  }
  td::Tensor<float, 1> inf = good;
  inf.view()(3) = std::numeric_limits<float>::infinity();
  QkvOut o(f.cfg, f.T);
  EXPECT_NO_THROW(
      run_qkv(f, o, td::cpu::make_context(nullptr), nullptr, nullptr, 0, -1, inf.view()));
  f.wq_a.view()(100, 9) = bf16(std::numeric_limits<float>::quiet_NaN());
  const td::Tensor<float, 1> nn = td::kernels::qkv_wq_a_norms(f.wq_a.view());
  EXPECT_EQ(nn.view()(9), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(nn.view()(10)));
}

TEST(QkvProjection, ProShapesMatchGolden) {
  QkvFixture f(td::pro_config(), 4, 33);
  QkvOut g(f.cfg, f.T), o(f.cfg, f.T);
  td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(), f.x_n.view(),
                             f.weights(), f.rope.view(), f.pos.view(), f.cfg);
  run_qkv(f, o, td::cpu::make_context(nullptr));
  expect_qkv_close(o, g);
}

TEST(QkvProjection, RejectsPositionOutsideTable) {
  QkvFixture f(td::flash_config(), 2, 34);
  f.pos.data()[1] = f.cfg.max_seq_len;
  QkvOut o(f.cfg, f.T);
  std::memset(static_cast<void*>(o.q.data()), 0x55, o.q.size() * 2);
  EXPECT_THROW(run_qkv(f, o, td::cpu::Context{}), td::Error);
  EXPECT_EQ(o.q.data()[0].bits, 0x5555) << "nothing written before the throw";
}

// ---------------------------------------------------------------------------------------------
// One whole layer step against the golden layer (spec §10.2 tolerances), B = 4, S = 2, flash.

struct LayerRun {
  double max_rel = 0;
};

// Runs kernel and golden on copies of the same pools; compares x_out and every pool.
void check_layer(td::LayerKind kind, std::array<std::int32_t, 4> starts, int commit,
                 td::cpu::Isa isa, const td::decode::LayerOptions& opt = {},
                 td::paged::Layout layout = td::paged::Layout::base, int S = 2,
                 bool compressor_check = false) {
  const auto cfg = td::flash_config();
  const int B = 4;
  td::ThreadPool pool(2);
  const auto be = td::decode::Backend::cpu(&pool, isa);
  // The HEAD layouts with pools sized so that no request shares a page (addendum §3.4).
  td::paged::FixtureTables fx =
      layout == td::paged::Layout::base
          ? td::paged::FixtureTables(B, cfg)
          : td::paged::FixtureTables(B, td::paged::PoolSizes::per_request(B, layout, cfg), layout,
                                     false, cfg);
  tdtest::LayerSetup L(cfg, kind, fx.pools, 2, 1234, be.cpu_ctx, layout);
  td::decode::LayerCacheStorage gold = L.caches;  // golden's own copy of the pools

  const td::paged::StepShape sh{B, S, commit};
  td::paged::StepMetadata md(B, S, cfg);
  md.build(starts, sh, fx.tables(), fx.pools, cfg);
  td::decode::Workspace ws(cfg, B, S, be.concurrency());
  const index_t T = B * S;
  td::Tensor<float, 3> x_hc({T, 4, cfg.hidden}), x_out({T, 4, cfg.hidden}),
      x_gold({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(be.cpu_ctx, x_hc.view(), 99, 0);

  if (compressor_check) {
    L.weights.enable_compressor_rounding_check();
    EXPECT_EQ(L.weights.view().compressor.row_norms.extent(0), 2 * L.weights.cmp_wkv.extent(0));
  }
  const auto w = L.weights.view();
  td::decode::layer_step(be, x_out.view(), x_hc.view(), w, L.caches.view(), md, L.rope.view(), ws,
                         cfg, opt);
  td::golden::LayerTrace tr;
  td::golden::decode_layer(x_gold.view(), x_hc.view(), w, gold.view(), starts, sh, fx.tables(),
                           L.rope.view(), cfg, opt, &tr);
  // Intermediates first (they explain an x_out failure).
  auto v = ws.views(B, S);
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() &&
           std::memcmp(a.data(), b.data(), a.size() * sizeof(*a.data())) == 0;
  };
  // LayerWeightsStorage::pack gives the q-latent's and the kv rounding checks on every CPU (their
  // norms and the transposed rows their repairs read), and x_n is golden's bytes: qr and kv are
  // golden's bytes on every tier and dot order (issue 17).
  ASSERT_TRUE(same(td::ConstView<bf16, 2>(v.x_n), tr.x_n.view())) << "x_n";
  EXPECT_TRUE(same(td::ConstView<std::int8_t, 2>(v.qr), tr.qr.view())) << "qr";
  EXPECT_TRUE(same(td::ConstView<bf16, 2>(v.kv), tr.kv.view())) << "kv";
  EXPECT_TRUE(tdtest::ratio_allclose(tdtest::to_float_vec(td::ConstView<bf16, 3>(v.q)),
                                     floats(tr.q), 1e-4, 1.0 / 128, 0.0))
      << "q";
  if (kind == td::LayerKind::csa) {
    // The kernel's scores come from its own upstream results: near-ties (scores equal to a few
    // ulp) may reorder against golden. Where the picks differ, golden's scores of the two picks
    // agree within the score rule (spec §10.2 score tolerance).
    for (index_t t = 0; t < T; ++t) {
      EXPECT_TRUE(tdtest::topk_near_tie_compare(
          std::span<const std::int32_t>(&v.topk_idxs(t, 0), std::size_t(cfg.idx_topk)),
          std::span<const std::int32_t>(&tr.topk_idxs.view()(t, 0), std::size_t(cfg.idx_topk)),
          std::span<const float>(&tr.score.view()(t, 0), std::size_t(cfg.score_len())),
          tdtest::tol::idx_score.atol, tdtest::tol::idx_score.rtol))
          << "topk_idxs row " << t;
    }
  }
  // attn_out: a diagnostic bound only. The front-end above is bit-exact, but the attention's
  // FP32 accumulation flips a few BF16 o_packed values against the double golden, and the
  // output projection's per-(token, group) Q8 spreads each flip over ~4 % of that token's
  // channels (measured 0.6–3 % of points beyond (1e-4, 1/128)); the spec's layer criterion is
  // the x_out rule below.
  EXPECT_TRUE(tdtest::ratio_allclose(tdtest::to_float_vec(td::ConstView<bf16, 2>(v.attn_out)),
                                     floats(tr.attn_out), 1e-3, 1.0 / 64, 0.05))
      << "attn_out";
  EXPECT_TRUE(tdtest::x_out_close(x_out.view(), x_gold.view(), kind)) << "x_out";
  tdtest::expect_caches_close(L.caches, gold, std::string(td::to_string(kind)).c_str());
  if (compressor_check) {
    // x_n is golden's bytes and both start from the same pools, so with the check the emitted
    // compressed rows are golden's bytes (the check's promise from the step's inputs).
    EXPECT_TRUE(same(L.caches.cmp_kv, gold.cmp_kv)) << "cmp_kv";
    if (kind == td::LayerKind::csa) {
      EXPECT_TRUE(same(L.caches.idx_kv_cache, gold.idx_kv_cache)) << "idx_kv_cache";
      EXPECT_TRUE(same(L.caches.idx_kv_scale, gold.idx_kv_scale)) << "idx_kv_scale";
    }
  }
}

// The compressors' opt-in rounding check (LayerWeightsStorage::enable_compressor_rounding_check)
// in the layer step: the emitted compressed rows equal golden's bytes.
TEST(LayerStep, CompressorRoundingCheckGivesGoldensRows) {
  for (td::cpu::Isa isa : td::cpu::supported_isas()) {
    SCOPED_TRACE(td::cpu::to_string(isa));
    check_layer(td::LayerKind::csa, {8190, 127, 2, 3}, -1, isa, {}, td::paged::Layout::base, 2,
                true);
    check_layer(td::LayerKind::hca, {8190, 126, 254, 3}, -1, isa, {}, td::paged::Layout::base, 2,
                true);
  }
}

TEST(LayerStep, SwaMatchesGoldenAtCanonicalStarts) {
  check_layer(td::LayerKind::swa, {8192, 127, 31, 8192}, 1, td::cpu::detect_isa());
}

TEST(LayerStep, HcaMatchesGoldenAtCanonicalStarts) {
  check_layer(td::LayerKind::hca, {8192, 127, 128, 255}, 1, td::cpu::detect_isa());
}

TEST(LayerStep, CsaMatchesGoldenAtCanonicalStarts) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa());
}

TEST(LayerStep, CsaAllCommittedWritesTheDraftBoundary) {
  // commit_tokens = -1 (standalone semantics): start 2 closes row 0 on its second token.
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, -1, td::cpu::detect_isa());
}

TEST(LayerStep, CsaReferenceRopeQuirk) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa(),
              {td::decode::IndexerRope::reference});
}

TEST(LayerStep, ScalarPathMatchesGoldenHca) {
  check_layer(td::LayerKind::hca, {8192, 127, 128, 255}, 1, td::cpu::Isa::scalar);
}

// The reference's current cache contract (addendum §2, §3): the same layer steps on the device
// ring (#862: shared compressed table, block_counts ring wrap of the compressed, index and state
// tables) and on the prefix-caching layout (separate HCA / CSA compressed pools, 1-row HCA and
// 32-row CSA / index pages, 7-column block_counts), each against golden's own builders of that
// layout. The starts cross the ring wrap of the fixture's block counts.
TEST(LayerStep, CsaDeviceRingLayout) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::device_ring);
}
TEST(LayerStep, HcaDeviceRingLayout) {
  check_layer(td::LayerKind::hca, {8192, 127, 128, 255}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::device_ring);
}
TEST(LayerStep, CsaPrefixCachingLayout) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::prefix_caching);
}
TEST(LayerStep, HcaPrefixCachingLayout) {
  check_layer(td::LayerKind::hca, {8192, 127, 128, 255}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::prefix_caching);
}
// MTP as served (addendum §8, §10): S in {1, 4, 8} tokens per request with commit_tokens in
// [0, S]; each draft token attends to its predecessors of the same step (their kv rows are written
// before the attention), and with S > R every ratio-4 boundary of the step gets its own
// compressed row (addendum §7, option (b)).
TEST(LayerStep, MtpS1Csa) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::base, 1);
}
TEST(LayerStep, MtpS4CommitNone) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 0, td::cpu::detect_isa(), {},
              td::paged::Layout::base, 4);
}
TEST(LayerStep, MtpS8CsaCommit1) {
  check_layer(td::LayerKind::csa, {8192, 0, 2, 3}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::base, 8);
}
TEST(LayerStep, MtpS8CsaCommitAll) {
  check_layer(td::LayerKind::csa, {8185, 0, 2, 3}, 8, td::cpu::detect_isa(), {},
              td::paged::Layout::base, 8);
}
TEST(LayerStep, MtpS8HcaCommit5) {
  check_layer(td::LayerKind::hca, {8188, 127, 120, 250}, 5, td::cpu::detect_isa(), {},
              td::paged::Layout::base, 8);
}
TEST(LayerStep, MtpS8SwaPrefixCaching) {
  check_layer(td::LayerKind::swa, {8192, 127, 31, 8192}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::prefix_caching, 8);
}

TEST(LayerStep, SwaPrefixCachingLayout) {
  check_layer(td::LayerKind::swa, {8192, 127, 31, 8192}, 1, td::cpu::detect_isa(), {},
              td::paged::Layout::prefix_caching);
}

}  // namespace

namespace {

// Every primitive splits work by shape only: a whole CSA layer step gives the same bits inline and
// on 3 threads (outputs and every pool).
TEST(LayerStep, BitIdenticalForAnyThreadCount) {
  const auto cfg = td::flash_config();
  const int B = 4, S = 2;
  td::paged::FixtureTables fx(B, cfg);
  tdtest::LayerSetup L(cfg, td::LayerKind::csa, fx.pools, 2, 55, td::cpu::make_context(nullptr));
  td::decode::LayerCacheStorage c1 = L.caches, c3 = L.caches;
  td::paged::StepMetadata md(B, S, cfg);
  const std::array<std::int32_t, 4> starts{8192, 0, 2, 3};
  md.build(starts, {B, S, 1}, fx.tables(), fx.pools, cfg);
  const index_t T = B * S;
  td::Tensor<float, 3> x({T, 4, cfg.hidden}), y1({T, 4, cfg.hidden}), y3({T, 4, cfg.hidden});
  td::decode::synthetic::fill_x_hc(td::cpu::Context{}, x.view(), 8, 0);
  const auto w = L.weights.view();
  {
    const auto be = td::decode::Backend::cpu(nullptr);
    td::decode::Workspace ws(cfg, B, S, be.concurrency());
    td::decode::layer_step(be, y1.view(), x.view(), w, c1.view(), md, L.rope.view(), ws, cfg);
  }
  {
    td::ThreadPool pool(3);
    const auto be = td::decode::Backend::cpu(&pool);
    td::decode::Workspace ws(cfg, B, S, be.concurrency());
    td::decode::layer_step(be, y3.view(), x.view(), w, c3.view(), md, L.rope.view(), ws, cfg);
  }
  EXPECT_EQ(0, std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(c1.kv_cache.data(), c3.kv_cache.data(), c1.kv_cache.size() * 2));
  EXPECT_EQ(0, std::memcmp(c1.cmp_kv.data(), c3.cmp_kv.data(), c1.cmp_kv.size() * 2));
  EXPECT_EQ(0, std::memcmp(c1.state.data(), c3.state.data(), c1.state.size() * 4));
  EXPECT_EQ(0, std::memcmp(c1.idx_kv_cache.data(), c3.idx_kv_cache.data(), c1.idx_kv_cache.size()));
}

}  // namespace
