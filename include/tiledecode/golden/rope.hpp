#pragma once
// Golden RoPE (spec §5), written from the formulas in double precision, independent of
// rope/rope.hpp's FP32 table construction:
//   inv_freq[i] = base^(-2i/64); YaRN (CSA/HCA): low/high from the correction-dim formula,
//   ramp = clamp((i-low)/(high-low), 0, 1), inv_freq ← inv_freq/factor*ramp + inv_freq*(1-ramp)
//   angle = pos * inv_freq[i]; table value = cos/sin(angle) (exact, not rounded)
// and the interleaved forward / inverse rotations of a 64-dim span in double with given table
// values (the golden compressors and attention apply the library's BF16 table through these).
//
// The two table definitions of addendum §4.1's [AMBIGUOUS] angle note, each written from its
// formula (tests hold the library's RopeAngles modes to them):
//   reference: inv_freq in FP32 (the spec's arithmetic: FP32 power, reciprocal, YaRN mix),
//              angle = fl(fl(pos) * inv_freq), value = bf16(fp32(cos/sin(angle)))
//   exact:     the same FP32 inv_freq, angle = pos * inv_freq without rounding (long double),
//              value = the BF16 nearest cos/sin(angle) (one rounding, ties to even)
// Profiles (addendum §4.1): SWA (and the MTP layer, kind swa) use rope_theta without YaRN,
// CSA/HCA compress_rope_theta with YaRN — the `kind` argument selects it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"

namespace tiledecode::golden {

// YaRN correction range (low, high) of the frequency columns, in double.
inline void rope_yarn_range(const ModelConfig& cfg, double& low, double& high) {
  const double pi = 3.14159265358979323846;
  const double d = cfg.rope_dim, base = cfg.compress_rope_theta, orig = cfg.yarn_orig_len;
  low = std::floor(d * std::log(orig / (cfg.yarn_beta_fast * 2 * pi)) / (2 * std::log(base)));
  high = std::ceil(d * std::log(orig / (cfg.yarn_beta_slow * 2 * pi)) / (2 * std::log(base)));
  low = std::max(low, 0.0);
  high = std::min(high, d - 1);
}

// inv_freq[i] in double for a layer kind (SWA: base rope_theta, no YaRN).
inline double rope_inv_freq(const ModelConfig& cfg, LayerKind kind, int i) {
  const bool yarn = kind != LayerKind::swa;
  const double base = yarn ? cfg.compress_rope_theta : cfg.rope_theta;
  const double f = std::pow(base, -2.0 * i / cfg.rope_dim);
  if (!yarn) return f;
  double low = 0, high = 0;
  rope_yarn_range(cfg, low, high);
  const double ramp = std::clamp((i - low) / (high == low ? 1e-3 : high - low), 0.0, 1.0);
  return f / cfg.yarn_factor * ramp + f * (1 - ramp);
}

// Exact cos / sin of column i (0..63; columns 32..63 repeat 0..31) at a position.
inline double rope_cos(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return std::cos(double(pos) * rope_inv_freq(cfg, kind, col % (cfg.rope_dim / 2)));
}
inline double rope_sin(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return std::sin(double(pos) * rope_inv_freq(cfg, kind, col % (cfg.rope_dim / 2)));
}

// inv_freq[i] as the spec computes it in FP32: fp32(base^(2i/64)) (the power correctly rounded
// to FP32, via double), its FP32 reciprocal, and the YaRN blend in FP32 for CSA/HCA.
inline float rope_inv_freq_fp32(const ModelConfig& cfg, LayerKind kind, int i) {
  const bool yarn = kind != LayerKind::swa;
  const double base = yarn ? cfg.compress_rope_theta : cfg.rope_theta;
  const float exponent = float(2 * i) / float(cfg.rope_dim);
  const float power = static_cast<float>(std::pow(base, double(exponent)));
  const float f = 1.0f / power;
  if (!yarn) return f;
  double low = 0, high = 0;
  rope_yarn_range(cfg, low, high);
  const float ramp = std::clamp(float((i - low) / (high == low ? 1e-3 : high - low)), 0.0f, 1.0f);
  const float interpolated = f / cfg.yarn_factor;
  return interpolated * ramp + f * (1.0f - ramp);
}

// The reference angle fl(fl(pos) * inv_freq_fp32) of column col (0..63).
inline float rope_angle_fp32(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  const float p = static_cast<float>(pos);
  return p * rope_inv_freq_fp32(cfg, kind, col % (cfg.rope_dim / 2));
}

// The BF16 value nearest x (ties to even), by scaling x to an 8-bit significand.
inline float bf16_nearest(long double x) {
  if (x == 0 || !std::isfinite(x)) return static_cast<float>(x);
  const int e = std::ilogb(x);                                 // |x| in [2^e, 2^(e+1))
  const long double scaled = std::ldexp(std::fabs(x), 7 - e);  // in [128, 256), exact
  long double r = std::floor(scaled);
  const long double frac = scaled - r;
  if (frac > 0.5L || (frac == 0.5L && std::fmod(r, 2.0L) != 0)) r += 1;
  return static_cast<float>(std::copysign(std::ldexp(r, e - 7), x));
}

// Table values (as float) of the two definitions above.
inline float rope_cos_reference(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return bf16(static_cast<float>(std::cos(double(rope_angle_fp32(cfg, kind, pos, col)))))
      .to_float();
}
inline float rope_sin_reference(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return bf16(static_cast<float>(std::sin(double(rope_angle_fp32(cfg, kind, pos, col)))))
      .to_float();
}
// The exact angle pos * inv_freq_fp32 and its cos/sin, in long double.
inline long double rope_angle_exact(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return static_cast<long double>(pos) *
         static_cast<long double>(rope_inv_freq_fp32(cfg, kind, col % (cfg.rope_dim / 2)));
}
inline float rope_cos_exact(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return bf16_nearest(std::cos(rope_angle_exact(cfg, kind, pos, col)));
}
inline float rope_sin_exact(const ModelConfig& cfg, LayerKind kind, long pos, int col) {
  return bf16_nearest(std::sin(rope_angle_exact(cfg, kind, pos, col)));
}

// Forward interleaved rotation in double: pair i = (x[2i], x[2i+1]), column i of the row.
inline void rope_forward(std::span<double> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const double c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const double e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * s;
    x[2 * i + 1] = e * s + o * c;
  }
}

// Inverse (conjugate) interleaved rotation in double.
inline void rope_inverse(std::span<double> x, const bf16* cos_row, const bf16* sin_row) {
  for (std::size_t i = 0; i < x.size() / 2; ++i) {
    const double c = cos_row[i].to_float(), s = sin_row[i].to_float();
    const double e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c + o * s;
    x[2 * i + 1] = o * c - e * s;
  }
}

}  // namespace tiledecode::golden
