#pragma once
// Per-row symmetric INT8 quantiser Q8 of spec §2:
//   amax = max(max_i |x_i|, 1e-4); sq = 127 / amax; q_i = round_half_even(x_i * sq); dq = 1 / sq
// `x_i * sq` is computed in FP32 exactly as written (one multiply, then rint), so results are
// bit-identical to the reference. |x_i * sq| <= 127 up to one rounding of the product, and a
// product that rounds to 127.00001 still rints to 127, so the cast never overflows int8.
// Non-finite rows (docs/security.md, "Numerics policy"): amax is a reduction and propagates NaN,
// so a NaN anywhere in the row gives dq = NaN and every q_i = -127 (the clamp of rint(NaN));
// an Inf (and no NaN) gives amax = +Inf, sq = 0, dq = +Inf, q_i = 0 for finite x_i and -127 for
// ±Inf (Inf · 0 = NaN). Every output computed from dq is then NaN / ±Inf, as IEEE arithmetic on
// the unquantised row would be. amax is the maximum of the bit patterns of |x_i| (for
// non-negative floats the integer order is the float order, and every NaN lies above +Inf): the
// AVX2 twin (cpu::avx2::quantize_q8_avx2) takes the same maximum, so both return the same dq
// bits, NaN payload included.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace tiledecode {

inline constexpr float kInt8ScaleMax = 127.0f;
inline constexpr float kInt8AmaxEps = 1e-4f;

// Quantises `x` into `q`; returns the FP32 dequant scale dq = 1 / (127 / amax).
inline float quantize_q8(std::span<std::int8_t> q, std::span<const float> x) {
  std::uint32_t amax_bits = 0;
  for (float v : x) amax_bits = std::max(amax_bits, std::bit_cast<std::uint32_t>(v) & 0x7fffffffu);
  float amax = std::bit_cast<float>(amax_bits);
  amax = amax < kInt8AmaxEps ? kInt8AmaxEps : amax;  // NaN stays NaN
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
