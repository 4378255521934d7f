#pragma once
// The CPU backend's per-call context: which executor runs the tasks and which ISA the kernels
// use. Built once per decode step (the single dispatch point) and passed down unchanged;
// primitives never query the machine themselves.

#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/parallel.hpp"

namespace tiledecode::cpu {

struct Context {
  Executor* exec = nullptr;  // nullptr: run inline on the calling thread
  Isa isa = Isa::scalar;
  // The avx512 tier's BF16 row products (isa.hpp, Bf16Dot): automatic takes the faster
  // instruction of this CPU; pin fma or dpbf16 for the same bits on every machine of the tier.
  Bf16Dot bf16_dot = Bf16Dot::automatic;

  // Runs fn(i) for i in [begin, end) in tasks of `grain` indices on the context's executor.
  template <class F>
  void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain, F&& fn) const {
    SerialExecutor serial;
    tiledecode::parallel_for(exec ? *exec : static_cast<Executor&>(serial), begin, end, grain,
                             static_cast<F&&>(fn));
  }
};

// Context with the best ISA of this machine on the given executor.
inline Context make_context(Executor* exec) {
  return Context{exec, detect_isa()};
}

}  // namespace tiledecode::cpu
