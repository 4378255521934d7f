#pragma once
// The BF16-row micro-kernel on the AVX-512 tier (Isa::avx512): avx2::bf16_rows_dot's contract
// with the activations in BF16 as well, on vdpbf16ps (AVX512_BF16: 32 BF16 pairs per instruction,
// 2 FLOP per pair, twice the FP32 FMA rate on Zen 4 where 512-bit FMA is double-pumped),
//   out[t, r] (= or +=) Σ_k x[t, k] · w[r, k]      BF16 x and w, FP32 then double accumulation.
// Used by the output projection's wo_a stage (its activations are o_packed, BF16 already).
//
// Summation order (two-level, as avx2::bf16_rows_dot; it is not that kernel's order, so this tier
// is not bit-identical to avx2 here: tested against golden and for rounding accuracy instead).
// Lane l (16 lanes) of an accumulator gets the pairs k = 32j + 2l, 32j + 2l + 1: vdpbf16ps adds
// the two products to the lane one after the other (each product of two BF16 values is exact in
// FP32, each addition rounds to nearest even), over one block of kBf16DotBlock k (64 products
// per lane); the lane partial is then added to a double accumulator of that lane, and at the end
// the 16 double lanes are summed in ascending l and rounded once to FP32. Unlike the FMA tiers
// vdpbf16ps treats subnormal inputs and results as zero (DAZ / FTZ, a documented difference of
// this tier: docs/security.md); NaN and ±Inf propagate as in IEEE arithmetic. Reached only after
// the runtime ISA check.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/bf16_rows_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

namespace bf16_rows_detail {

using avx2::bf16_rows_detail::Prefetch;
using avx2::bf16_rows_detail::prefetch_at;

// The BF16 elements [k, k + 32) of a row: whole (kMasked = false: k + 32 <= n), or zero past n
// through a zeroing mask (the tail; a zero pair adds +0). Whole steps take the plain load: on Zen 4
// a masked 512-bit load costs several times a plain one (a 4 × 6 tile of vdpbf16ps in L1 ran at
// 30 % of the instruction's rate with masked loads on every step, 71 % with plain ones).
template <bool kMasked>
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512bh load32(const bf16* p,
                                                                               index_t k,
                                                                               index_t n) {
  if constexpr (kMasked) {
    return (__m512bh)_mm512_maskz_loadu_epi16(__mmask32((1u << (n - k)) - 1u), p + k);
  } else {
    return (__m512bh)_mm512_loadu_si512(p + k);
  }
}

// One block [k0, k1) of the NR × NT register tile (k1 - k0 <= kBf16DotBlock): FP32 lane partials
// from +0, handed at the end to flush(r, t, partial) (the caller adds them to its double lanes).
// With ahead and self (the prefetch schedule of the pass over n), their prefetches are issued once
// per 32 k. Token t's elements [k, k + 32) are at x + t·ld_x + kXStep·k: rows (kXStep = 1) or a
// token panel tile (kXStep = 4, ld_x = 32: pack_bf16_panel_tile). Per 32 k, kStreamW: the NT
// activation vectors are loaded first, then each weight row once, used at once (NR·NT accumulators
// + NT + 1 registers; the blocked kernel, weights in L1: 3-5 % faster on Zen 5); else the NR
// weight vectors are held and the activations loaded one at a time (the row kernel, weights from
// memory: the other order made a T = 8 compressor call 15 % slower). The bits do not depend on
// it: every accumulator adds its products in ascending k either way.
template <int NR, int NT, int kXStep = 1, bool kStreamW = false, class Flush>
TILEDECODE_TARGET_AVX512 inline void tile_block(Flush&& flush, const bf16* w, index_t ld_w,
                                                const bf16* x, index_t ld_x, index_t k0, index_t k1,
                                                index_t n = 0, const Prefetch* ahead = nullptr,
                                                const Prefetch* self = nullptr) {
  __m512 c[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) c[r][t] = _mm512_setzero_ps();
  const auto step = [&]<bool kMasked>(index_t k) TILEDECODE_TARGET_AVX512 {
    if (ahead != nullptr) {  // once per 32 k, as the avx2 kernel
      prefetch_at(*ahead, k, n);
      prefetch_at(*self, k, n);
    }
    if constexpr (kStreamW) {
      __m512bh xv[NT];
      for (int t = 0; t < NT; ++t) xv[t] = load32<kMasked>(x + t * ld_x + (kXStep - 1) * k, k, k1);
      for (int r = 0; r < NR; ++r) {
        const __m512bh v = load32<kMasked>(w + r * ld_w, k, k1);
        for (int t = 0; t < NT; ++t) c[r][t] = _mm512_dpbf16_ps(c[r][t], v, xv[t]);
      }
    } else {
      __m512bh v[NR];
      for (int r = 0; r < NR; ++r) v[r] = load32<kMasked>(w + r * ld_w, k, k1);
      for (int t = 0; t < NT; ++t) {
        const __m512bh xv = load32<kMasked>(x + t * ld_x + (kXStep - 1) * k, k, k1);
        for (int r = 0; r < NR; ++r) c[r][t] = _mm512_dpbf16_ps(c[r][t], v[r], xv);
      }
    }
  };
  // A block of whole steps (every block but a last one with d % 32 != 0) runs without the tail
  // code, before which GCC would park the accumulators on the stack.
  index_t k = k0;
  if ((k1 - k0) % 32 == 0) {
    for (; k < k1; k += 32) step.template operator()<false>(k);
  } else {
    for (; k + 32 <= k1; k += 32) step.template operator()<false>(k);
    step.template operator()<true>(k);
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) flush(r, t, c[r][t]);
}

// sums[r][t] = Σ_k w[r*ld_w + k] * x[t*ld_x + k], k < n, in the order at the top.
template <int NR, int NT>
TILEDECODE_TARGET_AVX512 inline void tile(double (*sums)[kBf16TileTokens], const bf16* w,
                                          index_t ld_w, const bf16* x, index_t ld_x, index_t n,
                                          const Prefetch& ahead, const Prefetch& self) {
  alignas(64) double lanes[NR][NT][16] = {};
  for (index_t k = 0; k < n; k += kBf16DotBlock)
    tile_block<NR, NT>(
        [&](int r, int t, __m512 c) TILEDECODE_TARGET_AVX512 { add_to_f64(lanes[r][t], c); }, w,
        ld_w, x, ld_x, k, std::min<index_t>(n, k + kBf16DotBlock), n, &ahead, &self);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      double s = 0.0;
      for (int l = 0; l < 16; ++l) s += lanes[r][t][l];
      sums[r][t] = s;
    }
}

}  // namespace bf16_rows_detail

// out[t*ld_out + r] = float(Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k]) (with kAccumulate:
// float(double(out) + Σ)) for t < n_tok, r < n_rows, d even, in the order at the top; rows
// [n_rows, n_rows_pf) of w may be prefetched (avx2::bf16_rows_dot's contract, BF16 x).
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot(float* out, index_t ld_out, const bf16* x,
                                                   index_t ld_x, index_t n_tok, const bf16* w,
                                                   index_t ld_w, index_t n_rows, index_t d,
                                                   index_t n_rows_pf) {
  using namespace bf16_rows_detail;
  avx2::bf16_rows_detail::bf16_rows_pass<kAccumulate>(
      out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, n_rows_pf,
      [d, ld_w, ld_x](double(*sums)[kBf16TileTokens], int nr, int nt, const bf16* wr,
                      const bf16* xg, const Prefetch& ahead, const Prefetch& self)
          TILEDECODE_TARGET_AVX512 {
            with_static_count<kBf16TileRows>(nr, [&]<int R>() TILEDECODE_TARGET_AVX512 {
              with_static_count<kBf16TileTokens>(nt, [&]<int N>() TILEDECODE_TARGET_AVX512 {
                tile<R, N>(sums, wr, ld_w, xg, ld_x, d, ahead, self);
              });
            });
          });
}

// ---------------------------------------------------------------------------------------------
// bf16_rows_dot_blocked: bf16_rows_dot's contract and bits (every lane adds the same products in
// the same order, the double lanes are summed alike) for many tokens, blocked for the caches.
// The activations come as a token panel (pack_bf16_panel below, once per call of the kernel's
// caller, shared by its tasks): 4-token tiles whose four 32-element pieces of each k step lie
// side by side, so a register tile's activation loads for a step are one 256-byte run. With the
// rows in place (8 KB apart at d = 4096) all ten loads of a step fall in one L1 set, and the next
// tile's rows contend for it: the same tile on the panel ran 25 % faster (Zen 5, 24 rows x 64 and
// 128 tokens, in L2: 257-270 -> 324-343 GFLOP/s).
// Loop nest: per chunk of kBlockedChunkTokens tokens (their panel, 64 × 8 KB at d = 4096, stays in
// L2), per block of kBlockedRows rows, per group of kBlockedFoldBlocks k-blocks, per k-block of
// kBf16DotBlock (the rows' 6 × 2 KB segment stays in L1 while every token tile of the chunk runs
// it), register tiles of 6 rows × 4 tokens (24 accumulators; per 32 k: 4 activation loads from
// L2, 6 weight loads from L1, 24 vdpbf16ps). Each weight row is read from memory once per chunk.
// A tile's FP32 lane partials of a k-block are stored as they are (part: 64 × 6 × 2 × 64 B =
// 48 KB of stack, write only), and folded into the double lanes (another 48 KB) once per group:
// the same additions in the same order as add_to_f64 per k-block, but the double lanes are read
// and written once per 2 k-blocks instead of once per k-block, and the fold of the last group
// feeds the final sums directly. Zen 5, 2048 rows × 4096 in 24-row calls, T = 128 / 512, one
// thread, interleaved: add_to_f64 per k-block 288 / 288 GFLOP/s, this nest 318 / 321 (a fold per
// k-block: 268 / 275, no gain; groups of 4: the same as 2). The double lanes of 8 tokens × 1 row
// are summed at the end as one 8-wide vector per lane index (two 8 × 8 transposes): each output's
// sum is still ((0 + lane 0) + lane 1) + ... + lane 15, without 16 dependent scalar additions per
// output. The tile's shape is the fastest of those measured on Zen 5 (CSA compressor T = 128 /
// 512, one thread): 6 × 4 7.7–8.1 / 32.8–37.4 ms, 4 × 6 9.0–10.6 / 36.7–41.9 ms (fewer loads from
// L2 per vdpbf16ps); 5 × 5 and chunks of 32, 96 or 128 tokens were slower, 8 × 3 spills with the
// weights held (and with them streamed, as now: 8 × 3 and 12 × 2 ran 10-20 % slower than 6 × 4).
namespace bf16_rows_blocked_detail {

inline constexpr int kBlockedRows = 6;          // rows per register tile and L1 weight block
inline constexpr int kBlockedTileTokens = 4;    // tokens per register tile and panel tile
inline constexpr int kBlockedChunkTokens = 64;  // tokens per chunk of double lanes
inline constexpr int kBlockedFoldBlocks = 2;    // k-blocks per fold into the double lanes

// s[i] = ((0 + a_i[0]) + a_i[1]) + ... + a_i[15] for the 8 lane rows a_i = lanes[i] (16 doubles
// each, 64-byte aligned, ld doubles apart), lane for lane as the scalar loop.
TILEDECODE_TARGET_AVX512 inline __m512d sum_lanes8(const double* lanes, index_t ld) {
  __m512d s = _mm512_setzero_pd();
  for (int h = 0; h < 16; h += 8) {
    __m512d a[8], u[8], v[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_load_pd(lanes + i * ld + h);
    // u[2j] = (a[2j][l], a[2j+1][l]) for l even, u[2j+1] the same for l odd (per 128-bit lane).
    for (int j = 0; j < 8; j += 2) {
      u[j] = _mm512_unpacklo_pd(a[j], a[j + 1]);
      u[j + 1] = _mm512_unpackhi_pd(a[j], a[j + 1]);
    }
    // v[q]: rows 0-3 (q < 4) or 4-7 of lanes {l, l + 4} with l = (q % 4 → 0, 1, 2, 3).
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int b = 0; b < 8; b += 4) {
      v[b + 0] = _mm512_permutex2var_pd(u[b], lo, u[b + 2]);      // l = 0, 4
      v[b + 1] = _mm512_permutex2var_pd(u[b + 1], lo, u[b + 3]);  // l = 1, 5
      v[b + 2] = _mm512_permutex2var_pd(u[b], hi, u[b + 2]);      // l = 2, 6
      v[b + 3] = _mm512_permutex2var_pd(u[b + 1], hi, u[b + 3]);  // l = 3, 7
    }
    const __m512i first = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    __m512d col[8];  // col[l][i] = a[i][l]
    for (int l = 0; l < 4; ++l) {
      col[l] = _mm512_permutex2var_pd(v[l], first, v[4 + l]);
      col[l + 4] = _mm512_permutex2var_pd(v[l], second, v[4 + l]);
    }
    for (int l = 0; l < 8; ++l) s = _mm512_add_pd(s, col[l]);
  }
  return s;
}

}  // namespace bf16_rows_blocked_detail

// The token panel of n_tok tokens of d elements: tiles of 4 tokens, each 4 · round_up(d, 32)
// elements.
inline constexpr index_t bf16_panel_tile_elems(index_t d) {
  return bf16_rows_blocked_detail::kBlockedTileTokens * ((d + 31) / 32 * 32);
}
inline constexpr index_t bf16_panel_elems(index_t n_tok, index_t d) {
  return (n_tok + 3) / 4 * bf16_panel_tile_elems(d);
}

// Tile p of the panel (tokens 4p .. 4p + 3; past n_tok nothing is written):
// xp[p · tile + (k / 32) · 128 + (t % 4) · 32 + k % 32] = x[t · ld_x + k] for k < d, +0 for
// d <= k < round_up(d, 32). Plain copies (no ISA); callers run the tiles as parallel tasks. The
// whole 32-element pieces are fixed-size copies the compiler inlines: with a variable-size memcpy
// call per 64 bytes, 512 tokens × 4096 packed in 436 µs (9.6 GB/s, Zen 5), now 100 µs; in the
// inner compressor's call at T = 128 that saved 28-53 µs of ~1950.
inline void pack_bf16_panel_tile(bf16* xp, const bf16* x, index_t ld_x, index_t n_tok, index_t d,
                                 index_t p) {
  bf16* tile = xp + p * bf16_panel_tile_elems(d);
  for (index_t t = 4 * p; t < std::min<index_t>(n_tok, 4 * p + 4); ++t) {
    const bf16* src = x + t * ld_x;
    bf16* dst = tile + (t % 4) * 32;
    index_t k = 0;
    for (; k + 32 <= d; k += 32) std::memcpy(dst + 4 * k, src + k, 32 * sizeof(bf16));
    if (k < d) {  // the last piece: d - k elements, then +0
      std::memcpy(dst + 4 * k, src + k, std::size_t(d - k) * sizeof(bf16));
      for (index_t i = d - k; i < 32; ++i) dst[4 * k + i] = bf16::from_bits(0);
    }
  }
}

// Callers take bf16_rows_dot_blocked from this many tokens, bf16_rows_dot below it (the same
// bits either way).
inline constexpr index_t kBf16BlockedMinTokens = 16;

// Whether a caller runs bf16_rows_dot_blocked on a panel of n_tok tokens × d held in `capacity`
// BF16 elements of its scratch (else bf16_rows_dot on the rows: the same bits).
inline constexpr bool bf16_panel_fits(index_t n_tok, index_t d, index_t capacity) {
  return n_tok >= kBf16BlockedMinTokens && bf16_panel_elems(n_tok, d) <= capacity;
}

// The whole panel of x's n_tok rows, one tile per task of the caller's backend (be.tasks).
template <class Be>
inline void pack_bf16_panel(const Be& be, bf16* xp, const bf16* x, index_t ld_x, index_t n_tok,
                            index_t d) {
  be.tasks((n_tok + 3) / 4,
           [&](std::int64_t p) { pack_bf16_panel_tile(xp, x, ld_x, n_tok, d, index_t(p)); });
}

// bf16_rows_dot<kAccumulate>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, ·) with x given as
// its panel (pack_bf16_panel, or pack_bf16_panel_tile for every tile of the n_tok tokens): xp
// points at element k0 of the first tile (xp = panel + 4 · k0, k0 % 32 == 0, for a reduction over
// x's [k0, k0 + d)), ld_tile = bf16_panel_tile_elems of the packed width (elements from one tile to
// the next). Rows [n_rows, n_rows_pf) of w exist and may be prefetched (the caller's next rows).
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot_blocked(float* out, index_t ld_out,
                                                           const bf16* xp, index_t ld_tile,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows, index_t d,
                                                           index_t n_rows_pf) {
  using namespace bf16_rows_blocked_detail;
  constexpr int R = kBlockedRows, TT = kBlockedTileTokens, C = kBlockedChunkTokens;
  constexpr int G = kBlockedFoldBlocks;
  alignas(64) float part[C][R][G][16];  // a fold group's FP32 partials (48 KB)
  alignas(64) double lanes[C][R][16];   // the double lanes between fold groups (48 KB)
  const index_t n_blocks = (d + kBf16DotBlock - 1) / kBf16DotBlock;
  for (index_t c0 = 0; c0 < n_tok; c0 += C) {
    const int nc = int(std::min<index_t>(C, n_tok - c0));
    for (index_t r0 = 0; r0 < n_rows; r0 += R) {
      const int nr = int(std::min<index_t>(R, n_rows - r0));
      // In the first chunk the rows come from memory: the next block's rows (up to n_rows_pf)
      // are prefetched into L2 a k-block's segment at a time, spread over the token tiles (6 ×
      // 2 KB per 16 tiles at 64 tokens), while this block's run.
      const index_t pf_rows = c0 == 0 ? std::clamp<index_t>(n_rows_pf - (r0 + R), 0, R) : 0;
      for (index_t g0 = 0; g0 < n_blocks; g0 += G) {
        const int ng = int(std::min<index_t>(G, n_blocks - g0));
        for (int b = 0; b < ng; ++b) {
          const index_t k0 = (g0 + b) * kBf16DotBlock;
          const index_t k1 = std::min<index_t>(d, k0 + kBf16DotBlock);
          // The block's pf_rows × (k1 - k0) / 32 lines, row-major by k, a quota per tile.
          const index_t pf_lines = pf_rows * ((k1 - k0 + 31) / 32), n_tiles = (nc + TT - 1) / TT;
          const index_t quota = (pf_lines + n_tiles - 1) / n_tiles;
          index_t pf_done = 0, pf_r = 0, pf_k = k0;
          for (int t0 = 0; t0 < nc; t0 += TT) {
            const int nt = std::min(TT, nc - t0);
            for (const index_t end = std::min(pf_lines, pf_done + quota); pf_done < end;
                 ++pf_done) {
              _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + pf_r) * ld_w + pf_k),
                           _MM_HINT_T1);
              if (++pf_r == pf_rows) {
                pf_r = 0;
                pf_k += 32;
              }
            }
            const bf16* tile = xp + ((c0 + t0) / TT) * ld_tile;
            with_static_count<R>(nr, [&]<int NR>() TILEDECODE_TARGET_AVX512 {
              with_static_count<TT>(nt, [&]<int NT>() TILEDECODE_TARGET_AVX512 {
                bf16_rows_detail::tile_block<NR, NT, TT, true>(
                    [&](int r, int t, __m512 c)
                        TILEDECODE_TARGET_AVX512 { _mm512_store_ps(part[t0 + t][r][b], c); },
                    w + r0 * ld_w, ld_w, tile, 32, k0, k1);
              });
            });
          }
        }
        // The double lanes of (t, r) after this group: ((lanes + p_0) + p_1) + ..., from +0 in
        // the first group, i.e. add_to_f64 of every block's partial in block order.
        const bool first = g0 == 0, last = g0 + ng == n_blocks;
        const auto fold = [&](int t, int r, double* dst) TILEDECODE_TARGET_AVX512 {
          __m512d lo = first ? _mm512_setzero_pd() : _mm512_load_pd(lanes[t][r]);
          __m512d hi = first ? _mm512_setzero_pd() : _mm512_load_pd(lanes[t][r] + 8);
          for (int b = 0; b < ng; ++b) add_to_f64(lo, hi, _mm512_load_ps(part[t][r][b]));
          _mm512_store_pd(dst, lo);
          _mm512_store_pd(dst + 8, hi);
        };
        if (!last) {
          for (int t = 0; t < nc; ++t)
            for (int r = 0; r < nr; ++r) fold(t, r, lanes[t][r]);
          continue;
        }
        const auto emit = [&](int t, int r, double s) {
          float& o = out[(c0 + t) * ld_out + r0 + r];
          o = kAccumulate ? float(double(o) + s) : float(s);
        };
        int t = 0;
        for (; t + 8 <= nc; t += 8)
          for (int r = 0; r < nr; ++r) {
            alignas(64) double l8[8][16], s[8];
            for (int i = 0; i < 8; ++i) fold(t + i, r, l8[i]);
            _mm512_store_pd(s, sum_lanes8(l8[0], 16));
            for (int i = 0; i < 8; ++i) emit(t + i, r, s[i]);
          }
        for (; t < nc; ++t)
          for (int r = 0; r < nr; ++r) {
            alignas(64) double l1[16];
            fold(t, r, l1);
            double s = 0.0;
            for (int l = 0; l < 16; ++l) s += l1[l];
            emit(t, r, s);
          }
      }
    }
  }
}
// ---------------------------------------------------------------------------------------------
// bf16_rows_dot_fma: avx2::bf16_rows_dot's contract (FP32 x) and its bits, on 512-bit FMA, for
// many tokens. A register holds two rows' 8-lane partials for one token (lanes 0-7: row 2p,
// 8-15: row 2p + 1), so every lane does exactly what the avx2 kernel's lane does (FP32 FMAs of
// x[k]·w[k], k ≡ l mod 8, ascending, from +0 over each block of kBf16DotBlock; then into a
// double lane; the eight double lanes summed in ascending l at the end). Loop nest: per chunk of
// up to kFmaChunkTokens tokens (their x rows are read from memory once per call), per block of 8
// rows (the chunk's double lanes: 96 × 8 × 8 × 8 B = 48 KB of stack), per k-block of
// kBf16DotBlock: the block's 8 row segments widened once into an FP32
// panel of row pairs (16 floats per 8 k: 32 KB, L1), then register tiles of 4 row pairs ×
// kFmaTileTokens tokens run it (24 accumulators; x broadcast 8 floats at a time into both halves
// by vbroadcastf64x4 from memory, no shuffle; per 8 k: 4 panel loads, 6 x loads, 24 FMAs). Each
// weight row is read once per token chunk and widened once per chunk; the avx2 kernel widens each
// weight vector once per 4 tokens, which at large batch bounds it by the widening.
namespace bf16_rows_fma_detail {

inline constexpr int kFmaPairs = 4;         // row pairs per panel and register tile (8 rows)
inline constexpr int kFmaTileTokens = 6;    // tokens per register tile (24 accumulators)
inline constexpr int kFmaChunkTokens = 96;  // tokens per chunk of double lanes
inline constexpr index_t kFmaSteps = kBf16DotBlock / 8;  // 8-k steps per block
// Callers take bf16_rows_dot_fma above this many tokens, avx2::bf16_rows_dot up to it (the same
// bits): at 8 tokens the panel's widening does not pay (1536 rows × 4096: 1.52 vs 1.32 ms).
inline constexpr index_t kFmaMinTokens = 9;

// panel[(p·kFmaSteps + j)·16 + 8h + l] = float(w[(2p + h)·ld_w + k0 + 8j + l]) for j < steps,
// rows 2p + h < nr; 0 for the other rows.
TILEDECODE_TARGET_AVX512 inline void widen_pairs(float* panel, const bf16* w, index_t ld_w, int nr,
                                                 index_t k0, index_t steps) {
  for (int p = 0; p < kFmaPairs; ++p)
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * p + h;
      float* dst = panel + p * kFmaSteps * 16 + 8 * h;
      if (r >= nr) {
        for (index_t j = 0; j < steps; ++j) _mm256_store_ps(dst + j * 16, _mm256_setzero_ps());
        continue;
      }
      const bf16* src = w + r * ld_w + k0;
      for (index_t j = 0; j < steps; ++j)
        _mm256_store_ps(dst + j * 16, avx2::load_bf16x8(src + 8 * j));
    }
}

// One k-block (steps 8-k steps from x + 0) of the 8-row × NT register tile: FP32 lane partials
// from +0, then added to the double lanes lanes[t][p][0..16) (lanes 8h + l: row 2p + h, lane l).
template <int NT>
TILEDECODE_TARGET_AVX512 inline void fma_block(double (*lanes)[kFmaPairs][16], const float* panel,
                                               const float* x, index_t ld_x, index_t steps) {
  __m512 c[kFmaPairs][NT];
  for (int p = 0; p < kFmaPairs; ++p)
    for (int t = 0; t < NT; ++t) c[p][t] = _mm512_setzero_ps();
  for (index_t j = 0; j < steps; ++j) {
    __m512 v[kFmaPairs];
    for (int p = 0; p < kFmaPairs; ++p) v[p] = _mm512_load_ps(panel + (p * kFmaSteps + j) * 16);
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_castpd_ps(
          _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + t * ld_x + 8 * j))));
      for (int p = 0; p < kFmaPairs; ++p) c[p][t] = _mm512_fmadd_ps(v[p], xv, c[p][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int p = 0; p < kFmaPairs; ++p) add_to_f64(lanes[t][p], c[p][t]);
}

}  // namespace bf16_rows_fma_detail

// avx2::bf16_rows_dot<kAccumulate>'s contract and bits (d % 8 == 0; rows [n_rows, n_rows_pf)
// of w exist: the first row block of them is prefetched into L2 during the last chunk).
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot_fma(float* out, index_t ld_out, const float* x,
                                                       index_t ld_x, index_t n_tok, const bf16* w,
                                                       index_t ld_w, index_t n_rows, index_t d,
                                                       index_t n_rows_pf) {
  using namespace bf16_rows_fma_detail;
  constexpr int R = 2 * kFmaPairs;
  alignas(64) float panel[kFmaPairs * kFmaSteps * 16];
  alignas(64) double lanes[kFmaChunkTokens][kFmaPairs][16];
  for (index_t c0 = 0; c0 < n_tok; c0 += kFmaChunkTokens) {
    const int nc = int(std::min<index_t>(kFmaChunkTokens, n_tok - c0));
    for (index_t r0 = 0; r0 < n_rows; r0 += R) {
      const int nr = int(std::min<index_t>(R, n_rows - r0));
      for (int t = 0; t < nc; ++t)
        for (int p = 0; p < kFmaPairs; ++p)
          for (int i = 0; i < 16; i += 8) _mm512_store_pd(&lanes[t][p][i], _mm512_setzero_pd());
      for (index_t k0 = 0; k0 < d; k0 += kBf16DotBlock) {
        const index_t steps = (std::min<index_t>(d, k0 + kBf16DotBlock) - k0) / 8;
        widen_pairs(panel, w + r0 * ld_w, ld_w, nr, k0, steps);
        {  // the next row block, into L2, a block's share at a time
          const index_t n_next = std::clamp<index_t>(n_rows_pf - (r0 + R), 0, R);
          for (index_t r = 0; r < n_next; ++r)
            for (index_t k = k0; k < k0 + 8 * steps; k += 32)
              _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + r) * ld_w + k), _MM_HINT_T1);
        }
        for (int t0 = 0; t0 < nc; t0 += kFmaTileTokens) {
          const int nt = std::min(kFmaTileTokens, nc - t0);
          with_static_count<kFmaTileTokens>(nt, [&]<int NT>() TILEDECODE_TARGET_AVX512 {
            fma_block<NT>(lanes + t0, panel, x + (c0 + t0) * ld_x + k0, ld_x, steps);
          });
        }
      }
      for (int t = 0; t < nc; ++t)
        for (int r = 0; r < nr; ++r) {
          double s = 0.0;
          for (int l = 0; l < 8; ++l) s += lanes[t][r / 2][8 * (r % 2) + l];
          float& o = out[(c0 + t) * ld_out + r0 + r];
          o = kAccumulate ? float(double(o) + s) : float(s);
        }
    }
  }
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
