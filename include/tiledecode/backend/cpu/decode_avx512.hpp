#pragma once
// The q/kv projection's matmuls on the AVX-512 tier (Isa::avx512), reached only through
// backend/cpu/qkv_projection.hpp after the runtime ISA check:
//   * x_n @ wq_a and x_n @ wkv (matmul_bf16_tiled): token-blocked 512-bit FP32 FMA in exactly the
//     order of avx2::matmul_bf16_axpy (per output: FP32 FMAs in ascending k over groups of
//     kBf16GroupRows rows from +0, the group partials added to a double from +0 in ascending
//     group order, one rounding to FP32), so the projection's outputs are bit-identical to the
//     avx2 and scalar tiers' for every T. Only the loop nest differs: the weights are read once
//     per block of up to kTiledBlockTokens tokens instead of once per 8, so at large batch the
//     kernel runs from L1 at the FMA rate instead of re-streaming the weights.
//   * qr @ wq_b (matmul_i8_packed): the 512-bit vpdpbusd on the load-time packed wq_b in its
//     16-column layout (kernels::pack_qkv_wq_b with vector_cols = 16: one 64-byte operand per
//     quad and register, no shuffles). Exact INT32 like the avx2 and avx2_vnni matmuls.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tiledecode/backend/cpu/decode_avx2.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx512.hpp"
#include "tiledecode/backend/cpu/static_count.hpp"

#if TILEDECODE_X86
TILEDECODE_AVX512_BEGIN
namespace tiledecode::cpu::avx512 {

// ---------------------------------------------------------------------------------------------
// matmul_bf16_tiled. Loop nest, per 64-column slab (4 registers of 16 columns):
//   token blocks of up to kTiledBlockTokens rows (their double accumulators: 128 × 64 × 8 B =
//   64 KB of stack; with the panel 80 KB per call) → groups of kBf16GroupRows weight rows: the
//   group's (64 rows × 64 columns) BF16 weights widened once into an FP32 panel (16 KB, L1), then
//   every register tile of kTiledTileTokens tokens × 4 registers runs the group's FMAs from the
//   panel (24 FP32 accumulators + 4 weight registers; x_n broadcast from its FP32 copy) and adds
//   its partials to the double accumulators. Each weight element is read from memory once per token
//   block and widened once per block; the FMA work is that of the axpy order, in the same order.
inline constexpr int kTiledCols = 64;            // columns per slab
inline constexpr int kTiledTileTokens = 6;       // tokens per register tile
inline constexpr int kTiledBlockTokens = 128;    // tokens per double-accumulator block
inline constexpr std::int64_t kTiledAhead = 64;  // rows of software prefetch (one group)

// panel[r * 64 + n] = float(w[(k0 + r) * w_ld + c0 + n]) for r < rows, n < 64 (exact widening);
// prefetches the rows kTiledAhead ahead, i.e. the next group's panel, which then arrives while
// this group's tiles run (the slab's rows are w_ld apart: short runs the hardware prefetchers
// follow poorly).
TILEDECODE_TARGET_AVX512 inline void widen_panel(float* panel, const bf16* w, std::int64_t w_ld,
                                                 std::int64_t c0, std::int64_t k0, int rows,
                                                 std::int64_t K) {
  for (int r = 0; r < rows; ++r) {
    const bf16* row = w + (k0 + r) * w_ld + c0;
    if (k0 + r + kTiledAhead < K) {
      const char* pf = reinterpret_cast<const char*>(row + kTiledAhead * w_ld);
      _mm_prefetch(pf, _MM_HINT_T0);
      _mm_prefetch(pf + 64, _MM_HINT_T0);
    }
    for (int c = 0; c < kTiledCols; c += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      _mm512_store_ps(panel + r * kTiledCols + c,
                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  }
}

// One register tile over one group: TT tokens × 64 columns, FP32 FMAs in ascending k from +0,
// then dacc[t * 64 + n] += double(partial) (the group order of matmul_bf16_axpy).
template <int TT>
TILEDECODE_TARGET_AVX512 inline void tiled_group(double* dacc, const float* x, std::int64_t x_ld,
                                                 const float* panel, int rows) {
  __m512 s[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < 4; ++c) s[t][c] = _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 w[4];
    for (int c = 0; c < 4; ++c) w[c] = _mm512_load_ps(panel + r * kTiledCols + 16 * c);
    for (int t = 0; t < TT; ++t) {
      const __m512 b = _mm512_set1_ps(x[t * x_ld + r]);
      for (int c = 0; c < 4; ++c) s[t][c] = _mm512_fmadd_ps(b, w[c], s[t][c]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < 4; ++c) add_to_f64(dacc + t * kTiledCols + 16 * c, s[t][c]);
}

// avx2::matmul_bf16_axpy's contract and bits for any T: dst[t, n] = float(Σ_k x[t, k] w[k, n])
// for t < T and n in [n0, n1), n1 - n0 a multiple of 64; x is x_n widened to FP32 (x_ld floats
// per row), w BF16 (w_ld per row), dst FP32 (dst_ld per row, overwritten).
TILEDECODE_TARGET_AVX512 inline void matmul_bf16_tiled(float* dst, std::int64_t dst_ld,
                                                       const float* x, std::int64_t x_ld,
                                                       std::int64_t T, const bf16* w,
                                                       std::int64_t w_ld, std::int64_t K,
                                                       std::int64_t n0, std::int64_t n1) {
  constexpr int kG = avx2::kBf16GroupRows;
  alignas(64) float panel[kG * kTiledCols];
  alignas(64) double dacc[kTiledBlockTokens * kTiledCols];
  for (std::int64_t c0 = n0; c0 < n1; c0 += kTiledCols)
    for (std::int64_t b0 = 0; b0 < T; b0 += kTiledBlockTokens) {
      const int nb = int(std::min<std::int64_t>(kTiledBlockTokens, T - b0));
      for (int i = 0; i < nb * kTiledCols; i += 8) _mm512_store_pd(dacc + i, _mm512_setzero_pd());
      for (std::int64_t k0 = 0; k0 < K; k0 += kG) {
        const int rows = int(std::min<std::int64_t>(kG, K - k0));
        widen_panel(panel, w, w_ld, c0, k0, rows, K);
        for (int t0 = 0; t0 < nb; t0 += kTiledTileTokens) {
          const int tt = std::min(kTiledTileTokens, nb - t0);
          with_static_count<kTiledTileTokens>(tt, [&]<int TT>() TILEDECODE_TARGET_AVX512 {
            tiled_group<TT>(dacc + t0 * kTiledCols, x + (b0 + t0) * x_ld + k0, x_ld, panel, rows);
          });
        }
      }
      for (int t = 0; t < nb; ++t)
        for (int n = 0; n < kTiledCols; n += 8)
          _mm256_storeu_ps(dst + (b0 + t) * dst_ld + c0 + n,
                           _mm512_cvtpd_ps(_mm512_load_pd(dacc + t * kTiledCols + n)));
    }
}

// ---------------------------------------------------------------------------------------------
inline constexpr int kPackedTileTokens = 6;  // tokens per register tile
inline constexpr int kPackedTileRegs = 4;    // 16-column registers (packed vectors) per tile
inline constexpr std::int64_t kPackedChunkQuads = 64;  // k quads per L1 chunk (16 KB per slab)

// One register tile: TT tokens × NC packed 16-column vectors over quads [q0, q1): per quad one
// 64-byte load per vector, one broadcast per token, TT·NC vpdpbusd (TT·NC + NC + 1 <= 29 of
// 32 zmm). The accumulators start from -128·a_sum[t] (first chunk) or from acc, and are stored
// to acc at the end of the chunk. With pf set, quad j of the chunk also prefetches lines
// j·lpq .. j·lpq + lpq - 1 of the next chunk (line m: vector m mod NC, 64 bytes at
// (m div NC)·64; lpq = ceil(lines / quads)).
template <int TT, int NC>
TILEDECODE_TARGET_AVX512 inline void packed_tile(std::int32_t* acc, std::int64_t acc_ld,
                                                 const std::int8_t* a, std::int64_t a_ld,
                                                 const std::int32_t* a_sum, bool first,
                                                 const std::uint8_t* wp, std::int64_t KQ,
                                                 std::int64_t q0, std::int64_t q1,
                                                 std::uintptr_t pf, std::int64_t pf_lines) {
  __m512i s[TT][NC];
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < NC; ++c)
      s[t][c] = first ? _mm512_set1_epi32(-128 * a_sum[t])
                      : _mm512_loadu_si512(acc + t * acc_ld + 16 * c);
  const std::int64_t vstride = KQ * 64;
  const std::int64_t lpq = pf ? (pf_lines + (q1 - q0) - 1) / (q1 - q0) : 0;
  for (std::int64_t q = q0; q < q1; ++q) {
    for (std::int64_t m = (q - q0) * lpq; m < std::min(pf_lines, (q - q0 + 1) * lpq); ++m)
      _mm_prefetch(
          reinterpret_cast<const char*>(pf + std::uintptr_t((m % NC) * vstride + (m / NC) * 64)),
          _MM_HINT_T0);
    __m512i w[NC];
    for (int c = 0; c < NC; ++c) w[c] = _mm512_loadu_si512(wp + c * vstride + q * 64);
    for (int t = 0; t < TT; ++t) {
      std::int32_t av;
      std::memcpy(&av, a + t * a_ld + 4 * q, 4);
      const __m512i b = _mm512_set1_epi32(av);
      for (int c = 0; c < NC; ++c) s[t][c] = dpbusd(s[t][c], w[c], b);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < NC; ++c) _mm512_storeu_si512(acc + t * acc_ld + 16 * c, s[t][c]);
}

// avx2_vnni::matmul_i8_packed's contract on the 16-column packed layout: acc[t, j] =
// Σ_k a[t, k] * w[k, j] exactly in INT32 for t < T, j < width (a multiple of 16), K a multiple
// of 4, K <= 65536 (the caller checks; the bound of avx2_vnni::matmul_i8_packed). Blocked for L1:
// per slab of 64 columns, per chunk of kPackedChunkQuads quads (64 columns × 256 k = 16 KB), every
// token tile runs the chunk (the first from memory, the rest from L1), its accumulators kept in
// acc between chunks; each tile prefetches its share of the next chunk (the next slab's first
// after the last). Any T: the more tokens, the more reuse of each chunk (weights are read from
// memory once per call). Integer sums, so the blocking does not change a bit.
TILEDECODE_TARGET_AVX512 inline void matmul_i8_packed(std::int32_t* acc, std::int64_t acc_ld,
                                                      const std::int8_t* a, std::int64_t a_ld,
                                                      const std::int32_t* a_sum, int T,
                                                      const std::uint8_t* wp, std::int64_t K,
                                                      std::int64_t width) {
  if (T <= 0) return;
  const std::int64_t KQ = K / 4, nr = width / 16;
  for (std::int64_t r0 = 0; r0 < nr; r0 += kPackedTileRegs) {
    const int nc = int(std::min<std::int64_t>(kPackedTileRegs, nr - r0));
    const std::uint8_t* w = wp + r0 * KQ * 64;
    for (std::int64_t q0 = 0; q0 < KQ; q0 += kPackedChunkQuads) {
      const std::int64_t q1 = std::min(KQ, q0 + kPackedChunkQuads);
      // The next chunk: quads [q1, q1 + chunk) of this slab's nc vectors, or the next slab's
      // first chunk (integer addresses: past the last head they run beyond the buffer, and a
      // prefetch never faults), prefetched by the first tile, so that it arrives while the
      // others compute.
      const bool last = q1 >= KQ;
      const std::uintptr_t next = std::uintptr_t(w) + std::uintptr_t(last ? nc * KQ * 64 : q1 * 64);
      const std::int64_t next_quads = std::min(kPackedChunkQuads, last ? KQ : KQ - q1);
      const std::int64_t lines = nc * next_quads;
      for (int t0 = 0; t0 < T; t0 += kPackedTileTokens) {
        const int tt = std::min(kPackedTileTokens, T - t0);
        const std::uintptr_t pf = t0 == 0 ? next : 0;
        with_static_count<kPackedTileTokens>(tt, [&]<int TT>() TILEDECODE_TARGET_AVX512 {
          with_static_count<kPackedTileRegs>(nc, [&]<int NC>() TILEDECODE_TARGET_AVX512 {
            packed_tile<TT, NC>(acc + t0 * acc_ld + r0 * 16, acc_ld, a + t0 * a_ld, a_ld,
                                a_sum + t0, q0 == 0, w, KQ, q0, q1, pf, lines);
          });
        });
      }
    }
  }
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
