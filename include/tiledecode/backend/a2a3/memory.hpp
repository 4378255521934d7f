#pragma once
// Memory spaces of the a2a3 model as types, with capacity checks.
//
//   GM   global memory (HBM, cached by the shared L2); kernels see it through plain views.
//   L1   cube core staging buffer (512 KiB)        L0A / L0B  cube operand buffers (64 KiB each)
//   L0C  cube accumulator buffer (128 KiB)         UB         vector core unified buffer (192 KiB)
//
// Two levels of checking, as in PTO-ISA's buffer-limit header:
//  * compile time, where shapes are static: `StaticTile<T, Space, Rows, Cols>` refuses a tile
//    larger than its space, and `fits_v<Space, Tiles...>` / `static_bytes_v` let a schedule
//    `static_assert` that a whole set of buffers (e.g. a ring's slots beside an epilogue) fits;
//  * plan time otherwise: `LocalMemory::alloc` throws tiledecode::Error naming the core, the
//    space, the buffer, its need, what is already in use and the capacity.
// Every local buffer is rounded up to the 32-byte block of the local memories (arch.hpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>

#include "tiledecode/backend/a2a3/arch.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::a2a3 {

enum class Space : std::uint8_t { gm = 0, l1, l0a, l0b, l0c, ub };
inline constexpr int kLocalSpaces = 6;  // indexable by Space (gm slot unused)

constexpr std::string_view space_name(Space s) {
  switch (s) {
    case Space::gm:
      return "GM";
    case Space::l1:
      return "L1";
    case Space::l0a:
      return "L0A";
    case Space::l0b:
      return "L0B";
    case Space::l0c:
      return "L0C";
    case Space::ub:
      return "UB";
  }
  return "?";
}

// Capacity of one core's instance of a local space (GM: the model does not bound it).
constexpr std::int64_t capacity(Space s, const ArchFacts& a = kArch) {
  switch (s) {
    case Space::gm:
      return INT64_MAX;
    case Space::l1:
      return a.l1_bytes;
    case Space::l0a:
      return a.l0a_bytes;
    case Space::l0b:
      return a.l0b_bytes;
    case Space::l0c:
      return a.l0c_bytes;
    case Space::ub:
      return a.ub_bytes;
  }
  return 0;
}

constexpr std::int64_t align_up(std::int64_t bytes, std::int64_t align = kArch.local_align) {
  return (bytes + align - 1) / align * align;
}

// A tile whose shape is known at compile time: (Rows, Cols) elements of T in space S.
template <class T, Space S, index_t Rows, index_t Cols>
struct StaticTile {
  static_assert(S != Space::gm, "StaticTile describes a local buffer; GM tensors are views");
  static_assert(Rows > 0 && Cols > 0, "StaticTile needs a positive shape");
  using element_type = T;
  static constexpr Space space = S;
  static constexpr index_t rows = Rows;
  static constexpr index_t cols = Cols;
  static constexpr std::int64_t bytes = align_up(std::int64_t(sizeof(T)) * Rows * Cols);
  static_assert(bytes <= capacity(S), "StaticTile does not fit its memory space");
};

// `Slots` copies of a static tile (a ring's slots, a double buffer).
template <class Tile, int Slots>
struct Replicated {
  static_assert(Slots > 0);
  static constexpr Space space = Tile::space;
  static constexpr std::int64_t bytes = Tile::bytes * Slots;
};

template <Space S, class... Tiles>
inline constexpr std::int64_t static_bytes_v = ((Tiles::space == S ? Tiles::bytes : 0) + ... + 0);

// True iff the tiles of space S among `Tiles` fit one core's instance of S together.
template <Space S, class... Tiles>
inline constexpr bool fits_v = static_bytes_v<S, Tiles...> <= capacity(S);

// Timing state of one local buffer, used by the cost model to derive the dependencies of the
// ops that read and write it (the set_flag / wait_flag a real lowering would insert).
struct BufferState {
  double ready = 0;      // cycle at which the last write is complete (+ sync latency)
  double read_end = 0;   // latest end of a read since (and including) the last write
  int writer_pipe = -1;  // pipe of the last write (a cross-pipe dependency pays a pipe sync)
};

// A buffer in a local space: (rows, cols) row-major elements of T. Non-owning: the storage is
// the core's arena, live until the core's memory is reset at the end of a block.
template <class T>
class Tile {
 public:
  Tile() = default;
  Tile(T* data, index_t rows, index_t cols, Space space, BufferState* state, std::string_view name)
      : data_(data), rows_(rows), cols_(cols), space_(space), state_(state), name_(name) {}

  T* data() const { return data_; }
  index_t rows() const { return rows_; }
  index_t cols() const { return cols_; }
  index_t size() const { return rows_ * cols_; }
  std::int64_t bytes() const { return std::int64_t(sizeof(T)) * size(); }
  Space space() const { return space_; }
  BufferState& state() const { return *state_; }
  std::string_view name() const { return name_; }
  T& operator()(index_t r, index_t c) const { return data_[r * cols_ + c]; }
  T* row(index_t r) const { return data_ + r * cols_; }
  View<T, 2> view() const { return View<T, 2>(data_, {rows_, cols_}); }

 private:
  T* data_ = nullptr;
  index_t rows_ = 0, cols_ = 0;
  Space space_ = Space::ub;
  BufferState* state_ = nullptr;
  std::string_view name_;
};

// A rectangle of a local tile: rows [r0, r0 + rows) x columns [c0, c0 + cols). The operand type of
// the vector instructions (machine.hpp); it shares the tile's dependency state, so an instruction
// on part of a buffer orders against every other access to that buffer.
template <class T>
struct Sub {
  Tile<T> tile;
  index_t r0 = 0, c0 = 0, rows = 0, cols = 0;

  Sub() = default;
  Sub(Tile<T> t)  // NOLINT: a whole tile is a rectangle
      : tile(t), rows(t.rows()), cols(t.cols()) {}
  Sub(Tile<T> t, index_t row0, index_t n_rows, index_t col0, index_t n_cols)
      : tile(t), r0(row0), c0(col0), rows(n_rows), cols(n_cols) {}
  T& operator()(index_t r, index_t c) const { return tile(r0 + r, c0 + c); }
  index_t size() const { return rows * cols; }
  Space space() const { return tile.space(); }
  BufferState* state() const { return &tile.state(); }
  std::string_view name() const { return tile.name(); }
};

// Rows [r0, r0 + n) of a tile (all columns), or a rectangle.
template <class T>
Sub<T> rows_of(Tile<T> t, index_t r0, index_t n) {
  return Sub<T>(t, r0, n, 0, t.cols());
}
template <class T>
Sub<T> part(Tile<T> t, index_t r0, index_t n_rows, index_t c0, index_t n_cols) {
  return Sub<T>(t, r0, n_rows, c0, n_cols);
}

// One core's instance of one local space: a bump allocator over an arena of the space's capacity
// with plan-time capacity checks and a peak-occupancy counter.
class LocalMemory {
 public:
  LocalMemory() = default;
  LocalMemory(Space space, std::int64_t capacity_bytes, std::string core_name)
      : space_(space),
        cap_(capacity_bytes),
        core_(std::move(core_name)),
        arena_(std::make_unique<std::byte[]>(static_cast<std::size_t>(capacity_bytes))) {}

  // Allocates a (rows, cols) tile of T named `name` (a string literal or other storage that
  // outlives the block). Throws if the space cannot hold it.
  template <class T>
  Tile<T> alloc(std::string_view name, index_t rows, index_t cols) {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::int64_t need = align_up(std::int64_t(sizeof(T)) * rows * cols);
    if (rows <= 0 || cols <= 0 || used_ + need > cap_) {
      throw Error("a2a3 plan: " + core_ + " " + std::string(space_name(space_)) + ": buffer '" +
                  std::string(name) + "' needs " + std::to_string(need) + " bytes, " +
                  std::to_string(used_) + " already in use, capacity " + std::to_string(cap_) +
                  " bytes");
    }
    T* p = reinterpret_cast<T*>(arena_.get() + used_);
    used_ += need;
    if (used_ > peak_) peak_ = used_;
    states_.emplace_back();
    return Tile<T>(p, rows, cols, space_, &states_.back(), name);
  }

  std::int64_t used() const { return used_; }
  std::int64_t peak() const { return peak_; }
  std::int64_t capacity_bytes() const { return cap_; }
  // Frees every buffer (end of a block); the peak is kept for the launch report.
  void reset() {
    used_ = 0;
    states_.clear();
  }
  void reset_peak() { peak_ = 0; }

 private:
  Space space_ = Space::ub;
  std::int64_t cap_ = 0, used_ = 0, peak_ = 0;
  std::string core_;
  std::unique_ptr<std::byte[]> arena_;
  std::deque<BufferState> states_;  // deque: stable addresses for the tiles' state pointers
};

}  // namespace tiledecode::a2a3
