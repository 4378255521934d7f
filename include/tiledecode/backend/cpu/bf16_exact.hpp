#pragma once
// Exact BF16 dots (cpu::Bf16Dot::exact, issue 17): the long dots of a step whose results are
// rounded to BF16 or INT8 downstream (the compressors' x_n · wkv / wgate, the q/kv projection's
// x_n · wq_a / wkv, the o-proj's wo_a), computed so that their FP32 results are the exact dots
// rounded once, as golden computes them.
//
// The order: out = float(s), s = Σ_{k<d} x[k] · w[k] in double, from +0, in ascending k: the
// goldens' own loop (golden/compressor.hpp, qkv_projection.hpp, output_projection.hpp), so every
// tier gives golden's sum rounded once: the bits of the compressors' and the o-proj's goldens,
// which round it to FP32 too (the q/kv golden normalises its unrounded double sums).
// Why that is the exact dot rounded once: x and w are BF16 (8 significant bits each), so each
// product has at most 16 significant bits and is exact in double (53), and an FMA and a multiply
// then add give the same bits. Each double addition is off by at most 2^-53 of its running sum,
// so |s − Σ| <= d · 2^-53 · Σ|x·w| (d = 4096: 4.5e-13 · Σ|x·w|), against half an FP32 ulp of the
// result, 2^-24 · |Σ| ≈ 6e-8 · |Σ|: float(s) is the correctly rounded exact dot unless the dot
// lies within that bound of an FP32 rounding midpoint (at the layer's statistics, where Σ|x·w| ≈
// 40 |Σ|, a relative window of ~2e-11 against an ulp of 1.2e-7: the bound allows a few values in
// 10^4; the actual error is a random walk of the additions' roundings, ~1e-14 relative, so about
// one in 10^7; measured: none in tests/test_rounding.cpp's 131072 dots). No DAZ / FTZ: BF16
// subnormals are exact in double. NaN and ±Inf follow IEEE through the same additions (NaN
// payloads are not pinned across tiers).
//
// The cost is the arithmetic: one double FMA per 8 products on AVX-512 (4 on AVX2) against 32 per
// vdpbf16ps and 16 per FP32 FMA; docs/compressors.md gives the measured slowdown.
//
// Arrangements (the order above is per output; only the lanes differ):
//   rows  w[r·ld_w + k] (a weight row per output; the compressors, wo_a): the lanes on 8 tokens.
//         Per block of kBlockK k, each 8-token group's x as a panel of doubles [k][8 tokens] and
//         the register tile's rows widened to doubles once for a pass of up to kGroups panels;
//         per k one panel load and a broadcast multiply-add per row. AVX-512: 24 rows per
//         register tile, AVX2: 6 (two vectors each). The next block of each row is prefetched.
//   few   the rows arrangement's last n_tok % 8 tokens, up to 4 (all of them below 5 tokens: the
//         rounding checks' repairs): the lanes on 8 rows, each 8 × 8 block of BF16 transposed in
//         registers (24 unpacks) and widened, a broadcast multiply-add per token and k. AVX-512:
//         32 rows per tile, AVX2: 8 (two vectors, two tokens at a time; the transpose's last
//         stage folded into the widening, Tier::few_block8). The rows and the tokens by
//         pointer, so bf16_rows_gather_dots_exact runs it too (a few tokens against any rows:
//         the rounding checks' repairs).
//   cols  w[k·ld_w + n] (a weight column per output; the q/kv wq_a / wkv): the lanes on 8 (4)
//         columns, each token's x[k] broadcast. AVX-512: 3 column vectors × 8 tokens per tile,
//         AVX2: 3 × 4.
// Partial sums live in double between k blocks (stored, reloaded: the same value). Neither
// kernel throws or allocates; scratch is on the stack (rows 52 KB, few 16 KB, cols 38 KB).

#include <algorithm>
#include <cstdint>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::cpu {

// Weight rows per task where the callers split the exact row dots (a shape-only split: a multiple
// of both tiers' register tiles, one kernel chunk).
inline constexpr index_t kExactTaskRows = 96;

// ---------------------------------------------------------------------------------------------
// The order itself (every target; the scalar tier's kernels).

// Σ_{k<d} x[k] · w[k·stride] in double, ascending k, from +0.
inline double bf16_dot_exact(const bf16* x, const bf16* w, index_t d, index_t stride = 1) {
  double s = 0.0;
  for (index_t k = 0; k < d; ++k) s += double(x[k].to_float()) * double(w[k * stride].to_float());
  return s;
}

// s[j] = Σ_{k<d} x[j][k] · w[j][k · ws] for j < n <= kPairDots: bf16_dot_exact's sum of each pair
// (x[j], w[j] with stride ws), for the rounding checks' repairs (rounding_check.hpp): ws = 1 a
// weight row (the o-proj's wo_a, the q/kv transposed rows), ws = the row pitch a weight column
// (the q/kv wq_a itself: a cache line per k).
inline constexpr int kPairDots = 16;
// Rows: per block of k the products (exact in double) are formed a pair at a time, a loop the
// compiler vectorizes for the tier it is compiled for (the wrappers below), and the n sums then
// advance together in ascending k: interleaved, the chains' additions overlap (one alone is bound
// by the latency of its additions).
__attribute__((always_inline)) inline void pair_dots_body(int n, const bf16* const* x,
                                                          const bf16* const* w, index_t d,
                                                          double* s) {
  constexpr index_t B = 64;                 // k per block (a pair's products: 512 bytes)
  constexpr index_t kAhead = 8 * B;         // the prefetch distance, in k
  alignas(64) double p[kPairDots][B] = {};  // rows >= n stay +0 (their sums are discarded)
  double a[kPairDots] = {};
  for (index_t k0 = 0; k0 < d; k0 += B) {
    const index_t kb = std::min(B, d - k0);
    for (int j = 0; j < n; ++j) {
      // The rows are cold (a repair reads one row of a weight matrix just streamed past the
      // caches), and 2n streams are more than the hardware prefetchers follow well.
      if (k0 + kAhead < d) {
        __builtin_prefetch(x[j] + k0 + kAhead), __builtin_prefetch(x[j] + k0 + kAhead + 32);
        __builtin_prefetch(w[j] + k0 + kAhead), __builtin_prefetch(w[j] + k0 + kAhead + 32);
      }
      const bf16* xj = x[j] + k0;
      const bf16* wj = w[j] + k0;
      for (index_t k = 0; k < kb; ++k)
        p[j][k] = double(xj[k].to_float()) * double(wj[k].to_float());
    }
    for (index_t k = 0; k < kb; ++k) {
#pragma GCC unroll 16
      for (int j = 0; j < kPairDots; ++j) a[j] += p[j][k];
    }
  }
  for (int j = 0; j < n; ++j) s[j] = a[j];
}
// Columns: bound by their cache lines (one per k and pair, from the caches or memory), so the n
// chains advance k by k, each column's line kColAhead k ahead prefetched into L2 (measured, Zen 5,
// 3 columns of a 4096 × 1024 BF16 matrix: 39 → 20 µs from L3, 88 → 64 µs from memory, against
// the row body's blocked products).
__attribute__((always_inline)) inline void col_pair_dots_body(int n, const bf16* const* x,
                                                              const bf16* const* w, index_t d,
                                                              double* s, index_t ws) {
  constexpr index_t kColAhead = 64;
  double a[kPairDots] = {};
  for (index_t k = 0; k < d; ++k) {
    if (k + kColAhead < d)
      for (int j = 0; j < n; ++j) __builtin_prefetch(w[j] + (k + kColAhead) * ws, 0, 2);
    for (int j = 0; j < n; ++j)
      a[j] += double(x[j][k].to_float()) * double(w[j][k * ws].to_float());
  }
  for (int j = 0; j < n; ++j) s[j] = a[j];
}
inline void bf16_pair_dots_exact_scalar(int n, const bf16* const* x, const bf16* const* w,
                                        index_t d, double* s, index_t ws = 1) {
  if (ws != 1) return col_pair_dots_body(n, x, w, d, s, ws);
  pair_dots_body(n, x, w, d, s);
}

// out[t·ld_out + r] = float(Σ_k x[t·ld_x + k] · w[r·ld_w + k]), t < n_tok, r < n_rows.
inline void bf16_rows_dot_exact_scalar(float* out, index_t ld_out, const bf16* x, index_t ld_x,
                                       index_t n_tok, const bf16* w, index_t ld_w, index_t n_rows,
                                       index_t d) {
  for (index_t t = 0; t < n_tok; ++t)
    for (index_t r = 0; r < n_rows; ++r)
      out[t * ld_out + r] = float(bf16_dot_exact(x + t * ld_x, w + r * ld_w, d));
}

// out[t·ld_out + n] = float(Σ_k x[t·ld_x + k] · w[k·ld_w + n]), t < n_tok, n0 <= n < n1.
inline void bf16_cols_dot_exact_scalar(float* out, index_t ld_out, const bf16* x, index_t ld_x,
                                       index_t n_tok, const bf16* w, index_t ld_w, index_t d,
                                       index_t n0, index_t n1) {
  constexpr index_t C = 64;  // columns per pass: their sums advance together over k
  for (index_t t = 0; t < n_tok; ++t)
    for (index_t c0 = n0; c0 < n1; c0 += C) {
      const index_t nc = std::min(C, n1 - c0);
      double s[C] = {};
      for (index_t k = 0; k < d; ++k) {
        const double xv = x[t * ld_x + k].to_float();
        const bf16* wk = w + k * ld_w + c0;
        for (index_t j = 0; j < nc; ++j) s[j] += xv * double(wk[j].to_float());
      }
      for (index_t j = 0; j < nc; ++j) out[t * ld_out + c0 + j] = float(s[j]);
    }
}

// Tokens per pass of the few-token kernels (and of bf16_rows_gather_dots_exact on every tier).
inline constexpr int kFewTok = 4;

#if TILEDECODE_X86
namespace exact_detail {
inline constexpr int kTok = 8;          // rows: tokens per panel (the lanes of a register tile)
inline constexpr index_t kBlockK = 64;  // rows: k per block (a panel 4 KB, a widened tile 12 KB)
inline constexpr int kGroups = 4;       // rows: 8-token panels per pass over a row chunk's weights
inline constexpr index_t kChunkRows = 96;    // rows whose double sums are held at once
inline constexpr index_t kColsBlockK = 512;  // cols: k per block (8 tokens' x as double, 32 KB)
inline constexpr index_t kChunkCols = 96;    // cols: columns whose double sums are held at once

// The row's next block of weights (wr: this block, left: k from it to the row's end) into L1
// while this one runs: a chunk's rows are read a block at a time, more streams than the hardware
// prefetchers follow. Always inlined: called out of line, GCC 12 deems a function of prefetches
// alone side-effect free and drops the call (seen when a generic driver called it).
__attribute__((always_inline)) inline void prefetch_next_block(const bf16* wr, index_t left) {
  const index_t n = std::min(kBlockK, left - kBlockK);
  for (index_t k = 0; k < n; k += 32)
    _mm_prefetch(reinterpret_cast<const char*>(wr + kBlockK + k), _MM_HINT_T0);
}

// Few tokens (the rounding checks' repairs of one request's written candidates, the tokens past
// whole 8-token panels): the lanes on rows instead, so that no lane idles. Per 8 k, each group of
// 8 rows is an 8 × 8 block of BF16 transposed as 16-bit values (transpose8x8_bf16) and widened
// to doubles, one vector per k with the 8 rows in its lanes; per token a broadcast x[k] and a
// multiply-add per vector: each lane is one row's sum, in ascending k. Per 8 rows and k that is
// the transpose's 3 unpacks and a widening, shared by the tokens, and one multiply-add per token,
// against one per token panel (8 lanes) on the rows above.
inline constexpr index_t kFewBlockK = 512;  // k per block of the tokens' x as double (16 KB)
inline constexpr index_t kFewAhead = 256;   // their prefetch distance in the rows, in k

// c[j] = a[r][j] (8 BF16 values each, r < 8) in 16-bit lane r, j < 8: 16-bit interleaves of row
// pairs, 32-bit of pairs of pairs, 64-bit of the halves, 24 unpacks. SSE2, so it compiles into
// either tier's kernel (always inlined).
__attribute__((always_inline)) inline void transpose8x8_bf16(__m128i c[8], const __m128i a[8]) {
  __m128i b[8], h[8];
  for (int i = 0; i < 4; ++i) {  // rows 2i, 2i + 1: k 0-3, then k 4-7
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int g = 0; g < 2; ++g)  // rows 4g..4g + 3: k 0-1, 2-3, 4-5, 6-7
    for (int q = 0; q < 2; ++q) {
      h[4 * g + 2 * q] = _mm_unpacklo_epi32(b[4 * g + q], b[4 * g + q + 2]);
      h[4 * g + 2 * q + 1] = _mm_unpackhi_epi32(b[4 * g + q], b[4 * g + q + 2]);
    }
  for (int j = 0; j < 4; ++j) {  // rows 0-3 and 4-7 of k 2j, 2j + 1
    c[2 * j] = _mm_unpacklo_epi64(h[j], h[4 + j]);
    c[2 * j + 1] = _mm_unpackhi_epi64(h[j], h[4 + j]);
  }
}
// The same of rows[r][k + j]: 8 full loads (every row has k + 8 values), or the last n < 8 of a
// row (j >= n: +0) copied (kept apart: a copy puts the rows on the stack).
__attribute__((always_inline)) inline void transpose8x8_bf16(__m128i c[8], const bf16* const* rows,
                                                             index_t k) {
  __m128i a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + k));
  transpose8x8_bf16(c, a);
}
__attribute__((noinline)) inline void transpose8x8_bf16_tail(__m128i c[8], const bf16* const* rows,
                                                             index_t k, index_t n) {
  __m128i a[8];
  for (int r = 0; r < 8; ++r) {
    a[r] = _mm_setzero_si128();
    __builtin_memcpy(&a[r], rows[r] + k, std::size_t(n) * sizeof(bf16));
  }
  transpose8x8_bf16(c, a);
}

using Panels = double[kGroups][kBlockK * kTok];
using Sums = double[kGroups][kChunkRows * kTok];

// The rows arrangement of both vector tiers (the lanes on 8 tokens). Tier provides kTileRows and
//   token_panel(xp, x, ld_x, nt, kk)    xp[k][t] = x[t·ld_x + k] as double (t >= nt: +0)
//   widen_rows(wd, w, ld_w, nr, kk, left)   wd[r][k] = w[r·ld_w + k] as double, r < nr, and
//                                       each row's next block prefetched (left: k to its end)
//   tiles(nr, s, off, wd, xp, ng, kk)   s[g][off + r·8 + t] += Σ_k wd[r][k] · xp[g][k][t]
//                                       in ascending k, for each of the pass's ng panels
// Per chunk of rows and pass of up to kGroups panels, each block of a tile's rows is widened once.
// Always inlined into the tier's entry point, which compiles it (and Tier's functions) for the
// tier's target.
template <class Tier>
__attribute__((always_inline)) inline void rows_driver(float* out, index_t ld_out, const bf16* x,
                                                       index_t ld_x, index_t n_tok, const bf16* w,
                                                       index_t ld_w, index_t n_rows, index_t d) {
  alignas(64) Panels xp;
  alignas(64) double wd[Tier::kTileRows * kBlockK];
  alignas(64) Sums s;
  for (index_t r0 = 0; r0 < n_rows; r0 += kChunkRows) {
    const index_t nrc = std::min(kChunkRows, n_rows - r0);
    for (index_t t0 = 0; t0 < n_tok; t0 += kGroups * kTok) {
      const int ng = int(std::min<index_t>(kGroups, (n_tok - t0 + kTok - 1) / kTok));
      for (int g = 0; g < ng; ++g) std::fill_n(s[g], nrc * kTok, 0.0);
      for (index_t k0 = 0; k0 < d; k0 += kBlockK) {
        const index_t kk = std::min(kBlockK, d - k0);
        for (int g = 0; g < ng; ++g) {
          const index_t tg = t0 + g * kTok;
          Tier::token_panel(xp[g], x + tg * ld_x + k0, ld_x,
                            int(std::min<index_t>(kTok, n_tok - tg)), kk);
        }
        for (index_t rr = 0; rr < nrc; rr += Tier::kTileRows) {
          const int nr = int(std::min<index_t>(Tier::kTileRows, nrc - rr));
          const bf16* wr = w + (r0 + rr) * ld_w + k0;
          Tier::widen_rows(wd, wr, ld_w, nr, kk, d - k0);
          Tier::tiles(nr, s, rr * kTok, wd, xp, ng, kk);
        }
      }
      for (int g = 0; g < ng; ++g) {
        const index_t tg = t0 + g * kTok;
        for (index_t t = 0; t < std::min<index_t>(kTok, n_tok - tg); ++t)
          for (index_t r = 0; r < nrc; ++r)
            out[(tg + t) * ld_out + r0 + r] = float(s[g][r * kTok + t]);
      }
    }
  }
}

// put(t, r, Σ_k xs[t][k] · rows[r][k]) for t < NT, r < nr <= 8 · NG: the few-token arrangement
// (above), per block of kFewBlockK k the tokens' x widened to doubles (Tier::widen_x), per 8 k
// and group of 8 rows the block transposed (transpose8x8_bf16) and Tier::few_step<NT>(acc[.][v],
// c[j], xd, k + j) per k: acc[t][v] += the group's 8 weights at k, widened, times x[t][k], for t <
// NT. NG (<= Tier::kFewVecs) is a template argument so that the loops over groups and tokens
// unroll with constant indices into the sums. A full block goes through Tier::few_block8 (the
// same steps, the tier's transpose; H: the last group has at most 4 rows, which the tier may
// step alone, the padding rows' sums left out). Tier provides kFewVecs
// (groups per tile), FewAcc, few_zero(acc), few_step and few_store(a, acc) (the group's 8 sums
// into a[0..8)). Always inlined into the tier's entry points.
template <class Tier, int NT, int NG, bool H = false, class Put>
__attribute__((always_inline)) inline void few_tile(const bf16* const* rows, int nr,
                                                    const bf16* const* xs, index_t d, Put&& put) {
  alignas(64) double xd[NT * kFewBlockK];
  // The rows past nr repeat the last one (their sums are not put): every load is a full one.
  const bf16* rp[8 * NG];
  for (int r = 0; r < 8 * NG; ++r) rp[r] = rows[std::min(r, nr - 1)];
  typename Tier::FewAcc acc[NT][NG];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NG; ++v) Tier::few_zero(acc[t][v]);
  for (index_t k0 = 0; k0 < d; k0 += kFewBlockK) {
    const index_t kk = std::min(kFewBlockK, d - k0);
    for (int t = 0; t < NT; ++t) Tier::widen_x(xd + t * kFewBlockK, xs[t] + k0, kk);
    for (index_t k = 0; k < kk; k += 8) {
      const index_t n = std::min<index_t>(8, kk - k);
      if (k % 32 == 0 && k0 + k + kFewAhead < d)
        for (int r = 0; r < nr; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(rp[r] + k0 + k + kFewAhead), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < NG; ++v) {
        __m128i c[8];
        if (n == 8) {
          if (H && v == NG - 1)  // the last group's rows 4-7 are padding
            Tier::template few_block8<NT, NG, true>(acc, v, rp + 8 * v, k0 + k, xd, k);
          else
            Tier::template few_block8<NT, NG, false>(acc, v, rp + 8 * v, k0 + k, xd, k);
        } else {
          transpose8x8_bf16_tail(c, rp + 8 * v, k0 + k, n);
          for (int j = 0; j < int(n); ++j) Tier::template few_step<NT, NG>(acc, v, c[j], xd, k + j);
        }
      }
    }
  }
  double a[8];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NG; ++v) {
      Tier::few_store(a, acc[t][v]);
      for (int i = 0; i < std::min(8, nr - 8 * v); ++i) put(t, 8 * v + i, a[i]);
    }
}

// rows_driver's results, with the last n_tok % 8 tokens, up to kFewTok of them, on the tier's
// few-token kernel (Tier::few<NT>(xs, rows, nr, d, put): NT tokens and nr <= Tier::kFewRows rows
// by pointer, the lanes on rows): the same sums in the same order, so the same bits.
template <class Tier>
__attribute__((always_inline)) inline void rows_dispatch(float* out, index_t ld_out, const bf16* x,
                                                         index_t ld_x, index_t n_tok, const bf16* w,
                                                         index_t ld_w, index_t n_rows, index_t d) {
  const index_t few = n_tok % kTok <= kFewTok ? n_tok % kTok : 0, panels = n_tok - few;
  if (panels > 0) rows_driver<Tier>(out, ld_out, x, ld_x, panels, w, ld_w, n_rows, d);
  if (few == 0) return;
  float* fo = out + panels * ld_out;
  with_static_count<kFewTok>(int(few), [&]<int NT>() {
    const bf16* xs[NT];
    for (int t = 0; t < NT; ++t) xs[t] = x + (panels + t) * ld_x;
    const bf16* rows[Tier::kFewRows];
    for (index_t r0 = 0; r0 < n_rows; r0 += Tier::kFewRows) {
      const int nr = int(std::min<index_t>(Tier::kFewRows, n_rows - r0));
      for (int r = 0; r < nr; ++r) rows[r] = w + (r0 + r) * ld_w;
      Tier::template few<NT>(xs, rows, nr, d,
                             [&](int t, int r, double v) { fo[t * ld_out + r0 + r] = float(v); });
    }
  });
}

// The cols arrangement of both vector tiers (the lanes on Tier::kLanes columns, Tier::kColTok
// tokens per register tile). Tier provides
//   widen_x(xr, x, kk)                  xr[k] = x[k] as double (x null: +0)
//   col_tiles(nv, s, ld_s, xr, w, ld_w, kk)   s[t·ld_s + j] += Σ_k xr[t][k] · w[k·ld_w + j],
//                                       ascending k, for j < nv·kLanes (xr: kColsBlockK apart)
// and the last columns (fewer than kLanes) are summed here one at a time, in the same order.
template <class Tier>
__attribute__((always_inline)) inline void cols_driver(float* out, index_t ld_out, const bf16* x,
                                                       index_t ld_x, index_t n_tok, const bf16* w,
                                                       index_t ld_w, index_t d, index_t n0,
                                                       index_t n1) {
  constexpr int TT = Tier::kColTok, L = Tier::kLanes;
  alignas(64) double xr[TT * kColsBlockK];
  alignas(64) double s[TT * kChunkCols];
  for (index_t c0 = n0; c0 < n1; c0 += kChunkCols) {
    const index_t nc = std::min(kChunkCols, n1 - c0), nv = nc / L;  // whole vectors
    for (index_t t0 = 0; t0 < n_tok; t0 += TT) {
      const int nt = int(std::min<index_t>(TT, n_tok - t0));
      std::fill_n(s, TT * kChunkCols, 0.0);
      for (index_t k0 = 0; k0 < d; k0 += kColsBlockK) {
        const index_t kk = std::min(kColsBlockK, d - k0);
        for (int t = 0; t < TT; ++t)
          Tier::widen_x(xr + t * kColsBlockK, t < nt ? x + (t0 + t) * ld_x + k0 : nullptr, kk);
        Tier::col_tiles(nv, s, kChunkCols, xr, w + k0 * ld_w + c0, ld_w, kk);
        for (index_t j = L * nv; j < nc; ++j)
          for (int t = 0; t < nt; ++t) {
            double a = s[t * kChunkCols + j];
            for (index_t k = 0; k < kk; ++k)
              a += xr[t * kColsBlockK + k] * double(w[(k0 + k) * ld_w + c0 + j].to_float());
            s[t * kChunkCols + j] = a;
          }
      }
      for (int t = 0; t < nt; ++t)
        for (index_t j = 0; j < nc; ++j)
          out[(t0 + t) * ld_out + c0 + j] = float(s[t * kChunkCols + j]);
    }
  }
}
}  // namespace exact_detail

namespace avx512 {
namespace exact_detail {
using namespace cpu::exact_detail;

// Every lane. The maskz forms of the intrinsics below take +0 where the plain ones take an
// "undefined" source, which GCC 12 reports as maybe-uninitialized once they are inlined (the same
// instructions: an all-ones mask is no mask).
inline constexpr __mmask8 kAll = 0xff;

// The n <= 8 BF16 at p as 8 doubles (the rest +0).
TILEDECODE_TARGET_AVX512 inline __m512d widen8(const bf16* p, index_t n) {
  const __m128i v = n >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                           : _mm_maskz_loadu_epi16(__mmask8((1u << n) - 1u), p);
  return _mm512_maskz_cvtps_pd(
      kAll, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
}

// s[r][0..8) += Σ_{k<kk} wd[r][k] · xp[k][0..8), ascending k (s: NR × 8 doubles).
template <int NR>
TILEDECODE_TARGET_AVX512 inline void rows_tile(double* s, const double* wd, const double* xp,
                                               index_t kk) {
  __m512d acc[NR];
#pragma GCC unroll 24
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_load_pd(s + r * kTok);
  for (index_t k = 0; k < kk; ++k) {
    const __m512d xv = _mm512_load_pd(xp + k * kTok);
#pragma GCC unroll 24
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_fmadd_pd(_mm512_set1_pd(wd[r * kBlockK + k]), xv, acc[r]);
  }
#pragma GCC unroll 24
  for (int r = 0; r < NR; ++r) _mm512_store_pd(s + r * kTok, acc[r]);
}

// s[t][v·8 + j] += Σ_{k<kk} xr[t][k] · w[k·ld_w + v·8 + j], ascending k, t < 8, v < NV.
template <int NV>
TILEDECODE_TARGET_AVX512 inline void cols_tile(double* s, index_t ld_s, const double* xr,
                                               const bf16* w, index_t ld_w, index_t kk) {
  __m512d acc[kTok][NV];
#pragma GCC unroll 8
  for (int t = 0; t < kTok; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_loadu_pd(s + t * ld_s + 8 * v);
  for (index_t k = 0; k < kk; ++k) {
    __m512d wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wv[v] = widen8(w + k * ld_w + 8 * v, 8);
#pragma GCC unroll 8
    for (int t = 0; t < kTok; ++t) {
      const __m512d xb = _mm512_set1_pd(xr[t * kColsBlockK + k]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_pd(wv[v], xb, acc[t][v]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTok; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm512_storeu_pd(s + t * ld_s + 8 * v, acc[t][v]);
}

// The drivers' tier (cpu::exact_detail): 24-row tiles on 8 token lanes; 3 × 8 columns × 8 tokens.
struct Tier {
  static constexpr int kTileRows = 24, kColTok = 8, kLanes = 8, kTileVecs = 3;
  // The few-token kernel (cpu::exact_detail::few_tile): 4 groups of 8 rows, a vector each, so
  // NT · 4 chains of multiply-adds overlap.
  static constexpr int kFewVecs = 4, kFewRows = 8 * kFewVecs;
  using FewAcc = __m512d;
  TILEDECODE_TARGET_AVX512 static void few_zero(FewAcc& a) { a = _mm512_setzero_pd(); }
  // acc[t][v] += w[0..8)[k] · xd[t·kFewBlockK + k] for t < NT, c: w's 8 rows at k as BF16.
  template <int NT, int NG>
  TILEDECODE_TARGET_AVX512 static void few_step(FewAcc (*acc)[NG], int v, __m128i c,
                                                const double* xd, index_t k) {
    const __m512d wv = _mm512_maskz_cvtps_pd(
        kAll, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(c), 16)));
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
      acc[t][v] = _mm512_fmadd_pd(wv, _mm512_set1_pd(xd[t * kFewBlockK + k]), acc[t][v]);
  }
  // few_step for the 8 k of a full 8 × 8 block at pos (x at xd[kx ..]).
  template <int NT, int NG, bool H>  // H: no shorter form here (8 rows a vector)
  TILEDECODE_TARGET_AVX512 static void few_block8(FewAcc (*acc)[NG], int v, const bf16* const* rows,
                                                  index_t pos, const double* xd, index_t kx) {
    __m128i c[8];
    transpose8x8_bf16(c, rows, pos);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) few_step<NT, NG>(acc, v, c[j], xd, kx + j);
  }
  TILEDECODE_TARGET_AVX512 static void few_store(double* a, const FewAcc& acc) {
    _mm512_storeu_pd(a, acc);
  }
  template <int NT, class Put>
  TILEDECODE_TARGET_AVX512 static void few(const bf16* const* xs, const bf16* const* rows, int nr,
                                           index_t d, Put&& put) {
    with_static_count<kFewVecs>((nr + 7) / 8, [&]<int NG>() TILEDECODE_TARGET_AVX512 {
      few_tile<Tier, NT, NG>(rows, nr, xs, d, put);
    });
  }
  template <int NT>
  TILEDECODE_TARGET_AVX512 static void gather(const bf16* const* xs, const bf16* const* rows,
                                              int nr, index_t d, double* s, index_t ld_s) {
    few<NT>(xs, rows, nr, d, [&](int t, int r, double v) { s[t * ld_s + r] = v; });
  }

  // 8×8 transposes of the tokens' widened rows.
  TILEDECODE_TARGET_AVX512 static void token_panel(double* xp, const bf16* x, index_t ld_x, int nt,
                                                   index_t kk) {
    for (index_t k = 0; k < kk; k += 8) {
      const index_t n = std::min<index_t>(8, kk - k);
      __m512d r[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) r[t] = t < nt ? widen8(x + t * ld_x + k, n) : _mm512_setzero_pd();
      __m512d u[8], v[8];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {  // pairs of tokens, interleaved by k
        u[2 * i] = _mm512_maskz_unpacklo_pd(kAll, r[2 * i], r[2 * i + 1]);
        u[2 * i + 1] = _mm512_maskz_unpackhi_pd(kAll, r[2 * i], r[2 * i + 1]);
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // tokens 4h..4h+3: 128-bit lanes gathered by k
        v[4 * h + 0] = _mm512_maskz_shuffle_f64x2(kAll, u[4 * h], u[4 * h + 2], 0x88);  // k 0, 4
        v[4 * h + 1] = _mm512_maskz_shuffle_f64x2(kAll, u[4 * h], u[4 * h + 2], 0xdd);  // k 2, 6
        v[4 * h + 2] = _mm512_maskz_shuffle_f64x2(kAll, u[4 * h + 1], u[4 * h + 3], 0x88);  // 1, 5
        v[4 * h + 3] = _mm512_maskz_shuffle_f64x2(kAll, u[4 * h + 1], u[4 * h + 3], 0xdd);  // 3, 7
      }
      const __m512d col[8] = {_mm512_maskz_shuffle_f64x2(kAll, v[0], v[4], 0x88),
                              _mm512_maskz_shuffle_f64x2(kAll, v[2], v[6], 0x88),
                              _mm512_maskz_shuffle_f64x2(kAll, v[1], v[5], 0x88),
                              _mm512_maskz_shuffle_f64x2(kAll, v[3], v[7], 0x88),
                              _mm512_maskz_shuffle_f64x2(kAll, v[0], v[4], 0xdd),
                              _mm512_maskz_shuffle_f64x2(kAll, v[2], v[6], 0xdd),
                              _mm512_maskz_shuffle_f64x2(kAll, v[1], v[5], 0xdd),
                              _mm512_maskz_shuffle_f64x2(kAll, v[3], v[7], 0xdd)};
      for (index_t j = 0; j < n; ++j) _mm512_store_pd(xp + (k + j) * kTok, col[j]);
    }
  }
  TILEDECODE_TARGET_AVX512 static void widen_rows(double* wd, const bf16* w, index_t ld_w, int nr,
                                                  index_t kk, index_t left) {
    for (int r = 0; r < nr; ++r) {
      for (index_t k = 0; k < kk; k += 8)
        _mm512_store_pd(wd + r * kBlockK + k,
                        widen8(w + r * ld_w + k, std::min<index_t>(8, kk - k)));
      prefetch_next_block(w + r * ld_w, left);
    }
  }
  TILEDECODE_TARGET_AVX512 static void tiles(int nr, Sums& s, index_t off, const double* wd,
                                             const Panels& xp, int ng, index_t kk) {
    with_static_count<kTileRows>(nr, [&]<int NR>() TILEDECODE_TARGET_AVX512 {
      for (int g = 0; g < ng; ++g) rows_tile<NR>(s[g] + off, wd, xp[g], kk);
    });
  }
  TILEDECODE_TARGET_AVX512 static void widen_x(double* xr, const bf16* x, index_t kk) {
    for (index_t k = 0; k < kk; k += 8)
      _mm512_store_pd(xr + k,
                      x ? widen8(x + k, std::min<index_t>(8, kk - k)) : _mm512_setzero_pd());
  }
  TILEDECODE_TARGET_AVX512 static void col_tiles(index_t nv, double* s, index_t ld_s,
                                                 const double* xr, const bf16* w, index_t ld_w,
                                                 index_t kk) {
    for (index_t v = 0; v < nv; v += kTileVecs)
      with_static_count<kTileVecs>(int(std::min<index_t>(kTileVecs, nv - v)),
                                   [&]<int NV>() TILEDECODE_TARGET_AVX512 {
                                     cols_tile<NV>(s + 8 * v, ld_s, xr, w + 8 * v, ld_w, kk);
                                   });
  }
};
}  // namespace exact_detail

// bf16_rows_dot_exact_scalar's results (the order at the top), the lanes on tokens (the last
// n_tok % 8 <= kFewTok tokens: on rows).
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot_exact(float* out, index_t ld_out, const bf16* x,
                                                         index_t ld_x, index_t n_tok, const bf16* w,
                                                         index_t ld_w, index_t n_rows, index_t d) {
  cpu::exact_detail::rows_dispatch<exact_detail::Tier>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows,
                                                       d);
}

// bf16_cols_dot_exact_scalar's results (the order at the top), the lanes on columns.
TILEDECODE_TARGET_AVX512 inline void bf16_cols_dot_exact(float* out, index_t ld_out, const bf16* x,
                                                         index_t ld_x, index_t n_tok, const bf16* w,
                                                         index_t ld_w, index_t d, index_t n0,
                                                         index_t n1) {
  cpu::exact_detail::cols_driver<exact_detail::Tier>(out, ld_out, x, ld_x, n_tok, w, ld_w, d, n0,
                                                     n1);
}
}  // namespace avx512

namespace avx2 {
namespace exact_detail {
using namespace cpu::exact_detail;

// The n <= 4 BF16 at p as 4 doubles (the rest +0).
TILEDECODE_TARGET_AVX2 inline __m256d widen4(const bf16* p, index_t n) {
  std::uint64_t bits = 0;
  if (n >= 4)
    __builtin_memcpy(&bits, p, 8);
  else
    __builtin_memcpy(&bits, p, std::size_t(n) * 2);
  const __m128i v = _mm_cvtepu16_epi32(_mm_cvtsi64_si128(static_cast<long long>(bits)));
  return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(v, 16)));
}

template <int NR>
TILEDECODE_TARGET_AVX2 inline void rows_tile(double* s, const double* wd, const double* xp,
                                             index_t kk) {
  __m256d lo[NR], hi[NR];
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
    lo[r] = _mm256_load_pd(s + r * kTok);
    hi[r] = _mm256_load_pd(s + r * kTok + 4);
  }
  for (index_t k = 0; k < kk; ++k) {
    const __m256d x0 = _mm256_load_pd(xp + k * kTok), x1 = _mm256_load_pd(xp + k * kTok + 4);
#pragma GCC unroll 6
    for (int r = 0; r < NR; ++r) {
      const __m256d wb = _mm256_broadcast_sd(wd + r * kBlockK + k);
      lo[r] = _mm256_fmadd_pd(wb, x0, lo[r]);
      hi[r] = _mm256_fmadd_pd(wb, x1, hi[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
    _mm256_store_pd(s + r * kTok, lo[r]);
    _mm256_store_pd(s + r * kTok + 4, hi[r]);
  }
}

template <int NV>
TILEDECODE_TARGET_AVX2 inline void cols_tile(double* s, index_t ld_s, const double* xr,
                                             const bf16* w, index_t ld_w, index_t kk) {
  constexpr int TT = 4;
  __m256d acc[TT][NV];
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_loadu_pd(s + t * ld_s + 4 * v);
  for (index_t k = 0; k < kk; ++k) {
    __m256d wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wv[v] = widen4(w + k * ld_w + 4 * v, 4);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const __m256d xb = _mm256_broadcast_sd(xr + t * kColsBlockK + k);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_fmadd_pd(wv[v], xb, acc[t][v]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm256_storeu_pd(s + t * ld_s + 4 * v, acc[t][v]);
}

// The drivers' tier: 6-row tiles on 8 token lanes (two vectors); 3 × 4 columns × 4 tokens.
struct Tier {
  static constexpr int kTileRows = 6, kColTok = 4, kLanes = 4, kTileVecs = 3;
  // The few-token kernel (cpu::exact_detail::few_tile): one group of 8 rows, two vectors, so NT
  // · 2 chains of multiply-adds overlap; two tokens at a time. 16 vector registers: two groups
  // spilled sums and transposed rows (measured on a Zen 3, 16 rows × 4096, two tokens: 23 µs,
  // against 27 µs in two groups).
  static constexpr int kFewVecs = 1, kFewRows = 8 * kFewVecs;
  struct FewAcc {
    __m256d lo, hi;
  };
  TILEDECODE_TARGET_AVX2 static void few_zero(FewAcc& a) { a.lo = a.hi = _mm256_setzero_pd(); }
  template <int NT, int NG>
  TILEDECODE_TARGET_AVX2 static void few_step(FewAcc (*acc)[NG], int v, __m128i c, const double* xd,
                                              index_t k) {
    const __m128i z = _mm_setzero_si128();  // BF16 in the high half: its FP32
    const __m256d lo = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(z, c))),
                  hi = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(z, c)));
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) {
      const __m256d xb = _mm256_broadcast_sd(xd + t * kFewBlockK + k);
      acc[t][v].lo = _mm256_fmadd_pd(lo, xb, acc[t][v].lo);
      acc[t][v].hi = _mm256_fmadd_pd(hi, xb, acc[t][v].hi);
    }
  }
  // few_step for the 8 k of a full 8 × 8 block at pos (x at xd[kx ..]), the transpose's last
  // stage left out: after the 16- and 32-bit interleaves h[j] (h[4 + j]) holds rows 0-3 (4-7) at
  // k = 2j and 2j + 1, which the widening's unpacks with zero take apart (32 shuffles a block
  // instead of 40). H: rows 0-3 alone (half the shuffles, conversions and multiply-adds; the
  // sums of rows 4-7 are left at +0: padding).
  template <int NT, int NG, bool H>
  TILEDECODE_TARGET_AVX2 static void few_block8(FewAcc (*acc)[NG], int v, const bf16* const* rows,
                                                index_t pos, const double* xd, index_t kx) {
    constexpr int R = H ? 4 : 8;
    __m128i a[8], b[8], h[8];
    for (int r = 0; r < R; ++r)
      a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + pos));
    for (int i = 0; i < R / 2; ++i) {
      b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
      b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int g = 0; g < R / 4; ++g)
      for (int q = 0; q < 2; ++q) {
        h[4 * g + 2 * q] = _mm_unpacklo_epi32(b[4 * g + q], b[4 * g + q + 2]);
        h[4 * g + 2 * q + 1] = _mm_unpackhi_epi32(b[4 * g + q], b[4 * g + q + 2]);
      }
    const __m128i z = _mm_setzero_si128();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        const __m128i r03 = e ? _mm_unpackhi_epi16(z, h[j]) : _mm_unpacklo_epi16(z, h[j]);
        const __m256d lo = _mm256_cvtps_pd(_mm_castsi128_ps(r03));
        const index_t k = kx + 2 * j + e;
        if constexpr (H) {
#pragma GCC unroll 2
          for (int t = 0; t < NT; ++t)
            acc[t][v].lo =
                _mm256_fmadd_pd(lo, _mm256_broadcast_sd(xd + t * kFewBlockK + k), acc[t][v].lo);
        } else {
          const __m128i r47 = e ? _mm_unpackhi_epi16(z, h[4 + j]) : _mm_unpacklo_epi16(z, h[4 + j]);
          const __m256d hi = _mm256_cvtps_pd(_mm_castsi128_ps(r47));
#pragma GCC unroll 2
          for (int t = 0; t < NT; ++t) {
            const __m256d xb = _mm256_broadcast_sd(xd + t * kFewBlockK + k);
            acc[t][v].lo = _mm256_fmadd_pd(lo, xb, acc[t][v].lo);
            acc[t][v].hi = _mm256_fmadd_pd(hi, xb, acc[t][v].hi);
          }
        }
      }
  }
  TILEDECODE_TARGET_AVX2 static void few_store(double* a, const FewAcc& acc) {
    _mm256_storeu_pd(a, acc.lo);
    _mm256_storeu_pd(a + 4, acc.hi);
  }
  template <int NT, class Put>
  TILEDECODE_TARGET_AVX2 static void few(const bf16* const* xs, const bf16* const* rows, int nr,
                                         index_t d, Put&& put) {
    with_static_count<kFewVecs>((nr + 7) / 8, [&]<int NG>() TILEDECODE_TARGET_AVX2 {
      const auto tiles = [&]<bool H>() TILEDECODE_TARGET_AVX2 {
        few_tile<Tier, std::min(NT, 2), NG, H>(rows, nr, xs, d, put);
        if constexpr (NT > 2)
          few_tile<Tier, NT - 2, NG, H>(rows, nr, xs + 2, d,
                                        [&](int t, int r, double v) { put(t + 2, r, v); });
      };
      if (nr - 8 * (NG - 1) <= 4)
        tiles.template operator()<true>();
      else
        tiles.template operator()<false>();
    });
  }
  template <int NT>
  TILEDECODE_TARGET_AVX2 static void gather(const bf16* const* xs, const bf16* const* rows, int nr,
                                            index_t d, double* s, index_t ld_s) {
    few<NT>(xs, rows, nr, d, [&](int t, int r, double v) { s[t * ld_s + r] = v; });
  }

  // 4×4 transposes of the tokens' widened rows, two per 8 tokens.
  TILEDECODE_TARGET_AVX2 static void token_panel(double* xp, const bf16* x, index_t ld_x, int nt,
                                                 index_t kk) {
    for (index_t k = 0; k < kk; k += 4) {
      const index_t n = std::min<index_t>(4, kk - k);
      for (int h = 0; h < 2; ++h) {  // tokens 4h..4h+3
        __m256d r[4];
        for (int i = 0; i < 4; ++i) {
          const int t = 4 * h + i;
          r[i] = t < nt ? widen4(x + t * ld_x + k, n) : _mm256_setzero_pd();
        }
        const __m256d u0 = _mm256_unpacklo_pd(r[0], r[1]), u1 = _mm256_unpackhi_pd(r[0], r[1]);
        const __m256d u2 = _mm256_unpacklo_pd(r[2], r[3]), u3 = _mm256_unpackhi_pd(r[2], r[3]);
        const __m256d col[4] = {
            _mm256_permute2f128_pd(u0, u2, 0x20), _mm256_permute2f128_pd(u1, u3, 0x20),
            _mm256_permute2f128_pd(u0, u2, 0x31), _mm256_permute2f128_pd(u1, u3, 0x31)};
        for (index_t j = 0; j < n; ++j) _mm256_store_pd(xp + (k + j) * kTok + 4 * h, col[j]);
      }
    }
  }
  TILEDECODE_TARGET_AVX2 static void widen_rows(double* wd, const bf16* w, index_t ld_w, int nr,
                                                index_t kk, index_t left) {
    for (int r = 0; r < nr; ++r) {
      for (index_t k = 0; k < kk; k += 4)
        _mm256_store_pd(wd + r * kBlockK + k,
                        widen4(w + r * ld_w + k, std::min<index_t>(4, kk - k)));
      prefetch_next_block(w + r * ld_w, left);
    }
  }
  TILEDECODE_TARGET_AVX2 static void tiles(int nr, Sums& s, index_t off, const double* wd,
                                           const Panels& xp, int ng, index_t kk) {
    with_static_count<kTileRows>(nr, [&]<int NR>() TILEDECODE_TARGET_AVX2 {
      for (int g = 0; g < ng; ++g) rows_tile<NR>(s[g] + off, wd, xp[g], kk);
    });
  }
  TILEDECODE_TARGET_AVX2 static void widen_x(double* xr, const bf16* x, index_t kk) {
    for (index_t k = 0; k < kk; k += 4)
      _mm256_store_pd(xr + k,
                      x ? widen4(x + k, std::min<index_t>(4, kk - k)) : _mm256_setzero_pd());
  }
  TILEDECODE_TARGET_AVX2 static void col_tiles(index_t nv, double* s, index_t ld_s,
                                               const double* xr, const bf16* w, index_t ld_w,
                                               index_t kk) {
    for (index_t v = 0; v < nv; v += kTileVecs)
      with_static_count<kTileVecs>(int(std::min<index_t>(kTileVecs, nv - v)),
                                   [&]<int NV>() TILEDECODE_TARGET_AVX2 {
                                     cols_tile<NV>(s + 4 * v, ld_s, xr, w + 4 * v, ld_w, kk);
                                   });
  }
};
}  // namespace exact_detail

// bf16_rows_dot_exact_scalar's results (the order at the top), the lanes on tokens (the last
// n_tok % 8 <= kFewTok tokens: on rows).
TILEDECODE_TARGET_AVX2 inline void bf16_rows_dot_exact(float* out, index_t ld_out, const bf16* x,
                                                       index_t ld_x, index_t n_tok, const bf16* w,
                                                       index_t ld_w, index_t n_rows, index_t d) {
  cpu::exact_detail::rows_dispatch<exact_detail::Tier>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows,
                                                       d);
}

// bf16_cols_dot_exact_scalar's results (the order at the top), the lanes on columns.
TILEDECODE_TARGET_AVX2 inline void bf16_cols_dot_exact(float* out, index_t ld_out, const bf16* x,
                                                       index_t ld_x, index_t n_tok, const bf16* w,
                                                       index_t ld_w, index_t d, index_t n0,
                                                       index_t n1) {
  cpu::exact_detail::cols_driver<exact_detail::Tier>(out, ld_out, x, ld_x, n_tok, w, ld_w, d, n0,
                                                     n1);
}
}  // namespace avx2
#endif  // TILEDECODE_X86

// The one dispatch point: the tier's kernel (each gives bf16_rows_dot_exact_scalar's bits).
inline void bf16_rows_dot_exact(Isa isa, float* out, index_t ld_out, const bf16* x, index_t ld_x,
                                index_t n_tok, const bf16* w, index_t ld_w, index_t n_rows,
                                index_t d) {
#if TILEDECODE_X86
  if (isa == Isa::avx512)
    return avx512::bf16_rows_dot_exact(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d);
  if (has_avx2(isa))
    return avx2::bf16_rows_dot_exact(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d);
#endif
  (void)isa;
  bf16_rows_dot_exact_scalar(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d);
}

#if TILEDECODE_X86
namespace avx512 {
// 8 BF16 values at p as doubles.
TILEDECODE_TARGET_AVX512 inline __m512d pair_widen8(const bf16* p) {
  const __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return _mm512_maskz_cvtps_pd(__mmask8(0xff), _mm256_castsi256_ps(u));
}
// The lanes on the pairs, 8 to a vector: per 8 k, each pair's 8 products (exact in double) as a
// vector, an 8 × 8 transpose in registers (24 shuffles; the maskz forms with every lane set: the
// plain ones trip GCC 12's -Wmaybe-uninitialized), then the 8 additions in ascending k. The two
// vectors' chains of additions (pairs 0-7, 8-15) are independent: they overlap.
TILEDECODE_TARGET_AVX512 inline __m512d pair_block8(const bf16* const* xs, const bf16* const* ws,
                                                    index_t k0, __m512d acc) {
  constexpr __mmask8 all = 0xff;
  __m512d r[8], t[8], u[8], c[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    r[j] = _mm512_mul_pd(pair_widen8(xs[j] + k0), pair_widen8(ws[j] + k0));
    // t: pairs (2i, 2i + 1) interleaved by k parity; u: their 128-bit lanes gathered; c[k]: k of
    // every pair.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_pd(all, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_pd(all, r[2 * i], r[2 * i + 1]);
  }
  u[0] = _mm512_maskz_shuffle_f64x2(all, t[0], t[2], 0x88);  // k 0, 4 of pairs 0-3
  u[1] = _mm512_maskz_shuffle_f64x2(all, t[0], t[2], 0xdd);  // k 2, 6
  u[2] = _mm512_maskz_shuffle_f64x2(all, t[1], t[3], 0x88);  // k 1, 5
  u[3] = _mm512_maskz_shuffle_f64x2(all, t[1], t[3], 0xdd);  // k 3, 7
  u[4] = _mm512_maskz_shuffle_f64x2(all, t[4], t[6], 0x88);  // the same of pairs 4-7
  u[5] = _mm512_maskz_shuffle_f64x2(all, t[4], t[6], 0xdd);
  u[6] = _mm512_maskz_shuffle_f64x2(all, t[5], t[7], 0x88);
  u[7] = _mm512_maskz_shuffle_f64x2(all, t[5], t[7], 0xdd);
  c[0] = _mm512_maskz_shuffle_f64x2(all, u[0], u[4], 0x88);
  c[4] = _mm512_maskz_shuffle_f64x2(all, u[0], u[4], 0xdd);
  c[2] = _mm512_maskz_shuffle_f64x2(all, u[1], u[5], 0x88);
  c[6] = _mm512_maskz_shuffle_f64x2(all, u[1], u[5], 0xdd);
  c[1] = _mm512_maskz_shuffle_f64x2(all, u[2], u[6], 0x88);
  c[5] = _mm512_maskz_shuffle_f64x2(all, u[2], u[6], 0xdd);
  c[3] = _mm512_maskz_shuffle_f64x2(all, u[3], u[7], 0x88);
  c[7] = _mm512_maskz_shuffle_f64x2(all, u[3], u[7], 0xdd);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) acc = _mm512_add_pd(acc, c[k]);
  return acc;
}
TILEDECODE_TARGET_AVX512 inline void bf16_pair_dots_exact(int n, const bf16* const* x,
                                                          const bf16* const* w, index_t d,
                                                          double* s, index_t w_stride) {
  if (w_stride != 1) return col_pair_dots_body(n, x, w, d, s, w_stride);
  constexpr index_t kAhead = 512;  // the prefetch distance, in k (see pair_dots_body)
  const bf16* xs[kPairDots];
  const bf16* ws[kPairDots];
  for (int j = 0; j < kPairDots; ++j) {  // the missing pairs repeat the first (discarded)
    xs[j] = x[j < n ? j : 0];
    ws[j] = w[j < n ? j : 0];
  }
  const bool two = n > 8;
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  const index_t d8 = d - d % 8;
  for (index_t k0 = 0; k0 < d8; k0 += 8) {
    if (k0 % 32 == 0 && k0 + kAhead < d)
      for (int j = 0; j < n; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(xs[j] + k0 + kAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ws[j] + k0 + kAhead), _MM_HINT_T0);
      }
    acc0 = pair_block8(xs, ws, k0, acc0);
    if (two) acc1 = pair_block8(xs + 8, ws + 8, k0, acc1);
  }
  alignas(64) double a[kPairDots];
  _mm512_store_pd(a, acc0);
  _mm512_store_pd(a + 8, acc1);
  for (int j = 0; j < n; ++j) {
    for (index_t k = d8; k < d; ++k)
      a[j] += double(xs[j][k].to_float()) * double(ws[j][k].to_float());
    s[j] = a[j];
  }
}
}  // namespace avx512
namespace avx2 {
TILEDECODE_TARGET_AVX2 inline void bf16_pair_dots_exact(int n, const bf16* const* x,
                                                        const bf16* const* w, index_t d, double* s,
                                                        index_t ws) {
  if (ws != 1) return col_pair_dots_body(n, x, w, d, s, ws);
  pair_dots_body(n, x, w, d, s);
}
}  // namespace avx2
#endif

// The pairs' sums compiled for the tier (the same order, so the same bits, on every one).
inline void bf16_pair_dots_exact(Isa isa, int n, const bf16* const* x, const bf16* const* w,
                                 index_t d, double* s, index_t ws = 1) {
#if TILEDECODE_X86
  if (isa == Isa::avx512) return avx512::bf16_pair_dots_exact(n, x, w, d, s, ws);
  if (has_avx2(isa)) return avx2::bf16_pair_dots_exact(n, x, w, d, s, ws);
#endif
  (void)isa;
  bf16_pair_dots_exact_scalar(n, x, w, d, s, ws);
}

// s[t·ld_s + j] = Σ_{k<d} xs[t][k] · rows[j][k] for t < nt, j < n (any nt, n >= 0):
// bf16_dot_exact's sum of each of nt token rows with each of n weight rows, both by pointer (the
// rounding checks' repairs: the q-latent's and the kv checks' from the transposed rows, one token's
// listed dots or all of them; the compressors' channels on the scalar tier, through
// bf16_rows_gather_dots_rounded, which the vector tiers sum in another order, certified),
// on the few-token kernel (the lanes on rows, each x widened once, kFewTok tokens per pass over the
// rows), the scalar tier on the pairs' body. Measured on an Intel Xeon, one token, rows of 4096
// in cache, against bf16_pair_dots_exact (which widens x per pair and transposes the products):
// avx512 6.4 / 12.9 / 28 µs for 8 / 16 / 32 rows against 9.1 / 20 / 40, avx2 6.5 / 14 / 27
// against 24 / 35 / 69.
inline void bf16_rows_gather_dots_exact(Isa isa, int nt, const bf16* const* xs, int n,
                                        const bf16* const* rows, index_t d, double* s,
                                        index_t ld_s) {
  for (int t0 = 0; t0 < nt; t0 += kFewTok) {
    const int m = std::min(kFewTok, nt - t0);
    const bf16* const* x = xs + t0;
    double* st = s + t0 * ld_s;
#if TILEDECODE_X86
    if (isa == Isa::avx512 || has_avx2(isa)) {
      with_static_count<kFewTok>(m, [&]<int NT>() {
        const int R = isa == Isa::avx512 ? avx512::exact_detail::Tier::kFewRows
                                         : avx2::exact_detail::Tier::kFewRows;
        for (int j = 0; j < n; j += R) {
          const int nr = std::min(R, n - j);
          if (isa == Isa::avx512)
            avx512::exact_detail::Tier::gather<NT>(x, rows + j, nr, d, st + j, ld_s);
          else
            avx2::exact_detail::Tier::gather<NT>(x, rows + j, nr, d, st + j, ld_s);
        }
      });
      continue;
    }
#endif
    for (int t = 0; t < m; ++t) {
      const bf16* xr[kPairDots];
      std::fill_n(xr, kPairDots, x[t]);
      for (int j = 0; j < n; j += kPairDots)
        bf16_pair_dots_exact_scalar(std::min(kPairDots, n - j), xr, rows + j, d, st + t * ld_s + j);
    }
  }
  (void)isa;
}
// One x: s[j] = Σ_{k<d} x[k] · rows[j][k], j < n.
inline void bf16_rows_gather_dots_exact(Isa isa, int n, const bf16* x, const bf16* const* rows,
                                        index_t d, double* s) {
  bf16_rows_gather_dots_exact(isa, 1, &x, n, rows, d, s, 0);
}

inline void bf16_cols_dot_exact(Isa isa, float* out, index_t ld_out, const bf16* x, index_t ld_x,
                                index_t n_tok, const bf16* w, index_t ld_w, index_t d, index_t n0,
                                index_t n1) {
#if TILEDECODE_X86
  if (isa == Isa::avx512)
    return avx512::bf16_cols_dot_exact(out, ld_out, x, ld_x, n_tok, w, ld_w, d, n0, n1);
  if (has_avx2(isa))
    return avx2::bf16_cols_dot_exact(out, ld_out, x, ld_x, n_tok, w, ld_w, d, n0, n1);
#endif
  (void)isa;
  bf16_cols_dot_exact_scalar(out, ld_out, x, ld_x, n_tok, w, ld_w, d, n0, n1);
}

}  // namespace tiledecode::cpu
