#pragma once
// AVX2 + FMA block primitives of the sparse attention core (kernels/sparse_attention.hpp).
// One 128-column block of one token is a small GEMM pair for a tile of heads:
//   Sᵀ (cols × heads) = K (cols × 512) · Qᵀ (512 × heads)        sa_qk
//   P = bf16(exp(S - max over cols))                              sa_softmax_block
//   O (heads × 512) = α·O + γ·Pᵀ · K (cols × 512)                sa_pv_merge
// K is the block's valid rows converted to FP32 once (sa_load_rows) and shared by every head; Q
// is transposed once per work item so that heads are the vector lanes of both GEMMs: each is a
// broadcast-FMA kernel with 12 accumulators (6 × 16 floats) and no horizontal reductions.
// Layout of every operand: row-major FP32 with a leading dimension (floats), 32-byte aligned
// rows (the kernel's workspace guarantees it). Every function here must only be called after the
// runtime AVX2 check (ctx.isa == Isa::avx2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"

namespace tiledecode::cpu {

// The probability check of softmax_block (every tier; backend/cpu/sparse_attention.hpp, "Exact
// probabilities"): besides P = bf16(e), each head's block argmax and, per column j, a bit per head
// whose e lies within
//   band = band_q[h] · (knorm[j] + kmax) + 2 · (|s − m| + |m|) + kExpUlps     FP32 ulps of e
// of a BF16 rounding midpoint (e's low 16 bits against 0x8000), i.e. whose P the FP32 errors of
// the score, of the maximum, of the subtraction and of the exp may have rounded the other way.
// Every tier computes band and the distance with the same FP32 operations per lane, so the
// flags are the same bits on every tier (the exp differs on the scalar tier: its e are its own).
struct SoftmaxFlags {
  const float* band_q;   // per head (index h of the call)
  const float* knorm;    // per column: ||k_j||
  float kmax;            // max_j knorm
  int* jmax;             // out, per head: the first column with s == m (0 if none is above)
  std::uint64_t* flags;  // out, per column: bit (shift + h) set where flagged; caller zeroes
  int shift;             // first head of the call within the caller's 64-head tile
};
inline constexpr float kExpUlps = 4.0f;  // the exps' error in FP32 ulps, with margin (both ~1)

// The row norms' lane sum (every tier), by halving: t_i = l_i + l_{i+16} for i < 16, then the
// same on the 16 sums down to one (avx2: hsum((a0 + a2) + (a1 + a3)) of the 8-lane quarters
// a0..a3; avx512: hsum(lo + hi) of the 16-lane halves: a few vector additions per row instead of
// 31 dependent scalar ones).
inline float sum_lanes32(const float* l) {
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = l[i] + l[i + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

// e^x for x <= 0 (and -inf), ≈1 ulp: x = n·ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial (truncation error r^8/8! < 6e-9 relative, below FP32 epsilon), times 2^n built in the
// exponent field. x < -87 flushes to 0 (e^-87 is at the FP32 normal limit; such terms are below
// any BF16 probability that matters against the block maximum, whose e is 1).
// NaN in, NaN out, like std::exp (the numerics policy: a NaN score, or s - m = Inf - Inf, makes
// the head's block sum NaN): max_ps returns its second operand when either is NaN, so the clamp
// keeps x; NaN is not below -87 (ordered compare), n = r = p = NaN, and the exponent field
// built from cvtps(NaN) = INT_MIN is a finite scale (1.0), so the product stays NaN.
TILEDECODE_TARGET_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);
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
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Round 8 floats to BF16 (nearest even) and return them as floats. ±Inf stay ±Inf; a NaN stays
// NaN when its low 16 bits are zero, which holds for every NaN of the attention pipeline (widened
// BF16 NaNs and the default NaN 0xffc00000 of Inf - Inf or 0 · Inf, propagated unchanged), so
// no NaN test is needed here (bf16::round_bits, which also forces the quiet bit, is the general
// conversion).
TILEDECODE_TARGET_AVX2 inline __m256 round_bf16_ps(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
}

// kf[i, 0:dim] = float(rows[i][0:dim]) for i < n. dim % 16 == 0.
// With k2 (dim % 32 == 0): also k2[i] = ||kf[i, 0:dim]||², 32 FP32 lanes (lane l: the squares of
// d ≡ l mod 32, ascending d, FMA) summed as sum_lanes32, the flag band's row norms (the avx512
// tier's load keeps these lanes and that sum: the same bits).
TILEDECODE_TARGET_AVX2 inline void sa_load_rows(float* kf, int ldk, const bf16* const* rows, int n,
                                                int dim, float* k2 = nullptr) {
  for (int i = 0; i < n; ++i) {
    const bf16* src = rows[i];
    float* dst = kf + std::int64_t(i) * ldk;
    if (k2 == nullptr) {
      for (int d = 0; d < dim; d += 16) {
        _mm256_store_ps(dst + d, load_bf16x8(src + d));
        _mm256_store_ps(dst + d + 8, load_bf16x8(src + d + 8));
      }
      continue;
    }
    __m256 acc[4];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 32)
      for (int c = 0; c < 4; ++c) {
        const __m256 x = load_bf16x8(src + d + 8 * c);
        _mm256_store_ps(dst + d + 8 * c, x);
        acc[c] = _mm256_fmadd_ps(x, x, acc[c]);
      }
    k2[i] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
  }
}

// Scores of NJ columns × 8·NV heads: acc[j][v] = Σ_d kf[j, d] · qt[d, h0 + 8v .. +8]. The head
// dimension is the vector lane, so the reduction over d needs no horizontal sums and the d loop
// (512 steps) amortises the tile's set-up. Writes st[j, h0 ..] = scale · acc.
template <int NJ, int NV>
TILEDECODE_TARGET_AVX2 inline void qk_tile(float* st, int lds, const float* qt, int ldq,
                                           const float* kf, int ldk, int dim, float scale) {
  __m256 acc[NJ][NV];
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_setzero_ps();
  const float* qd = qt;
  for (int d = 0; d < dim; ++d, qd += ldq) {
    __m256 qv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_load_ps(qd + 8 * v);
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) {
      const __m256 kb = _mm256_broadcast_ss(kf + std::int64_t(j) * ldk + d);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_fmadd_ps(kb, qv[v], acc[j][v]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      _mm256_store_ps(st + std::int64_t(j) * lds + 8 * v, _mm256_mul_ps(sc, acc[j][v]));
}

template <int NV>
TILEDECODE_TARGET_AVX2 inline void qk_cols(float* st, int lds, const float* qt, int ldq,
                                           const float* kf, int ldk, int nc, int dim, float scale) {
  int j = 0;
  for (; j + 6 <= nc; j += 6)
    qk_tile<6, NV>(st + std::int64_t(j) * lds, lds, qt, ldq, kf + std::int64_t(j) * ldk, ldk, dim,
                   scale);
  float* sj = st + std::int64_t(j) * lds;
  const float* kj = kf + std::int64_t(j) * ldk;
  switch (nc - j) {
    case 5:
      qk_tile<5, NV>(sj, lds, qt, ldq, kj, ldk, dim, scale);
      break;
    case 4:
      qk_tile<4, NV>(sj, lds, qt, ldq, kj, ldk, dim, scale);
      break;
    case 3:
      qk_tile<3, NV>(sj, lds, qt, ldq, kj, ldk, dim, scale);
      break;
    case 2:
      qk_tile<2, NV>(sj, lds, qt, ldq, kj, ldk, dim, scale);
      break;
    case 1:
      qk_tile<1, NV>(sj, lds, qt, ldq, kj, ldk, dim, scale);
      break;
    default:
      break;
  }
}

// st[j, h] = scale · Σ_d kf[j, d] · qt[d, h] for j < nc, h < nh (nh % 8 == 0).
// qt: (dim, ldq) transposed queries; st: (nc, lds) column-major scores; rows 32-byte aligned.
TILEDECODE_TARGET_AVX2 inline void sa_qk(float* st, int lds, const float* qt, int ldq, int nh,
                                         const float* kf, int ldk, int nc, int dim, float scale) {
  int h = 0;
  for (; h + 16 <= nh; h += 16) qk_cols<2>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale);
  if (h < nh) qk_cols<1>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale);
}

// Per head (column of st, nc >= 1 rows): mb[h] = max_j, lb[h] = Σ_j exp(st - mb) (FP32,
// unrounded, summed in j order), st ← bf16(exp(st - mb)), mb at least `floor` (kMaskNeg for a
// tile with invalid columns, -Inf otherwise: the scalar twin's rule). Eight heads per vector,
// nh % 8 == 0.
// A NaN score may drop out of mb (max_ps), but its own exp is NaN, so lb and the head's row are
// NaN, as on the scalar tier (docs/security.md, "Numerics policy").
template <bool kFlag>
TILEDECODE_TARGET_AVX2 inline void softmax_block_impl(float* st, int lds, int nh, int nc,
                                                      float floor, float* mb, float* lb,
                                                      const SoftmaxFlags* f) {
  for (int h = 0; h < nh; h += 8) {
    float* col = st + h;
    __m256 m = _mm256_max_ps(_mm256_set1_ps(floor), _mm256_load_ps(col));
    __m256i arg = _mm256_setzero_si256();
    for (int j = 1; j < nc; ++j) {
      const __m256 v = _mm256_load_ps(col + std::int64_t(j) * lds);
      if constexpr (kFlag)
        arg = _mm256_blendv_epi8(arg, _mm256_set1_epi32(j),
                                 _mm256_castps_si256(_mm256_cmp_ps(v, m, _CMP_GT_OQ)));
      m = _mm256_max_ps(m, v);
    }
    __m256 sum = _mm256_setzero_ps(), bq = _mm256_setzero_ps(), am = _mm256_setzero_ps();
    if constexpr (kFlag) {
      bq = _mm256_loadu_ps(f->band_q + h);
      am = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), m);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(f->jmax + h), arg);
    }
    for (int j = 0; j < nc; ++j) {
      float* x = col + std::int64_t(j) * lds;
      const __m256 xm = _mm256_sub_ps(_mm256_load_ps(x), m);
      const __m256 e = exp_nonpositive(xm);
      sum = _mm256_add_ps(sum, e);
      _mm256_store_ps(x, round_bf16_ps(e));
      if constexpr (kFlag) {
        const __m256i low = _mm256_and_si256(_mm256_castps_si256(e), _mm256_set1_epi32(0xffff));
        const __m256 dist =
            _mm256_cvtepi32_ps(_mm256_abs_epi32(_mm256_sub_epi32(low, _mm256_set1_epi32(0x8000))));
        const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), xm);
        const __m256 band =
            _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(bq, _mm256_set1_ps(f->knorm[j] + f->kmax)),
                                        _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(ax, am))),
                          _mm256_set1_ps(kExpUlps));
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(dist, band, _CMP_LE_OQ));
        if (mask != 0) f->flags[j] |= std::uint64_t(unsigned(mask)) << (f->shift + h);
      }
    }
    _mm256_storeu_ps(mb + h, m);
    _mm256_storeu_ps(lb + h, sum);
  }
}

// With f (SoftmaxFlags, above): also f->jmax[h] and the flags of the probabilities that may round
// otherwise than the exact ones; P, mb and lb are the same bits either way.
TILEDECODE_TARGET_AVX2 inline void sa_softmax_block(float* st, int lds, int nh, int nc, float floor,
                                                    float* mb, float* lb,
                                                    const SoftmaxFlags* f = nullptr) {
  if (f != nullptr)
    softmax_block_impl<true>(st, lds, nh, nc, floor, mb, lb, f);
  else
    softmax_block_impl<false>(st, lds, nh, nc, floor, mb, lb, f);
}

// Σ_d q[d] · k[d] (BF16 q, FP32 k holding BF16 values, n % 32 == 0) accurately: each product is
// exact in FP32 (8 + 8 significant bits), is widened to double and added to lane d mod 32
// (ascending d); the 32 lanes l[] are then summed as
//   a_i = (l[i] + l[i+16]) + (l[i+8] + l[i+24]), b_i = a_i + a_{i+4}, c_i = b_i + b_{i+2},
//   result = c_0 + c_1
// (the avx512 tier and the scalar twin keep the lanes and the tree: one bits). Its error,
// ≲ 2⁻⁴⁷ · Σ|q·k|, is far below an FP32 ulp of the score.
TILEDECODE_TARGET_AVX2 inline double sa_exact_dot(const bf16* q, const float* k, int n) {
  __m256d acc[8];  // acc[j]: lanes 4j .. 4j + 3
  for (auto& a : acc) a = _mm256_setzero_pd();
  for (int d = 0; d < n; d += 32)
    for (int c = 0; c < 4; ++c) {
      const __m256 p = _mm256_mul_ps(load_bf16x8(q + d + 8 * c), _mm256_loadu_ps(k + d + 8 * c));
      acc[2 * c] = _mm256_add_pd(acc[2 * c], _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
      acc[2 * c + 1] = _mm256_add_pd(acc[2 * c + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
    }
  // a_0..3 and a_4..7, then b, c and the result.
  const __m256d a_lo = _mm256_add_pd(_mm256_add_pd(acc[0], acc[4]), _mm256_add_pd(acc[2], acc[6]));
  const __m256d a_hi = _mm256_add_pd(_mm256_add_pd(acc[1], acc[5]), _mm256_add_pd(acc[3], acc[7]));
  const __m256d b = _mm256_add_pd(a_lo, a_hi);
  const __m128d c = _mm_add_pd(_mm256_castpd256_pd128(b), _mm256_extractf128_pd(b, 1));
  return _mm_cvtsd_f64(_mm_add_sd(c, _mm_unpackhi_pd(c, c)));
}

// O tile of NH heads × 16 dims: acc = Σ_j p[j, h] · kf[j, d0:d0+16]; o = α·o + γ·acc (o = γ·acc
// on the first block, so o need not be initialised). p is column-major (j, heads).
template <int NH>
TILEDECODE_TARGET_AVX2 inline void pv_tile(float* o, int ldo, const float* p, int ldp,
                                           const float* kf, int ldk, int nc, const float* alpha,
                                           const float* gamma, bool first) {
  // Two accumulator arrays, fully unrolled loops: keeps all 2·NH accumulators in registers
  // (a single acc[NH][2] array made GCC store them to the stack every iteration).
  __m256 lo[NH], hi[NH];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const float* pj = p;
  const float* kr = kf;
  for (int j = 0; j < nc; ++j, pj += ldp, kr += ldk) {
    const __m256 k0 = _mm256_load_ps(kr), k1 = _mm256_load_ps(kr + 8);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 pb = _mm256_broadcast_ss(pj + h);
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

// o[h, :] = α[h]·o[h, :] + γ[h]·Σ_j p[j, h]·kf[j, :] for h < nh (first: o = γ·Σ). dim % 16 == 0.
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
      const float* ph = p + h;
      const float* kd = kf + d;
      switch (take) {
        case 6:
          pv_tile<6>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first);
          break;
        case 4:
          pv_tile<4>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first);
          break;
        case 3:
          pv_tile<3>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first);
          break;
        case 2:
          pv_tile<2>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first);
          break;
        default:
          pv_tile<1>(oh, ldo, ph, ldp, kd, ldk, nc, alpha + h, gamma + h, first);
          break;
      }
      h += take;
    }
  }
}

// qt[d, h] = float(q[h][d]) for h < nh (nh % 8 == 0), d < dim (dim % 8 == 0): 8 × 8 tiles
// widened and transposed in registers. With q2: also q2[h] = Σ_d q[h][d]², the flag band's query
// norms, from the transposed registers: per head two FMA chains, over the even and the odd d in
// ascending order, added at the end (both vector tiers run this function).
TILEDECODE_TARGET_AVX2 inline void sa_load_q_transposed(float* qt, int ldq, const bf16* const* q,
                                                        int nh, int dim, float* q2 = nullptr) {
  for (int h = 0; h < nh; h += 8) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int d = 0; d < dim; d += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load_bf16x8(q[h + i] + d);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
      const __m256 col[8] = {
          _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
          _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
          _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
          _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      float* dst = qt + std::int64_t(d) * ldq + h;
      for (int i = 0; i < 8; ++i) {  // row d + i of qt
        _mm256_store_ps(dst + i * std::int64_t(ldq), col[i]);
        if (q2 != nullptr) acc[i % 2] = _mm256_fmadd_ps(col[i], col[i], acc[i % 2]);
      }
    }
    if (q2 != nullptr) _mm256_storeu_ps(q2 + h, _mm256_add_ps(acc[0], acc[1]));
  }
}

// float(double(src[d]) · r) for d < 8: the finished row's normalisation, as in scalar code.
TILEDECODE_TARGET_AVX2 inline __m256 scale8(const float* src, __m256d r) {
  const __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(src)), r));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(src + 4)), r));
  return _mm256_set_m128(hi, lo);
}

// The inverse-RoPE tail of a finished head row: x = float(double(src[d]) · rden), rotated back as
// rope_inverse does (pairs (x_2i, x_2i+1) by (cos_i, sin_i): e·c + o·s and o·c − e·s, FP32
// products then one addition, no FMA) and rounded to BF16 into dst, for d < n (n % 8 == 0).
// Every operation is the scalar code's (o·c + e·(−s) is o·c − e·s exactly): the same bits, but
// for the sign of a NaN (the sum of two NaNs takes either one's sign, by operand order).
TILEDECODE_TARGET_AVX2 inline void sa_rope_tail(bf16* dst, const float* src, double rden,
                                                const bf16* cos_row, const bf16* sin_row, int n) {
  const __m256d r = _mm256_set1_pd(rden);
  const __m256 flip = _mm256_setr_ps(0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f);
  const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  for (int d = 0; d < n; d += 8) {
    const __m256 x = scale8(src + d, r);
    const __m256 xs = _mm256_permute_ps(x, 0xb1);  // (o, e) per pair
    // cos_i, sin_i for the pairs i = d/2 .. d/2 + 3, each twice; sin with the odd lanes negated.
    const auto pairs = [&](const bf16* t) TILEDECODE_TARGET_AVX2 {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + d / 2));
      const __m128 v = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b), 16));
      return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), dup);
    };
    const __m256 c = pairs(cos_row), sn = _mm256_xor_ps(pairs(sin_row), flip);
    store_bf16x8(dst + d, _mm256_add_ps(_mm256_mul_ps(x, c), _mm256_mul_ps(xs, sn)));
  }
}

// dst[d] = bf16(float(double(src[d]) · rden)) for d < n (n % 8 == 0), as in scalar code.
TILEDECODE_TARGET_AVX2 inline void sa_scale_round(bf16* dst, const float* src, double rden, int n) {
  const __m256d r = _mm256_set1_pd(rden);
  for (int d = 0; d < n; d += 8) store_bf16x8(dst + d, scale8(src + d, r));
}

}  // namespace tiledecode::cpu::avx2
#endif
