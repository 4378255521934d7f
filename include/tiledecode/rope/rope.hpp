#pragma once
// RoPE tables and interleaved rotations (spec §5).
//
// Tables: BF16 cos/sin [L, 64]; columns 0..31 hold cos/sin(pos * inv_freq[i]), columns 32..63
// duplicate them. inv_freq[i] = base^(-2i/64) in FP32. CSA/HCA layers use base 160000 with YaRN
// (factor 16, beta_fast 32, beta_slow 1, original length 65536 → ramp low 15, high 25):
//   inv_freq[i] ← inv_freq[i]/16 * ramp[i] + inv_freq[i] * (1 - ramp[i]),
//   ramp[i] = clamp((i - low) / (high - low), 0, 1).
// Angles are pos * inv_freq in FP32, cos/sin computed in FP32 (via double, then rounded to FP32,
// so the table does not depend on the libm's float cos), then rounded to BF16.
//
// Rotation, interleaved pairs: pair i = dims (2i, 2i+1) of the 64 rotary dims, column i:
//   forward  e' = e*c - o*s ; o' = e*s + o*c
//   inverse  e' = e*c + o*s ; o' = o*c - e*s      (conjugate, spec §8.4)
// computed in FP32 with the BF16 table values.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

// Read-only view of one RoPE table pair, rows = positions.
struct RopeTableView {
  ConstView<bf16, 2> cos;  // (L, 64)
  ConstView<bf16, 2> sin;  // (L, 64)

  index_t length() const { return cos.extent(0); }
  const bf16* cos_row(index_t pos) const { return cos.data() + pos * cos.stride(0); }
  const bf16* sin_row(index_t pos) const { return sin.data() + pos * sin.stride(0); }
};

// Owning RoPE table for one layer kind.
struct RopeTable {
  Tensor<bf16, 2> cos;
  Tensor<bf16, 2> sin;
  RopeTableView view() const { return {cos.view(), sin.view()}; }
};

// The 32 inverse frequencies of a layer kind (FP32, spec §5).
inline void rope_inv_freq(std::span<float, 32> inv_freq, const ModelConfig& cfg, LayerKind kind) {
  const bool yarn = kind != LayerKind::swa;
  const float base = yarn ? cfg.compress_rope_theta : cfg.rope_theta;
  const int dim = cfg.rope_dim;
  for (int i = 0; i < dim / 2; ++i) {
    inv_freq[i] = 1.0f / std::pow(base, float(2 * i) / float(dim));
  }
  if (!yarn) return;
  // Correction range of YaRN: dims whose wavelength lies between orig_len/beta_fast and
  // orig_len/beta_slow are blended linearly.
  const double two_pi = 6.283185307179586;
  const auto corr_dim = [&](double rotations) {
    return dim * std::log(cfg.yarn_orig_len / (rotations * two_pi)) / (2 * std::log(double(base)));
  };
  const double low = std::max(0.0, std::floor(corr_dim(cfg.yarn_beta_fast)));
  const double high = std::min(double(dim - 1), std::ceil(corr_dim(cfg.yarn_beta_slow)));
  for (int i = 0; i < dim / 2; ++i) {
    const float ramp = std::clamp(float((i - low) / std::max(high - low, 1e-3)), 0.0f, 1.0f);
    inv_freq[i] = inv_freq[i] / cfg.yarn_factor * ramp + inv_freq[i] * (1.0f - ramp);
  }
}

// Builds the BF16 cos/sin tables [length, 64] for a layer kind (SWA: no YaRN; CSA/HCA: YaRN).
inline RopeTable make_rope_table(const ModelConfig& cfg, LayerKind kind, index_t length) {
  check_range<index_t>("make_rope_table", "length", length, 1, index_t(1) << 24);
  float inv_freq[32];
  rope_inv_freq(inv_freq, cfg, kind);
  const int half = cfg.rope_dim / 2;
  RopeTable t{Tensor<bf16, 2>({length, cfg.rope_dim}), Tensor<bf16, 2>({length, cfg.rope_dim})};
  auto c = t.cos.view();
  auto s = t.sin.view();
  for (index_t p = 0; p < length; ++p) {
    for (int i = 0; i < half; ++i) {
      const float angle = float(p) * inv_freq[i];
      const bf16 cv(static_cast<float>(std::cos(double(angle))));
      const bf16 sv(static_cast<float>(std::sin(double(angle))));
      c(p, i) = c(p, i + half) = cv;
      s(p, i) = s(p, i + half) = sv;
    }
  }
  return t;
}

// Forward interleaved rotation of 64 rotary dims in place (FP32), table row of one position.
inline void rope_forward(std::span<float> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const float c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const float e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * s;
    x[2 * i + 1] = e * s + o * c;
  }
}

// Inverse (conjugate) interleaved rotation of 64 rotary dims in place (FP32).
inline void rope_inverse(std::span<float> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const float c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const float e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c + o * s;
    x[2 * i + 1] = o * c - e * s;
  }
}

// Validates that a table covers position `pos` (the token's rotation position).
inline void check_rope_position(std::string_view where, const RopeTableView& t, index_t pos) {
  check_range<index_t>(where, "rope position", pos, 0, t.length());
}

}  // namespace tiledecode
