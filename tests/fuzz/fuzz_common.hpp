#pragma once
// Helpers shared by the fuzz targets: a buffer with canary regions on both sides (a write
// outside the caller's view is caught even where AddressSanitizer cannot see it, e.g. inside a
// larger pool allocation), a checked abort that prints why, a "did it throw Error" probe and a
// counter-based filler for big arrays.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tiledecode/core/error.hpp"

namespace tdfuzz {

// Byte an output body starts filled with, so "never written" is detectable (Guarded::body_is).
inline constexpr unsigned char kFill = 0x5A;
// TDFUZZ_DUMP=1 (read by each target) prints every error message.
inline bool g_verbose = false;

// True iff `call` throws tiledecode::Error (any other exception propagates: a fuzz failure).
bool threw_error(auto&& call) {
  try {
    call();
  } catch (const tiledecode::Error& e) {
    if (g_verbose) std::fprintf(stderr, "  threw: %s\n", e.what());
    return true;
  }
  return false;
}

// Counter-based filler (splitmix64) so big arrays cost 8 bytes of fuzz input, not their size.
// The sequence is part of the committed corpora's meaning: do not change it.
struct Mix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float unit() { return float(next() >> 40) / float(1 << 24); }        // [0, 1)
  float sym() { return float(next() >> 40) / float(1 << 23) - 1.0f; }  // [-1, 1)
};

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
    // memcmp in chunks, not a byte loop: an instrumented byte loop costs one comparison hook per
    // byte (coverage_ignorelist.txt).
    unsigned char ref[256];
    std::memset(ref, fill, sizeof ref);
    const unsigned char* p = bytes_.data() + kCanary * sizeof(T);
    const std::size_t total = n_ * sizeof(T);
    for (std::size_t i = 0; i < total; i += sizeof ref)
      if (std::memcmp(p + i, ref, std::min(sizeof ref, total - i)) != 0) return false;
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
