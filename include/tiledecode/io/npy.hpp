#pragma once
// Minimal NumPy .npy writer (format version 1.0), standard library only, for dumping decode-step
// tensors so they can be lined up against a PyTorch reference:
//   np.load("q.npy")  →  ndarray with the view's shape, C order, little-endian.
// BF16 has no NumPy dtype: it is written as '<u2' (the raw bits); read it back with
//   torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)   or   (a.astype(np.uint32) <<
//   16).view(np.float32)
// Header: magic "\x93NUMPY", version 1.0, little-endian uint16 header length, then the Python
// dict literal padded with spaces and a final '\n' so data starts on a 64-byte boundary.

#include <array>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::io {

// The NumPy dtype string of an element type ('<u2' for bf16) and the name a manifest should
// report ("bfloat16" for bf16, else the NumPy name).
template <class T>
constexpr std::string_view npy_descr() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bf16>)
    return "<u2";
  else if constexpr (std::is_same_v<U, float>)
    return "<f4";
  else if constexpr (std::is_same_v<U, double>)
    return "<f8";
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return "|i1";
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return "|u1";
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return "<i4";
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return "<i8";
  else
    static_assert(sizeof(U) == 0, "no .npy dtype for this element type");
}

template <class T>
constexpr std::string_view dtype_name() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bf16>)
    return "bfloat16";
  else if constexpr (std::is_same_v<U, float>)
    return "float32";
  else if constexpr (std::is_same_v<U, double>)
    return "float64";
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return "int8";
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return "uint8";
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return "int32";
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return "int64";
  else
    static_assert(sizeof(U) == 0, "no dtype name for this element type");
}

// The complete .npy header (magic .. padding) for a C-order array.
inline std::string npy_header(std::string_view descr, const std::vector<index_t>& shape) {
  std::string dict = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  const std::size_t prefix = 10;  // magic (6) + version (2) + length (2)
  std::size_t total = prefix + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict += '\n';
  if (dict.size() > 65535) throw Error("npy_header: header longer than format 1.0 allows");
  std::string h = "\x93NUMPY";
  h += char(1);
  h += char(0);
  h += char(dict.size() & 0xff);
  h += char((dict.size() >> 8) & 0xff);
  return h + dict;
}

// Writes `v` (any strides; elements are written in C order) to `path`. Throws on I/O failure.
template <class T, std::size_t R>
void write_npy(const std::string& path, View<T, R> v) {
  std::vector<index_t> shape(v.shape().begin(), v.shape().end());
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error("write_npy: cannot open '" + path + "' for writing");
  const std::string h = npy_header(npy_descr<T>(), shape);
  f.write(h.data(), std::streamsize(h.size()));
  if (v.is_contiguous()) {
    f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
  } else {
    std::array<index_t, R> i{};
    for (index_t n = 0; n < v.size(); ++n) {
      index_t off = 0;
      for (std::size_t d = 0; d < R; ++d) off += i[d] * v.stride(d);
      f.write(reinterpret_cast<const char*>(v.data() + off), sizeof(T));
      for (std::size_t d = R; d-- > 0;) {
        if (++i[d] < v.extent(d)) break;
        i[d] = 0;
      }
    }
  }
  if (!f) throw Error("write_npy: write to '" + path + "' failed");
}

}  // namespace tiledecode::io
