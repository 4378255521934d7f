// Rounding accuracy: every value the step rounds to INT8 or BF16 is computed close enough to its
// exact value that it rounds as the exact value does. One ulp of error before a rounding becomes
// a whole INT8 step or BF16 ulp after it (a flipped q-latent element moves a whole token's q).
//
// For each rounded quantity: the rate of results that differ from rounding the exact value
// (double accumulation of exact BF16 × BF16 products: the golden references, or the exact dot
// computed here), over seeded random rows at the layer's statistics, on every CPU tier this
// machine has. Each test also measures the previous summation order (one FP32 sum) on the same
// data and checks that the threshold would have caught it, so the measurement can fail.
//
// Thresholds, from the measurements (seeded, so every run sees the same counts; Xeon Sapphire
// Rapids, every tier identical):
//   * BF16 of a 4096-long dot (compressor projections, wo_a: 131072 outputs): the two-level
//     order (FP32 lane partials over blocks of 1024, double across blocks) leaves 7.6e-5 of BF16
//     roundings off, the previous single FP32 sum per lane 1.9e-4. kv (x_n · wkv in FP32 groups
//     of 64 rows, then the double norm and RoPE; 32768 values): 6.1e-5, previously 2.4e-4. Bar
//     1e-4: between the two, so the old orders fail it. Exact rounding (all-double) would double
//     the FMA work of kernels that are FMA-bound at decode batch sizes (5 % budget; the block
//     sizes and their costs are in backend/cpu/bf16_rows_avx2.hpp and decode_avx2.hpp).
//   * Q8 of a row (qr, o-proj activations): a flip needs an error that moves a value across a
//     midpoint 1/254 of amax wide; 0 of 65536 qr values and 0 of 131072 dot rows flip (the old
//     order: 1 of 131072). Bar: 2e-5.
//   * q (BF16 after the exact INT32 matmul of qr and a double epilogue): 0 of 2097152. Bar 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/qkv_fixture.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/golden/qkv_projection.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::cpu::Isa;

namespace {

struct Rate {
  long diff = 0, n = 0;
  void add(bool differs) {
    diff += differs;
    ++n;
  }
  double rate() const { return n ? double(diff) / double(n) : 0.0; }
};

void report(const char* what, const std::string& tier, const Rate& r) {
  std::printf("  %-44s %-10s %6ld / %8ld = %.2e\n", what, tier.c_str(), r.diff, r.n, r.rate());
  testing::Test::RecordProperty(std::string(what) + " " + tier, std::to_string(r.rate()));
}

std::vector<std::int8_t> q8(const float* x, index_t n) {
  std::vector<std::int8_t> q(static_cast<std::size_t>(n));
  td::quantize_q8(q, std::span<const float>(x, std::size_t(n)));
  return q;
}

// Q8 of each row of `got` against Q8 of the same row of `exact` (both FP32, rows of n).
void add_q8(Rate& r, const std::vector<float>& got, const std::vector<float>& exact, index_t n) {
  for (std::size_t row = 0; row * std::size_t(n) < got.size(); ++row) {
    const auto a = q8(got.data() + row * n, n), b = q8(exact.data() + row * n, n);
    for (std::size_t i = 0; i < a.size(); ++i) r.add(a[i] != b[i]);
  }
}

void add_bf16(Rate& r, const std::vector<float>& got, const std::vector<float>& exact) {
  for (std::size_t i = 0; i < got.size(); ++i)
    r.add(td::round_bf16(got[i]) != td::round_bf16(exact[i]));
}

constexpr double kBf16DotBar = 1e-4;
constexpr double kQ8Bar = 2e-5;

// ---------------------------------------------------------------------------------------------
// The BF16-row micro-kernel of the compressor projections and the o-proj's wo_a stage: 128
// tokens × 1024 rows of a 4096-long dot, x ~ N(0, 1) and w ~ N(0, 1/64) in BF16.
TEST(rounding, Bf16RowDotRoundsAsTheExactDot) {
  constexpr index_t T = 128, R = 1024, D = 4096;
  namespace sy = td::decode::synthetic;
  const td::cpu::Context host{};
  td::Tensor<bf16, 2> xb({T, D}), w({R, D});
  sy::fill_normal(host, xb.flat(), sy::tensor_key(17, 0, 1), 0.0f, 1.0f);
  sy::fill_normal(host, w.flat(), sy::tensor_key(17, 0, 2), 0.0f, 1.0f / 64.0f);
  std::vector<float> x(std::size_t(T * D));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = xb.flat()[i].to_float();
  std::vector<float> exact(std::size_t(T * R)), old(std::size_t(T * R));
  for (index_t t = 0; t < T; ++t)
    for (index_t r = 0; r < R; ++r) {
      double s = 0.0;
      float lanes[8] = {};  // the previous order: 8 FP32 lanes over the whole row
      for (index_t k = 0; k < D; ++k) {
        const float p = x[std::size_t(t * D + k)] * w.view()(r, k).to_float();
        s += double(p);
        lanes[k % 8] += p;
      }
      exact[std::size_t(t * R + r)] = float(s);
      old[std::size_t(t * R + r)] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                                    ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    }
  Rate old_bf16, old_q8;
  add_bf16(old_bf16, old, exact);
  add_q8(old_q8, old, exact, R);
  report("bf16 row dot, BF16 (old order)", "-", old_bf16);
  report("bf16 row dot, Q8 per token (old order)", "-", old_q8);
  EXPECT_GT(old_bf16.rate(), kBf16DotBar) << "the measurement no longer sees the old order's error";

  for (Isa isa : td::cpu::supported_isas()) {
    const std::string tier(td::cpu::to_string(isa));
    SCOPED_TRACE(tier);
    std::vector<float> out(std::size_t(T * R));
#if TILEDECODE_X86
    if (isa == Isa::avx512) {  // the o-proj's wo_a on this tier: vdpbf16ps, BF16 activations
      td::cpu::avx512::bf16_rows_dot<false>(out.data(), R, xb.data(), D, T, w.data(), D, R, D, R);
    } else if (td::cpu::has_avx2(isa)) {
      td::cpu::avx2::bf16_rows_dot<false>(out.data(), R, x.data(), D, T, w.data(), D, R, D, R);
    } else
#endif
    {
      td::cpu::bf16_rows_dot_scalar<false>(out.data(), R, x.data(), D, T, w.data(), D, R, D);
    }
    Rate fp32, r_bf16, r_q8;
    for (std::size_t i = 0; i < out.size(); ++i) fp32.add(out[i] != exact[i]);
    add_bf16(r_bf16, out, exact);
    add_q8(r_q8, out, exact, R);
    report("bf16 row dot, FP32 not correctly rounded", tier, fp32);
    report("bf16 row dot, BF16", tier, r_bf16);
    report("bf16 row dot, Q8 per token", tier, r_q8);
    EXPECT_LE(r_bf16.rate(), kBf16DotBar);
    EXPECT_LE(r_q8.rate(), kQ8Bar);
  }
}

// ---------------------------------------------------------------------------------------------
// The q/kv projection at flash shapes, 64 tokens, against golden (double accumulation, double
// norms and RoPE: the exact values, rounded once). qr = Q8(cq) of x_n · wq_a; kv = BF16 of
// x_n · wkv after its norm and RoPE; q = BF16 after the INT32 matmul of qr.
TEST(rounding, QkvProjectionQLatentAndKvRoundAsTheExactValues) {
  const tdtest::QkvFixture f(td::flash_config(), 64, 23);
  const td::ModelConfig& c = f.cfg;
  tdtest::QkvOut g(c, f.T);
  td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(), f.x_n.view(),
                             f.weights(), f.rope.view(), f.pos.view(), c);
  // The previous order for kv: one FP32 sum in ascending k, then the same double epilogue.
  Rate old_kv;
  {
    const index_t D = c.hidden, HD = c.head_dim, NOPE = c.nope_dim();
    std::vector<float> acc(static_cast<std::size_t>(HD));
    std::vector<double> y(static_cast<std::size_t>(HD));
    for (index_t t = 0; t < f.T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (index_t k = 0; k < D; ++k) {
        const float a = f.x_n.view()(t, k).to_float();
        for (index_t n = 0; n < HD; ++n) acc[n] += a * f.wkv.view()(k, n).to_float();
      }
      double ss = 0.0;
      for (float v : acc) ss += double(v) * v;
      const double r = 1.0 / std::sqrt(ss / double(HD) + double(c.rms_eps));
      for (index_t n = 0; n < HD; ++n)
        y[n] = double(acc[n]) * r * double(f.gamma_ckv.view()(n).to_float());
      td::rope_forward_f64(y.data() + NOPE, f.rope.view().cos_row(f.pos.view()(t)),
                           f.rope.view().sin_row(f.pos.view()(t)), c.rope_dim);
      for (index_t n = 0; n < HD; ++n) old_kv.add(bf16(float(y[n])).bits != g.kv.view()(t, n).bits);
    }
  }
  report("kv BF16 (old order)", "-", old_kv);
  EXPECT_GT(old_kv.rate(), kBf16DotBar) << "the measurement no longer sees the old order's error";

  for (Isa isa : td::cpu::supported_isas()) {
    const std::string tier(td::cpu::to_string(isa));
    SCOPED_TRACE(tier);
    tdtest::QkvOut o(c, f.T);
    td::ThreadPool pool(2);
    tdtest::run_qkv(f, o, td::cpu::Context{&pool, isa});
    Rate qr, qs, kv, q;
    for (std::size_t i = 0; i < o.qr.size(); ++i) qr.add(o.qr.data()[i] != g.qr.data()[i]);
    for (std::size_t i = 0; i < o.qr_scale.size(); ++i)
      qs.add(o.qr_scale.data()[i] != g.qr_scale.data()[i]);
    for (std::size_t i = 0; i < o.kv.size(); ++i)
      kv.add(o.kv.data()[i].bits != g.kv.data()[i].bits);
    for (std::size_t i = 0; i < o.q.size(); ++i) q.add(o.q.data()[i].bits != g.q.data()[i].bits);
    report("qr = Q8(cq)", tier, qr);
    report("qr_scale", tier, qs);
    report("kv BF16", tier, kv);
    report("q BF16", tier, q);
    EXPECT_LE(qr.rate(), kQ8Bar);
    EXPECT_LE(kv.rate(), kBf16DotBar);
    EXPECT_LE(q.rate(), kBf16DotBar);
  }
}

}  // namespace
