#pragma once
// The decode step's KV-cache write (spec §3.3) — contract and tile program:
//   pool[slot_mapping[t], :] = rows[t, :] for every t with slot_mapping[t] >= 0 (-1 skips);
// tokens in order t = 0..T-1, so if two tokens map to the same slot the later one wins (the
// spec's per-request order). One op (tile: scatter rows through a slot mapping): the CPU copies
// rows, the a2a3 model issues one DMA per written row.

#include <cstdint>
#include <string>
#include <string_view>

#include "tiledecode/core/error.hpp"
#include "tiledecode/core/validate.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::kernels {

struct CacheWrite {
  static constexpr std::string_view kernel_name = "kv_cache_write";
};

template <class E>
struct CacheWriteArgs {
  View<E, 2> pool;                   // (pool rows, W) written
  ConstView<E, 2> rows;              // (T, W)
  ConstView<std::int64_t, 1> slots;  // (T) -1 = skip
  index_t tokens() const { return rows.extent(0); }
};

template <class E>
void validate(const CacheWriteArgs<E>& a) {
  constexpr std::string_view where = "write_cache";
  check_view(where, "pool", a.pool);
  check_view(where, "rows", a.rows);
  check_rows(where, "pool", a.pool, {-1, a.rows.extent(1)});
  check_inner_stride(where, "rows", a.rows);
  check_extents(where, "slot_mapping", a.slots, {a.rows.extent(0)});
  const index_t n = a.pool.extent(0);
  for (index_t t = 0; t < a.slots.extent(0); ++t) {
    const index_t s = a.slots(t);
    if (s < -1 || s >= n)
      throw_arg(where, nth_name("slot_mapping", t), s,
                "[-1, " + std::to_string(n) + ") (-1 = skip; pool rows)");
  }
}

template <class B, class E>
void cache_write_program(const B& be, const CacheWriteArgs<E>& a) {
  ops_for<CacheWrite, B>::scatter_rows(be, a);
}

// pool rows ← rows through slot_mapping (see above), on backend `be`. Validates every slot before
// the first write.
template <class Be, class E>
void write_cache(const Be& be, View<E, 2> pool, ConstView<E, 2> rows,
                 ConstView<std::int64_t, 1> slot_mapping) {
  const CacheWriteArgs<E> a{pool, rows, slot_mapping};
  dispatch(be, [&](const auto& b) {
    validate(a);
    if (a.tokens() == 0) return;
    b.kernel(CacheWrite::kernel_name, [&] { cache_write_program(b, a); });
  });
}

}  // namespace tiledecode::kernels
