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

#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

// Projection tasks own kCompressorRowBlock weight rows (24 × 8 KB at D = 4096); inside a task the
// rows run through the shared 3-row × 4-token BF16 micro-kernel (backend/cpu/bf16_rows_avx2.hpp,
// which also describes its streaming schedule). Every output is one lane-wise ascending-k FMA
// chain plus a fixed-order horizontal sum, whatever the tile, so results depend on the shape only.
inline constexpr int kCompressorRowBlock = 24;
inline constexpr int kCompressorTokenGroup = kBf16TileTokens;
// Candidates per online-softmax chunk in the pooling (one max, one rescale per chunk).
inline constexpr int kCompressorPoolChunk = 8;

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// e^x for 8 floats, ~2 ulp over the range the pooling uses (x <= 0). Cody–Waite reduction
// x = n·ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n assembled in the exponent
// field. Inputs below ln(FLT_MIN) return 0 (the softmax weight of a masked candidate; no
// denormals), inputs above 88 saturate at e^88. NaN in, NaN out, like std::exp: min/max_ps return
// their second operand when either is NaN, so the clamps keep x, and the exponent field built from
// cvtps(NaN) = INT_MIN is a finite scale (see sparse_attention_avx2.hpp's exp_nonpositive).
TILEDECODE_TARGET_AVX2 inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 hi = _mm256_set1_ps(88.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
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

// out[t*ld_out + r] = Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k] for t < n_tok, r < n_rows (d % 8 == 0).
// Rows [n_rows, n_rows_pf) of w exist and may be prefetched (the next task's rows).
TILEDECODE_TARGET_AVX2 inline void compressor_project_rows(float* out, index_t ld_out,
                                                           const float* x, index_t ld_x,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows, index_t d,
                                                           index_t n_rows_pf) {
  bf16_rows_dot<false>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, n_rows_pf);
}

// pooled[c] = Σ_j e^{s_j[c] - m} kv_j[c] / Σ_j e^{s_j[c] - m} for c in [c0, c1) ((c1-c0) % 8 == 0),
// candidate j read at kv[j][c] and score[j][c]. Online softmax over chunks of
// kCompressorPoolChunk candidates: one running max per channel seeded with kNegBig (a chunk of
// -Inf scores then rescales by e^0 = 1 instead of e^(-Inf + Inf) = NaN), one rescale per chunk.
// Non-finite inputs (docs/security.md, "Numerics policy", the scalar twin's rule): a NaN score or
// kv, or a +Inf score (e^(Inf - Inf)), makes the channel NaN (a NaN score may drop out of the max,
// its own e^ is NaN); a -Inf score has weight 0; a channel whose every score is -Inf pools to
// 0 / 0 = NaN, as golden. Masked candidates score kNegBig (weight e^(kNegBig - m)), never -Inf.
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
    _mm256_storeu_ps(pooled + c, _mm256_div_ps(acc, l));
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
