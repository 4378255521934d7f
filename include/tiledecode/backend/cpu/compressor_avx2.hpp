#pragma once
// AVX2 + FMA microkernels of the compressors (spec §6), reached only through the runtime
// dispatch on ctx.isa in kernels/compressor.hpp. Each has a scalar twin there with the same
// loop structure; both are tested against golden/compressor.hpp.
//
//   compressor_project_rows   out[t, r] = Σ_k x[t, k] * w[r, k]   (BF16 weights, FP32 x/acc)
//   compressor_pool_channels  per-channel softmax-gated pooling over a window of state rows
//   compressor_hadamard_row   z = y @ H for one 128-wide indexer row
//
// The three work on raw pointers with explicit leading dimensions: the caller validated every
// extent and stride, the kernels never check, allocate or throw.

#include <algorithm>
#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

// Projection tiling shared by the AVX2 kernel and its scalar twin (kernels/compressor.hpp).
// A task owns kCompressorRowBlock weight rows (16 × 8 KB at D = 4096) and makes one sequential
// pass over each row per group of 8 tokens, the group's 8 accumulators in registers. With one
// group (T <= 8, the decode step) the weights stream from DRAM exactly once; with more groups the
// block's 128 KB is re-read from L2. x (8 × 16 KB per group) is read from L2 by every row: the
// measured per-block rate is the same for T = 8..128 (K-blocking x into L1 was no faster: the
// FMAs, not L2, bound this loop, and blocked weight slices alias in L1 sets).
inline constexpr int kCompressorRowBlock = 16;
inline constexpr int kCompressorTokenGroup = 8;
inline constexpr int kCompressorPrefetch = 512;  // BF16 elements ahead (1 KB)
// Candidates per online-softmax chunk in the pooling (one max, one rescale per chunk).
inline constexpr int kCompressorPoolChunk = 8;

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// e^x for 8 floats, ~2 ulp over the range the pooling uses (x <= 0). Cody–Waite reduction
// x = n·ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n assembled in the exponent
// field. Inputs below ln(FLT_MIN) return 0 (the softmax weight of a masked candidate; no
// denormals), inputs above 88 saturate at e^88.
TILEDECODE_TARGET_AVX2 inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 hi = _mm256_set1_ps(88.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

// acc[t] += Σ_k w[k] * x[t*ld_x + k] over k < n (n % 8 == 0), for NT tokens, lane-wise: lane l
// of acc[t] sums k ≡ l (mod 8) in ascending k. One BF16 weight load (widened by a shift) feeds NT
// FMAs whose x operands come from L1/L2. The weights are touched once per step and come from
// DRAM: a software prefetch kCompressorPrefetch elements (1 KB) ahead, one per 64-byte line,
// keeps enough lines in flight for the FMAs to stay busy (measured +20 % over the hardware
// prefetcher alone on the dev machine).
template <int NT>
TILEDECODE_TARGET_AVX2 inline void project_tile(__m256* acc, const bf16* w, const float* x,
                                                index_t ld_x, index_t n) {
  __m256 a[NT];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) a[t] = acc[t];
  index_t k = 0;
  for (; k + 32 <= n; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k + kCompressorPrefetch), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < 32; u += 8) {
      const __m256 vw = load_bf16x8(w + k + u);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        a[t] = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x + t * ld_x + k + u), a[t]);
      }
    }
  }
  for (; k < n; k += 8) {
    const __m256 vw = load_bf16x8(w + k);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      a[t] = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x + t * ld_x + k), a[t]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) acc[t] = a[t];
}

// out[t*ld_out + r] = Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k] for t < n_tok, r < n_rows
// (d % 8 == 0). Each output is one lane-wise ascending-k FMA chain followed by a fixed-order
// horizontal sum, so the result depends only on the shape.
TILEDECODE_TARGET_AVX2 inline void compressor_project_rows(float* out, index_t ld_out,
                                                           const float* x, index_t ld_x,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows,
                                                           index_t d) {
  constexpr int G = kCompressorTokenGroup;
  for (index_t tg = 0; tg < n_tok; tg += G) {
    const int nt = static_cast<int>(std::min<index_t>(G, n_tok - tg));
    const float* xg = x + tg * ld_x;
    for (index_t r = 0; r < n_rows; ++r) {
      __m256 acc[G];  // (tokens) lane-wise partial sums of this row
      for (int t = 0; t < G; ++t) acc[t] = _mm256_setzero_ps();
      const bf16* wr = w + r * ld_w;
      switch (nt) {
        case 8:
          project_tile<8>(acc, wr, xg, ld_x, d);
          break;
        case 7:
          project_tile<7>(acc, wr, xg, ld_x, d);
          break;
        case 6:
          project_tile<6>(acc, wr, xg, ld_x, d);
          break;
        case 5:
          project_tile<5>(acc, wr, xg, ld_x, d);
          break;
        case 4:
          project_tile<4>(acc, wr, xg, ld_x, d);
          break;
        case 3:
          project_tile<3>(acc, wr, xg, ld_x, d);
          break;
        case 2:
          project_tile<2>(acc, wr, xg, ld_x, d);
          break;
        default:
          project_tile<1>(acc, wr, xg, ld_x, d);
          break;
      }
      for (int t = 0; t < nt; ++t) out[(tg + t) * ld_out + r] = hsum(acc[t]);
    }
  }
}

// pooled[c] = Σ_j e^{s_j[c] - m} kv_j[c] / Σ_j e^{s_j[c] - m} for c in [c0, c1) ((c1-c0) % 8 == 0),
// candidate j read at kv[j][c] and score[j][c]. Online softmax over chunks of
// kCompressorPoolChunk candidates: one running max per channel seeded with kNegBig (so a window
// of only masked candidates pools to 0 instead of NaN), one rescale per chunk.
TILEDECODE_TARGET_AVX2 inline void compressor_pool_channels(float* pooled, const float* const* kv,
                                                            const float* const* score, int n_cand,
                                                            index_t c0, index_t c1) {
  for (index_t c = c0; c < c1; c += 8) {
    __m256 m = _mm256_set1_ps(kNegBig);
    __m256 l = _mm256_setzero_ps();
    __m256 acc = _mm256_setzero_ps();
    for (int j0 = 0; j0 < n_cand; j0 += kCompressorPoolChunk) {
      const int jn = std::min(kCompressorPoolChunk, n_cand - j0);
      __m256 m_new = m;
      for (int j = j0; j < j0 + jn; ++j)
        m_new = _mm256_max_ps(m_new, _mm256_loadu_ps(score[j] + c));
      const __m256 alpha = exp_ps(_mm256_sub_ps(m, m_new));
      l = _mm256_mul_ps(l, alpha);
      acc = _mm256_mul_ps(acc, alpha);
      for (int j = j0; j < j0 + jn; ++j) {
        const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(score[j] + c), m_new));
        l = _mm256_add_ps(l, p);
        acc = _mm256_fmadd_ps(p, _mm256_loadu_ps(kv[j] + c), acc);
      }
      m = m_new;
    }
    const __m256 pos = _mm256_cmp_ps(l, _mm256_setzero_ps(), _CMP_GT_OQ);
    _mm256_storeu_ps(pooled + c, _mm256_and_ps(pos, _mm256_div_ps(acc, l)));
  }
}

// z[j] = Σ_i y[i] * h[i*ld_h + j] for j < n (n % 8 == 0), i ascending (row-vector times matrix).
TILEDECODE_TARGET_AVX2 inline void compressor_hadamard_row(float* z, const float* y, const bf16* h,
                                                           index_t ld_h, index_t n) {
  for (index_t j = 0; j < n; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (index_t i = 0; i < n; ++i) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i]), load_bf16x8(h + i * ld_h + j), acc);
    }
    _mm256_storeu_ps(z + j, acc);
  }
}

}  // namespace tiledecode::cpu::avx2
#endif
