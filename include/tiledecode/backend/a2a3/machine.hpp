#pragma once
// The a2a3 execution model: cores with pipes, explicit copies, a cross-core ring, SPMD launch of
// mixed blocks, and the cost model that times every issued op.
//
// Execution. A schedule is a tile program: for each block of a launch it calls ops on the
// block's cube core (`CubeCore`: GM->L1 copies, L1->L0 moves, mmad, FIXPIPE out of L0C) and on
// its two vector cores (`VectorCore`: GM<->UB copies, vector ops on UB tiles, sorts, scalar
// work). Every op runs functionally at once (it really computes on the tile data) and is timed.
//
// Cost model (constants only from arch.hpp):
//  * every core has in-order pipes MTE2 (GM->local), MTE1 (L1->L0), CUBE, FIXPIPE (L0C->out),
//    VECTOR, MTE3 (UB->GM) and SCALAR; an op starts when its pipe is free and its operands are
//    ready: RAW on the buffers it reads, WAR/WAW on the buffers it writes (the flags a lowering
//    inserts), plus a pipe-sync cost when the producer was another pipe and a cross-core sync
//    cost when it was another core (ring traffic). Pipes therefore overlap exactly as far as the
//    issued dependencies allow: a double buffer overlaps, a single buffer serialises.
//  * op durations: DMA = per-descriptor issue cost + max(bytes, min burst) / port rate, with the
//    GM latency delaying readiness but not occupying the pipe; mmad = fractal count (16x16x16
//    BF16 or 16x32x16 INT8 per cycle; partial fractals pay in full, so T = 8 rows pads to 16);
//    vector op = bytes / 256 B-per-cycle x op factor + fixed issue cost.
//  * a launch (one kernel / scope) takes max(slowest core, total HBM bytes / HBM bandwidth) plus
//    the launch overhead; a kernel made of several launches takes their sum.
// Cores of a launch are independent in the model except through rings inside a block, so blocks
// are executed per core (core c runs its blocks c, c + cores, ... in order) and cores in parallel
// on an Executor: functional results and predicted times are identical for any thread count.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tiledecode/backend/a2a3/arch.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::a2a3 {

enum class Pipe : std::uint8_t { mte2 = 0, mte1, cube, fixpipe, vector, mte3, scalar };
inline constexpr int kPipes = 7;

constexpr std::string_view pipe_name(Pipe p) {
  constexpr std::array<std::string_view, kPipes> n{"MTE2",   "MTE1", "CUBE",  "FIXPIPE",
                                                   "VECTOR", "MTE3", "SCALAR"};
  return n[static_cast<int>(p)];
}

enum class Role : std::uint8_t { cube, vector };

// Bytes moved per memory level (both directions counted where a level is read and written).
struct Traffic {
  std::int64_t gm_read = 0;   // HBM/GM -> L1 or UB
  std::int64_t gm_write = 0;  // L0C or UB -> GM
  std::int64_t ring = 0;      // cube<->vector ring through the L2-resident workspace (in + out)
  std::int64_t l1_in = 0;     // into L1 (GM and ring)
  std::int64_t l0a_in = 0;    // L1 -> L0A
  std::int64_t l0b_in = 0;    // L1 -> L0B
  std::int64_t l0c_out = 0;   // FIXPIPE out of L0C
  std::int64_t ub_in = 0;     // into UB (GM and ring)
  std::int64_t ub_out = 0;    // UB -> GM and ring
  std::int64_t gm_total() const { return gm_read + gm_write; }
  Traffic& operator+=(const Traffic& o) {
    gm_read += o.gm_read;
    gm_write += o.gm_write;
    ring += o.ring;
    l1_in += o.l1_in;
    l0a_in += o.l0a_in;
    l0b_in += o.l0b_in;
    l0c_out += o.l0c_out;
    ub_in += o.ub_in;
    ub_out += o.ub_out;
    return *this;
  }
};

// One timed op, for the Chrome trace.
struct OpRecord {
  std::string_view name;
  Pipe pipe;
  double start, end;  // cycles from the launch start
};

class Machine;

// A core of the model: pipes, local memories, issued-op log and traffic counters.
class Core {
 public:
  Core(Role role, int id, const ArchFacts& arch) : role_(role), id_(id), arch_(&arch) {
    const std::string n = name();
    if (role == Role::cube) {
      mem_[int(Space::l1)] = LocalMemory(Space::l1, arch.l1_bytes, n);
      mem_[int(Space::l0a)] = LocalMemory(Space::l0a, arch.l0a_bytes, n);
      mem_[int(Space::l0b)] = LocalMemory(Space::l0b, arch.l0b_bytes, n);
      mem_[int(Space::l0c)] = LocalMemory(Space::l0c, arch.l0c_bytes, n);
    } else {
      mem_[int(Space::ub)] = LocalMemory(Space::ub, arch.ub_bytes, n);
    }
  }

  Role role() const { return role_; }
  int id() const { return id_; }
  std::string name() const { return (role_ == Role::cube ? "AIC" : "AIV") + std::to_string(id_); }
  const ArchFacts& arch() const { return *arch_; }

  // Allocates a local buffer; throws (plan-time check) when the space overflows.
  template <class T>
  Tile<T> alloc(Space s, std::string_view name, index_t rows, index_t cols) {
    check_space(s);
    return mem_[int(s)].alloc<T>(name, rows, cols);
  }
  const LocalMemory& memory(Space s) const { return mem_[int(s)]; }
  bool has_space(Space s) const {
    return role_ == Role::cube
               ? (s == Space::l1 || s == Space::l0a || s == Space::l0b || s == Space::l0c)
               : s == Space::ub;
  }

  // Issues one op: returns its end cycle. `reads`/`writes` are the buffers whose flags order it.
  double issue(Pipe p, std::string_view name, double cycles,
               std::initializer_list<BufferState*> reads,
               std::initializer_list<BufferState*> writes, double write_latency = 0) {
    double start = pipe_free_[int(p)];
    for (BufferState* r : reads) {
      const double sync =
          (r->writer_pipe >= 0 && r->writer_pipe != int(p)) ? arch_->pipe_sync_cycles : 0.0;
      start = std::max(start, r->ready + sync);
    }
    // WAR always; WAW only against another pipe (an in-order pipe keeps its own writes in
    // order, e.g. several DMAs filling rows of one buffer back to back).
    for (BufferState* w : writes) {
      start = std::max(start, w->read_end);
      if (w->writer_pipe != int(p)) start = std::max(start, w->ready);
    }
    const double end = start + cycles;
    pipe_free_[int(p)] = end;
    busy_[int(p)] += cycles;
    for (BufferState* r : reads) r->read_end = std::max(r->read_end, end);
    for (BufferState* w : writes) {
      w->ready =
          w->writer_pipe == int(p) ? std::max(w->ready, end + write_latency) : end + write_latency;
      w->read_end = std::max(w->read_end, end);
      w->writer_pipe = int(p);
    }
    ops_.push_back({name, p, start, end});
    return end;
  }

  // --- timing helpers shared by the op wrappers (cycles) ---
  double dma_cycles(std::int64_t descriptors, std::int64_t bytes_each) const {
    const double b = double(std::max<std::int64_t>(bytes_each, arch_->min_burst_bytes));
    return double(descriptors) * (arch_->dma_issue_cycles + b / arch_->gm_port_bytes_per_cycle);
  }

  // --- explicit GM -> local copy (MTE2): rows of `src` into rows [r0, r0 + rows) of `dst`.
  // One DataCopy instruction (a strided copy is one descriptor of `rows` bursts).
  template <class T>
  void copy_in(Tile<T> dst, index_t r0, std::type_identity_t<ConstView<T, 2>> src,
               std::string_view name = "copy_in") {
    check_copy(dst, r0, src.extent(0), src.extent(1), "copy_in");
    if (functional_)
      for (index_t r = 0; r < src.extent(0); ++r)
        std::memcpy(dst.row(r0 + r), &src(r, 0), sizeof(T) * std::size_t(src.extent(1)));
    const std::int64_t row_bytes = std::int64_t(sizeof(T)) * src.extent(1);
    const bool contiguous = src.extent(0) == 1 || src.stride(0) == src.extent(1);
    const double cyc = contiguous ? dma_cycles(1, row_bytes * src.extent(0))
                                  : arch_->dma_issue_cycles +
                                        double(src.extent(0)) *
                                            double(std::max(row_bytes, arch_->min_burst_bytes)) /
                                            arch_->gm_port_bytes_per_cycle;
    issue(Pipe::mte2, name, cyc, {}, {&dst.state()}, arch_->dma_latency_cycles);
    count_in(dst.space(), row_bytes * src.extent(0));
  }

  // --- GM row gather (MTE2): row `rows[i]` of `src` (-1: zero row, no read) into dst row r0+i.
  // One DataCopy per row: sparse gathers are issue-bound.
  template <class T, class Idx>
  void gather_rows_in(Tile<T> dst, index_t r0, std::type_identity_t<ConstView<T, 2>> src,
                      std::span<const Idx> rows, std::string_view name = "gather_rows") {
    check_copy(dst, r0, index_t(rows.size()), src.extent(1), "gather_rows_in");
    const std::int64_t row_bytes = std::int64_t(sizeof(T)) * src.extent(1);
    std::int64_t n = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      T* d = dst.row(r0 + index_t(i));
      if (rows[i] < 0) {
        if (functional_) std::memset(static_cast<void*>(d), 0, std::size_t(row_bytes));
      } else {
        if (functional_) std::memcpy(d, &src(index_t(rows[i]), 0), std::size_t(row_bytes));
        ++n;
      }
    }
    // Zero rows are produced by a vector dup / zeroed buffer, not by a GM read: not counted.
    issue(Pipe::mte2, name, n ? dma_cycles(n, row_bytes) : 1.0, {}, {&dst.state()},
          arch_->dma_latency_cycles);
    count_in(dst.space(), row_bytes * n);
  }

  // --- local -> GM copy: rows [r0, r0 + dst rows) of `src` (MTE3 from UB, FIXPIPE from L0C).
  template <class T>
  void copy_out(std::type_identity_t<View<T, 2>> dst, Tile<T> src, index_t r0,
                std::string_view name = "copy_out") {
    if (src.space() != Space::ub && src.space() != Space::l0c)
      throw Error("a2a3 copy_out: source '" + std::string(src.name()) + "' is in " +
                  std::string(space_name(src.space())) + "; only UB and L0C are written to GM");
    check_copy(src, r0, dst.extent(0), dst.extent(1), "copy_out");
    if (functional_)
      for (index_t r = 0; r < dst.extent(0); ++r)
        std::memcpy(&dst(r, 0), src.row(r0 + r), sizeof(T) * std::size_t(dst.extent(1)));
    const std::int64_t row_bytes = std::int64_t(sizeof(T)) * dst.extent(1);
    const bool contiguous = dst.extent(0) == 1 || dst.stride(0) == dst.extent(1);
    const double rate =
        src.space() == Space::l0c ? arch_->fixpipe_bytes_per_cycle : arch_->gm_port_bytes_per_cycle;
    const double cyc =
        arch_->dma_issue_cycles +
        (contiguous ? double(std::max(row_bytes * dst.extent(0), arch_->min_burst_bytes))
                    : double(dst.extent(0)) * double(std::max(row_bytes, arch_->min_burst_bytes))) /
            rate;
    issue(src.space() == Space::l0c ? Pipe::fixpipe : Pipe::mte3, name, cyc, {&src.state()}, {});
    const std::int64_t bytes = row_bytes * dst.extent(0);
    traffic_.gm_write += bytes;
    if (src.space() == Space::l0c)
      traffic_.l0c_out += bytes;
    else
      traffic_.ub_out += bytes;
  }

  // --- SCALAR: one metadata rule evaluated on the scalar unit (address generation through a
  // block table, column masks, work orders). The rule is a type: `name`, `elements()` and the
  // scalar instructions it executes per element, `kScalarOps` (counted at its definition), plus
  // `run()`, which computes it on the block's tiles. Timed at arch.scalar_cycles_per_op.
  template <class Rule>
  void scalar_rule(const Rule& rule, std::initializer_list<BufferState*> reads,
                   std::initializer_list<BufferState*> writes) {
    if (functional_) rule.run();
    issue(Pipe::scalar, Rule::name,
          double(rule.elements()) * double(Rule::kScalarOps) * arch_->scalar_cycles_per_op, reads,
          writes);
  }

  // PipeBarrier between pipes for data that goes through GM (which the model does not track
  // per address): `to` issues nothing before everything issued so far on `from` is complete and
  // visible (a GM write's latency included), e.g. MTE3 state writes then MTE2 reads of them.
  void gm_barrier(Pipe from, Pipe to) {
    pipe_free_[int(to)] =
        std::max(pipe_free_[int(to)], pipe_free_[int(from)] + arch_->dma_latency_cycles);
  }

  // --- launch bookkeeping ---
  void begin_launch() {
    pipe_free_.fill(0);
    busy_.fill(0);
    ops_.clear();
    traffic_ = {};
    for (auto& m : mem_) {
      m.reset();
      m.reset_peak();
    }
    used_ = false;
  }
  void end_block() {
    for (auto& m : mem_) m.reset();
  }
  void mark_used() { used_ = true; }
  // Functional (ops compute on tile data) or timing-only (ops are only timed and counted; GM
  // views may then be shape-only, with a null data pointer).
  void set_functional(bool on) { functional_ = on; }
  bool functional() const { return functional_; }
  bool used() const { return used_; }
  double finish_cycles() const { return *std::max_element(pipe_free_.begin(), pipe_free_.end()); }
  double busy(Pipe p) const { return busy_[int(p)]; }
  const std::vector<OpRecord>& ops() const { return ops_; }
  Traffic& traffic() { return traffic_; }
  const Traffic& traffic() const { return traffic_; }

  void count_in(Space s, std::int64_t bytes) {
    traffic_.gm_read += bytes;
    if (s == Space::l1) traffic_.l1_in += bytes;
    if (s == Space::ub) traffic_.ub_in += bytes;
  }

 protected:
  void check_space(Space s) const {
    if (!has_space(s))
      throw Error("a2a3 plan: " + name() + " has no " + std::string(space_name(s)) +
                  " (cube cores own L1/L0A/L0B/L0C, vector cores own UB)");
  }
  template <class T>
  void check_copy(const Tile<T>& t, index_t r0, index_t rows, index_t cols,
                  std::string_view where) const {
    check_space(t.space());
    if (r0 < 0 || r0 + rows > t.rows() || cols > t.cols())
      throw Error("a2a3 " + std::string(where) + ": " + std::to_string(rows) + "x" +
                  std::to_string(cols) + " at row " + std::to_string(r0) + " exceeds buffer '" +
                  std::string(t.name()) + "' (" + std::to_string(t.rows()) + "x" +
                  std::to_string(t.cols()) + ")");
  }

  Role role_;
  int id_;
  const ArchFacts* arch_;
  std::array<LocalMemory, kLocalSpaces> mem_;
  std::array<double, kPipes> pipe_free_{};
  std::array<double, kPipes> busy_{};
  std::vector<OpRecord> ops_;
  Traffic traffic_;
  bool used_ = false;
  bool functional_ = true;
};

// Element type of the cube's accumulator for an operand type.
template <class In>
using acc_t = std::conditional_t<std::is_same_v<In, std::int8_t>, std::int32_t, float>;

// Cube core (AIC): L1 staging, L0A/L0B operands, mmad into L0C, FIXPIPE out.
class CubeCore : public Core {
 public:
  CubeCore(int id, const ArchFacts& arch) : Core(Role::cube, id, arch) {}

  // MTE1: sub-block [r0, r0+rows) x [c0, c0+cols) of an L1 tile into an L0A/L0B tile (row-major
  // (rows, cols)). `transpose` stores it as (cols, rows) (the load's transpose mode).
  template <class T>
  void load_l0(Tile<T> dst, Tile<T> src, index_t r0, index_t rows, index_t c0, index_t cols,
               bool transpose = false, std::string_view name = "load_l0") {
    if (src.space() != Space::l1 || (dst.space() != Space::l0a && dst.space() != Space::l0b))
      throw Error("a2a3 load_l0: moves L1 -> L0A/L0B only ('" + std::string(src.name()) + "' -> '" +
                  std::string(dst.name()) + "')");
    const index_t dr = transpose ? cols : rows, dc = transpose ? rows : cols;
    if (r0 < 0 || c0 < 0 || r0 + rows > src.rows() || c0 + cols > src.cols() || dr > dst.rows() ||
        dc > dst.cols())
      throw Error("a2a3 load_l0: block does not fit '" + std::string(dst.name()) + "'");
    for (index_t r = 0; r < rows && functional_; ++r)
      for (index_t c = 0; c < cols; ++c) {
        if (transpose)
          dst(c, r) = src(r0 + r, c0 + c);
        else
          dst(r, c) = src(r0 + r, c0 + c);
      }
    const std::int64_t bytes = std::int64_t(sizeof(T)) * rows * cols;
    issue(Pipe::mte1, name, arch_->pipe_sync_cycles + double(bytes) / arch_->mte1_bytes_per_cycle,
          {&src.state()}, {&dst.state()});
    (dst.space() == Space::l0a ? traffic_.l0a_in : traffic_.l0b_in) += bytes;
  }

  // CUBE: c[0:m, c0:c0+n] (+)= a[0:m, 0:k] . b[0:n, 0:k]^T   (a in L0A as (m, k), b in L0B as
  // (n, k), c0 a column offset into the L0C tile). INT8 x INT8 -> INT32 (exact), BF16 x BF16 ->
  // FP32 (products exact, summed in k order). Cycles: one 16 x (16|32) x 16 fractal per cycle,
  // partial fractals padded.
  template <class In, class Acc>
  void mmad(Tile<Acc> c, Tile<In> a, Tile<In> b, index_t m, index_t n, index_t k, bool accumulate,
            std::string_view name = "mmad", index_t c0 = 0) {
    static_assert(std::is_same_v<Acc, acc_t<In>>, "mmad: INT8 accumulates in INT32, BF16 in FP32");
    if (a.space() != Space::l0a || b.space() != Space::l0b || c.space() != Space::l0c)
      throw Error("a2a3 mmad: operands must be L0A x L0B -> L0C");
    if (m > a.rows() || k > a.cols() || n > b.rows() || k > b.cols() || m > c.rows() || c0 < 0 ||
        c0 + n > c.cols())
      throw Error("a2a3 mmad: shape exceeds an operand buffer");
    for (index_t i = 0; i < m && functional_; ++i)
      for (index_t j = c0; j < c0 + n; ++j) {
        Acc s = accumulate ? c(i, j) : Acc(0);
        const In* ar = a.row(i);
        const In* br = b.row(j - c0);
        if constexpr (std::is_same_v<In, std::int8_t>) {
          std::int32_t d = 0;
          for (index_t q = 0; q < k; ++q) d += std::int32_t(ar[q]) * std::int32_t(br[q]);
          s += d;
        } else {
          float d = 0;
          for (index_t q = 0; q < k; ++q) d += float(ar[q]) * float(br[q]);
          s += d;
        }
        c(i, j) = s;
      }
    const double kf = std::is_same_v<In, std::int8_t> ? 32.0 : 16.0;
    const double fractals =
        std::ceil(double(m) / 16) * std::ceil(double(n) / 16) * std::ceil(double(k) / kf);
    issue(Pipe::cube, name, fractals + arch_->pipe_sync_cycles, {&a.state(), &b.state()},
          {&c.state()});
  }
};

// (score, index) pair of the vector sort: descending score, ascending index on ties.
struct ScorePair {
  float score;
  std::int32_t index;
};
inline bool pair_before(const ScorePair& a, const ScorePair& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// Vector core (AIV): UB tiles and its typed instruction set.
//
// Every instruction is one Ascend C vector API call on UB operands (`Sub` rectangles of tiles):
// it computes its result functionally and is timed by its class, from arch.hpp only:
//   alu      (add, sub, mul, max, min, abs, copy, dup, cast, select, pair gathers, broadcasts):
//            issue cost + one repeat of vector_bytes_per_cycle (256 B of the widest element type)
//            per cycle;
//   special  (exp, reciprocal, sqrt, division): the same repeats at 1 / vector_exp_cost_factor;
//   reduce   (row max / row sum): one repeat per 256 B folds each 256-B block to one value
//            (WholeReduce), a row longer than one block takes a second pass over the partials;
//   sort     Sort32 / MrgSort at sort32_cycles_per_element / merge_cycles_per_element.
// There is no instruction that runs caller code or takes a caller-chosen cost.
// Numerics: FP32 IEEE arithmetic as on the CPU; max/min propagate NaN; row sums fold each
// 64-element block by a pairwise tree and add the blocks in order; casts to BF16 round to nearest
// even, FP32 -> integer casts round half to even and saturate.
class VectorCore : public Core {
 public:
  VectorCore(int id, const ArchFacts& arch) : Core(Role::vector, id, arch) {}

  enum class Unit { alu, special };

  double vector_cycles(index_t elems, std::size_t elem_bytes, Unit u = Unit::alu) const {
    const double repeats =
        std::ceil(double(elems) * double(elem_bytes) / arch_->vector_bytes_per_cycle);
    return arch_->vector_op_overhead_cycles +
           repeats * (u == Unit::special ? arch_->vector_exp_cost_factor : 1.0);
  }
  double reduce_cycles(index_t rows, index_t cols) const {
    const index_t per_block = index_t(arch_->vector_bytes_per_cycle / 4);  // FP32 per repeat
    double c = vector_cycles(rows * cols, 4);
    if (cols > per_block) c += vector_cycles(rows * ((cols + per_block - 1) / per_block), 4);
    return c;
  }

  // ---- a metadata rule evaluated with whole-tile ALU instructions (compare, select, shift, mask,
  // gather, multiply-add over index lanes): the rule is a type with `name`, `elements()`, the
  // element width `kElemBytes` and the number of ALU instructions its vectorised form issues,
  // `kVectorOps` (counted at its definition); `run()` computes it on the block's tiles. Timed as
  // kVectorOps alu instructions over elements() lanes.
  template <class Rule>
  void vector_rule(const Rule& rule, std::initializer_list<BufferState*> reads,
                   std::initializer_list<BufferState*> writes) {
    if (functional_) rule.run();
    issue(Pipe::vector, Rule::name,
          double(Rule::kVectorOps) * vector_cycles(rule.elements(), Rule::kElemBytes), reads,
          writes);
  }

  // ---- element-wise, same-shape operands: d = a (op) b
  void vadd(Sub<float> d, Sub<float> a, Sub<float> b, std::string_view name = "vadd") {
    binary(name, Unit::alu, d, a, b, [](float x, float y) { return x + y; });
  }
  void vsub(Sub<float> d, Sub<float> a, Sub<float> b, std::string_view name = "vsub") {
    binary(name, Unit::alu, d, a, b, [](float x, float y) { return x - y; });
  }
  void vmul(Sub<float> d, Sub<float> a, Sub<float> b, std::string_view name = "vmul") {
    binary(name, Unit::alu, d, a, b, [](float x, float y) { return x * y; });
  }
  void vdiv(Sub<float> d, Sub<float> a, Sub<float> b, std::string_view name = "vdiv") {
    binary(name, Unit::special, d, a, b, [](float x, float y) { return x / y; });
  }
  void vmax(Sub<float> d, Sub<float> a, Sub<float> b, std::string_view name = "vmax") {
    binary(name, Unit::alu, d, a, b, max_nan);
  }
  // ---- with a scalar operand: d = a (op) s
  void vadds(Sub<float> d, Sub<float> a, float s, std::string_view name = "vadds") {
    unary(name, Unit::alu, d, a, [s](float x) { return x + s; });
  }
  void vmuls(Sub<float> d, Sub<float> a, float s, std::string_view name = "vmuls") {
    unary(name, Unit::alu, d, a, [s](float x) { return x * s; });
  }
  void vmaxs(Sub<float> d, Sub<float> a, float s, std::string_view name = "vmaxs") {
    unary(name, Unit::alu, d, a, [s](float x) { return max_nan(x, s); });
  }
  void vmins(Sub<float> d, Sub<float> a, float s, std::string_view name = "vmins") {
    unary(name, Unit::alu, d, a, [s](float x) { return min_nan(x, s); });
  }
  // d = s / a (scalar numerator; e.g. 127 / amax)
  void vsdiv(Sub<float> d, float s, Sub<float> a, std::string_view name = "vsdiv") {
    unary(name, Unit::special, d, a, [s](float x) { return s / x; });
  }
  // d = a * s(0, 0): Muls with its scalar operand read from UB (GetValue, one scalar op)
  void vmul_scalar(Sub<float> d, Sub<float> a, Sub<float> s, std::string_view name = "vmuls_ub") {
    check_vec(d, name);
    check_same(d, a, name);
    if (s.size() != 1) throw Error("a2a3 " + std::string(name) + ": the scalar operand is not 1x1");
    if (functional_) {
      const float k = s(0, 0);
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = a(r, c) * k;
    }
    issue(Pipe::vector, name, vector_cycles(d.size(), 4) + arch_->scalar_cycles_per_op,
          {a.state(), s.state()}, {d.state()});
  }
  // ---- unary
  void vexp(Sub<float> d, Sub<float> a, std::string_view name = "vexp") {
    unary(name, Unit::special, d, a, [](float x) { return std::exp(x); });
  }
  void vsqrt(Sub<float> d, Sub<float> a, std::string_view name = "vsqrt") {
    unary(name, Unit::special, d, a, [](float x) { return std::sqrt(x); });
  }
  void vabs(Sub<float> d, Sub<float> a, std::string_view name = "vabs") {
    unary(name, Unit::alu, d, a, [](float x) { return std::fabs(x); });
  }
  void vrelu(Sub<float> d, Sub<float> a, std::string_view name = "vrelu") {
    unary(name, Unit::alu, d, a, [](float x) { return max_nan(x, 0.0f); });
  }
  // ---- broadcasts: v holds one value per row of d (rows(v) * cols(v) == rows(d)), or one per
  // column (== cols(d)), read in row-major order of v.
  void vmul_rows(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vmul_rows") {
    broadcast(name, Unit::alu, true, d, a, v, [](float x, float y) { return x * y; });
  }
  void vadd_rows(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vadd_rows") {
    broadcast(name, Unit::alu, true, d, a, v, [](float x, float y) { return x + y; });
  }
  void vsub_rows(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vsub_rows") {
    broadcast(name, Unit::alu, true, d, a, v, [](float x, float y) { return x - y; });
  }
  void vdiv_rows(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vdiv_rows") {
    broadcast(name, Unit::special, true, d, a, v, [](float x, float y) { return x / y; });
  }
  void vmul_cols(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vmul_cols") {
    broadcast(name, Unit::alu, false, d, a, v, [](float x, float y) { return x * y; });
  }
  void vadd_cols(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vadd_cols") {
    broadcast(name, Unit::alu, false, d, a, v, [](float x, float y) { return x + y; });
  }
  // d(r, c) += a(r, c) * v[r]  (MulAddDst with a row scalar)
  void vaxpy_rows(Sub<float> d, Sub<float> a, Sub<float> v, std::string_view name = "vaxpy_rows") {
    check_vec(d, name);
    check_same(d, a, name);
    check_broadcast(d, v, true, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r) {
        const float s = at(v, r);
        for (index_t c = 0; c < d.cols; ++c) d(r, c) += a(r, c) * s;
      }
    issue(Pipe::vector, name, vector_cycles(d.size(), 4), {d.state(), a.state(), v.state()},
          {d.state()});
  }
  // ---- reductions over the columns of each row: d[r] = max / sum of a(r, :)
  void vrow_max(Sub<float> d, Sub<float> a, std::string_view name = "vrow_max") {
    reduce(name, d, a, false);
  }
  void vrow_sum(Sub<float> d, Sub<float> a, std::string_view name = "vrow_sum") {
    reduce(name, d, a, true);
  }
  // ---- data
  template <class T>
  void vdup(Sub<T> d, T value, std::string_view name = "vdup") {
    check_vec(d, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = value;
    issue(Pipe::vector, name, vector_cycles(d.size(), sizeof(T)), {}, {d.state()});
  }
  template <class T>
  void vcopy(Sub<T> d, Sub<T> a, std::string_view name = "vcopy") {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = a(r, c);
    issue(Pipe::vector, name, vector_cycles(d.size(), sizeof(T)), {a.state()}, {d.state()});
  }
  // Type conversion (Cast): FP32 -> BF16 round to nearest even (NaN stays NaN), BF16 -> FP32 and
  // INT32/INT8 -> FP32 exact, FP32 -> INT32 / INT8 round half to even with saturation (NaN -> 0).
  template <class D, class S>
  void vcast(Sub<D> d, Sub<S> a, std::string_view name = "vcast") {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = convert<D>(a(r, c));
    issue(Pipe::vector, name, vector_cycles(d.size(), std::max(sizeof(D), sizeof(S))), {a.state()},
          {d.state()});
  }
  // d[2i] = a[2i + 1], d[2i + 1] = a[2i] (a fixed-pattern Gather: the x[j ^ 1] of the RoPE pairs)
  void vswap_pairs(Sub<float> d, Sub<float> a, std::string_view name = "vswap_pairs") {
    check_vec(d, name);
    check_same(d, a, name);
    if (d.cols % 2 != 0) throw Error("a2a3 " + std::string(name) + ": odd row width");
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; c += 2) {
          const float e = a(r, c), o = a(r, c + 1);
          d(r, c) = o;
          d(r, c + 1) = e;
        }
    issue(Pipe::vector, name, vector_cycles(d.size(), 4), {a.state()}, {d.state()});
  }
  // d[i] = d[i + 1] = a[i / 2] per row: widens a half-width row to interleaved pairs (Gather)
  void vdup_pairs(Sub<float> d, Sub<float> a, std::string_view name = "vdup_pairs") {
    check_vec(d, name);
    if (a.rows != d.rows || 2 * a.cols != d.cols)
      throw Error("a2a3 " + std::string(name) + ": operand is not half the width");
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = a(r, c / 2);
    issue(Pipe::vector, name, vector_cycles(d.size(), 4), {a.state()}, {d.state()});
  }
  // d[2i] = a[2i] * even, d[2i + 1] = a[2i + 1] * odd (Muls under an alternating mask: folds the
  // RoPE pair signs into an interleaved sin row)
  void vsign_pairs(Sub<float> d, Sub<float> a, float even, float odd,
                   std::string_view name = "vsign_pairs") {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = a(r, c) * (c % 2 == 0 ? even : odd);
    issue(Pipe::vector, name, vector_cycles(d.size(), 4), {a.state()}, {d.state()});
  }
  // Columns >= n of every row of d take `value` (Select with a column mask: the score tail).
  template <class T>
  void vfill_from(Sub<T> d, index_t n, T value, std::string_view name = "vfill_from") {
    check_vec(d, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = std::max<index_t>(n, 0); c < d.cols; ++c) d(r, c) = value;
    issue(Pipe::vector, name, vector_cycles(d.size(), sizeof(T)), {d.state()}, {d.state()});
  }
  // ---- sort (score, index) pairs
  // Pairs from a score row (CreateVecIndex + Compare/Select + the pair interleave, then a mask
  // count): column j of each row of `d` = (score j, j) for j < valid and a non-NaN score; a masked
  // column (j >= valid or NaN) becomes (-inf, j + cols), which sorts after every kept pair, and
  // count(r, 0) = the number of kept pairs of row r.
  void vmake_pairs(Sub<ScorePair> d, Sub<std::int32_t> count, Sub<float> score, index_t valid,
                   std::string_view name = "vmake_pairs") {
    check_vec(d, name);
    check_same(d, score, name);
    if (count.size() != d.rows) throw Error("a2a3 " + std::string(name) + ": one count per row");
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r) {
        std::int32_t n = 0;
        for (index_t c = 0; c < d.cols; ++c) {
          const float v = score(r, c);
          const bool keep = c < valid && v == v;
          d(r, c) =
              keep ? ScorePair{v, std::int32_t(c)}
                   : ScorePair{-std::numeric_limits<float>::infinity(), std::int32_t(c + d.cols)};
          n += keep;
        }
        count(r, 0) = n;
      }
    issue(Pipe::vector, name,
          vector_cycles(d.size(), sizeof(ScorePair)) + vector_cycles(d.size(), 4), {score.state()},
          {d.state(), count.state()});
  }
  // Sort32: every run of 32 pairs of each row sorted (descending score, ascending index).
  void vsort32(Sub<ScorePair> d, Sub<ScorePair> a, std::string_view name = "vsort32") {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r) {
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = a(r, c);
        for (index_t g = 0; g < d.cols; g += 32)
          std::sort(&d(r, g), &d(r, 0) + std::min(d.cols, g + 32), pair_before);
      }
    issue(Pipe::vector, name,
          arch_->vector_op_overhead_cycles + double(d.size()) * arch_->sort32_cycles_per_element,
          {a.state()}, {d.state()});
  }
  // MrgSort: merges groups of `ways` (<= 4) consecutive sorted runs of length `run` of each row and
  // keeps the first `keep` pairs of each merged group (the rest of that group in d is unchanged).
  void vmerge(Sub<ScorePair> d, Sub<ScorePair> a, index_t run, int ways, index_t keep,
              std::string_view name = "vmerge") {
    check_vec(d, name);
    check_same(d, a, name);
    if (ways < 2 || ways > 4) throw Error("a2a3 " + std::string(name) + ": 2..4 ways");
    index_t produced = 0;
    for (index_t g = 0; g < d.cols; g += run * ways)
      produced += std::min(std::min(d.cols, g + run * ways) - g, keep);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r) merge_row(&d(r, 0), &a(r, 0), d.cols, run, ways, keep);
    issue(Pipe::vector, name,
          arch_->vector_op_overhead_cycles +
              double(produced * d.rows) * arch_->merge_cycles_per_element,
          {a.state()}, {d.state()});
  }
  // d[j] = j < min(k, count(r, 0)) ? a[j].index + offset : -1 (GatherMask of the index lane +
  // Select; the count is read with one scalar GetValue per row)
  void vpair_indices(Sub<std::int32_t> d, Sub<ScorePair> a, index_t k, Sub<std::int32_t> count,
                     std::int32_t offset, std::string_view name = "vpair_indices") {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r) {
        const index_t kk = std::min<index_t>(k, count(r, 0));
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = c < kk ? a(r, c).index + offset : -1;
      }
    issue(Pipe::vector, name,
          vector_cycles(d.size(), sizeof(ScorePair)) + double(d.rows) * arch_->scalar_cycles_per_op,
          {a.state(), count.state()}, {d.state()});
  }

 private:
  static float max_nan(float x, float y) { return (x != x || y != y) ? x + y : (x < y ? y : x); }
  static float min_nan(float x, float y) { return (x != x || y != y) ? x + y : (y < x ? y : x); }

  template <class D, class S>
  static D convert(S v) {
    if constexpr (std::is_same_v<D, S>) {
      return v;
    } else if constexpr (std::is_same_v<D, bf16>) {
      return bf16(float(v));
    } else if constexpr (std::is_same_v<S, bf16>) {
      return D(v.to_float());
    } else if constexpr (std::is_floating_point_v<S> && std::is_integral_v<D>) {
      if (v != v) return D(0);
      const float lo = float(std::numeric_limits<D>::min()),
                  hi = float(std::numeric_limits<D>::max());
      const float r = std::nearbyint(float(v));
      return r <= lo   ? std::numeric_limits<D>::min()
             : r >= hi ? std::numeric_limits<D>::max()
                       : D(r);
    } else if constexpr (std::is_integral_v<S> && std::is_integral_v<D>) {
      return D(std::clamp<std::int64_t>(std::int64_t(v), std::numeric_limits<D>::min(),
                                        std::numeric_limits<D>::max()));
    } else {
      return D(v);
    }
  }

  template <class A, class B>
  static void check_same(const Sub<A>& d, const Sub<B>& a, std::string_view name) {
    if (a.rows != d.rows || a.cols != d.cols)
      throw Error("a2a3 " + std::string(name) + ": operand '" + std::string(a.name()) + "' is " +
                  std::to_string(a.rows) + "x" + std::to_string(a.cols) + ", destination '" +
                  std::string(d.name()) + "' " + std::to_string(d.rows) + "x" +
                  std::to_string(d.cols));
  }
  template <class T>
  void check_vec(const Sub<T>& d, std::string_view name) const {
    check_space(d.space());
    if (d.r0 < 0 || d.c0 < 0 || d.r0 + d.rows > d.tile.rows() || d.c0 + d.cols > d.tile.cols())
      throw Error("a2a3 " + std::string(name) + ": rectangle exceeds buffer '" +
                  std::string(d.name()) + "'");
  }
  static void check_broadcast(const Sub<float>& d, const Sub<float>& v, bool per_row,
                              std::string_view name) {
    if (v.size() != (per_row ? d.rows : d.cols))
      throw Error("a2a3 " + std::string(name) + ": broadcast operand '" + std::string(v.name()) +
                  "' has " + std::to_string(v.size()) + " values");
  }
  static float at(const Sub<float>& v, index_t i) { return v(i / v.cols, i % v.cols); }

  template <class Op>
  void binary(std::string_view name, Unit u, Sub<float> d, Sub<float> a, Sub<float> b, Op op) {
    check_vec(d, name);
    check_same(d, a, name);
    check_same(d, b, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = op(a(r, c), b(r, c));
    issue(Pipe::vector, name, vector_cycles(d.size(), 4, u), {a.state(), b.state()}, {d.state()});
  }
  template <class Op>
  void unary(std::string_view name, Unit u, Sub<float> d, Sub<float> a, Op op) {
    check_vec(d, name);
    check_same(d, a, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = op(a(r, c));
    issue(Pipe::vector, name, vector_cycles(d.size(), 4, u), {a.state()}, {d.state()});
  }
  template <class Op>
  void broadcast(std::string_view name, Unit u, bool per_row, Sub<float> d, Sub<float> a,
                 Sub<float> v, Op op) {
    check_vec(d, name);
    check_same(d, a, name);
    check_broadcast(d, v, per_row, name);
    if (functional_)
      for (index_t r = 0; r < d.rows; ++r)
        for (index_t c = 0; c < d.cols; ++c) d(r, c) = op(a(r, c), at(v, per_row ? r : c));
    issue(Pipe::vector, name, vector_cycles(d.size(), 4, u), {a.state(), v.state()}, {d.state()});
  }
  void reduce(std::string_view name, Sub<float> d, Sub<float> a, bool sum) {
    check_vec(d, name);
    if (d.size() != a.rows)
      throw Error("a2a3 " + std::string(name) + ": destination holds " + std::to_string(d.size()) +
                  " values for " + std::to_string(a.rows) + " rows");
    const index_t blk = index_t(arch_->vector_bytes_per_cycle / 4);
    if (functional_)
      for (index_t r = 0; r < a.rows; ++r) {
        float acc = 0.0f;
        for (index_t c0 = 0; c0 < a.cols; c0 += blk) {
          float part[64];
          index_t n = std::min(blk, a.cols - c0);
          for (index_t c = 0; c < n; ++c) part[c] = a(r, c0 + c);
          // Pairwise tree inside one 256-B block.
          while (n > 1) {
            const index_t h = (n + 1) / 2;
            for (index_t i = 0; i + h < n; ++i)
              part[i] = sum ? part[i] + part[i + h] : max_nan(part[i], part[i + h]);
            n = h;
          }
          acc = c0 == 0 ? part[0] : (sum ? acc + part[0] : max_nan(acc, part[0]));
        }
        d(r / d.cols, r % d.cols) = acc;
      }
    issue(Pipe::vector, name, reduce_cycles(a.rows, a.cols), {a.state()}, {d.state()});
  }
  static void merge_row(ScorePair* dst, const ScorePair* src, index_t n, index_t run, int ways,
                        index_t keep) {
    for (index_t g = 0; g < n; g += run * ways) {
      std::array<index_t, 4> pos{}, end{};
      for (int w = 0; w < ways; ++w) {
        pos[std::size_t(w)] = std::min(n, g + w * run);
        end[std::size_t(w)] = std::min(n, g + (w + 1) * run);
      }
      const index_t total = std::min(end[std::size_t(ways - 1)] - g, keep);
      for (index_t o = 0; o < total; ++o) {
        int best = -1;
        for (int w = 0; w < ways; ++w) {
          if (pos[std::size_t(w)] >= end[std::size_t(w)]) continue;
          if (best < 0 || pair_before(src[pos[std::size_t(w)]], src[pos[std::size_t(best)]]))
            best = w;
        }
        dst[g + o] = src[pos[std::size_t(best)]++];
      }
    }
  }
};

// Cross-core ring with `slot_num` slots from a producer core to a consumer core of one block.
// Slots live in the consumer's local memory (UB for cube->vector, L1 for vector->cube) and are
// allocated (and capacity-checked) when the ring is made. The transfer goes through the
// L2-resident workspace in GM (the a2a3 cores share no direct path): the producer's FIXPIPE
// (from L0C) or MTE3 (from UB) writes the slot's workspace, a cross-core flag tells the consumer,
// whose MTE2 copies it into the slot. Back-pressure: a slot is reused only after the consumer
// released it, and the producer's write waits for the consumer's last read of the slot.
template <class T>
class Ring {
 public:
  Ring(Core& producer, Core& consumer, std::string_view name, int slot_num, index_t rows,
       index_t cols)
      : prod_(&producer), cons_(&consumer), name_(name) {
    if (slot_num < 1) throw_arg("a2a3 Ring", "slot_num", slot_num, ">= 1");
    if (producer.role() == consumer.role())
      throw Error("a2a3 Ring '" + std::string(name) + "': connects a cube core and a vector core");
    const Space s = consumer.role() == Role::vector ? Space::ub : Space::l1;
    for (int i = 0; i < slot_num; ++i) {
      slots_.push_back(consumer.alloc<T>(s, name, rows, cols));
      ws_.push_back(std::make_unique<BufferState>());
    }
    state_.assign(std::size_t(slot_num), 0);
  }

  int slot_num() const { return int(slots_.size()); }

  // Pushes rows [r0, r0 + rows) of the producer's tile `src` (L0C or UB) into the next slot,
  // rows [0, rows) of it. Returns the slot index.
  int push(Tile<T> src, index_t r0, index_t rows, std::string_view name = "ring_push") {
    const int k = int(pushed_ % slots_.size());
    if (state_[std::size_t(k)] != 0)
      throw Error("a2a3 Ring '" + name_ + "': push into slot " + std::to_string(k) +
                  " before the consumer released it (slot_num " + std::to_string(slot_num()) +
                  "); this program order would deadlock on the chip");
    Tile<T>& dst = slots_[std::size_t(k)];
    if (r0 < 0 || r0 + rows > src.rows() || rows > dst.rows() || src.cols() != dst.cols())
      throw Error("a2a3 Ring '" + name_ + "': tile does not match the slot shape");
    if (prod_->functional())
      for (index_t r = 0; r < rows; ++r)
        std::memcpy(dst.row(r), src.row(r0 + r), sizeof(T) * std::size_t(dst.cols()));
    const ArchFacts& a = prod_->arch();
    const std::int64_t bytes = std::int64_t(sizeof(T)) * rows * dst.cols();
    BufferState& ws = *ws_[std::size_t(k)];
    const bool from_cube = src.space() == Space::l0c;
    const double rate = from_cube ? a.fixpipe_bytes_per_cycle : a.gm_port_bytes_per_cycle;
    const double l2_rate = a.l2_bytes_per_s / a.clock_hz;
    const double cyc = a.dma_issue_cycles + double(bytes) / std::min(rate, l2_rate);
    // Back-pressure: the producer waits for the consumer's release of this slot (its last read
    // of the previous tile in it), signalled by a cross-core flag.
    BufferState freed;
    if (pushed_ >= std::int64_t(slots_.size()))
      freed.ready = dst.state().read_end + a.cross_core_sync_cycles;
    prod_->issue(from_cube ? Pipe::fixpipe : Pipe::mte3, name, cyc, {&src.state(), &freed}, {&ws},
                 a.cross_core_sync_cycles);
    // Workspace -> slot on the consumer's MTE2.
    cons_->issue(Pipe::mte2, name, a.dma_issue_cycles + double(bytes) / l2_rate, {&ws},
                 {&dst.state()}, a.dma_latency_cycles * 0.5);
    (from_cube ? prod_->traffic().l0c_out : prod_->traffic().ub_out) += bytes;
    prod_->traffic().ring += bytes;
    cons_->traffic().ring += bytes;
    (cons_->role() == Role::vector ? cons_->traffic().ub_in : cons_->traffic().l1_in) += bytes;
    state_[std::size_t(k)] = 1;
    ++pushed_;
    return k;
  }

  // The oldest pushed, not yet popped slot (the consumer's view of it).
  Tile<T> pop() {
    if (popped_ >= pushed_)
      throw Error("a2a3 Ring '" + name_ + "': pop from an empty ring (nothing pushed)");
    const std::size_t k = std::size_t(popped_ % slots_.size());
    state_[k] = 2;
    ++popped_;
    return slots_[k];
  }
  // Releases the oldest popped slot (the consumer's last read of it has been issued).
  void release() {
    const std::size_t k = std::size_t(released_ % slots_.size());
    if (released_ >= popped_ || state_[k] != 2)
      throw Error("a2a3 Ring '" + name_ + "': release without a popped slot");
    state_[k] = 0;
    ++released_;
  }

 private:
  Core* prod_;
  Core* cons_;
  std::string name_;
  std::vector<Tile<T>> slots_;
  std::vector<std::unique_ptr<BufferState>> ws_;
  std::vector<int> state_;  // 0 free, 1 full, 2 held by the consumer
  std::int64_t pushed_ = 0, popped_ = 0, released_ = 0;
};

// The cores one block of a mixed launch runs on: 1 cube core + 2 vector cores.
struct MixedBlock {
  int index;  // block id in the grid
  CubeCore& cube;
  VectorCore& vec0;
  VectorCore& vec1;
  VectorCore& vec(int i) { return i == 0 ? vec0 : vec1; }
};
struct VectorBlock {
  int index;
  VectorCore& vec;
};
struct CubeBlock {
  int index;
  CubeCore& cube;
};

// Per-core peak occupancy (bytes) of one launch.
struct CorePeak {
  std::string core;
  std::array<std::int64_t, kLocalSpaces> peak{};
};

// Predicted cost of one launch (scope).
struct LaunchReport {
  std::string name;
  int blocks = 0;
  double core_us = 0;       // slowest core
  double hbm_bound_us = 0;  // GM bytes / HBM bandwidth
  double latency_us = 0;    // max(core_us, hbm_bound_us) + launch overhead
  std::string slowest_core;
  std::array<double, kPipes> busy_slowest_us{};       // per-pipe busy time on the slowest core
  std::array<double, kPipes> busy_max_us{};           // per-pipe max busy time over all cores
  std::array<std::int64_t, kLocalSpaces> peak_max{};  // max over cores of peak occupancy
  std::vector<CorePeak> peaks;                        // per used core
  Traffic traffic;
};

// Predicted cost of a kernel: its launches in sequence.
struct KernelReport {
  std::string name;
  std::vector<LaunchReport> launches;
  double latency_us() const {
    double s = 0;
    for (const auto& l : launches) s += l.latency_us;
    return s;
  }
  Traffic traffic() const {
    Traffic t;
    for (const auto& l : launches) t += l.traffic;
    return t;
  }
  std::array<double, kPipes> busy_slowest_us() const {
    std::array<double, kPipes> b{};
    for (const auto& l : launches)
      for (int p = 0; p < kPipes; ++p) b[std::size_t(p)] += l.busy_slowest_us[std::size_t(p)];
    return b;
  }
};

// One trace event (Chrome trace "X" event), microseconds from the start of the recording.
struct TraceEvent {
  std::string name;
  std::string core;
  std::string launch;
  Pipe pipe;
  double ts_us, dur_us;
};

// One launch on the recorded timeline (overhead included), microseconds.
struct LaunchSpan {
  std::string name;
  double ts_us, dur_us;
};

// The chip: 24 cube + 48 vector cores, launches, reports and the trace.
class Machine {
 public:
  explicit Machine(Executor* exec = nullptr, const ArchFacts& arch = kArch)
      : arch_(arch), exec_(exec) {
    for (int i = 0; i < arch_.cube_cores; ++i)
      cubes_.push_back(std::make_unique<CubeCore>(i, arch_));
    for (int i = 0; i < arch_.vector_cores(); ++i)
      vecs_.push_back(std::make_unique<VectorCore>(i, arch_));
  }

  const ArchFacts& arch() const { return arch_; }
  // Whether trace events are recorded (off by default: tests need not pay for them).
  void set_tracing(bool on) { tracing_ = on; }
  const std::vector<TraceEvent>& trace() const { return trace_; }
  const std::vector<LaunchSpan>& launch_spans() const { return spans_; }
  // Timing-only mode for the launches that follow (see Core::set_functional).
  void set_functional(bool on) {
    for (auto& c : cubes_) c->set_functional(on);
    for (auto& v : vecs_) v->set_functional(on);
  }

  // Starts a kernel; launches until end_kernel() are its scopes.
  void begin_kernel(std::string_view name) {
    current_ = KernelReport{std::string(name), {}};
    in_kernel_ = true;
  }
  KernelReport end_kernel() {
    in_kernel_ = false;
    return std::move(current_);
  }
  bool in_kernel() const { return in_kernel_; }
  // GM scratch for launch intermediates of kernels whose API takes no workspace (the chip's
  // device memory, not the engine's): grows on demand, valid until the next request.
  std::span<std::byte> gm_scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_ = Buffer<std::byte>(bytes);
    return {scratch_.data(), bytes};
  }

  // SPMD launch of `n_blocks` mixed blocks (1 AIC + 2 AIV each). Block u runs on cube core
  // u % 24 and vector cores 2(u % 24), 2(u % 24) + 1; blocks beyond one wave queue on the same
  // cores. fn(MixedBlock&) is the tile program of one block.
  template <class F>
  const LaunchReport& launch_mixed(std::string_view name, int n_blocks, F&& fn) {
    const int lanes = arch_.cube_cores;
    return launch(name, n_blocks, lanes, [&](int u) {
      const int c = u % lanes;
      MixedBlock blk{u, *cubes_[std::size_t(c)], *vecs_[std::size_t(2 * c)],
                     *vecs_[std::size_t(2 * c + 1)]};
      blk.cube.mark_used();
      blk.vec0.mark_used();
      blk.vec1.mark_used();
      fn(blk);
      blk.cube.end_block();
      blk.vec0.end_block();
      blk.vec1.end_block();
    });
  }
  // SPMD launch of vector-only blocks: block u on vector core u % 48.
  template <class F>
  const LaunchReport& launch_vector(std::string_view name, int n_blocks, F&& fn) {
    const int lanes = arch_.vector_cores();
    return launch(name, n_blocks, lanes, [&](int u) {
      VectorBlock blk{u, *vecs_[std::size_t(u % lanes)]};
      blk.vec.mark_used();
      fn(blk);
      blk.vec.end_block();
    });
  }
  // SPMD launch of cube-only blocks: block u on cube core u % 24.
  template <class F>
  const LaunchReport& launch_cube(std::string_view name, int n_blocks, F&& fn) {
    const int lanes = arch_.cube_cores;
    return launch(name, n_blocks, lanes, [&](int u) {
      CubeBlock blk{u, *cubes_[std::size_t(u % lanes)]};
      blk.cube.mark_used();
      fn(blk);
      blk.cube.end_block();
    });
  }

 private:
  template <class RunBlock>
  const LaunchReport& launch(std::string_view name, int n_blocks, int lanes, RunBlock&& run) {
    if (n_blocks < 1) throw_arg("a2a3 launch", "n_blocks", n_blocks, ">= 1");
    for (auto& c : cubes_) c->begin_launch();
    for (auto& v : vecs_) v->begin_launch();
    // Lane l runs blocks l, l + lanes, ... in order; lanes are independent.
    const int used_lanes = std::min(n_blocks, lanes);
    auto lane = [&](std::size_t l) {
      for (int u = int(l); u < n_blocks; u += lanes) run(u);
    };
    if (exec_)
      exec_->run(std::size_t(used_lanes), FunctionRef(lane));
    else
      for (int l = 0; l < used_lanes; ++l) lane(std::size_t(l));
    return finish(name, n_blocks);
  }

  const LaunchReport& finish(std::string_view name, int n_blocks) {
    LaunchReport r;
    r.name = std::string(name);
    r.blocks = n_blocks;
    double worst = -1;
    const Core* slow = nullptr;
    auto visit = [&](const Core& c) {
      if (!c.used()) return;
      r.traffic += c.traffic();
      const double f = c.finish_cycles();
      if (f > worst) {
        worst = f;
        slow = &c;
      }
      CorePeak cp{c.name(), {}};
      for (int s = 1; s < kLocalSpaces; ++s) {
        cp.peak[std::size_t(s)] = c.memory(Space(s)).peak();
        r.peak_max[std::size_t(s)] = std::max(r.peak_max[std::size_t(s)], cp.peak[std::size_t(s)]);
      }
      r.peaks.push_back(cp);
      for (int p = 0; p < kPipes; ++p)
        r.busy_max_us[std::size_t(p)] =
            std::max(r.busy_max_us[std::size_t(p)], arch_.cycles_to_us(c.busy(Pipe(p))));
    };
    for (auto& c : cubes_) visit(*c);
    for (auto& v : vecs_) visit(*v);
    r.core_us = arch_.cycles_to_us(std::max(worst, 0.0));
    r.hbm_bound_us = double(r.traffic.gm_total()) / arch_.hbm_bytes_per_s * 1e6;
    r.latency_us = std::max(r.core_us, r.hbm_bound_us) + arch_.launch_overhead_us;
    if (slow) {
      r.slowest_core = slow->name();
      for (int p = 0; p < kPipes; ++p)
        r.busy_slowest_us[std::size_t(p)] = arch_.cycles_to_us(slow->busy(Pipe(p)));
    }
    if (tracing_) {
      // The launch overhead precedes the launch's first op on the timeline.
      const double t0 = clock_us_ + arch_.launch_overhead_us;
      auto record = [&](const Core& c) {
        if (!c.used()) return;
        for (const auto& op : c.ops())
          trace_.push_back({std::string(op.name), c.name(), r.name, op.pipe,
                            t0 + arch_.cycles_to_us(op.start),
                            arch_.cycles_to_us(op.end - op.start)});
      };
      for (auto& c : cubes_) record(*c);
      for (auto& v : vecs_) record(*v);
      spans_.push_back({current_.name + "/" + r.name, clock_us_, r.latency_us});
    }
    clock_us_ += r.latency_us;
    current_.launches.push_back(std::move(r));
    return current_.launches.back();
  }

  ArchFacts arch_;
  Executor* exec_;
  std::vector<std::unique_ptr<CubeCore>> cubes_;
  std::vector<std::unique_ptr<VectorCore>> vecs_;
  KernelReport current_;
  Buffer<std::byte> scratch_;
  bool in_kernel_ = false;
  bool tracing_ = false;
  double clock_us_ = 0;
  std::vector<TraceEvent> trace_;
  std::vector<LaunchSpan> spans_;
};

}  // namespace tiledecode::a2a3
