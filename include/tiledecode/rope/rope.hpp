#pragma once
// RoPE tables and interleaved rotations (spec §5).
//
// Tables: BF16 cos/sin [L, 64]; columns 0..31 hold cos/sin(pos * inv_freq[i]), columns 32..63
// duplicate them. inv_freq[i] = base^(-2i/64) in FP32. CSA/HCA layers use base 160000 with YaRN
// (factor 16, beta_fast 32, beta_slow 1, original length 65536):
//   low  = floor(64 * ln(orig / (beta_fast * 2π)) / (2 ln base)) = 15
//   high = ceil (64 * ln(orig / (beta_slow * 2π)) / (2 ln base)) = 25
//   ramp[i] = clamp((i - low) / (high - low), 0, 1)
//   inv_freq[i] ← inv_freq[i]/16 * ramp[i] + inv_freq[i] * (1 - ramp[i])
// so dims below `low` keep their frequency, dims at/after `high` are interpolated by 1/16 and the
// dims in between are blended linearly. low/high are evaluated in double (host-side Python
// arithmetic in the reference); everything per-dim is FP32 as in the reference tables.
// Angles are pos * inv_freq in FP32 (so a large position carries the FP32 rounding of the
// product, exactly like the reference); cos/sin of that FP32 angle are evaluated in double and
// rounded to FP32 (so the table does not depend on the libm's float cos), then to BF16.
// SWA layers: base 10000, no YaRN.
//
// Rotation, interleaved pairs: pair i = dims (2i, 2i+1) of the 64 rotary dims, column i:
//   forward  e' = e*c - o*s ; o' = e*s + o*c
//   inverse  e' = e*c + o*s ; o' = o*c - e*s      (conjugate, spec §8.4)
// computed in FP32 with the BF16 table values. The rotary dims are the LAST 64 dims of a
// 512-wide head (dims 448..511) and dims 64..127 of a 128-wide indexer head; callers pass the
// 64-float span.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

// Rotary dims per head (the tables' width) and frequency columns.
inline constexpr int kRopeDim = 64;
inline constexpr int kRopeHalf = kRopeDim / 2;

// Read-only view of one RoPE table pair, rows = positions.
struct RopeTableView {
  ConstView<bf16, 2> cos;  // (L, 64)
  ConstView<bf16, 2> sin;  // (L, 64)

  // Positions both halves cover (a short sin half must never be read past its end).
  index_t length() const { return std::min(cos.extent(0), sin.extent(0)); }
  const bf16* cos_row(index_t pos) const { return cos.data() + pos * cos.stride(0); }
  const bf16* sin_row(index_t pos) const { return sin.data() + pos * sin.stride(0); }
};

// Owning RoPE table for one layer kind.
struct RopeTable {
  Tensor<bf16, 2> cos;
  Tensor<bf16, 2> sin;
  RopeTableView view() const { return {cos.view(), sin.view()}; }
};

// YaRN correction range [low, high] of the frequency columns (spec §5; 15 and 25 for the
// flash/pro presets). Clamped to [0, rope_dim - 1] like the reference.
struct YarnRange {
  double low = 0;
  double high = 0;
};

inline YarnRange rope_yarn_range(const ModelConfig& cfg) {
  const double two_pi = 6.283185307179586;
  const double dim = cfg.rope_dim;
  const double base = cfg.compress_rope_theta;
  // The dim whose wavelength makes `rotations` turns over the original context length.
  const auto corr_dim = [&](double rotations) {
    return dim * std::log(double(cfg.yarn_orig_len) / (rotations * two_pi)) / (2 * std::log(base));
  };
  return {std::max(0.0, std::floor(corr_dim(cfg.yarn_beta_fast))),
          std::min(dim - 1, std::ceil(corr_dim(cfg.yarn_beta_slow)))};
}

namespace detail {
inline void check_rope_config(std::string_view where, const ModelConfig& cfg) {
  check_equal(where, "cfg.rope_dim", cfg.rope_dim, kRopeDim);
}
}  // namespace detail

// The 32 inverse frequencies of a layer kind (FP32, spec §5).
inline void rope_inv_freq(std::span<float, 32> inv_freq, const ModelConfig& cfg, LayerKind kind) {
  detail::check_rope_config("rope_inv_freq", cfg);
  const bool yarn = kind != LayerKind::swa;
  const float base = yarn ? cfg.compress_rope_theta : cfg.rope_theta;
  const int dim = cfg.rope_dim;
  for (int i = 0; i < dim / 2; ++i) {
    inv_freq[i] = 1.0f / std::pow(base, float(2 * i) / float(dim));
  }
  if (!yarn) return;
  const YarnRange r = rope_yarn_range(cfg);
  // The reference nudges an empty range open to avoid dividing by zero.
  const double width = std::max(r.high - r.low, 1e-3);
  for (int i = 0; i < dim / 2; ++i) {
    const float ramp = std::clamp(float((i - r.low) / width), 0.0f, 1.0f);
    inv_freq[i] = inv_freq[i] / cfg.yarn_factor * ramp + inv_freq[i] * (1.0f - ramp);
  }
}

// Builds the BF16 cos/sin tables [length, 64] for a layer kind (SWA: no YaRN; CSA/HCA: YaRN).
// Row p serves position p; `length` is normally cfg.max_seq_len.
inline RopeTable make_rope_table(const ModelConfig& cfg, LayerKind kind, index_t length) {
  detail::check_rope_config("make_rope_table", cfg);
  check_range<index_t>("make_rope_table", "length", length, 1, index_t(1) << 24);
  float inv_freq[kRopeHalf];
  rope_inv_freq(inv_freq, cfg, kind);
  RopeTable t{Tensor<bf16, 2>({length, kRopeDim}), Tensor<bf16, 2>({length, kRopeDim})};
  auto c = t.cos.view();
  auto s = t.sin.view();
  for (index_t p = 0; p < length; ++p) {
    for (int i = 0; i < kRopeHalf; ++i) {
      const float angle = float(p) * inv_freq[i];
      const bf16 cv(static_cast<float>(std::cos(double(angle))));
      const bf16 sv(static_cast<float>(std::sin(double(angle))));
      c(p, i) = c(p, i + kRopeHalf) = cv;
      s(p, i) = s(p, i + kRopeHalf) = sv;
    }
  }
  return t;
}

// Forward interleaved rotation in place (FP32) of x.size() rotary dims (even, <= 64), with the
// table row of one position: pair i = (x[2i], x[2i+1]) uses column i.
inline void rope_forward(std::span<float> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const float c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const float e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * s;
    x[2 * i + 1] = e * s + o * c;
  }
}

// Inverse (conjugate) interleaved rotation in place (FP32), same layout as rope_forward.
inline void rope_inverse(std::span<float> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const float c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const float e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c + o * s;
    x[2 * i + 1] = o * c - e * s;
  }
}

// Position-taking forms; `pos` must be a validated row of the table (check_rope_position).
inline void rope_forward(std::span<float> x, const RopeTableView& t, index_t pos) {
  rope_forward(x, t.cos_row(pos), t.sin_row(pos));
}
inline void rope_inverse(std::span<float> x, const RopeTableView& t, index_t pos) {
  rope_inverse(x, t.cos_row(pos), t.sin_row(pos));
}

// Validates that a table covers position `pos` (the token's rotation position).
inline void check_rope_position(std::string_view where, const RopeTableView& t, index_t pos) {
  check_range<index_t>(where, "rope position", pos, 0, t.length());
}

// Validates a table view once at an API boundary: both halves (L, >= 32) with unit inner
// stride and equal row counts, so that cos_row/sin_row can be read as plain arrays.
inline void check_rope_table(std::string_view where, const RopeTableView& t) {
  check_at_least(where, "rope.cos.extent(0)", t.cos.extent(0), index_t(0));
  check_at_least(where, "rope.cos.extent(1)", t.cos.extent(1), index_t(kRopeHalf));
  check_equal(where, "rope.sin.extent(0)", t.sin.extent(0), t.cos.extent(0));
  check_at_least(where, "rope.sin.extent(1)", t.sin.extent(1), index_t(kRopeHalf));
  check_equal(where, "rope.cos.stride(1)", t.cos.stride(1), index_t(1));
  check_equal(where, "rope.sin.stride(1)", t.sin.stride(1), index_t(1));
  if (t.cos.data() == nullptr || t.sin.data() == nullptr) {
    throw_arg(where, "rope", "null", "a table with data");
  }
}

}  // namespace tiledecode
