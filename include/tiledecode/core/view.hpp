#pragma once
// Non-owning tensor views (pointer + shape + strides, in elements) and an owning 64-byte
// aligned buffer. A view is what every kernel takes: the engine owns the memory.
//
//   View<bf16, 2> kv(ptr, {T, 512});        // row-major by default
//   auto row = kv.row(t);                    // View<bf16, 1>, (512)
//   auto blk = kv.slice(0, 8, 16);           // rows 8..15
//
// `operator()` is unchecked (hot loops trust validated arguments); `at()` checks every index and
// throws tiledecode::Error — golden references and tests use it. Defining
// TILEDECODE_CHECKED_VIEWS makes `operator()` check as well (debug builds).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "tiledecode/core/error.hpp"

namespace tiledecode {

using index_t = std::int64_t;

template <class T, std::size_t Rank>
class View {
  static_assert(Rank >= 1, "View needs at least one dimension");

 public:
  using element_type = T;
  using Extents = std::array<index_t, Rank>;

  constexpr View() = default;
  // Row-major view over `data` with the given shape.
  constexpr View(T* data, const Extents& shape) : data_(data), shape_(shape) {
    index_t s = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      stride_[d] = s;
      s *= shape_[d];
    }
  }
  constexpr View(T* data, const Extents& shape, const Extents& stride)
      : data_(data), shape_(shape), stride_(stride) {}

  // A view of const T from a view of T.
  template <class U>
  requires(std::is_same_v<const U, T> &&
           !std::is_same_v<U, T>) constexpr View(const View<U, Rank>& o)
      : data_(o.data()), shape_(o.shape()), stride_(o.strides()) {}

  constexpr T* data() const { return data_; }
  constexpr const Extents& shape() const { return shape_; }
  constexpr const Extents& strides() const { return stride_; }
  constexpr index_t extent(std::size_t d) const { return shape_[d]; }
  constexpr index_t stride(std::size_t d) const { return stride_[d]; }
  constexpr index_t size() const {
    index_t n = 1;
    for (auto e : shape_) n *= e;
    return n;
  }
  constexpr bool empty() const { return data_ == nullptr || size() == 0; }
  constexpr bool is_contiguous() const {
    index_t s = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      if (shape_[d] != 1 && stride_[d] != s) return false;
      s *= shape_[d];
    }
    return true;
  }

  template <class... I>
  requires(sizeof...(I) == Rank) constexpr T& operator()(I... idx) const {
#ifdef TILEDECODE_CHECKED_VIEWS
    return at(idx...);
#else
    return data_[offset(idx...)];
#endif
  }

  // Bounds-checked element access.
  template <class... I>
  requires(sizeof...(I) == Rank) T& at(I... idx) const {
    const std::array<index_t, Rank> i{static_cast<index_t>(idx)...};
    for (std::size_t d = 0; d < Rank; ++d) {
      if (i[d] < 0 || i[d] >= shape_[d]) {
        throw Error("View::at: index " + std::to_string(i[d]) + " of dimension " +
                    std::to_string(d) + " is out of range; allowed [0, " +
                    std::to_string(shape_[d]) + ")");
      }
    }
    return data_[offset(idx...)];
  }

  // Drop the first dimension: element `i` of dimension 0.
  constexpr auto row(index_t i) const requires(Rank >= 2) {
    std::array<index_t, Rank - 1> sh{}, st{};
    for (std::size_t d = 1; d < Rank; ++d) {
      sh[d - 1] = shape_[d];
      st[d - 1] = stride_[d];
    }
    return View<T, Rank - 1>(data_ + i * stride_[0], sh, st);
  }

  // Elements [begin, end) of dimension `dim`.
  constexpr View slice(std::size_t dim, index_t begin, index_t end) const {
    View r = *this;
    r.data_ = data_ + begin * stride_[dim];
    r.shape_[dim] = end - begin;
    return r;
  }

  // Same memory seen with another row-major shape; requires a contiguous view.
  template <std::size_t R2>
  View<T, R2> reshape(const std::array<index_t, R2>& shape) const {
    index_t n = 1;
    for (auto e : shape) n *= e;
    if (!is_contiguous() || n != size()) {
      throw Error("View::reshape: element count " + std::to_string(n) +
                  " does not match a contiguous view of " + std::to_string(size()));
    }
    return View<T, R2>(data_, shape);
  }

  // A 1-D contiguous view as a std::span.
  constexpr std::span<T> span() const requires(Rank == 1) {
    return std::span<T>(data_, static_cast<std::size_t>(shape_[0]));
  }

 private:
  template <class... I>
  constexpr index_t offset(I... idx) const {
    const std::array<index_t, Rank> i{static_cast<index_t>(idx)...};
    index_t off = 0;
    for (std::size_t d = 0; d < Rank; ++d) off += i[d] * stride_[d];
    return off;
  }

  T* data_ = nullptr;
  Extents shape_{};
  Extents stride_{};
};

template <class T, std::size_t Rank>
using ConstView = View<const T, Rank>;

namespace detail {
// Asks for transparent huge pages before the first touch (Linux; advisory, ignored where THP is
// off): streaming 100+ MB per layer through 4 KB pages costs a page walk per 4 KB once other
// work has evicted the page tables from the caches.
inline void advise_huge_pages([[maybe_unused]] void* p, [[maybe_unused]] std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  ::madvise(p, bytes, MADV_HUGEPAGE);
#endif
}
}  // namespace detail

// Owning, zero-initialised, 64-byte aligned storage of `n` elements of a trivial type (2 MiB
// aligned, with huge pages requested, from 2 MiB on).
template <class T>
class Buffer {
  static_assert(std::is_trivially_copyable_v<T>, "Buffer holds trivially copyable types");

 public:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;

  Buffer() = default;
  explicit Buffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    const std::size_t bytes = rounded_bytes(n);
    data_ = static_cast<T*>(::operator new (bytes, std::align_val_t{alignment(n)}));
    if (bytes >= kHugePage) detail::advise_huge_pages(data_, bytes);
    std::memset(static_cast<void*>(data_), 0, bytes);
  }
  Buffer(const Buffer& o) : Buffer(o.n_) {
    if (n_) std::memcpy(static_cast<void*>(data_), o.data_, n_ * sizeof(T));
  }
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  Buffer& operator=(Buffer o) noexcept {
    std::swap(data_, o.data_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~Buffer() {
    if (data_) ::operator delete (data_, std::align_val_t{alignment(n_)});
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + n_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + n_; }
  std::span<T> span() { return {data_, n_}; }
  std::span<const T> span() const { return {data_, n_}; }

  // Row-major view of the whole buffer with the given shape (element counts must match).
  template <std::size_t Rank>
  View<T, Rank> view(const std::array<index_t, Rank>& shape) {
    check_count(shape);
    return View<T, Rank>(data_, shape);
  }
  template <std::size_t Rank>
  View<const T, Rank> view(const std::array<index_t, Rank>& shape) const {
    check_count(shape);
    return View<const T, Rank>(data_, shape);
  }

 private:
  static std::size_t rounded_bytes(std::size_t n) {
    return (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
  }
  // Buffers of at least one huge page start on a huge-page boundary (see the constructor).
  static std::size_t alignment(std::size_t n) {
    return rounded_bytes(n) >= kHugePage ? kHugePage : kAlign;
  }

  template <std::size_t Rank>
  void check_count(const std::array<index_t, Rank>& shape) const {
    index_t n = 1;
    for (auto e : shape) n *= e;
    if (n != static_cast<index_t>(n_)) {
      throw Error("Buffer::view: shape holds " + std::to_string(n) + " elements, buffer has " +
                  std::to_string(n_));
    }
  }

  T* data_ = nullptr;
  std::size_t n_ = 0;
};

// An owning tensor: a Buffer plus its row-major shape. Convenient for tests, examples and
// workspaces; kernels take Views.
template <class T, std::size_t Rank>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(const std::array<index_t, Rank>& shape) : shape_(shape), buf_(count(shape)) {}

  View<T, Rank> view() { return View<T, Rank>(buf_.data(), shape_); }
  View<const T, Rank> view() const { return View<const T, Rank>(buf_.data(), shape_); }
  operator View<T, Rank>() { return view(); }
  operator View<const T, Rank>() const { return view(); }

  T* data() { return buf_.data(); }
  const T* data() const { return buf_.data(); }
  std::size_t size() const { return buf_.size(); }
  const std::array<index_t, Rank>& shape() const { return shape_; }
  index_t extent(std::size_t d) const { return shape_[d]; }
  std::span<T> flat() { return buf_.span(); }
  std::span<const T> flat() const { return buf_.span(); }

 private:
  static std::size_t count(const std::array<index_t, Rank>& shape) {
    index_t n = 1;
    for (auto e : shape) {
      if (e < 0) throw Error("Tensor: negative extent " + std::to_string(e));
      n *= e;
    }
    return static_cast<std::size_t>(n);
  }
  std::array<index_t, Rank> shape_{};
  Buffer<T> buf_;
};

}  // namespace tiledecode
