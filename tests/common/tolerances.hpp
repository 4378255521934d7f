#pragma once
// The tolerances of the test suite, once: one named rule per kernel output, from the spec's
// tolerance table (dsv4_flash_decode.md §10.2) and the HEAD addendum (dsv4_head_contract.md
// §12). A test names the rule (`tdtest::tol::sparse_attn_out`), never its numbers, so a tolerance
// is read, argued about and changed in one place. Where the spec gives no rule for an output (the
// hyper-connection gates, the indexer's query and head weights, intermediate FP32 rows), the rule
// below says what it was derived from.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "common/compare.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/view.hpp"

namespace tdtest::tol {

// ratio_allclose(atol, rtol, max_error_ratio): a point fails if |a - e| > atol + rtol |e|; the
// output passes iff the failing fraction is <= max_error_ratio (and nothing is NaN/Inf).
struct Allclose {
  std::string_view name;
  double atol, rtol, max_error_ratio;
  std::string_view source;
};
// ratio_reldiff(diff_thd, pct_thd, max_diff_hd) (spec §10.1).
struct Reldiff {
  std::string_view name;
  double diff_thd, pct_thd, max_diff_hd;
  std::string_view source;
};

inline constexpr double kBf16Rtol = 1.0 / 128;

// hc_pre (spec §4.1 gives no operator test): x_mixed is a BF16 row (the BF16 rule, 0 %); the
// gates are FP32 results of a short double-precision Sinkhorn (1e-5, 1e-4).
inline constexpr Allclose hc_x_mixed{"x_mixed", 1e-4, kBf16Rtol, 0.0, "BF16 rule of §10.2"};
inline constexpr Allclose hc_gates{"post/comb", 1e-5, 1e-4, 0.0, "FP32 gates, no spec rule"};
// rmsnorm: x_normed (1e-4, 1/128) (§10.2).
inline constexpr Allclose rmsnorm_out{"x_n", 1e-4, kBf16Rtol, 0.0, "§10.2 rmsnorm"};
// qkv_proj_rope: q, kv (1e-4, 1/128); qr (atol 1, 0 %); qr_scale (2.5e-5, 5e-3) (§10.2).
inline constexpr Allclose qkv_q{"q", 1e-4, kBf16Rtol, 0.0, "§10.2 qkv_proj_rope"};
inline constexpr Allclose qkv_kv{"kv", 1e-4, kBf16Rtol, 0.0, "§10.2 qkv_proj_rope"};
inline constexpr Allclose qkv_qr{"qr", 1.0, 0.0, 0.0, "§10.2 qkv_proj_rope"};
inline constexpr Allclose qkv_qr_scale{"qr_scale", 2.5e-5, 5e-3, 0.0, "§10.2 qkv_proj_rope"};
// Pools (§10.2, §12.4 mapped-pool budgets): kv_cache (1e-4, 1/128, 0.5 %); compressed rows and
// compressor states 0 %; index cache codes +-1 on <= 1 %, their scales (1e-4, 1/128, 1 %).
inline constexpr Allclose kv_cache{"kv_cache", 1e-4, kBf16Rtol, 0.005, "§10.2 / §12.4 kv_cache"};
inline constexpr Allclose cmp_kv{"cmp_kv", 1e-4, kBf16Rtol, 0.0, "§10.2 cmp_kv_cache"};
inline constexpr Allclose compress_state{"compress_state", 1e-3, 1e-3, 0.0, "§10.2 compress_state"};
inline constexpr Allclose idx_kv_cache{"idx_kv_cache", 1.0, 0.0, 0.01, "§10.2 idx_kv_cache"};
inline constexpr Allclose idx_kv_scale{"idx_kv_scale", 1e-4, kBf16Rtol, 0.01, "§10.2 idx_kv_scale"};
// Indexer (§10.2): score on the visible region (golden != NEG_BIG) (1e-4, 1/128, 0.5 %), the tail
// exact; top-k by topk_pair_compare. The query (INT8 codes +-1 like qr, 0.5 % as §12.1's [PRO]
// qr rule; scales like qr_scale) and the head weights (FP32 rows of a BF16 matmul: the BF16 rule)
// have no rule of their own.
inline constexpr Allclose idx_score{"score", 1e-4, kBf16Rtol, 0.005, "§10.2 indexer score"};
inline constexpr Allclose idx_q_i8{"q_i8", 1.0, 0.0, 0.005, "§12.1 [PRO] qr codes rule"};
inline constexpr Allclose idx_q_scale{"q_scale", 2.5e-5, 5e-3, 0.0, "qr_scale rule of §10.2"};
inline constexpr Allclose idx_weights{"weights", 1e-4, kBf16Rtol, 0.0, "BF16 rule of §10.2"};
// Sparse attention: attn_out / o_packed (1e-4, 1/128, 0.5 %) (§10.2, §12.3); the output
// projection's result is held to the same rule (its TP variant is 0 %, §12.3, on partial sums).
inline constexpr Allclose sparse_attn_out{"o_packed", 1e-4, kBf16Rtol, 0.005, "§10.2 sparse_attn"};
inline constexpr Allclose o_proj_out{"attn_out", 1e-4, kBf16Rtol, 0.005, "§10.2 sparse_attn"};
// hc_post's x_out, alone (inputs from golden): FP32 combination of FP32/BF16 inputs.
inline constexpr Allclose hc_post_out{"x_out", 1e-5, 1e-5, 0.0, "FP32 rows, no spec rule"};
// A whole layer's pools over one or more steps, by the mapped-pool comparator: the layer rows of
// the addendum (§12.3 [DSP], §12.4 [PRO]); every kernel alone is held to the operator rules above.
inline constexpr Allclose layer_kv_cache{"kv_cache", 1e-4, kBf16Rtol, 0.005,
                                         "§12.3 SWA/CSA layer kv_cache (mapped)"};
inline constexpr Allclose layer_csa_cmp_kv{"cmp_kv", 1e-4, kBf16Rtol, 0.005,
                                           "§12.3 CSA layer cmp_kv (mapped)"};
inline constexpr Allclose layer_hca_pool{"kv_cache/cmp_kv/compress_state", 1e-3, kBf16Rtol, 0.005,
                                         "§12.3 HCA layer pools (mapped)"};
inline constexpr Allclose layer_csa_state{"compress_state", 1e-3, 1e-3, 0.005,
                                          "§12.3 CSA layer states (mapped)"};
inline constexpr Allclose layer_idx_kv_cache{"idx_kv_cache", 1.0, 0.0, 0.01,
                                             "§12.3 CSA layer idx_kv_cache (mapped)"};
inline constexpr Allclose layer_idx_kv_scale{"idx_kv_scale", 1e-4, kBf16Rtol, 0.01,
                                             "§12.3 CSA layer idx_kv_scale (mapped)"};
// A whole layer's x_out (§10.2 attention_csa / _hca / _swa; §12.3 hw rows).
inline constexpr Reldiff layer_x_out_csa{"x_out", 4e-3, 0.008, 1.0, "§10.2 attention_csa"};
inline constexpr Reldiff layer_x_out{"x_out", 3e-3, 0.008, 1.0, "§10.2 attention_hca/swa"};

template <class A, class E>
testing::AssertionResult check(const Allclose& r, const A& actual, const E& expected) {
  auto res = ratio_allclose(std::span<const float>(actual), std::span<const float>(expected),
                            r.atol, r.rtol, r.max_error_ratio);
  if (!res) res << " [rule " << r.name << ": " << r.source << "]";
  return res;
}
template <class A, class E>
testing::AssertionResult check(const Reldiff& r, const A& actual, const E& expected) {
  auto res = ratio_reldiff(std::span<const float>(actual), std::span<const float>(expected),
                           r.diff_thd, r.pct_thd, r.max_diff_hd);
  if (!res) res << " [rule " << r.name << ": " << r.source << "]";
  return res;
}

// The mapped-pool comparator (addendum §12.1): a pool [rows, width] and the slot mappings of the
// step (entries -1 or a row); the mapped rows are compared with rule `r` over those rows only,
// and every other row must equal golden's bit for bit (no stray writes).
template <class T>
testing::AssertionResult check_mapped(
    const Allclose& r, tiledecode::ConstView<T, 2> actual, tiledecode::ConstView<T, 2> expected,
    std::initializer_list<tiledecode::ConstView<std::int64_t, 1>> slot_mappings) {
  using tiledecode::index_t;
  if (actual.shape() != expected.shape())
    return testing::AssertionFailure() << r.name << ": pool shapes differ";
  const index_t rows = actual.extent(0), width = actual.extent(1);
  std::vector<char> mapped(std::size_t(rows), 0);
  for (const auto& m : slot_mappings)
    for (index_t t = 0; t < m.extent(0); ++t) {
      const std::int64_t s = m(t);
      if (s == -1) continue;
      if (s < 0 || s >= rows)
        return testing::AssertionFailure() << r.name << ": slot " << s << " of token " << t
                                           << " outside the pool's " << rows << " rows";
      mapped[std::size_t(s)] = 1;
    }
  std::vector<float> a, e;
  auto to_f = [](const T& x) {
    if constexpr (std::is_same_v<T, tiledecode::bf16>)
      return x.to_float();
    else
      return static_cast<float>(x);
  };
  for (index_t i = 0; i < rows; ++i) {
    if (mapped[std::size_t(i)]) {
      for (index_t j = 0; j < width; ++j) {
        a.push_back(to_f(actual(i, j)));
        e.push_back(to_f(expected(i, j)));
      }
    } else {
      for (index_t j = 0; j < width; ++j)
        if (std::memcmp(&actual(i, j), &expected(i, j), sizeof(T)) != 0)
          return testing::AssertionFailure()
                 << r.name << ": unmapped row " << i << " differs from golden at column " << j
                 << " (a stray write) [rule " << r.name << ": " << r.source << ", §12.1 mapped]";
    }
  }
  return check(r, a, e);
}

}  // namespace tdtest::tol
