#pragma once
// The CPU backend as a tile-program backend type: `cpu::Cpu<Isa>` (one type per ISA tier), and the
// single dispatch point `cpu::dispatch(ctx, f)` that turns the runtime choice in a cpu::Context
// into a call f(Cpu<isa>{...}) — so every program is instantiated once per tier and never asks
// which machine it runs on inside a loop (Highway's "one dispatch point, code per target").
//
// A family's ops for this backend are the specialisation backend_ops<Family, Cpu<I>> in
// backend/cpu/<family>.hpp (tile/backend.hpp). On a non-x86 target only Cpu<Isa::scalar> exists.

#include <cstdint>
#include <string_view>
#include <utility>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::cpu {

template <Isa I>
struct Cpu {
  static constexpr Isa isa = I;
  static constexpr bool avx2 = has_avx2(I);
  static constexpr bool vnni = has_vnni(I);
  static constexpr std::string_view name = to_string(I);
  Executor* exec = nullptr;         // nullptr: inline on the calling thread
  Bf16Dot bf16_dot = Bf16Dot::fma;  // resolved (never automatic): see Context::bf16_dot

  std::size_t concurrency() const { return exec ? exec->concurrency() : 1; }
  Context context() const { return Context{exec, I, bf16_dot}; }
  // A stage of n independent tasks [0, n) (shape-only split; any order, any thread).
  template <class F>
  void tasks(std::int64_t n, F&& f) const {
    context().parallel_for(0, n, 1, static_cast<F&&>(f));
  }
  // One kernel of a step (the a2a3 backend brackets its launches here; the CPU just runs it).
  template <class F>
  void kernel(std::string_view /*name*/, F&& body) const {
    body();
  }
};

// Calls f(Cpu<ctx.isa>{ctx.exec, bf16_dot}) and returns its result; the ISA is validated against
// the CPU (cpu::checked_isa) and the BF16 choice resolved (cpu::resolved_bf16_dot) once, here.
template <class F>
decltype(auto) dispatch(const Context& ctx, F&& f) {
  const Isa isa = checked_isa(ctx.isa);
  const Bf16Dot b = resolved_bf16_dot(ctx.bf16_dot);
  switch (isa) {
#if TILEDECODE_X86
    case Isa::avx512:
      return f(Cpu<Isa::avx512>{ctx.exec, b});
    case Isa::avx2_vnni:
      return f(Cpu<Isa::avx2_vnni>{ctx.exec, b});
    case Isa::avx2:
      return f(Cpu<Isa::avx2>{ctx.exec, b});
#endif
    default:
      return f(Cpu<Isa::scalar>{ctx.exec, b});
  }
}

// A concrete CPU backend dispatches to itself (programs composed of programs, e.g. the layer).
template <Isa I, class F>
decltype(auto) dispatch(const Cpu<I>& b, F&& f) {
  return f(b);
}

}  // namespace tiledecode::cpu
