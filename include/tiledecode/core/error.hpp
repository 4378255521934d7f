#pragma once
// Error type of the library. Every public entry point validates its arguments once, before the
// first write, and throws `tiledecode::Error` with a message that names the argument, the bad
// value and the allowed range. Hot loops after validation never throw.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tiledecode {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
inline std::string to_text(std::string_view s) {
  return std::string(s);
}
inline std::string to_text(const char* s) {
  return std::string(s);
}
inline std::string to_text(const std::string& s) {
  return s;
}
template <class T>
std::string to_text(const T& v) {
  return std::to_string(v);
}
}  // namespace detail

// "<where>: argument '<arg>' = <value> is out of range; allowed <range>"
template <class V>
[[noreturn]] inline void throw_arg(std::string_view where, std::string_view arg, const V& value,
                                   std::string_view allowed) {
  throw Error(std::string(where) + ": argument '" + std::string(arg) + "' = " +
              detail::to_text(value) + " is out of range; allowed " + std::string(allowed));
}

// The failure paths of the checks below, out of line and cold: the message is built only when a
// check fails, and the checks that validation runs every step stay a compare and a branch where
// they are inlined (GCC 12 also reported a false -Wrestrict in the string concatenation once it
// was inlined into a caller with known argument names).
namespace detail {
template <class V>
[[noreturn, gnu::cold, gnu::noinline]] void throw_range(std::string_view where,
                                                        std::string_view arg, V value, V lo, V hi) {
  throw_arg(where, arg, value, "[" + to_text(lo) + ", " + to_text(hi) + ")");
}
template <class V>
[[noreturn, gnu::cold, gnu::noinline]] void throw_not_equal(std::string_view where,
                                                            std::string_view arg, V value,
                                                            V expected) {
  throw_arg(where, arg, value, "exactly " + to_text(expected));
}
template <class V>
[[noreturn, gnu::cold, gnu::noinline]] void throw_below(std::string_view where,
                                                        std::string_view arg, V value, V lo) {
  throw_arg(where, arg, value, ">= " + to_text(lo));
}
}  // namespace detail

// Validates `lo <= value < hi` (half-open), naming the argument on failure.
template <class V>
inline void check_range(std::string_view where, std::string_view arg, V value, V lo, V hi) {
  if (value < lo || value >= hi) detail::throw_range(where, arg, value, lo, hi);
}

// Validates an exact size/shape relation, e.g. a view extent against the config.
template <class V>
inline void check_equal(std::string_view where, std::string_view arg, V value, V expected) {
  if (value != expected) detail::throw_not_equal(where, arg, value, expected);
}

// Validates `value >= lo`.
template <class V>
inline void check_at_least(std::string_view where, std::string_view arg, V value, V lo) {
  if (value < lo) detail::throw_below(where, arg, value, lo);
}

}  // namespace tiledecode
