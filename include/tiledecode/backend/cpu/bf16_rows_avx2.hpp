#pragma once
// AVX2 + FMA micro-kernel shared by the compressor projections (kernels/compressor.hpp) and the
// wo_a stage of the output projection (kernels/output_projection.hpp): a few tokens against many
// BF16 weight rows, both stored along the reduction dimension,
//   out[t, r] (= or +=) Σ_k x[t, k] · w[r, k]      FP32 x and accumulation, BF16 weights.
// Reached only through the runtime dispatch on ctx.isa; the callers keep scalar twins with the
// same summation order (8 lane-wise partial sums in ascending k, then hsum's fixed tree).
//
// Register tile: 3 weight rows × 4 tokens (12 accumulators): per 8 k-values 3 BF16 loads widened
// once and 4 x loads feed 12 FMAs (a 1-row × 8-token tile, 9 loads per 8 FMAs, was load-port
// bound). With L2-resident weights the tile runs at ~100 % of the FMA ceiling.
//
// Streaming schedule. At decode sizes every weight is read from memory once per call while the
// FMAs run, so the stream must overlap the arithmetic evenly: the ceil(n_tok / 4) passes of a
// row triple over K together prefetch the triple kBf16PrefetchTriples ahead (pass g its g-th K
// slice). Prefetching the whole next triple during the first pass only (the obvious schedule)
// asks the memory system for twice the average bandwidth in that pass and nothing in the others;
// at T = 8 that was measured 15 % slower (compressor step), and two triples ahead beat one by
// another ~4 % (wo_a). The first triples of a call, which nobody prefetched, also prefetch their
// own rows 1 KB ahead in their first pass.

#include <algorithm>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

inline constexpr int kBf16TileRows = 3;
inline constexpr int kBf16TileTokens = 4;
inline constexpr int kBf16PrefetchTriples = 2;  // the stream runs this many row triples ahead
inline constexpr int kBf16SelfPrefetch = 512;   // BF16 elements ahead (1 KB), first triples only

}  // namespace tiledecode::cpu

#if TILEDECODE_X86
namespace tiledecode::cpu::avx2 {

namespace bf16_rows_detail {

// Software prefetch issued by one pass of the register tile: rows [0, n_rows) of `w` (leading
// dimension ld_w), columns [k0, k1) spread evenly over the pass. n_rows == 0: none.
struct Prefetch {
  const bf16* w = nullptr;
  index_t ld_w = 0;
  int n_rows = 0;
  index_t k0 = 0, k1 = 0;
};

// One k-step of 8 of the NR × NT register tile.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void step(__m256 (&c)[NR][NT],
                                                                       const bf16* w, index_t ld_w,
                                                                       const float* x, index_t ld_x,
                                                                       index_t k) {
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

// Issues the prefetches of `pf` that belong to k-step k of a pass over n.
TILEDECODE_TARGET_AVX2 __attribute__((always_inline)) inline void prefetch_at(const Prefetch& pf,
                                                                              index_t k,
                                                                              index_t n) {
  const index_t pk = pf.k0 + k * (pf.k1 - pf.k0) / n;
  for (int r = 0; r < pf.n_rows; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(pf.w + r * pf.ld_w + pk), _MM_HINT_T0);
}

// sums[r][t] = hsum over lanes of Σ_k w[r*ld_w + k] * x[t*ld_x + k], k < n (n % 8 == 0), lane l
// summing k ≡ l (mod 8) in ascending k. Meanwhile prefetches `ahead` (rows further on) and
// `self` (this tile's own rows, when nobody prefetched them) into L1.
template <int NR, int NT>
TILEDECODE_TARGET_AVX2 inline void tile(float (*sums)[kBf16TileTokens], const bf16* w, index_t ld_w,
                                        const float* x, index_t ld_x, index_t n,
                                        const Prefetch& ahead, const Prefetch& self) {
  __m256 c[NR][NT];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) c[r][t] = _mm256_setzero_ps();
  index_t k = 0;
  for (; k + 32 <= n; k += 32) {
    prefetch_at(ahead, k, n);
    prefetch_at(self, k, n);
    step<NR, NT>(c, w, ld_w, x, ld_x, k);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 8);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 16);
    step<NR, NT>(c, w, ld_w, x, ld_x, k + 24);
  }
  for (; k < n; k += 8) step<NR, NT>(c, w, ld_w, x, ld_x, k);
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) sums[r][t] = hsum(c[r][t]);
}

template <int NR>
TILEDECODE_TARGET_AVX2 inline void tile_nt(float (*sums)[kBf16TileTokens], int nt, const bf16* w,
                                           index_t ld_w, const float* x, index_t ld_x, index_t n,
                                           const Prefetch& ahead, const Prefetch& self) {
  switch (nt) {
    case 4:
      tile<NR, 4>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    case 3:
      tile<NR, 3>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    case 2:
      tile<NR, 2>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
    default:
      tile<NR, 1>(sums, w, ld_w, x, ld_x, n, ahead, self);
      break;
  }
}

}  // namespace bf16_rows_detail

// out[t*ld_out + r] = (or += with kAccumulate) Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k] for
// t < n_tok, r < n_rows, d % 8 == 0. Rows [n_rows, n_rows_pf) of w exist and may be prefetched
// (the rows the caller's next call reads); pass n_rows_pf = n_rows when there are none.
template <bool kAccumulate>
TILEDECODE_TARGET_AVX2 inline void bf16_rows_dot(float* out, index_t ld_out, const float* x,
                                                 index_t ld_x, index_t n_tok, const bf16* w,
                                                 index_t ld_w, index_t n_rows, index_t d,
                                                 index_t n_rows_pf) {
  using namespace bf16_rows_detail;
  constexpr int NR = kBf16TileRows, G = kBf16TileTokens;
  const index_t n_groups = (n_tok + G - 1) / G;
  for (index_t r0 = 0; r0 < n_rows; r0 += NR) {
    const int nr = static_cast<int>(std::min<index_t>(NR, n_rows - r0));
    const bf16* wr = w + r0 * ld_w;
    const index_t r_pf = r0 + kBf16PrefetchTriples * NR;  // first row this triple prefetches
    const int n_pf = static_cast<int>(std::clamp<index_t>(n_rows_pf - r_pf, 0, NR));
    for (index_t g = 0; g < n_groups; ++g) {
      const index_t tg = g * G;
      const int nt = static_cast<int>(std::min<index_t>(G, n_tok - tg));
      const Prefetch ahead{w + r_pf * ld_w, ld_w, n_pf, g * d / n_groups, (g + 1) * d / n_groups};
      Prefetch self;  // the first triples of a call: nobody prefetched their rows
      if (r0 < kBf16PrefetchTriples * NR && g == 0)
        self = {wr, ld_w, nr, kBf16SelfPrefetch, d + kBf16SelfPrefetch};
      float sums[NR][G];
      const float* xg = x + tg * ld_x;
      if (nr == 3) {
        tile_nt<3>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
      } else if (nr == 2) {
        tile_nt<2>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
      } else {
        tile_nt<1>(sums, nt, wr, ld_w, xg, ld_x, d, ahead, self);
      }
      for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) {
          float& o = out[(tg + t) * ld_out + r0 + r];
          o = kAccumulate ? o + sums[r][t] : sums[r][t];
        }
    }
  }
}

}  // namespace tiledecode::cpu::avx2
#endif
