#pragma once
// The spec's comparators (§10.1), as gtest assertion helpers that explain a failure.
//   ratio_allclose(atol, rtol, max_error_ratio): |a-e| > atol + rtol*|e| fails a point; pass iff
//       failing fraction <= max_error_ratio; any NaN/Inf in actual fails.
//   ratio_reldiff(diff_thd, pct_thd, max_diff_hd): see spec.
//   topk_pair_compare: position-wise; at a mismatch the actual paired scores must stay
//       non-increasing with both neighbours (a tie swap passes, a worse pick fails).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace tdtest {

inline testing::AssertionResult ratio_allclose(std::span<const float> actual,
                                               std::span<const float> expected, double atol,
                                               double rtol, double max_error_ratio = 0.005) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure() << "size " << actual.size() << " vs " << expected.size();
  }
  std::size_t bad = 0, first = actual.size();
  double worst = 0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (!std::isfinite(a)) {
      return testing::AssertionFailure() << "non-finite actual " << a << " at " << i;
    }
    const double d = std::fabs(a - e);
    if (d > atol + rtol * std::fabs(e)) {
      if (bad++ == 0) first = i;
      if (d > worst) {
        worst = d;
        worst_i = i;
      }
    }
  }
  const double ratio = actual.empty() ? 0.0 : double(bad) / double(actual.size());
  if (ratio <= max_error_ratio) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << bad << "/" << actual.size() << " points fail (ratio " << ratio << " > "
         << max_error_ratio << "); first at " << first << " (a=" << actual[first]
         << ", e=" << expected[first] << "), worst at " << worst_i << " (a=" << actual[worst_i]
         << ", e=" << expected[worst_i] << ")";
}

inline testing::AssertionResult ratio_reldiff(std::span<const float> actual,
                                              std::span<const float> expected, double diff_thd,
                                              double pct_thd, double max_diff_hd = INFINITY) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure() << "size " << actual.size() << " vs " << expected.size();
  }
  std::size_t bad = 0;
  double worst = 0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (!std::isfinite(a)) {
      return testing::AssertionFailure() << "non-finite actual " << a << " at " << i;
    }
    const double d = std::fabs(a - e);
    const double den =
        std::max({std::fabs(a), std::fabs(e), std::ldexp(1.0, -14) / diff_thd}) + 1e-9;
    const double rd = d < diff_thd ? d : d / den;
    if (rd > diff_thd) {
      ++bad;
      if (rd > worst) {
        worst = rd;
        worst_i = i;
      }
    }
  }
  const double pct = actual.empty() ? 0.0 : double(bad) / double(actual.size());
  if (pct <= pct_thd && worst < max_diff_hd) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << bad << "/" << actual.size() << " points over " << diff_thd << " (" << pct * 100
         << "% > " << pct_thd * 100 << "%), worst rd " << worst << " at " << worst_i
         << " (a=" << actual[worst_i] << ", e=" << expected[worst_i] << ")";
}

// Tie-tolerant top-k comparison of one row. `score_of(idx)` returns the actual score paired with
// an index (the kernel's own score row). Both lists have the same length; -1 entries must match.
template <class ScoreOf>
testing::AssertionResult topk_pair_compare(std::span<const std::int32_t> actual,
                                           std::span<const std::int32_t> expected,
                                           ScoreOf&& score_of) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure() << "size " << actual.size() << " vs " << expected.size();
  }
  const std::size_t n = actual.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (actual[i] == expected[i]) continue;
    if ((actual[i] < 0) != (expected[i] < 0)) {
      return testing::AssertionFailure() << "position " << i << ": actual " << actual[i]
                                         << " vs expected " << expected[i] << " (padding differs)";
    }
    const float s = score_of(actual[i]);
    if (i > 0 && actual[i - 1] >= 0 && score_of(actual[i - 1]) < s) {
      return testing::AssertionFailure() << "position " << i << ": score " << s
                                         << " exceeds its predecessor " << score_of(actual[i - 1]);
    }
    if (i + 1 < n && actual[i + 1] >= 0 && score_of(actual[i + 1]) > s) {
      return testing::AssertionFailure() << "position " << i << ": score " << s
                                         << " below its successor " << score_of(actual[i + 1]);
    }
    // A swap among equal scores is fine; a different pick must score the same as expected's.
    const float se = score_of(expected[i]);
    if (s != se) {
      return testing::AssertionFailure()
             << "position " << i << ": picked " << actual[i] << " (score " << s << ") instead of "
             << expected[i] << " (score " << se << ")";
    }
  }
  return testing::AssertionSuccess();
}

// Top-k of a kernel against golden's when the two ranked slightly different scores (a layer
// step: the kernel's scores come from its own upstream results): where the picks differ, golden's
// scores of the two picks must agree within the score rule (atol + rtol |e|) - a near-tie
// reordered by last-bit differences passes, a clearly worse pick fails. -1 padding must match.
inline testing::AssertionResult topk_near_tie_compare(std::span<const std::int32_t> actual,
                                                      std::span<const std::int32_t> expected,
                                                      std::span<const float> golden_score,
                                                      double atol, double rtol) {
  if (actual.size() != expected.size())
    return testing::AssertionFailure() << "size " << actual.size() << " vs " << expected.size();
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] == expected[i]) continue;
    if (actual[i] < 0 || expected[i] < 0)
      return testing::AssertionFailure() << "position " << i << ": padding differs";
    if (std::size_t(actual[i]) >= golden_score.size())
      return testing::AssertionFailure()
             << "position " << i << ": index " << actual[i] << " outside the score row";
    const double sa = golden_score[std::size_t(actual[i])],
                 se = golden_score[std::size_t(expected[i])];
    if (std::fabs(sa - se) > atol + rtol * std::fabs(se))
      return testing::AssertionFailure()
             << "position " << i << ": picked " << actual[i] << " (golden score " << sa
             << ") instead of " << expected[i] << " (golden score " << se << ")";
  }
  return testing::AssertionSuccess();
}

// Floats of a BF16 span, for the comparators.
template <class Bf16>
std::vector<float> to_floats(std::span<const Bf16> v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = v[i].to_float();
  return r;
}

}  // namespace tdtest
