// Numerics policy (docs/security.md, "Numerics policy"): NaN, ±Inf and FP32 overflow behave the
// same on every CPU tier (scalar, avx2, avx2_vnni where the CPU has it) and as documented against
// the golden references, for every kernel family: sparse attention, compressor pooling (main and
// indexer inner), indexer query / weights / score / top-k, Q8 (q-latent, o-proj activations,
// indexer query, inner compressor), output projection, qkv projection, RMSNorm, hc_pre / hc_post.
//
// Each test injects NaN / +Inf / -Inf / huge finite values into one input and checks
//   * the policy's prediction of which outputs are NaN / Inf / finite (written out per test),
//   * tier against tier: bit-for-bit (NaN == NaN, payloads unspecified) where the tiers are
//     bit-identical on finite data (INT8 paths, Q8, RMSNorm, hc_post, qkv, indexer), the same
//     NaN / ±Inf / finite class per element elsewhere (FP32 kernels whose exp or summation order
//     differs: sparse attention, compressors, hc_pre, o-proj scalar vs avx2),
//   * golden: the same class per element, except the documented FP32-overflow differences, which
//     have their own tests (names ending in Fp32Overflow...).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "common/sparse_attn_fixture.hpp"
#include "tiledecode/backend/cpu/bf16_exact.hpp"
#include "tiledecode/backend/cpu/bf16_rounded.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/quant.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/golden/compressor.hpp"
#include "tiledecode/golden/hyper_connection.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/golden/output_projection.hpp"
#include "tiledecode/golden/qkv_projection.hpp"
#include "tiledecode/golden/rmsnorm.hpp"
#include "tiledecode/golden/sparse_attention.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace td = tiledecode;
namespace kn = tiledecode::kernels;
using td::bf16;
using td::index_t;
using td::LayerKind;
using td::cpu::Isa;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Every tier this CPU runs: scalar, avx2, avx2_vnni.
std::vector<Isa> tiers() {
  return td::cpu::supported_isas();
}
std::string name(Isa isa) {
  return std::string(td::cpu::to_string(isa));
}

// ---------------------------------------------------------------------------------------------
// Comparators.

// 'n' NaN, '+' +Inf, '-' -Inf, 'f' finite.
char cls(float v) {
  return std::isnan(v) ? 'n' : (std::isinf(v) ? (v > 0 ? '+' : '-') : 'f');
}

template <class T>
float as_float(T v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return v.to_float();
  } else {
    return float(v);
  }
}
template <class T, std::size_t R>
std::vector<float> floats(const td::Tensor<T, R>& t) {
  std::vector<float> r(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) r[i] = as_float(t.data()[i]);
  return r;
}

// Same NaN / +Inf / -Inf / finite class at every index.
testing::AssertionResult same_classes(const std::vector<float>& a, const std::vector<float>& e) {
  if (a.size() != e.size()) return testing::AssertionFailure() << "sizes differ";
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (cls(a[i]) != cls(e[i]) && bad++ == 0) first = i;
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << bad << "/" << a.size() << " classes differ; first at "
                                     << first << ": " << a[first] << " vs " << e[first];
}

// Bit-identical, except that any two NaNs are equal (payload and sign are unspecified).
testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& e) {
  if (a.size() != e.size()) return testing::AssertionFailure() << "sizes differ";
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool same = (std::isnan(a[i]) && std::isnan(e[i])) ||
                      std::bit_cast<std::uint32_t>(a[i]) == std::bit_cast<std::uint32_t>(e[i]);
    if (!same && bad++ == 0) first = i;
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << bad << "/" << a.size() << " elements differ; first at "
                                     << first << ": " << a[first] << " vs " << e[first];
}

std::size_t count_class(std::span<const float> v, char c) {
  return std::size_t(std::count_if(v.begin(), v.end(), [c](float x) { return cls(x) == c; }));
}

// splitmix64 fills (fast enough for the 32 MiB INT8 weights of the flash preset).
struct Mix {
  std::uint64_t x;
  std::uint64_t next() {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() >> 40) / 16777216.0f; }
};
void fill_int8(std::span<std::int8_t> v, std::uint64_t seed) {  // [-127, 127]
  Mix m{seed};
  for (auto& x : v) x = std::int8_t(int(m.next() % 255) - 127);
}
void fill_bf16(std::span<bf16> v, std::uint64_t seed, float lo, float hi) {
  Mix m{seed};
  for (auto& x : v) x = bf16(m.uniform(lo, hi));
}
// Six special BF16 values (±0, the smallest subnormal, a negative subnormal, ±Inf, a NaN) at
// random places of x and of w (the exact dots' cases).
void plant_specials(std::span<bf16> x, std::span<bf16> w, Mix& m) {
  for (int i = 0; i < 6; ++i) {
    const std::uint16_t bits[] = {0x0000, 0x0001, 0x8040, 0x7f80, 0xff80, 0x7fc1};
    x[std::size_t(m.next() % x.size())].bits = bits[i];
    w[std::size_t(m.next() % w.size())].bits = bits[(i + 3) % 6];
  }
}

// ---------------------------------------------------------------------------------------------
// Bf16Dot::exact's kernels (backend/cpu/bf16_exact.hpp): on every tier this CPU has, both
// arrangements give bf16_dot_exact's sequential double sum rounded once, bit for bit (NaN as NaN),
// over shapes around their blocks and tiles: tokens around the 8-token panels and the passes of 4
// and the few-token kernels (up to 4 tokens past the last whole panel: 1-4, 12; 13 keeps its 5 on
// a panel) (1, 2, 3, 4, 7, 8, 9, 12, 13, 33, 70), rows around the 24 / 6-row tiles, the few-token
// kernels' 8-row groups and 32 / 16-row tiles and the 96-row chunks (1, 5, 23, 25, 97, 200),
// reductions around the 64 / 512-k blocks and the 8 / 4-element vectors (1, 7, 63, 65, 130, 513,
// 4096), padded leading dimensions, column ranges with a partial last vector; values with zeros,
// BF16 subnormals (exact in double: no flush on these paths), ±Inf and NaN. Random products
// round to the same FP32 in any double order, so the shapes alternate with planted ones whose
// sum depends on the order (below): a kernel summing in another order fails there.
TEST(ExactDots, EveryTierAndShapeIsTheSequentialDoubleSum) {
  Mix m{71};
  const auto same = [](float a, float b) {
    return std::isnan(a) ? std::isnan(b)
                         : std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
  };
  int cases = 0, shape = 0, shapes = 0;
  for (index_t T : {1, 2, 3, 4, 7, 8, 9, 12, 13, 33, 70})
    for (index_t R : {1, 5, 23, 25, 97, 200})
      for (index_t d : {1, 7, 63, 65, 130, 513, 4096}) {
        if (T * R * d > 40'000'000) continue;
        ++shapes;
        const index_t ldx = d + index_t(m.next() % 5), ldw = d + index_t(m.next() % 3);
        std::vector<bf16> x(std::size_t(T * ldx)), w(std::size_t(R * ldw)),
            wc(std::size_t(d * (R + 9)));
        fill_bf16(x, m.next(), -2.0f, 2.0f);
        fill_bf16(w, m.next(), -0.1f, 0.1f);
        fill_bf16(wc, m.next(), -0.1f, 0.1f);
        if (d >= 3 && (shape++ % 2) == 1) {
          // Every other shape plants products 1, 2^60 and -2^60 at k = 0, d / 2 and d - 1 in every
          // dot: in ascending k the 2^60 absorbs every product before -2^60 cancels it, so the
          // sequential sum is exactly 0; other orders (descending, lanes on k, blocks summed
          // apart) keep some of the small products and are caught.
          const float big = 1073741824.0f;  // 2^30, exact in BF16
          for (index_t t = 0; t < T; ++t) {
            x[std::size_t(t * ldx)] = bf16(1.0f);
            x[std::size_t(t * ldx + d / 2)] = bf16(big);
            x[std::size_t(t * ldx + d - 1)] = bf16(big);
          }
          for (index_t r = 0; r < R; ++r) {
            w[std::size_t(r * ldw)] = bf16(1.0f);
            w[std::size_t(r * ldw + d / 2)] = bf16(big);
            w[std::size_t(r * ldw + d - 1)] = bf16(-big);
          }
          for (index_t n = 0; n < R + 9; ++n) {
            wc[std::size_t(n)] = bf16(1.0f);
            wc[std::size_t((d / 2) * (R + 9) + n)] = bf16(big);
            wc[std::size_t((d - 1) * (R + 9) + n)] = bf16(-big);
          }
        } else {
          for (int i = 0; i < 6; ++i) {  // zeros, subnormals (0x0001, 0x8040), ±Inf, NaN
            const std::uint16_t bits[] = {0x0000, 0x0001, 0x8040, 0x7f80, 0xff80, 0x7fc1};
            x[std::size_t(m.next() % x.size())].bits = bits[i];
            w[std::size_t(m.next() % w.size())].bits = bits[(i + 1) % 6];
            wc[std::size_t(m.next() % wc.size())].bits = bits[(i + 2) % 6];
          }
        }
        const index_t ldc = R + 9, n0 = index_t(m.next() % 4), n1 = ldc - index_t(m.next() % 4);
        for (Isa isa : tiers()) {
          std::vector<float> rows(std::size_t(T * R), -1.0f), cols(std::size_t(T * ldc), -1.0f);
          td::cpu::bf16_rows_dot_exact(isa, rows.data(), R, x.data(), ldx, T, w.data(), ldw, R, d);
          td::cpu::bf16_cols_dot_exact(isa, cols.data(), ldc, x.data(), ldx, T, wc.data(), ldc, d,
                                       n0, n1);
          long bad = 0;
          for (index_t t = 0; t < T; ++t) {
            for (index_t r = 0; r < R; ++r)
              bad +=
                  !same(rows[std::size_t(t * R + r)],
                        float(td::cpu::bf16_dot_exact(x.data() + t * ldx, w.data() + r * ldw, d)));
            for (index_t n = 0; n < ldc; ++n) {
              const float e =
                  n >= n0 && n < n1
                      ? float(td::cpu::bf16_dot_exact(x.data() + t * ldx, wc.data() + n, d, ldc))
                      : -1.0f;  // outside [n0, n1): untouched
              bad += !same(cols[std::size_t(t * ldc + n)], e);
            }
          }
          EXPECT_EQ(bad, 0) << name(isa) << " T " << T << " R " << R << " d " << d;
          ++cases;
        }
      }
  EXPECT_EQ(shapes, 461);
  EXPECT_EQ(cases, shapes * int(tiers().size()));
}

// The rounding checks' repairs (bf16_pair_dots_exact): n <= kPairDots independent pairs, each
// bf16_dot_exact's sequential double sum, bit for bit, on every tier this CPU has, the weights as
// rows and as columns of a matrix (a stride: the q-latent's repairs from wq_a): n around the
// two 8-pair vectors of the avx512 kernel (1, 7, 8, 9, 16), d around its 8-k blocks and the
// 64-k blocks of the other tiers (1, 7, 8, 9, 63, 64, 65, 513, 4096), the planted order-sensitive
// products of the test above in every other case, zeros, subnormals, ±Inf and NaN in the others.
TEST(ExactDots, PairDotsAreTheSequentialDoubleSumOnEveryTier) {
  Mix m{83};
  int cases = 0;
  for (int n : {1, 7, 8, 9, 16})
    for (index_t d : {1, 7, 8, 9, 63, 64, 65, 513, 4096}) {
      std::vector<bf16> x(std::size_t(n * (d + 3))), w(std::size_t(n * (d + 5)));
      fill_bf16(x, m.next(), -2.0f, 2.0f);
      fill_bf16(w, m.next(), -0.1f, 0.1f);
      std::vector<const bf16*> xp(static_cast<std::size_t>(n)), wp(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {  // rows at odd offsets (any alignment of 2)
        xp[std::size_t(j)] = x.data() + j * (d + 3);
        wp[std::size_t(j)] = w.data() + j * (d + 5);
      }
      if (d >= 3 && cases % 2 == 1) {
        const float big = 1073741824.0f;  // 2^30: products 1, 2^60, -2^60 (sequential sum 0)
        for (int j = 0; j < n; ++j) {
          bf16* xj = x.data() + j * (d + 3);
          bf16* wj = w.data() + j * (d + 5);
          xj[0] = wj[0] = bf16(1.0f);
          xj[d / 2] = wj[d / 2] = xj[d - 1] = bf16(big);
          wj[d - 1] = bf16(-big);
        }
      } else {
        plant_specials(x, w, m);
      }
      // The same weights as columns of a (d, P) matrix (the q-latent's repairs from wq_a): pair j
      // reads column 2j + 1 (every other one: neighbours share cache lines), P odd.
      const index_t P = 2 * n + 3;
      std::vector<bf16> wc(std::size_t(d * P), bf16(7.0f));
      std::vector<const bf16*> cp(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {
        cp[std::size_t(j)] = wc.data() + 2 * j + 1;
        for (index_t k = 0; k < d; ++k) wc[std::size_t(k * P + 2 * j + 1)] = wp[std::size_t(j)][k];
      }
      for (Isa isa : tiers())
        for (bool cols : {false, true}) {
          std::vector<double> s(static_cast<std::size_t>(n), -1.0);
          if (cols)
            td::cpu::bf16_pair_dots_exact(isa, n, xp.data(), cp.data(), d, s.data(), P);
          else
            td::cpu::bf16_pair_dots_exact(isa, n, xp.data(), wp.data(), d, s.data());
          long bad = 0;
          for (int j = 0; j < n; ++j) {
            const double e = td::cpu::bf16_dot_exact(xp[std::size_t(j)], wp[std::size_t(j)], d);
            const double a = s[std::size_t(j)];
            bad += std::isnan(e)
                       ? !std::isnan(a)
                       : std::bit_cast<std::uint64_t>(a) != std::bit_cast<std::uint64_t>(e);
          }
          EXPECT_EQ(bad, 0) << name(isa) << (cols ? " columns" : " rows") << " n " << n << " d "
                            << d;
        }
      ++cases;
    }
  EXPECT_EQ(cases, 45);
}

// The repairs (bf16_rows_gather_dots_exact: nt token rows and n weight rows by pointer, on the
// few-token kernel, kFewTok tokens a pass): each bf16_dot_exact's sequential double sum, bit for
// bit, on every tier this CPU has: nt from 1 to 6 (one pass and a second; the avx2 tier's pairs
// of tokens and its odd one), n around the 8-row groups and the 32 / 16-row tiles (0, 1, 7, 8, 9,
// 16, 17, 32, 33, 70), d around the 8-k steps and 512-k blocks (1, 7, 8, 9, 63, 513, 4096), the
// rows and the tokens in shuffled orders with repeats, the planted order-sensitive products in
// every other case, zeros, subnormals, ±Inf and NaN in the others; the one-x form on the same
// cases against the first token's sums.
TEST(ExactDots, GatheredRowsAreTheSequentialDoubleSumOnEveryTier) {
  Mix m{97};
  int cases = 0;
  for (int n : {0, 1, 7, 8, 9, 16, 17, 32, 33, 70})
    for (index_t d : {1, 7, 8, 9, 63, 513, 4096}) {
      const index_t ld = d + 3, R = 40, X = 5;
      const int nt = 1 + cases % 6;
      std::vector<bf16> x(static_cast<std::size_t>(X * d)), w(static_cast<std::size_t>(R * ld));
      fill_bf16(x, m.next(), -2.0f, 2.0f);
      fill_bf16(w, m.next(), -0.1f, 0.1f);
      if (d >= 3 && cases % 2 == 1) {
        const float big = 1073741824.0f;  // 2^30: products 1, 2^60, -2^60 (sequential sum 0)
        for (index_t i = 0; i < X; ++i) {
          bf16* xi = x.data() + i * d;
          xi[0] = bf16(1.0f), xi[d / 2] = xi[d - 1] = bf16(big);
        }
        for (index_t r = 0; r < R; ++r) {
          bf16* wr = w.data() + r * ld;
          wr[0] = bf16(1.0f), wr[d / 2] = bf16(big), wr[d - 1] = bf16(-big);
        }
      } else {
        plant_specials(x, w, m);
      }
      std::vector<const bf16*> rows(static_cast<std::size_t>(n)), xs(static_cast<std::size_t>(nt));
      for (int j = 0; j < n; ++j) rows[std::size_t(j)] = w.data() + index_t(m.next() % R) * ld;
      for (int t = 0; t < nt; ++t) xs[std::size_t(t)] = x.data() + index_t(m.next() % X) * d;
      const index_t ld_s = n + 2;
      for (Isa isa : tiers()) {
        std::vector<double> s(static_cast<std::size_t>(nt * ld_s), -1.0),
            s1(static_cast<std::size_t>(n) + 1, -1.0);
        td::cpu::bf16_rows_gather_dots_exact(isa, nt, xs.data(), n, rows.data(), d, s.data(), ld_s);
        td::cpu::bf16_rows_gather_dots_exact(isa, n, xs[0], rows.data(), d, s1.data());
        long bad = 0, past = 0;
        for (int t = 0; t < nt; ++t) {
          for (int j = 0; j < n; ++j) {
            const double e = td::cpu::bf16_dot_exact(xs[std::size_t(t)], rows[std::size_t(j)], d);
            const auto same = [&](double a) {
              return std::isnan(e)
                         ? std::isnan(a)
                         : std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(e);
            };
            bad += !same(s[std::size_t(t * ld_s + j)]) + (t == 0 && !same(s1[std::size_t(j)]));
          }
          past += s[std::size_t(t * ld_s + n)] != -1.0 || s[std::size_t(t * ld_s + n + 1)] != -1.0;
        }
        EXPECT_EQ(bad, 0) << name(isa) << " nt " << nt << " n " << n << " d " << d;
        EXPECT_EQ(past, 0) << "past n: written";
        EXPECT_EQ(s1[std::size_t(n)], -1.0) << "one x, past n: written";
      }
      ++cases;
    }
  EXPECT_EQ(cases, 70);
}

// bf16_rows_gather_dots_rounded (backend/cpu/bf16_rounded.hpp: the compressors' repairs): each
// float(bf16_dot_exact) bit for bit, on every tier this CPU has, on the gathered kernel's cases
// (nt 1-6: passes of 1-4 tokens, the avx2 kernel's 4 and 2-vector lanes; n around its 16-row
// chunks; d around its 8 / 16-k steps and 512-k blocks, with a tail), the rows' norms their
// upper bounds (bf16_norm_bound), +Inf for every third row (golden's order there). The planted
// order-sensitive products (every other case from d = 33) make the lanes' sum differ from
// golden's: a kernel that keeps it without its certificate fails there. Then 8192 dots at the
// compressors' statistics (N(0, 1) x, N(0, 0.02) weights, d = 4096), where most are certified and
// some go to golden's order: every one golden's float. Each call with and without the tokens'
// FP32 copies (xf, which the AVX2 kernel widens instead of the BF16 rows).
TEST(ExactDots, RoundedGatheredRowsAreGoldensFloatOnEveryTier) {
  Mix m{131};
  int cases = 0;
  for (int n : {0, 1, 7, 16, 17, 33})
    for (index_t d : {1, 7, 8, 9, 17, 63, 513, 1031, 4096}) {
      const index_t ld = d + 3, R = 40, X = 7;
      const int nt = 1 + cases % 6;
      std::vector<bf16> x(static_cast<std::size_t>(X * d)), w(static_cast<std::size_t>(R * ld));
      fill_bf16(x, m.next(), -2.0f, 2.0f);
      fill_bf16(w, m.next(), -0.1f, 0.1f);
      if (d >= 33 && cases % 2 == 1) {
        // Products 2^60 at k = 0 and -2^60 at k2 (a multiple of 16: the same lane of the avx2
        // kernel's 8 or 16): golden's sum loses every product before k2 (each below 2^60's
        // half ulp, 64) and is the sum of those after it; the lanes keep the other lanes' sums.
        const float big = 1073741824.0f;  // 2^30
        const index_t k2 = 16 * ((d - 1) / 32);
        for (index_t i = 0; i < X; ++i) {
          bf16* xi = x.data() + i * d;
          xi[0] = xi[k2] = bf16(big);
        }
        for (index_t r = 0; r < R; ++r) {
          bf16* wr = w.data() + r * ld;
          wr[0] = bf16(big), wr[k2] = bf16(-big);
        }
      } else {
        plant_specials(x, w, m);
      }
      std::vector<const bf16*> rows(static_cast<std::size_t>(n)), xs(static_cast<std::size_t>(nt));
      std::vector<float> norms(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {
        const bf16* r = w.data() + index_t(m.next() % R) * ld;
        rows[std::size_t(j)] = r;
        norms[std::size_t(j)] = j % 3 == 2 ? kInf : td::bf16_norm_bound(r, d);
      }
      std::vector<float> x32(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) x32[i] = x[i].to_float();
      std::vector<const float*> xf(static_cast<std::size_t>(nt));
      for (int t = 0; t < nt; ++t) {
        const index_t at = index_t(m.next() % X) * d;
        xs[std::size_t(t)] = x.data() + at;
        xf[std::size_t(t)] = x32.data() + at;
      }
      const index_t ld_o = n + 2;
      for (Isa isa : tiers())
        for (const bool f32 : {false, true}) {
          std::vector<float> o(static_cast<std::size_t>(nt * ld_o), -1.0f);
          td::cpu::bf16_rows_gather_dots_rounded(isa, nt, xs.data(), n, rows.data(), norms.data(),
                                                 d, o.data(), ld_o, f32 ? xf.data() : nullptr);
          long bad = 0, past = 0;
          for (int t = 0; t < nt; ++t) {
            for (int j = 0; j < n; ++j) {
              const float e =
                  float(td::cpu::bf16_dot_exact(xs[std::size_t(t)], rows[std::size_t(j)], d));
              const float a = o[std::size_t(t * ld_o + j)];
              bad += std::isnan(e)
                         ? !std::isnan(a)
                         : std::bit_cast<std::uint32_t>(a) != std::bit_cast<std::uint32_t>(e);
            }
            past +=
                o[std::size_t(t * ld_o + n)] != -1.0f || o[std::size_t(t * ld_o + n + 1)] != -1.0f;
          }
          EXPECT_EQ(bad, 0) << name(isa) << (f32 ? " xf" : "") << " nt " << nt << " n " << n
                            << " d " << d;
          EXPECT_EQ(past, 0) << "past n: written";
        }
      ++cases;
    }
  EXPECT_EQ(cases, 54);

  // The compressors' statistics: 2 tokens against 64 rows, 64 times.
  const index_t d = 4096;
  tdtest::Rng rng(5);
  std::vector<bf16> x(static_cast<std::size_t>(2 * d)), w(static_cast<std::size_t>(64 * d));
  std::vector<const bf16*> rows(64);
  std::vector<float> norms(64);
  long bad = 0, dots = 0;
  for (int rep = 0; rep < 64; ++rep) {
    rng.fill_normal(std::span<bf16>(x), 1.0f);
    rng.fill_normal(std::span<bf16>(w), 0.02f);
    for (int j = 0; j < 64; ++j) {
      rows[std::size_t(j)] = w.data() + j * d;
      norms[std::size_t(j)] = td::bf16_norm_bound(rows[std::size_t(j)], d);
    }
    const bf16* xs[2] = {x.data(), x.data() + d};
    std::vector<float> x32(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x32[i] = x[i].to_float();
    const float* xf[2] = {x32.data(), x32.data() + d};
    for (Isa isa : tiers()) {
      std::vector<float> o(2 * 64, -1.0f);
      td::cpu::bf16_rows_gather_dots_rounded(isa, 2, xs, 64, rows.data(), norms.data(), d, o.data(),
                                             64, rep % 2 == 1 ? xf : nullptr);
      for (int t = 0; t < 2; ++t)
        for (int j = 0; j < 64; ++j, ++dots)
          bad += std::bit_cast<std::uint32_t>(o[std::size_t(t * 64 + j)]) !=
                 std::bit_cast<std::uint32_t>(
                     float(td::cpu::bf16_dot_exact(xs[t], rows[std::size_t(j)], d)));
    }
  }
  EXPECT_EQ(bad, 0) << "of " << dots;
}

// The rounded dots' second certificate (bf16_rounded.hpp, sums_exact): where no addition rounds,
// its own order is golden's sum. Planted where the first certificate fails and golden's sum rounds:
// products 2^(m + 53) at k = 0 and −2^(m + 53) at k = 32 (one lane), and q, q at k = 1 and 33
// (another lane), m the least bit of q (every other value 0). Golden's sum rounds 2^(m + 53) + q
// (a tie, to even), the lanes add q + q exactly: the FP32 results differ, and Σ|p| = 2^(m + 54)
// is past the test's 2^(m + 53), so the dot is golden's order. m from a normal q (1 + 2^-7)²
// (m = -14) and from a BF16 subnormal x (2^-133 (1 + 2^-7), m = -140). A test that trusted its
// own order two bits further (2^(m + 55)), or that left the subnormals out of m, fails here. Even
// nt with the tokens' FP32 copies (xf).
TEST(ExactDots, RoundedDotsTrustTheirOwnOrderOnlyWhereNoSumRounds) {
  struct Plant {
    const char* what;
    float big_x, big_w, qx, qw;  // x[0] = x[32] = big_x, w[0] = big_w = −w[32]; x, w at 1, 33
  };
  const float q = 1.0f + 0x1p-7f;
  const Plant plants[] = {{"normal", 0x1p30f, 0x1p9f, q, q},
                          {"subnormal x", 0x1p-60f, 0x1p-27f, 0x1p-133f, q}};
  int cases = 0;
  for (const Plant& p : plants)
    for (index_t d : {64, 100, 4096})
      for (int nt : {1, 2, 3, 4}) {
        std::vector<bf16> x(static_cast<std::size_t>(d), bf16(0.0f)), w = x;
        x[0] = x[32] = bf16(p.big_x);
        w[0] = bf16(p.big_w), w[32] = bf16(-p.big_w);
        x[1] = x[33] = bf16(p.qx);
        w[1] = w[33] = bf16(p.qw);
        const double e = td::cpu::bf16_dot_exact(x.data(), w.data(), d);
        const double exact = 2.0 * double(bf16(p.qx).to_float()) * double(bf16(p.qw).to_float());
        ASSERT_NE(float(e), float(exact)) << p.what << ": golden's sum must round here";
        std::vector<const bf16*> xs(static_cast<std::size_t>(nt), x.data());
        std::vector<float> x32(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) x32[i] = x[i].to_float();
        std::vector<const float*> xf(static_cast<std::size_t>(nt), x32.data());
        const bf16* rows[3] = {w.data(), w.data(), w.data()};
        const float norm = td::bf16_norm_bound(w.data(), d);
        const float norms[3] = {norm, norm, norm};
        for (Isa isa : tiers()) {
          std::vector<float> o(static_cast<std::size_t>(nt * 3), -1.0f);
          td::cpu::bf16_rows_gather_dots_rounded(isa, nt, xs.data(), 3, rows, norms, d, o.data(), 3,
                                                 nt % 2 == 0 ? xf.data() : nullptr);
          for (std::size_t i = 0; i < o.size(); ++i)
            EXPECT_EQ(std::bit_cast<std::uint32_t>(o[i]), std::bit_cast<std::uint32_t>(float(e)))
                << p.what << " " << name(isa) << " d " << d << " nt " << nt << " dot " << i;
        }
        ++cases;
      }
  EXPECT_EQ(cases, 24);
}

// rounding_check::bf16_abs_max on every tier: the plain max of the magnitudes' bits (NaN above
// +Inf, its payload kept), at lengths around the AVX2 kernel's 32 values an iteration.
TEST(RoundingCheck, Bf16AbsMaxIsThePlainMaxOnEveryTier) {
  Mix m{17};
  int cases = 0;
  for (index_t k : {0, 1, 31, 32, 33, 63, 64, 65, 100, 4096, 4097})
    for (int plant = 0; plant < 6; ++plant) {
      std::vector<bf16> x(static_cast<std::size_t>(std::max<index_t>(k, 1)));
      fill_bf16(x, m.next(), -3.0f, 3.0f);
      if (k > 0) {
        const std::size_t at = plant % 2 == 0 ? std::size_t(k - 1) : std::size_t(m.next() % k);
        const std::uint16_t bits[] = {0xc0f0, 0x7fc1, 0xff80, 0x0001, 0x8000, 0x4480};
        x[at].bits = bits[plant];
        if (plant == 3 || plant == 4)  // only tiny values, or only zeros
          for (bf16& v : x) v.bits = std::uint16_t(plant == 3 ? 0x0001 + m.next() % 4 : 0x8000);
      }
      int ref = 0;
      for (index_t i = 0; i < k; ++i) ref = std::max(ref, int(x[std::size_t(i)].bits & 0x7fff));
      const float want = bf16::from_bits(std::uint16_t(ref)).to_float();
      for (Isa isa : tiers())
        EXPECT_EQ(
            std::bit_cast<std::uint32_t>(td::cpu::rounding_check::bf16_abs_max(isa, x.data(), k)),
            std::bit_cast<std::uint32_t>(want))
            << name(isa) << " k " << k << " plant " << plant;
      ++cases;
    }
  EXPECT_EQ(cases, 66);
}

// ---------------------------------------------------------------------------------------------
// Q8 (core/quant.hpp, cpu::quantize_q8_row): every caller's quantiser.

// Policy: amax = max |x_i| propagating NaN. A NaN in the row → dq = NaN and every q_i = -127; an
// Inf (no NaN) → dq = +Inf, q_i = 0 for finite x_i and -127 for ±Inf; finite rows as before. Core
// and every tier give the same bits (dq compared bit for bit, NaN payload included).
TEST(Q8, NonFiniteRowsFollowThePolicyOnEveryTier) {
  struct Case {
    const char* what;
    std::vector<std::pair<int, float>> set;  // (index, value); negative index counts from the end
  };
  const std::vector<Case> cases = {
      {"NaN first", {{0, kNaN}}},
      {"NaN middle", {{-17, kNaN}}},
      {"NaN last lane", {{-1, kNaN}}},
      {"-NaN", {{5, -kNaN}}},
      {"NaN and Inf", {{3, kInf}, {9, kNaN}}},
      {"+Inf", {{7, kInf}}},
      {"-Inf", {{-2, -kInf}}},
      {"huge finite", {{4, 3.0e38f}, {11, -3.3e38f}}},
      {"tiny (amax floor)", {{0, 1e-30f}}},
      {"finite", {}},
  };
  for (int n : {32, 40, 128, 1024}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.what) + " n=" + std::to_string(n));
      tdtest::Rng rng{std::uint64_t(n)};
      std::vector<float> x(static_cast<std::size_t>(n));
      if (std::string(c.what) == "tiny (amax floor)") {
        rng.fill_normal(x, 1e-7f);
      } else {
        rng.fill_normal(x, 2.0f);
      }
      bool has_nan = false, has_inf = false;
      for (auto [i, v] : c.set) {
        x[std::size_t(i >= 0 ? i : n + i)] = v;
        has_nan |= std::isnan(v);
        has_inf |= std::isinf(v);
      }
      std::vector<std::int8_t> q_ref(static_cast<std::size_t>(n));
      const float dq_ref = td::quantize_q8(q_ref, x);
      if (has_nan) {
        EXPECT_TRUE(std::isnan(dq_ref)) << dq_ref;
        for (auto v : q_ref) ASSERT_EQ(v, -127);
      } else if (has_inf) {
        EXPECT_EQ(dq_ref, kInf);
        for (int i = 0; i < n; ++i)
          ASSERT_EQ(q_ref[std::size_t(i)], std::isinf(x[std::size_t(i)]) ? -127 : 0) << i;
      } else {
        EXPECT_TRUE(std::isfinite(dq_ref) && dq_ref > 0.0f) << dq_ref;
      }
      for (Isa isa : tiers()) {
        std::vector<std::int8_t> q(std::size_t(n), 55);
        const float dq = td::cpu::quantize_q8_row(isa, q.data(), x.data(), n);
        EXPECT_EQ(std::bit_cast<std::uint32_t>(dq), std::bit_cast<std::uint32_t>(dq_ref))
            << name(isa) << ": " << dq << " vs " << dq_ref;
        EXPECT_EQ(q, q_ref) << name(isa);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sparse attention. A 16-head model with the real head shapes (two AVX2 head vectors), SWA.

td::ModelConfig sa_config() {
  td::ModelConfig c = td::flash_config();
  c.n_heads = 16;
  c.o_groups = 2;
  return c;
}

const td::RopeTable& sa_rope() {
  static const td::RopeTable t =
      td::make_rope_table(sa_config(), LayerKind::swa, sa_config().max_seq_len);
  return t;
}

struct SaProblem : tdtest::SparseAttnMetadata {
  td::ModelConfig cfg;
  td::Tensor<bf16, 2> kv, cmp;
  td::Tensor<bf16, 3> q;
  td::Tensor<std::int32_t, 2> topk;
  td::Tensor<float, 1> sink;

  explicit SaProblem(std::uint64_t seed)
      : SparseAttnMetadata(sa_config(), {8192, 127, 31, 5000}, 2, 128, 32), cfg(sa_config()) {
    tdtest::Rng rng(seed);
    kv = td::Tensor<bf16, 2>({128 * cfg.page, cfg.head_dim});
    cmp = td::Tensor<bf16, 2>({32 * cfg.page, cfg.head_dim});
    rng.fill_uniform(kv.flat(), -0.5f, 0.5f);
    rng.fill_uniform(cmp.flat(), -0.5f, 0.5f);
    q = td::Tensor<bf16, 3>({T, cfg.n_heads, cfg.head_dim});
    rng.fill_uniform(q.flat(), -0.5f, 0.5f);
    topk = td::Tensor<std::int32_t, 2>({T, cfg.idx_topk});
    std::fill(topk.flat().begin(), topk.flat().end(), -1);
    sink = td::Tensor<float, 1>({cfg.n_heads});
    rng.fill_uniform(sink.flat(), -1.0f, 1.0f);
  }
  td::Tensor<bf16, 2> out() const {
    return td::Tensor<bf16, 2>({cfg.o_groups * T, cfg.o_group_in()});
  }
  td::Tensor<bf16, 2> golden() const {
    auto o = out();
    td::golden::sparse_attention(cfg, LayerKind::swa, o.view(), q.view(), kv.view(), cmp.view(),
                                 win_idx.view(), win_lens.view(), topk.view(), cmp_table.view(),
                                 pos.view(), lens.view(), S, sink.view(), sa_rope().view());
    return o;
  }
  td::Tensor<bf16, 2> kernel(Isa isa) const {
    auto o = out();
    std::vector<std::byte> ws(kn::sparse_attention_workspace_bytes(cfg, 1));
    kn::sparse_attention(td::cpu::Context{nullptr, td::cpu::checked_isa(isa)}, cfg, LayerKind::swa,
                         o.view(), q.view(), kv.view(), cmp.view(), win_idx.view(), win_lens.view(),
                         topk.view(), cmp_table.view(), pos.view(), lens.view(), S, sink.view(),
                         sa_rope().view(), ws);
    return o;
  }
  // Tokens whose valid window reads kv_cache row r.
  std::vector<bool> readers(std::int32_t r) const {
    std::vector<bool> v(std::size_t(T), false);
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < win_lens.view()(t); ++k)
        v[std::size_t(t)] = v[std::size_t(t)] || win_idx.view()(t, k) == r;
    return v;
  }
  // The 512 outputs of head h of token t.
  std::vector<float> head_row(const td::Tensor<bf16, 2>& o, index_t t, int h) const {
    const int hpg = cfg.heads_per_group(), g = h / hpg, hh = h % hpg;
    std::vector<float> r(std::size_t(cfg.head_dim));
    for (index_t d = 0; d < cfg.head_dim; ++d)
      r[std::size_t(d)] = o.view()(g * T + t, hh * cfg.head_dim + d).to_float();
    return r;
  }
};

// Runs golden and every tier, checks `expect(o, who)` on each and the classes of every tier
// against golden (and of the tiers against each other).
template <class Expect>
void check_sparse_attention(const SaProblem& p, Expect&& expect) {
  const auto g = p.golden();
  {
    SCOPED_TRACE("golden");
    expect(g);
  }
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const auto o = p.kernel(isa);
    expect(o);
    EXPECT_TRUE(same_classes(floats(o), floats(g))) << "against golden";
  }
}

// Policy: NaN in a KV row a token reads makes every output of every head of that token NaN (the
// softmax sum of each head is NaN); tokens that do not read the row are untouched.
// (Before: AVX2 dropped the NaN from the running max and clamped exp(NaN) to e^-87, so only the
// poisoned dimension came out NaN.)
TEST(SparseAttention, NaNInKvRowMakesEveryHeadOfItsReadersNaN) {
  SaProblem p(1);
  const std::int32_t r = p.win_idx.view()(0, 5);
  p.kv.view()(r, 17) = bf16(kNaN);
  const auto readers = p.readers(r);
  ASSERT_TRUE(readers[0] && readers[1]);
  ASSERT_FALSE(readers[2]);
  check_sparse_attention(p, [&](const td::Tensor<bf16, 2>& o) {
    for (index_t t = 0; t < p.T; ++t)
      for (int h = 0; h < p.cfg.n_heads; ++h) {
        const auto row = p.head_row(o, t, h);
        if (readers[std::size_t(t)]) {
          ASSERT_EQ(count_class(row, 'n'), row.size()) << "t " << t << " h " << h;
        } else {
          ASSERT_EQ(count_class(row, 'f'), row.size()) << "t " << t << " h " << h;
        }
      }
  });
}

// Policy: NaN in q[t, h] makes exactly head row (t, h) NaN.
TEST(SparseAttention, NaNInQueryMakesExactlyThatHeadRowNaN) {
  SaProblem p(2);
  p.q.view()(3, 9, 100) = bf16(kNaN);
  check_sparse_attention(p, [&](const td::Tensor<bf16, 2>& o) {
    for (index_t t = 0; t < p.T; ++t)
      for (int h = 0; h < p.cfg.n_heads; ++h) {
        const auto row = p.head_row(o, t, h);
        const char want = t == 3 && h == 9 ? 'n' : 'f';
        ASSERT_EQ(count_class(row, want), row.size()) << "t " << t << " h " << h;
      }
  });
}

// Policy (IEEE on the spec's formulas): ±Inf at dim 17 of a KV row gives score s = ±Inf·sign(q17)
// per head. s = +Inf is the block max: exp(s - m) = exp(Inf - Inf) = NaN, the whole head row is
// NaN. s = -Inf has weight exactly 0, but 0 · K[17] = 0 · Inf = NaN: only dim 17 is NaN.
TEST(SparseAttention, InfInKvRowFollowsIeeeThroughTheSoftmax) {
  for (float inf : {kInf, -kInf}) {
    SCOPED_TRACE(inf > 0 ? "+Inf" : "-Inf");
    SaProblem p(3);
    const std::int32_t r = p.win_idx.view()(6, 9);
    p.kv.view()(r, 17) = bf16(inf);
    const auto readers = p.readers(r);
    ASSERT_TRUE(readers[6]);
    check_sparse_attention(p, [&](const td::Tensor<bf16, 2>& o) {
      for (index_t t = 0; t < p.T; ++t)
        for (int h = 0; h < p.cfg.n_heads; ++h) {
          const auto row = p.head_row(o, t, h);
          const float q17 = p.q.view()(t, h, 17).to_float();
          if (!readers[std::size_t(t)]) {
            ASSERT_EQ(count_class(row, 'f'), row.size()) << "t " << t << " h " << h;
          } else if (q17 * inf > 0 || q17 == 0) {  // s = +Inf (or NaN): the whole row
            ASSERT_EQ(count_class(row, 'n'), row.size()) << "t " << t << " h " << h;
          } else {  // s = -Inf: weight 0, 0 · Inf at dim 17
            ASSERT_TRUE(std::isnan(row[17])) << "t " << t << " h " << h;
            ASSERT_EQ(count_class(row, 'f'), row.size() - 1) << "t " << t << " h " << h;
          }
        }
    });
  }
}

// Documented difference: scores are FP32 on every CPU tier (spec), golden accumulates q·k in
// double. With q[t0] and one row r it reads at 1e18, the FP32 dot overflows to +Inf (|q·k| >
// FLT_MAX before the softmax scale), so every head row of t0 is NaN on every tier (Inf - Inf,
// the policy above); golden's double score (2.3e37) is finite and so is its output. Other
// tokens are finite everywhere. (Before: AVX2 gave finite rows for t0 and scalar NaN.)
TEST(SparseAttention, Fp32ScoreOverflowIsNaNOnEveryTierGoldenFinite) {
  SaProblem p(4);
  const std::int32_t r = p.win_idx.view()(0, 40);
  for (index_t d = 0; d < p.cfg.head_dim; ++d) p.kv.view()(r, d) = bf16(1e18f);
  for (int h = 0; h < p.cfg.n_heads; ++h)
    for (index_t d = 0; d < p.cfg.head_dim; ++d) p.q.view()(0, h, d) = bf16(1e18f);
  const auto g = p.golden();
  EXPECT_EQ(count_class(floats(g), 'f'), g.size()) << "golden is finite everywhere";
  std::optional<std::vector<float>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const auto o = p.kernel(isa);
    for (index_t t = 0; t < p.T; ++t)
      for (int h = 0; h < p.cfg.n_heads; ++h) {
        const auto row = p.head_row(o, t, h);
        ASSERT_EQ(count_class(row, t == 0 ? 'n' : 'f'), row.size()) << "t " << t << " h " << h;
      }
    if (first) {
      EXPECT_TRUE(same_classes(floats(o), *first));
    } else {
      first = floats(o);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Compressors (main CSA / HCA, indexer inner): pooling, RMSNorm, Q8 of the inner row.

enum class CKind { csa, hca, inner };

kn::CompressorSpec spec_of(CKind k) {
  const auto& c = td::flash_config();
  switch (k) {
    case CKind::csa:
      return kn::csa_compressor_spec(c);
    case CKind::hca:
      return kn::hca_compressor_spec(c);
    case CKind::inner:
      return kn::indexer_compressor_spec(c);
  }
  return {};
}

const td::RopeTable& c_rope() {
  static const td::RopeTable t =
      td::make_rope_table(td::flash_config(), LayerKind::csa, td::flash_config().max_seq_len);
  return t;
}

struct CWeights {
  td::Tensor<bf16, 2> wkv, wgate;
  td::Tensor<float, 2> ape;
  td::Tensor<bf16, 1> norm_w;
  kn::CompressorWeights view() const {
    return {wkv.view(), wgate.view(), ape.view(), norm_w.view()};
  }
};

const CWeights& c_weights(CKind k) {
  static std::unique_ptr<CWeights> cache[3];
  auto& w = cache[int(k)];
  if (w) return *w;
  const auto sp = spec_of(k);
  const index_t out = sp.out_dim(), d = td::flash_config().hidden;
  w = std::make_unique<CWeights>();
  tdtest::Rng rng(500 + std::uint64_t(k));
  w->wkv = td::Tensor<bf16, 2>({out, d});
  w->wgate = td::Tensor<bf16, 2>({out, d});
  w->ape = td::Tensor<float, 2>({sp.ratio, out});
  w->norm_w = td::Tensor<bf16, 1>({sp.head_dim});
  fill_bf16(w->wkv.flat(), 501 + std::uint64_t(k), -0.04f, 0.04f);
  fill_bf16(w->wgate.flat(), 511 + std::uint64_t(k), -0.06f, 0.06f);
  rng.fill_normal(w->ape.flat(), 0.15f);
  for (auto& v : w->norm_w.flat()) v = bf16(0.9f + 0.2f * rng.normal());
  return *w;
}

// One compressor step: B requests of `seq` tokens at `starts` (small starts: no two requests'
// pages alias in the fixture tables), history rows 0.05·randn before each start.
struct CFixture {
  CKind kind;
  kn::CompressorSpec spec;
  td::paged::StepShape shape;
  index_t page = 0, blocks = 0, cache_rows = 0;
  td::Tensor<bf16, 2> x_n;
  td::Tensor<std::int32_t, 1> positions;
  td::Tensor<std::int32_t, 2> state_table, cmp_table;
  td::Tensor<std::int64_t, 1> state_slots, cmp_slots;
  td::Tensor<float, 2> state_pool;
  td::Tensor<float, 2> ape;  // the gate bias actually used (a copy: tests may poison it)
  td::Tensor<bf16, 2> hadamard;

  CFixture(CKind k, std::vector<std::int32_t> starts, int seq) : kind(k), spec(spec_of(k)) {
    const auto& c = td::flash_config();
    shape = {int(starts.size()), seq, -1};
    const index_t B = shape.batch, T = shape.tokens();
    page = kn::compressor_state_page(c, spec);
    blocks = spec.ratio == 4 ? 65 : 64;
    positions = td::Tensor<std::int32_t, 1>({T});
    td::paged::build_position_ids(positions.view(), starts, shape, c);
    state_table = td::Tensor<std::int32_t, 2>({B, c.max_seq_len / page});
    td::paged::build_fixture_block_table(state_table.view(), blocks);
    state_slots = td::Tensor<std::int64_t, 1>({T});
    td::paged::build_state_slot_mapping(state_slots.view(), positions.view(), state_table.view(),
                                        blocks, int(page), shape, c);
    const index_t cmp_blocks = k == CKind::inner ? 64 : 32;
    cmp_table = td::Tensor<std::int32_t, 2>({B, cmp_blocks});
    td::paged::build_fixture_block_table(cmp_table.view(), cmp_blocks);
    cmp_slots = td::Tensor<std::int64_t, 1>({T});
    td::paged::build_compressed_slot_mapping(cmp_slots.view(), positions.view(), cmp_table.view(),
                                             cmp_blocks, spec.ratio, shape, c);
    cache_rows = cmp_blocks * c.page;
    tdtest::Rng rng(77 + std::uint64_t(k));
    x_n = td::Tensor<bf16, 2>({T, index_t(c.hidden)});
    rng.fill_normal(x_n.flat());
    const index_t sw = spec.state_width();
    state_pool = td::Tensor<float, 2>({blocks * page, sw});
    for (index_t b = 0; b < B; ++b)
      for (index_t p = std::max<index_t>(0, starts[std::size_t(b)] - 100);
           p < starts[std::size_t(b)]; ++p)
        for (index_t i = 0; i < sw; ++i) state_pool.view()(slot(b, p), i) = 0.05f * rng.normal();
    ape = c_weights(k).ape;
    if (k == CKind::inner) hadamard = td::make_hadamard_bf16(128);
  }
  index_t slot(index_t b, index_t p) const {
    return index_t(
        td::paged::paged_slot("fixture", "state_table", state_table.view(), b, p, page, blocks));
  }
  // State columns of channel d for a candidate of the current window (c's own positions).
  index_t kv_col(index_t d) const { return spec.overlap ? spec.head_dim + d : d; }
  index_t score_col(index_t d) const { return spec.out_dim() + kv_col(d); }
  kn::CompressorWeights weights() const {
    kn::CompressorWeights w = c_weights(kind).view();
    w.ape = ape.view();
    return w;
  }
  kn::CompressorMetadata meta() const {
    return {shape, positions.view(), state_slots.view(), cmp_slots.view(), state_table.view()};
  }
  // (token, request) of every emitted row.
  std::vector<std::pair<index_t, index_t>> emitted() const {
    std::vector<std::pair<index_t, index_t>> v;
    for (index_t t = 0; t < shape.tokens(); ++t)
      if (cmp_slots.view()(t) >= 0) v.push_back({t, t / shape.seq});
    return v;
  }
};

struct COut {
  td::Tensor<float, 2> state;
  td::Tensor<bf16, 2> cmp;
  td::Tensor<std::int8_t, 2> idx;
  td::Tensor<float, 1> scale;
  td::Tensor<float, 2> kv_out;
  explicit COut(const CFixture& f)
      : state(f.state_pool),
        cmp({f.kind == CKind::inner ? 0 : f.cache_rows, f.spec.head_dim}),
        idx({f.kind == CKind::inner ? f.cache_rows : 0, 128}),
        scale({f.kind == CKind::inner ? f.cache_rows : 0}),
        kv_out({index_t(f.shape.batch), index_t(f.spec.head_dim)}) {}
  // The emitted row of slot s (main: cmp_kv; inner: the Q8 scale then the 128 INT8 values).
  std::vector<float> row(const CFixture& f, index_t s) const {
    std::vector<float> r;
    if (f.kind == CKind::inner) {
      r.push_back(scale.view()(s));
      for (index_t i = 0; i < 128; ++i) r.push_back(float(idx.view()(s, i)));
    } else {
      for (index_t i = 0; i < f.spec.head_dim; ++i) r.push_back(cmp.view()(s, i).to_float());
    }
    return r;
  }
  std::vector<float> kv_row(index_t b) const {
    return std::vector<float>(&kv_out.view()(b, 0), &kv_out.view()(b, 0) + kv_out.extent(1));
  }
};

COut run_golden(const CFixture& f) {
  COut o(f);
  const auto& c = td::flash_config();
  if (f.kind == CKind::inner) {
    td::golden::indexer_compressor_step(c, o.state.view(), o.idx.view(), o.scale.view(),
                                        o.kv_out.view(), f.x_n.view(), f.weights(),
                                        f.hadamard.view(), f.meta(), c_rope().view());
  } else {
    td::golden::compressor_step(c, f.spec, o.state.view(), o.cmp.view(), o.kv_out.view(),
                                f.x_n.view(), f.weights(), f.meta(), c_rope().view());
  }
  return o;
}

COut run_kernel(const CFixture& f, Isa isa) {
  COut o(f);
  const auto& c = td::flash_config();
  const td::cpu::Context ctx{nullptr, td::cpu::checked_isa(isa)};
  td::Tensor<float, 1> ws({kn::compressor_workspace_size(c, f.spec, f.shape.tokens())});
  if (f.kind == CKind::inner) {
    kn::indexer_compressor_step(ctx, c, o.state.view(), o.idx.view(), o.scale.view(),
                                o.kv_out.view(), f.x_n.view(), f.weights(), f.hadamard.view(),
                                f.meta(), c_rope().view(), ws.view());
  } else {
    kn::compressor_step(ctx, c, f.spec, o.state.view(), o.cmp.view(), o.kv_out.view(), f.x_n.view(),
                        f.weights(), f.meta(), c_rope().view(), ws.view());
  }
  return o;
}

// Policy check of one step: the emitted row (and kv_out) of each request in `poisoned` is NaN
// as a whole (main: every BF16 value; inner: the Q8 scale NaN and every INT8 value -127), every
// other emitted row finite; the state pools have the same classes on every tier and in golden;
// the tiers agree on every class.
void check_compressor(const CFixture& f, const std::vector<index_t>& poisoned) {
  const auto is_poisoned = [&](index_t b) {
    return std::find(poisoned.begin(), poisoned.end(), b) != poisoned.end();
  };
  const auto expect = [&](const COut& o) {
    for (auto [t, b] : f.emitted()) {
      SCOPED_TRACE("request " + std::to_string(b));
      const auto row = o.row(f, f.cmp_slots.view()(t));
      const auto kvr = o.kv_row(b);
      if (is_poisoned(b)) {
        EXPECT_EQ(count_class(kvr, 'n'), kvr.size()) << "kv_out";
        if (f.kind == CKind::inner) {
          EXPECT_TRUE(std::isnan(row[0])) << "idx_kv_scale " << row[0];
          EXPECT_EQ(std::count(row.begin() + 1, row.end(), -127.0f), 128) << "idx_kv_cache";
        } else {
          EXPECT_EQ(count_class(row, 'n'), row.size()) << "cmp_kv";
        }
      } else {
        EXPECT_EQ(count_class(kvr, 'f'), kvr.size()) << "kv_out";
        EXPECT_EQ(count_class(row, 'f'), row.size()) << "emitted row";
      }
    }
  };
  const COut g = run_golden(f);
  {
    SCOPED_TRACE("golden");
    expect(g);
  }
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const COut o = run_kernel(f, isa);
    expect(o);
    EXPECT_TRUE(same_classes(floats(o.state), floats(g.state))) << "state pool";
    EXPECT_TRUE(same_classes(floats(o.kv_out), floats(g.kv_out))) << "kv_out";
  }
}

// Policy: a NaN in one candidate's score (or kv) of one channel makes that pooled channel NaN,
// and the row RMSNorm spreads it to the whole emitted row (and kv_out). +Inf in a score is the
// window max: exp(Inf - Inf) = NaN, the same. A NaN in x_n makes the token's state row NaN, so
// every window that reads it. (Before: the `l > 0` guard turned a NaN softmax sum into 0 on both
// tiers, and AVX2's exp clamped NaN to e^-87: finite rows.)
TEST(Compressor, NaNOrPlusInfInACandidateMakesTheEmittedRowNaN) {
  struct Case {
    CKind kind;
    std::vector<std::int32_t> starts;
    int seq;
    index_t pos;  // history position of request 0 to poison
  };
  const std::vector<Case> cases = {
      {CKind::csa, {2, 3}, 2, 0},
      {CKind::inner, {2, 3}, 2, 1},
      {CKind::hca, {127, 255}, 1, 50},  // 128 candidates: 16 online-softmax chunks
  };
  for (const Case& c : cases) {
    for (const char* what : {"score NaN", "score +Inf", "kv NaN", "x_n NaN"}) {
      SCOPED_TRACE(std::string(what) + " kind " + std::to_string(int(c.kind)));
      CFixture f(c.kind, c.starts, c.seq);
      const std::string w = what;
      const index_t d = 7, s = f.slot(0, c.pos);
      if (w == "score NaN") f.state_pool.view()(s, f.score_col(d)) = kNaN;
      if (w == "score +Inf") f.state_pool.view()(s, f.score_col(d)) = kInf;
      if (w == "kv NaN") f.state_pool.view()(s, f.kv_col(d)) = kNaN;
      if (w == "x_n NaN") f.x_n.view()(0, 100) = bf16(kNaN);  // token 0 = request 0's first
      check_compressor(f, {0});
    }
  }
}

// Policy: -Inf in a score is weight exactly 0 (the row stays finite); a channel whose every
// candidate scores -Inf pools to 0/0 = NaN, as golden (before: 0 on both kernel tiers).
TEST(Compressor, MinusInfScoreHasWeightZeroAllMinusInfIsNaN) {
  {
    SCOPED_TRACE("one candidate -Inf");
    CFixture f(CKind::csa, {2, 3}, 2);
    f.state_pool.view()(f.slot(0, 0), f.score_col(7)) = -kInf;
    check_compressor(f, {});
  }
  {
    SCOPED_TRACE("every candidate of request 0 -Inf at channel 7");
    CFixture f(CKind::csa, {2, 3}, 2);
    // Window c = 0 of request 0 = positions 0, 1 (history) and 2, 3 (this step: ape rows 2, 3).
    const index_t d = 7;
    f.state_pool.view()(f.slot(0, 0), f.score_col(d)) = -kInf;
    f.state_pool.view()(f.slot(0, 1), f.score_col(d)) = -kInf;
    f.ape.view()(2, f.kv_col(d)) = -kInf;
    f.ape.view()(3, f.kv_col(d)) = -kInf;  // request 1's window keeps finite candidates 0..2
    check_compressor(f, {0});
  }
}

// The kernels' RMSNorm of the pooled row runs in double, as golden's does (it used to sum squares
// in FP32, where a pooled value of ~1e29 overflowed Σ pooled² to +Inf and zeroed the row): a
// pooled value of ~1e30 is normalised on every tier (finite, nonzero at d), with golden's classes.
TEST(Compressor, HugePooledValueIsNormalisedOnEveryTierAsInGolden) {
  CFixture f(CKind::csa, {2, 3}, 2);
  const index_t d = 7, s = f.slot(0, 0);
  f.state_pool.view()(s, f.kv_col(d)) = 1e30f;
  f.state_pool.view()(s, f.score_col(d)) = 1.0f;  // the window max: weight ~1/2..1
  const auto [t0, b0] = f.emitted().front();
  ASSERT_EQ(b0, 0);
  const index_t slot = f.cmp_slots.view()(t0);
  const COut g = run_golden(f);
  const auto gr = g.row(f, slot);
  EXPECT_EQ(count_class(gr, 'f'), gr.size());
  EXPECT_GT(std::fabs(gr[std::size_t(d)]), 1.0f) << "golden normalises the row";
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const COut o = run_kernel(f, isa);
    const auto r = o.row(f, slot);
    EXPECT_TRUE(same_classes(r, gr));
    EXPECT_GT(std::fabs(r[std::size_t(d)]), 1.0f) << "the kernel normalises the row";
    EXPECT_TRUE(same_classes(floats(o.state), floats(g.state)));
  }
}

// ---------------------------------------------------------------------------------------------
// Indexer: score, top-k, query, weights.

struct ScoreCase {
  td::ModelConfig cfg = td::flash_config();
  int B = 2, S = 2;
  td::Tensor<std::int32_t, 1> positions, kv_lens;
  td::Tensor<std::int32_t, 2> table;
  td::Tensor<std::int8_t, 2> cache;
  td::Tensor<float, 1> kscale;
  td::Tensor<std::int8_t, 3> q;
  td::Tensor<float, 2> q_sc, w;
  index_t T() const { return index_t(B) * S; }
  int vis(index_t t) const {
    return td::golden::indexer_visible_rows(cfg, positions.view()(t), kv_lens.view()(t / S));
  }
  index_t row(index_t t, index_t j) const {
    return index_t(table.view()(t / S, j / cfg.page)) * cfg.page + j % cfg.page;
  }
  explicit ScoreCase(std::uint64_t seed) {
    const std::vector<std::int32_t> starts = {8192, 3001};
    const td::paged::StepShape sh{B, S, -1};
    positions = td::Tensor<std::int32_t, 1>({T()});
    kv_lens = td::Tensor<std::int32_t, 1>({B});
    td::paged::build_position_ids(positions.view(), starts, sh, cfg);
    td::paged::build_kv_seq_lens(kv_lens.view(), starts, sh, cfg);
    table = td::Tensor<std::int32_t, 2>({B, 64});
    td::paged::build_fixture_block_table(table.view(), 48);
    tdtest::Rng rng(seed);
    cache = td::Tensor<std::int8_t, 2>({48 * 128, 128});
    fill_int8(cache.flat(), seed);
    kscale = td::Tensor<float, 1>({48 * 128});
    rng.fill_uniform(kscale.flat(), 0.002f, 0.02f);
    q = td::Tensor<std::int8_t, 3>({T(), cfg.idx_n_heads, 128});
    fill_int8(q.flat(), seed + 1);
    q_sc = td::Tensor<float, 2>({T(), cfg.idx_n_heads});
    rng.fill_uniform(q_sc.flat(), 0.002f, 0.02f);
    w = td::Tensor<float, 2>({T(), cfg.idx_n_heads});
    rng.fill_uniform(w.flat(), 0.05f, 0.5f);  // > 0: the sign of every head sum is known
  }
  td::Tensor<float, 2> kernel(Isa isa) const {
    td::Tensor<float, 2> s({T(), cfg.score_len()});
    kn::indexer_score(td::cpu::Context{nullptr, td::cpu::checked_isa(isa)}, cfg, s.view(), q.view(),
                      q_sc.view(), w.view(), cache.view(), kscale.view(), table.view(),
                      positions.view(), kv_lens.view(), S);
    return s;
  }
  td::Tensor<float, 2> golden() const {
    td::Tensor<float, 2> s({T(), cfg.score_len()});
    td::golden::indexer_score(cfg, s.view(), q.view(), q_sc.view(), w.view(), cache.view(),
                              kscale.view(), table.view(), positions.view(), kv_lens.view(), S);
    return s;
  }
};

// Policy: score[t, j] = ksc[row] · Σ_h (q_sc·w)[t, h] · relu(dot): NaN in w[t, h] makes the whole
// visible score row of t NaN; NaN / ±Inf in idx_kv_scale[row] makes column j of every token
// that reads the row NaN / ±Inf (Inf · 0 = NaN where the head sum is 0); +Inf in w[t, h] gives
// +Inf where that head's ReLU is > 0 and NaN where it is 0. The tail (j >= vis) stays kNegBig.
// Top-k never selects NaN, ranks +Inf first and fills every slot (tile/topk.hpp), on every tier,
// equal to golden's rule. Tiers bit-identical; golden the same classes.
TEST(IndexerScore, NonFiniteWeightsAndKeyScalesPropagateTopkSkipsNaN) {
  ScoreCase c(31);
  c.w.view()(0, 5) = kNaN;                // token 0: whole row NaN
  c.w.view()(3, 2) = kInf;                // token 3: +Inf / NaN per column
  c.kscale.view()(c.row(1, 9)) = kNaN;    // request 0, column 9 (tokens 0 and 1)
  c.kscale.view()(c.row(1, 10)) = kInf;   // column 10: +Inf (or NaN)
  c.kscale.view()(c.row(2, 11)) = -kInf;  // request 1, column 11
  const auto g = c.golden();
  std::optional<td::Tensor<float, 2>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const auto s = c.kernel(isa);
    EXPECT_TRUE(same_classes(floats(s), floats(g))) << "against golden";
    if (first) {
      EXPECT_TRUE(same_bits(floats(s), floats(*first))) << "against " << name(tiers()[0]);
    } else {
      first = s;
    }
    for (index_t t = 0; t < c.T(); ++t) {
      const int vis = c.vis(t);
      for (index_t j = vis; j < c.cfg.score_len(); ++j) ASSERT_EQ(s.view()(t, j), td::kNegBig);
      const std::span<const float> row(&s.view()(t, 0), std::size_t(vis));
      if (t == 0) {
        EXPECT_EQ(count_class(row, 'n'), row.size()) << "t 0";
      } else if (t == 1) {
        EXPECT_TRUE(std::isnan(row[9]));
        EXPECT_EQ(cls(row[10]), '+');
        EXPECT_EQ(count_class(row, 'f'), row.size() - 2);
      } else if (t == 2) {
        EXPECT_EQ(cls(row[11]), '-');
        EXPECT_EQ(count_class(row, 'f'), row.size() - 1);
      } else {  // +Inf · relu: +Inf where head 2's ReLU > 0, NaN (Inf · 0) where it is 0
        for (std::size_t j = 0; j < row.size(); ++j)
          ASSERT_TRUE(cls(row[j]) == 'n' || cls(row[j]) == (j == 11 ? '-' : '+')) << j;
        EXPECT_GT(count_class(row, '+'), 0u);
        EXPECT_GT(count_class(row, 'n'), 0u);
      }
    }
    // Top-k of this tier's scores: the golden rule exactly; NaN never picked, +Inf first.
    const int k = c.cfg.idx_topk;
    td::Tensor<std::int32_t, 2> ta({c.T(), k + 8}), tg({c.T(), k + 8});
    kn::indexer_topk(td::cpu::Context{nullptr, isa}, c.cfg, ta.view(), s.view(), c.positions.view(),
                     c.kv_lens.view(), c.S, k, 0);
    td::golden::indexer_topk(c.cfg, tg.view(), s.view(), c.positions.view(), c.kv_lens.view(), c.S,
                             k, 0);
    EXPECT_EQ(std::vector<std::int32_t>(ta.flat().begin(), ta.flat().end()),
              std::vector<std::int32_t>(tg.flat().begin(), tg.flat().end()));
    for (index_t i = 0; i < k + 8; ++i) ASSERT_EQ(ta.view()(0, i), -1) << "all-NaN row";
    EXPECT_EQ(ta.view()(1, 0), 10) << "+Inf ranks first";
    for (index_t t = 0; t < c.T(); ++t)
      for (index_t i = 0; i < k + 8; ++i) {
        const std::int32_t j = ta.view()(t, i);
        if (j >= 0) {
          ASSERT_FALSE(std::isnan(s.view()(t, j))) << "t " << t << " slot " << i;
        }
      }
  }
}

// Documented difference: the kernel's head sum Σ_h coef·relu runs in FP32 before the key scale,
// golden's in double. w = 3e38 overflows the FP32 sum to +Inf; with idx_kv_scale = 1e-10 golden's
// double score (~1e32) is finite while every tier gives +Inf (bit-identical among tiers).
TEST(IndexerScore, Fp32OverflowOfTheHeadSumIsInfOnEveryTierGoldenFinite) {
  ScoreCase c(32);
  for (int h = 0; h < c.cfg.idx_n_heads; ++h) c.w.view()(0, h) = 3e38f;
  const index_t row = c.row(0, 20);
  c.kscale.view()(row) = 1e-10f;
  const auto g = c.golden();
  EXPECT_TRUE(std::isfinite(g.view()(0, 20))) << g.view()(0, 20);
  std::optional<td::Tensor<float, 2>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const auto s = c.kernel(isa);
    EXPECT_EQ(s.view()(0, 20), kInf);
    for (index_t t = 1; t < c.T(); ++t)
      for (index_t j = 0; j < c.vis(t); ++j) ASSERT_TRUE(std::isfinite(s.view()(t, j)));
    if (first) {
      EXPECT_TRUE(same_bits(floats(s), floats(*first)));
    } else {
      first = s;
    }
  }
}

struct QueryCase {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 5;
  td::Tensor<std::int8_t, 2> qr, wq_b;
  td::Tensor<float, 1> qr_scale, wq_scale;
  td::Tensor<bf16, 2> hadamard;
  td::Tensor<std::int32_t, 1> rope_pos;
  QueryCase(bool sylvester, std::uint64_t seed) {
    tdtest::Rng rng(seed);
    qr = td::Tensor<std::int8_t, 2>({T, cfg.q_lora});
    fill_int8(qr.flat(), seed);
    qr_scale = td::Tensor<float, 1>({T});
    rng.fill_uniform(qr_scale.flat(), 0.005f, 0.02f);
    const index_t N = index_t(cfg.idx_n_heads) * 128;
    wq_b = td::Tensor<std::int8_t, 2>({cfg.q_lora, N});
    fill_int8(wq_b.flat(), seed + 1);
    wq_scale = td::Tensor<float, 1>({N});
    rng.fill_uniform(wq_scale.flat(), 0.0005f, 0.002f);
    if (sylvester) {
      hadamard = td::make_hadamard_bf16(128);
    } else {
      hadamard = td::Tensor<bf16, 2>({128, 128});
      for (auto& v : hadamard.flat()) v = bf16(rng.uniform() / std::sqrt(128.0f));
    }
    rope_pos = td::Tensor<std::int32_t, 1>({T});
    for (index_t t = 0; t < T; ++t) rope_pos.view()(t) = std::int32_t(rng.integer(0, 16383));
  }
};

const td::RopeTable& csa_rope() {
  return c_rope();
}

// Policy (Q8 above, through the query epilogue): NaN in qr_scale[t] makes every head's row of t
// NaN before Q8, so q_sc[t, :] = NaN and q_i8[t] = -127; NaN in one wq_b_scale column of head h
// does the same for head h of every token; +Inf in qr_scale[t] gives ±Inf / NaN (Inf·0) values,
// whose FWHT / matrix Hadamard is NaN: q_sc[t, :] NaN. Tiers bit-identical; golden the same
// classes and INT8 rows. A NaN q_sc is then rejected by the public indexer_score (its argument
// check; the decode step skips that check and lets the NaN propagate to top-k, which skips it).
// (Before: Q8's amax ignored NaN and q_sc came out finite.)
TEST(IndexerQuery, NonFiniteScalesGiveNaNQ8ScalesOnEveryTier) {
  for (bool sylvester : {true, false}) {
    SCOPED_TRACE(sylvester ? "FWHT path" : "matrix path");
    QueryCase c(sylvester, 41);
    c.qr_scale.view()(1) = kNaN;
    c.qr_scale.view()(3) = kInf;
    c.wq_scale.view()(7 * 128 + 33) = kNaN;  // head 7
    const index_t T = c.T, H = c.cfg.idx_n_heads;
    td::Tensor<std::int8_t, 3> qe({T, H, 128});
    td::Tensor<float, 2> se({T, H});
    td::golden::indexer_query(c.cfg, qe.view(), se.view(), c.qr.view(), c.qr_scale.view(),
                              c.wq_b.view(), c.wq_scale.view(), c.rope_pos.view(),
                              csa_rope().view(), c.hadamard.view());
    const auto packed =
        kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
    const auto expect = [&](const td::Tensor<std::int8_t, 3>& q, const td::Tensor<float, 2>& s) {
      for (index_t t = 0; t < T; ++t)
        for (index_t h = 0; h < H; ++h) {
          const bool bad = t == 1 || t == 3 || h == 7;
          ASSERT_EQ(std::isnan(s.view()(t, h)), bad) << "t " << t << " h " << h;
          ASSERT_TRUE(bad || std::isfinite(s.view()(t, h)));
          for (index_t d = 0; d < 128 && bad; ++d) ASSERT_EQ(q.view()(t, h, d), -127);
        }
    };
    {
      SCOPED_TRACE("golden");
      expect(qe, se);
    }
    std::optional<std::pair<std::vector<std::int8_t>, std::vector<float>>> first;
    for (Isa isa : tiers()) {
      SCOPED_TRACE(name(isa));
      td::Tensor<std::int8_t, 3> qa({T, H, 128});
      td::Tensor<float, 2> sa({T, H});
      kn::indexer_query(td::cpu::Context{nullptr, isa}, c.cfg, qa.view(), sa.view(), c.qr.view(),
                        c.qr_scale.view(), packed, c.rope_pos.view(), csa_rope().view());
      expect(qa, sa);
      EXPECT_TRUE(same_classes(floats(sa), floats(se))) << "against golden";
      std::vector<std::int8_t> qv(qa.flat().begin(), qa.flat().end());
      if (first) {
        EXPECT_EQ(qv, first->first);
        EXPECT_TRUE(same_bits(floats(sa), first->second));
      } else {
        first.emplace(qv, floats(sa));
      }
      if (isa == tiers().back()) {
        // The public score rejects the NaN scale (before writing anything).
        ScoreCase sc(42);
        for (index_t h = 0; h < H; ++h) sc.q_sc.view()(1, h) = sa.view()(1, h);
        EXPECT_THROW((void)sc.kernel(isa), td::Error);
      }
    }
  }
}

// Policy: w[t, h] = Σ_d x_n[t, d] · weights_proj[d, h] (FP32 FMA chain): NaN in x_n[t] makes
// w[t, :] NaN; +Inf in weights_proj[d, h] makes w[:, h] ±Inf (or NaN: Inf·0). Tiers
// bit-identical; golden the same classes.
TEST(IndexerWeights, NonFiniteInputsPropagatePerTokenAndHead) {
  const auto cfg = td::flash_config();
  const index_t T = 5, D = cfg.hidden, H = cfg.idx_n_heads;
  td::Tensor<bf16, 2> x({T, D}), wp({D, H});
  fill_bf16(x.flat(), 51, -1.0f, 1.0f);
  fill_bf16(wp.flat(), 52, -0.05f, 0.05f);
  x.view()(2, 100) = bf16(kNaN);
  wp.view()(300, 9) = bf16(kInf);
  td::Tensor<float, 2> g({T, H});
  td::golden::indexer_weights(cfg, g.view(), x.view(), wp.view());
  std::optional<std::vector<float>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    td::Tensor<float, 2> w({T, H});
    kn::indexer_weights(td::cpu::Context{nullptr, isa}, cfg, w.view(), x.view(), wp.view());
    for (index_t t = 0; t < T; ++t)
      for (index_t h = 0; h < H; ++h) {
        const char c = cls(w.view()(t, h));
        if (t == 2) {
          ASSERT_EQ(c, 'n') << h;
        } else if (h == 9) {
          ASSERT_TRUE(c == '+' || c == '-') << t;  // x[t, 300] != 0 here
        } else {
          ASSERT_EQ(c, 'f') << t << " " << h;
        }
      }
    EXPECT_TRUE(same_classes(floats(w), floats(g)));
    if (first) {
      EXPECT_TRUE(same_bits(floats(w), *first));
    } else {
      first = floats(w);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Output projection (Q8 of o_r per (token, group), exact INT8 wo_b, golden's double group sum).

struct OprojCase {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 2;
  td::Tensor<bf16, 3> wo_a;
  td::Tensor<std::int8_t, 2> wo_b;
  td::Tensor<float, 1> scale;
  td::Tensor<bf16, 2> o;
  OprojCase() {
    wo_a = td::Tensor<bf16, 3>({cfg.o_groups, cfg.o_lora, cfg.o_group_in()});
    fill_bf16(wo_a.flat(), 61, -0.035f, 0.035f);
    wo_b = td::Tensor<std::int8_t, 2>({cfg.hidden, index_t(cfg.o_groups) * cfg.o_lora});
    fill_int8(wo_b.flat(), 62);
    scale = td::Tensor<float, 1>({cfg.hidden});
    Mix m{63};
    for (auto& v : scale.flat()) v = 1e-3f * m.uniform(0.5f, 1.5f);
    o = td::Tensor<bf16, 2>({index_t(cfg.o_groups) * T, cfg.o_group_in()});
    fill_bf16(o.flat(), 64, -0.1f, 0.1f);
  }
  td::Tensor<bf16, 2> kernel(Isa isa) const {
    td::Tensor<bf16, 2> out({T, cfg.hidden});
    std::vector<std::byte> ws(kn::output_projection_workspace_bytes(cfg, T));
    kn::output_projection(td::cpu::Context{nullptr, td::cpu::checked_isa(isa)}, cfg, out.view(),
                          o.view(), wo_a.view(), wo_b.view(), scale.view(), ws);
    return out;
  }
  td::Tensor<bf16, 2> golden() const {
    td::Tensor<bf16, 2> out({T, cfg.hidden});
    td::golden::output_projection(cfg, out.view(), o.view(), wo_a.view(), wo_b.view(),
                                  scale.view());
    return out;
  }
};

// Compares the tiers among themselves: avx2 and avx2_vnni bit-identical (exact INT8 stages, the
// same FP32 code), scalar and avx512 the same classes (their wo_a sums are ordered differently:
// scalar's lane sum, avx512's vdpbf16ps).
void expect_oproj_tiers_agree(const std::vector<std::pair<Isa, std::vector<float>>>& runs) {
  for (const auto& [isa, v] : runs) {
    EXPECT_TRUE(same_classes(v, runs.front().second)) << name(isa);
    if (isa != Isa::avx2_vnni) continue;
    for (const auto& [i2, v2] : runs) {
      if (i2 == Isa::avx2) {
        EXPECT_TRUE(same_bits(v, v2)) << name(isa) << " vs avx2";
      }
    }
  }
}

// Policy: a NaN in o_packed row (g·T + t) makes o_r[t, g, :] NaN, its Q8 scale NaN, and so every
// channel of attn_out[t] NaN; a NaN in wo_b_scale[n] makes channel n NaN for every token; +Inf in
// o_packed gives dq = +Inf and ±Inf / NaN outputs of that token. Golden (same Q8) the same
// classes. (Before: Q8's amax skipped the NaN and attn_out[t] came out finite.)
TEST(OutputProjection, NonFiniteActivationsAndScalesPropagate) {
  for (const char* what : {"NaN", "+Inf"}) {
    SCOPED_TRACE(what);
    OprojCase c;
    const bool nan = std::string(what) == "NaN";
    c.o.view()(1 * c.T + 0, 777) = bf16(nan ? kNaN : kInf);  // group 1, token 0
    c.scale.view()(5) = kNaN;
    const auto g = floats(c.golden());
    std::vector<std::pair<Isa, std::vector<float>>> runs;
    const index_t N = c.cfg.hidden;
    const auto expect = [&](const std::vector<float>& v) {
      const std::span<const float> t0(v.data(), std::size_t(N)), t1(v.data() + N, std::size_t(N));
      if (nan) {
        EXPECT_EQ(count_class(t0, 'n'), std::size_t(N)) << "token 0";
      } else {
        EXPECT_EQ(count_class(t0, 'f'), 0u) << "token 0";
        EXPECT_GT(count_class(t0, '+') + count_class(t0, '-'), std::size_t(N) / 2);
      }
      EXPECT_TRUE(std::isnan(t1[5])) << "channel 5";
      EXPECT_EQ(count_class(t1, 'f'), std::size_t(N) - 1) << "token 1";
    };
    {
      SCOPED_TRACE("golden");
      expect(g);
    }
    for (Isa isa : tiers()) {
      SCOPED_TRACE(name(isa));
      runs.emplace_back(isa, floats(c.kernel(isa)));
      expect(runs.back().second);
      EXPECT_TRUE(same_classes(runs.back().second, g)) << "against golden";
    }
    expect_oproj_tiers_agree(runs);
  }
}

// The combine is golden's on every tier (issue 17: Σ_g dq_g · P_g of exact products in double,
// scaled in double, one rounding to FP32): activations of 1e36 in one group give dq ~ 4e34 and
// dq · P beyond FLT_MAX, which an FP32 group sum (the kernels' before) turned into ±Inf for most
// of attn_out[t0]; the double sum times wo_b_scale (~4e37) is finite, as golden's.
TEST(OutputProjection, GroupSumBeyondFltMaxStaysFiniteOnEveryTierAsGolden) {
  OprojCase c;
  for (index_t k = 0; k < c.cfg.o_group_in(); ++k) c.o.view()(3 * c.T + 0, k) = bf16(1e36f);
  const auto g = floats(c.golden());
  EXPECT_EQ(count_class(g, 'f'), g.size()) << "golden finite";
  std::vector<std::pair<Isa, std::vector<float>>> runs;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    runs.emplace_back(isa, floats(c.kernel(isa)));
    const auto& v = runs.back().second;
    EXPECT_EQ(count_class(v, 'f'), v.size()) << "finite";
    EXPECT_TRUE(same_classes(v, g)) << "against golden";
  }
  expect_oproj_tiers_agree(runs);
}

// ---------------------------------------------------------------------------------------------
// qkv projection (FP32 BF16 matmuls in ascending k on every tier and in golden, Q8 of the
// q-latent, exact INT8 wq_b, the rest in double).

struct QkvCase {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 3;
  td::Tensor<bf16, 2> x_n, wq_a, wkv;
  td::Tensor<bf16, 1> gamma_cq, gamma_ckv;
  td::Tensor<std::int8_t, 2> wq_b;
  td::Tensor<float, 1> wq_b_scale;
  td::Tensor<std::int32_t, 1> pos;
  QkvCase()
      : x_n({T, cfg.hidden}),
        wq_a({cfg.hidden, cfg.q_lora}),
        wkv({cfg.hidden, cfg.head_dim}),
        gamma_cq({cfg.q_lora}),
        gamma_ckv({cfg.head_dim}),
        wq_b({cfg.q_lora, index_t(cfg.n_heads) * cfg.head_dim}),
        wq_b_scale({index_t(cfg.n_heads) * cfg.head_dim}),
        pos({T}) {
    fill_bf16(x_n.flat(), 71, -1.7f, 1.7f);
    fill_bf16(wq_a.flat(), 72, -0.027f, 0.027f);
    fill_bf16(wkv.flat(), 73, -0.027f, 0.027f);
    fill_bf16(gamma_cq.flat(), 74, 0.7f, 1.3f);
    fill_bf16(gamma_ckv.flat(), 75, 0.7f, 1.3f);
    fill_int8(wq_b.flat(), 76);
    Mix m{77};
    for (auto& v : wq_b_scale.flat()) v = 2e-4f * m.uniform(0.5f, 1.5f);
    for (index_t t = 0; t < T; ++t) pos.view()(t) = std::int32_t(100 + 3000 * t);
  }
  static const td::RopeTable& rope() {
    static const td::RopeTable r = td::make_rope_table(td::flash_config(), LayerKind::csa, 8200);
    return r;
  }
  td::QkvWeights weights() const {
    return {wq_a.view(),       gamma_cq.view(), wq_b.view(),
            wq_b_scale.view(), wkv.view(),      gamma_ckv.view()};
  }
};

struct QkvOut {
  td::Tensor<bf16, 3> q;
  td::Tensor<bf16, 2> kv;
  td::Tensor<std::int8_t, 2> qr;
  td::Tensor<float, 1> qr_scale;
  explicit QkvOut(const QkvCase& c)
      : q({c.T, c.cfg.n_heads, c.cfg.head_dim}),
        kv({c.T, c.cfg.head_dim}),
        qr({c.T, c.cfg.q_lora}),
        qr_scale({c.T}) {}
  std::vector<float> all() const {
    std::vector<float> v = floats(q), k = floats(kv), r = floats(qr), s = floats(qr_scale);
    v.insert(v.end(), k.begin(), k.end());
    v.insert(v.end(), r.begin(), r.end());
    v.insert(v.end(), s.begin(), s.end());
    return v;
  }
  // Every output of token t (q, kv, qr, qr_scale rows).
  std::vector<float> token(index_t t) const {
    std::vector<float> v;
    const auto add = [&](const auto& tensor) {  // row t of a contiguous tensor
      const std::size_t n = tensor.size() / std::size_t(tensor.extent(0));
      for (std::size_t i = 0; i < n; ++i)
        v.push_back(as_float(tensor.data()[std::size_t(t) * n + i]));
    };
    add(q);
    add(kv);
    add(qr);
    add(qr_scale);
    return v;
  }
};

QkvOut run_qkv(const QkvCase& c, Isa isa) {
  QkvOut o(c);
  td::Tensor<float, 2> x({c.T, c.cfg.hidden}), cq({c.T, c.cfg.q_lora}), kvf({c.T, c.cfg.head_dim});
  td::Tensor<std::int32_t, 2> pairs({c.T, c.cfg.q_lora / 2});
  kn::qkv_projection(td::cpu::Context{nullptr, td::cpu::checked_isa(isa)}, o.q.view(), o.kv.view(),
                     o.qr.view(), o.qr_scale.view(), c.x_n.view(), c.weights(),
                     QkvCase::rope().view(), c.pos.view(),
                     {x.view(), cq.view(), kvf.view(), pairs.view()}, c.cfg);
  return o;
}

QkvOut golden_qkv(const QkvCase& c) {
  QkvOut o(c);
  td::golden::qkv_projection(o.q.view(), o.kv.view(), o.qr.view(), o.qr_scale.view(), c.x_n.view(),
                             c.weights(), QkvCase::rope().view(), c.pos.view(), c.cfg);
  return o;
}

// Policy: a NaN in x_n[t] makes cq[t] and kvf[t] NaN: qr_scale[t] = NaN, qr[t] = -127, q[t] and
// kv[t] NaN. A product x·w beyond FLT_MAX (x_n = 3e38 against a weight row of 2) makes cq[t] ±Inf
// on every tier (the FP32 products and group sums are part of the contract), its RMSNorm NaN, and
// so q[t] and qr_scale[t]; golden accumulates in double, where nothing overflows, and token t
// stays finite there (a documented FP32-overflow difference). A NaN in one wq_b_scale column makes
// that head of every token NaN (the per-head RMSNorm). Tiers bit-identical (INT8 matmul exact, FP32
// sums in the same order, the rest in shared double code); golden the same classes and the same
// INT8 rows of poisoned tokens. (Before: Q8 skipped NaN, qr_scale stayed finite and q[t] came out
// finite for the overflow.)
TEST(QkvProjection, NonFiniteActivationsPropagatePerToken) {
  QkvCase c;
  c.x_n.view()(0, 100) = bf16(kNaN);
  c.x_n.view()(2, 200) = bf16(3e38f);
  for (index_t n = 0; n < c.cfg.q_lora; ++n) c.wq_a.view()(200, n) = bf16(2.0f);
  c.wq_b_scale.view()(5 * c.cfg.head_dim + 9) = kNaN;  // head 5
  const QkvOut g = golden_qkv(c);
  const index_t H = c.cfg.n_heads, HD = c.cfg.head_dim;
  const auto expect = [&](const QkvOut& o, bool golden) {
    for (index_t t : {0, 2}) {
      if (golden && t == 2) {  // finite as token 1 is: NaN in head 5 only
        EXPECT_TRUE(std::isfinite(o.qr_scale.view()(t)));
        EXPECT_TRUE(same_classes(o.token(2), o.token(1))) << "golden token 2";
        continue;
      }
      EXPECT_TRUE(std::isnan(o.qr_scale.view()(t))) << "qr_scale " << t;
      for (index_t k = 0; k < c.cfg.q_lora; ++k) ASSERT_EQ(o.qr.view()(t, k), -127) << t;
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < HD; ++d) ASSERT_TRUE(std::isnan(o.q.view()(t, h, d).to_float()));
    }
    for (index_t d = 0; d < HD; ++d) ASSERT_TRUE(std::isnan(o.kv.view()(0, d).to_float()));
    for (index_t d = 0; d < HD; ++d) ASSERT_TRUE(std::isfinite(o.kv.view()(2, d).to_float()));
    EXPECT_TRUE(std::isfinite(o.qr_scale.view()(1)));
    for (index_t h = 0; h < H; ++h)
      for (index_t d = 0; d < HD; ++d)
        ASSERT_EQ(std::isnan(o.q.view()(1, h, d).to_float()), h == 5) << h << " " << d;
    for (index_t d = 0; d < HD; ++d) ASSERT_TRUE(std::isfinite(o.kv.view()(1, d).to_float()));
  };
  {
    SCOPED_TRACE("golden");
    expect(g, true);
  }
  std::optional<std::vector<float>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    const QkvOut o = run_qkv(c, isa);
    expect(o, false);
    for (index_t t : {0, 1})
      EXPECT_TRUE(same_classes(o.token(t), g.token(t))) << "against golden, token " << t;
    if (first) {
      EXPECT_TRUE(same_bits(o.all(), *first)) << "against " << name(tiers()[0]);
    } else {
      first = o.all();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (double on every tier and in golden: bit-identical, NaN payloads aside).

// Policy: a NaN in x[t] makes row t NaN; ±Inf makes Σx² = Inf and r = 0: the Inf elements NaN
// (Inf·0), every other element ±0; a NaN in w[i] makes column i NaN. No overflow: Σx² of BF16
// values is exact-range in double (3.4e38² < 1.8e308).
TEST(RmsNorm, NonFiniteRowsAndWeightsFollowIeee) {
  const auto cfg = td::flash_config();
  const index_t T = 5, D = cfg.hidden;
  td::Tensor<bf16, 2> x({T, D});
  td::Tensor<bf16, 1> w({D});
  fill_bf16(x.flat(), 81, -3.0f, 3.0f);
  fill_bf16(w.flat(), 82, 0.5f, 1.5f);
  x.view()(0, 10) = bf16(kNaN);
  x.view()(1, 20) = bf16(kInf);
  x.view()(2, 30) = bf16(-kInf);
  for (index_t i = 0; i < D; ++i) x.view()(3, i) = bf16(3.0e38f);  // huge finite: no overflow
  w.view()(40) = bf16(kNaN);
  td::Tensor<bf16, 2> g({T, D});
  td::golden::rmsnorm(g.view(), x.view(), w.view(), cfg.rms_eps);
  const auto expect = [&](const td::Tensor<bf16, 2>& y) {
    for (index_t t = 0; t < T; ++t)
      for (index_t i = 0; i < D; ++i) {
        const float v = y.view()(t, i).to_float();
        if (t == 0 || i == 40 || (t == 1 && i == 20) || (t == 2 && i == 30)) {
          ASSERT_TRUE(std::isnan(v)) << t << " " << i;
        } else if (t == 1 || t == 2) {
          ASSERT_EQ(v, 0.0f) << t << " " << i;
        } else {
          ASSERT_TRUE(std::isfinite(v) && v != 0.0f) << t << " " << i << " " << v;
        }
      }
  };
  expect(g);
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    td::Tensor<bf16, 2> y({T, D});
    kn::rmsnorm(td::cpu::Context{nullptr, isa}, y.view(), x.view(), w.view(), cfg.rms_eps);
    expect(y);
    EXPECT_TRUE(same_bits(floats(y), floats(g)));
  }
}

// ---------------------------------------------------------------------------------------------
// Hyper-connections.

struct HcCase {
  td::ModelConfig cfg = td::flash_config();
  index_t T = 4;
  td::Tensor<float, 3> x_hc{{T, 4, cfg.hidden}};
  td::Tensor<float, 2> fn{{td::kHcMixes, 4 * cfg.hidden}};
  td::Tensor<float, 1> scale{{3}}, base{{td::kHcMixes}};
  HcCase() {
    tdtest::Rng rng(91);
    rng.fill_normal(x_hc.flat(), 1.0f);
    rng.fill_normal(fn.flat(), 1.0f / 128.0f);
    scale.data()[0] = 0.5f;
    scale.data()[1] = 0.7f;
    scale.data()[2] = 1.3f;
    rng.fill_normal(base.flat(), 0.5f);
  }
  td::HcWeights weights() const { return {fn.view(), scale.view(), base.view()}; }
};

// Policy (double throughout): NaN or ±Inf anywhere in x_hc[t] makes all of token t's outputs
// NaN (Σx² = NaN / Inf: r = NaN / 0, every mix NaN); NaN in an fn row of the comb group makes
// every comb entry of every token NaN (the Sinkhorn normalisations mix all rows and columns),
// pre / post / x_mixed stay finite; NaN in a post row makes that post gate NaN only. Tiers the
// same classes (the AVX2 dots sum in 8 lanes); golden the same classes.
TEST(HyperConnection, PreNonFiniteInputsPropagateAsDocumented) {
  HcCase c;
  const index_t D = c.cfg.hidden, T = c.T;
  c.x_hc.view()(0, 2, 100) = kNaN;
  c.x_hc.view()(1, 0, 5) = -kInf;
  c.fn.view()(8 + 6, 777) = kNaN;   // comb mix (i = 1, o = 2)
  c.fn.view()(4 + 3, 4000) = kNaN;  // post gate 3
  td::Tensor<bf16, 2> xg({T, D});
  td::Tensor<float, 2> pg({T, 4});
  td::Tensor<float, 3> cg({T, 4, 4});
  td::golden::hc_pre(xg.view(), pg.view(), cg.view(), c.x_hc.view(), c.weights(), c.cfg);
  const auto expect = [&](const td::Tensor<bf16, 2>& xm, const td::Tensor<float, 2>& post,
                          const td::Tensor<float, 3>& comb) {
    for (index_t t = 0; t < T; ++t) {
      const bool dead = t < 2;
      for (index_t k = 0; k < D; ++k)
        ASSERT_EQ(std::isnan(xm.view()(t, k).to_float()), dead) << t << " " << k;
      for (int i = 0; i < 4; ++i) ASSERT_EQ(std::isnan(post.view()(t, i)), dead || i == 3) << t;
      for (int i = 0; i < 4; ++i)
        for (int o = 0; o < 4; ++o) ASSERT_TRUE(std::isnan(comb.view()(t, i, o))) << t;
    }
    for (float v : floats(xm)) ASSERT_FALSE(std::isinf(v));
  };
  {
    SCOPED_TRACE("golden");
    expect(xg, pg, cg);
  }
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    td::Tensor<bf16, 2> xm({T, D});
    td::Tensor<float, 2> post({T, 4});
    td::Tensor<double, 2> mixes({T, td::kHcMixes});
    td::Tensor<float, 3> comb({T, 4, 4});
    kn::hc_pre(td::cpu::Context{nullptr, isa}, xm.view(), post.view(), comb.view(), c.x_hc.view(),
               c.weights(), mixes.view(), c.cfg);
    expect(xm, post, comb);
  }
}

// Policy (FP32, elementwise): y[t, o, k] = a[t, k]·post[t, o] + Σ_i x_hc[t, i, k]·comb[t, i, o];
// NaN in a[t, k] → y[t, :, k] NaN; NaN in post[t, o] → y[t, o, :] NaN; +Inf in x_hc[t, i, k] →
// y[t, :, k] +Inf (comb > 0). Tiers bit-identical (the same mul / add order); golden the same
// classes. Documented difference: FP32 partial sums overflow where golden's double sum does not:
// x_hc[t, 0..2, k] = (3e38, 3e38, -3e38) with comb 0.9 gives +Inf on every tier, golden 2.7e38.
TEST(HyperConnection, PostNonFiniteAndFp32OverflowAsDocumented) {
  HcCase c;
  const index_t D = c.cfg.hidden, T = c.T;
  tdtest::Rng rng(92);
  td::Tensor<bf16, 2> a({T, D});
  rng.fill_normal(a.flat(), 1.0f);
  td::Tensor<float, 2> post({T, 4});
  td::Tensor<float, 3> comb({T, 4, 4});
  rng.fill_uniform(post.flat(), 0.1f, 2.0f);
  rng.fill_uniform(comb.flat(), 0.1f, 0.5f);
  a.view()(0, 10) = bf16(kNaN);
  post.view()(1, 2) = kNaN;
  c.x_hc.view()(2, 3, 20) = kInf;
  // Token 3, column 30: the overflow case.
  a.view()(3, 30) = bf16(0.0f);
  for (int i = 0; i < 4; ++i) {
    c.x_hc.view()(3, i, 30) = i < 2 ? 3e38f : (i == 2 ? -3e38f : 0.0f);
    for (int o = 0; o < 4; ++o) comb.view()(3, i, o) = 0.9f;
  }
  td::Tensor<float, 3> yg({T, 4, D});
  td::golden::hc_post(yg.view(), a.view(), c.x_hc.view(), post.view(), comb.view(), c.cfg);
  const auto expect = [&](const td::Tensor<float, 3>& y, bool golden) {
    for (index_t t = 0; t < T; ++t)
      for (int o = 0; o < 4; ++o)
        for (index_t k = 0; k < D; ++k) {
          const char got = cls(y.view()(t, o, k));
          char want = 'f';
          if ((t == 0 && k == 10) || (t == 1 && o == 2)) want = 'n';
          if (t == 2 && k == 20) want = '+';
          if (t == 3 && k == 30) want = golden ? 'f' : '+';
          ASSERT_EQ(got, want) << t << " " << o << " " << k;
        }
  };
  {
    SCOPED_TRACE("golden");
    expect(yg, true);
  }
  std::optional<std::vector<float>> first;
  for (Isa isa : tiers()) {
    SCOPED_TRACE(name(isa));
    td::Tensor<float, 3> y({T, 4, D});
    kn::hc_post(td::cpu::Context{nullptr, isa}, y.view(), a.view(), c.x_hc.view(), post.view(),
                comb.view(), c.cfg);
    expect(y, false);
    if (first) {
      EXPECT_TRUE(same_bits(floats(y), *first));
    } else {
      first = floats(y);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The VNNI tiers (INT8 kernels on vpdpbusd: avx2_vnni 256-bit, avx512 512-bit): bit-identical to
// avx2 on the non-finite cases above (avx512's output projection: the same classes, its wo_a
// runs on vdpbf16ps). The per-family tests already include the tiers when the CPU
// has them; these state each tier's coverage explicitly and skip (with the reason) elsewhere.
void expect_vnni_tier_bit_identical_on_non_finite(Isa tier) {
  {
    OprojCase c;
    c.o.view()(0, 3) = bf16(kNaN);
    c.scale.view()(9) = kInf;
    // avx512's wo_a runs on vdpbf16ps (another summation order): the same classes there.
    const auto got = floats(c.kernel(tier)), want = floats(c.kernel(Isa::avx2));
    EXPECT_TRUE(tier == Isa::avx512 ? same_classes(got, want) : same_bits(got, want))
        << "output_projection";
  }
  {
    QkvCase c;
    c.x_n.view()(1, 7) = bf16(kNaN);
    EXPECT_TRUE(same_bits(run_qkv(c, tier).all(), run_qkv(c, Isa::avx2).all())) << "qkv_projection";
  }
  {
    ScoreCase c(33);
    c.w.view()(1, 3) = kNaN;
    c.kscale.view()(c.row(2, 4)) = kInf;
    EXPECT_TRUE(same_bits(floats(c.kernel(tier)), floats(c.kernel(Isa::avx2)))) << "indexer_score";
  }
  {
    QueryCase c(true, 43);
    c.qr_scale.view()(2) = kNaN;
    const auto packed =
        kn::pack_indexer_query_weights(c.cfg, c.wq_b.view(), c.wq_scale.view(), c.hadamard.view());
    std::vector<float> s[2];
    std::vector<std::int8_t> q[2];
    for (int i = 0; i < 2; ++i) {
      td::Tensor<std::int8_t, 3> qa({c.T, c.cfg.idx_n_heads, 128});
      td::Tensor<float, 2> sa({c.T, c.cfg.idx_n_heads});
      kn::indexer_query(td::cpu::Context{nullptr, i ? tier : Isa::avx2}, c.cfg, qa.view(),
                        sa.view(), c.qr.view(), c.qr_scale.view(), packed, c.rope_pos.view(),
                        csa_rope().view());
      s[i] = floats(sa);
      q[i].assign(qa.flat().begin(), qa.flat().end());
    }
    EXPECT_TRUE(same_bits(s[1], s[0])) << "indexer_query scales";
    EXPECT_EQ(q[1], q[0]) << "indexer_query INT8";
  }
}

TEST(VnniTier, BitIdenticalToAvx2OnNonFiniteInputs) {
  if (!td::cpu::cpu_supports(Isa::avx2_vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  expect_vnni_tier_bit_identical_on_non_finite(Isa::avx2_vnni);
}

TEST(Avx512Tier, BitIdenticalToAvx2OnNonFiniteInputs) {
  if (!td::cpu::cpu_supports(Isa::avx512))
    GTEST_SKIP() << "no AVX-512 F/BW/VL/VNNI/BF16 on this CPU";
  expect_vnni_tier_bit_identical_on_non_finite(Isa::avx512);
}

}  // namespace
