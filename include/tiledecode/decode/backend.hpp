#pragma once
// The backend of a decode step, chosen ONCE per step by the caller and passed unchanged to every
// layer; the tile programs below never ask which machine they run on (style: dispatch hoisted to
// the outermost call).
//
//   auto be = decode::Backend::cpu(&pool);                 // best ISA of this CPU, detected once
//   auto be = decode::Backend::cpu(&pool, Isa::scalar);    // force a tier (tests)
//   a2a3::Machine chip(&pool);
//   auto be = decode::Backend::a2a3(&chip);                // the Ascend a2a3 execution model
//
// On the a2a3 backend every kernel of the layer runs as its tile program on the machine model:
// the outputs are computed by the model's instructions (checked against golden) and each kernel's
// predicted latency is reported (decode::KernelTimes; the launch details via `reports`).

#include <string>
#include <string_view>
#include <vector>

#include "tiledecode/backend/a2a3/backend.hpp"
#include "tiledecode/backend/cpu/backend.hpp"
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
  cpu::Context cpu_ctx{};    // executor + ISA of the CPU backend
  a2a3::Context a2a3_ctx{};  // the machine model (kind == a2a3)

  // CPU backend on `exec` (nullptr = inline) with the best ISA of this machine.
  static Backend cpu(Executor* exec) { return {BackendKind::cpu, cpu::make_context(exec), {}}; }
  // CPU backend with an explicit ISA (validated against the machine).
  static Backend cpu(Executor* exec, cpu::Isa isa) {
    return {BackendKind::cpu, cpu::Context{exec, cpu::checked_isa(isa)}, {}};
  }
  // The a2a3 execution model; `reports` (optional) receives one KernelReport per kernel run.
  static Backend a2a3(a2a3::Machine* machine, std::vector<a2a3::KernelReport>* reports = nullptr,
                      a2a3::ScoreDesign score = a2a3::ScoreDesign::fused) {
    if (machine == nullptr) throw_arg("decode::Backend::a2a3", "machine", "null", "a Machine");
    return {BackendKind::a2a3, cpu::Context{}, a2a3::Context{machine, reports, score, 2}};
  }
  std::size_t concurrency() const {
    return kind == BackendKind::cpu && cpu_ctx.exec ? cpu_ctx.exec->concurrency() : 1;
  }
};

// The single dispatch point: f(concrete backend) — cpu::Cpu<isa> or a2a3::A2a3.
template <class F>
decltype(auto) dispatch(const Backend& be, F&& f) {
  switch (be.kind) {
    case BackendKind::cpu:
      return cpu::dispatch(be.cpu_ctx, static_cast<F&&>(f));
    case BackendKind::a2a3:
      return a2a3::dispatch(be.a2a3_ctx, static_cast<F&&>(f));
  }
  throw_arg("decode::dispatch", "be.kind", int(be.kind), "cpu (0) or a2a3 (1)");
}

inline BackendKind backend_by_name(std::string_view name) {
  if (name == "cpu") return BackendKind::cpu;
  if (name == "a2a3") return BackendKind::a2a3;
  throw Error("backend_by_name: argument 'name' = " + std::string(name) +
              " is not a backend; allowed cpu, a2a3");
}

}  // namespace tiledecode::decode
