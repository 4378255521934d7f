#pragma once
// AVX-512 block primitives of the sparse attention core (Isa::avx512): the contract of
// backend/cpu/sparse_attention_avx2.hpp with 16 heads (qk, softmax) or 16 dims (pv) per vector.
//
// Bit-identical to the AVX2 micro-kernels, by construction: every output lane sees the same
// operations in the same order as there, only more lanes run per instruction.
//   sa_qk       lane = head; acc = fma(k[j, d], q[d, h], acc) for d ascending from +0, then
//               scale · acc (one rounding each, as avx2::qk_tile).
//   softmax     lane = head; the max over j, then e = exp_nonpositive(s - m) on the same
//               Cody–Waite split and degree-7 polynomial (the same FMA chain, constant for
//               constant), Σ e in j order, bf16 rounding by the same integer sequence.
//   sa_pv_merge lane = dim; acc = fma(p[j, h], k[j, d], acc) for j ascending from +0, then
//               γ·acc (first block) or fma(α, o, γ·acc), as avx2::pv_tile.
//   load_rows   BF16 → FP32 is exact (a shift of the bits).
// Heads beyond a multiple of 16 (nh % 16 == 8) run the AVX2 tile for those 8 lanes: same lanes'
// operations, so the split changes nothing.
//
// Why a tier of its own: where 512-bit FMA runs at full width (Zen 5, Sapphire Rapids) the AVX2
// tiles are capped at half the core's FP32 rate (Zen 5, CSA B = 4: 6.3-6.9 ms on the AVX2 tiles,
// 3.3-3.7 ms on these); Zen 4 splits 512-bit FMA in two, so there these tiles can at best match
// the AVX2 rate (not measured on Zen 4). Register tiles keep 24 of the 32 zmm registers as
// accumulators: qk 6 columns × 64 heads, pv 6 heads × 64 dims (4 vectors per head: one
// broadcast of p feeds 4 FMAs). Operands as in the AVX2 file: row-major FP32 with leading
// dimensions in floats, 64-byte aligned rows (the kernel's workspace guarantees it). Reached only
// after the runtime ISA check (cpu_has_avx512).

#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/sparse_attention_avx2.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/bf16.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// avx2::exp_nonpositive on 16 lanes (the same operations: see the AVX2 file for the error bound
// and the NaN argument; roundscale to nearest is round_ps to nearest).
TILEDECODE_TARGET_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(lo, x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(__mmask16(~underflow), p, _mm512_castsi512_ps(e));
}

// avx2::round_bf16_ps on 16 lanes.
TILEDECODE_TARGET_AVX512 inline __m512 round_bf16_ps(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}

// 16 BF16 values widened to FP32.
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512 widen16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// kf[i, 0:dim] = float(rows[i][0:dim]) for i < n. dim % 16 == 0; with k2, avx2::sa_load_rows'
// row norms (dim % 32 == 0).
TILEDECODE_TARGET_AVX512 inline void sa_load_rows(float* kf, int ldk, const bf16* const* rows,
                                                  int n, int dim, float* k2 = nullptr) {
  for (int i = 0; i < n; ++i) {
    const bf16* src = rows[i];
    float* dst = kf + std::int64_t(i) * ldk;
    if (k2 == nullptr) {
      for (int d = 0; d < dim; d += 16) _mm512_store_ps(dst + d, widen16(src + d));
      continue;
    }
    // avx2::sa_load_rows' 32 lanes of squares: lanes 0-15 in acc[0], 16-31 in acc[1].
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int d = 0; d < dim; d += 32)
      for (int c = 0; c < 2; ++c) {
        const __m512 x = widen16(src + d + 16 * c);
        _mm512_store_ps(dst + d + 16 * c, x);
        acc[c] = _mm512_fmadd_ps(x, x, acc[c]);
      }
    // sum_lanes32's halvings, as avx2's: l + l+16, then the 256-bit halves and hsum.
    const __m512 t16 = _mm512_add_ps(acc[0], acc[1]);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t16), 1));
    k2[i] = avx2::hsum(_mm256_add_ps(_mm512_castps512_ps256(t16), hi));
  }
}

// dst[d] = bf16(float(double(src[d]) · rden)) (avx2::sa_scale_round on 16 lanes, n % 16 == 0).
TILEDECODE_TARGET_AVX512 inline void sa_scale_round(bf16* dst, const float* src, double rden,
                                                    int n) {
  const __m512d r = _mm512_set1_pd(rden);
  for (int d = 0; d < n; d += 16) {
    const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(src + d)), r));
    const __m256 hi =
        _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(src + d + 8)), r));
    const __m512 v = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + d),
        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16)));
  }
}

// Scores of NJ columns × 16·NV heads (avx2::qk_tile on 16-lane vectors).
template <int NJ, int NV>
TILEDECODE_TARGET_AVX512 inline void qk_tile(float* st, int lds, const float* qt, int ldq,
                                             const float* kf, int ldk, int dim, float scale) {
  __m512 acc[NJ][NV];
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  const float* qd = qt;
  for (int d = 0; d < dim; ++d, qd += ldq) {
    __m512 qv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qd + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) {
      const __m512 kb = _mm512_set1_ps(kf[std::int64_t(j) * ldk + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_fmadd_ps(kb, qv[v], acc[j][v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      _mm512_store_ps(st + std::int64_t(j) * lds + 16 * v, _mm512_mul_ps(sc, acc[j][v]));
}

template <int NV>
TILEDECODE_TARGET_AVX512 inline void qk_cols(float* st, int lds, const float* qt, int ldq,
                                             const float* kf, int ldk, int nc, int dim,
                                             float scale) {
  int j = 0;
  for (; j + 6 <= nc; j += 6)
    qk_tile<6, NV>(st + std::int64_t(j) * lds, lds, qt, ldq, kf + std::int64_t(j) * ldk, ldk, dim,
                   scale);
  if (j < nc)
    with_static_count<5>(nc - j, [&]<int NJ>() TILEDECODE_TARGET_AVX512 {
      qk_tile<NJ, NV>(st + std::int64_t(j) * lds, lds, qt, ldq, kf + std::int64_t(j) * ldk, ldk,
                      dim, scale);
    });
}

// avx2::sa_qk's contract (nh % 8 == 0): 64 heads per tile, then 32, 16, and 8 on the AVX2 tile.
TILEDECODE_TARGET_AVX512 inline void sa_qk(float* st, int lds, const float* qt, int ldq, int nh,
                                           const float* kf, int ldk, int nc, int dim, float scale) {
  int h = 0;
  for (; h + 64 <= nh; h += 64) qk_cols<4>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale);
  if (h + 32 <= nh) qk_cols<2>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale), h += 32;
  if (h + 16 <= nh) qk_cols<1>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale), h += 16;
  if (h < nh) avx2::qk_cols<1>(st + h, lds, qt + h, ldq, kf, ldk, nc, dim, scale);
}

// avx2::sa_softmax_block's contract, 16 heads per vector (an 8-head remainder on AVX2); with f,
// the same flags and argmax, by the same FP32 operations per lane.
template <bool kFlag>
TILEDECODE_TARGET_AVX512 inline void softmax_block_impl(float* st, int lds, int nh, int nc,
                                                        float floor, float* mb, float* lb,
                                                        const SoftmaxFlags* f) {
  int h = 0;
  for (; h + 16 <= nh; h += 16) {
    float* col = st + h;
    __m512 m = _mm512_max_ps(_mm512_set1_ps(floor), _mm512_load_ps(col));
    __m512i arg = _mm512_setzero_si512();
    for (int j = 1; j < nc; ++j) {
      const __m512 v = _mm512_load_ps(col + std::int64_t(j) * lds);
      if constexpr (kFlag)
        arg = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, m, _CMP_GT_OQ), arg,
                                      _mm512_set1_epi32(j));
      m = _mm512_max_ps(m, v);
    }
    __m512 sum = _mm512_setzero_ps(), bq = _mm512_setzero_ps(), am = _mm512_setzero_ps();
    if constexpr (kFlag) {
      bq = _mm512_loadu_ps(f->band_q + h);
      am = _mm512_abs_ps(m);
      _mm512_storeu_si512(f->jmax + h, arg);
    }
    for (int j = 0; j < nc; ++j) {
      float* x = col + std::int64_t(j) * lds;
      const __m512 xm = _mm512_sub_ps(_mm512_load_ps(x), m);
      const __m512 e = exp_nonpositive(xm);
      sum = _mm512_add_ps(sum, e);
      _mm512_store_ps(x, round_bf16_ps(e));
      if constexpr (kFlag) {
        const __m512i low = _mm512_and_si512(_mm512_castps_si512(e), _mm512_set1_epi32(0xffff));
        const __m512 dist =
            _mm512_cvtepi32_ps(_mm512_abs_epi32(_mm512_sub_epi32(low, _mm512_set1_epi32(0x8000))));
        const __m512 band = _mm512_add_ps(
            _mm512_add_ps(
                _mm512_mul_ps(bq, _mm512_set1_ps(f->knorm[j] + f->kmax)),
                _mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(_mm512_abs_ps(xm), am))),
            _mm512_set1_ps(kExpUlps));
        const __mmask16 mask = _mm512_cmp_ps_mask(dist, band, _CMP_LE_OQ);
        if (mask != 0) f->flags[j] |= std::uint64_t(mask) << (f->shift + h);
      }
    }
    _mm512_storeu_ps(mb + h, m);
    _mm512_storeu_ps(lb + h, sum);
  }
  if (h < nh) {
    if constexpr (kFlag) {
      SoftmaxFlags rest = *f;
      rest.band_q += h;
      rest.jmax += h;
      rest.shift += h;
      avx2::sa_softmax_block(st + h, lds, nh - h, nc, floor, mb + h, lb + h, &rest);
    } else {
      avx2::sa_softmax_block(st + h, lds, nh - h, nc, floor, mb + h, lb + h);
    }
  }
}

TILEDECODE_TARGET_AVX512 inline void sa_softmax_block(float* st, int lds, int nh, int nc,
                                                      float floor, float* mb, float* lb,
                                                      const SoftmaxFlags* f = nullptr) {
  if (f != nullptr)
    softmax_block_impl<true>(st, lds, nh, nc, floor, mb, lb, f);
  else
    softmax_block_impl<false>(st, lds, nh, nc, floor, mb, lb, f);
}

// avx2::sa_exact_dot's lanes and sum tree on 512-bit vectors (lane d mod 32 in acc[(d mod 32) / 8]:
// every lane adds the same products in the same order, so the same bits at twice the width).
TILEDECODE_TARGET_AVX512 inline double sa_exact_dot(const bf16* q, const float* k, int n) {
  __m512d acc[4];
  for (auto& a : acc) a = _mm512_setzero_pd();
  for (int d = 0; d < n; d += 32)
    for (int c = 0; c < 2; ++c) {
      const __m512 p = _mm512_mul_ps(widen16(q + d + 16 * c), _mm512_loadu_ps(k + d + 16 * c));
      acc[2 * c] = _mm512_add_pd(acc[2 * c], _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
      acc[2 * c + 1] = _mm512_add_pd(
          acc[2 * c + 1],
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))));
    }
  // avx2's tree: a_i = (l[i] + l[i+16]) + (l[i+8] + l[i+24]), then halves.
  const __m512d a = _mm512_add_pd(_mm512_add_pd(acc[0], acc[2]), _mm512_add_pd(acc[1], acc[3]));
  const __m256d b = _mm256_add_pd(_mm512_castpd512_pd256(a), _mm512_extractf64x4_pd(a, 1));
  const __m128d c = _mm_add_pd(_mm256_castpd256_pd128(b), _mm256_extractf128_pd(b, 1));
  return _mm_cvtsd_f64(_mm_add_sd(c, _mm_unpackhi_pd(c, c)));
}

// O tile of NH heads × 16·NV dims (avx2::pv_tile on 16-lane vectors).
template <int NH, int NV>
TILEDECODE_TARGET_AVX512 inline void pv_tile(float* o, int ldo, const float* p, int ldp,
                                             const float* kf, int ldk, int nc, const float* alpha,
                                             const float* gamma, bool first) {
  __m512 acc[NH][NV];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  const float* pj = p;
  const float* kr = kf;
  for (int j = 0; j < nc; ++j, pj += ldp, kr += ldk) {
    __m512 kv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) kv[v] = _mm512_load_ps(kr + 16 * v);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m512 pb = _mm512_set1_ps(pj[h]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(pb, kv[v], acc[h][v]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
    float* orow = o + std::int64_t(h) * ldo;
    const __m512 g = _mm512_set1_ps(gamma[h]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __m512 r = _mm512_mul_ps(g, acc[h][v]);
      if (!first) r = _mm512_fmadd_ps(_mm512_set1_ps(alpha[h]), _mm512_load_ps(orow + 16 * v), r);
      _mm512_store_ps(orow + 16 * v, r);
    }
  }
}

template <int NV>
TILEDECODE_TARGET_AVX512 inline void pv_heads(float* o, int ldo, const float* p, int ldp, int nh,
                                              const float* kf, int ldk, int nc, const float* alpha,
                                              const float* gamma, bool first) {
  int h = 0;
  for (; h + 6 <= nh; h += 6)
    pv_tile<6, NV>(o + std::int64_t(h) * ldo, ldo, p + h, ldp, kf, ldk, nc, alpha + h, gamma + h,
                   first);
  if (h < nh)
    with_static_count<5>(nh - h, [&]<int NH>() TILEDECODE_TARGET_AVX512 {
      pv_tile<NH, NV>(o + std::int64_t(h) * ldo, ldo, p + h, ldp, kf, ldk, nc, alpha + h, gamma + h,
                      first);
    });
}

// avx2::sa_pv_merge's contract (dim % 16 == 0): strips of 64 dims (d outer: the strip of K,
// nc rows × 256 B, is reused by every head tile), then 16-dim strips for the rest.
TILEDECODE_TARGET_AVX512 inline void sa_pv_merge(float* o, int ldo, const float* p, int ldp, int nh,
                                                 const float* kf, int ldk, int nc, int dim,
                                                 const float* alpha, const float* gamma,
                                                 bool first) {
  int d = 0;
  for (; d + 64 <= dim; d += 64)
    pv_heads<4>(o + d, ldo, p, ldp, nh, kf + d, ldk, nc, alpha, gamma, first);
  for (; d < dim; d += 16)
    pv_heads<1>(o + d, ldo, p, ldp, nh, kf + d, ldk, nc, alpha, gamma, first);
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
