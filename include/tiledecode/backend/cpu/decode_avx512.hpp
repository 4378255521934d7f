#pragma once
// The q/kv projection's INT8 matmul (qr @ wq_b) on the AVX-512 tier (Isa::avx512): the 512-bit
// vpdpbusd on the load-time packed wq_b (kernels::pack_qkv_wq_b, the layout of
// avx2_vnni::matmul_i8_packed). Exact INT32 like the avx2 and avx2_vnni matmuls, so the
// projection's outputs are bit-identical to those tiers'. Reached only through
// backend/cpu/qkv_projection.hpp after the runtime ISA check.

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

inline constexpr int kPackedTileTokens = 4;  // tokens per register tile
inline constexpr int kPackedTileRegs = 4;    // 16-column registers per tile (8 packed vectors)

// One register tile: TT tokens × NC registers of 16 columns over the whole K (KQ quads). Register
// c joins the packed 8-column vectors 2c and 2c + 1 (lanes 0-7 and 8-15: 16 consecutive columns),
// so the accumulators hold the natural column order. Accumulators stay in registers from the
// start value -128·a_sum[t] to the store (TT·NC + NC + 1 <= 21 of 32 zmm). Each quad also
// prefetches pf + q·pf_step .. + pf_step (its share of the next slab).
template <int TT, int NC>
TILEDECODE_TARGET_AVX512 inline void packed_tile(std::int32_t* acc, std::int64_t acc_ld,
                                                 const std::int8_t* a, std::int64_t a_ld,
                                                 const std::int32_t* a_sum, const std::uint8_t* wp,
                                                 std::int64_t KQ, std::uintptr_t pf,
                                                 std::int64_t pf_step) {
  __m512i s[TT][NC];
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < NC; ++c) s[t][c] = _mm512_set1_epi32(-128 * a_sum[t]);
  const std::int64_t vstride = KQ * 32;
  for (std::int64_t q = 0; q < KQ; ++q) {
    const std::uintptr_t p = pf + std::uintptr_t(q * pf_step);
    for (std::int64_t off = 0; off < pf_step; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + std::uintptr_t(off)), _MM_HINT_T0);
    __m512i w[NC];
    for (int c = 0; c < NC; ++c) {
      const std::uint8_t* v = wp + 2 * c * vstride + q * 32;
      w[c] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + vstride)), 1);
    }
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

// avx2_vnni::matmul_i8_packed's contract and layout with 16-column registers: acc[t, j] =
// Σ_k a[t, k] * w[k, j] exactly in INT32 for t < T, j < width (a multiple of 16), K a multiple
// of 4, K <= 65536 (the caller checks; the bound of avx2_vnni::matmul_i8_packed). Per slab of
// 64 columns (16 KB at K = 1024) the token tiles run one after the other and the later ones find
// the slab in L1; each tile prefetches its share of the next slab, as in the avx2_vnni kernel.
TILEDECODE_TARGET_AVX512 inline void matmul_i8_packed(std::int32_t* acc, std::int64_t acc_ld,
                                                      const std::int8_t* a, std::int64_t a_ld,
                                                      const std::int32_t* a_sum, int T,
                                                      const std::uint8_t* wp, std::int64_t K,
                                                      std::int64_t width) {
  if (T <= 0) return;
  const std::int64_t KQ = K / 4, nr = width / 16;
  const int tiles = (T + kPackedTileTokens - 1) / kPackedTileTokens;
  for (std::int64_t r0 = 0; r0 < nr; r0 += kPackedTileRegs) {
    const int nc = int(std::min<std::int64_t>(kPackedTileRegs, nr - r0));
    const std::uint8_t* w = wp + 2 * r0 * KQ * 32;
    // The next slab, spread over this slab's token tiles (integer addresses: past the last head
    // it runs beyond the buffer, and a prefetch never faults).
    const std::int64_t next = 2 * kPackedTileRegs * KQ * 32, share = next / tiles;
    for (int t0 = 0, i = 0; t0 < T; t0 += kPackedTileTokens, ++i) {
      const int tt = std::min(kPackedTileTokens, T - t0);
      const std::uintptr_t pf = std::uintptr_t(w) + std::uintptr_t(2 * nc * KQ * 32 + i * share);
      with_static_count<kPackedTileTokens>(tt, [&]<int TT>() TILEDECODE_TARGET_AVX512 {
        with_static_count<kPackedTileRegs>(nc, [&]<int NC>() TILEDECODE_TARGET_AVX512 {
          packed_tile<TT, NC>(acc + t0 * acc_ld + r0 * 16, acc_ld, a + t0 * a_ld, a_ld, a_sum + t0,
                              w, KQ, pf, share / KQ);
        });
      });
    }
  }
}

}  // namespace tiledecode::cpu::avx512
TILEDECODE_AVX512_END
#endif
