// RoPE tables and rotations (spec §5) against values computed independently in double
// precision (golden/rope.hpp) from the formulas; the dual profiles, the two angle modes and the
// long-context (> 65536, up to 2^20) rows of addendum §4.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/random.hpp"
#include "tiledecode/golden/rope.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
using td::bf16;
using td::LayerKind;

namespace {

const td::ModelConfig kFlash = td::flash_config();

// Half a BF16 ulp at |x| (8 significant bits).
double half_ulp_bf16(double x) {
  return x == 0 ? 0 : std::ldexp(1.0, std::ilogb(x) - 8);
}

TEST(RopeYarn, CorrectionRangeComesOutOfTheFormula) {
  // low = floor(64 ln(65536/(32·2π)) / (2 ln 160000)) = floor(15.45) = 15,
  // high = ceil(64 ln(65536/(1·2π)) / (2 ln 160000)) = ceil(24.71) = 25.
  for (const auto& cfg : {td::flash_config(), td::pro_config()}) {
    const td::YarnRange r = td::rope_yarn_range(cfg);
    EXPECT_EQ(r.low, 15.0);
    EXPECT_EQ(r.high, 25.0);
    double lo = 0, hi = 0;
    td::golden::rope_yarn_range(cfg, lo, hi);
    EXPECT_EQ(lo, 15.0);
    EXPECT_EQ(hi, 25.0);
  }
}

TEST(RopeYarn, RampAtDims14To26) {
  float f[32];
  td::rope_inv_freq(f, kFlash, LayerKind::csa);
  const auto base = [](int i) { return std::pow(160000.0, -2.0 * i / 64.0); };
  // Below low: unchanged. At low: ramp 0, unchanged. Midway (20): ramp 0.5 → f·(1/32 + 1/2).
  // At/after high: ramp 1 → f/16.
  const struct {
    int dim;
    double expected;
  } cases[] = {{14, base(14)},
               {15, base(15)},
               {20, base(20) * (0.5 / 16 + 0.5)},
               {25, base(25) / 16},
               {26, base(26) / 16}};
  for (const auto& c : cases) {
    EXPECT_NEAR(f[c.dim], c.expected, 4e-7 * c.expected) << "dim " << c.dim;
    EXPECT_NEAR(td::golden::rope_inv_freq(kFlash, LayerKind::csa, c.dim), c.expected,
                1e-12 * c.expected)
        << "dim " << c.dim;
  }
  // Every column against the independent double formula; HCA uses the same profile.
  float h[32];
  td::rope_inv_freq(h, kFlash, LayerKind::hca);
  for (int i = 0; i < 32; ++i) {
    const double e = td::golden::rope_inv_freq(kFlash, LayerKind::csa, i);
    EXPECT_NEAR(f[i], e, 4e-7 * e) << i;
    EXPECT_EQ(f[i], h[i]) << i;
  }
}

TEST(RopeYarn, SwaProfileHasNoYarn) {
  float f[32];
  td::rope_inv_freq(f, kFlash, LayerKind::swa);
  for (int i = 0; i < 32; ++i) {
    const double e = std::pow(10000.0, -2.0 * i / 64.0);
    EXPECT_NEAR(f[i], e, 4e-7 * e) << i;
  }
}

// |table - exact| <= half a BF16 ulp + the FP32 angle's error (the spec computes
// angles in FP32: inv_freq within a few ulp, one rounding of pos·inv_freq, ≈ 3.5e-7 relative).
void check_table_rows(LayerKind kind) {
  const auto t = td::make_rope_table(kFlash, kind, kFlash.max_seq_len);
  const auto v = t.view();
  ASSERT_EQ(v.length(), 16384);
  ASSERT_EQ(t.cos.extent(1), 64);
  for (long pos : {0L, 1L, 8191L, 16383L}) {
    for (int col = 0; col < 64; ++col) {
      const double angle = double(pos) * td::golden::rope_inv_freq(kFlash, kind, col % 32);
      const double ec = td::golden::rope_cos(kFlash, kind, pos, col);
      const double es = td::golden::rope_sin(kFlash, kind, pos, col);
      const double tol_angle = 3.5e-7 * angle + 1e-7;
      const float c = v.cos_row(pos)[col].to_float(), s = v.sin_row(pos)[col].to_float();
      EXPECT_NEAR(c, ec, half_ulp_bf16(ec) + tol_angle) << "cos pos " << pos << " col " << col;
      EXPECT_NEAR(s, es, half_ulp_bf16(es) + tol_angle) << "sin pos " << pos << " col " << col;
      // Columns 32..63 duplicate 0..31 bit for bit.
      if (col >= 32) {
        EXPECT_EQ(v.cos_row(pos)[col], v.cos_row(pos)[col - 32]);
        EXPECT_EQ(v.sin_row(pos)[col], v.sin_row(pos)[col - 32]);
      }
    }
  }
  // Position 0 is the identity rotation exactly.
  for (int col = 0; col < 64; ++col) {
    EXPECT_EQ(v.cos_row(0)[col].to_float(), 1.0f);
    EXPECT_EQ(v.sin_row(0)[col].to_float(), 0.0f);
  }
}

TEST(RopeTable, SwaProfileMatchesDoublePrecision) {
  check_table_rows(LayerKind::swa);
}
TEST(RopeTable, YarnProfileMatchesDoublePrecision) {
  check_table_rows(LayerKind::csa);
}

TEST(RopeTable, Position1IsBf16OfTheExactValue) {
  // At position 1 the FP32 angle is inv_freq itself: the entries are the BF16 neighbours of
  // cos/sin(inv_freq), within half a BF16 ulp (plus the FP32 rounding of inv_freq).
  const auto t = td::make_rope_table(kFlash, LayerKind::csa, 2);
  for (int i = 0; i < 32; ++i) {
    const double ec = td::golden::rope_cos(kFlash, LayerKind::csa, 1, i);
    const double es = td::golden::rope_sin(kFlash, LayerKind::csa, 1, i);
    EXPECT_NEAR(t.cos.view()(1, i).to_float(), ec, half_ulp_bf16(ec) + 1e-7) << i;
    EXPECT_NEAR(t.sin.view()(1, i).to_float(), es, half_ulp_bf16(es) + 1e-7) << i;
  }
}

TEST(RopeTable, RejectsBadArguments) {
  EXPECT_THROW((void)td::make_rope_table(kFlash, LayerKind::csa, 0), td::Error);
  td::ModelConfig odd = kFlash;
  odd.rope_dim = 32;
  EXPECT_THROW((void)td::make_rope_table(odd, LayerKind::csa, 16), td::Error);
  const auto t = td::make_rope_table(kFlash, LayerKind::swa, 8);
  EXPECT_NO_THROW(td::check_rope_position("test", t.view(), 7));
  EXPECT_THROW(td::check_rope_position("test", t.view(), 8), td::Error);
  EXPECT_THROW(td::check_rope_position("test", t.view(), -1), td::Error);
  EXPECT_NO_THROW(td::check_rope_table("test", t.view()));
}

TEST(RopeRotation, ForwardAndInverseMatchDoubleComplexProducts) {
  const auto t = td::make_rope_table(kFlash, LayerKind::csa, kFlash.max_seq_len);
  const auto v = t.view();
  tdtest::Rng rng(5);
  for (long pos : {0L, 1L, 3L, 8191L, 8700L, 16383L}) {
    std::vector<float> x(64);
    rng.fill_normal(x);
    std::vector<float> f = x, inv = x;
    td::rope_forward(f, v, pos);
    td::rope_inverse(inv, v, pos);
    std::vector<double> gf(x.begin(), x.end()), gi(x.begin(), x.end());
    td::golden::rope_forward(gf, v.cos_row(pos), v.sin_row(pos));
    td::golden::rope_inverse(gi, v.cos_row(pos), v.sin_row(pos));
    for (int i = 0; i < 32; ++i) {
      // (e + i·o) · (c ± i·s) with the table's BF16 c, s.
      const double c = v.cos_row(pos)[i].to_float(), s = v.sin_row(pos)[i].to_float();
      const double e = x[2 * i], o = x[2 * i + 1];
      EXPECT_NEAR(f[2 * i], e * c - o * s, 1e-6);
      EXPECT_NEAR(f[2 * i + 1], e * s + o * c, 1e-6);
      EXPECT_NEAR(inv[2 * i], e * c + o * s, 1e-6);
      EXPECT_NEAR(inv[2 * i + 1], o * c - e * s, 1e-6);
      EXPECT_NEAR(f[2 * i], gf[2 * i], 1e-6);
      EXPECT_NEAR(inv[2 * i + 1], gi[2 * i + 1], 1e-6);
    }
    // Inverse undoes forward up to |c + i s|² = 1 ± the BF16 rounding of the table.
    td::rope_inverse(f, v, pos);
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(f[i], x[i], 2e-2 * std::fabs(x[i]) + 1e-6) << pos;
    // Position 0 is the identity.
    if (pos == 0) {
      for (int i = 0; i < 64; ++i) EXPECT_EQ(inv[i], x[i]);
    }
  }
}

TEST(RopeRotation, PairsUseTheirOwnColumn) {
  // A unit vector in pair i rotates by column i's angle and leaves every other pair untouched.
  const auto t = td::make_rope_table(kFlash, LayerKind::swa, 128);
  const auto v = t.view();
  for (int i : {0, 7, 31}) {
    std::vector<float> x(64, 0.0f);
    x[2 * i] = 1.0f;
    td::rope_forward(x, v, 100);
    for (int j = 0; j < 64; ++j) {
      if (j == 2 * i) {
        EXPECT_EQ(x[j], v.cos_row(100)[i].to_float());
      } else if (j == 2 * i + 1) {
        EXPECT_EQ(x[j], v.sin_row(100)[i].to_float());
      } else {
        EXPECT_EQ(x[j], 0.0f);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dual profiles (addendum §4.1), angle modes and long context.

constexpr long kOneM = 1L << 20;

bool same_bits(const bf16* a, const bf16* b, int n) {
  return std::memcmp(a, b, sizeof(bf16) * std::size_t(n)) == 0;
}

bool same_table(const td::RopeTableView& a, const td::RopeTableView& b) {
  if (a.length() != b.length()) return false;
  for (td::index_t p = 0; p < a.length(); ++p) {
    if (!same_bits(a.cos_row(p), b.cos_row(p), 64) || !same_bits(a.sin_row(p), b.sin_row(p), 64))
      return false;
  }
  return true;
}

TEST(RopeProfiles, LayerKindsPickTheirProfile) {
  static_assert(td::rope_profile(LayerKind::swa) == td::RopeProfile::base);
  static_assert(td::rope_profile(LayerKind::csa) == td::RopeProfile::compress);
  static_assert(td::rope_profile(LayerKind::hca) == td::RopeProfile::compress);
  static_assert(td::kDefaultRopeAngles == td::RopeAngles::fp32_reference);
  // Flash schedule: layers 0, 1 SWA → profile 0; every CSA/HCA layer → profile 1. The MTP draft
  // layer has compress ratio 0, i.e. kind swa, hence profile 0 (addendum §4.1).
  for (int l = 0; l < kFlash.n_layers; ++l) {
    const LayerKind k = kFlash.layer_kind(l);
    EXPECT_EQ(td::rope_profile(k), l < 2 ? td::RopeProfile::base : td::RopeProfile::compress) << l;
  }
  const td::ModelConfig pro = td::pro_config();
  for (int l = 0; l < pro.n_layers; ++l) {
    EXPECT_EQ(td::rope_profile(pro.layer_kind(l)), td::RopeProfile::compress) << l;
  }

  const td::RopeTables tables(kFlash, 300);
  EXPECT_EQ(tables.length(), 300);
  EXPECT_EQ(tables.angles(), td::RopeAngles::fp32_reference);
  EXPECT_EQ(tables.bytes(), std::size_t(2 * 2 * 300 * 64 * 2));
  EXPECT_EQ(tables.stacked_cos().extent(0), 2);
  EXPECT_EQ(tables.stacked_cos().extent(1), 300);
  EXPECT_EQ(tables.stacked_sin().extent(2), 64);
  const auto swa = td::make_rope_table(kFlash, LayerKind::swa, 300);
  const auto csa = td::make_rope_table(kFlash, LayerKind::csa, 300);
  EXPECT_TRUE(same_table(tables.profile(LayerKind::swa), swa.view()));
  EXPECT_TRUE(same_table(tables.profile(LayerKind::csa), csa.view()));
  EXPECT_TRUE(same_table(tables.profile(LayerKind::hca), csa.view()));
  EXPECT_TRUE(same_table(tables.profile(0), swa.view()));
  EXPECT_TRUE(same_table(tables.profile(td::RopeProfile::compress), csa.view()));
  EXPECT_FALSE(same_table(swa.view(), csa.view()));
  // The profile views are slices of the stacked [2, L, 64] pair, valid for the kernels.
  EXPECT_EQ(tables.profile(1).cos_row(0), tables.stacked_cos().data() + 300 * 64);
  EXPECT_EQ(tables.profile(LayerKind::hca).sin_row(7), tables.stacked_sin().data() + 307 * 64);
  EXPECT_NO_THROW(td::check_rope_table("test", tables.profile(LayerKind::csa)));
  // The make_rope_table(kind) and make_rope_table(profile) forms agree.
  EXPECT_TRUE(
      same_table(td::make_rope_table(kFlash, td::RopeProfile::base, 300).view(), swa.view()));

  EXPECT_THROW((void)tables.profile(2), td::Error);
  EXPECT_THROW((void)tables.profile(-1), td::Error);
  EXPECT_THROW((void)tables.profile(static_cast<td::RopeProfile>(2)), td::Error);
  EXPECT_THROW((void)td::RopeTables().profile(0), td::Error);
  EXPECT_THROW(td::RopeTables(kFlash, 0), td::Error);
  try {
    (void)tables.profile(5);
    ADD_FAILURE() << "no throw";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'profile' = 5"), std::string::npos) << e.what();
  }
}

TEST(RopeTable, DefaultModeIsTheFp32ReferenceAndModesAgreeOnExactAngles) {
  const auto def = td::make_rope_table(kFlash, LayerKind::csa, 2048);
  const auto ref =
      td::make_rope_table(kFlash, LayerKind::csa, 2048, td::RopeAngles::fp32_reference);
  const auto exa = td::make_rope_table(kFlash, LayerKind::csa, 2048, td::RopeAngles::exact);
  EXPECT_TRUE(same_table(def.view(), ref.view()));
  EXPECT_FALSE(same_table(ref.view(), exa.view()));
  // Column 0 (inv_freq = 1) has exact FP32 angles: the modes can differ there only by the
  // reference's double rounding double → FP32 → BF16, which the exact mode avoids.
  for (td::index_t p = 0; p < 2048; ++p) {
    for (int col : {0, 32}) {
      const double c = std::cos(double(p)), s = std::sin(double(p));
      EXPECT_LE(std::fabs(exa.view().cos_row(p)[col].to_float() - c), half_ulp_bf16(c)) << p;
      EXPECT_LE(std::fabs(exa.view().sin_row(p)[col].to_float() - s), half_ulp_bf16(s)) << p;
      EXPECT_LE(std::fabs(ref.view().cos_row(p)[col].to_float() - c), 2 * half_ulp_bf16(c)) << p;
    }
  }
  for (int col = 0; col < 64; ++col) {
    EXPECT_EQ(exa.view().cos_row(0)[col].to_float(), 1.0f);
    EXPECT_EQ(exa.view().sin_row(0)[col].to_float(), 0.0f);
  }
  // Every column of every 7th row against both golden definitions (bit for bit).
  for (long p = 0; p < 2048; p += 7) {
    for (int col = 0; col < 64; ++col) {
      const auto ev = exa.view(), rv = ref.view();
      EXPECT_EQ(ev.cos_row(p)[col].to_float(),
                td::golden::rope_cos_exact(kFlash, LayerKind::csa, p, col));
      EXPECT_EQ(ev.sin_row(p)[col].to_float(),
                td::golden::rope_sin_exact(kFlash, LayerKind::csa, p, col));
      EXPECT_EQ(rv.cos_row(p)[col].to_float(),
                td::golden::rope_cos_reference(kFlash, LayerKind::csa, p, col));
      EXPECT_EQ(rv.sin_row(p)[col].to_float(),
                td::golden::rope_sin_reference(kFlash, LayerKind::csa, p, col));
    }
  }
  // The golden FP32 inverse frequencies are the library's, bit for bit, for both profiles.
  for (auto kind : {LayerKind::swa, LayerKind::csa}) {
    float f[32];
    td::rope_inv_freq(f, kFlash, kind);
    for (int i = 0; i < 32; ++i)
      EXPECT_EQ(f[i], td::golden::rope_inv_freq_fp32(kFlash, kind, i)) << i;
  }
}

TEST(RopeTable, ExactModeRoundsOnceToBf16) {
  // mid = 1 + 2^-8 is the midpoint of the BF16 neighbours 1 and 1 + 2^-7; a double a hair off it
  // rounds to exactly `mid` in FP32, so rounding through FP32 would fall back to ties-to-even.
  const double mid = 1.0 + std::ldexp(1.0, -8), up = 1.0 + std::ldexp(1.0, -7);
  const double eps = std::ldexp(1.0, -40);
  for (double sign : {1.0, -1.0}) {
    EXPECT_EQ(td::detail::bf16_nearest(sign * (mid + eps)).to_float(), sign * up);
    EXPECT_EQ(td::detail::bf16_nearest(sign * (mid - eps)).to_float(), sign * 1.0);
    EXPECT_EQ(td::detail::bf16_nearest(sign * mid).to_float(), sign * 1.0);  // tie: even
    EXPECT_EQ(td::golden::bf16_nearest(sign * (mid + eps)), sign * up);
    EXPECT_EQ(td::golden::bf16_nearest(sign * (mid - eps)), sign * 1.0);
    EXPECT_EQ(td::golden::bf16_nearest(sign * mid), sign * 1.0);
    EXPECT_EQ(bf16(float(sign * (mid + eps))).to_float(), sign * 1.0);  // the double rounding
  }
  EXPECT_EQ(td::detail::bf16_nearest(0.0).bits, 0);
  EXPECT_EQ(td::detail::bf16_nearest(0.3).to_float(), bf16(0.3f).to_float());
}

TEST(RopeTable, ExecutorBuildIsBitIdentical) {
  td::ThreadPool pool2(2, std::chrono::microseconds(0)), pool3(3, std::chrono::microseconds(0));
  for (auto angles : {td::RopeAngles::fp32_reference, td::RopeAngles::exact}) {
    const auto serial = td::make_rope_table(kFlash, LayerKind::hca, 20000, angles);
    const auto two = td::make_rope_table(kFlash, LayerKind::hca, 20000, angles, &pool2);
    const auto three = td::make_rope_table(kFlash, LayerKind::hca, 20000, angles, &pool3);
    EXPECT_TRUE(same_table(serial.view(), two.view())) << td::to_string(angles);
    EXPECT_TRUE(same_table(serial.view(), three.view())) << td::to_string(angles);
  }
  const td::RopeTables a(kFlash, 9000, td::RopeAngles::exact),
      b(kFlash, 9000, td::RopeAngles::exact, &pool2);
  EXPECT_TRUE(same_table(a.profile(0), b.profile(0)));
  EXPECT_TRUE(same_table(a.profile(1), b.profile(1)));
  EXPECT_EQ(b.angles(), td::RopeAngles::exact);
}

TEST(RopeTable, FillRejectsBadArgumentsBeforeWriting) {
  std::vector<bf16> c(64 * 16, bf16::from_bits(0x1234)), s(64 * 16, bf16::from_bits(0x1234));
  const auto untouched = [&] {
    return std::all_of(c.begin(), c.end(), [](bf16 v) { return v.bits == 0x1234; }) &&
           std::all_of(s.begin(), s.end(), [](bf16 v) { return v.bits == 0x1234; });
  };
  td::View<bf16, 2> cv(c.data(), {16, 64}), sv(s.data(), {16, 64});
  const auto P = td::RopeProfile::compress;
  EXPECT_THROW(td::fill_rope_table(cv, sv.slice(0, 0, 15), kFlash, P), td::Error);
  EXPECT_THROW(td::fill_rope_table(cv.slice(1, 0, 40), sv.slice(1, 0, 40), kFlash, P), td::Error);
  EXPECT_THROW(td::fill_rope_table(cv, sv.slice(1, 0, 32), kFlash, P), td::Error);
  EXPECT_THROW(td::fill_rope_table(td::View<bf16, 2>(c.data(), {8, 32}, {64, 2}),
                                   td::View<bf16, 2>(s.data(), {8, 32}), kFlash, P),
               td::Error);
  EXPECT_THROW(td::fill_rope_table(cv.slice(0, 0, 0), sv.slice(0, 0, 0), kFlash, P), td::Error);
  EXPECT_THROW(td::fill_rope_table(td::View<bf16, 2>(c.data(), {(1L << 24) + 1, 64}),
                                   td::View<bf16, 2>(s.data(), {(1L << 24) + 1, 64}), kFlash, P),
               td::Error);
  EXPECT_THROW(td::fill_rope_table(td::View<bf16, 2>(nullptr, {16, 64}), sv, kFlash, P), td::Error);
  EXPECT_THROW(td::fill_rope_table(cv, sv, kFlash, static_cast<td::RopeProfile>(2)), td::Error);
  EXPECT_THROW(td::fill_rope_table(cv, sv, kFlash, P, static_cast<td::RopeAngles>(7)), td::Error);
  td::ModelConfig odd = kFlash;
  odd.rope_dim = 32;
  EXPECT_THROW(td::fill_rope_table(cv, sv, odd, P), td::Error);
  EXPECT_TRUE(untouched());
  EXPECT_THROW((void)td::make_rope_table(kFlash, LayerKind::csa, (1L << 24) + 1), td::Error);
  EXPECT_THROW((void)td::make_rope_table(kFlash, static_cast<td::RopeProfile>(3), 8), td::Error);
  EXPECT_THROW((void)td::make_rope_table(kFlash, LayerKind::csa, 8, static_cast<td::RopeAngles>(2)),
               td::Error);
  try {
    td::fill_rope_table(cv, sv, kFlash, P, static_cast<td::RopeAngles>(7));
    ADD_FAILURE() << "no throw";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'angles' = 7"), std::string::npos) << e.what();
  }
  // A 32-wide destination holds columns 0..31 of the 64-wide table.
  td::fill_rope_table(cv.slice(1, 0, 32), sv.slice(1, 0, 32), kFlash, P);
  const auto t = td::make_rope_table(kFlash, P, 16);
  for (td::index_t p = 0; p < 16; ++p) {
    EXPECT_TRUE(same_bits(&cv(p, 0), t.view().cos_row(p), 32)) << p;
    EXPECT_TRUE(same_bits(&sv(p, 0), t.view().sin_row(p), 32)) << p;
    EXPECT_EQ(cv(p, 40).bits, 0x1234);  // columns past the view untouched
  }
}

TEST(RopeRows, TokenLocalRowsEqualTableRowsAndValidateFirst) {
  const td::index_t L = 65536 + 4100;
  td::ThreadPool pool(2, std::chrono::microseconds(0));
  const td::RopeTables tables(kFlash, L, td::kDefaultRopeAngles, &pool);
  const std::vector<std::int32_t> pos = {0, 5, 127, 65535, 65536, 65537, 69000, int(L - 1)};
  const auto T = td::index_t(pos.size());
  const td::ConstView<std::int32_t, 1> pv(pos.data(), {T});
  for (auto kind : {LayerKind::swa, LayerKind::csa, LayerKind::hca}) {
    const auto tv = tables.profile(kind);
    for (td::index_t width : {64, 32}) {
      std::vector<bf16> c(std::size_t(T * width)), s(std::size_t(T * width));
      td::fill_rope_rows(td::View<bf16, 2>(c.data(), {T, width}),
                         td::View<bf16, 2>(s.data(), {T, width}), pv, kFlash,
                         td::rope_profile(kind));
      for (td::index_t t = 0; t < T; ++t) {
        EXPECT_TRUE(same_bits(&c[std::size_t(t * width)], tv.cos_row(pos[t]), int(width))) << t;
        EXPECT_TRUE(same_bits(&s[std::size_t(t * width)], tv.sin_row(pos[t]), int(width))) << t;
      }
    }
  }
  // Validation before the first write: a bad position anywhere leaves the rows untouched.
  std::vector<bf16> c(64 * 3, bf16::from_bits(0x7777)), s(64 * 3, bf16::from_bits(0x7777));
  td::View<bf16, 2> cv(c.data(), {3, 64}), sv(s.data(), {3, 64});
  for (std::int32_t bad : {-1, 1 << 24}) {
    const std::vector<std::int32_t> q = {1, 2, bad};
    EXPECT_THROW(td::fill_rope_rows(cv, sv, td::ConstView<std::int32_t, 1>(q.data(), {3}), kFlash,
                                    td::RopeProfile::base),
                 td::Error);
  }
  const std::vector<std::int32_t> q2 = {1, 2};
  EXPECT_THROW(td::fill_rope_rows(cv, sv, td::ConstView<std::int32_t, 1>(q2.data(), {2}), kFlash,
                                  td::RopeProfile::base),
               td::Error);
  EXPECT_THROW(td::fill_rope_rows(cv.slice(1, 0, 48), sv.slice(1, 0, 48),
                                  td::ConstView<std::int32_t, 1>(pos.data(), {3}), kFlash,
                                  td::RopeProfile::base),
               td::Error);
  EXPECT_THROW(td::fill_rope_rows(cv, sv, td::ConstView<std::int32_t, 1>(pos.data(), {3}), kFlash,
                                  static_cast<td::RopeProfile>(9)),
               td::Error);
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](bf16 v) { return v.bits == 0x7777; }));
  EXPECT_TRUE(std::all_of(s.begin(), s.end(), [](bf16 v) { return v.bits == 0x7777; }));
  try {
    const std::vector<std::int32_t> q = {1, -3, 2};
    td::fill_rope_rows(cv, sv, td::ConstView<std::int32_t, 1>(q.data(), {3}), kFlash,
                       td::RopeProfile::base);
    ADD_FAILURE() << "no throw";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'positions[t]' = -3"), std::string::npos) << e.what();
  }
}

// Positions past the original YaRN length 65536, from a table long enough to hold them: every
// entry is the reference definition bit for bit and within the FP32 angle error of the exact
// double-precision formula; the YaRN columns are really interpolated there.
TEST(RopeTable, long_context_yarn_profile_past_65536) {
  const td::index_t L = 65536 + 4100;
  td::ThreadPool pool(2, std::chrono::microseconds(0));
  const td::RopeTables tables(kFlash, L, td::kDefaultRopeAngles, &pool);
  for (auto kind : {LayerKind::swa, LayerKind::csa}) {
    const auto v = tables.profile(kind);
    for (long pos : {65535L, 65536L, 65537L, 65600L, 66000L, 69000L, 69635L}) {
      for (int col = 0; col < 64; ++col) {
        const float c = v.cos_row(pos)[col].to_float(), s = v.sin_row(pos)[col].to_float();
        EXPECT_EQ(c, td::golden::rope_cos_reference(kFlash, kind, pos, col)) << pos << " " << col;
        EXPECT_EQ(s, td::golden::rope_sin_reference(kFlash, kind, pos, col)) << pos << " " << col;
        const double angle = double(pos) * td::golden::rope_inv_freq(kFlash, kind, col % 32);
        const double ec = std::cos(angle), es = std::sin(angle);
        // FP32 inv_freq (≤ 2^-24 relative, a few ulp through pow and the YaRN blend) and one
        // rounding of the FP32 product: ≤ 3.5e-7 · angle (up to 0.008 rad for column 1 here).
        const double tol = 3.5e-7 * angle + 1e-7;
        EXPECT_NEAR(c, ec, half_ulp_bf16(ec) + tol) << "cos " << pos << " " << col;
        EXPECT_NEAR(s, es, half_ulp_bf16(es) + tol) << "sin " << pos << " " << col;
      }
    }
  }
  // YaRN: columns >= high (25) run at 1/16 of the base-160000 frequency, columns < low (15)
  // unchanged, so profile 1 at position 16·q of column i ≥ 25 matches the plain base-160000
  // angle at q (q past 4096 here: positions past 65536).
  const auto v = tables.profile(LayerKind::csa);
  for (long q : {4096L, 4097L, 4200L, 4350L}) {
    for (int i = 25; i < 32; ++i) {
      const double plain = double(q) * std::pow(160000.0, -2.0 * i / 64);
      EXPECT_NEAR(v.cos_row(16 * q)[i].to_float(), std::cos(plain), 4e-3) << q << " " << i;
      EXPECT_NEAR(v.sin_row(16 * q)[i].to_float(), std::sin(plain), 4e-3) << q << " " << i;
    }
    for (int i = 0; i < 15; ++i) {
      const double plain = double(16 * q) * std::pow(160000.0, -2.0 * i / 64);
      EXPECT_NEAR(v.cos_row(16 * q)[i].to_float(), std::cos(plain), 4e-3 + 3.5e-7 * plain) << i;
    }
  }
}

// Accumulated comparison of the two angle modes over a set of positions (both profiles).
struct ModeStats {
  long entries = 0, differ = 0;     // cos + sin entries of columns 0..31, and those differing
  long ref_bad = 0, exact_bad = 0;  // entries off their golden definition
  double max_angle_err = 0;         // |fl(fl(pos)·inv) − pos·inv| (FP32 inv_freq)
  double max_angle_err_f64 = 0;     // |fl(fl(pos)·inv) − pos·inv_f64|
  double max_ref_err = 0, max_exact_err = 0;  // |entry − cos/sin(exact angle)|
  double max_exact_excess = 0;                // |exact entry − value| − half BF16 ulp (≤ 0)
};

void merge(ModeStats& st, const ModeStats& o) {
  st.entries += o.entries;
  st.differ += o.differ;
  st.ref_bad += o.ref_bad;
  st.exact_bad += o.exact_bad;
  st.max_angle_err = std::max(st.max_angle_err, o.max_angle_err);
  st.max_angle_err_f64 = std::max(st.max_angle_err_f64, o.max_angle_err_f64);
  st.max_ref_err = std::max(st.max_ref_err, o.max_ref_err);
  st.max_exact_err = std::max(st.max_exact_err, o.max_exact_err);
  st.max_exact_excess = std::max(st.max_exact_excess, o.max_exact_excess);
}

// Stats of one row (columns 0..31) of the two modes at `pos`.
ModeStats row_stats(LayerKind kind, long pos, const bf16* rc, const bf16* rs, const bf16* ec,
                    const bf16* es) {
  ModeStats st;
  st.max_exact_excess = -1;
  for (int col = 0; col < 32; ++col) {
    const long double a = td::golden::rope_angle_exact(kFlash, kind, pos, col);
    const double a32 = td::golden::rope_angle_fp32(kFlash, kind, pos, col);
    const double a64 = double(pos) * td::golden::rope_inv_freq(kFlash, kind, col);
    st.max_angle_err = std::max(st.max_angle_err, double(std::fabs(a32 - a)));
    st.max_angle_err_f64 = std::max(st.max_angle_err_f64, std::fabs(a32 - a64));
    const double vc = double(std::cos(a)), vs = double(std::sin(a));
    st.entries += 2;
    st.differ += (rc[col] != ec[col]) + (rs[col] != es[col]);
    st.ref_bad += (rc[col].to_float() != td::golden::rope_cos_reference(kFlash, kind, pos, col)) +
                  (rs[col].to_float() != td::golden::rope_sin_reference(kFlash, kind, pos, col));
    st.exact_bad += (ec[col].to_float() != td::golden::bf16_nearest(std::cos(a))) +
                    (es[col].to_float() != td::golden::bf16_nearest(std::sin(a)));
    st.max_ref_err = std::max(
        {st.max_ref_err, std::fabs(rc[col].to_float() - vc), std::fabs(rs[col].to_float() - vs)});
    const double ex_c = std::fabs(ec[col].to_float() - vc),
                 ex_s = std::fabs(es[col].to_float() - vs);
    st.max_exact_err = std::max({st.max_exact_err, ex_c, ex_s});
    st.max_exact_excess =
        std::max({st.max_exact_excess, ex_c - half_ulp_bf16(vc), ex_s - half_ulp_bf16(vs)});
  }
  return st;
}

void print_stats(const char* what, LayerKind kind, const ModeStats& st) {
  std::printf(
      "[rope %s, profile %d] entries %ld, fp32_reference vs exact differ %ld (%.3f %%); max angle "
      "error %.6g rad (f64 inv_freq: %.6g); max |entry - exact value| reference %.4g, exact "
      "%.4g; off-golden reference %ld, exact %ld\n",
      what, int(td::rope_profile(kind)), st.entries, st.differ, 100.0 * st.differ / st.entries,
      st.max_angle_err, st.max_angle_err_f64, st.max_ref_err, st.max_exact_err, st.ref_bad,
      st.exact_bad);
}

// Sampled 1M check (always run): token-local rows at ~5000 positions spread over [0, 2^20),
// dense near 2^20 and around powers of two, in both modes against both golden definitions.
TEST(RopeRows, long_context_fp32_angle_accuracy_1M_sampled) {
  std::vector<std::int32_t> pos;
  for (long p = 0; p < kOneM; p += 1021) pos.push_back(std::int32_t(p));
  for (long p = kOneM - 1024; p < kOneM; ++p) pos.push_back(std::int32_t(p));
  for (int e = 10; e <= 20; ++e) {
    for (long d = -3; d <= 3; ++d) {
      const long p = (1L << e) + d;
      if (p < kOneM) pos.push_back(std::int32_t(p));
    }
  }
  tdtest::Rng rng(16);
  for (int k = 0; k < 2048; ++k) pos.push_back(std::int32_t(rng.integer(65537, kOneM - 1)));
  const auto T = td::index_t(pos.size());
  const td::ConstView<std::int32_t, 1> pv(pos.data(), {T});
  std::vector<bf16> rc(std::size_t(T) * 64), rs(rc.size()), ec(rc.size()), es(rc.size());
  for (auto kind : {LayerKind::swa, LayerKind::csa}) {
    const auto P = td::rope_profile(kind);
    td::fill_rope_rows(td::View<bf16, 2>(rc.data(), {T, 64}), td::View<bf16, 2>(rs.data(), {T, 64}),
                       pv, kFlash, P, td::RopeAngles::fp32_reference);
    td::fill_rope_rows(td::View<bf16, 2>(ec.data(), {T, 64}), td::View<bf16, 2>(es.data(), {T, 64}),
                       pv, kFlash, P, td::RopeAngles::exact);
    ModeStats all, near1m, below16k;
    for (td::index_t t = 0; t < T; ++t) {
      const std::size_t o = std::size_t(t) * 64;
      const long p = pos[std::size_t(t)];
      const ModeStats row = row_stats(kind, p, &rc[o], &rs[o], &ec[o], &es[o]);
      merge(all, row);
      if (p >= kOneM / 2) merge(near1m, row);
      if (p < 16384) merge(below16k, row);
      EXPECT_TRUE(same_bits(&rc[o], &rc[o + 32], 32) && same_bits(&ec[o + 32], &ec[o], 32)) << p;
    }
    print_stats("1M sampled", kind, all);
    // Each mode is its golden definition, bit for bit.
    EXPECT_EQ(all.ref_bad, 0);
    EXPECT_EQ(all.exact_bad, 0);
    // Exact: within half a BF16 ulp of cos/sin of the exact angle everywhere.
    EXPECT_LE(all.max_exact_excess, 1e-12);
    // FP32 reference: the angle rounds by at most half an FP32 ulp of 2^20 (2^-5 rad), and it
    // really loses that much near 1M (the [AMBIGUOUS] note of addendum §4.1) ...
    EXPECT_LE(all.max_angle_err, 0.03125);
    EXPECT_GE(near1m.max_angle_err, 0.02);
    EXPECT_LE(all.max_ref_err, 0.03125 + 0.002);
    EXPECT_GE(near1m.max_ref_err, 0.01);
    // ... so near 1M a large share of the entries differ between the modes (measured over the
    // full sweep: 16.3 % / 12.2 % of all entries in [0, 2^20) for profiles 0 / 1) ...
    EXPECT_GE(double(near1m.differ) / double(near1m.entries), 0.10);
    // ... while below 16384 (the kernels' budget) they agree to one BF16 ulp: ≤ 4.9e-4 rad.
    EXPECT_LE(below16k.max_angle_err, 4.9e-4);
    EXPECT_LE(below16k.max_ref_err, 0.002 + 4.9e-4);
    EXPECT_LE(double(below16k.differ) / double(below16k.entries), 0.02);
  }
}

// The full sweep of every position in [0, 2^20) and every column, from 2^20 + 3-row tables
// (512 MiB for both profiles per mode), with build times and memory. ~1 min on two cores:
// runs only with TILEDECODE_LONG_TESTS=1.
TEST(RopeTable, long_context_full_sweep_1M) {
  if (!std::getenv("TILEDECODE_LONG_TESTS")) GTEST_SKIP() << "set TILEDECODE_LONG_TESTS=1";
  const td::index_t L = kOneM + 3;
  td::ThreadPool pool;
  const auto seconds = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto t0 = std::chrono::steady_clock::now();
  const auto serial = td::make_rope_table(kFlash, LayerKind::csa, L);
  const double t_serial = seconds(t0);
  t0 = std::chrono::steady_clock::now();
  const td::RopeTables ref(kFlash, L, td::RopeAngles::fp32_reference, &pool);
  const double t_ref = seconds(t0);
  t0 = std::chrono::steady_clock::now();
  const td::RopeTables exa(kFlash, L, td::RopeAngles::exact, &pool);
  const double t_exa = seconds(t0);
  std::printf(
      "[rope 2^20+3] one profile serial %.2f s (%zu MiB); RopeTables (2 profiles, %zu threads) "
      "fp32_reference %.2f s, exact %.2f s, %zu MiB each\n",
      t_serial, (serial.cos.size() + serial.sin.size()) * 2 >> 20, pool.concurrency(), t_ref, t_exa,
      ref.bytes() >> 20);
  EXPECT_EQ(ref.bytes(), std::size_t(L) * 64 * 2 * 2 * 2);
  EXPECT_TRUE(same_table(serial.view(), ref.profile(LayerKind::csa)));
  EXPECT_EQ(ref.profile(0).length(), L);
  for (auto kind : {LayerKind::swa, LayerKind::csa}) {
    const auto rv = ref.profile(kind), ev = exa.profile(kind);
    ModeStats st;
    for (long p = 0; p < kOneM; ++p) {
      merge(st, row_stats(kind, p, rv.cos_row(p), rv.sin_row(p), ev.cos_row(p), ev.sin_row(p)));
    }
    print_stats("full sweep [0, 2^20)", kind, st);
    EXPECT_EQ(st.entries, 2 * 32 * kOneM);
    EXPECT_EQ(st.ref_bad, 0);
    EXPECT_EQ(st.exact_bad, 0);
    EXPECT_LE(st.max_exact_excess, 1e-12);
    EXPECT_LE(st.max_angle_err, 0.03125);
    // Measured: 10,949,215 (profile 0) and 8,216,657 (profile 1) differing entries.
    const double frac = double(st.differ) / double(st.entries);
    EXPECT_NEAR(frac, kind == LayerKind::swa ? 0.1632 : 0.1224, 0.002);
  }
}

}  // namespace
