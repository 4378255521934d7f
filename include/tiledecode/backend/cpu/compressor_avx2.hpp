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
// A task owns kCompressorRowBlock weight rows (24 × 8 KB at D = 4096). The register tile is
// 3 weight rows × 4 tokens (12 accumulators): per 8 k-values 3 BF16 loads (widened by a shift)
// and 4 x loads feed 12 FMAs. A 1-row × 8-token tile (9 loads per 8 FMAs) was load-port bound at
// ~65 GFLOP/s; 3 × 4 reaches ~105 GFLOP/s with L2-resident weights on the dev machine, so the
// step becomes bound by the DRAM stream. Each row triple makes one sequential pass over K per
// group of 4 tokens: its first pass streams the weights from DRAM (software prefetch 1 KB ahead
// per row keeps the stream busy), later groups re-read them from L1/L2; x (FP32) comes from L2.
// Every output is one lane-wise ascending-k FMA chain plus a fixed-order horizontal sum, whatever
// the tile, so results depend on the shape only.
inline constexpr int kCompressorRowBlock = 24;
inline constexpr int kCompressorTileRows = 3;
inline constexpr int kCompressorTokenGroup = 4;
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

// One k-step of 8 of the NR × NT register tile.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void project_step(
    __m256 (&c)[NR][NT], const bf16* w, index_t ld_w, const float* x, index_t ld_x, index_t k) {
  __m256 v[NR];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r) v[r] = load_bf16x8(w + r * ld_w + k);
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    const __m256 xv = _mm256_loadu_ps(x + t * ld_x + k);
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r) c[r][t] = _mm256_fmadd_ps(v[r], xv, c[r][t]);
  }
}

// acc[r][t] = Σ_k w[r*ld_w + k] * x[t*ld_x + k] over k < n (n % 8 == 0) for NR rows × NT tokens,
// lane-wise: lane l sums k ≡ l (mod 8) in ascending k.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 inline void project_tile(__m256 (*acc)[kCompressorTokenGroup], const bf16* w,
                                                index_t ld_w, const float* x, index_t ld_x,
                                                index_t n) {
  __m256 c[NR][NT];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) c[r][t] = _mm256_setzero_ps();
  index_t k = 0;
  for (; k + 32 <= n; k += 32) {
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * ld_w + k + kCompressorPrefetch),
                   _MM_HINT_T0);
    }
    project_step<NR, NT>(c, w, ld_w, x, ld_x, k);
    project_step<NR, NT>(c, w, ld_w, x, ld_x, k + 8);
    project_step<NR, NT>(c, w, ld_w, x, ld_x, k + 16);
    project_step<NR, NT>(c, w, ld_w, x, ld_x, k + 24);
  }
  for (; k < n; k += 8) project_step<NR, NT>(c, w, ld_w, x, ld_x, k);
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = c[r][t];
}

template <int NR>
TILEDECODE_TARGET_AVX2 inline void project_tile_nt(__m256 (*acc)[kCompressorTokenGroup], int nt,
                                                   const bf16* w, index_t ld_w, const float* x,
                                                   index_t ld_x, index_t n) {
  switch (nt) {
    case 4:
      project_tile<NR, 4>(acc, w, ld_w, x, ld_x, n);
      break;
    case 3:
      project_tile<NR, 3>(acc, w, ld_w, x, ld_x, n);
      break;
    case 2:
      project_tile<NR, 2>(acc, w, ld_w, x, ld_x, n);
      break;
    default:
      project_tile<NR, 1>(acc, w, ld_w, x, ld_x, n);
      break;
  }
}

// out[t*ld_out + r] = Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k] for t < n_tok, r < n_rows (d % 8 == 0).
TILEDECODE_TARGET_AVX2 inline void compressor_project_rows(float* out, index_t ld_out,
                                                           const float* x, index_t ld_x,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows,
                                                           index_t d) {
  constexpr int NR = kCompressorTileRows, G = kCompressorTokenGroup;
  for (index_t r0 = 0; r0 < n_rows; r0 += NR) {
    const int nr = static_cast<int>(std::min<index_t>(NR, n_rows - r0));
    const bf16* wr = w + r0 * ld_w;
    for (index_t tg = 0; tg < n_tok; tg += G) {
      const int nt = static_cast<int>(std::min<index_t>(G, n_tok - tg));
      __m256 acc[NR][G];
      const float* xg = x + tg * ld_x;
      if (nr == 3) {
        project_tile_nt<3>(acc, nt, wr, ld_w, xg, ld_x, d);
      } else if (nr == 2) {
        project_tile_nt<2>(acc, nt, wr, ld_w, xg, ld_x, d);
      } else {
        project_tile_nt<1>(acc, nt, wr, ld_w, xg, ld_x, d);
      }
      for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) out[(tg + t) * ld_out + r0 + r] = hsum(acc[r][t]);
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
