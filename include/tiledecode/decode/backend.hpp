#pragma once
// The backend of a decode step, chosen ONCE per step by the caller and passed unchanged to every
// layer; the primitives below never ask which machine they run on (style: dispatch hoisted to
// the outermost call).
//
//   auto be = decode::Backend::cpu(&pool);          // best ISA of this CPU, detected once
//   auto be = decode::Backend::cpu(&pool, Isa::scalar);   // force the scalar path (tests)
//
// BackendKind::a2a3 names the Ascend a2a3 execution model (backend/a2a3/). That model is a
// latency PREDICTION model: qkv_proj_rope, the compressors, the indexer and sparse attention with
// the output projection have functional tile programs there, but hc_pre, rms_norm, the cache
// write and hc_post exist only as timing-only programs (backend/a2a3/layer.hpp), so the model
// cannot produce a layer's x_out. A layer step given this kind therefore throws (before writing
// anything); the CPU is the only executing backend of the decode step. The model is used by
// `decode_step --backend a2a3` (examples/10_decode_step.cpp: the CPU runs the step, the a2a3
// schedules predict each kernel's latency for the same shapes and metadata) and by a2a3_report.

#include <string_view>

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/parallel.hpp"

namespace tiledecode::decode {

enum class BackendKind { cpu, a2a3 };

constexpr std::string_view to_string(BackendKind k) {
  return k == BackendKind::cpu ? "cpu" : "a2a3";
}

struct Backend {
  BackendKind kind = BackendKind::cpu;
  cpu::Context cpu_ctx{};  // executor + ISA of the CPU backend

  // CPU backend on `exec` (nullptr = inline) with the best ISA of this machine.
  static Backend cpu(Executor* exec) { return {BackendKind::cpu, cpu::make_context(exec)}; }
  // CPU backend with an explicit ISA (validated against the machine).
  static Backend cpu(Executor* exec, cpu::Isa isa) {
    return {BackendKind::cpu, cpu::Context{exec, cpu::checked_isa(isa)}};
  }
  std::size_t concurrency() const { return cpu_ctx.exec ? cpu_ctx.exec->concurrency() : 1; }
};

inline BackendKind backend_by_name(std::string_view name) {
  if (name == "cpu") return BackendKind::cpu;
  if (name == "a2a3") return BackendKind::a2a3;
  throw Error("backend_by_name: argument 'name' = " + std::string(name) +
              " is not a backend; allowed cpu, a2a3");
}

}  // namespace tiledecode::decode
