// RoPE tables and rotations (spec §5) against values computed independently in double
// precision (golden/rope.hpp) from the formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

}  // namespace
