#pragma once
// Golden reference of the grouped W8A8 output projection (spec §8.5), plain loops:
//   o_r[t,g,:]   = o_packed[g*T+t, :] @ wo_a[g]^T                 (double accumulation → FP32)
//   a_i8, a_dq   = Q8(o_r[t,g,:])                                  per (token, group), 1024 values
//   P_g[t,n]     = Σ_r a_i8[t,g,r] * wo_b[n, g*1024 + r]            exact integer
//   attn_out[t,n] = bf16(wo_b_scale[n] * Σ_g a_dq[t,g] * P_g[t,n])   (double, then FP32 → BF16)

#include <cstdint>
#include <span>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::golden {

// Same argument order as kernels::output_projection (minus the context and workspace).
inline void output_projection(const ModelConfig& cfg, View<bf16, 2> attn_out,
                              ConstView<bf16, 2> o_packed, ConstView<bf16, 3> wo_a,
                              ConstView<std::int8_t, 2> wo_b, ConstView<float, 1> wo_b_scale) {
  constexpr std::string_view where = "golden::output_projection";
  const index_t G = cfg.o_groups, R = cfg.o_lora, K = cfg.o_group_in(), N = cfg.hidden;
  const index_t T = attn_out.extent(0);
  check_equal(where, "attn_out.extent(1)", attn_out.extent(1), N);
  check_equal(where, "o_packed.extent(0)", o_packed.extent(0), G * T);
  check_equal(where, "o_packed.extent(1)", o_packed.extent(1), K);
  check_equal(where, "wo_a.extent(0)", wo_a.extent(0), G);
  check_equal(where, "wo_a.extent(1)", wo_a.extent(1), R);
  check_equal(where, "wo_a.extent(2)", wo_a.extent(2), K);
  check_equal(where, "wo_b.extent(0)", wo_b.extent(0), N);
  check_equal(where, "wo_b.extent(1)", wo_b.extent(1), G * R);
  check_equal(where, "wo_b_scale.extent(0)", wo_b_scale.extent(0), N);

  std::vector<std::int8_t> a(static_cast<std::size_t>(T * G * R));
  std::vector<float> adq(static_cast<std::size_t>(T * G));
  std::vector<float> orow(static_cast<std::size_t>(R));
  for (index_t t = 0; t < T; ++t) {
    for (index_t g = 0; g < G; ++g) {
      for (index_t r = 0; r < R; ++r) {
        double acc = 0;
        for (index_t k = 0; k < K; ++k)
          acc += double(o_packed(g * T + t, k).to_float()) * wo_a(g, r, k).to_float();
        orow[r] = float(acc);
      }
      adq[t * G + g] = quantize_q8(std::span<std::int8_t>(a.data() + (t * G + g) * R, R), orow);
    }
  }
  for (index_t t = 0; t < T; ++t) {
    for (index_t n = 0; n < N; ++n) {
      double acc = 0;
      for (index_t g = 0; g < G; ++g) {
        std::int64_t p = 0;
        for (index_t r = 0; r < R; ++r)
          p += std::int64_t(a[(t * G + g) * R + r]) * wo_b(n, g * R + r);
        acc += double(adq[t * G + g]) * double(p);
      }
      attn_out(t, n) = bf16(float(double(wo_b_scale(n)) * acc));
    }
  }
}

}  // namespace tiledecode::golden
