#pragma once
// BF16 storage type: the upper 16 bits of an IEEE-754 binary32.
// Conversion from float rounds to nearest, ties to even (spec §2); NaN stays NaN (quiet bit
// forced so rounding can never turn a NaN payload into Inf); ±Inf and ±0 are preserved.
// Widening to float is exact (a 16-bit shift).

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tiledecode {

struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() = default;
  explicit constexpr bf16(float f) : bits(round_bits(f)) {}

  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
  constexpr float to_float() const { return std::bit_cast<float>(std::uint32_t(bits) << 16); }
  explicit constexpr operator float() const { return to_float(); }

  static constexpr std::uint16_t round_bits(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet bit
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
    }
    // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. Inf stays Inf
    // (its low bits are zero); the largest finite values round up to Inf as IEEE requires.
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }

  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2);

// Round a float to the nearest BF16 value and return it as float (the "bf16(x)" of the spec).
constexpr float round_bf16(float f) {
  return bf16(f).to_float();
}

// An upper bound of the Euclidean norm of w[0], w[stride], ... (n values) as FP32: the double sum
// of the squares (each exact: a BF16 square has 16 significant bits) is within a relative 2^-40
// of the exact sum, and its square root, raised by 2^-30 and rounded one FP32 ulp up from the
// nearest, stays above the exact norm. A norm past FLT_MAX, and a NaN anywhere, give +Inf (a bound
// that trusts nothing). The rounding checks' row scales (kernels::output_projection_row_norms,
// kernels::qkv_wq_a_norms), made once at load time.
inline float bf16_norm_bound(const bf16* w, std::int64_t n, std::int64_t stride = 1) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = w[i * stride].to_float();
    s += v * v;
  }
  const double up = std::sqrt(s) * (1.0 + 0x1p-30);
  return std::isnan(up) ? kInf : std::nextafter(float(up), kInf);
}

}  // namespace tiledecode
