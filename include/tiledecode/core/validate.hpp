#pragma once
// Argument checks of the public entry points (validate everything once, before the first write).
// Every check builds its message only on failure, so validation on the valid path never allocates
// (a decode step validates every argument of every kernel every step).
//
//   check_view(where, "q", q)                      every extent >= 0, data present if non-empty
//   check_extents(where, "q", q, {T, H, 512})      exact extents (-1 = any) + check_view
//   check_inner_stride(where, "q", q)              the last dimension is contiguous
//   check_finite(where, "attn_sink", sink)         every element finite

#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>

#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode {

namespace detail {
inline std::string dim_name(std::string_view arg, std::string_view what, std::size_t d) {
  return std::string(arg) + "." + std::string(what) + "(" + std::to_string(d) + ")";
}
}  // namespace detail

// "arg[i]" / "arg[i,j]": the name of one element in an error message (build it on failure only).
inline std::string nth_name(std::string_view arg, index_t i) {
  return std::string(arg) + "[" + std::to_string(i) + "]";
}
inline std::string nth_name(std::string_view arg, index_t i, index_t j) {
  return std::string(arg) + "[" + std::to_string(i) + "," + std::to_string(j) + "]";
}

// Every extent >= 0 (a negative extent would make sizes and pointer offsets meaningless) and a
// data pointer when the view holds elements.
template <class T, std::size_t R>
void check_view(std::string_view where, std::string_view arg, const View<T, R>& v) {
  for (std::size_t d = 0; d < R; ++d)
    if (v.extent(d) < 0) throw_arg(where, detail::dim_name(arg, "extent", d), v.extent(d), ">= 0");
  if (v.data() == nullptr && v.size() > 0)
    throw_arg(where, arg, "a null pointer", "a view with data");
}

// Exact extents; -1 in `want` accepts any extent of that dimension.
template <class T, std::size_t R>
void check_extents(std::string_view where, std::string_view arg, const View<T, R>& v,
                   const std::array<index_t, R>& want) {
  check_view(where, arg, v);
  for (std::size_t d = 0; d < R; ++d)
    if (want[d] >= 0 && v.extent(d) != want[d])
      throw_arg(where, detail::dim_name(arg, "extent", d), v.extent(d),
                "exactly " + std::to_string(want[d]));
}

// The last dimension has unit stride (rows are read as arrays).
template <class T, std::size_t R>
void check_inner_stride(std::string_view where, std::string_view arg, const View<T, R>& v) {
  if (v.extent(R - 1) > 1 && v.stride(R - 1) != 1)
    throw_arg(where, detail::dim_name(arg, "stride", R - 1), v.stride(R - 1),
              "exactly 1 (contiguous rows)");
}

// Extents + unit inner stride: the usual shape of a row-major operand.
template <class T, std::size_t R>
void check_rows(std::string_view where, std::string_view arg, const View<T, R>& v,
                const std::array<index_t, R>& want) {
  check_extents(where, arg, v, want);
  check_inner_stride(where, arg, v);
}

// A view that must hold elements (a family's required weights and pools).
template <class T, std::size_t R>
void check_present(std::string_view where, std::string_view arg, const View<T, R>& v) {
  check_view(where, arg, v);
  if (v.size() == 0) throw_arg(where, arg, "an empty view", "a view with elements");
}

// Every element of a 1-D view is finite.
template <class T>
void check_finite(std::string_view where, std::string_view arg, const View<T, 1>& v) {
  for (index_t i = 0; i < v.extent(0); ++i)
    if (!std::isfinite(double(v(i))))
      throw_arg(where, nth_name(arg, i), double(v(i)), "a finite value");
}

// Every element of a 1-D or 2-D view is >= 0 (NaN and negative values rejected, +Inf allowed),
// `want` naming what makes it: the rounding checks' weight-norm bounds (an infinite one trusts
// nothing of its row).
template <class T>
void check_nonnegative(std::string_view where, std::string_view arg, const View<T, 1>& v,
                       std::string_view want) {
  for (index_t i = 0; i < v.extent(0); ++i)
    if (!(v(i) >= T(0))) throw_arg(where, nth_name(arg, i), v(i), want);
}
template <class T>
void check_nonnegative(std::string_view where, std::string_view arg, const View<T, 2>& v,
                       std::string_view want) {
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j)
      if (!(v(i, j) >= T(0))) throw_arg(where, nth_name(arg, i, j), v(i, j), want);
}

}  // namespace tiledecode
