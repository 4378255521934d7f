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
//   * cpu::Bf16Dot::exact (backend/cpu/bf16_exact.hpp: the long dots summed in double in
//     ascending k, golden's order), every tier, AMD EPYC Zen 5: every FP32 dot is the correctly
//     rounded exact dot (0 of 131072 differ, both arrangements) and no rounding after it differs
//     from golden's: row dot BF16 / Q8 0, qr 0 / 65536, kv 0 / 32768, q 0 / 2097152, o-proj
//     attn_out 0 / 32768 (T = 8) and 0 / 98304 (T = 24), the compressors' state rows and FP32 y
//     equal golden's (so 0 BF16 / INT8 flips). Bar kExactBar = 0. What can still differ: a value
//     within half an FP32 ulp of a rounding midpoint where the kernel rounds the dot to FP32 and
//     golden keeps its double (the q / kv epilogues): about 1e-5 of kv and 3e-6 of qr values, an
//     expected 0.35 and 0.2 here. The data are seeded, so the counts do not move unless the code
//     or the fixture does. The default paths (FP32 accumulation) keep the bars above; the cost of
//     exact is in docs/compressors.md ("Exact dots").
//   * The o-proj's rounding check (default dots given wo_a_norm, as the decode step runs them;
//     backend/cpu/rounding_check.hpp): attn_out 0 / 32768 (T = 8) and 0 / 98304 (T = 24) differ
//     from golden on every tier, where the same dots without it give 604–606 and 3–6. Bar 0: the
//     check recomputes as golden does every value whose interval (κ = 16 times the largest error
//     measured, 1.9 · 2^-24 · max|x| · |w_r|) could hold a Q8 decision.
//   * The same check on the q-latent (QkvWeights::wq_a_norm; its repairs from the transposed rows
//     or from wq_a's columns): qr 0 / 524288 off the exact cq's Q8 on every tier, where the same
//     dots without it give 1 (avx512/dpbf16: 2), and the q of the tokens those flip is golden's
//     bytes (without it 10630 of 98304 differ).
//   * The compressors' check (CompressorWeights::row_norms), from each step's inputs: 0 of 131072
//     CSA, 32768 HCA and 65536 inner BF16 values off golden's on every path, where the default
//     dots alone give 5 / 1 / 5 (FMA order) and 8 / 0 / 2 (avx512/dpbf16); with +Inf norms every
//     written state value is golden's too. Bar 0.
//   * The kv check (QkvWeights::wkv_norm): kv 0 / 524288 off golden's on every path (repairs from
//     the rows and from the columns), where the same dots without it give 39 (avx512/dpbf16: 41).
//     Bar 0.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/qkv_fixture.hpp"
#include "common/random.hpp"
#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/bf16_rows_avx512.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/decode/synthetic.hpp"
#include "tiledecode/golden/output_projection.hpp"
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
  std::printf("  %-44s %-16s %6ld / %8ld = %.2e\n", what, tier.c_str(), r.diff, r.n, r.rate());
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
// Bf16Dot::exact: none at these sizes (the note at the top).
constexpr double kExactBar = 0.0;

// The previous order of the BF16 row dots (before the two-level blocks): 8 FP32 lanes (k % 8)
// over the whole row, summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)). Every product of
// BF16-valued x and w is exact in FP32.
float old_order_dot(const float* x, const float* w, index_t d) {
  float lanes[8] = {};
  for (index_t k = 0; k < d; ++k) lanes[k % 8] += x[k] * w[k];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
         ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

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
  std::vector<float> wf(std::size_t(R * D));
  for (std::size_t i = 0; i < wf.size(); ++i) wf[i] = w.flat()[i].to_float();
  std::vector<float> exact(std::size_t(T * R)), old(std::size_t(T * R));
  for (index_t t = 0; t < T; ++t)
    for (index_t r = 0; r < R; ++r) {
      const float* xr = x.data() + t * D;
      const float* wr = wf.data() + r * D;
      double s = 0.0;
      for (index_t k = 0; k < D; ++k) s += double(xr[k] * wr[k]);
      exact[std::size_t(t * R + r)] = float(s);
      old[std::size_t(t * R + r)] = old_order_dot(xr, wr, D);
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

  // Bf16Dot::exact (bf16_exact.hpp), both arrangements (a weight row per output, and the q/kv
  // layout, a weight column per output): `exact` above is their order, so not one FP32 value may
  // differ, on any tier, and then neither may a BF16 or Q8 rounding.
  std::vector<bf16> wt(std::size_t(D * R));  // w as (D, R)
  for (index_t r = 0; r < R; ++r)
    for (index_t k = 0; k < D; ++k) wt[std::size_t(k * R + r)] = w.flat()[std::size_t(r * D + k)];
  for (Isa isa : td::cpu::supported_isas()) {
    const std::string tier = std::string(td::cpu::to_string(isa)) + "/exact";
    SCOPED_TRACE(tier);
    std::vector<float> rows(std::size_t(T * R)), cols(rows.size());
    td::cpu::bf16_rows_dot_exact(isa, rows.data(), R, xb.data(), D, T, w.data(), D, R, D);
    td::cpu::bf16_cols_dot_exact(isa, cols.data(), R, xb.data(), D, T, wt.data(), R, D, 0, R);
    Rate fp32, fp32_cols, r_bf16, r_q8;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      fp32.add(rows[i] != exact[i]);
      fp32_cols.add(cols[i] != exact[i]);
    }
    add_bf16(r_bf16, rows, exact);
    add_q8(r_q8, rows, exact, R);
    report("bf16 row dot, FP32 not correctly rounded", tier, fp32);
    report("bf16 column dot, FP32 not correctly rounded", tier, fp32_cols);
    report("bf16 row dot, BF16", tier, r_bf16);
    report("bf16 row dot, Q8 per token", tier, r_q8);
    EXPECT_EQ(fp32.diff, 0);
    EXPECT_EQ(fp32_cols.diff, 0);
    EXPECT_EQ(r_bf16.diff, 0);
    EXPECT_EQ(r_q8.diff, 0);
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

  // Every tier on its FMA order (one bits), and the avx512 tier's vdpbf16ps x_n · [wq_a | wkv]
  // (Bf16Dot::dpbf16 with the transposed copy QkvWeights::bf16_rows) where it runs.
  // Each also with the q-latent's rounding check (wq_a_norm, as the decode step runs them): qr
  // then is golden's, and so is q (its per-head RMSNorm undoes qr_scale's error).
  struct Path {
    Isa isa;
    td::cpu::Bf16Dot bf16;
    std::string name;
    bool checked = false;
  };
  std::vector<Path> paths;
  for (Isa isa : td::cpu::supported_isas())
    for (bool chk : {false, true})
      paths.push_back({isa, td::cpu::Bf16Dot::fma,
                       std::string(td::cpu::to_string(isa)) + (chk ? "+check" : ""), chk});
  td::QkvBf16Rows rows;
  if (td::cpu::cpu_supports(Isa::avx512)) {
    rows = td::kernels::pack_qkv_bf16_rows(c, f.wq_a.view(), f.wkv.view());
    for (bool chk : {false, true})
      paths.push_back({Isa::avx512, td::cpu::Bf16Dot::dpbf16,
                       chk ? "avx512/dpbf16+check" : "avx512/dpbf16", chk});
  }
  const td::Tensor<float, 1> norm = td::kernels::qkv_wq_a_norms(f.wq_a.view());
  const td::Tensor<float, 1> kv_norm = td::kernels::qkv_wkv_norms(f.wkv.view());
  long kv_unchecked = 0;
  // Bf16Dot::exact on every tier: golden's dots, rounded once to FP32 before the double epilogue
  // (golden normalises its unrounded double sums): within half an FP32 ulp of golden's cq.
  for (Isa isa : td::cpu::supported_isas())
    paths.push_back(
        {isa, td::cpu::Bf16Dot::exact, std::string(td::cpu::to_string(isa)) + "/exact"});
  for (const Path& path : paths) {
    const std::string& tier = path.name;
    SCOPED_TRACE(tier);
    tdtest::QkvOut o(c, f.T);
    td::ThreadPool pool(2);
    tdtest::run_qkv(
        f, o, td::cpu::Context{&pool, path.isa, path.bf16}, nullptr,
        path.bf16 == td::cpu::Bf16Dot::dpbf16 ? &rows : nullptr, 0, -1,
        path.checked ? td::ConstView<float, 1>(norm.view()) : td::ConstView<float, 1>{},
        path.checked ? td::ConstView<float, 1>(kv_norm.view()) : td::ConstView<float, 1>{});
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
    if (path.bf16 == td::cpu::Bf16Dot::exact) {  // qr_scale is FP32: printed, not a rounding
      EXPECT_LE(qr.rate(), kExactBar);
      EXPECT_LE(kv.rate(), kExactBar);
      EXPECT_LE(q.rate(), kExactBar);
    } else if (path.checked) {
      EXPECT_LE(qr.rate(), kExactBar);
      EXPECT_LE(kv.rate(), kExactBar);
      EXPECT_LE(q.rate(), kExactBar);
    } else {
      kv_unchecked += kv.diff;
      EXPECT_LE(qr.rate(), kQ8Bar);
      EXPECT_LE(kv.rate(), kBf16DotBar);
      EXPECT_LE(q.rate(), kBf16DotBar);
    }
  }
  // The kv check's zeros can fail: the same dots without it flip some kv values.
  EXPECT_GT(kv_unchecked, 0) << "the data no longer show the default dots' kv flips";
}

// Golden's normed row of token t (golden/qkv_projection.hpp's order): y[n] = acc[n] · r ·
// gamma[n], acc[n] = Σ_k x_n[t, k] · w[k, n] in double in ascending k, r = 1 / sqrt(Σ_n acc[n]² /
// N + eps) (Σ in ascending n).
void golden_normed_row(const tdtest::QkvFixture& f, td::ConstView<bf16, 2> w,
                       td::ConstView<bf16, 1> gamma, index_t t, std::vector<double>& y) {
  const index_t D = f.cfg.hidden, N = w.extent(1);
  y.assign(static_cast<std::size_t>(N), 0.0);
  for (index_t k = 0; k < D; ++k) {
    const double a = f.x_n.view()(t, k).to_float();
    for (index_t n = 0; n < N; ++n) y[std::size_t(n)] += a * double(w(k, n).to_float());
  }
  double ss = 0.0;
  for (double v : y) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / double(N) + double(f.cfg.rms_eps));
  for (index_t n = 0; n < N; ++n) y[std::size_t(n)] = y[std::size_t(n)] * r * gamma(n).to_float();
}

// The rounding checks' paths: every tier on its FMA dots, its repairs read from the weights'
// columns (no rows: AVX2-only and Intel CPUs) and from the transposed rows; and the avx512 tier's
// vdpbf16ps dots on the rows (Bf16Dot::dpbf16) where it runs.
struct CheckPath {
  Isa isa;
  td::cpu::Bf16Dot dot;
  bool rows;
  std::string name() const {
    return std::string(td::cpu::to_string(isa)) +
           (dot == td::cpu::Bf16Dot::dpbf16 ? "/dpbf16" : "") +
           (rows ? ", repairs from the rows" : ", repairs from the columns");
  }
};
std::vector<CheckPath> check_paths() {
  std::vector<CheckPath> paths;
  for (Isa isa : td::cpu::supported_isas())
    for (bool r : {false, true}) paths.push_back({isa, td::cpu::Bf16Dot::fma, r});
  if (td::cpu::cpu_supports(Isa::avx512))
    paths.push_back({Isa::avx512, td::cpu::Bf16Dot::dpbf16, true});
  return paths;
}

// The q-latent's rounding check (QkvWeights::wq_a_norm; backend/cpu/qkv_projection.hpp): qr =
// Q8(cq) against Q8 of golden's cq (the exact dots in double, their double RMS norm, one rounding
// to FP32), over 512 tokens (524288 values) on every tier, with the check (its repairs from the
// transposed rows and from wq_a's columns) and without it (the same dots). Q8 is scale-invariant,
// so the kernel's r (from its FP32 dots) leaves the decisions golden's; qr_scale (FP32, scaled by
// r) is not compared.
TEST(rounding, QLatentWithTheRoundingCheckRoundsAsTheExactValue) {
  const tdtest::QkvFixture f(td::flash_config(), 512, 29);
  const td::ModelConfig& c = f.cfg;
  const index_t QL = c.q_lora;
  std::vector<std::int8_t> exact(static_cast<std::size_t>(f.T * QL));
  {
    std::vector<double> y;
    std::vector<float> cq(static_cast<std::size_t>(QL));
    for (index_t t = 0; t < f.T; ++t) {
      golden_normed_row(f, f.wq_a.view(), f.gamma_cq.view(), t, y);
      for (index_t n = 0; n < QL; ++n) cq[std::size_t(n)] = float(y[std::size_t(n)]);
      td::quantize_q8(std::span<std::int8_t>(exact.data() + t * QL, std::size_t(QL)), cq);
    }
  }
  const td::QkvBf16Rows rows = td::kernels::pack_qkv_bf16_rows(c, f.wq_a.view(), f.wkv.view());
  const td::Tensor<float, 1> norm = td::kernels::qkv_wq_a_norms(f.wq_a.view());
  // check_paths(); unchecked: the same dots without wq_a_norm.
  // q against golden's (golden::qkv_projection, a token at a time) on the first and last token and
  // on each token whose qr the path flips without the check: with it, q must be golden's bytes
  // there (its qr is golden's, and the per-head RMSNorm undoes qr_scale's relative error, r's and
  // amax's), where without it q differs (one flipped qr value moves its token's q).
  const index_t HQ = index_t(c.n_heads) * c.head_dim;
  std::map<index_t, std::vector<std::uint16_t>> q_golden;
  const auto golden_q = [&](index_t t) -> const std::vector<std::uint16_t>& {
    auto it = q_golden.find(t);
    if (it != q_golden.end()) return it->second;
    tdtest::QkvOut g(c, 1);
    td::golden::qkv_projection(g.q.view(), g.kv.view(), g.qr.view(), g.qr_scale.view(),
                               td::ConstView<bf16, 2>(f.x_n.view()).slice(0, t, t + 1), f.weights(),
                               f.rope.view(),
                               td::ConstView<std::int32_t, 1>(f.pos.view()).slice(0, t, t + 1), c);
    EXPECT_EQ(0, std::memcmp(g.qr.data(), exact.data() + t * QL, std::size_t(QL)))
        << "golden's qr, token " << t;
    std::vector<std::uint16_t>& v = q_golden[t];
    for (index_t j = 0; j < HQ; ++j) v.push_back(g.q.data()[j].bits);
    return v;
  };
  for (const CheckPath& p : check_paths()) {
    const std::string tier = p.name();
    Rate checked, unchecked;
    std::vector<index_t> q_tokens{0, f.T - 1};
    long q_off[2] = {};  // [with]: q values of q_tokens off golden's
    for (bool with : {false, true}) {
      tdtest::QkvOut o(c, f.T);
      td::ThreadPool pool(2);
      tdtest::run_qkv(f, o, td::cpu::Context{&pool, p.isa, p.dot}, nullptr,
                      p.rows ? &rows : nullptr, 0, -1,
                      with ? td::ConstView<float, 1>(norm.view()) : td::ConstView<float, 1>{});
      Rate& r = with ? checked : unchecked;
      for (std::size_t i = 0; i < exact.size(); ++i) {
        r.add(o.qr.data()[i] != exact[i]);
        const index_t t = index_t(i) / QL;
        if (!with && o.qr.data()[i] != exact[i] &&
            std::find(q_tokens.begin(), q_tokens.end(), t) == q_tokens.end())
          q_tokens.push_back(t);
      }
      for (index_t t : q_tokens) {
        const std::vector<std::uint16_t>& g = golden_q(t);
        for (index_t j = 0; j < HQ; ++j) q_off[with] += o.q.data()[t * HQ + j].bits != g[j];
      }
    }
    report("qr, no check", tier, unchecked);
    report("qr, rounding check", tier, checked);
    std::printf(
        "  q of %zu tokens off golden's (the ends, each flipped qr's): %ld without the "
        "check, %ld with\n",
        q_tokens.size(), q_off[0], q_off[1]);
    EXPECT_EQ(checked.diff, 0) << tier;
    EXPECT_GT(unchecked.diff, 0) << tier << ": the data no longer flip a value without the check";
    EXPECT_EQ(q_off[1], 0) << tier;
    EXPECT_GT(q_off[0], 0) << tier << ": a flipped qr no longer moves its token's q";
  }
}

// The kv rounding check (QkvWeights::wkv_norm; backend/cpu/qkv_projection.hpp "check_kv"): kv
// against golden's (the exact dots in double, golden's r from them in ascending order, (d · r) ·
// gamma, the RoPE, one rounding to FP32 and then BF16) over 1024 tokens (524288 values) on every
// tier, with the check (its repairs from the transposed rows and from wkv's columns) and without
// it (the same dots). The flash q/kv shapes with 4 query heads: the kv path does not depend on
// them, and the test stays fast on the scalar tier. The sanitizer and aarch64 (qemu) passes run
// 32 tokens and assert only the zeros.
TEST(rounding, KvWithTheRoundingCheckRoundsAsTheExactValue) {
  const bool lean = std::getenv("TILEDECODE_SANITIZE_LEAN") != nullptr;
  td::ModelConfig c = td::flash_config();
  c.n_heads = 4;
  const tdtest::QkvFixture f(c, lean ? 32 : 1024, 41);
  const index_t HD = c.head_dim, NOPE = c.nope_dim();
  std::vector<std::uint16_t> exact(static_cast<std::size_t>(f.T * HD));
  {
    std::vector<double> y;
    for (index_t t = 0; t < f.T; ++t) {
      golden_normed_row(f, f.wkv.view(), f.gamma_ckv.view(), t, y);
      const index_t p = f.pos.view()(t);
      td::rope_forward_f64(y.data() + NOPE, f.rope.view().cos_row(p), f.rope.view().sin_row(p),
                           c.rope_dim);
      for (index_t n = 0; n < HD; ++n)
        exact[std::size_t(t * HD + n)] = bf16(float(y[std::size_t(n)])).bits;
    }
  }
  const td::QkvBf16Rows rows = td::kernels::pack_qkv_bf16_rows(c, f.wq_a.view(), f.wkv.view());
  const td::Tensor<float, 1> norm = td::kernels::qkv_wkv_norms(f.wkv.view());
  for (const CheckPath& p : check_paths()) {
    const std::string tier = p.name();
    Rate checked, unchecked;
    for (bool with : {false, true}) {
      tdtest::QkvOut o(c, f.T);
      td::ThreadPool pool(2);
      tdtest::run_qkv(f, o, td::cpu::Context{&pool, p.isa, p.dot}, nullptr,
                      p.rows ? &rows : nullptr, 0, -1, {},
                      with ? td::ConstView<float, 1>(norm.view()) : td::ConstView<float, 1>{});
      Rate& r = with ? checked : unchecked;
      for (std::size_t i = 0; i < exact.size(); ++i) r.add(o.kv.data()[i].bits != exact[i]);
    }
    report("kv, no check", tier, unchecked);
    report("kv, rounding check", tier, checked);
    EXPECT_EQ(checked.diff, 0) << tier;
    if (!lean) {
      EXPECT_GT(unchecked.diff, 0) << tier << ": the data no longer flip a value without the check";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The output projection's BF16 output (flash, T = 8 and 24: B = 4 at S = 2, and the avx512
// tier's blocked wo_b from 16 tokens): attn_out = bf16(scale · Σ_g adq_g · P_g) after wo_a, Q8
// per (token, group) and the exact INT8 matmul. One Q8 activation that rounds the other way
// moves every output of its token (a few percent of them across a BF16 rounding), so the rate is
// the wo_a dots' and the combine's together. Every path prints its rate against golden;
// Bf16Dot::exact (wo_a = golden's double sums, the combine golden's: exact products adq · P_g,
// double sums in ascending g) must give golden's bytes. The default paths are not asserted here:
// their rate is one flip's reach (measured, Zen 5: 0 or 660 of 32768 at T = 8 depending on
// whether an activation flips; the Q8 rate itself is Bf16RowDot's, above).
// The o-proj at flash shapes (wo_a std 0.02, o_packed N(0, 1)), T = 8 and 24, against golden's
// bytes: the default dots without the rounding check (reported; they must flip, so the zeros
// can fail), with it (wo_a_norm: 0), and Bf16Dot::exact (0).
TEST(rounding, OprojOutputRoundsAsTheExactOutput) {
  const td::ModelConfig c = td::flash_config();
  const index_t G = c.o_groups, R = c.o_lora, K = c.o_group_in(), N = c.hidden;
  namespace sy = td::decode::synthetic;
  const td::cpu::Context host{};
  td::Tensor<bf16, 3> wo_a({G, R, K});
  td::Tensor<std::int8_t, 2> wo_b({N, G * R});
  td::Tensor<float, 1> scale({N});
  sy::fill_normal(host, wo_a.flat(), sy::tensor_key(31, 0, 1), 0.0f, 0.02f);
  tdtest::Rng rng(31);
  for (auto& v : wo_b.flat()) v = std::int8_t(int(rng.uniform() * 255.0f) - 127);
  for (auto& v : scale.flat()) v = 1e-3f * (0.5f + rng.uniform());
  const td::Tensor<float, 2> norm = td::kernels::output_projection_row_norms(wo_a.view());
  enum class Path { unchecked, checked, exact };
  for (Isa isa : td::cpu::supported_isas()) {
    long unchecked_diff = 0;
    for (index_t T : {8, 24}) {
      td::Tensor<bf16, 2> o({G * T, K}), g({T, N});
      sy::fill_normal(host, o.flat(), sy::tensor_key(31, T, 3), 0.0f, 1.0f);
      td::golden::output_projection(c, g.view(), o.view(), wo_a.view(), wo_b.view(), scale.view());
      std::vector<std::byte> ws(td::kernels::output_projection_workspace_bytes(c, T));
      for (Path p : {Path::unchecked, Path::checked, Path::exact}) {
        const auto b = p == Path::exact ? td::cpu::Bf16Dot::exact : td::cpu::Bf16Dot::automatic;
        const std::string tier =
            std::string(td::cpu::to_string(isa)) + (p == Path::exact       ? "/exact"
                                                    : p == Path::unchecked ? "/no norms"
                                                                           : "");
        SCOPED_TRACE(tier + " T " + std::to_string(T));
        td::Tensor<bf16, 2> out({T, N});
        td::kernels::output_projection(
            td::cpu::Context{nullptr, isa, b}, c, out.view(), o.view(), wo_a.view(), wo_b.view(),
            scale.view(), ws, p == Path::unchecked ? td::ConstView<float, 2>{} : norm.view());
        Rate r;
        for (std::size_t i = 0; i < out.size(); ++i) r.add(out.data()[i].bits != g.data()[i].bits);
        report(T == 8 ? "attn_out BF16, T = 8" : "attn_out BF16, T = 24", tier, r);
        if (p == Path::unchecked) {
          unchecked_diff += r.diff;
        } else {
          EXPECT_EQ(r.diff, 0);
        }
      }
    }
    // Without the check the FP32 sums flip Q8 activations here (so the zeros above can fail).
    EXPECT_GT(unchecked_diff, 0) << td::cpu::to_string(isa);
  }
}

}  // namespace

// Appended section (issue 17, the compressors): its own includes and unnamed namespace.
#include <algorithm>

#include "common/random.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/golden/compressor.hpp"
#include "tiledecode/rope/rope.hpp"
#include "tiledecode/rules/compressor.hpp"

namespace {

// ---------------------------------------------------------------------------------------------
// The compressors' emitted rows (spec §6): the BF16 cmp_kv rows of the CSA and HCA compressors,
// and the indexer inner compressor's BF16 Hadamard input bf16(y), its BF16 Hadamard output and
// its INT8 index row. Against golden (pooling, norm and RoPE in double, rounded once to FP32 and
// then to BF16, as the spec's FP32 y is stored), on every tier.
//
// The steps isolate the part after the projections: every token closes a window whose candidate
// state rows are all mapped (this request's own blocks) and pre-filled, and no token writes its
// state row (state slot -1), so kernel and golden pool the same FP32 inputs and differ only by the
// pooling, the norm, the rotation and the Hadamard. Two statistics (spec §10.3): the states the
// projections produce (x_n ~ N(0, 1), wkv std 0.0245 and wgate 0.0388 over D = 4096: kv ~ N(0,
// 1.57), score ~ N(0, 2.48)), a softmax far from uniform; and the fixtures' history rows
// 0.05·randn in both halves, a nearly uniform one. The projections themselves are the row dot of
// Bf16RowDotRoundsAsTheExactDot, so a 64-wide hidden is enough here (x_n and the weights only have
// to be valid).
//
// Measured (this machine, Xeon Sapphire Rapids; scalar, avx2, avx2_vnni, avx512 identical; the
// counts are seeded):
//   * pooling in double (kernels/compressor.hpp "Pooling in double"): CSA 0 / 524288 BF16 row
//     values off, HCA 0 / 131072, inner bf16(y) 0 / 524288, inner INT8 0 / 524288 (and the FP32
//     y itself equal to golden's for all but 1 of 524288 inner values);
//   * the previous order (FP32 online softmax in chunks of 8, std::exp in FP32; the double norm
//     and RoPE kept) on the same data: CSA 25 / 524288 (4.8e-5), HCA 29 / 131072 (2.2e-4), inner
//     bf16(y) 27 / 524288 (5.2e-5), inner INT8 2 / 524288 (3.8e-6, with the FP32 Hadamard);
//   * the Hadamard z = bf16(y) · H: in double 0 / 524288 (each product is exact, and golden sums
//     in the same ascending order); the previous FP32 sum 30 / 524288 (5.7e-5).
// Bars 2e-5: zero is measured now, and the old orders' BF16 rates are 2.4–11× above the bar, so
// the old-order checks fail them (the INT8 rate is checked against kQ8Bar only: a flip needs an
// error across a 1/254-of-amax midpoint, too rare to separate the orders at this sample size).
constexpr double kPoolBar = 2e-5;
constexpr double kHadamardBar = 2e-5;

enum class CmpKind { csa, hca, inner };

// The previous pooling order (the scalar twin before the double pooling), for the old-order
// recomputation: FP32 online softmax over chunks of 8 candidates.
float old_pool(const std::vector<float>& kv, const std::vector<float>& sc) {
  float m = td::kNegBig, l = 0.0f, acc = 0.0f;
  const int n = int(kv.size());
  for (int j0 = 0; j0 < n; j0 += 8) {
    const int j1 = std::min(n, j0 + 8);
    float m_new = m;
    for (int j = j0; j < j1; ++j) m_new = std::max(m_new, sc[std::size_t(j)]);
    const float alpha = std::exp(m - m_new);
    l *= alpha;
    acc *= alpha;
    for (int j = j0; j < j1; ++j) {
      const float p = std::exp(sc[std::size_t(j)] - m_new);
      l += p;
      acc += p * kv[std::size_t(j)];
    }
    m = m_new;
  }
  return acc / l;
}

struct CmpRates {
  Rate row_bf16, y_fp32, q8, scale;
};

// One pooling-only step of `B` requests (one token each) of compressor `kind` at state statistics
// (kv_std, score_std); adds every tier's rates against golden to `tiers` and the previous order's
// to `old`, and appends golden's bf16(y) rows (inner) to `y_rows`.
// The compressors' paths: every tier with Bf16Dot::fma (one order, the same bits), and the
// avx512 tier's vdpbf16ps projections (Bf16Dot::dpbf16, another summation order) where it runs.
struct CmpPath {
  td::cpu::Isa isa;
  td::cpu::Bf16Dot bf16;
  std::string name;
};
std::vector<CmpPath> cmp_paths() {
  std::vector<CmpPath> v;
  for (Isa isa : td::cpu::supported_isas())
    v.push_back({isa, td::cpu::Bf16Dot::fma, std::string(td::cpu::to_string(isa))});
  if (td::cpu::cpu_supports(Isa::avx512))
    v.push_back({Isa::avx512, td::cpu::Bf16Dot::dpbf16, "avx512/dpbf16"});
  return v;
}

td::kernels::CompressorSpec cmp_spec(CmpKind kind, const td::ModelConfig& cfg) {
  namespace tk = td::kernels;
  return kind == CmpKind::csa   ? tk::csa_compressor_spec(cfg)
         : kind == CmpKind::hca ? tk::hca_compressor_spec(cfg)
                                : tk::indexer_compressor_spec(cfg);
}

// One compressor step's outputs for B requests (kv_out per request; cmp / idx / scale indexed by
// the cmp slot b), and the step on golden or on a kernel path: the inner compressor (INT8 rows
// through the Hadamard) or a main one (BF16 rows).
struct CmpOut {
  td::Tensor<bf16, 2> cmp;
  td::Tensor<std::int8_t, 2> idx;
  td::Tensor<float, 1> scale;
  td::Tensor<float, 2> kv_out;
  CmpOut(index_t B, index_t HD) : cmp({B, HD}), idx({B, HD}), scale({B}), kv_out({B, HD}) {}
};

struct CmpStepInputs {
  const td::ModelConfig& cfg;
  const td::kernels::CompressorSpec& spec;
  const td::kernels::CompressorWeights& w;
  td::ConstView<bf16, 2> hadamard;
  const td::RopeTableView& rope;
  bool inner;
};

void golden_cmp_step(const CmpStepInputs& in, td::View<float, 2> state, CmpOut& o,
                     td::ConstView<bf16, 2> x_n, const td::kernels::CompressorMetadata& meta) {
  if (in.inner) {
    td::golden::indexer_compressor_step(in.cfg, state, o.idx.view(), o.scale.view(),
                                        o.kv_out.view(), x_n, in.w, in.hadamard, meta, in.rope);
  } else {
    td::golden::compressor_step(in.cfg, in.spec, state, o.cmp.view(), o.kv_out.view(), x_n, in.w,
                                meta, in.rope);
  }
}

void kernel_cmp_step(const td::cpu::Context& ctx, const CmpStepInputs& in, td::View<float, 2> state,
                     CmpOut& o, td::ConstView<bf16, 2> x_n,
                     const td::kernels::CompressorMetadata& meta, td::View<float, 1> ws) {
  if (in.inner) {
    td::kernels::indexer_compressor_step(ctx, in.cfg, state, o.idx.view(), o.scale.view(),
                                         o.kv_out.view(), x_n, in.w, in.hadamard, meta, in.rope,
                                         ws);
  } else {
    td::kernels::compressor_step(ctx, in.cfg, in.spec, state, o.cmp.view(), o.kv_out.view(), x_n,
                                 in.w, meta, in.rope, ws);
  }
}

void compressor_rate_step(CmpKind kind, index_t B, float kv_std, float score_std,
                          std::uint64_t seed, std::vector<CmpRates>& tiers, CmpRates& old,
                          std::vector<float>& y_rows) {
  namespace tk = td::kernels;
  td::ModelConfig cfg = td::flash_config();
  cfg.hidden = 64;  // the projections do not reach the pooled rows here (state slots -1)
  const tk::CompressorSpec spec = cmp_spec(kind, cfg);
  const bool inner = kind == CmpKind::inner;
  const index_t R = spec.ratio, HD = spec.head_dim, OUT = spec.out_dim(), SW = spec.state_width();
  const index_t page = tk::compressor_state_page(cfg, spec), D = cfg.hidden;
  const index_t cols = cfg.max_seq_len / page;
  tdtest::Rng rng(seed);
  static const td::RopeTable rope = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);

  // Request b closes window c_b (1 <= c_b < max_seq_len / R): its candidate pages map to its own
  // blocks, every other table entry is unmapped.
  const td::paged::StepShape shape{int(B), 1, -1};
  td::Tensor<std::int32_t, 1> positions({B});
  td::Tensor<std::int32_t, 2> table({B, cols});
  td::Tensor<std::int64_t, 1> state_slots({B}), cmp_slots({B});
  for (auto& v : table.flat()) v = -1;
  std::int32_t blocks = 0;
  for (index_t b = 0; b < B; ++b) {
    const index_t c = 1 + index_t(rng.uniform() * float(cfg.max_seq_len / R - 2));
    positions.view()(b) = std::int32_t(c * R + R - 1);
    const index_t first = td::rules::compressor_first_position(int(R), spec.overlap, c);
    for (index_t col = first / page; col <= (c * R + R - 1) / page; ++col)
      table.view()(b, col) = blocks++;
    state_slots.view()(b) = -1;
    cmp_slots.view()(b) = b;
  }
  td::Tensor<float, 2> state({index_t(blocks) * page, SW});
  for (index_t r = 0; r < state.extent(0); ++r)
    for (index_t i = 0; i < SW; ++i)
      state.view()(r, i) = (i < OUT ? kv_std : score_std) * rng.normal();
  td::Tensor<bf16, 2> x_n({B, D}), wkv({OUT, D}), wgate({OUT, D});
  td::Tensor<float, 2> ape({R, OUT});
  td::Tensor<bf16, 1> norm_w({HD});
  rng.fill_normal(x_n.flat());
  rng.fill_normal(wkv.flat(), 0.03f);
  rng.fill_normal(wgate.flat(), 0.04f);
  rng.fill_normal(ape.flat(), 0.12f);
  for (auto& v : norm_w.flat())
    v = bf16(inner ? 0.685f + 0.26f * rng.normal() : 0.9666f + 0.19f * rng.normal());
  const td::Tensor<bf16, 2> hadamard = td::make_hadamard_bf16(128);
  const tk::CompressorWeights w{wkv.view(), wgate.view(), ape.view(), norm_w.view()};
  const tk::CompressorMetadata meta{shape, positions.view(), state_slots.view(), cmp_slots.view(),
                                    table.view()};
  const td::RopeTableView rv = rope.view();
  const CmpStepInputs in{cfg, spec, w, hadamard.view(), rv, inner};

  CmpOut g(B, HD);
  golden_cmp_step(in, state.view(), g, x_n.view(), meta);
  if (inner)
    for (float v : g.kv_out.flat()) y_rows.push_back(td::round_bf16(v));

  // The previous order on the same state rows, then the current double norm and RoPE.
  {
    td::rules::PoolCandidate cand[2 * 128];
    std::vector<float> kv, sc, yf(static_cast<std::size_t>(HD)), z(static_cast<std::size_t>(HD));
    std::vector<double> pooled(static_cast<std::size_t>(HD));
    for (index_t b = 0; b < B; ++b) {
      const index_t c = positions.view()(b) / R;
      const int n = td::rules::compressor_candidates(int(R), spec.overlap, c, cand);
      for (index_t d = 0; d < HD; ++d) {
        kv.clear();
        sc.clear();
        for (int j = 0; j < n; ++j) {
          const std::int64_t row = td::rules::slot_of(table.view(), b, cand[j].pos, page);
          const index_t off = cand[j].half ? HD : 0;
          kv.push_back(state.view()(row, off + d));
          sc.push_back(state.view()(row, OUT + off + d));
        }
        pooled[std::size_t(d)] = double(old_pool(kv, sc));
      }
      double ss = 0.0;
      for (double p : pooled) ss += p * p;
      const double r = 1.0 / std::sqrt(ss / double(HD) + double(cfg.rms_eps));
      std::vector<double> y(static_cast<std::size_t>(HD));
      for (index_t i = 0; i < HD; ++i)
        y[std::size_t(i)] = pooled[std::size_t(i)] * r * double(norm_w.view()(i).to_float());
      const index_t rp = c * R, nope = HD - td::kRopeDim;
      td::rope_forward_f64(y.data() + nope, rope.view().cos_row(rp), rope.view().sin_row(rp),
                           td::kRopeDim);
      for (index_t i = 0; i < HD; ++i) yf[std::size_t(i)] = float(y[std::size_t(i)]);
      for (index_t i = 0; i < HD; ++i) {
        const float gy = g.kv_out.view()(b, i);
        old.y_fp32.add(yf[std::size_t(i)] != gy);
        old.row_bf16.add(inner ? td::round_bf16(yf[std::size_t(i)]) != td::round_bf16(gy)
                               : bf16(yf[std::size_t(i)]).bits != g.cmp.view()(b, i).bits);
      }
      if (inner) {  // the rest of the emit as the kernel does it (FP32 Hadamard, the old order)
        for (index_t j = 0; j < HD; ++j) {
          float a = 0.0f;
          for (index_t i = 0; i < HD; ++i)
            a += td::round_bf16(yf[std::size_t(i)]) * hadamard.view()(i, j).to_float();
          z[std::size_t(j)] = td::round_bf16(a);
        }
        const auto q = q8(z.data(), HD);
        for (index_t j = 0; j < HD; ++j) old.q8.add(q[std::size_t(j)] != g.idx.view()(b, j));
      }
    }
  }

  const auto paths = cmp_paths();
  tiers.resize(paths.size());
  td::ThreadPool pool(2);
  for (std::size_t k = 0; k < paths.size(); ++k) {
    const td::cpu::Context ctx{&pool, paths[k].isa, paths[k].bf16};
    CmpOut o(B, HD);
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg, spec, B)});
    kernel_cmp_step(ctx, in, state.view(), o, x_n.view(), meta, ws.view());
    CmpRates& t = tiers[k];
    for (std::size_t i = 0; i < o.kv_out.size(); ++i) {
      const float a = o.kv_out.data()[i], e = g.kv_out.data()[i];
      t.y_fp32.add(a != e);
      t.row_bf16.add(inner ? td::round_bf16(a) != td::round_bf16(e)
                           : o.cmp.data()[i].bits != g.cmp.data()[i].bits);
    }
    if (inner) {
      for (std::size_t i = 0; i < o.idx.size(); ++i) t.q8.add(o.idx.data()[i] != g.idx.data()[i]);
      for (std::size_t i = 0; i < o.scale.size(); ++i)
        t.scale.add(o.scale.data()[i] != g.scale.data()[i]);
    }
  }
}

void compressor_rate_test(CmpKind kind, index_t B, int steps, const char* name) {
  const auto paths = cmp_paths();
  std::vector<CmpRates> tiers;
  CmpRates old;
  std::vector<float> y_rows;
  for (int s = 0; s < steps; ++s) {
    const bool projected = s % 2 == 0;  // the projections' statistics, then the fixtures'
    compressor_rate_step(kind, B, projected ? 1.57f : 0.05f, projected ? 2.48f : 0.05f,
                         1700 + std::uint64_t(s) + 100 * std::uint64_t(kind), tiers, old, y_rows);
  }
  const bool inner = kind == CmpKind::inner;
  const std::string w(name);
  report((w + (inner ? " bf16(y) (old order)" : " BF16 row (old order)")).c_str(), "-",
         old.row_bf16);
  report((w + " FP32 y off (old order)").c_str(), "-", old.y_fp32);
  if (inner) report((w + " INT8 (old order)").c_str(), "-", old.q8);
  EXPECT_GT(old.row_bf16.rate(), kPoolBar) << "the measurement no longer sees the old order";
  for (std::size_t k = 0; k < paths.size(); ++k) {
    const std::string tier = paths[k].name;
    SCOPED_TRACE(tier);
    const CmpRates& t = tiers[k];
    report((w + (inner ? " bf16(y)" : " BF16 row")).c_str(), tier, t.row_bf16);
    report((w + " FP32 y not correctly rounded").c_str(), tier, t.y_fp32);
    EXPECT_LE(t.row_bf16.rate(), kPoolBar);
    if (inner) {
      report((w + " INT8").c_str(), tier, t.q8);
      report((w + " INT8 scale").c_str(), tier, t.scale);
      EXPECT_LE(t.q8.rate(), kQ8Bar);
      EXPECT_LE(t.scale.rate(), kQ8Bar);
    }
  }
}

TEST(rounding, CsaCompressorRowsRoundAsTheExactRows) {
  compressor_rate_test(CmpKind::csa, 256, 4, "CSA cmp_kv");
}

TEST(rounding, HcaCompressorRowsRoundAsTheExactRows) {
  compressor_rate_test(CmpKind::hca, 64, 4, "HCA cmp_kv");
}

TEST(rounding, IndexerCompressorRowsRoundAsTheExactRows) {
  compressor_rate_test(CmpKind::inner, 1024, 4, "inner");
}

// The Hadamard of the inner compressor on its own: z = y · H for BF16 rows y at the emitted
// statistics (y ~ N(0, 1) · norm_w, norm_w ~ 0.685 ± 0.26, spec §10.3) and two matrices (the
// fixture's Sylvester H / sqrt(128) in BF16 and the standalone tests' rand / sqrt(128)), each
// tier's kernel (avx2::compressor_hadamard_row on every AVX2 tier, the scalar twin otherwise)
// against the exact sum rounded once, BF16 of both compared (z is rounded to BF16 before its Q8).
TEST(rounding, IndexerHadamardRoundsAsTheExactProduct) {
  constexpr index_t N = 128, rows = 2048;
  tdtest::Rng rng(1717);
  std::vector<float> y(static_cast<std::size_t>(rows * N));
  for (auto& v : y) v = td::round_bf16(rng.normal() * (0.685f + 0.26f * rng.normal()));
  td::Tensor<bf16, 2> rnd({N, N});
  for (auto& v : rnd.flat()) v = bf16(rng.uniform() / std::sqrt(128.0f));
  const td::Tensor<bf16, 2> syl = td::make_hadamard_bf16(N);
  const auto isas = td::cpu::supported_isas();
  std::vector<Rate> tiers(isas.size());
  Rate old;
  std::vector<float> z(static_cast<std::size_t>(N));
  const td::Tensor<bf16, 2>* mats[] = {&syl, &rnd};
  for (const td::Tensor<bf16, 2>* h : mats) {
    for (index_t r = 0; r < rows; ++r) {
      const float* yr = y.data() + r * N;
      std::vector<float> exact(static_cast<std::size_t>(N)), prev(static_cast<std::size_t>(N));
      for (index_t j = 0; j < N; ++j) {
        double a = 0.0;
        float f = 0.0f;  // the previous order: one FP32 sum in ascending i
        for (index_t i = 0; i < N; ++i) {
          a += double(yr[i]) * double(h->view()(i, j).to_float());
          f += yr[i] * h->view()(i, j).to_float();
        }
        exact[std::size_t(j)] = float(a);
        prev[std::size_t(j)] = f;
      }
      add_bf16(old, prev, exact);
      for (std::size_t k = 0; k < isas.size(); ++k) {
#if TILEDECODE_X86
        if (td::cpu::has_avx2(isas[k])) {
          td::cpu::avx2::compressor_hadamard_row(z.data(), yr, h->data(), N, N);
        } else
#endif
        {
          td::kernels::detail::hadamard_row_scalar(z.data(), yr, h->data(), N, N);
        }
        add_bf16(tiers[k], z, exact);
      }
    }
  }
  report("inner Hadamard z BF16 (old order)", "-", old);
  EXPECT_GT(old.rate(), kHadamardBar) << "the measurement no longer sees the old order's error";
  for (std::size_t k = 0; k < isas.size(); ++k) {
    const std::string tier(td::cpu::to_string(isas[k]));
    SCOPED_TRACE(tier);
    report("inner Hadamard z BF16", tier, tiers[k]);
    EXPECT_LE(tiers[k].rate(), kHadamardBar);
  }
}

}  // namespace

// Appended section (issue 17, the compressors end to end): the projections feed the pooling.
#include <cstdlib>
#include <limits>

namespace {

// ---------------------------------------------------------------------------------------------
// The compressors' emitted rows with their projections in the loop: the tests above pool given
// state rows, so they see the pooling's error alone; here every candidate state row is written by
// the step itself from x_n · wkv / wgate at the flash shapes (D = 4096), so the rows also carry
// the long dots' error (Bf16RowDotRoundsAsTheExactDot), as in a served step. Request b closes
// window c_b, and its L candidate positions (CSA and inner: 2 × 4, HCA: 128) are projected by
// L / 8 steps of S = 8 tokens (MTP's largest S), the last token emitting the row; kernel and
// golden each run their own state pool. A control: golden's pooling of the same windows with the
// state rows projected in the previous order (8 FP32 lanes over the whole row, as in
// Bf16RowDotRoundsAsTheExactDot), which the bar must reject.
//
// What is asserted: the error level, Σ |y - y_gold| / ulp_bf16(rms of y_gold's row) / n, the
// mean error in BF16 ulps at the row's scale. The flip counts (BF16 values, inner INT8 values
// that differ from golden's) are printed, not asserted: at these sample sizes they are a few
// events, and a per-value estimate in ulps of each value (|δ| / ulp_bf16(y)) is as noisy, its
// sum dominated by the few values near zero (seeds 1-6 moved it 2-4x). An inner INT8 flip
// follows a bf16(y) flip (one flipped y element moves every z of its row through the
// Hadamard), so it is no separate property here; the pooling-only test above holds it to 0.
//
// Measured (AMD EPYC Zen 5; the scalar, avx2, avx2_vnni and avx512 Bf16Dot::fma paths are
// bit-identical, so one figure), error level over the committed seed and 8 others (seed + 1..8):
//   quantity              fma paths             avx512/dpbf16         old dots (control)
//   CSA cmp_kv            2.32e-5 (1.55-2.41)   1.76e-5 (1.16-1.79)   4.94e-5 (3.26-4.99)
//   HCA cmp_kv            2.45e-5 (2.17-3.26)   1.89e-5 (1.72-2.69)   5.38e-5 (4.76-7.16)
//   inner bf16(y)         1.65e-5 (1.65-1.80)   1.26e-5 (1.22-1.36)   3.46e-5 (3.45-3.78)
//   state kv (the dots)   1.16-1.17e-5          8.1e-6                -
// (committed seed, and the range over the 9 seeds, all ×1e-5 in brackets). Flip counts at the
// committed seed: CSA 1 / 8192 (fma), 0 (dpbf16), 3 (control); HCA 1 / 2048, 0, 0; inner 1 / 8192,
// 2, 2; inner INT8 0 everywhere (3 / 8192 on every path, control included, at seed + 7). The rows
// carry more than their dots: the pooled mean is smaller than the candidates' kv while their
// errors (and the scores', through the softmax weights) do not shrink with it, and the RMS norm
// scales the row back up. Bars per compressor, between the largest path and the smallest control
// over the 9 seeds: CSA 2.8e-5, HCA 4e-5, inner 2.5e-5. This is not the "near zero": that
// needs exact long dots (kBf16DotBar's note at the top). The dpbf16 column is the previous
// vdpbf16ps order (16 lanes of 64 products per 1024-k block); the order of bf16_rows_avx512.hpp
// since (an FP32 lane per 64-k block) measures, at the committed seed, CSA 1.76e-5, HCA 1.99e-5,
// inner 1.26e-5, state kv 8.1e-6.

double ulp_bf16(float v) {
  const float a = std::fabs(v);
  if (!(a > 0.0f) || !std::isfinite(a)) return 0.0;
  int e = 0;
  std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1): the BF16 ulp is 2^(e - 8)
  return std::ldexp(1.0, e - 8);
}

struct E2eRate {
  Rate bf16;         // BF16 row values (inner: bf16(y)) off golden's
  Rate q8;           // inner: INT8 index values off golden's
  double sum = 0.0;  // sum of |y - y_gold| / ulp_bf16(rms of y_gold's row)
  long n = 0;
  // One row: its values' errors in BF16 ulps at the row's RMS.
  void add_row(const float* got, const float* gold, index_t len) {
    double ss = 0.0;
    for (index_t i = 0; i < len; ++i) ss += double(gold[i]) * double(gold[i]);
    const double u = ulp_bf16(float(std::sqrt(ss / double(len))));
    for (index_t i = 0; i < len; ++i)
      sum += u > 0.0 ? std::fabs(double(got[i]) - double(gold[i])) / u : 0.0;
    n += long(len);
  }
  double level() const { return n ? sum / double(n) : 0.0; }
};

void report_e2e(const std::string& what, const std::string& tier, const E2eRate& r, bool q8) {
  std::printf("  %-44s %-16s %4ld / %6ld = %.2e, error level %.2e", what.c_str(), tier.c_str(),
              r.bf16.diff, r.bf16.n, r.bf16.rate(), r.level());
  if (q8) std::printf(", INT8 %ld / %ld", r.q8.diff, r.q8.n);
  std::printf("\n");
  testing::Test::RecordProperty(what + " " + tier + " error level", std::to_string(r.level()));
}

// One compressor at flash shapes (its geometry) and its weights at the projections' statistics
// (§10.3: kv ~ N(0, 1.57), score ~ N(0, 2.48)), drawn by fill (and x_n ~ N(0, 1) where given, in
// the draw order the tests' data were measured with).
struct CmpSetup {
  td::ModelConfig cfg = td::flash_config();
  td::kernels::CompressorSpec spec;
  bool inner;
  index_t R, HD, OUT, SW, page, D, cols;
  td::Tensor<bf16, 2> wkv, wgate, hadamard = td::make_hadamard_bf16(128);
  td::Tensor<float, 2> ape;
  td::Tensor<bf16, 1> norm_w;
  explicit CmpSetup(CmpKind kind)
      : spec(cmp_spec(kind, cfg)),
        inner(kind == CmpKind::inner),
        R(spec.ratio),
        HD(spec.head_dim),
        OUT(spec.out_dim()),
        SW(spec.state_width()),
        page(td::kernels::compressor_state_page(cfg, spec)),
        D(cfg.hidden),
        cols(cfg.max_seq_len / page),
        wkv({OUT, D}),
        wgate({OUT, D}),
        ape({R, OUT}),
        norm_w({HD}) {}
  void fill(tdtest::Rng& rng, td::Tensor<bf16, 2>* x_n = nullptr) {
    rng.fill_normal(wkv.flat(), 1.57f / 64.0f);
    rng.fill_normal(wgate.flat(), 2.48f / 64.0f);
    rng.fill_normal(ape.flat(), 0.12f);
    if (x_n) rng.fill_normal(x_n->flat());
    for (auto& v : norm_w.flat())
      v = bf16(inner ? 0.685f + 0.26f * rng.normal() : 0.9666f + 0.19f * rng.normal());
  }
  td::kernels::CompressorWeights weights() const {
    return {wkv.view(), wgate.view(), ape.view(), norm_w.view()};
  }
};

void compressor_e2e_test(CmpKind kind, index_t B, std::uint64_t seed, double bar,
                         const char* name) {
  // Golden's D = 4096 double dots take 25-50 s per test under ASan + checked views; the same
  // kernels run there in test_compressor and in the pooling-only rounding tests above.
  if (std::getenv("TILEDECODE_SANITIZE_LEAN") != nullptr)
    GTEST_SKIP() << "skipped in the sanitizer pass (TILEDECODE_SANITIZE_LEAN)";
  namespace tk = td::kernels;
  CmpSetup cs(kind);
  const td::ModelConfig& cfg = cs.cfg;
  const tk::CompressorSpec& spec = cs.spec;
  const bool inner = cs.inner;
  const index_t R = cs.R, OUT = cs.OUT, page = cs.page, D = cs.D;
  constexpr index_t S = 8;
  const index_t L = spec.overlap ? 2 * R : R, steps = L / S;
  tdtest::Rng rng(seed);
  static const td::RopeTable rope = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);

  std::vector<index_t> first(static_cast<std::size_t>(B)), last(static_cast<std::size_t>(B));
  td::Tensor<std::int32_t, 2> table({B, cs.cols});
  for (auto& v : table.flat()) v = -1;
  std::int32_t blocks = 0;
  for (index_t b = 0; b < B; ++b) {
    const index_t c = 1 + index_t(rng.uniform() * float(cfg.max_seq_len / R - 2));
    first[std::size_t(b)] = td::rules::compressor_first_position(int(R), spec.overlap, c);
    last[std::size_t(b)] = c * R + R - 1;
    ASSERT_EQ(last[std::size_t(b)] - first[std::size_t(b)] + 1, L);
    for (index_t col = first[std::size_t(b)] / page; col <= last[std::size_t(b)] / page; ++col)
      table.view()(b, col) = blocks++;
  }
  cs.fill(rng);
  const tk::CompressorWeights w = cs.weights();

  // Step j: token s of request b at position first_b + 8j + s; x_n rows ~ N(0, 1).
  struct Step {
    td::Tensor<std::int32_t, 1> pos;
    td::Tensor<std::int64_t, 1> state_slots, cmp_slots;
    td::Tensor<bf16, 2> x_n;
  };
  std::vector<Step> st;
  for (index_t j = 0; j < steps; ++j) {
    Step s{td::Tensor<std::int32_t, 1>({B * S}), td::Tensor<std::int64_t, 1>({B * S}),
           td::Tensor<std::int64_t, 1>({B * S}), td::Tensor<bf16, 2>({B * S, D})};
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < S; ++i) {
        const index_t t = b * S + i, p = first[std::size_t(b)] + j * S + i;
        s.pos.view()(t) = std::int32_t(p);
        s.state_slots.view()(t) = std::int64_t(table.view()(b, p / page)) * page + p % page;
        s.cmp_slots.view()(t) = p == last[std::size_t(b)] ? b : -1;
      }
    rng.fill_normal(s.x_n.flat());
    st.push_back(std::move(s));
  }
  const td::paged::StepShape shape{int(B), int(S), -1};
  const auto meta = [&](const Step& s) {
    return tk::CompressorMetadata{shape, s.pos.view(), s.state_slots.view(), s.cmp_slots.view(),
                                  table.view()};
  };
  // A run's state pool and outputs.
  struct Out {
    td::Tensor<float, 2> state;
    CmpOut out;
  };
  const auto fresh = [&] {
    return Out{td::Tensor<float, 2>({index_t(blocks) * page, cs.SW}), {B, cs.HD}};
  };
  const td::RopeTableView rv = rope.view();
  const CmpStepInputs in{cfg, spec, w, cs.hadamard.view(), rv, inner};
  Out g = fresh();
  for (const Step& s : st) golden_cmp_step(in, g.state.view(), g.out, s.x_n.view(), meta(s));

  const auto add_rows = [&](E2eRate& r, const CmpOut& o) {
    const CmpOut& e = g.out;
    for (std::size_t i = 0; i < o.kv_out.size(); ++i) {
      r.bf16.add(inner ? td::round_bf16(o.kv_out.data()[i]) != td::round_bf16(e.kv_out.data()[i])
                       : o.cmp.data()[i].bits != e.cmp.data()[i].bits);
    }
    for (index_t b = 0; b < B; ++b)
      r.add_row(&o.kv_out.view()(b, 0), &e.kv_out.view()(b, 0), cs.HD);
    if (inner) {
      for (std::size_t i = 0; i < o.idx.size(); ++i) r.q8.add(o.idx.data()[i] != e.idx.data()[i]);
    }
  };

  // The control: golden's state rows with the projections in the previous order, then golden's
  // pooling of the last token alone (state slot -1: nothing is written over them).
  E2eRate old;
  {
    Out o = fresh();
    // NaN everywhere first: a candidate row the loop below misses would show as NaN rows.
    std::fill(o.state.flat().begin(), o.state.flat().end(),
              std::numeric_limits<float>::quiet_NaN());
    std::vector<float> wk(static_cast<std::size_t>(OUT * D)), wg(wk.size()),
        x(static_cast<std::size_t>(D));
    for (std::size_t i = 0; i < wk.size(); ++i) {
      wk[i] = cs.wkv.flat()[i].to_float();
      wg[i] = cs.wgate.flat()[i].to_float();
    }
    for (const Step& s : st)
      for (index_t t = 0; t < B * S; ++t) {
        for (index_t k = 0; k < D; ++k) x[std::size_t(k)] = s.x_n.view()(t, k).to_float();
        const index_t slot = index_t(s.state_slots.view()(t)), p = s.pos.view()(t);
        for (index_t n = 0; n < OUT; ++n) {
          o.state.view()(slot, n) = old_order_dot(x.data(), wk.data() + n * D, D);
          o.state.view()(slot, OUT + n) =
              old_order_dot(x.data(), wg.data() + n * D, D) + cs.ape.view()(p % R, n);
        }
      }
    Step last_tok{td::Tensor<std::int32_t, 1>({B}), td::Tensor<std::int64_t, 1>({B}),
                  td::Tensor<std::int64_t, 1>({B}), td::Tensor<bf16, 2>({B, D})};
    for (index_t b = 0; b < B; ++b) {
      last_tok.pos.view()(b) = std::int32_t(last[std::size_t(b)]);
      last_tok.state_slots.view()(b) = -1;
      last_tok.cmp_slots.view()(b) = b;
    }
    const tk::CompressorMetadata m1{td::paged::StepShape{int(B), 1, -1}, last_tok.pos.view(),
                                    last_tok.state_slots.view(), last_tok.cmp_slots.view(),
                                    table.view()};
    golden_cmp_step(in, o.state.view(), o.out, last_tok.x_n.view(), m1);
    add_rows(old, o.out);
  }
  const std::string what(name);
  report_e2e(what + (inner ? " bf16(y) (old dots)" : " BF16 row (old dots)"), "-", old, inner);
  EXPECT_GT(old.level(), bar) << "the measurement no longer sees the old order's error";

  auto paths = cmp_paths();
  for (Isa isa : td::cpu::supported_isas())  // golden's dots (bf16_exact.hpp)
    paths.push_back(
        {isa, td::cpu::Bf16Dot::exact, std::string(td::cpu::to_string(isa)) + "/exact"});
  td::ThreadPool pool(2);
  for (const CmpPath& path : paths) {
    SCOPED_TRACE(path.name);
    const td::cpu::Context ctx{&pool, path.isa, path.bf16};
    Out o = fresh();
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg, spec, B * S)});
    for (const Step& s : st)
      kernel_cmp_step(ctx, in, o.state.view(), o.out, s.x_n.view(), meta(s), ws.view());
    E2eRate rows, state;
    add_rows(rows, o.out);
    for (index_t r = 0; r < o.state.extent(0); ++r) {
      for (index_t n = 0; n < OUT; ++n) {
        const float a = o.state.view()(r, n), e = g.state.view()(r, n);
        state.bf16.add(td::round_bf16(a) != td::round_bf16(e));
      }
      state.add_row(&o.state.view()(r, 0), &g.state.view()(r, 0), OUT);
    }
    report_e2e(what + " state kv BF16 (the dots)", path.name, state, false);
    report_e2e(what + (inner ? " bf16(y)" : " BF16 row"), path.name, rows, inner);
    if (path.bf16 == td::cpu::Bf16Dot::exact) {
      EXPECT_EQ(state.sum, 0.0) << "the exact dots are golden's, bit for bit";
      EXPECT_EQ(rows.sum, 0.0) << "every emitted FP32 y is golden's";
      EXPECT_EQ(rows.bf16.diff, 0);
      EXPECT_EQ(rows.q8.diff, 0);
    } else {
      EXPECT_LE(rows.level(), bar);
    }
  }
}

TEST(rounding, CsaCompressorRowsWithProjectionsRoundAsTheExactRows) {
  compressor_e2e_test(CmpKind::csa, 16, 1901, 2.8e-5, "CSA cmp_kv e2e");
}

TEST(rounding, HcaCompressorRowsWithProjectionsRoundAsTheExactRows) {
  compressor_e2e_test(CmpKind::hca, 4, 1902, 4e-5, "HCA cmp_kv e2e");
}

TEST(rounding, IndexerCompressorRowsWithProjectionsRoundAsTheExactRows) {
  compressor_e2e_test(CmpKind::inner, 64, 1903, 2.5e-5, "inner e2e");
}

}  // namespace

// The compressors' rounding check (CompressorWeights::row_norms; backend/cpu/compressor.hpp
// "Rounding check"), from each step's inputs: golden and the kernel start from the same state pool
// (every candidate row of a window that the step does not write is already there, at the
// projections' statistics), the step writes the last S positions of every request's window and
// closes it. Golden's emitted rows are then the exact rounding of the step (its state values are
// the exact dots rounded to FP32), which is what the reference compares on each dump.
// With the check every path emits golden's bytes; without it the same data differ (the count is
// asserted too, so the zero can fail). Norms of +Inf list every value: every written candidate is
// recomputed, so its state values are golden's bits as well.
struct CmpCheckCounts {
  long rows = 0;   // emitted BF16 values (main) / bf16(y) values (inner) that differ from golden's
  long idx = 0;    // inner: INT8 index values that differ
  long state = 0;  // written state values that differ from golden's
};

// dominant >= 0: channel `dominant` decides the RMS factor r. Its wkv rows are 64 times the others
// (each half's), and the rows the step does not write hold +0 kv and a score of -1e4 there (a
// softmax weight of 0), so its pooled value is the written candidates' alone and about 0.9 of
// Σ pooled²: the FP32 error of its two dots moves r, hence every value of the row, by their
// relative error. The roundings that r alone flips (the unchecked path's values of that channel
// in golden's pool otherwise, golden's pooling) are counted and must be there; golden's r needs
// that channel, which only the repairs for ρ (the rounds by share, or every channel) give it.
void compressor_check_test(CmpKind kind, index_t B, index_t S, std::uint64_t seed, const char* name,
                           index_t dominant = -1) {
  // The sanitizer pass runs the check on B / 16 windows (golden's projections take seconds there);
  // too few for the unchecked paths to show a flip, so only the zeros are asserted.
  const bool lean = std::getenv("TILEDECODE_SANITIZE_LEAN") != nullptr;
  if (lean) B = std::max<index_t>(B / 16, 4);
  namespace tk = td::kernels;
  CmpSetup cs(kind);
  const td::ModelConfig& cfg = cs.cfg;
  const tk::CompressorSpec& spec = cs.spec;
  const bool inner = cs.inner;
  const index_t R = cs.R, HD = cs.HD, page = cs.page;
  tdtest::Rng rng(seed);
  static const td::RopeTable rope = td::make_rope_table(cfg, td::LayerKind::csa, cfg.max_seq_len);

  td::Tensor<std::int32_t, 2> table({B, cs.cols});
  for (auto& v : table.flat()) v = -1;
  td::Tensor<std::int32_t, 1> pos({B * S});
  td::Tensor<std::int64_t, 1> state_slots({B * S}), cmp_slots({B * S});
  std::int32_t blocks = 0;
  std::vector<index_t> first(static_cast<std::size_t>(B));
  for (index_t b = 0; b < B; ++b) {
    const index_t c = 1 + index_t(rng.uniform() * float(cfg.max_seq_len / R - 2));
    first[std::size_t(b)] = td::rules::compressor_first_position(int(R), spec.overlap, c);
    const index_t last = c * R + R - 1;
    for (index_t col = first[std::size_t(b)] / page; col <= last / page; ++col)
      table.view()(b, col) = blocks++;
    for (index_t s = 0; s < S; ++s) {
      const index_t t = b * S + s, p = last - (S - 1) + s;
      pos.view()(t) = std::int32_t(p);
      state_slots.view()(t) = std::int64_t(table.view()(b, p / page)) * page + p % page;
      cmp_slots.view()(t) = p == last ? b : -1;
    }
  }
  td::Tensor<bf16, 2> x_n({B * S, cs.D});
  cs.fill(rng, &x_n);
  std::vector<index_t> dom;  // the dominant channel's columns of a state row's kv (each half)
  if (dominant >= 0) {
    for (index_t h = 0; h < cs.OUT; h += HD) dom.push_back(h + dominant);
    for (index_t n : dom)
      for (index_t k = 0; k < cs.D; ++k)
        cs.wkv.view()(n, k) = bf16(cs.wkv.view()(n, k).to_float() * 64.0f);
  }
  const td::ConstView<bf16, 2> hadamard = cs.hadamard;
  const td::Tensor<float, 1> norms = tk::compressor_row_norms(cs.wkv.view(), cs.wgate.view());
  td::Tensor<float, 1> inf_norms({2 * cs.OUT});
  for (auto& v : inf_norms.flat()) v = std::numeric_limits<float>::infinity();
  // The state pool before the step: the rows the step reads and does not write, at the
  // projections' statistics (kv, then the score).
  td::Tensor<float, 2> state0({index_t(blocks) * page, cs.SW});
  for (index_t r = 0; r < state0.extent(0); ++r)
    for (index_t n = 0; n < cs.SW; ++n)
      state0.view()(r, n) = rng.normal() * (n < cs.OUT ? 1.57f : 2.48f);
  for (index_t r = 0; r < state0.extent(0); ++r)
    for (index_t n : dom) state0.view()(r, n) = 0.0f, state0.view()(r, cs.OUT + n) = -1e4f;
  const tk::CompressorMetadata meta{td::paged::StepShape{int(B), int(S), -1}, pos.view(),
                                    state_slots.view(), cmp_slots.view(), table.view()};
  const td::RopeTableView rv = rope.view();

  const auto run_golden = [&](td::Tensor<float, 2>& st, CmpOut& o) {
    const tk::CompressorWeights w = cs.weights();
    golden_cmp_step({cfg, spec, w, hadamard, rv, inner}, st.view(), o, x_n.view(), meta);
  };
  td::Tensor<float, 2> gs = state0;
  CmpOut g(B, HD);
  run_golden(gs, g);

  const auto count = [&](const td::Tensor<float, 2>& st, const CmpOut& o) {
    CmpCheckCounts n;
    for (std::size_t i = 0; i < o.kv_out.size(); ++i)
      n.rows += inner ? td::round_bf16(o.kv_out.data()[i]) != td::round_bf16(g.kv_out.data()[i])
                      : o.cmp.data()[i].bits != g.cmp.data()[i].bits;
    if (inner) {
      for (std::size_t i = 0; i < o.idx.size(); ++i) n.idx += o.idx.data()[i] != g.idx.data()[i];
    }
    for (index_t t = 0; t < B * S; ++t) {  // the values of the half the window pools
      const index_t r = state_slots.view()(t), p = pos.view()(t);
      const index_t c = first[std::size_t(t / S)] / R + (spec.overlap ? 1 : 0);
      const index_t off = spec.overlap && p >= c * R ? HD : 0;  // the current window: the back half
      for (index_t d = 0; d < HD; ++d)
        for (index_t h : {off, cs.OUT + off}) n.state += st.view()(r, h + d) != gs.view()(r, h + d);
    }
    return n;
  };
  // Golden's pooling alone (state slot -1: nothing written) of every request's last position.
  td::Tensor<std::int32_t, 1> last_pos({B});
  td::Tensor<std::int64_t, 1> no_slot({B}), last_cmp({B});
  for (index_t b = 0; b < B; ++b) {
    last_pos.view()(b) = pos.view()((b + 1) * S - 1);
    no_slot.view()(b) = -1;
    last_cmp.view()(b) = b;
  }
  const tk::CompressorMetadata pool_only{td::paged::StepShape{int(B), 1, -1}, last_pos.view(),
                                         no_slot.view(), last_cmp.view(), table.view()};
  // The roundings r alone flips: golden's state pool with the dominant channel's written values
  // from `st`, pooled by golden; the values of the other channels that differ from golden's.
  const auto r_flips = [&](const td::Tensor<float, 2>& st) {
    td::Tensor<float, 2> mixed = gs;
    for (index_t t = 0; t < B * S; ++t)
      for (index_t n : dom)
        for (index_t h : {n, cs.OUT + n}) {
          const index_t r = state_slots.view()(t);
          mixed.view()(r, h) = st.view()(r, h);
        }
    CmpOut o(B, HD);
    golden_cmp_step({cfg, spec, cs.weights(), hadamard, rv, inner}, mixed.view(), o,
                    x_n.view().slice(0, 0, B), pool_only);
    long n = 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < HD; ++i)
        if (i != dominant)
          n += inner
                   ? td::round_bf16(o.kv_out.view()(b, i)) != td::round_bf16(g.kv_out.view()(b, i))
                   : o.cmp.view()(b, i).bits != g.cmp.view()(b, i).bits;
    return n;
  };
  std::printf("%-28s %-14s %10s %8s %10s\n", name, "path", "rows", "INT8", "state");
  long unchecked = 0, by_r = 0;
  td::ThreadPool pool(2);
  for (const CmpPath& path : cmp_paths()) {
    SCOPED_TRACE(path.name);
    const td::cpu::Context ctx{&pool, path.isa, path.bf16};
    td::Tensor<float, 1> ws({tk::compressor_workspace_size(cfg, spec, B * S)});
    for (int mode = 0; mode < 3; ++mode) {  // without norms, with them, with +Inf norms
      tk::CompressorWeights w = cs.weights();
      if (mode == 1) w.row_norms = norms.view();
      if (mode == 2) w.row_norms = inf_norms.view();
      td::Tensor<float, 2> st = state0;
      CmpOut o(B, HD);
      kernel_cmp_step(ctx, {cfg, spec, w, hadamard, rv, inner}, st.view(), o, x_n.view(), meta,
                      ws.view());
      const CmpCheckCounts n = count(st, o);
      const char* m = mode == 0 ? "" : mode == 1 ? "+check" : "+check(inf)";
      std::printf("%-28s %-14s %10ld %8ld %10ld  of %ld / %ld / %ld\n", name,
                  (path.name + m).c_str(), n.rows, n.idx, n.state, long(B * HD),
                  long(inner ? B * HD : 0), long(B * S * 2 * HD));
      if (mode == 0) {
        unchecked += n.rows;
        if (dominant >= 0) {
          const long f = r_flips(st);
          std::printf("%-28s %-14s %10ld  flipped by r alone\n", name, path.name.c_str(), f);
          by_r += f;
        }
      } else {
        EXPECT_EQ(n.rows, 0) << "with the check every emitted rounding is golden's";
        EXPECT_EQ(n.idx, 0);
      }
      if (mode == 2) {
        EXPECT_EQ(n.state, 0) << "every written candidate recomputed as golden does";
      }
      if (mode != 1) continue;
      // Thread- and batch-invariant: one thread, and the first 16 requests each alone, give the
      // same bytes (outputs and state pool).
      td::Tensor<float, 2> st1 = state0;
      CmpOut o1(B, HD);
      kernel_cmp_step(td::cpu::Context{nullptr, path.isa, path.bf16},
                      {cfg, spec, w, hadamard, rv, inner}, st1.view(), o1, x_n.view(), meta,
                      ws.view());
      EXPECT_EQ(std::memcmp(st1.data(), st.data(), st.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(o1.cmp.data(), o.cmp.data(), o.cmp.size() * sizeof(bf16)), 0);
      EXPECT_EQ(std::memcmp(o1.idx.data(), o.idx.data(), o.idx.size()), 0);
      td::Tensor<float, 2> stb = state0;
      CmpOut ob(B, HD);
      for (index_t b = 0; b < std::min<index_t>(B, 16); ++b) {
        const tk::CompressorMetadata m1{
            td::paged::StepShape{1, int(S), -1}, pos.view().slice(0, b * S, (b + 1) * S),
            state_slots.view().slice(0, b * S, (b + 1) * S),
            cmp_slots.view().slice(0, b * S, (b + 1) * S), table.view().slice(0, b, b + 1)};
        td::Tensor<float, 1> ws1({tk::compressor_workspace_size(cfg, spec, S)});
        const td::ConstView<bf16, 2> x1 = x_n.view().slice(0, b * S, (b + 1) * S);
        if (inner) {
          tk::indexer_compressor_step(ctx, cfg, stb.view(), ob.idx.view(), ob.scale.view(), {}, x1,
                                      w, hadamard, m1, rv, ws1.view());
        } else {
          tk::compressor_step(ctx, cfg, spec, stb.view(), ob.cmp.view(), {}, x1, w, m1, rv,
                              ws1.view());
        }
        for (index_t d = 0; d < HD; ++d) {
          EXPECT_EQ(inner ? ob.idx.view()(b, d) : ob.cmp.view()(b, d).bits,
                    inner ? o.idx.view()(b, d) : o.cmp.view()(b, d).bits);
        }
        for (index_t t = b * S; t < (b + 1) * S; ++t) {
          const index_t r = state_slots.view()(t);
          EXPECT_EQ(std::memcmp(&stb.view()(r, 0), &st.view()(r, 0), sizeof(float) * cs.SW), 0);
        }
      }
    }
  }
  if (!lean) {
    EXPECT_GT(unchecked, 0) << "the data no longer show the default dots' flips";
    if (dominant >= 0) {
      EXPECT_GT(by_r, 0) << "the data no longer show flips that r alone causes";
    }
  }
}

TEST(rounding, CsaCompressorWithTheRoundingCheckRoundsAsGoldenFromTheStepsInputs) {
  compressor_check_test(CmpKind::csa, 256, 2, 2101, "CSA cmp_kv (check)");
}

TEST(rounding, HcaCompressorWithTheRoundingCheckRoundsAsGoldenFromTheStepsInputs) {
  compressor_check_test(CmpKind::hca, 64, 8, 2102, "HCA cmp_kv (check)");
}

TEST(rounding, IndexerCompressorWithTheRoundingCheckRoundsAsGoldenFromTheStepsInputs) {
  compressor_check_test(CmpKind::inner, 512, 2, 2103, "inner bf16(y) (check)");
}

TEST(rounding, CsaCompressorWithTheRoundingCheckRoundsAsGoldenWhenOneChannelDecidesTheNorm) {
  compressor_check_test(CmpKind::csa, 256, 2, 2104, "CSA cmp_kv (check, r)", 5);
}
