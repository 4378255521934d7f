#pragma once
// Request lanes that help one another (backend/cpu/compressor.hpp, for_requests). The L lanes run
// as tasks of the step's executor; each lane's own stages (Cpu::tasks: the pooling's channel
// blocks, the rounding check's repairs) run on that lane's executor here, which posts the stage's
// tasks to the lane's slot and runs them itself, while a thread whose lane is done, once every
// lane has started, takes tasks from the others' slots instead of idling at the executor's
// barrier. Which thread runs a task changes no bit: the tasks are the stage's own, each writes
// only its own outputs, and the lane returns from the stage once all of them have finished.
//
// No deadlock on any executor: a thread waits only (1) as a helper, while every lane has started
// and one has not finished (that lane runs on another thread and never waits for a helper), and
// (2) as a lane, for the tasks that a helper claimed (the helper is running them). Both spin, and
// yield the thread after kSpin idle rounds (a lane's stage may run for a while with nothing to
// share; yielding leaves the core to the thread that works where threads outnumber cores). Neither
// side allocates; the tasks must not throw (the compressors' stages do not). A stage started
// from inside one of its own lane's tasks runs inline.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "tiledecode/core/parallel.hpp"

namespace tiledecode::cpu {

class LaneCrew {
 public:
  static constexpr int kMaxLanes = 8;

  // lanes in [1, kMaxLanes].
  explicit LaneCrew(int lanes) : lanes_(lanes) {
    for (int i = 0; i < kMaxLanes; ++i) execs_[i].slot_ = &slots_[i];
  }
  LaneCrew(const LaneCrew&) = delete;
  LaneCrew& operator=(const LaneCrew&) = delete;

  // Lane i's executor (its stages' Cpu::exec).
  Executor* lane(int i) { return &execs_[i]; }
  // Called by a lane's task first.
  void start() { started_.fetch_add(1, std::memory_order_acq_rel); }
  // Called by a lane's task last: its lane is done; once every lane has started, it takes the
  // other lanes' posted tasks until every lane is done.
  void finish_and_help() {
    finished_.fetch_add(1, std::memory_order_acq_rel);
    // A lane not started yet: back to the executor, whose next task on this thread may be it.
    if (started_.load(std::memory_order_acquire) < lanes_) return;
    helpers_.fetch_add(1, std::memory_order_relaxed);
    for (int rounds = 0; finished_.load(std::memory_order_acquire) < lanes_;) {
      if (take_one())
        rounds = 0;
      else
        wait(rounds);
    }
    helpers_.fetch_sub(1, std::memory_order_relaxed);
  }
  // Whether a thread helps now (a lane may split a stage that it would otherwise run whole).
  bool helping() const { return helpers_.load(std::memory_order_relaxed) > 0; }

 private:
  static constexpr int kSpin = 4096;
  static constexpr std::uint64_t kMaxTasks = 0xffff;  // n and next: 16 bits each

  // A posted stage: state = generation << 32 | n << 16 | next (the next task to claim).
  struct Slot {
    std::atomic<std::uint64_t> state{0};
    std::atomic<const FunctionRef*> body{nullptr};
    std::atomic<std::uint32_t> done{0};  // tasks finished by helpers
    std::atomic<bool> busy{false};       // a stage posted (a nested one runs inline)
  };
  static std::uint64_t next_of(std::uint64_t s) { return s & kMaxTasks; }
  static std::uint64_t n_of(std::uint64_t s) { return (s >> 16) & kMaxTasks; }

  // Claims task i < n of the slot's current stage (a CAS on its state, so a stale generation
  // claims nothing): returns i, or ~0 where every task is claimed (or none is posted).
  static std::uint64_t claim(Slot& s) {
    std::uint64_t st = s.state.load(std::memory_order_acquire);
    while (next_of(st) < n_of(st))
      if (s.state.compare_exchange_weak(st, st + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        return next_of(st);
    return ~std::uint64_t(0);
  }
  // One task of any lane's posted stage; false where none is left to claim.
  bool take_one() {
    for (int j = 0; j < lanes_; ++j) {
      Slot& s = slots_[j];
      const std::uint64_t i = claim(s);
      if (i == ~std::uint64_t(0)) continue;
      // The claim read the state the lane released after storing body: it is this stage's, and
      // stays until this task's done below.
      (*s.body.load(std::memory_order_relaxed))(std::size_t(i));
      s.done.fetch_add(1, std::memory_order_release);
      return true;
    }
    return false;
  }
  // One round of waiting: a pause hint for kSpin rounds, then a yield of the thread.
  static void wait(int& rounds) {
    if (++rounds > kSpin) {
      std::this_thread::yield();
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  class Exec final : public Executor {
   public:
    void run(std::size_t n, FunctionRef body) override {
      Slot& s = *slot_;
      if (n < 2 || n > kMaxTasks || s.busy.load(std::memory_order_relaxed)) {
        for (std::size_t i = 0; i < n; ++i) body(i);
        return;
      }
      s.busy.store(true, std::memory_order_relaxed);
      s.body.store(&body, std::memory_order_relaxed);
      s.done.store(0, std::memory_order_relaxed);
      const std::uint64_t gen = (s.state.load(std::memory_order_relaxed) >> 32) + 1;
      s.state.store(gen << 32 | std::uint64_t(n) << 16, std::memory_order_release);
      std::uint32_t own = 0;
      for (std::uint64_t i; (i = claim(s)) != ~std::uint64_t(0); ++own) body(std::size_t(i));
      for (int rounds = 0; s.done.load(std::memory_order_acquire) != std::uint32_t(n) - own;)
        wait(rounds);
      s.busy.store(false, std::memory_order_relaxed);
    }
    std::size_t concurrency() const override { return 1; }

   private:
    friend class LaneCrew;
    Slot* slot_ = nullptr;
  };

  int lanes_;
  std::atomic<int> started_{0}, finished_{0}, helpers_{0};
  Slot slots_[kMaxLanes];
  Exec execs_[kMaxLanes];
};

}  // namespace tiledecode::cpu
