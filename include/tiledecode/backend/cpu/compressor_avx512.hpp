#pragma once
// AVX-512 pooling of the compressors (Isa::avx512): avx2::compressor_pool_channels on 8 double
// lanes instead of 4. The operations and their order per lane are those of the AVX2 kernel and of
// the scalar twin (pool_exp_f64, kernels/compressor.hpp "Pooling in double"), so the three tiers
// give the same bits; only the width differs (one 512-bit op per 8 channels where AVX2 needs two
// 256-bit ones: the double exp is the pooling's cost, docs/compressors.md has the measurements).
// Reached only through the runtime dispatch on ctx.isa; never checks, allocates or throws.

#include <algorithm>
#include <cstdint>

#include "tiledecode/backend/cpu/compressor_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// pool_exp_f64 on 8 doubles (avx2::exp_pd, lane for lane; kClamp as there).
template <bool kClamp>
TILEDECODE_TARGET_AVX512 inline __m512d exp_pd(__m512d x) {
  const __m512d lo = _mm512_set1_pd(kPoolExpLo);
  const __m512d magic = _mm512_set1_pd(kPoolExpMagic);
  __mmask8 under = 0;
  if constexpr (kClamp) {
    under = _mm512_cmp_pd_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_pd(lo, x);
  }
  const __m512d t = _mm512_fmadd_pd(x, _mm512_set1_pd(kPoolLog2e), magic);
  const __m512d n = _mm512_sub_pd(t, magic);
  const __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(kPoolLn2), x);
  __m512d p = _mm512_set1_pd(kPoolExpC[kPoolExpDegree]);
  for (int k = kPoolExpDegree - 1; k >= 0; --k)  // unrolled: constant trip count
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kPoolExpC[k]));
  const __m512d y =
      _mm512_mul_pd(p, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 52)));
  if constexpr (kClamp) return _mm512_maskz_mov_pd(__mmask8(~under), y);
  return y;
}

// The window pooled after this one (its candidates' kv and score rows, n of them; n = 0: none),
// prefetched into L2 while this one runs: a window pooled from memory takes about twice as long
// as one in cache (HCA, 128 rows: 68-79 against 31 µs). peer_compare, HCA compressor, B = 64,
// S = 2 (16 windows closing, cold caches), Zen 5, one thread, three alternating rounds: 4.09-4.10
// -> 3.84-4.07 ms.
struct PoolAhead {
  const float* const* kv = nullptr;
  const float* const* score = nullptr;
  int n = 0;
};

// The sums of compressor_pool_channels for the Q blocks of 8 channels from c, candidates j0 .. j1
// - 1 in ascending order (each block's lanes as avx2's).
// With next, the lines of the next group (channels [c + 32, c + 64)) of each candidate are
// prefetched as its sums run; so are those of the same Q blocks in the next window's candidate j
// (ahead), into L2.
template <bool kClamp, int Q>
TILEDECODE_TARGET_AVX512 inline void pool_sums(__m512d (&l)[Q], __m512d (&acc)[Q],
                                               const float* const* kv, const float* const* score,
                                               int j0, int j1, index_t c, const __m512d (&m)[Q],
                                               bool next, const PoolAhead& ahead) {
  for (int j = j0; j < j1; ++j) {
    if (next) {
      for (int q = 0; q < 4; q += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(score[j] + c + 32 + 8 * q), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(kv[j] + c + 32 + 8 * q), _MM_HINT_T0);
      }
    }
    if (j < ahead.n) {
      for (int q = 0; q < Q; q += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead.score[j] + c + 8 * q), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead.kv[j] + c + 8 * q), _MM_HINT_T1);
      }
    }
    for (int q = 0; q < Q; ++q) {
      const __m512d p = exp_pd<kClamp>(
          _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(score[j] + c + 8 * q)), m[q]));
      l[q] = _mm512_add_pd(l[q], p);
      acc[q] = _mm512_fmadd_pd(p, _mm512_cvtps_pd(_mm256_loadu_ps(kv[j] + c + 8 * q)), acc[q]);
    }
  }
}

// Candidates ahead whose rows the pooling prefetches (each candidate is its own state row, 4 KB
// or more apart: one page each, which the hardware prefetchers do not follow). The distance is
// not what bounds a row pooled from memory: Zen 5, one thread, one HCA row (128 candidates x 512
// channels, 4 calls of 128 channels) from a 256 MB pool, min over 390 rows: 8 ahead 62-66 us, 16
// 62, 24 57-62, 32 64 (the same within the noise; 31 us with the rows in cache); the rows on
// transparent huge pages: 59-60 us.
inline constexpr int kPoolPrefetchAhead = 8;

// hi, lo of the 8 channels from c from their sums: pooled = acc / l as the FP32 pair (avx2's
// pool_store).
TILEDECODE_TARGET_AVX512 inline void pool_store(float* hi, float* lo, index_t c, __m512d l,
                                                __m512d acc) {
  const __m512d v = _mm512_div_pd(acc, l);
  const __m256 h = _mm512_cvtpd_ps(v);
  _mm256_storeu_ps(hi + c, h);
  _mm256_storeu_ps(lo + c, _mm512_cvtpd_ps(_mm512_sub_pd(v, _mm512_cvtps_pd(h))));
}

// Q blocks of 8 channels from c (Q <= 4: 32 channels, 128 bytes of each candidate's score and kv,
// 32 KB for HCA's 128 candidates, stay in L1 between the two passes). With pre, the sums after
// the candidates before j0 are kept (avx2::compressor_pool_channels' pre, 8 lanes: pre[2c' ..
// 2c' + 8) = l, [2c' + 8 .. 2c' + 16) = acc of the block of channels c' .. c' + 7), and the max
// over those candidates (mp, as avx2's).
template <int Q>
TILEDECODE_TARGET_AVX512 inline void pool_group(float* hi, float* lo, const float* const* kv,
                                                const float* const* score, int n_cand, index_t c,
                                                bool next, const PoolAhead& ahead, float* mx,
                                                float* ls, double* pre, float* mp, int j0) {
  const int jp = pre ? std::min(j0, n_cand) : 0;  // the sums kept after jp candidates
  __m256 m8[Q], n8[Q];
  for (int q = 0; q < Q; ++q) {
    m8[q] = _mm256_set1_ps(kNegBig);
    n8[q] = _mm256_set1_ps(INFINITY);
  }
  for (int j = 0; j < n_cand; ++j) {
    if (pre && j == jp)
      for (int q = 0; q < Q; ++q) _mm256_storeu_ps(mp + c + 8 * q, m8[q]);
    if (j + kPoolPrefetchAhead < n_cand) {
      const int a = j + kPoolPrefetchAhead;
      for (int q = 0; q < Q; q += 2) {  // one 64-byte line per two blocks
        _mm_prefetch(reinterpret_cast<const char*>(score[a] + c + 8 * q), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(kv[a] + c + 8 * q), _MM_HINT_T0);
      }
    }
    for (int q = 0; q < Q; ++q) {
      const __m256 sv = _mm256_loadu_ps(score[j] + c + 8 * q);
      m8[q] = _mm256_max_ps(m8[q], sv);
      n8[q] = _mm256_min_ps(n8[q], sv);
    }
  }
  if (pre && jp == n_cand)
    for (int q = 0; q < Q; ++q) _mm256_storeu_ps(mp + c + 8 * q, m8[q]);
  __m512d m[Q], l[Q], acc[Q];
  // As avx2: every x >= kPoolExpLo in all Q blocks takes the clamp-free exp (the same bits; the
  // clamp changes only lanes below it, so one block out of range sends all Q to the clamped one).
  bool in_range = true;
  for (int q = 0; q < Q; ++q) {
    m[q] = _mm512_cvtps_pd(m8[q]);
    in_range = in_range && _mm512_cmp_pd_mask(_mm512_sub_pd(_mm512_cvtps_pd(n8[q]), m[q]),
                                              _mm512_set1_pd(kPoolExpLo), _CMP_GE_OQ) == 0xff;
    l[q] = _mm512_setzero_pd();
    acc[q] = _mm512_setzero_pd();
  }
  if (in_range)
    pool_sums<false, Q>(l, acc, kv, score, 0, jp, c, m, next, ahead);
  else
    pool_sums<true, Q>(l, acc, kv, score, 0, jp, c, m, next, ahead);
  if (pre)
    for (int q = 0; q < Q; ++q) {
      _mm512_storeu_pd(pre + 2 * (c + 8 * q), l[q]);
      _mm512_storeu_pd(pre + 2 * (c + 8 * q) + 8, acc[q]);
    }
  if (in_range)
    pool_sums<false, Q>(l, acc, kv, score, jp, n_cand, c, m, next, ahead);
  else
    pool_sums<true, Q>(l, acc, kv, score, jp, n_cand, c, m, next, ahead);
  for (int q = 0; q < Q; ++q) {
    pool_store(hi, lo, c + 8 * q, l[q], acc[q]);
    if (mx) {
      _mm256_storeu_ps(mx + c + 8 * q, m8[q]);
      _mm256_storeu_ps(ls + c + 8 * q, _mm512_cvtpd_ps(l[q]));
    }
  }
}

// avx2::compressor_pool_channels, 8 channels per double vector ((c1 - c0) % 8 == 0), in groups of
// up to 32 channels: per group one pass over the candidates for the max (prefetching the rows
// kPoolPrefetchAhead candidates ahead), then one for the sums (prefetching the next group's
// lines). Each channel's operations and their order are avx2's (the same bits); only the loop
// order over channels changed. With pre, the sums before candidate j0 are kept for
// compressor_pool_resume (pool_group). One HCA row (128 candidates × 512 channels, 4 tasks of 128),
// Zen 5, one thread: 46-49 -> 31 µs with the state rows in cache, 80-91 -> 68-79 µs from memory
// (against blocks of 8 channels, each its own pass over the candidates).

TILEDECODE_TARGET_AVX512 inline void compressor_pool_channels(
    float* hi, float* lo, const float* const* kv, const float* const* score, int n_cand, index_t c0,
    index_t c1, const PoolAhead& ahead = {}, float* mx = nullptr, float* ls = nullptr,
    double* pre = nullptr, float* mp = nullptr, int j0 = 0) {
  for (index_t c = c0; c < c1; c += 32) {
    const int q = int(std::min<index_t>(4, (c1 - c) / 8));
    with_static_count<4>(q, [&]<int Q>() TILEDECODE_TARGET_AVX512 {
      pool_group<Q>(hi, lo, kv, score, n_cand, c, c + 32 < c1, ahead, mx, ls, pre, mp, j0);
    });
  }
}

// avx2::compressor_pool_resume on 8 lanes: channels c .. c + 7 pooled again after the candidates
// from j0 on changed, from the sums compressor_pool_channels kept (pre, with its max mx), where
// the max over every candidate (avx2::pool_max_kept) is still mx's:
// compressor_pool_channels' bits. Returns false, and writes nothing, where the max moved.
TILEDECODE_TARGET_AVX512 inline bool compressor_pool_resume(float* hi, float* lo,
                                                            const float* const* kv,
                                                            const float* const* score, int n_cand,
                                                            index_t c, int j0, const double* pre,
                                                            const float* mp, const float* mx) {
  __m256 m8;
  if (!avx2::pool_max_kept(score, n_cand, c, j0, mp, mx, m8)) return false;
  __m512d l[1] = {_mm512_loadu_pd(pre + 2 * c)}, acc[1] = {_mm512_loadu_pd(pre + 2 * c + 8)};
  const __m512d m[1] = {_mm512_cvtps_pd(m8)};
  pool_sums<true, 1>(l, acc, kv, score, std::min(j0, n_cand), n_cand, c, m, false, PoolAhead{});
  pool_store(hi, lo, c, l[0], acc[0]);
  return true;
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
