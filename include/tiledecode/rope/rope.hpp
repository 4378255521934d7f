#pragma once
// RoPE tables and interleaved rotations (spec §5, HEAD addendum §4).
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
// Angles (default, RopeAngles::fp32_reference) are pos * inv_freq in FP32 (so a large position
// carries the FP32 rounding of the product, exactly like the reference); cos/sin of that FP32
// angle are evaluated in double and rounded to FP32 (so the table does not depend on the libm's
// float cos: glibc's cosf/sinf differ from the correctly rounded FP32 value in 13 resp. 19 of the
// 2^26 entries of a 2^20-row table), then to BF16.
//
// Dual profiles (addendum §4.1, superseding spec §11.8's single SWA-profile table):
//   profile 0 (RopeProfile::base)     rope_theta = 10000, no YaRN: SWA layers (flash layers 0, 1)
//                                     and the MTP draft layer (compress ratio 0, i.e. its
//                                     LayerKind is swa: rope_profile(LayerKind::swa) == base);
//   profile 1 (RopeProfile::compress) compress_rope_theta = 160000 with YaRN: every CSA and HCA
//                                     layer and every rotary consumer inside it (q, kv, main
//                                     compressor rows, indexer query, inner compressor, inverse
//                                     RoPE) — one table per layer, never mixed.
// rope_profile(kind) maps a layer kind to its profile; RopeTables holds both profiles stacked as
// the reference's [2, L, 64] cos/sin and hands each layer its [L, 64] profile by kind.
// Token-local rows (addendum §4.2): fill_rope_rows writes the rows of given positions into a
// caller's [T, 64] (or [T, 32]) buffer, bit-identical to the table rows, so a 1M-context layer
// needs no 1M table (a [2, 2^20, 64] BF16 cos+sin pair is 512 MiB; one profile 256 MiB).
//
// [AMBIGUOUS] FP32 vs exact angles at long context (addendum §4.1, ambiguity register item 6).
// The reference semantics are the FP32 angle fl(fl(pos) * inv_freq); at 2^20 positions its ulp
// is 2^-4 rad for the fast pairs (angles in [2^19, 2^20)), so it rounds by up to 2^-5 rad.
// Measured over every position in [0, 2^20) and every column (flash config, 2^26 cos+sin entries
// per profile), BF16 entries of the FP32 angle vs the BF16 (one RNE rounding) of cos/sin of the
// exactly computed angle (pos * inv_freq in double: exact, 44 significant bits):
//                                   profile 0 (base)          profile 1 (compress, YaRN)
//   inv_freq = the spec's FP32 value
//     entries that differ          10,949,215 (16.3 %)        8,216,657 (12.2 %)
//       of them at pos < 65536        124,291                     91,961
//       of them at pos < 16384         10,572 (1.0 %)              7,792 (0.7 %)
//     max |angle error|            0.03125 rad (col 1)        0.03125 rad (col 1)
//     max |entry difference|       0.0315 (8 BF16 ulps at 1)  0.0314
//   inv_freq in double (the unrounded formula)
//     entries that differ          13,373,870 (19.9 %)        9,483,459 (14.1 %)
//     max |angle error|            0.0392 rad                 0.0553 rad
// (Column 0 has inv_freq = 1 and exact angles; its 17 differing rows per profile are the double
// rounding double → FP32 → BF16 of the reference path, which ≈ 500 rows per profile show.)
// Max |table − cos/sin(exact angle)|: 0.0315 for fp32_reference, 0.00195 (half a BF16 ulp) for
// exact. Below 16384 (the kernels' budget) both agree to one BF16 ulp (max angle error 4.9e-4).
// Decision: the default stays RopeAngles::fp32_reference. The angle is *defined* as FP32 by
// the reference (addendum §4.1 recommends it) and by the usual PyTorch table precompute (FP32
// positions × FP32 inv_freq) of the engines a decode step is compared with; the "lost bits" are
// part of the positional encoding the weights were used with, and an exact table would differ
// from the reference in 12-16 % of the entries at 1M by up to 8 BF16 ulps. The table *generation*
// is already in double (cos/sin of the FP32 angle), so no further bits are lost by the builder.
// RopeAngles::exact (cos/sin of the exact angle pos · inv_freq, inv_freq still the spec's FP32
// value, rounded once to BF16: within half a BF16 ulp of the true value at every position
// < 2^24) is available to every builder for studies and engines that generate tables that way;
// tests/test_rope.cpp checks both against independent golden definitions (golden/rope.hpp),
// at sampled positions up to 2^20 in CI and over the full [0, 2^20) sweep with
// TILEDECODE_LONG_TESTS=1. kDefaultRopeAngles is the one place the default is chosen.
//
// Build cost (measured on the 2-core CI box, Release): a 2^20-row profile is 2^25 double sincos,
// ≈ 0.85-1.1 CPU-seconds (1.0-2.4 s wall depending on the box's load), plus ≈ 0.1 s to allocate
// and zero its 256 MiB; RopeTables at 2^20 (both profiles, 512 MiB) twice that. The builders take
// an optional Executor: rows are split into fixed 4096-row tasks (257 per 2^20-row profile) and
// each entry is a pure function of (profile, mode, pos, column), so the result is bit-identical
// for any thread count. The 64-wide duplicated layout is kept because the kernels validate it
// (qkv_projection, indexer: rope.cos.extent(1) == 64) and the a2a3 model copies 64-wide rows;
// the rotations themselves read only columns 0..31, so fill_rope_table and fill_rope_rows also
// accept 32-wide destinations (half the memory) for consumers that want them.
//
// Rotation, interleaved pairs: pair i = dims (2i, 2i+1) of the 64 rotary dims, column i:
//   forward  e' = e*c - o*s ; o' = e*s + o*c
//   inverse  e' = e*c + o*s ; o' = o*c - e*s      (conjugate, spec §8.4)
// computed in FP32 with the BF16 table values. The rotary dims are the LAST 64 dims of a
// 512-wide head (dims 448..511) and dims 64..127 of a 128-wide indexer head; callers pass the
// 64-float span.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

// Rotary dims per head (the tables' width) and frequency columns.
inline constexpr int kRopeDim = 64;
inline constexpr int kRopeHalf = kRopeDim / 2;
// Longest table / largest position the builders accept: positions are exact in FP32 below 2^24
// (and pos · inv_freq is then exact in double).
inline constexpr index_t kRopeMaxLength = index_t(1) << 24;

// The two RoPE profiles of addendum §4.1 (values = the index in the stacked [2, L, 64] tables).
enum class RopeProfile : std::uint8_t { base = 0, compress = 1 };
inline constexpr int kRopeProfiles = 2;

// Profile of a layer kind: SWA (and the MTP draft layer, whose kind is swa) → base; CSA, HCA →
// compress.
constexpr RopeProfile rope_profile(LayerKind k) {
  return k == LayerKind::swa ? RopeProfile::base : RopeProfile::compress;
}
constexpr std::string_view to_string(RopeProfile p) {
  return p == RopeProfile::base ? "base" : (p == RopeProfile::compress ? "compress" : "invalid");
}

// How table angles are computed ([AMBIGUOUS] addendum §4.1; see the header comment).
enum class RopeAngles : std::uint8_t {
  fp32_reference = 0,  // angle = fl(fl(pos) * inv_freq); bf16(fp32(cos/sin(angle)))
  exact = 1,           // angle = pos * inv_freq exactly; BF16 RNE of cos/sin(angle)
};
inline constexpr RopeAngles kDefaultRopeAngles = RopeAngles::fp32_reference;
constexpr std::string_view to_string(RopeAngles a) {
  return a == RopeAngles::fp32_reference ? "fp32_reference"
                                         : (a == RopeAngles::exact ? "exact" : "invalid");
}

// Read-only view of one RoPE table pair, rows = positions.
struct RopeTableView {
  ConstView<bf16, 2> cos;  // (L, 64)
  ConstView<bf16, 2> sin;  // (L, 64)

  // Positions both halves cover (a short sin half must never be read past its end).
  index_t length() const { return std::min(cos.extent(0), sin.extent(0)); }
  const bf16* cos_row(index_t pos) const { return cos.data() + pos * cos.stride(0); }
  const bf16* sin_row(index_t pos) const { return sin.data() + pos * sin.stride(0); }
};

// Owning RoPE table of one profile (make_rope_table).
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
inline void check_rope_profile(std::string_view where, RopeProfile p) {
  check_range<int>(where, "profile", static_cast<int>(p), 0, kRopeProfiles);
}
inline void check_rope_angles(std::string_view where, RopeAngles a) {
  check_range<int>(where, "angles", static_cast<int>(a), 0, 2);
}

// BF16 nearest (ties to even) a double, rounded once: RNE to FP32 first is exact unless it
// lands on a BF16 midpoint that the double was not on; then the double decides the side.
inline bf16 bf16_nearest(double d) {
  const float f = static_cast<float>(d);
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0xffffu) == 0x8000u && double(f) != d) {
    const auto down = static_cast<std::uint16_t>(u >> 16);  // toward zero
    return bf16::from_bits(std::fabs(d) > std::fabs(double(f)) ? std::uint16_t(down + 1) : down);
  }
  return bf16(f);
}

// cos/sin of one column at one position under an angle mode.
template <RopeAngles A>
inline void rope_entry(float inv_freq, index_t pos, bf16& c, bf16& s) {
  if constexpr (A == RopeAngles::fp32_reference) {
    const float angle = float(pos) * inv_freq;
    c = bf16(static_cast<float>(std::cos(double(angle))));
    s = bf16(static_cast<float>(std::sin(double(angle))));
  } else {
    const double angle = double(pos) * double(inv_freq);  // exact below 2^29
    c = bf16_nearest(std::cos(angle));
    s = bf16_nearest(std::sin(angle));
  }
}

// One row (32 or 64 wide; 64 duplicates columns 0..31 into 32..63).
template <RopeAngles A>
inline void rope_row(bf16* c, bf16* s, index_t width, const float* inv_freq, index_t pos) {
  for (int i = 0; i < kRopeHalf; ++i) {
    rope_entry<A>(inv_freq[i], pos, c[i], s[i]);
    if (width == kRopeDim) {
      c[i + kRopeHalf] = c[i];
      s[i + kRopeHalf] = s[i];
    }
  }
}

// Validates a destination pair of `rows` rows: width 32 or 64, equal shapes, unit inner stride,
// rows not overlapping, data present.
inline void check_rope_dest(std::string_view where, const View<bf16, 2>& cos,
                            const View<bf16, 2>& sin, index_t rows) {
  check_equal(where, "cos.extent(0)", cos.extent(0), rows);
  check_equal(where, "sin.extent(0)", sin.extent(0), rows);
  if (cos.extent(1) != kRopeHalf && cos.extent(1) != kRopeDim) {
    throw_arg(where, "cos.extent(1)", cos.extent(1), "32 or 64");
  }
  check_equal(where, "sin.extent(1)", sin.extent(1), cos.extent(1));
  check_equal(where, "cos.stride(1)", cos.stride(1), index_t(1));
  check_equal(where, "sin.stride(1)", sin.stride(1), index_t(1));
  if (rows > 1) {
    check_at_least(where, "cos.stride(0)", cos.stride(0), cos.extent(1));
    check_at_least(where, "sin.stride(0)", sin.stride(0), sin.extent(1));
  }
  if (rows > 0 && (cos.data() == nullptr || sin.data() == nullptr)) {
    throw_arg(where, "cos/sin", "null", "views with data");
  }
}

// Fills rows [0, rows) with row r serving position pos_of(r), on `ex` (nullptr: inline) in
// fixed tasks of 4096 rows.
template <class PosOf>
inline void fill_rope(View<bf16, 2> cos, View<bf16, 2> sin, const float* inv_freq,
                      RopeAngles angles, index_t rows, Executor* ex, const PosOf& pos_of) {
  constexpr index_t kRowsPerTask = 4096;
  const index_t width = cos.extent(1);
  const auto task = [&](std::size_t k) {
    const index_t lo = index_t(k) * kRowsPerTask;
    const index_t hi = std::min(rows, lo + kRowsPerTask);
    for (index_t r = lo; r < hi; ++r) {
      bf16* c = cos.data() + r * cos.stride(0);
      bf16* s = sin.data() + r * sin.stride(0);
      if (angles == RopeAngles::fp32_reference) {
        rope_row<RopeAngles::fp32_reference>(c, s, width, inv_freq, pos_of(r));
      } else {
        rope_row<RopeAngles::exact>(c, s, width, inv_freq, pos_of(r));
      }
    }
  };
  const auto n_tasks = static_cast<std::size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
  if (ex == nullptr || n_tasks <= 1) {
    for (std::size_t k = 0; k < n_tasks; ++k) task(k);
  } else {
    ex->run(n_tasks, FunctionRef(task));
  }
}
}  // namespace detail

// The 32 inverse frequencies of a profile (FP32, spec §5).
inline void rope_inv_freq(std::span<float, 32> inv_freq, const ModelConfig& cfg,
                          RopeProfile profile) {
  detail::check_rope_config("rope_inv_freq", cfg);
  detail::check_rope_profile("rope_inv_freq", profile);
  const bool yarn = profile == RopeProfile::compress;
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

// The 32 inverse frequencies of a layer kind (its profile: SWA base, CSA/HCA compress).
inline void rope_inv_freq(std::span<float, 32> inv_freq, const ModelConfig& cfg, LayerKind kind) {
  rope_inv_freq(inv_freq, cfg, rope_profile(kind));
}

// Fills a caller's table pair (L, 64) or (L, 32): row p serves position p, L in [1, 2^24].
// Validates everything before the first write; `ex` (optional) parallelises over fixed row
// tasks (bit-identical for any executor). Not a hot path: once per model load.
inline void fill_rope_table(View<bf16, 2> cos, View<bf16, 2> sin, const ModelConfig& cfg,
                            RopeProfile profile, RopeAngles angles = kDefaultRopeAngles,
                            Executor* ex = nullptr) {
  constexpr std::string_view where = "fill_rope_table";
  detail::check_rope_config(where, cfg);
  detail::check_rope_profile(where, profile);
  detail::check_rope_angles(where, angles);
  check_range<index_t>(where, "cos.extent(0)", cos.extent(0), 1, kRopeMaxLength + 1);
  detail::check_rope_dest(where, cos, sin, cos.extent(0));
  float inv_freq[kRopeHalf];
  rope_inv_freq(inv_freq, cfg, profile);
  detail::fill_rope(cos, sin, inv_freq, angles, cos.extent(0), ex, [](index_t r) { return r; });
}

// Token-local rows (addendum §4.2): row t of cos/sin (T, 64) or (T, 32) = the table row of
// positions[t] (bit-identical to fill_rope_table's), without a table. Positions in [0, 2^24).
// Validates everything before the first write; allocation-free (usable in a decode step).
inline void fill_rope_rows(View<bf16, 2> cos, View<bf16, 2> sin,
                           ConstView<std::int32_t, 1> positions, const ModelConfig& cfg,
                           RopeProfile profile, RopeAngles angles = kDefaultRopeAngles) {
  constexpr std::string_view where = "fill_rope_rows";
  detail::check_rope_config(where, cfg);
  detail::check_rope_profile(where, profile);
  detail::check_rope_angles(where, angles);
  const index_t T = positions.extent(0);
  detail::check_rope_dest(where, cos, sin, T);
  if (T > 0 && positions.data() == nullptr) throw_arg(where, "positions", "null", "a view");
  for (index_t t = 0; t < T; ++t) {
    check_range<index_t>(where, "positions[t]", positions(t), 0, kRopeMaxLength);
  }
  float inv_freq[kRopeHalf];
  rope_inv_freq(inv_freq, cfg, profile);
  detail::fill_rope(cos, sin, inv_freq, angles, T, nullptr,
                    [&](index_t t) { return index_t(positions(t)); });
}

// Builds the BF16 cos/sin tables [length, 64] of a profile. Row p serves position p; `length`
// is normally cfg.max_seq_len (up to 2^24; 2^20 for the 1M HCA/SWA layers of addendum §1.3).
inline RopeTable make_rope_table(const ModelConfig& cfg, RopeProfile profile, index_t length,
                                 RopeAngles angles = kDefaultRopeAngles, Executor* ex = nullptr) {
  detail::check_rope_config("make_rope_table", cfg);
  detail::check_rope_profile("make_rope_table", profile);
  detail::check_rope_angles("make_rope_table", angles);
  check_range<index_t>("make_rope_table", "length", length, 1, kRopeMaxLength + 1);
  RopeTable t{Tensor<bf16, 2>({length, kRopeDim}), Tensor<bf16, 2>({length, kRopeDim})};
  fill_rope_table(t.cos.view(), t.sin.view(), cfg, profile, angles, ex);
  return t;
}

// Builds the tables [length, 64] for a layer kind (SWA: base, no YaRN; CSA/HCA: YaRN).
inline RopeTable make_rope_table(const ModelConfig& cfg, LayerKind kind, index_t length,
                                 RopeAngles angles = kDefaultRopeAngles, Executor* ex = nullptr) {
  return make_rope_table(cfg, rope_profile(kind), length, angles, ex);
}

// Both profiles of addendum §4.1, stacked like the reference's freqs_cos/freqs_sin
// [2, L, 64] BF16 (profile 0 = base, 1 = compress). A layer takes its profile by kind:
//   decode::layer_step(..., rope.profile(w.kind), ...)
// SWA and the MTP draft layer (kind swa) get profile 0, CSA and HCA layers profile 1.
class RopeTables {
 public:
  RopeTables() = default;
  // length in [1, 2^24]; 2^20 rows (both profiles) take 512 MiB.
  RopeTables(const ModelConfig& cfg, index_t length, RopeAngles angles = kDefaultRopeAngles,
             Executor* ex = nullptr)
      : angles_(angles) {
    constexpr std::string_view where = "RopeTables";
    detail::check_rope_config(where, cfg);
    detail::check_rope_angles(where, angles);
    check_range<index_t>(where, "length", length, 1, kRopeMaxLength + 1);
    cos_ = Tensor<bf16, 3>({kRopeProfiles, length, kRopeDim});
    sin_ = Tensor<bf16, 3>({kRopeProfiles, length, kRopeDim});
    for (int p = 0; p < kRopeProfiles; ++p) {
      fill_rope_table(cos_.view().row(p), sin_.view().row(p), cfg, RopeProfile(p), angles, ex);
    }
  }

  index_t length() const { return cos_.extent(1); }
  RopeAngles angles() const { return angles_; }
  // Memory held (cos + sin, both profiles).
  std::size_t bytes() const { return (cos_.size() + sin_.size()) * sizeof(bf16); }

  // The [L, 64] table of a profile; throws tiledecode::Error on a profile other than 0, 1 or
  // on a default-constructed holder.
  RopeTableView profile(int p) const {
    check_range<int>("RopeTables::profile", "profile", p, 0, kRopeProfiles);
    if (length() == 0) throw_arg("RopeTables::profile", "tables", "empty", "built tables");
    return {cos_.view().row(p), sin_.view().row(p)};
  }
  RopeTableView profile(RopeProfile p) const { return profile(static_cast<int>(p)); }
  // The table of a layer kind (SWA → 0, CSA/HCA → 1).
  RopeTableView profile(LayerKind k) const { return profile(rope_profile(k)); }

  // The stacked [2, L, 64] pair (the reference's ABI for the forward / the MTP entry).
  ConstView<bf16, 3> stacked_cos() const { return cos_.view(); }
  ConstView<bf16, 3> stacked_sin() const { return sin_.view(); }

 private:
  Tensor<bf16, 3> cos_;
  Tensor<bf16, 3> sin_;
  RopeAngles angles_ = kDefaultRopeAngles;
};

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

// Forward interleaved rotation of n dims in double with the BF16 table row (spec §5): the fast
// paths' epilogues, whose results are rounded once to FP32 (then BF16 or INT8).
inline void rope_forward_f64(double* x, const bf16* cos_row, const bf16* sin_row, index_t n) {
  for (index_t i = 0; i < n / 2; ++i) {
    const double c = cos_row[i].to_float(), sn = sin_row[i].to_float();
    const double e = x[2 * i], o = x[2 * i + 1];
    x[2 * i] = e * c - o * sn;
    x[2 * i + 1] = e * sn + o * c;
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
