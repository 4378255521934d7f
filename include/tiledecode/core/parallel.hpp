#pragma once
// Parallel execution. Kernels split their work into a fixed list of independent tasks whose
// boundaries depend only on the problem shape, never on the thread count, and each output
// element is produced by exactly one task with a fixed reduction order — so results are
// bit-identical for any number of threads.
//
// `Executor` is the seam an engine replaces with its own scheduler. `ThreadPool` is the default
// (sized to the hardware); `SerialExecutor` runs inline. Dispatch never allocates: the task body
// is passed as a non-owning `FunctionRef`.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace tiledecode {

// Non-owning reference to a callable `void(std::size_t)`. The callable must outlive the call.
class FunctionRef {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef>)
      FunctionRef(F&& f)  // NOLINT: implicit by design
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, std::size_t i) { (*static_cast<std::remove_reference_t<F>*>(o))(i); }) {}
  void operator()(std::size_t i) const { call_(obj_, i); }

 private:
  void* obj_;
  void (*call_)(void*, std::size_t);
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs body(0) … body(n_tasks-1), each exactly once, and returns when all have finished.
  // Tasks may run in any order and concurrently. The first exception thrown by a task is
  // rethrown here after all tasks finished.
  virtual void run(std::size_t n_tasks, FunctionRef body) = 0;
  // How many tasks may run at once (used only to size workspaces, never to split work).
  virtual std::size_t concurrency() const = 0;
};

class SerialExecutor final : public Executor {
 public:
  void run(std::size_t n_tasks, FunctionRef body) override {
    for (std::size_t i = 0; i < n_tasks; ++i) body(i);
  }
  std::size_t concurrency() const override { return 1; }
};

// A fixed pool of worker threads. The calling thread takes part in the work, so a pool of
// `n` threads starts `n - 1` workers. One `run` at a time per pool (calls are serialised).
//
// Nested use: `run` called from inside a task of the SAME pool (a kernel given this pool, called
// from a task the pool is running, on a worker or on the calling thread) runs its tasks inline on
// that thread, in index order, with the Executor contract (every task once, the first exception
// rethrown after all of them), instead of waiting for the pool it is itself occupying (which
// deadlocked: the outer run holds the pool). A thread_local marker (the pool whose tasks the
// thread is running) is the only state; it is set and restored around each task loop, so a task
// of pool A that runs pool B sees B's marker inside B's tasks and A's again afterwards. Not
// detected: a cycle across pools whose inner run executes on ANOTHER pool's workers (A's task
// runs B, whose task runs A again): B's worker does not know it serves A, and that waits.
//
// Waiting: a worker that finished a run spins for `spin` (default 100 µs) watching for the next
// run before it sleeps on the condition variable, and the caller spins as long for the workers'
// last tasks before it sleeps. A decode step calls its kernels back to back, so the spin catches
// them; a futex wake costs 15-100 µs on a VM (measured here), 2-10 % of a 1-4 ms kernel on two
// threads. Pass spin = 0 to always sleep (e.g. when the pool has more threads than free cores).
class ThreadPool final : public Executor {
 public:
  static constexpr std::chrono::microseconds kDefaultSpin{100};

  explicit ThreadPool(std::size_t n_threads = default_threads(),
                      std::chrono::microseconds spin = kDefaultSpin)
      : spin_(std::max(spin, std::chrono::microseconds(0))) {
    n_threads = std::max<std::size_t>(1, n_threads);
    workers_.reserve(n_threads - 1);
    for (std::size_t i = 0; i + 1 < n_threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() override {
    {
      std::lock_guard lk(m_);
      stop_.store(true, std::memory_order_relaxed);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  static std::size_t default_threads() {
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : n;
  }
  std::size_t concurrency() const override { return workers_.size() + 1; }

  // True while the calling thread is running a task of this pool (a nested run goes inline).
  bool inside_task() const noexcept { return current_pool() == this; }

  void run(std::size_t n_tasks, FunctionRef body) override {
    if (n_tasks == 0) return;
    if (inside_task()) {  // nested: this thread already holds one of the pool's lanes
      run_inline(n_tasks, body);
      return;
    }
    if (workers_.empty() || n_tasks == 1) {
      for (std::size_t i = 0; i < n_tasks; ++i) body(i);
      return;
    }
    std::lock_guard run_lock(run_m_);
    {
      std::lock_guard lk(m_);
      body_ = &body;
      n_tasks_ = n_tasks;
      next_.store(0, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      active_.fetch_add(1, std::memory_order_relaxed);  // the caller
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();  // no system call when every worker is still spinning
    drain();
    // Every task finished *and* every worker left drain(), so that no worker can touch the
    // counter or the body once this call returns.
    const auto finished = [&] {
      return done_.load(std::memory_order_acquire) == n_tasks_ &&
             active_.load(std::memory_order_acquire) == 0;
    };
    spin_until(finished);
    std::unique_lock lk(m_);  // also orders the workers' task writes before our return
    done_cv_.wait(lk, finished);
    body_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // The pool whose tasks this thread is running (nullptr outside any task loop).
  static const ThreadPool*& current_pool() noexcept {
    static thread_local const ThreadPool* p = nullptr;
    return p;
  }
  // Marks this thread as running `pool`'s tasks for its lifetime, restoring the outer marker.
  class TaskScope {
   public:
    explicit TaskScope(const ThreadPool* pool) noexcept
        : outer_(std::exchange(current_pool(), pool)) {}
    ~TaskScope() { current_pool() = outer_; }
    TaskScope(const TaskScope&) = delete;
    TaskScope& operator=(const TaskScope&) = delete;

   private:
    const ThreadPool* outer_;
  };

  // Every task on the calling thread, in order; the first exception after all of them.
  static void run_inline(std::size_t n_tasks, FunctionRef body) {
    std::exception_ptr first;
    for (std::size_t i = 0; i < n_tasks; ++i) {
      try {
        body(i);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  // Spins (with a pause hint) until pred() or stop, for at most spin_.
  template <class Pred>
  void spin_until(Pred&& pred) const {
    if (spin_.count() == 0) return;
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (unsigned i = 1;; ++i) {
      if (pred() || stop_.load(std::memory_order_relaxed)) return;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
    }
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Called with active_ incremented; body_ and n_tasks_ are stable until active_ drops to 0.
  void drain() {
    std::size_t finished = 0;
    {
      const TaskScope scope(this);  // a run() from inside a task goes inline
      for (;;) {
        const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
        if (i >= n_tasks_) break;
        try {
          (*body_)(i);
        } catch (...) {
          std::lock_guard lk(m_);
          if (!error_) error_ = std::current_exception();
        }
        ++finished;
      }
    }
    std::lock_guard lk(m_);
    done_.fetch_add(finished, std::memory_order_release);
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
        done_.load(std::memory_order_relaxed) == n_tasks_)
      done_cv_.notify_all();
  }

  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] {
          return stop_.load(std::memory_order_relaxed) ||
                 (generation_.load(std::memory_order_relaxed) != seen && body_ != nullptr);
        });
        if (stop_.load(std::memory_order_relaxed)) return;
        seen = generation_.load(std::memory_order_relaxed);
        active_.fetch_add(1, std::memory_order_relaxed);
      }
      drain();
    }
  }

  std::vector<std::thread> workers_;
  std::chrono::microseconds spin_;
  std::mutex run_m_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  // Written under m_; the atomics are also read without it by the spinning threads.
  const FunctionRef* body_ = nullptr;  // stable while active_ > 0
  std::size_t n_tasks_ = 0;
  std::atomic<std::size_t> active_{0};
  std::atomic<std::size_t> next_{0};
  std::atomic<std::size_t> done_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
};

// Calls fn(i) for every i in [begin, end), in tasks of `grain` consecutive indices. The task
// split depends only on (begin, end, grain).
template <class F>
void parallel_for(Executor& ex, std::int64_t begin, std::int64_t end, std::int64_t grain, F&& fn) {
  if (end <= begin) return;
  grain = std::max<std::int64_t>(1, grain);
  const std::int64_t n_tasks = (end - begin + grain - 1) / grain;
  auto task = [&](std::size_t k) {
    const std::int64_t lo = begin + static_cast<std::int64_t>(k) * grain;
    const std::int64_t hi = std::min(end, lo + grain);
    for (std::int64_t i = lo; i < hi; ++i) fn(i);
  };
  ex.run(static_cast<std::size_t>(n_tasks), FunctionRef(task));
}

}  // namespace tiledecode
