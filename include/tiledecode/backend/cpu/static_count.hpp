#pragma once
// Run-time count → compile-time template argument, for register tiles whose shape is a template
// parameter (the partial tiles at the end of a row or a slab).

namespace tiledecode::cpu {

// Calls f.template operator()<N>() with N = n, for 1 <= n <= kMax (n outside: N = kMax for
// n > kMax, N = 1 for n < 1; callers pass a count in range). A plain function: it may call
// kernels compiled for any target (the call is not inlined across targets).
template <int kMax, class F>
inline void with_static_count(int n, F&& f) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_static_count<kMax - 1>(n, static_cast<F&&>(f));
  }
  f.template operator()<kMax>();
}

}  // namespace tiledecode::cpu
