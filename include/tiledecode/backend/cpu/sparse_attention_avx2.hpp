#pragma once
// AVX2 + FMA block primitives of the sparse attention core (kernels/sparse_attention.hpp).
// One 128-column block of one token is a small GEMM pair for a tile of heads:
//   S (heads × cols) = Q (heads × 512) · Kᵀ (512 × cols)        qk_block
//   P = bf16(exp(S - rowmax))                                     softmax_block
//   O (heads × 512) = α·O + γ·P (heads × cols) · K (cols × 512)   pv_merge_block
// K is the block's valid rows converted to FP32 once (load_rows) and shared by every head.
// Layout of every operand: row-major FP32 with a leading dimension (floats), 32-byte aligned
// rows (the kernel's workspace guarantees it). Every function here must only be called after the
// runtime AVX2 check (ctx.isa == Isa::avx2).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// e^x for x <= 0 (and -inf), ≈1 ulp: x = n·ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial (truncation error r^8/8! < 6e-9 relative, below FP32 epsilon), times 2^n built in the
// exponent field. x < -87 flushes to 0 (e^-87 is at the FP32 normal limit; such terms are below
// any BF16 probability that matters against the block maximum, whose e is 1).
TILEDECODE_TARGET_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split: exact hi part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Round 8 finite floats to BF16 (nearest even) and return them as floats.
TILEDECODE_TARGET_AVX2 inline __m256 round_bf16_ps(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
}

// kf[i, 0:dim] = float(rows[i][0:dim]) for i < n. dim % 16 == 0.
TILEDECODE_TARGET_AVX2 inline void sa_load_rows(float* kf, int ldk, const bf16* const* rows, int n,
                                                int dim) {
  for (int i = 0; i < n; ++i) {
    const bf16* src = rows[i];
    float* dst = kf + std::int64_t(i) * ldk;
    for (int d = 0; d < dim; d += 16) {
      _mm256_store_ps(dst + d, load_bf16x8(src + d));
      _mm256_store_ps(dst + d + 8, load_bf16x8(src + d + 8));
    }
  }
}

// (4 sums of a, b, c, d) — lane i holds the horizontal sum of the i-th argument.
TILEDECODE_TARGET_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Scores of NH heads × NC columns, reduction over dim in 8-lane partial sums. Writes 4 floats per
// head row (lanes >= NC are scratch, overwritten by the next tile or ignored).
template <int NH, int NC>
TILEDECODE_TARGET_AVX2 inline void qk_tile(float* s, int lds, const float* q, int ldq,
                                           const float* k, int ldk, int dim, float scale) {
  __m256 acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    __m256 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = _mm256_load_ps(k + std::int64_t(c) * ldk + d);
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_load_ps(q + std::int64_t(h) * ldq + d);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm256_fmadd_ps(qv, kv[c], acc[h][c]);
    }
  }
  const __m256 z = _mm256_setzero_ps();
  const __m128 sc = _mm_set1_ps(scale);
  for (int h = 0; h < NH; ++h) {
    const __m128 v = hsum4(acc[h][0], NC > 1 ? acc[h][NC > 1 ? 1 : 0] : z,
                           NC > 2 ? acc[h][NC > 2 ? 2 : 0] : z, z);
    _mm_storeu_ps(s + std::int64_t(h) * lds, _mm_mul_ps(sc, v));
  }
}

template <int NH>
TILEDECODE_TARGET_AVX2 inline void qk_rows(float* s, int lds, const float* q, int ldq,
                                           const float* kf, int ldk, int nc, int dim, float scale) {
  int j = 0;
  for (; j + 3 <= nc; j += 3)
    qk_tile<NH, 3>(s + j, lds, q, ldq, kf + std::int64_t(j) * ldk, ldk, dim, scale);
  if (nc - j == 2) qk_tile<NH, 2>(s + j, lds, q, ldq, kf + std::int64_t(j) * ldk, ldk, dim, scale);
  if (nc - j == 1) qk_tile<NH, 1>(s + j, lds, q, ldq, kf + std::int64_t(j) * ldk, ldk, dim, scale);
}

// s[h, j] = scale * (q[h, :] · kf[j, :]) for h < nh, j < nc. Row capacity of s: nc + 4.
TILEDECODE_TARGET_AVX2 inline void sa_qk(float* s, int lds, const float* q, int ldq, int nh,
                                         const float* kf, int ldk, int nc, int dim, float scale) {
  int h = 0;
  for (; h + 4 <= nh; h += 4)
    qk_rows<4>(s + std::int64_t(h) * lds, lds, q + std::int64_t(h) * ldq, ldq, kf, ldk, nc, dim, scale);
  float* sh = s + std::int64_t(h) * lds;
  const float* qh = q + std::int64_t(h) * ldq;
  switch (nh - h) {
    case 3: qk_rows<3>(sh, lds, qh, ldq, kf, ldk, nc, dim, scale); break;
    case 2: qk_rows<2>(sh, lds, qh, ldq, kf, ldk, nc, dim, scale); break;
    case 1: qk_rows<1>(sh, lds, qh, ldq, kf, ldk, nc, dim, scale); break;
    default: break;
  }
}

// Per head row of s (nc valid columns, 1 <= nc): mb[h] = max, lb[h] = Σ exp(s - mb) (FP32,
// unrounded), s ← bf16(exp(s - mb)). Row capacity of s: round_up(nc, 8).
TILEDECODE_TARGET_AVX2 inline void sa_softmax_block(float* s, int lds, int nh, int nc, float* mb,
                                                    float* lb) {
  const int n8 = (nc + 7) / 8 * 8;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int h = 0; h < nh; ++h) {
    float* row = s + std::int64_t(h) * lds;
    for (int j = nc; j < n8; ++j) row[j] = -INFINITY;  // tail lanes: e = 0
    __m256 mx = ninf;
    for (int j = 0; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < n8; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(row + j, round_bf16_ps(e));
    }
    mb[h] = m;
    lb[h] = hsum(sum);
  }
}

// O tile of NH heads × 16 dims: acc = Σ_j p[h, j] · kf[j, d0:d0+16]; o = α·o + γ·acc (o = γ·acc
// on the first block, so o need not be initialised).
template <int NH>
TILEDECODE_TARGET_AVX2 inline void pv_tile(float* o, int ldo, const float* p, int ldp,
                                           const float* kf, int ldk, int nc,
                                           const float* alpha, const float* gamma, bool first) {
  // Two accumulator arrays, fully unrolled loops: keeps all 2·NH accumulators in registers
  // (a single acc[NH][2] array made GCC store them to the stack every iteration).
  __m256 lo[NH], hi[NH];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const float* pj = p;
  const float* kr = kf;
  for (int j = 0; j < nc; ++j, ++pj, kr += ldk) {
    const __m256 k0 = _mm256_load_ps(kr), k1 = _mm256_load_ps(kr + 8);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 pb = _mm256_broadcast_ss(pj + std::int64_t(h) * ldp);
      lo[h] = _mm256_fmadd_ps(pb, k0, lo[h]);
      hi[h] = _mm256_fmadd_ps(pb, k1, hi[h]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
    float* orow = o + std::int64_t(h) * ldo;
    const __m256 g = _mm256_set1_ps(gamma[h]);
    __m256 r0 = _mm256_mul_ps(g, lo[h]), r1 = _mm256_mul_ps(g, hi[h]);
    if (!first) {
      const __m256 a = _mm256_set1_ps(alpha[h]);
      r0 = _mm256_fmadd_ps(a, _mm256_load_ps(orow), r0);
      r1 = _mm256_fmadd_ps(a, _mm256_load_ps(orow + 8), r1);
    }
    _mm256_store_ps(orow, r0);
    _mm256_store_ps(orow + 8, r1);
  }
}

// o[h, :] = α[h]·o[h, :] + γ[h]·Σ_j p[h, j]·kf[j, :] for h < nh (first: o = γ·Σ). dim % 16 == 0.
TILEDECODE_TARGET_AVX2 inline void sa_pv_merge(float* o, int ldo, const float* p, int ldp, int nh,
                                               const float* kf, int ldk, int nc, int dim,
                                               const float* alpha, const float* gamma, bool first) {
  // d outer: the 16-dim strip of K (nc rows × 64 B) stays in L1 while every head tile uses it.
  for (int d = 0; d < dim; d += 16) {
    int h = 0;
    while (h < nh) {
      const int left = nh - h;
      const int take = left >= 6 && left != 8 ? 6 : (left >= 4 ? 4 : left);
      float* oh = o + std::int64_t(h) * ldo + d;
      const float* ph = p + std::int64_t(h) * ldp;
      const float* kd = kf + d;
      switch (take) {
        case 6: pv_tile<6>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first); break;
        case 4: pv_tile<4>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first); break;
        case 3: pv_tile<3>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first); break;
        case 2: pv_tile<2>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first); break;
        default: pv_tile<1>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first); break;
      }
      h += take;
    }
  }
}

}  // namespace tiledecode::cpu::avx2
#endif
