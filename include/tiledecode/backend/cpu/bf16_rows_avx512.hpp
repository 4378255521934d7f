#pragma once
// The BF16-row kernels of the AVX-512 tier (Isa::avx512) on vdpbf16ps (AVX512_BF16: 16 FP32
// lanes, each adding the two products of one BF16 pair per instruction),
//   out[t, r] (= or +=) Σ_k x[t, k] · w[r, k]      BF16 x and w, FP32 then double accumulation,
// for Bf16Dot::dpbf16: the o-proj's wo_a, the compressors' wkv / wgate, the q/kv projections.
//
// Summation order, one for both kernels below and for any token count (a request's bits do not
// depend on its batch). For each output (t, r) and each block of kDpbf16BlockK = 64 consecutive k
// (the last one shorter when d % 64 != 0), one FP32 lane takes the block's pairs (k = 2p, 2p + 1)
// in ascending p, one vdpbf16ps per pair, from +0 (a product of two BF16 values is exact in FP32;
// the instruction adds the pair's two products to the lane, rounding to nearest even); the block's
// partial is then added to the output's double sum, block after block from +0, and the double is
// rounded once to FP32 (kAccumulate: float(double(out) + sum)). So 64 products per FP32 partial,
// as in the order this replaced (16 lanes × 64 products per 1024 k). It is not the avx2 tier's
// order: this tier is tested against golden and for rounding accuracy, not for bit-identity with
// avx2. Unlike the FMA tiers vdpbf16ps treats subnormal inputs and results as zero (DAZ / FTZ, a
// documented difference of this tier: docs/security.md); NaN and ±Inf propagate as in IEEE
// arithmetic. Reached only after the runtime ISA check.
//
// Two arrangements compute that order, with the lanes on different axes; the operands of each
// vdpbf16ps (x's pair and w's pair) and every addition are the same, so are the bits
// (CompressorTiers.Avx512Bf16RowsBlockedBitIdentical):
// - lane per weight row (bf16_rows_dot on x's rows, below kBf16BlockedMinTokens tokens; and
//   bf16_rows_dot_blocked's last group when it has fewer than 32 tokens, on the panel): the 16
//   rows' 64-k segments are transposed in registers (two 16 × 16 dword transposes) into a vector
//   per pair, held in L1 (2 KB), and each token's pair is broadcast against it (vdpbf16ps's
//   broadcast memory operand), 8 tokens per pass on rows (their rows, 8 KB apart at d = 4096,
//   share an L1 set) or 16 on the panel (a pair of 16 tokens is one line). The weights are read
//   as whole 64-byte lines, once per 64 tokens.
// - lane per token (bf16_rows_dot_blocked, from kBf16BlockedMinTokens tokens, on a token panel
//   packed once per call): the panel holds each 16-token tile's pairs side by side (a vector per
//   pair), and each weight row's pair is broadcast against it: register tiles of 6 rows × 64
//   tokens (24 accumulators; per pair 4 panel loads from L1, 6 broadcasts of 4 bytes, 24
//   vdpbf16ps). The previous kernel's dot-product tiles (a vector of 32 k of one row against 32 k
//   of one token) took 4 token loads from L2 and 6 row loads per 24 vdpbf16ps; here the weights
//   take no vector load, and a 64-k slab of the panel (8 KB) serves 48 rows from L1.
// Zen 5 (AVX-512 F/BW/VL/VNNI/BF16), one thread, the CSA compressor's shape (2 × 1024 rows ×
// 4096, the weights rotated over 12 copies on huge pages), minimum of 21 rounds interleaved with
// the previous kernels (24-row calls; these: 48-row calls, kDpbf16TaskRows) in one process: T = 8
// (rows) 1.13 -> 0.92 ms, T = 16 1.29 -> 1.21, T = 24 1.85 -> 1.93, T = 32 2.17 -> 2.01, T = 48
// 3.00 -> 2.75, T = 80 4.85 -> 4.49, T = 128 8.11 -> 7.43 ms (in a quieter minute 7.4-7.9 ->
// 6.4-7.0), T = 512 29.1-29.3 -> 25.0-25.3 ms (293 -> 342 GFLOP/s).

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

inline constexpr index_t kDpbf16BlockK = 64;  // k per FP32 partial (32 pairs, 64 products)

// Rows per task for the callers that split their weights into row tasks (the compressors): a
// multiple of bf16_rows_dot's 16 lanes and of the blocked kernel's 6-row tiles. The split does
// not change a bit (each output's sum is its own).
inline constexpr index_t kDpbf16TaskRows = 48;

namespace bf16_rows_detail {

// The pair (p[0], p[1]) in every lane.
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512bh pair_bcast(const bf16* p) {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// The 32 BF16 elements at p, or the first n of them and zeros (n < 32: a masked load, which on
// Zen 4 costs several times a plain one, so whole pieces take the plain load).
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512i load_pairs16(const bf16* p,
                                                                                    index_t n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(__mmask32((1u << n) - 1u), p);
}

// v[j][i] = v[i][j] for a 16 × 16 matrix of dwords (v[i]: row i), in registers: 64 shuffles.
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i], t[i+1]: rows i, i+1 interleaved by dword
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // v[i + c]: rows i..i+3 of column c of each 128-bit lane
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 8; ++i) {  // rows 0-7 / 8-15 of columns 4L + c, two lanes of each
    const int a = (i / 4) * 8 + i % 4, b = a + 4;
    t[2 * i] = _mm512_shuffle_i32x4(v[a], v[b], 0x88);
    t[2 * i + 1] = _mm512_shuffle_i32x4(v[a], v[b], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {  // the two halves of every column joined
    v[i] = _mm512_shuffle_i32x4(t[2 * i], t[8 + 2 * i], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[2 * i], t[8 + 2 * i], 0xdd);
    v[i + 4] = _mm512_shuffle_i32x4(t[2 * i + 1], t[9 + 2 * i], 0x88);
    v[i + 12] = _mm512_shuffle_i32x4(t[2 * i + 1], t[9 + 2 * i], 0xdd);
  }
}

inline constexpr int kRowLanes = 16;        // weight rows per vector
inline constexpr int kRowChunkTokens = 64;  // tokens whose double sums are held at once

// wt[p][l] = the pair (w[l·ld_w + 2p], w[l·ld_w + 2p + 1]) for l < nr and 2p < kk (kk <= 64,
// even); lanes l >= nr are +0.
TILEDECODE_TARGET_AVX512 inline void transpose_block(std::uint32_t (*wt)[kRowLanes], const bf16* w,
                                                     index_t ld_w, int nr, index_t kk) {
  for (index_t h = 0; h < kk; h += 32) {
    const index_t n = std::min<index_t>(32, kk - h);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = i < nr ? load_pairs16(w + i * ld_w + h, n) : _mm512_setzero_si512();
    transpose16(v);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      if (2 * j < n) _mm512_store_si512(wt[h / 2 + j], v[j]);
  }
}

// A 4-byte BF16 pair as the asm's memory operand (any alignment of 2, aliasing bf16 storage).
typedef std::int32_t __attribute__((may_alias, aligned(2))) bf16_pair_bits;

// c + the products of w's pairs (a vector) and the pair at p (in every lane): vdpbf16ps with the
// pair as its broadcast memory operand (GCC 12 otherwise loads each broadcast into a register
// first: one more instruction per vdpbf16ps where every broadcast is used once). Every vdpbf16ps
// here takes w's pairs as its first source and x's as its second, on both arrangements: the
// products are exact and commute, but with a NaN on both sides the instruction returns the
// first source's (its payload and sign), so one operand order keeps the bits one for NaN too.
TILEDECODE_TARGET_AVX512 __attribute__((always_inline)) inline __m512 dp_bcast(__m512 c, __m512bh w,
                                                                               const bf16* p) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
          : "+v"(c)
          : "v"(w), "m"(*reinterpret_cast<const bf16_pair_bits*>(p)));
  return c;
#else
  return _mm512_dpbf16_ps(c, w, pair_bcast(p));
#endif
}

// One pass of NT tokens over np pairs of the transposed block: FP32 partials from +0, then added
// to the double sums s[t][0..16) (add_to_f64: the second level of the order at the top). x: the
// pass's first token at the block's first k, in rows (kPanel = false: token t's pair p at x +
// t·ld_x + 2p) or in its token panel tile (kPanel: at x + 2t + 32p).
template <int NT, bool kPanel>
TILEDECODE_TARGET_AVX512 inline void row_pass(double (*s)[kRowLanes],
                                              const std::uint32_t (*wt)[kRowLanes], const bf16* x,
                                              index_t ld_x, index_t np) {
  __m512 c[NT];
  for (int t = 0; t < NT; ++t) c[t] = _mm512_setzero_ps();
  for (index_t p = 0; p < np; ++p) {
    const __m512bh wv = (__m512bh)_mm512_load_si512(wt[p]);
    for (int t = 0; t < NT; ++t)
      c[t] = dp_bcast(c[t], wv, kPanel ? x + 2 * t + 32 * p : x + t * ld_x + 2 * p);
  }
  for (int t = 0; t < NT; ++t) add_to_f64(s[t], c[t]);
}

// The lane-per-row pass over n_tok tokens (rows of x, or kPanel: x = the first token's panel tile,
// n_tok from a tile boundary, ld_x = the tile stride), in the order at the top of the file. Token
// passes of 16 on the panel (its 16 tokens' pairs are one line), of 8 on rows (their rows, 8 KB
// apart at d = 4096, share an L1 set: 16 of them thrash it).
template <bool kAccumulate, bool kPanel>
TILEDECODE_TARGET_AVX512 inline void row_lanes(float* out, index_t ld_out, const bf16* x,
                                               index_t ld_x, index_t n_tok, const bf16* w,
                                               index_t ld_w, index_t n_rows, index_t d) {
  constexpr int L = kRowLanes, P = kPanel ? 16 : 8, C = kRowChunkTokens;
  alignas(64) std::uint32_t wt[kDpbf16BlockK / 2][L];
  alignas(64) double s[C][L];
  // Token t0's operand at the block's first k (on the panel a pass starts at a tile's first token
  // or 8 tokens into it).
  const auto at = [&](index_t t0, index_t k0) {
    return kPanel ? x + (t0 / 16) * ld_x + 16 * k0 + 2 * (t0 % 16) : x + t0 * ld_x + k0;
  };
  for (index_t c0 = 0; c0 < n_tok; c0 += C) {
    const int nc = int(std::min<index_t>(C, n_tok - c0));
    for (index_t r0 = 0; r0 < n_rows; r0 += L) {
      const int nr = int(std::min<index_t>(L, n_rows - r0));
      std::fill_n(&s[0][0], nc * L, 0.0);  // the double sums start at +0
      for (index_t k0 = 0; k0 < d; k0 += kDpbf16BlockK) {
        const index_t kk = std::min<index_t>(kDpbf16BlockK, d - k0);
        transpose_block(wt, w + r0 * ld_w + k0, ld_w, nr, kk);
        int t0 = 0;
        for (; t0 + P <= nc; t0 += P)
          row_pass<P, kPanel>(s + t0, wt, at(c0 + t0, k0), ld_x, kk / 2);
        if (nc - t0 > 8) {  // panel passes: 8 of a tile's last 9-15 tokens, then the rest
          row_pass<8, kPanel>(s + t0, wt, at(c0 + t0, k0), ld_x, kk / 2);
          t0 += 8;
        }
        if (t0 < nc)
          with_static_count<8>(nc - t0, [&]<int NT>() TILEDECODE_TARGET_AVX512 {
            row_pass<NT, kPanel>(s + t0, wt, at(c0 + t0, k0), ld_x, kk / 2);
          });
      }
      for (int t = 0; t < nc; ++t)
        for (int l = 0; l < nr; ++l) {
          float& o = out[(c0 + t) * ld_out + r0 + l];
          o = kAccumulate ? float(double(o) + s[t][l]) : float(s[t][l]);
        }
    }
  }
}

}  // namespace bf16_rows_detail

// out[t*ld_out + r] = float(Σ_{k<d} x[t*ld_x + k] * w[r*ld_w + k]) (with kAccumulate:
// float(double(out) + Σ)) for t < n_tok, r < n_rows, d even, in the order at the top (a lane per
// weight row). n_rows_pf: avx2::bf16_rows_dot's parameter, unused here: the weight rows are read
// as whole lines, 16 streams the hardware prefetcher follows.
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot(float* out, index_t ld_out, const bf16* x,
                                                   index_t ld_x, index_t n_tok, const bf16* w,
                                                   index_t ld_w, index_t n_rows, index_t d,
                                                   index_t /*n_rows_pf*/) {
  bf16_rows_detail::row_lanes<kAccumulate, false>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d);
}

// ---------------------------------------------------------------------------------------------
// The token panel of bf16_rows_dot_blocked: tiles of 16 tokens, each d / 2 pairs of 16 dwords
// (pair p of token t: x[t][2p], x[t][2p + 1]), 16 · d BF16 elements (d even); a token past n_tok
// is +0 in every pair.
inline constexpr index_t bf16_panel_tiles(index_t n_tok) {
  return (n_tok + 15) / 16;
}
inline constexpr index_t bf16_panel_tile_elems(index_t d) {
  return 16 * d;
}
inline constexpr index_t bf16_panel_elems(index_t n_tok, index_t d) {
  return bf16_panel_tiles(n_tok) * bf16_panel_tile_elems(d);
}
// The offset of element k0 (even) in a tile: a reduction over x's [k0, k0 + d) reads the panel
// from here.
inline constexpr index_t bf16_panel_offset(index_t k0) {
  return 16 * k0;
}

// Tile p of the panel (tokens 16p .. 16p + 15): xp[p · tile + 32 · (k / 2) + 2 · (t % 16) + k % 2]
// = x[t · ld_x + k] for k < d, t < n_tok, and +0 for the tokens past n_tok. The 16 tokens' 16-pair
// pieces are transposed in registers (64 shuffles per KB). Callers run the tiles as parallel tasks.
TILEDECODE_TARGET_AVX512 inline void pack_bf16_panel_tile(bf16* xp, const bf16* x, index_t ld_x,
                                                          index_t n_tok, index_t d, index_t p) {
  using bf16_rows_detail::load_pairs16;
  bf16* tile = xp + p * bf16_panel_tile_elems(d);
  const int nt = int(std::min<index_t>(16, n_tok - 16 * p));
  const bf16* x0 = x + 16 * p * ld_x;
  for (index_t h = 0; h < d; h += 32) {
    const index_t n = std::min<index_t>(32, d - h);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = i < nt ? load_pairs16(x0 + i * ld_x + h, n) : _mm512_setzero_si512();
    bf16_rows_detail::transpose16(v);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      if (2 * j < n) _mm512_storeu_si512(tile + 16 * (h + 2 * j), v[j]);
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
  be.tasks(bf16_panel_tiles(n_tok),
           [&](std::int64_t p) { pack_bf16_panel_tile(xp, x, ld_x, n_tok, d, index_t(p)); });
}

namespace bf16_rows_blocked_detail {

inline constexpr int kTileAccumulators = 24;  // per register tile: rows × panel tiles
inline constexpr int kTileVecs = 4;           // panel tiles (16 tokens) per register tile, at most
inline constexpr int kPanelRows = 48;         // rows whose double sums are held at once (24 KB)
inline constexpr int kFoldBlocks = 4;         // k-blocks per fold of the FP32 partials into them
inline constexpr int kTokenLaneMinTokens = 32;  // smaller (last) token groups run lane per row

// One k-block (np pairs) of the NR-row × NZ-panel-tile register tile: FP32 partials from +0 into
// part[r][z][0..16). xq: the block's first pair in the first panel tile, ld_tile elements from
// one panel tile to the next; w: the block's first k in the first row.
template <int NR, int NZ>
TILEDECODE_TARGET_AVX512 inline void tile_block(float* part, const bf16* xq, index_t ld_tile,
                                                const bf16* w, index_t ld_w, index_t np) {
  using bf16_rows_detail::pair_bcast;
  __m512 c[NR][NZ];
  for (int r = 0; r < NR; ++r)
    for (int z = 0; z < NZ; ++z) c[r][z] = _mm512_setzero_ps();
  for (index_t p = 0; p < np; ++p) {
    __m512bh xv[NZ];
    for (int z = 0; z < NZ; ++z) xv[z] = (__m512bh)_mm512_loadu_si512(xq + z * ld_tile + 32 * p);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wb = pair_bcast(w + r * ld_w + 2 * p);
      for (int z = 0; z < NZ; ++z) c[r][z] = _mm512_dpbf16_ps(c[r][z], wb, xv[z]);  // w, x
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int z = 0; z < NZ; ++z) _mm512_store_ps(part + (r * NZ + z) * 16, c[r][z]);
}

// s[r·ld_s + 16z ..] = ((s + P_0) + P_1) + ... over the ng blocks' partials (block b's at
// part + b · ld_part, laid out as tile_block's), in block order.
template <int NR, int NZ>
TILEDECODE_TARGET_AVX512 inline void fold(double* s, index_t ld_s, const float* part,
                                          index_t ld_part, int ng) {
  for (int r = 0; r < NR; ++r)
    for (int z = 0; z < NZ; ++z) {
      double* d = s + r * ld_s + 16 * z;
      __m512d lo = _mm512_load_pd(d), hi = _mm512_load_pd(d + 8);
      for (int b = 0; b < ng; ++b)
        add_to_f64(lo, hi, _mm512_load_ps(part + b * ld_part + (r * NZ + z) * 16));
      _mm512_store_pd(d, lo);
      _mm512_store_pd(d + 8, hi);
    }
}

}  // namespace bf16_rows_blocked_detail

// bf16_rows_dot<kAccumulate>(out, ld_out, x, ld_x, n_tok, w, ld_w, n_rows, d, ·)'s results, bit for
// bit, with x given as its panel (pack_bf16_panel, or pack_bf16_panel_tile for every tile of the
// n_tok tokens): xp points at element k0 of the first tile (xp = panel + bf16_panel_offset(k0) for
// a reduction over x's [k0, k0 + d)), ld_tile = bf16_panel_tile_elems of the packed width. Rows
// [n_rows, n_rows_pf) of w exist and may be prefetched (the caller's next rows).
// Loop nest: per group of 64 tokens (4 panel tiles), per panel of 48 rows (their double sums,
// 48 × 64 × 8 B, stay in L1), per fold group of 4 k-blocks (the panel's 4 × 8 KB slab, read once
// from L2 and then from L1 by the register tiles), per register tile (6, 8 or 12 rows for 4, 3 or
// 2 panel vectors: 24 accumulators): its 4 k-blocks, each
// from +0 into FP32 partials (stored, 6 KB), then folded into the double sums in block order. A
// fold per k-block instead of per 4 ran 7-14 % slower (Zen 5, T = 128 / 512). The outputs are
// written token by token (a row-major scatter over 64 tokens touched a page per store: 25 % of
// the time at d = 4096, ld_out = 2048).
template <bool kAccumulate>
TILEDECODE_TARGET_AVX512 inline void bf16_rows_dot_blocked(float* out, index_t ld_out,
                                                           const bf16* xp, index_t ld_tile,
                                                           index_t n_tok, const bf16* w,
                                                           index_t ld_w, index_t n_rows, index_t d,
                                                           index_t n_rows_pf) {
  using namespace bf16_rows_blocked_detail;
  constexpr int Z = kTileVecs, TG = 16 * Z, RP = kPanelRows, G = kFoldBlocks;
  constexpr index_t kPart = kTileAccumulators * 16;  // floats per block's partials
  alignas(64) double s[RP][TG];
  alignas(64) float part[G * kPart];
  const index_t n_blocks = (d + kDpbf16BlockK - 1) / kDpbf16BlockK;
  // A last group of fewer than kTokenLaneMinTokens tokens (all of them when n_tok is below it)
  // runs lane per row on its panel tiles after the others (the same bits): a register tile of one
  // 16-token vector would need 12-24 rows for its accumulators, whose broadcasts (rows 8 KB apart
  // share one L1 set) then carry the tile. So every group here has at least 2 panel vectors.
  const index_t tail = n_tok % TG < kTokenLaneMinTokens ? n_tok % TG : 0, n_main = n_tok - tail;
  for (index_t t0 = 0; t0 < n_main; t0 += TG) {
    const int nt = int(std::min<index_t>(TG, n_main - t0));
    const int nz = (nt + 15) / 16;
    const bf16* xg = xp + (t0 / 16) * ld_tile;
    for (index_t rp = 0; rp < n_rows; rp += RP) {
      const int nrp = int(std::min<index_t>(RP, n_rows - rp));
      std::fill_n(&s[0][0], nrp * TG, 0.0);  // the double sums start at +0
      // In the first token group the rows come from memory: the next panel's (up to n_rows_pf)
      // are prefetched into L2 meanwhile, a quota of lines per register tile's k-block.
      const index_t n_next = t0 == 0 ? std::clamp<index_t>(n_rows_pf - (rp + RP), 0, RP) : 0;
      const index_t lines = n_next * ((d + 31) / 32);
      with_static_count<Z>(nz, [&]<int NZ>() TILEDECODE_TARGET_AVX512 {
        constexpr int RT = kTileAccumulators / NZ;  // rows per register tile (NZ >= 2)
        const index_t calls = n_blocks * ((nrp + RT - 1) / RT);
        const index_t quota = calls > 0 ? (lines + calls - 1) / calls : 0;
        index_t done = 0, pf_r = 0, pf_k = 0;
        for (index_t b0 = 0; b0 < n_blocks; b0 += G) {
          const int ng = int(std::min<index_t>(G, n_blocks - b0));
          for (int r0 = 0; r0 < nrp; r0 += RT) {
            const bf16* wr = w + (rp + r0) * ld_w;
            with_static_count<RT>(std::min(RT, nrp - r0), [&]<int NR>() TILEDECODE_TARGET_AVX512 {
              for (int b = 0; b < ng; ++b) {
                for (const index_t end = std::min(lines, done + quota); done < end; ++done) {
                  _mm_prefetch(reinterpret_cast<const char*>(w + (rp + RP + pf_r) * ld_w + pf_k),
                               _MM_HINT_T1);
                  if (++pf_r == n_next) {
                    pf_r = 0;
                    pf_k += 32;
                  }
                }
                const index_t k0 = (b0 + b) * kDpbf16BlockK;
                const index_t np = (std::min(d, k0 + kDpbf16BlockK) - k0) / 2;
                tile_block<NR, NZ>(part + b * kPart, xg + bf16_panel_offset(k0), ld_tile, wr + k0,
                                   ld_w, np);
              }
              fold<NR, NZ>(&s[r0][0], TG, part, kPart, ng);
            });
          }
        }
      });
      for (int t = 0; t < nt; ++t)
        for (int r = 0; r < nrp; ++r) {
          float& o = out[(t0 + t) * ld_out + rp + r];
          o = kAccumulate ? float(double(o) + s[r][t]) : float(s[r][t]);
        }
    }
  }
  if (tail > 0)
    bf16_rows_detail::row_lanes<kAccumulate, true>(out + n_main * ld_out, ld_out,
                                                   xp + (n_main / 16) * ld_tile, ld_tile, tail, w,
                                                   ld_w, n_rows, d);
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
