#pragma once
// hc_pre / hc_post (kernels/hyper_connection.hpp) on the CPU backend.
//
// hc_pre runs in double — the mix dot products (FP32 × FP32 products are exact in double; AVX2:
// 8 lanes then a fixed horizontal sum, scalar: sequential), the RMS scale, the gates, the Sinkhorn
// iterations and the mix-in sum — and rounds to BF16 via FP32 at the end. It costs nothing at
// decode sizes (24 × 4D multiply-adds per token) and keeps x_mixed on the reference's side of BF16
// rounding boundaries (x_mixed feeds the INT8 quantisation of the q-latent, where a single flip
// upstream changes a quantised value and spreads to the whole token). The golden twin
// (golden/hyper_connection.hpp) computes the same formulas sequentially in double.
// Parallel split: the 24 mix rows (8 tasks of 3 rows, all tokens, in register tiles of 3 rows ×
// 2 tokens on AVX2: bit-identical to one dot per pair), then one task per token. hc_post is FP32
// (spec), a·post first, then the streams i = 0..3, in tasks of (token, 512-column chunk).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/kernels/hyper_connection.hpp"

namespace tiledecode::cpu {

template <Isa I>
struct backend_ops_hc_pre {
  struct Lane {
    double mix[kHcMixes], pre[4], post[4], comb[16];
  };
  // The (T, 24) double mixes.
  static std::size_t workspace_bytes(const Cpu<I>&, const ModelConfig&, index_t T) {
    return std::size_t(std::max<index_t>(T, 0)) * kHcMixes * sizeof(double) + 64;
  }
  static void check(const Cpu<I>& be, const kernels::HcPreArgs& a) {
    const std::size_t need = workspace_bytes(be, *a.cfg, a.tokens()) - 64;
    if (a.workspace.size() < need)
      throw_arg("hc_pre", "workspace.size()", a.workspace.size(),
                ">= " + std::to_string(need) + " (hc_pre_workspace_bytes)");
  }
  // The mixes scratch as (T, 24) doubles (8-byte aligned: callers pass double storage or a
  // workspace from hc_pre_workspace_bytes, whose 64 extra bytes cover the alignment).
  static View<double, 2> mix_view(const kernels::HcPreArgs& a) {
    const auto base = reinterpret_cast<std::uintptr_t>(a.workspace.data());
    std::byte* p = a.workspace.data() + (8 - base % 8) % 8;
    return View<double, 2>(reinterpret_cast<double*>(p), {a.tokens(), kHcMixes});
  }
  // Pass 1: the 24 mixes of every token; one task per 3 weight rows (fn streams once).
  static void mixes(const Cpu<I>& be, const kernels::HcPreArgs& a) {
    const View<double, 2> mixes = mix_view(a);
    const index_t T = a.tokens(), n = index_t(kHcStreams) * a.cfg->hidden;
    constexpr int kRows = 3;
    [[maybe_unused]] constexpr int kToks = 2;
    static_assert(kHcMixes % kRows == 0);
    be.tasks(kHcMixes / kRows, [&](std::int64_t task) {
      const index_t j0 = task * kRows;
      const float* f = a.w.fn.data() + j0 * a.w.fn.stride(0);
      index_t t = 0;
#if TILEDECODE_X86
      if constexpr (has_avx2(I)) {
        double s[kRows * kToks];
        for (; t + kToks <= T; t += kToks) {
          avx2::dot_f32_f64_tile<kRows, kToks>(
              s, f, a.w.fn.stride(0), a.x_hc.data() + t * a.x_hc.stride(0), a.x_hc.stride(0), n);
          for (int r = 0; r < kRows; ++r)
            for (int u = 0; u < kToks; ++u) mixes(t + u, j0 + r) = s[r * kToks + u];
        }
        for (; t < T; ++t) {
          avx2::dot_f32_f64_tile<kRows, 1>(
              s, f, a.w.fn.stride(0), a.x_hc.data() + t * a.x_hc.stride(0), a.x_hc.stride(0), n);
          for (int r = 0; r < kRows; ++r) mixes(t, j0 + r) = s[r];
        }
      }
#endif
      for (; t < T; ++t) {
        const float* x = a.x_hc.data() + t * a.x_hc.stride(0);
        for (int r = 0; r < kRows; ++r) {
          const float* fr = f + r * a.w.fn.stride(0);
          double s = 0.0;
          for (index_t k = 0; k < n; ++k) s += double(fr[k]) * double(x[k]);
          mixes(t, j0 + r) = s;
        }
      }
    });
  }
  template <class Body>
  static void for_tokens(const Cpu<I>& be, const kernels::HcPreArgs& a, Body&& body) {
    be.tasks(a.tokens(), [&](std::int64_t t) {
      Lane lane;
      body(lane, t);
    });
  }
  static void rms_scale(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    const index_t n = index_t(kHcStreams) * a.cfg->hidden;
    const float* x = a.x_hc.data() + t * a.x_hc.stride(0);
    double ss = 0.0;
#if TILEDECODE_X86
    if constexpr (has_avx2(I)) {
      ss = avx2::dot_f32_f64(x, x, n);
    } else
#endif
    {
      for (index_t k = 0; k < n; ++k) ss += double(x[k]) * double(x[k]);
    }
    const double r = 1.0 / std::sqrt(ss / double(n) + double(a.cfg->rms_eps));
    const View<double, 2> mixes = mix_view(a);
    for (int j = 0; j < kHcMixes; ++j) z.mix[j] = mixes(t, j) * r;
  }
  static void gates(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    double scale[3], base[kHcMixes];
    for (int i = 0; i < 3; ++i) scale[i] = a.w.scale(i);
    for (int j = 0; j < kHcMixes; ++j) base[j] = a.w.base(j);
    kernels::hc_gates<double>(z.pre, z.post, z.comb, z.mix, scale, base);
    for (int i = 0; i < 4; ++i) a.post(t, i) = float(z.post[i]);
    for (int i = 0; i < 4; ++i)
      for (int o = 0; o < 4; ++o) a.comb(t, i, o) = float(z.comb[i * 4 + o]);
  }
  static void mix_in(Lane& z, const kernels::HcPreArgs& a, index_t t) {
    const index_t D = a.cfg->hidden;
    const float* x = a.x_hc.data() + t * a.x_hc.stride(0);
    bf16* dst = a.x_mixed.data() + t * a.x_mixed.stride(0);
    for (index_t k = 0; k < D; ++k) {
      double s = z.pre[0] * x[k];
      s += z.pre[1] * x[D + k];
      s += z.pre[2] * x[2 * D + k];
      s += z.pre[3] * x[3 * D + k];
      dst[k] = bf16(float(s));
    }
  }
};

template <Isa I>
struct backend_ops_hc_post {
  struct Lane {};
  // One task per (token, 512-column chunk): enough tasks for any thread count.
  template <class Body>
  static void for_chunks(const Cpu<I>& be, const kernels::HcPostArgs& a, Body&& body) {
    const index_t D = a.cfg->hidden, chunk = 512, n_chunks = (D + chunk - 1) / chunk;
    be.tasks(a.tokens() * n_chunks, [&](std::int64_t task) {
      Lane lane;
      const index_t t = task / n_chunks, c0 = (task % n_chunks) * chunk;
      body(lane, t, c0, std::min(chunk, D - c0));
    });
  }
  static void combine(Lane&, const kernels::HcPostArgs& a, index_t t, index_t c0, index_t n) {
    float po[4], cb[16];
    for (int i = 0; i < 4; ++i) po[i] = a.post(t, i);
    for (int i = 0; i < 4; ++i)
      for (int o = 0; o < 4; ++o) cb[i * 4 + o] = a.comb(t, i, o);
    const bf16* at = a.attn_out.data() + t * a.attn_out.stride(0) + c0;
    const float* x = a.x_hc.data() + t * a.x_hc.stride(0) + c0;
    float* yt = a.y.data() + t * a.y.stride(0) + c0;
#if TILEDECODE_X86
    if constexpr (has_avx2(I)) {
      avx2::hc_post_row(yt, a.y.stride(1), at, x, a.x_hc.stride(1), po, cb, n);
      return;
    }
#endif
    for (int o = 0; o < 4; ++o)
      for (index_t k = 0; k < n; ++k) {
        float s = at[k].to_float() * po[o];
        for (int i = 0; i < 4; ++i) s += x[i * a.x_hc.stride(1) + k] * cb[i * 4 + o];
        yt[o * a.y.stride(1) + k] = s;
      }
  }
};

}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::HcPre, cpu::Cpu<I>> : cpu::backend_ops_hc_pre<I> {};
template <cpu::Isa I>
struct backend_ops<kernels::HcPost, cpu::Cpu<I>> : cpu::backend_ops_hc_post<I> {};
}  // namespace tiledecode
