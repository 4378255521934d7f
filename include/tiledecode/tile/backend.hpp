#pragma once
// How a tile program finds a backend's implementation of its ops.
//
// A kernel family (sparse attention, the output projection, ...) is ONE tile program, a template
// over a backend type B (cpu::Cpu<Isa> or a2a3::A2a3). The program names its ops through
//   using Ops = ops_for<Family, B>;
// and each backend implements them by specialising `backend_ops<Family, B>` in its own folder
// (backend/cpu/<family>.hpp, backend/a2a3/<family>.hpp). The primary template is declared and never
// defined (the CuTe habit: what no backend implements is refused at compile time), so
// `implements<Family, B>` tells a test table at compile time whether a backend has a family, and a
// program instantiated with a backend that lacks it fails with the message below instead of at
// run time.

#include <type_traits>

namespace tiledecode {

template <class Family, class Backend>
struct backend_ops;  // specialised per backend; never defined for a pair that has no implementation

template <class Family, class Backend>
concept implements = requires {
  sizeof(backend_ops<Family, std::remove_cvref_t<Backend>>);
};

namespace detail {
template <class Family, class Backend>
struct ops_for_check {
  static_assert(implements<Family, Backend>,
                "this backend has no implementation of this kernel family: include "
                "tiledecode/backend/<backend>/<family>.hpp before instantiating the program");
  using type = backend_ops<Family, std::remove_cvref_t<Backend>>;
};
}  // namespace detail

template <class Family, class Backend>
using ops_for = typename detail::ops_for_check<Family, std::remove_cvref_t<Backend>>::type;

}  // namespace tiledecode
