#pragma once
// Per-row symmetric INT8 quantiser Q8 of spec §2:
//   amax = max(max_i |x_i|, 1e-4); sq = 127 / amax; q_i = round_half_even(x_i * sq); dq = 1 / sq
// `x_i * sq` is computed in FP32 exactly as written (one multiply, then rint), so results are
// bit-identical to the reference. |x_i * sq| <= 127 up to one rounding of the product, and a
// product that rounds to 127.00001 still rints to 127, so the cast never overflows int8.
// NaN policy: a NaN in the row makes amax NaN-free (fmax ignores NaN) but its own q is
// unspecified; callers that must reject NaN check before quantising (see the kernel headers).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace tiledecode {

inline constexpr float kInt8ScaleMax = 127.0f;
inline constexpr float kInt8AmaxEps = 1e-4f;

// Quantises `x` into `q`; returns the FP32 dequant scale dq = 1 / (127 / amax).
inline float quantize_q8(std::span<std::int8_t> q, std::span<const float> x) {
  float amax = 0.0f;
  for (float v : x) amax = std::fmax(amax, std::fabs(v));
  amax = std::fmax(amax, kInt8AmaxEps);
  const float sq = kInt8ScaleMax / amax;
  for (std::size_t i = 0; i < x.size(); ++i) {
    // std::nearbyint honours the default rounding mode, round-half-to-even.
    float r = std::nearbyint(x[i] * sq);
    r = std::fmin(std::fmax(r, -kInt8ScaleMax), kInt8ScaleMax);
    q[i] = static_cast<std::int8_t>(r);
  }
  return 1.0f / sq;
}

}  // namespace tiledecode
