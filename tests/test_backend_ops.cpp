// backend_ops: every kernel of the decode step on every backend of this machine, against golden
// (the ggml test-backend-ops idea). One table:
//
//   kernels   hc_pre, rmsnorm, qkv_proj_rope, kv_cache_write, compressor, idx_compressor,
//             indexer_query (+ weights), indexer_score, indexer_topk, sparse_attn, o_proj, hc_post
//   backends  scalar, avx2, avx2_vnni, avx512 (the CPU tiers; a tier this CPU lacks is skipped with
//   a
//             message) and a2a3 (the Ascend execution model)
//   cases     per family (SWA, CSA, HCA) the spec's canonical start set (§10.3, all tokens
//             committed) and a seeded random start set (MTP, commit_tokens = 1)
//
// Each kernel runs ALONE on golden inputs: the golden layer (golden/decode_layer.hpp, its own
// metadata, double accumulation) records every intermediate; the backend's layer plan
// (decode::plan_layer_step) is fed those intermediates through its workspace views and the pools as
// golden had them before (for the kernel that writes a pool) or after (for the kernels that read
// it), and decode::run_layer_kernel runs the one kernel. So a failure names the kernel and the
// backend, never an upstream one. Every output is compared with its one named rule of
// tests/common/tolerances.hpp. Whether a backend implements a kernel is a compile-time fact
// (tiledecode::implements) that the table states; nothing is discovered by an exception.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/decode_fixture.hpp"
#include "common/tolerances.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/golden/decode_layer.hpp"
#include "tiledecode/tile/backend.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::decode::Kernel;

namespace {

// ---- the backends --------------------------------------------------------------------------
enum class BackendId { scalar, avx2, avx2_vnni, avx512, a2a3 };
constexpr BackendId kBackendIds[] = {BackendId::scalar, BackendId::avx2, BackendId::avx2_vnni,
                                     BackendId::avx512, BackendId::a2a3};

constexpr const char* name_of(BackendId b) {
  switch (b) {
    case BackendId::scalar:
      return "scalar";
    case BackendId::avx2:
      return "avx2";
    case BackendId::avx2_vnni:
      return "avx2_vnni";
    case BackendId::avx512:
      return "avx512";
    case BackendId::a2a3:
      return "a2a3";
  }
  return "?";
}

// The backend types the tile programs are instantiated with.
template <BackendId B>
struct backend_type;
template <>
struct backend_type<BackendId::scalar> {
  using type = td::cpu::Cpu<td::cpu::Isa::scalar>;
};
template <>
struct backend_type<BackendId::avx2> {
  using type = td::cpu::Cpu<td::cpu::Isa::avx2>;
};
template <>
struct backend_type<BackendId::avx2_vnni> {
  using type = td::cpu::Cpu<td::cpu::Isa::avx2_vnni>;
};
template <>
struct backend_type<BackendId::avx512> {
  using type = td::cpu::Cpu<td::cpu::Isa::avx512>;
};
template <>
struct backend_type<BackendId::a2a3> {
  using type = td::a2a3::A2a3;
};

// Whether backend B implements kernel k: the families of its programs (compile time).
template <class B>
constexpr bool implements_kernel(Kernel k) {
  namespace K = td::kernels;
  switch (k) {
    case Kernel::hc_pre:
      return td::implements<K::HcPre, B>;
    case Kernel::rmsnorm:
      return td::implements<K::RmsNorm, B>;
    case Kernel::qkv_projection:
      return td::implements<K::QkvProjection, B>;
    case Kernel::cache_write:
      return td::implements<K::CacheWrite, B>;
    case Kernel::compressor:
    case Kernel::indexer_compressor:
      return td::implements<K::Compressor, B>;
    case Kernel::indexer_query:
      return td::implements<K::IndexerQuery, B> && td::implements<K::IndexerWeights, B>;
    case Kernel::indexer_score:
      return td::implements<K::IndexerScore, B>;
    case Kernel::indexer_topk:
      return td::implements<K::IndexerTopk, B>;
    case Kernel::sparse_attention:
      return td::implements<K::SparseAttention, B>;
    case Kernel::output_projection:
      return td::implements<K::OutputProjection, B>;
    case Kernel::hc_post:
      return td::implements<K::HcPost, B>;
    case Kernel::count:
      break;
  }
  return false;
}

bool implements_kernel(BackendId b, Kernel k) {
  switch (b) {
    case BackendId::scalar:
      return implements_kernel<backend_type<BackendId::scalar>::type>(k);
    case BackendId::avx2:
      return implements_kernel<backend_type<BackendId::avx2>::type>(k);
    case BackendId::avx2_vnni:
      return implements_kernel<backend_type<BackendId::avx2_vnni>::type>(k);
    case BackendId::avx512:
      return implements_kernel<backend_type<BackendId::avx512>::type>(k);
    case BackendId::a2a3:
      return implements_kernel<backend_type<BackendId::a2a3>::type>(k);
  }
  return false;
}

// Every backend implements every kernel of the decode step today; the table below prints it and
// this states it at compile time (a backend that drops a family fails the build here, and the
// table would then say "unsupported" instead of running it).
template <class B>
constexpr bool implements_all() {
  for (int k = 0; k < td::decode::kNumKernels; ++k)
    if (!implements_kernel<B>(Kernel(k))) return false;
  return true;
}
static_assert(implements_all<backend_type<BackendId::scalar>::type>());
static_assert(implements_all<backend_type<BackendId::avx2>::type>());
static_assert(implements_all<backend_type<BackendId::avx2_vnni>::type>());
static_assert(implements_all<backend_type<BackendId::avx512>::type>());
static_assert(implements_all<backend_type<BackendId::a2a3>::type>());

// The CPU tier of a CPU backend (scalar for the a2a3 model, which runs on its own).
td::cpu::Isa isa_of(BackendId b) {
  return b == BackendId::avx2        ? td::cpu::Isa::avx2
         : b == BackendId::avx2_vnni ? td::cpu::Isa::avx2_vnni
         : b == BackendId::avx512    ? td::cpu::Isa::avx512
                                     : td::cpu::Isa::scalar;
}

// Whether this machine can run backend b (CPU tiers need the CPU's features; the a2a3 model runs
// anywhere), and why not.
bool available(BackendId b, std::string* why) {
  using td::cpu::Isa;
  const Isa isa = isa_of(b);
  if (b == BackendId::a2a3 || td::cpu::cpu_supports(isa)) return true;
  *why = std::string("this CPU lacks the ") + name_of(b) + " tier (" +
         (b == BackendId::avx2        ? "AVX2 + FMA"
          : b == BackendId::avx2_vnni ? "AVX2 + AVX-VNNI"
                                      : "AVX-512 F/BW/VL/VNNI/BF16") +
         ")";
  return false;
}

// ---- the cases -----------------------------------------------------------------------------
struct Case {
  const char* name;
  td::LayerKind kind;
  std::vector<std::int32_t> starts;
  int commit;  // -1 all committed, 1 MTP
};

std::vector<std::int32_t> random_starts(std::uint64_t seed, int max_start) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int> d(0, max_start);
  std::vector<std::int32_t> s(4);
  for (auto& x : s) x = d(g);
  return s;
}

std::vector<Case> cases() {
  const int max_start = td::flash_config().max_seq_len - 2;
  return {
      {"swa_canonical", td::LayerKind::swa, {8192, 127, 31, 8192}, -1},
      {"csa_canonical", td::LayerKind::csa, {8192, 0, 2, 3}, -1},
      {"hca_canonical", td::LayerKind::hca, {8192, 127, 128, 255}, -1},
      {"swa_random_mtp", td::LayerKind::swa, random_starts(101, max_start), 1},
      {"csa_random_mtp", td::LayerKind::csa, random_starts(102, max_start), 1},
      {"hca_random_mtp", td::LayerKind::hca, random_starts(103, max_start), 1},
  };
}

// ---- views <-> vectors ------------------------------------------------------------------------
template <class T, std::size_t R>
std::vector<float> floats(td::ConstView<T, R> v) {
  std::vector<float> r;
  r.reserve(std::size_t(v.size()));
  auto push = [&](const T& x) {
    if constexpr (std::is_same_v<T, bf16>)
      r.push_back(x.to_float());
    else
      r.push_back(static_cast<float>(x));
  };
  if constexpr (R == 1) {
    for (index_t i = 0; i < v.extent(0); ++i) push(v(i));
  } else if constexpr (R == 2) {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j) push(v(i, j));
  } else {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j)
        for (index_t k = 0; k < v.extent(2); ++k) push(v(i, j, k));
  }
  return r;
}
template <class T, std::size_t R>
std::vector<float> floats(td::View<T, R> v) {
  return floats(td::ConstView<T, R>(v));
}
template <class T, std::size_t R>
std::vector<float> floats(const td::Tensor<T, R>& t) {
  return floats(t.view());
}

// dst <- src (same extents; dst may be strided).
template <class T, std::size_t R>
void feed(td::View<T, R> dst, td::ConstView<T, R> src) {
  ASSERT_EQ(dst.shape(), src.shape());
  if constexpr (R == 1) {
    for (index_t i = 0; i < dst.extent(0); ++i) dst(i) = src(i);
  } else if constexpr (R == 2) {
    for (index_t i = 0; i < dst.extent(0); ++i)
      for (index_t j = 0; j < dst.extent(1); ++j) dst(i, j) = src(i, j);
  } else {
    for (index_t i = 0; i < dst.extent(0); ++i)
      for (index_t j = 0; j < dst.extent(1); ++j)
        for (index_t k = 0; k < dst.extent(2); ++k) dst(i, j, k) = src(i, j, k);
  }
}
template <class T, std::size_t R>
void feed(td::View<T, R> dst, const td::Tensor<T, R>& src) {
  feed(dst, src.view());
}

template <class T>
void copy_pool(td::Tensor<T, 2>& dst, const td::Tensor<T, 2>& src) {
  std::copy_n(src.data(), src.size(), dst.data());
}

// ---- one case on one backend ---------------------------------------------------------------

// The model of the table: flash; in the sanitizer pass (TILEDECODE_SANITIZE_LEAN, set by
// scripts/ci_sanitize.sh) the CPU backends run the narrow flash (tests/common/narrow_config.hpp:
// every paging, cache and per-head constant of flash, dense widths cut), the same code paths in
// a fraction of the time under ASan + checked views. The a2a3 model keeps flash: its schedules
// are written for the chip's shapes (it rejects the narrow widths at plan time).
td::ModelConfig table_config(BackendId b) {
  const bool lean = std::getenv("TILEDECODE_SANITIZE_LEAN") != nullptr;
  return lean && b != BackendId::a2a3 ? tdtest::narrow_config() : td::flash_config();
}

// A case's golden layer (every intermediate, the pools after) and the backend's plan of the same
// step, with what feeds one kernel its golden inputs and what compares its outputs.
struct Harness {
  static constexpr int B = 4, S = 2;
  static constexpr index_t T = B * S;
  Case c;
  BackendId bid;
  td::ModelConfig cfg = table_config(bid);  // (bid is declared, so set, before cfg)
  td::ThreadPool pool{2};
  td::cpu::Context host = td::cpu::make_context(&pool);
  td::paged::FixtureTables fx{B, cfg};
  tdtest::LayerSetup L;
  td::decode::LayerCacheStorage after;  // golden's pools after the step
  td::paged::StepShape sh;
  td::Tensor<float, 3> x_hc{{T, 4, cfg.hidden}}, x_out{{T, 4, cfg.hidden}},
      g_out{{T, 4, cfg.hidden}};
  td::golden::LayerTrace tr;
  td::a2a3::Machine machine{&pool};
  td::decode::Backend be;
  td::paged::StepMetadata md{B, S, cfg};
  td::decode::Workspace ws;
  td::decode::LayerPlan plan;

  Harness(Case c_, BackendId b)
      : c(std::move(c_)),
        bid(b),
        L(cfg, c.kind, fx.pools, 2, 4242, host),
        after(L.caches),
        sh{B, S, c.commit},
        be(b == BackendId::a2a3 ? td::decode::Backend::a2a3(&machine)
                                : td::decode::Backend::cpu(&pool, isa_of(b))),
        ws(cfg, B, S, be) {
    td::decode::synthetic::fill_x_hc(host, x_hc.view(), 77, 0);
    td::golden::decode_layer(g_out.view(), x_hc.view(), L.weights.view(), after.view(), c.starts,
                             sh, fx.tables(), L.rope.view(), cfg, {}, &tr);
    md.build(c.starts, sh, fx.tables(), fx.pools, cfg);
    // L.caches still holds the pools as they were before the step.
    td::decode::plan_layer_step(plan, be, x_out.view(), x_hc.view(), L.weights.view(),
                                L.caches.view(), md, L.rope.view(), ws, cfg);
  }

  // Pools as golden had them after the step (what the reading kernels see).
  void pools_after() {
    td::decode::LayerCacheStorage& p = L.caches;
    copy_pool(p.kv_cache, after.kv_cache);
    if (c.kind == td::LayerKind::swa) return;
    copy_pool(p.cmp_kv, after.cmp_kv);
    copy_pool(p.state, after.state);
    if (c.kind != td::LayerKind::csa) return;
    copy_pool(p.inner_state, after.inner_state);
    copy_pool(p.idx_kv_cache, after.idx_kv_cache);
    std::copy_n(after.idx_kv_scale.data(), after.idx_kv_scale.size(), p.idx_kv_scale.data());
  }

  // Kernel k's inputs from golden; the pools it writes stay as before the step.
  void feed_inputs(Kernel k) {
    const td::decode::StepViews& v = plan.v;
    switch (k) {
      case Kernel::hc_pre:
        break;
      case Kernel::rmsnorm:
        feed(v.x_mixed, tr.x_mixed);
        break;
      case Kernel::qkv_projection:
      case Kernel::compressor:
      case Kernel::indexer_compressor:
        feed(v.x_n, tr.x_n);
        break;
      case Kernel::cache_write:
        feed(v.kv, tr.kv);
        break;
      case Kernel::indexer_query:
        feed(v.x_n, tr.x_n);
        feed(v.qr, tr.qr);
        feed(v.qr_scale, tr.qr_scale);
        break;
      case Kernel::indexer_score:
        feed(v.idx_q_i8, tr.idx_q_i8);
        feed(v.idx_q_scale, tr.idx_q_scale);
        feed(v.idx_weights, tr.idx_weights);
        pools_after();
        break;
      case Kernel::indexer_topk:
        feed(v.score, tr.score);
        break;
      case Kernel::sparse_attention:
        feed(v.q, tr.q);
        if (c.kind == td::LayerKind::csa) feed(v.topk_idxs, tr.topk_idxs);
        pools_after();
        break;
      case Kernel::output_projection:
        feed(v.o_packed, tr.o_packed);
        break;
      case Kernel::hc_post:
        feed(v.attn_out, tr.attn_out);
        feed(v.post, tr.post);
        feed(v.comb, tr.comb);
        break;
      case Kernel::count:
        break;
    }
  }

  void run(Kernel k) { td::decode::run_layer_kernel(be, plan, k); }

  // Kernel k's outputs against golden, each with its rule of tolerances.hpp.
  void compare(Kernel k) {
    namespace tol = tdtest::tol;
    const td::decode::StepViews& v = plan.v;
    const td::decode::LayerCacheStorage& p = L.caches;
    auto cv = [](const auto& t) { return std::as_const(t).view(); };
    auto column = [](const td::Tensor<float, 1>& t) {
      return td::ConstView<float, 2>(t.data(), {t.view().extent(0), 1});
    };
    switch (k) {
      case Kernel::hc_pre:
        EXPECT_TRUE(tol::check(tol::hc_x_mixed, floats(v.x_mixed), floats(tr.x_mixed)));
        EXPECT_TRUE(tol::check(tol::hc_gates, floats(v.post), floats(tr.post)));
        EXPECT_TRUE(tol::check(tol::hc_gates, floats(v.comb), floats(tr.comb)));
        break;
      case Kernel::rmsnorm:
        EXPECT_TRUE(tol::check(tol::rmsnorm_out, floats(v.x_n), floats(tr.x_n)));
        break;
      case Kernel::qkv_projection:
        EXPECT_TRUE(tol::check(tol::qkv_q, floats(v.q), floats(tr.q)));
        EXPECT_TRUE(tol::check(tol::qkv_kv, floats(v.kv), floats(tr.kv)));
        EXPECT_TRUE(tol::check(tol::qkv_qr, floats(v.qr), floats(tr.qr)));
        EXPECT_TRUE(tol::check(tol::qkv_qr_scale, floats(v.qr_scale), floats(tr.qr_scale)));
        break;
      case Kernel::cache_write:
        EXPECT_TRUE(tol::check_mapped(tol::kv_cache, cv(p.kv_cache), cv(after.kv_cache),
                                      {cv(tr.ori_slot_mapping)}));
        break;
      case Kernel::compressor:
        EXPECT_TRUE(tol::check_mapped(tol::cmp_kv, cv(p.cmp_kv), cv(after.cmp_kv),
                                      {cv(tr.cmp_slot_mapping)}));
        EXPECT_TRUE(tol::check_mapped(tol::compress_state, cv(p.state), cv(after.state),
                                      {cv(tr.state_slot_mapping)}));
        break;
      case Kernel::indexer_compressor:
        EXPECT_TRUE(tol::check_mapped(tol::compress_state, cv(p.inner_state), cv(after.inner_state),
                                      {cv(tr.inner_state_slot_mapping)}));
        EXPECT_TRUE(tol::check_mapped(tol::idx_kv_cache, cv(p.idx_kv_cache), cv(after.idx_kv_cache),
                                      {cv(tr.idx_slot_mapping)}));
        EXPECT_TRUE(tol::check_mapped(tol::idx_kv_scale, column(p.idx_kv_scale),
                                      column(after.idx_kv_scale), {cv(tr.idx_slot_mapping)}));
        break;
      case Kernel::indexer_query:
        EXPECT_TRUE(tol::check(tol::idx_q_i8, floats(v.idx_q_i8), floats(tr.idx_q_i8)));
        EXPECT_TRUE(tol::check(tol::idx_q_scale, floats(v.idx_q_scale), floats(tr.idx_q_scale)));
        EXPECT_TRUE(tol::check(tol::idx_weights, floats(v.idx_weights), floats(tr.idx_weights)));
        break;
      case Kernel::indexer_score: {
        // Visible region (golden != NEG_BIG) by the score rule, the tail exactly NEG_BIG.
        std::vector<float> a, e;
        std::size_t tail_bad = 0;
        for (index_t t = 0; t < T; ++t)
          for (index_t j = 0; j < cfg.score_len(); ++j) {
            const float ge = tr.score.view()(t, j), ga = v.score(t, j);
            if (ge == td::kNegBig) {
              tail_bad += ga != td::kNegBig;
            } else {
              a.push_back(ga);
              e.push_back(ge);
            }
          }
        EXPECT_EQ(tail_bad, 0u) << "score tail entries that are not NEG_BIG";
        EXPECT_FALSE(e.empty());
        EXPECT_TRUE(tol::check(tol::idx_score, a, e));
        break;
      }
      case Kernel::indexer_topk:
        // The kernel ranked golden's own score rows: tie-tolerant against golden's top-k (spec
        // §10.1), the tail -1.
        for (index_t t = 0; t < T; ++t) {
          const auto score_of = [&](std::int32_t j) { return tr.score.view()(t, j); };
          EXPECT_TRUE(tdtest::topk_pair_compare(
              std::span<const std::int32_t>(&v.topk_idxs(t, 0), std::size_t(cfg.idx_topk)),
              std::span<const std::int32_t>(&tr.topk_idxs.view()(t, 0), std::size_t(cfg.idx_topk)),
              score_of))
              << "row " << t;
          for (index_t j = cfg.idx_topk; j < cfg.score_len(); ++j)
            ASSERT_EQ(v.topk_idxs(t, j), -1) << "row " << t << " col " << j;
        }
        break;
      case Kernel::sparse_attention:
        EXPECT_TRUE(tol::check(tol::sparse_attn_out, floats(v.o_packed), floats(tr.o_packed)));
        break;
      case Kernel::output_projection:
        EXPECT_TRUE(tol::check(tol::o_proj_out, floats(v.attn_out), floats(tr.attn_out)));
        break;
      case Kernel::hc_post:
        EXPECT_TRUE(tol::check(tol::hc_post_out, floats(x_out.view()), floats(g_out.view())));
        break;
      case Kernel::count:
        break;
    }
  }
};

class BackendOps : public testing::TestWithParam<std::tuple<BackendId, int>> {};

TEST_P(BackendOps, EveryKernelMatchesGolden) {
  const Case c = cases()[std::size_t(std::get<1>(GetParam()))];
  const BackendId bid = std::get<0>(GetParam());
  std::string why;
  if (!available(bid, &why)) GTEST_SKIP() << name_of(bid) << ": " << why;
  Harness h(c, bid);
  int ran = 0;
  for (const Kernel k : td::decode::layer_kernels(c.kind)) {
    const std::string kname(td::decode::to_string(k));
    SCOPED_TRACE("kernel " + kname + " on " + name_of(bid) + ", case " + c.name);
    if (!implements_kernel(bid, k)) {
      std::printf("  %-16s %-10s unsupported (no backend_ops specialisation)\n", kname.c_str(),
                  name_of(bid));
      continue;
    }
    h.feed_inputs(k);
    h.run(k);
    h.compare(k);
    ++ran;
  }
  EXPECT_EQ(ran, int(td::decode::layer_kernels(c.kind).size()));
}

// The harness can fail: a kernel fed a perturbed input, or an output disturbed after the run,
// is caught by the comparison (one case per kind of output: a BF16 row, a pool, a top-k list).
TEST(BackendOpsTable, ComparisonsCatchAWrongResult) {
  Harness h(cases()[1], BackendId::scalar);  // csa_canonical
  h.feed_inputs(Kernel::rmsnorm);
  h.plan.v.x_mixed(3, 17) = td::bf16(h.plan.v.x_mixed(3, 17).to_float() * 4.0f + 1.0f);
  h.run(Kernel::rmsnorm);
  EXPECT_NONFATAL_FAILURE(h.compare(Kernel::rmsnorm), "rule x_n");

  h.feed_inputs(Kernel::cache_write);
  h.run(Kernel::cache_write);
  const std::int64_t slot = h.md.ori_slot_mapping()(5);
  ASSERT_GE(slot, 0);
  for (index_t i = 0; i < h.cfg.head_dim; ++i) h.L.caches.kv_cache.view()(slot, i) = td::bf16(3.0f);
  EXPECT_NONFATAL_FAILURE(h.compare(Kernel::cache_write), "rule kv_cache");

  h.feed_inputs(Kernel::indexer_topk);
  h.run(Kernel::indexer_topk);
  std::swap(h.plan.v.topk_idxs(0, 0), h.plan.v.topk_idxs(0, 300));
  EXPECT_NONFATAL_FAILURE(h.compare(Kernel::indexer_topk), "row 0");
}

std::string param_name(const testing::TestParamInfo<std::tuple<BackendId, int>>& info) {
  return std::string(cases()[std::size_t(std::get<1>(info.param))].name) + "_" +
         name_of(std::get<0>(info.param));
}

// Backend-major order: gtest shards deal cases round-robin, and with the case outer and the four
// backends inner every a2a3 case (by far the slowest under ASan: the model needs the chip's full
// shapes) fell into one sanitizer shard (scripts/ci_sanitize.sh); backend-major spreads them.
INSTANTIATE_TEST_SUITE_P(Table, BackendOps,
                         testing::Combine(testing::ValuesIn(kBackendIds), testing::Range(0, 6)),
                         param_name);

// The support table itself: kernel x backend, "ok" where implemented and runnable here.
TEST(BackendOpsTable, PrintsWhatEachBackendRuns) {
  std::printf("  %-16s", "kernel");
  for (BackendId b : kBackendIds) std::printf(" %-10s", name_of(b));
  std::printf("\n");
  for (int k = 0; k < td::decode::kNumKernels; ++k) {
    std::printf("  %-16s", std::string(td::decode::to_string(Kernel(k))).c_str());
    for (BackendId b : kBackendIds) {
      std::string why;
      const char* cell = !implements_kernel(b, Kernel(k)) ? "unsupported"
                         : available(b, &why)             ? "ok"
                                                          : "skip(cpu)";
      std::printf(" %-10s", cell);
    }
    std::printf("\n");
  }
  // The scalar tier and the a2a3 model run on every machine.
  std::string why;
  EXPECT_TRUE(available(BackendId::scalar, &why));
  EXPECT_TRUE(available(BackendId::a2a3, &why));
}

// run_layer_kernel refuses a kernel the family does not have, before running anything.
TEST(BackendOpsTable, RunLayerKernelRejectsAForeignKernel) {
  const auto cfg = td::flash_config();
  td::ThreadPool pool(1);
  const auto be = td::decode::Backend::cpu(&pool, td::cpu::Isa::scalar);
  td::paged::FixtureTables fx(1, cfg);
  tdtest::LayerSetup L(cfg, td::LayerKind::swa, fx.pools, 0, 1, be.cpu_ctx);
  td::paged::StepMetadata md(1, 2, cfg);
  const std::int32_t start[1] = {100};
  md.build(start, {1, 2, 1}, fx.tables(), fx.pools, cfg);
  td::decode::Workspace ws(cfg, 1, 2, be);
  td::Tensor<float, 3> x({2, 4, cfg.hidden}), y({2, 4, cfg.hidden});
  td::decode::LayerPlan plan;
  td::decode::plan_layer_step(plan, be, y.view(), x.view(), L.weights.view(), L.caches.view(), md,
                              L.rope.view(), ws, cfg);
  EXPECT_THROW(td::decode::run_layer_kernel(be, plan, Kernel::indexer_score), td::Error);
  EXPECT_THROW(td::decode::run_layer_kernel(be, plan, Kernel::compressor), td::Error);
}

}  // namespace
