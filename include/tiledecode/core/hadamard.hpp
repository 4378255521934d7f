#pragma once
// Sylvester Hadamard matrix (spec §6.4, §7.1): H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]];
// entry (i, j) = (-1)^popcount(i & j). The rotation used by the indexer is H_n / sqrt(n),
// stored as BF16 (1/sqrt(128) rounds to BF16 like the reference fixture).

#include <bit>
#include <cmath>
#include <cstdint>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

// Fills dst (n, n) with the Sylvester Hadamard matrix scaled by `scale` (n a power of two).
template <class T>
void build_hadamard(View<T, 2> dst, float scale) {
  const index_t n = dst.extent(0);
  if (n < 1 || !std::has_single_bit(static_cast<std::uint64_t>(n))) {
    throw_arg("build_hadamard", "dst.extent(0)", n, "a power of two >= 1");
  }
  check_equal("build_hadamard", "dst.extent(1)", dst.extent(1), n);
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < n; ++j) {
      const float v = (std::popcount(static_cast<std::uint64_t>(i & j)) & 1) ? -scale : scale;
      dst(i, j) = T(v);
    }
}

// The indexer rotation: BF16 Sylvester Hadamard(n) / sqrt(n).
inline Tensor<bf16, 2> make_hadamard_bf16(index_t n) {
  Tensor<bf16, 2> h({n, n});
  build_hadamard<bf16>(h.view(), 1.0f / std::sqrt(float(n)));
  return h;
}

}  // namespace tiledecode
