// Fuzz target: lightning-indexer score and top-k (kernels/indexer.hpp, kernels/topk.hpp) with
// arbitrary positions, kv lengths (hence visible lengths), index block tables, pool sizes,
// INT8 rows (including -128), scales, and NaN/Inf in weights, key scales and raw score rows.
// Invariants:
//  * a call throws tiledecode::Error iff a plain model of the documented validation says the
//    arguments are invalid, and then the output is byte-identical to before (nothing written);
//  * a valid score equals golden::indexer_score within FP32 summation error, is kNegBig at and
//    after vis_t, is finite when every input is finite, and is bit-identical for scalar/AVX2
//    and for 1/3 threads; no write lands outside the score or top-k views (canaries);
//  * top-k equals golden::indexer_topk exactly (descending score, ascending column), every slot
//    is written, every index is -1 or in [offset, offset + vis_t), never a NaN score, no repeats.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <vector>

#include "fuzz_common.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/golden/indexer.hpp"
#include "tiledecode/kernels/topk.hpp"

namespace td = tiledecode;
namespace tk = tiledecode::kernels;
using td::index_t;

namespace {

using tdfuzz::g_verbose;
using tdfuzz::kFill;
using tdfuzz::Mix;
using tdfuzz::threw_error;

float special(FuzzedDataProvider& in, float normal_value) {
  switch (in.ConsumeIntegralInRange(0, 15)) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    case 2:
      return -std::numeric_limits<float>::infinity();
    case 3:
      return 0.0f;
    case 4:
      return -0.0f;
    case 5:
      return td::kNegBig;
    case 6:
      return -1.0f;
    default:
      return normal_value;
  }
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// Checks one top-k result row against golden and the invariants.
void check_topk(const std::int32_t* got, const std::int32_t* want, index_t width, const float* row,
                index_t vis, int k, std::int32_t offset) {
  std::set<std::int32_t> seen;
  index_t non_nan = 0;
  for (index_t j = 0; j < vis; ++j) non_nan += !std::isnan(row[j]);
  const index_t n = std::min<index_t>(k, non_nan);
  for (index_t i = 0; i < width; ++i) {
    TDFUZZ_CHECK(got[i] == want[i], i, got[i]);
    if (i >= n) {
      TDFUZZ_CHECK(got[i] == -1, i, got[i]);
      continue;
    }
    const index_t col = index_t(got[i]) - offset;
    TDFUZZ_CHECK(col >= 0 && col < vis, i, got[i]);
    TDFUZZ_CHECK(!std::isnan(row[col]), i, col);
    TDFUZZ_CHECK(seen.insert(got[i]).second, i, got[i]);
  }
}

void fuzz_topk_rows(FuzzedDataProvider& in, Mix& mix, const td::cpu::Context& ctx) {
  const index_t rows = in.ConsumeIntegralInRange<index_t>(0, 4);
  const index_t n = in.ConsumeIntegralInRange<index_t>(0, 600);
  const int k = in.ConsumeIntegralInRange<int>(-1, int(n) + 1);
  const index_t width = std::max<index_t>(0, k + in.ConsumeIntegralInRange<index_t>(-1, 5));
  static constexpr std::int32_t kOffsets[] = {0, 128,
                                              std::numeric_limits<std::int32_t>::max() - 600, -1};
  const std::int32_t offset = in.PickValueInArray(kOffsets);
  const int distinct = in.ConsumeIntegralInRange(1, 40);  // few distinct values → many ties
  std::vector<float> score(static_cast<std::size_t>(rows * n));
  for (auto& s : score) {
    s = float(std::int64_t(mix.next() % std::uint64_t(distinct)) - distinct / 2);
    if (mix.next() % 16 == 0) s = special(in, s);
  }
  std::vector<std::int32_t> vlen(static_cast<std::size_t>(rows));
  for (auto& v : vlen) v = std::int32_t(in.ConsumeIntegralInRange<index_t>(-1, n + 1));
  tdfuzz::Guarded<std::int32_t> dst(static_cast<std::size_t>(rows * width), kFill);
  const bool threw = threw_error([&] {
    tk::topk_rows(ctx, td::View<std::int32_t, 2>(dst.data(), {rows, width}),
                  td::ConstView<float, 2>(score.data(), {rows, n}),
                  td::ConstView<std::int32_t, 1>(vlen.data(), {rows}), k, offset);
  });
  bool valid = k >= 1 && k <= n && width >= k && offset >= 0 &&
               index_t(offset) <= index_t(std::numeric_limits<std::int32_t>::max()) - n;
  for (auto v : vlen) valid = valid && v >= 0 && v <= n;
  TDFUZZ_CHECK(threw == !valid, threw);
  TDFUZZ_CHECK(dst.canaries_intact());
  if (threw) {
    TDFUZZ_CHECK(dst.body_is(kFill));
    return;
  }
  for (index_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t> want(static_cast<std::size_t>(width));
    td::golden::topk_row(want, std::span<const float>(score.data() + r * n, std::size_t(vlen[r])),
                         k, offset);
    check_topk(dst.data() + r * width, want.data(), width, score.data() + r * n, vlen[r], k,
               offset);
  }
}

void fuzz_score_and_topk(FuzzedDataProvider& in, Mix& mix, const td::cpu::Context& ctx,
                         td::cpu::Context other_ctx) {
  td::ModelConfig cfg = td::flash_config();
  static constexpr int kHeads[] = {16, 32};
  static constexpr int kMaxLens[] = {512, 2048};
  cfg.idx_n_heads = in.PickValueInArray(kHeads);
  cfg.max_seq_len = in.PickValueInArray(kMaxLens);
  const index_t H = cfg.idx_n_heads, N = cfg.score_len(), page = cfg.page;
  const int B = in.ConsumeIntegralInRange(1, 3), seq = in.ConsumeIntegralInRange(1, 3);
  const index_t T = index_t(B) * seq;
  // Positions and lengths: mostly valid, sometimes off by one on either side.
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T)), kvl(static_cast<std::size_t>(B));
  for (auto& p : pos) {
    p = in.ConsumeProbability<float>() < 0.03f ? (in.ConsumeBool() ? -1 : cfg.max_seq_len)
                                               : in.ConsumeIntegralInRange(0, cfg.max_seq_len - 1);
  }
  for (auto& l : kvl) {
    l = in.ConsumeProbability<float>() < 0.03f ? (in.ConsumeBool() ? -1 : cfg.max_seq_len + 1)
                                               : in.ConsumeIntegralInRange(0, cfg.max_seq_len);
  }
  const index_t blocks = in.ConsumeIntegralInRange<index_t>(1, 4);
  const index_t pool_rows = blocks * page + (in.ConsumeProbability<float>() < 0.03f ? 5 : 0);
  const index_t cols = in.ConsumeIntegralInRange<index_t>(0, 5);
  std::vector<std::int32_t> table(static_cast<std::size_t>(B * cols));
  for (auto& e : table) {
    e = in.ConsumeProbability<float>() < 0.05f
            ? std::int32_t(in.ConsumeBool() ? -2 : blocks)
            : std::int32_t(in.ConsumeIntegralInRange<index_t>(-1, blocks - 1));
  }
  std::vector<std::int8_t> q(static_cast<std::size_t>(T * H * 128)),
      kc(static_cast<std::size_t>(pool_rows * 128));
  for (auto& v : q) v = std::int8_t(mix.next());  // every int8 value, -128 included
  for (auto& v : kc) v = std::int8_t(mix.next());
  std::vector<float> qs(static_cast<std::size_t>(T * H)), w(static_cast<std::size_t>(T * H)),
      ks(static_cast<std::size_t>(pool_rows));
  const bool specials = in.ConsumeProbability<float>() < 0.3f;
  for (auto& v : qs) v = 1e-4f + mix.unit() * 0.05f;
  for (auto& v : w) v = (mix.unit() - 0.5f) * 4.0f;
  for (auto& v : ks) v = 1e-4f + mix.unit() * 0.05f;
  if (specials) {  // NaN/Inf/zero/negative in a few places
    const int n_special = in.ConsumeIntegralInRange(1, 4);
    for (int i = 0; i < n_special; ++i) {
      switch (in.ConsumeIntegralInRange(0, 2)) {
        case 0:
          qs[in.ConsumeIntegralInRange<std::size_t>(0, qs.size() - 1)] = special(in, 0.0f);
          break;
        case 1:
          w[in.ConsumeIntegralInRange<std::size_t>(0, w.size() - 1)] = special(in, 1e30f);
          break;
        default:
          ks[in.ConsumeIntegralInRange<std::size_t>(0, ks.size() - 1)] = special(in, 1e30f);
      }
    }
  }
  td::View<std::int32_t, 1> pv(pos.data(), {T});
  td::View<std::int32_t, 1> lv(kvl.data(), {index_t(B)});
  td::ConstView<std::int8_t, 3> qv(q.data(), {T, H, 128});
  td::ConstView<float, 2> qsv(qs.data(), {T, H}), wv(w.data(), {T, H});
  td::ConstView<std::int8_t, 2> kcv(kc.data(), {pool_rows, 128});
  td::ConstView<float, 1> ksv(ks.data(), {pool_rows});
  td::ConstView<std::int32_t, 2> tv(table.data(), {index_t(B), cols});

  // Validation model (kernels/indexer.hpp: indexer_score).
  bool meta_ok = true;
  for (auto p : pos) meta_ok = meta_ok && p >= 0 && p < cfg.max_seq_len;
  for (auto l : kvl) meta_ok = meta_ok && l >= 0 && l <= cfg.max_seq_len;
  bool valid = meta_ok && pool_rows % page == 0;
  for (auto v : qs) valid = valid && v > 0.0f && std::isfinite(v);
  for (auto e : table) valid = valid && e >= -1 && e < blocks;
  std::vector<index_t> vis(static_cast<std::size_t>(T), 0);
  if (meta_ok) {
    for (index_t t = 0; t < T; ++t) {
      vis[t] = tk::indexer_visible_rows(cfg, pos[t], kvl[t / seq]);
      const index_t pages = (vis[t] + page - 1) / page;
      if (pages > cols) valid = false;
      for (index_t c = 0; c < std::min(pages, cols); ++c)
        if (table[(t / seq) * cols + c] < 0) valid = false;
    }
  }
  tdfuzz::Guarded<float> score(static_cast<std::size_t>(T * N), kFill);
  td::View<float, 2> sv(score.data(), {T, N});
  const bool threw =
      threw_error([&] { tk::indexer_score(ctx, cfg, sv, qv, qsv, wv, kcv, ksv, tv, pv, lv, seq); });
  TDFUZZ_CHECK(threw == !valid, threw);
  TDFUZZ_CHECK(score.canaries_intact());
  if (threw) {
    TDFUZZ_CHECK(score.body_is(kFill));
  } else {
    // Same result on the other ISA / thread count (the header promises bit-identical paths).
    tdfuzz::Guarded<float> score2(static_cast<std::size_t>(T * N), kFill);
    tk::indexer_score(other_ctx, cfg, td::View<float, 2>(score2.data(), {T, N}), qv, qsv, wv, kcv,
                      ksv, tv, pv, lv, seq);
    TDFUZZ_CHECK(score2.same_as(score.snapshot()));
    std::vector<float> gold(static_cast<std::size_t>(T * N));
    td::golden::indexer_score(cfg, td::View<float, 2>(gold.data(), {T, N}), qv, qsv, wv, kcv, ksv,
                              tv, pv, lv, seq);
    const bool finite_in = all_finite(w) && all_finite(ks);
    for (index_t t = 0; t < T; ++t) {
      const index_t b = t / seq;
      for (index_t j = 0; j < N; ++j) {
        const float a = score[t * N + j], e = gold[t * N + j];
        if (j >= vis[t]) {
          TDFUZZ_CHECK(a == td::kNegBig, t, j);
          continue;
        }
        // FP32 vs double summation: bound by the magnitude of the summed terms. The kernel works
        // in FP32, so finite inputs give a finite score only while no FP32 intermediate can
        // overflow: each dequantised dot, the weighted head-sum before the key scale, and the
        // result (the header's "up to FP32 overflow").
        const index_t row = table[b * cols + j / page] * page + j % page;
        double mag = 0, max_term = 0;
        for (index_t h = 0; h < H; ++h) {
          std::int64_t dot = 0;
          for (index_t d = 0; d < 128; ++d)
            dot += std::int64_t(q[(t * H + h) * 128 + d]) * kc[row * 128 + d];
          const double term = std::max(0.0, double(qs[t * H + h]) * double(dot));
          max_term = std::max(max_term, term);
          mag += std::fabs(double(w[t * H + h])) * term;
        }
        const double pre_scale = mag;
        mag *= std::fabs(double(ks[row]));
        constexpr double kNoOverflow = 1e37;  // FLT_MAX / 34: margin for FP32 rounding
        const bool fp32_safe =
            max_term < kNoOverflow && pre_scale < kNoOverflow && mag < kNoOverflow;
        if (finite_in && fp32_safe) TDFUZZ_CHECK(std::isfinite(a), t, j);
        if (std::isnan(e)) {
          TDFUZZ_CHECK(std::isnan(a), t, j);
          continue;
        }
        // An FP32 intermediate may overflow (to ±inf, or NaN from inf − inf) where the double
        // golden stays finite, e.g. a head-sum of 5e40 scaled by a key scale of 1e-3: the score
        // is then outside what FP32 represents on the way and only NaN-ness is comparable.
        if (!fp32_safe || !std::isfinite(mag) || !std::isfinite(e)) continue;
        TDFUZZ_CHECK(std::fabs(double(a) - double(e)) <= 1e-5 * mag + 1e-30, t, j);
      }
    }
  }

  // Top-k over the kernel's score (or, if it was rejected, over a fuzzed score with specials).
  std::vector<float> sc(static_cast<std::size_t>(T * N));
  if (!threw) {
    for (index_t i = 0; i < T * N; ++i) sc[i] = score[i];
  } else {
    for (auto& v : sc) v = mix.next() % 8 == 0 ? special(in, 1.0f) : float(mix.next() % 9);
  }
  const int topk =
      in.ConsumeProbability<float>() < 0.05f ? int(N) + 1 : in.ConsumeIntegralInRange(1, int(N));
  const index_t width = topk + in.ConsumeIntegralInRange<index_t>(0, 3);
  const std::int32_t offset = in.ConsumeBool() ? 0 : 128;
  tdfuzz::Guarded<std::int32_t> sel(static_cast<std::size_t>(T * width), kFill);
  td::ConstView<float, 2> scv(sc.data(), {T, N});
  const bool threw_k = threw_error([&] {
    tk::indexer_topk(ctx, cfg, td::View<std::int32_t, 2>(sel.data(), {T, width}), scv, pv, lv, seq,
                     topk, offset);
  });
  TDFUZZ_CHECK(threw_k == !(meta_ok && topk <= N), threw_k);
  TDFUZZ_CHECK(sel.canaries_intact());
  if (threw_k) {
    TDFUZZ_CHECK(sel.body_is(kFill));
    return;
  }
  std::vector<std::int32_t> want(static_cast<std::size_t>(T * width));
  td::golden::indexer_topk(cfg, td::View<std::int32_t, 2>(want.data(), {T, width}), scv, pv, lv,
                           seq, topk, offset);
  for (index_t t = 0; t < T; ++t)
    check_topk(sel.data() + t * width, want.data() + t * width, width, sc.data() + t * N,
               std::min<index_t>(vis[t], N), topk, offset);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  static td::ThreadPool pool3(3);
  FuzzedDataProvider in(data, size);
  Mix mix{in.ConsumeIntegral<std::uint64_t>()};
  // One tier under test, compared bit for bit with another (scalar vs the best SIMD tier).
  static const std::vector<td::cpu::Isa> kIsas = td::cpu::supported_isas();
  const td::cpu::Isa isa = kIsas[in.ConsumeIntegralInRange<std::size_t>(0, kIsas.size() - 1)];
  const td::cpu::Isa other = isa == td::cpu::Isa::scalar ? kIsas.back() : td::cpu::Isa::scalar;
  const bool threads = in.ConsumeBool();
  const td::cpu::Context ctx{threads ? &pool3 : nullptr, isa};
  const td::cpu::Context other_ctx{threads ? nullptr : &pool3, other};
  if (in.ConsumeBool()) {
    fuzz_topk_rows(in, mix, ctx);
  } else {
    fuzz_score_and_topk(in, mix, ctx, other_ctx);
  }
  return 0;
}
