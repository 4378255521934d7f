#pragma once
// Q8 of one row (spec §2) on the context's ISA: the AVX2 quantiser where the tier has AVX2 and
// the length is a multiple of 32, core quantize_q8 otherwise. Both give the same bits (tested),
// so the choice never changes results; one place decides it for every caller.

#include <cstddef>
#include <cstdint>
#include <span>

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/simd/avx2.hpp"
#include "tiledecode/core/quant.hpp"

namespace tiledecode::cpu {

// q[0, n) ← Q8(x[0, n)); returns the dequant scale (see core/quant.hpp).
inline float quantize_q8_row(Isa isa, std::int8_t* q, const float* x, std::int64_t n) {
#if TILEDECODE_X86
  if (has_avx2(isa) && n % 32 == 0) return avx2::quantize_q8_avx2(q, x, n);
#else
  (void)isa;
#endif
  return quantize_q8(std::span<std::int8_t>(q, std::size_t(n)),
                     std::span<const float>(x, std::size_t(n)));
}

}  // namespace tiledecode::cpu
