#pragma once
// Helpers shared by the fuzz targets: a buffer with canary regions on both sides (a write
// outside the caller's view is caught even where AddressSanitizer cannot see it, e.g. inside a
// larger pool allocation), and a checked abort that prints why.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace tdfuzz {

[[noreturn]] inline void fail(const char* what, long long a = 0, long long b = 0) {
  std::fprintf(stderr, "fuzz invariant violated: %s (%lld, %lld)\n", what, a, b);
  std::abort();
}

#define TDFUZZ_CHECK(cond, ...)                                    \
  do {                                                             \
    if (!(cond)) ::tdfuzz::fail(#cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// `n` elements of T with `kCanary` elements of pattern 0xA5 before and after. The body starts
// filled with byte `fill` so a test can tell "never written" from "written".
template <class T>
class Guarded {
 public:
  static constexpr std::size_t kCanary = 64;
  static constexpr unsigned char kPattern = 0xA5;

  explicit Guarded(std::size_t n, unsigned char fill = 0x5A)
      : n_(n), bytes_((n + 2 * kCanary) * sizeof(T)) {
    std::memset(bytes_.data(), kPattern, bytes_.size());
    std::memset(body_bytes(), fill, n_ * sizeof(T));
  }
  T* data() { return reinterpret_cast<T*>(body_bytes()); }
  std::size_t size() const { return n_; }
  T& operator[](std::size_t i) { return data()[i]; }

  bool canaries_intact() const {
    const std::size_t c = kCanary * sizeof(T);
    for (std::size_t i = 0; i < c; ++i) {
      if (bytes_[i] != kPattern || bytes_[bytes_.size() - 1 - i] != kPattern) return false;
    }
    return true;
  }
  // True if every byte of the body still holds `fill`.
  bool body_is(unsigned char fill) const {
    const unsigned char* p = bytes_.data() + kCanary * sizeof(T);
    for (std::size_t i = 0; i < n_ * sizeof(T); ++i)
      if (p[i] != fill) return false;
    return true;
  }
  std::vector<unsigned char> snapshot() const { return bytes_; }
  bool same_as(const std::vector<unsigned char>& s) const { return s == bytes_; }

 private:
  unsigned char* body_bytes() { return bytes_.data() + kCanary * sizeof(T); }
  std::size_t n_;
  // operator new aligns to 16 bytes; kernels must not assume more (they use unaligned loads).
  std::vector<unsigned char> bytes_;
};

}  // namespace tdfuzz
