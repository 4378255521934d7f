#pragma once
// KV-cache write (kernels/cache_write.hpp) on the CPU: row copies in token order.

#include <cstring>

#include "tiledecode/backend/cpu/backend.hpp"
#include "tiledecode/kernels/cache_write.hpp"

namespace tiledecode::cpu {
template <Isa I>
struct backend_ops_cache_write {
  template <class E>
  static void scatter_rows(const Cpu<I>&, const kernels::CacheWriteArgs<E>& a) {
    const index_t W = a.rows.extent(1);
    for (index_t t = 0; t < a.tokens(); ++t) {
      const index_t s = a.slots(t);
      if (s < 0) continue;
      std::memcpy(static_cast<void*>(&a.pool(s, 0)), static_cast<const void*>(&a.rows(t, 0)),
                  std::size_t(W) * sizeof(E));
    }
  }
};
}  // namespace tiledecode::cpu

namespace tiledecode {
template <cpu::Isa I>
struct backend_ops<kernels::CacheWrite, cpu::Cpu<I>> : cpu::backend_ops_cache_write<I> {};
}  // namespace tiledecode
