#pragma once
// KV-cache write (kernels/cache_write.hpp) on the a2a3 model: one vector block copies the T new
// rows into UB and writes each mapped row to its slot with one DMA (skipped rows issue nothing).

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/kernels/cache_write.hpp"

namespace tiledecode::a2a3 {
struct backend_ops_cache_write {
  template <class E>
  static void scatter_rows(const A2a3& be, const kernels::CacheWriteArgs<E>& a) {
    const index_t T = a.tokens(), W = a.rows.extent(1);
    be.m->launch_vector("kv_cache_write", 1, [&](VectorBlock& blk) {
      VectorCore& v = blk.vec;
      auto r = v.alloc<E>(Space::ub, "rows", T, W);
      v.copy_in(r, 0, a.rows, "rows_in");
      for (index_t t = 0; t < T; ++t) {
        const index_t s = a.slots(t);
        if (s >= 0) v.copy_out(a.pool.slice(0, s, s + 1), r, t, "row_out");
      }
    });
  }
};
}  // namespace tiledecode::a2a3

namespace tiledecode {
template <>
struct backend_ops<kernels::CacheWrite, a2a3::A2a3> : a2a3::backend_ops_cache_write {};
}  // namespace tiledecode
