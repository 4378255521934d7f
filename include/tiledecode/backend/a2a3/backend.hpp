#pragma once
// The a2a3 execution model as a tile-program backend type: `a2a3::A2a3` (the chip: a Machine and
// where its kernel reports go), and `a2a3::Context`, the runtime handle a caller passes to a kernel
// entry point or to decode::Backend::a2a3 (like cpu::Context for the CPU).
//
// A family's ops for this backend are the specialisation backend_ops<Family, A2a3> in
// backend/a2a3/<family>.hpp: each op is issued as the DMA / cube / vector instructions of the
// machine model (machine.hpp) on the cores of the block that runs the work item, so results are
// computed by the model's own instructions and every latency comes from arch.hpp.

#include <string_view>
#include <utility>
#include <vector>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/tile/backend.hpp"

namespace tiledecode::a2a3 {

// The indexer score's schedule (spec §7.4): the fused mixed scope of PR #831 or the earlier
// two-scope design (a cube scope writing INT32 GM scratch, then a vector scope).
enum class ScoreDesign { fused, two_scope };

struct A2a3 {
  static constexpr std::string_view name = "a2a3";
  Machine* m = nullptr;
  std::vector<KernelReport>* reports = nullptr;  // one report per kernel run (optional)
  ScoreDesign score_design = ScoreDesign::fused;
  int ring_slots = 2;  // the fused score's cube -> vector ring depth (PR #831: 2)

  std::size_t concurrency() const { return 1; }
  const ArchFacts& arch() const { return m->arch(); }
  // One kernel: its launches are reported together (appended to `reports`); returns its predicted
  // latency (us). Inside an open kernel (a composition that reports several programs as one
  // kernel) the launches join it and 0 is returned.
  template <class F>
  double kernel(std::string_view kernel_name, F&& body) const {
    if (m->in_kernel()) {
      body();
      return 0.0;
    }
    m->begin_kernel(kernel_name);
    body();
    KernelReport r = m->end_kernel();
    const double us = r.latency_us();
    if (reports) reports->push_back(std::move(r));
    return us;
  }
};

// What a caller passes to run kernels on the model.
struct Context {
  Machine* machine = nullptr;
  std::vector<KernelReport>* reports = nullptr;
  ScoreDesign score_design = ScoreDesign::fused;
  int ring_slots = 2;
};

template <class F>
decltype(auto) dispatch(const Context& ctx, F&& f) {
  if (ctx.machine == nullptr) throw_arg("a2a3::dispatch", "ctx.machine", "null", "a Machine");
  if (ctx.score_design != ScoreDesign::fused && ctx.score_design != ScoreDesign::two_scope)
    throw_arg("a2a3::dispatch", "ctx.score_design", int(ctx.score_design), "fused or two_scope");
  check_range("a2a3::dispatch", "ctx.ring_slots", ctx.ring_slots, 1, 65);
  return f(A2a3{ctx.machine, ctx.reports, ctx.score_design, ctx.ring_slots});
}
template <class F>
decltype(auto) dispatch(const A2a3& b, F&& f) {
  return f(b);
}

// GM scratch carved from a caller's byte workspace (64-byte aligned parts), in order.
class GmArena {
 public:
  explicit GmArena(std::span<std::byte> ws) : base_(ws.data()), size_(ws.size()) {}
  template <class T, std::size_t R>
  View<T, R> take(const std::array<index_t, R>& shape) {
    index_t n = 1;
    for (auto e : shape) n *= e;
    const auto p = reinterpret_cast<std::uintptr_t>(base_ + used_);
    used_ += (64 - p % 64) % 64;
    T* data = reinterpret_cast<T*>(base_ + used_);
    used_ += std::size_t(n) * sizeof(T);
    if (used_ > size_)
      throw Error("a2a3: GM workspace of " + std::to_string(size_) + " bytes is too small");
    return View<T, R>(data, shape);
  }
  std::size_t used() const { return used_; }
  // Bytes `take` needs for these shapes (64-byte alignment slack included).
  template <class T, std::size_t R>
  static std::size_t bytes(const std::array<index_t, R>& shape) {
    index_t n = 1;
    for (auto e : shape) n *= e;
    return std::size_t(n) * sizeof(T) + 64;
  }

 private:
  std::byte* base_;
  std::size_t size_;
  std::size_t used_ = 0;
};

}  // namespace tiledecode::a2a3
