// Batch invariance (issue 15): a request's outputs are bit-identical whatever batch it is decoded
// in — alone (B = 1), at any slot of a batch of 2, 7 or 64, beside requests of other lengths — for
// the whole layer of each family and, through decode::plan_layer_step + run_layer_kernel with
// identical inputs fed into plan.v, for every kernel of the family.
//
// What is compared, per request: its rows of x_out and of every intermediate of the workspace
// (x_mixed, post, comb, x_n, q, kv, qr, qr_scale, the emitted compressor rows, the indexer query,
// scales, weights and RoPE positions, score, top-k, every o_packed group row, attn_out) and every
// pool row it owns (kv_cache, cmp_kv, the compressor states, the index cache and scales).
//
// The universe: N requests at different starts, each OWNING private pages of every pool (the
// fixture tables alias pages across requests; these tables map each request's columns to its own
// physical pages and leave every column it cannot touch at -1), so a request reads and writes the
// same physical rows in every batch. The references are B = 1 steps of every request, run one
// after the other on one copy of the pools (each writes only its own pages, so this equals every
// request on the pristine pools, and the pools at the end are the "final image": pristine plus
// every request's writes). After a batch of requests M on the pristine pools, a pool page must
// equal the final image if its owner is in M and the pristine pools otherwise.
//
// Per kernel: before kernel k, every workspace row of every member is set to its reference value
// (the reference's full step: each view has one writer kernel), the outputs of k to a fill
// pattern, the pools k reads to the final image and the pools k writes to the pristine image;
// then k runs alone (run_layer_kernel) and every row and the written pools are compared.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/decode_fixture.hpp"
#include "tiledecode/decode/step.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::LayerKind;
using td::decode::Kernel;

namespace {

constexpr int kMaxS = 2;  // the universe's tables cover S <= kMaxS tokens per request
constexpr unsigned char kPattern = 0x5A;

// ---- the universe: requests owning private pages --------------------------------------------

struct OwnedTable {
  td::Tensor<std::int32_t, 2> t;  // [N, width], -1 outside the request's pages
  std::vector<int> owner;         // physical page -> request id
  index_t page_rows = 0;          // pool rows per page
};

struct Universe {
  td::ModelConfig cfg;
  std::vector<std::int32_t> starts;
  int N = 0;
  OwnedTable ori, cmp, idx, hca_state, csa_state, inner;
  td::paged::PoolSizes pools;
  td::Tensor<float, 3> x_hc;  // [N * kMaxS, 4, D]: token s of request k is row k * kMaxS + s

  Universe(const td::ModelConfig& c, std::vector<std::int32_t> st)
      : cfg(c), starts(std::move(st)), N(int(starts.size())) {
    const index_t page = cfg.page, L = cfg.max_seq_len;
    auto cdiv = [](index_t a, index_t b) { return (a + b - 1) / b; };
    // Columns [lo, hi] of request k (inclusive), in the table's page units.
    auto alloc = [&](OwnedTable& o, index_t width, index_t rows, auto range) {
      o.t = td::Tensor<std::int32_t, 2>({index_t(N), width});
      o.page_rows = rows;
      std::fill_n(o.t.data(), o.t.size(), -1);
      for (int k = 0; k < N; ++k) {
        auto [lo, hi] = range(index_t(starts[std::size_t(k)]));
        hi = std::min(hi, width - 1);
        for (index_t j = lo; j <= hi; ++j) {
          o.t.view()(k, j) = std::int32_t(o.owner.size());
          o.owner.push_back(k);
        }
      }
      if (o.owner.empty()) o.owner.push_back(-1);  // a pool has at least one page
      return index_t(o.owner.size());
    };
    const index_t last = kMaxS - 1;
    // ori: every token's window (positions pos - 127 .. pos).
    pools.ori = alloc(ori, cdiv(L, page), page, [&](index_t s) {
      return std::pair{std::max<index_t>(0, s - cfg.window) / page, (s + last) / page};
    });
    // compressed rows 0 .. (pos + 1) / 4 (CSA, and HCA's fewer rows through the same table).
    const index_t cmp_cols = cdiv(cfg.score_len(), page);
    auto cmp_range = [&](index_t s) { return std::pair{index_t(0), ((s + kMaxS) / 4) / page}; };
    pools.cmp = alloc(cmp, cmp_cols, page, cmp_range);
    pools.idx = alloc(idx, 2 * cmp_cols, page, cmp_range);
    // Compressor states: the pages of the windows a step pools or writes (ratio 128: from the
    // window start; ratio 4 overlapping: from the previous window's start).
    const index_t p128 = cfg.c128_state_page, p4 = cfg.c4_state_page;
    pools.hca_state = alloc(hca_state, cdiv(L, p128), p128, [&](index_t s) {
      return std::pair{(s / 128) * 128 / p128, (s + last) / p128};
    });
    auto c4 = [&](index_t s) {
      return std::pair{std::max<index_t>(0, (s / 4) * 4 - 8) / p4, (s + last) / p4};
    };
    pools.csa_state = alloc(csa_state, cdiv(L, p4), p4, c4);
    pools.csa_inner_state = alloc(inner, cdiv(L, p4), p4, c4);
    x_hc = td::Tensor<float, 3>({index_t(N) * kMaxS, 4, cfg.hidden});
    td::decode::synthetic::fill_x_hc(td::cpu::Context{}, x_hc.view(), 2024, 0);
  }
};

// The tables of a batch: row i = the universe row of request ids[i].
struct BatchTables {
  td::Tensor<std::int32_t, 2> ori, cmp, idx, hca, csa, inner;
  BatchTables(const Universe& u, const std::vector<int>& ids) {
    auto pick = [&](td::Tensor<std::int32_t, 2>& dst, const OwnedTable& src) {
      const index_t w = src.t.extent(1);
      dst = td::Tensor<std::int32_t, 2>({index_t(ids.size()), w});
      for (std::size_t i = 0; i < ids.size(); ++i)
        std::copy_n(src.t.data() + index_t(ids[i]) * w, w, dst.data() + index_t(i) * w);
    };
    pick(ori, u.ori), pick(cmp, u.cmp), pick(idx, u.idx);
    pick(hca, u.hca_state), pick(csa, u.csa_state), pick(inner, u.inner);
  }
  td::paged::StepTables tables() const {
    return {ori.view(), cmp.view(), idx.view(), hca.view(), csa.view(), inner.view()};
  }
};

// ---- the rows of one request in the workspace ----------------------------------------------

template <class T, std::size_t R>
unsigned char* row_ptr(td::View<T, R> v, index_t r) {
  return reinterpret_cast<unsigned char*>(v.data() + r * v.stride(0));
}
template <class T, std::size_t R>
std::size_t row_bytes(td::View<T, R> v) {
  return std::size_t(v.extent(0) > 0 ? v.size() / v.extent(0) : 0) * sizeof(T);
}

// The writer kernel of every compared view (each has exactly one).
const std::map<std::string, Kernel>& writers() {
  static const std::map<std::string, Kernel> w = {
      {"x_mixed", Kernel::hc_pre},
      {"post", Kernel::hc_pre},
      {"comb", Kernel::hc_pre},
      {"x_n", Kernel::rmsnorm},
      {"q", Kernel::qkv_projection},
      {"kv", Kernel::qkv_projection},
      {"qr", Kernel::qkv_projection},
      {"qr_scale", Kernel::qkv_projection},
      {"cmp_kv_out", Kernel::compressor},
      {"idx_kv_out", Kernel::indexer_compressor},
      {"idx_q_i8", Kernel::indexer_query},
      {"idx_q_scale", Kernel::indexer_query},
      {"idx_weights", Kernel::indexer_query},
      {"idx_rope_pos", Kernel::indexer_query},
      {"score", Kernel::indexer_score},
      {"topk_idxs", Kernel::indexer_topk},
      {"o_packed", Kernel::sparse_attention},
      {"attn_out", Kernel::output_projection},
      {"x_out", Kernel::hc_post},
  };
  return w;
}

// f(name, token (or request for per-request rows), pointer, bytes) for every row of request slot
// i of a step of T = B * S tokens, in a fixed order.
template <class F>
void for_each_row(const td::decode::StepViews& v, td::View<float, 3> x_out, int i, int S,
                  const td::ModelConfig& cfg, F&& f) {
  const index_t T = v.T;
  for (int s = 0; s < S; ++s) {
    const index_t t = index_t(i) * S + s;
    auto one = [&](const char* name, auto view) { f(name, t, row_ptr(view, t), row_bytes(view)); };
    one("x_mixed", v.x_mixed);
    one("post", v.post);
    one("comb", v.comb);
    one("x_n", v.x_n);
    one("q", v.q);
    one("kv", v.kv);
    one("qr", v.qr);
    one("qr_scale", v.qr_scale);
    one("idx_q_i8", v.idx_q_i8);
    one("idx_q_scale", v.idx_q_scale);
    one("idx_weights", v.idx_weights);
    one("idx_rope_pos", v.idx_rope_pos);
    one("score", v.score);
    one("topk_idxs", v.topk_idxs);
    for (int g = 0; g < cfg.o_groups; ++g)
      f("o_packed", t, row_ptr(v.o_packed, g * T + t), row_bytes(v.o_packed));
    one("attn_out", v.attn_out);
    one("x_out", x_out);
  }
  f("cmp_kv_out", i, row_ptr(v.cmp_kv_out, i), row_bytes(v.cmp_kv_out));
  f("idx_kv_out", i, row_ptr(v.idx_kv_out, i), row_bytes(v.idx_kv_out));
}

using Rows = std::vector<unsigned char>;  // a request's rows, concatenated in for_each_row order

Rows request_rows(const td::decode::StepViews& v, td::View<float, 3> x_out, int i, int S,
                  const td::ModelConfig& cfg) {
  Rows r;
  for_each_row(v, x_out, i, S, cfg,
               [&](const char*, index_t, const unsigned char* p, std::size_t n) {
                 r.insert(r.end(), p, p + n);
               });
  return r;
}

// Empty if slot i of the step holds the reference rows; else the first differing view.
std::string diff_rows(const td::decode::StepViews& v, td::View<float, 3> x_out, int i, int S,
                      const td::ModelConfig& cfg, const Rows& ref) {
  std::string d;
  std::size_t off = 0;
  for_each_row(v, x_out, i, S, cfg,
               [&](const char* name, index_t t, const unsigned char* p, std::size_t n) {
                 if (d.empty() && (off + n > ref.size() || std::memcmp(p, ref.data() + off, n)))
                   d = std::string(name) + " row " + std::to_string(t);
                 off += n;
               });
  return d;
}

// Writes the reference rows into slot i, except the views written by kernel `skip`.
void put_rows(const td::decode::StepViews& v, td::View<float, 3> x_out, int i, int S,
              const td::ModelConfig& cfg, const Rows& ref, Kernel skip) {
  std::size_t off = 0;
  for_each_row(v, x_out, i, S, cfg,
               [&](const char* name, index_t, unsigned char* p, std::size_t n) {
                 if (writers().at(name) != skip) std::memcpy(p, ref.data() + off, n);
                 off += n;
               });
}

void fill_workspace(td::decode::Workspace& ws) {
  const auto v = ws.views(ws.max_batch(), ws.max_seq());
  auto fill = [](auto view) {
    std::memset(static_cast<void*>(view.data()), kPattern,
                std::size_t(view.size()) * sizeof(*view.data()));
  };
  fill(v.x_mixed), fill(v.post), fill(v.comb), fill(v.x_n), fill(v.q), fill(v.kv), fill(v.qr);
  fill(v.qr_scale), fill(v.cmp_kv_out), fill(v.idx_kv_out), fill(v.idx_q_i8), fill(v.idx_q_scale);
  fill(v.idx_weights), fill(v.score), fill(v.topk_idxs), fill(v.o_packed);
  fill(v.attn_out);
  // Not the pattern: decode::layer_step validates the indexer query's rope_pos (the workspace's
  // idx_rope_pos) BEFORE the step writes this step's values into it, i.e. it validates the
  // previous step's leftovers (0x5A5A5A5A is rejected although every input is valid; see
  // AllOrNothing.DISABLED_StaleIndexerRopePositionsDoNotRejectAValidStep). 0 is a valid position,
  // and every step overwrites it, so the comparison still sees whether a kernel wrote it.
  std::fill_n(v.idx_rope_pos.data(), v.idx_rope_pos.size(), 0);
}

// ---- one layer of a family on the universe's pools -----------------------------------------

struct Pool {
  const char* name;
  unsigned char* live;
  const unsigned char* pristine;
  std::size_t bytes;
  const OwnedTable* tab;
  std::size_t page_bytes;
};

struct Family {
  const Universe& u;
  LayerKind kind;
  tdtest::LayerSetup L;
  td::decode::LayerCacheStorage pristine;

  Family(const Universe& uni, LayerKind k, const td::cpu::Context& ctx)
      : u(uni), kind(k), L(uni.cfg, k, uni.pools, 0, 99, ctx), pristine(L.caches) {}

  std::vector<Pool> pools() {
    std::vector<Pool> p;
    auto add = [&](const char* name, auto& live, const auto& prist, const OwnedTable& tab) {
      if (live.size() == 0) return;
      const std::size_t bytes = live.size() * sizeof(*live.data());
      p.push_back({name, reinterpret_cast<unsigned char*>(live.data()),
                   reinterpret_cast<const unsigned char*>(prist.data()), bytes, &tab,
                   bytes / std::size_t(live.extent(0)) * std::size_t(tab.page_rows)});
    };
    auto& c = L.caches;
    add("kv_cache", c.kv_cache, pristine.kv_cache, u.ori);
    add("cmp_kv", c.cmp_kv, pristine.cmp_kv, u.cmp);
    add("state", c.state, pristine.state, kind == LayerKind::hca ? u.hca_state : u.csa_state);
    add("inner_state", c.inner_state, pristine.inner_state, u.inner);
    add("idx_kv_cache", c.idx_kv_cache, pristine.idx_kv_cache, u.idx);
    add("idx_kv_scale", c.idx_kv_scale, pristine.idx_kv_scale, u.idx);
    return p;
  }
  void restore_pristine() {
    for (const Pool& p : pools()) std::memcpy(p.live, p.pristine, p.bytes);
  }
};

// The pools a kernel reads (set to the final image) and writes (set to the pristine image).
struct KernelPools {
  std::set<std::string> reads, writes;
};
KernelPools kernel_pools(Kernel k) {
  switch (k) {
    case Kernel::cache_write:
      return {{}, {"kv_cache"}};
    case Kernel::compressor:
      return {{}, {"state", "cmp_kv"}};
    case Kernel::indexer_compressor:
      return {{}, {"inner_state", "idx_kv_cache", "idx_kv_scale"}};
    case Kernel::indexer_score:
      return {{"idx_kv_cache", "idx_kv_scale"}, {}};
    case Kernel::sparse_attention:
      return {{"kv_cache", "cmp_kv"}, {}};
    default:
      return {};
  }
}

// The reference of every request (B = 1) for one step shape, and the pools after all of them.
struct Refs {
  int S = 2, commit = 1;
  std::vector<Rows> rows;
  std::vector<std::vector<unsigned char>> final_image;  // per Family::pools() entry
};

// The batch of request ids `ids`: its metadata, x_hc and x_out.
struct Batch {
  BatchTables tabs;
  td::paged::StepMetadata md;
  td::Tensor<float, 3> x_hc, x_out;
  Batch(const Universe& u, const std::vector<int>& ids, int S, int commit)
      : tabs(u, ids),
        md(int(ids.size()), S, u.cfg),
        x_hc({index_t(ids.size()) * S, 4, u.cfg.hidden}),
        x_out({index_t(ids.size()) * S, 4, u.cfg.hidden}) {
    std::vector<std::int32_t> st;
    for (int id : ids) st.push_back(u.starts[std::size_t(id)]);
    const td::paged::StepShape sh{int(ids.size()), S, commit};
    md.build(st, sh, tabs.tables(), u.pools, u.cfg);
    md.check_disjoint_rows();  // the universe tables never alias
    const index_t row = 4 * u.cfg.hidden;
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (int s = 0; s < S; ++s)
        std::copy_n(u.x_hc.data() + (index_t(ids[i]) * kMaxS + s) * row, row,
                    x_hc.data() + (index_t(i) * S + s) * row);
    std::memset(x_out.data(), kPattern, x_out.size() * sizeof(float));
  }
};

// Empty if every page of every pool in `names` (all if empty) equals the final image for a
// member's page and the pristine image otherwise; else the first differing page.
std::string diff_pools(Family& f, const Refs& refs, const std::vector<int>& ids,
                       const std::set<std::string>& names = {}) {
  std::vector<char> member(std::size_t(f.u.N), 0);
  for (int id : ids) member[std::size_t(id)] = 1;
  const auto ps = f.pools();
  for (std::size_t q = 0; q < ps.size(); ++q) {
    const Pool& p = ps[q];
    if (!names.empty() && !names.count(p.name)) continue;
    const std::size_t pages = p.bytes / p.page_bytes;
    for (std::size_t pg = 0; pg < pages; ++pg) {
      const int o = pg < p.tab->owner.size() ? p.tab->owner[pg] : -1;
      const unsigned char* ref =
          (o >= 0 && member[std::size_t(o)]) ? refs.final_image[q].data() : p.pristine;
      if (std::memcmp(p.live + pg * p.page_bytes, ref + pg * p.page_bytes, p.page_bytes) != 0)
        return std::string(p.name) + " page " + std::to_string(pg) + " (request " +
               std::to_string(o) + (o >= 0 && member[std::size_t(o)] ? ", member)" : ")");
    }
  }
  return {};
}

// diff_pools over members `ids`, ignoring the pages of request `skip`.
std::string diff_pools_except(Family& f, const Refs& refs, const std::vector<int>& ids, int skip) {
  std::vector<char> member(std::size_t(f.u.N), 0);
  for (int id : ids) member[std::size_t(id)] = 1;
  const auto ps = f.pools();
  for (std::size_t q = 0; q < ps.size(); ++q) {
    const Pool& p = ps[q];
    const std::size_t pages = p.bytes / p.page_bytes;
    for (std::size_t pg = 0; pg < pages; ++pg) {
      const int o = pg < p.tab->owner.size() ? p.tab->owner[pg] : -1;
      if (o == skip) continue;
      const unsigned char* ref =
          (o >= 0 && member[std::size_t(o)]) ? refs.final_image[q].data() : p.pristine;
      if (std::memcmp(p.live + pg * p.page_bytes, ref + pg * p.page_bytes, p.page_bytes) != 0)
        return std::string(p.name) + " page " + std::to_string(pg) + " (request " +
               std::to_string(o) + ")";
    }
  }
  return {};
}

void layer_step(Family& f, const td::decode::Backend& be, td::decode::Workspace& ws, Batch& b) {
  td::decode::layer_step(be, b.x_out.view(), b.x_hc.view(), f.L.weights.view(), f.L.caches.view(),
                         b.md, f.L.rope.view(), ws, f.u.cfg);
}

Refs make_refs(Family& f, const td::decode::Backend& be, td::decode::Workspace& ws, int S,
               int commit) {
  Refs r;
  r.S = S, r.commit = commit;
  f.restore_pristine();
  for (int k = 0; k < f.u.N; ++k) {
    Batch b(f.u, {k}, S, commit);
    fill_workspace(ws);
    layer_step(f, be, ws, b);
    r.rows.push_back(request_rows(ws.views(1, S), b.x_out.view(), 0, S, f.u.cfg));
  }
  for (const Pool& p : f.pools()) r.final_image.emplace_back(p.live, p.live + p.bytes);
  return r;
}

struct Tally {
  int layer_runs = 0, kernel_runs = 0, requests_checked = 0;
  std::map<Kernel, std::string> kernel_failure;  // first failure per kernel
  std::string layer_failure;
};

// The whole layer on batch `ids`: every member's rows and every pool page.
void check_layer(Family& f, const td::decode::Backend& be, td::decode::Workspace& ws,
                 const Refs& refs, const std::vector<int>& ids, Tally& tally,
                 const std::string& where) {
  Batch b(f.u, ids, refs.S, refs.commit);
  f.restore_pristine();
  fill_workspace(ws);
  layer_step(f, be, ws, b);
  const auto v = ws.views(int(ids.size()), refs.S);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string d =
        diff_rows(v, b.x_out.view(), int(i), refs.S, f.u.cfg, refs.rows[std::size_t(ids[i])]);
    EXPECT_TRUE(d.empty()) << where << ": request " << ids[i] << " at slot " << i << ": " << d;
    if (!d.empty() && tally.layer_failure.empty()) tally.layer_failure = where + ": " + d;
    ++tally.requests_checked;
  }
  const std::string dp = diff_pools(f, refs, ids);
  EXPECT_TRUE(dp.empty()) << where << ": " << dp;
  ++tally.layer_runs;
}

// Negative control and isolation: the same batch with slot 0's x_hc changed in one element
// must change slot 0's rows (the comparison has teeth) and leave every other request's rows
// and pages exactly as in its reference (a request never sees another request's inputs).
void check_isolation(Family& f, const td::decode::Backend& be, td::decode::Workspace& ws,
                     const Refs& refs, const std::vector<int>& ids, const std::string& where) {
  Batch b(f.u, ids, refs.S, refs.commit);
  b.x_hc.data()[7] += 0.5f;
  f.restore_pristine();
  fill_workspace(ws);
  layer_step(f, be, ws, b);
  const auto v = ws.views(int(ids.size()), refs.S);
  EXPECT_FALSE(
      diff_rows(v, b.x_out.view(), 0, refs.S, f.u.cfg, refs.rows[std::size_t(ids[0])]).empty())
      << where << ": a changed input was not detected";
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const std::string d =
        diff_rows(v, b.x_out.view(), int(i), refs.S, f.u.cfg, refs.rows[std::size_t(ids[i])]);
    EXPECT_TRUE(d.empty()) << where << ": request " << ids[i] << " at slot " << i
                           << " changed with slot 0's input: " << d;
  }
  std::vector<int> others(ids.begin() + 1, ids.end());
  const std::string dp = diff_pools_except(f, refs, others, ids[0]);
  EXPECT_TRUE(dp.empty()) << where << ": " << dp;
}

// Every kernel alone on batch `ids`, with the reference inputs.
void check_kernels(Family& f, const td::decode::Backend& be, td::decode::Workspace& ws,
                   const Refs& refs, const std::vector<int>& ids, Tally& tally,
                   const std::string& where) {
  Batch b(f.u, ids, refs.S, refs.commit);
  td::decode::LayerPlan p;
  td::decode::plan_layer_step(p, be, b.x_out.view(), b.x_hc.view(), f.L.weights.view(),
                              f.L.caches.view(), b.md, f.L.rope.view(), ws, f.u.cfg);
  const auto ps = f.pools();
  for (const Kernel k : td::decode::layer_kernels(f.kind)) {
    fill_workspace(ws);
    std::memset(b.x_out.data(), kPattern, b.x_out.size() * sizeof(float));
    for (std::size_t i = 0; i < ids.size(); ++i)
      put_rows(p.v, b.x_out.view(), int(i), refs.S, f.u.cfg, refs.rows[std::size_t(ids[i])], k);
    const KernelPools kp = kernel_pools(k);
    for (std::size_t q = 0; q < ps.size(); ++q) {
      if (kp.reads.count(ps[q].name))
        std::memcpy(ps[q].live, refs.final_image[q].data(), ps[q].bytes);
      if (kp.writes.count(ps[q].name)) std::memcpy(ps[q].live, ps[q].pristine, ps[q].bytes);
    }
    td::decode::run_layer_kernel(be, p, k);
    std::string d;
    for (std::size_t i = 0; i < ids.size() && d.empty(); ++i) {
      d = diff_rows(p.v, b.x_out.view(), int(i), refs.S, f.u.cfg, refs.rows[std::size_t(ids[i])]);
      if (!d.empty())
        d = "request " + std::to_string(ids[i]) + " at slot " + std::to_string(i) + ": " + d;
    }
    if (d.empty() && !kp.writes.empty()) d = diff_pools(f, refs, ids, kp.writes);
    EXPECT_TRUE(d.empty()) << where << ", kernel " << td::decode::to_string(k) << ": " << d;
    if (!d.empty() && !tally.kernel_failure.count(k)) tally.kernel_failure[k] = where + ": " + d;
    ++tally.kernel_runs;
  }
}

std::vector<int> iota_ids(int n, int first = 0) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[std::size_t(i)] = first + i;
  return v;
}
std::vector<int> reversed(std::vector<int> v) {
  std::reverse(v.begin(), v.end());
  return v;
}
std::vector<int> rotated(std::vector<int> v, int by) {
  std::rotate(v.begin(), v.begin() + by, v.end());
  return v;
}

struct Shape {
  int S, commit;
  std::vector<std::vector<int>> batches;
};

// Every batch of every shape, on 1 and 2 threads, layer and per kernel, against B = 1 references
// (1 thread). Prints one line per family with the per-kernel result.
void run_family(const Universe& u, LayerKind kind, const std::vector<Shape>& shapes,
                td::cpu::Isa isa = td::cpu::detect_isa()) {
  const auto t0 = std::chrono::steady_clock::now();
  td::ThreadPool pool1(1), pool2(2);
  const auto be1 = td::decode::Backend::cpu(&pool1, isa),
             be2 = td::decode::Backend::cpu(&pool2, isa);
  Family f(u, kind, be2.cpu_ctx);
  int max_b = 1;
  for (const Shape& sh : shapes)
    for (const auto& b : sh.batches) max_b = std::max(max_b, int(b.size()));
  td::decode::Workspace ws(u.cfg, max_b, kMaxS, be2.concurrency());
  Tally tally;
  for (const Shape& sh : shapes) {
    const Refs refs = make_refs(f, be1, ws, sh.S, sh.commit);
    check_isolation(f, be2, ws, refs, sh.batches.front(),
                    std::string(td::to_string(kind)) + " S=" + std::to_string(sh.S) + " isolation");
    for (const auto& ids : sh.batches)
      for (const auto* be : {&be1, &be2}) {
        const std::string where = std::string(td::to_string(kind)) + " S=" + std::to_string(sh.S) +
                                  " B=" + std::to_string(ids.size()) + " first id " +
                                  std::to_string(ids[0]) + ", " +
                                  std::to_string(be->concurrency()) + " thread(s)";
        check_layer(f, *be, ws, refs, ids, tally, where);
        check_kernels(f, *be, ws, refs, ids, tally, where);
      }
  }
  std::string per_kernel;
  for (const Kernel k : td::decode::layer_kernels(kind))
    per_kernel += std::string(td::decode::to_string(k)) +
                  (tally.kernel_failure.count(k) ? "=VARIES " : "=ok ");
  std::printf("%s (%s, %s): %d layer runs, %d kernel runs, %d request comparisons, %.1f s\n  %s\n",
              std::string(td::to_string(kind)).c_str(), std::string(u.cfg.name).c_str(),
              std::string(td::cpu::to_string(be2.cpu_ctx.isa)).c_str(), tally.layer_runs,
              tally.kernel_runs, tally.requests_checked,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              per_kernel.c_str());
  for (const auto& [k, why] : tally.kernel_failure)
    std::printf("  %s varies first at %s\n", std::string(td::decode::to_string(k)).c_str(),
                why.c_str());
}

// 64 requests: every boundary class (ratio 4 / 128 windows, the window slide at 128, page
// crossings, ring-free long contexts up to 16000 where CSA's top-k picks 512 of 4000 rows) and
// pseudo-random starts in between.
std::vector<std::int32_t> narrow_starts() {
  std::vector<std::int32_t> s = {0,    1,    2,    3,    7,    31,    126,  127,
                                 128,  255,  256,  511,  1023, 2047,  2048, 2050,
                                 4095, 4096, 8190, 8191, 8192, 12000, 16000};
  std::uint32_t x = 12345;
  while (s.size() < 64) {
    x = x * 1103515245u + 12345u;
    s.push_back(std::int32_t((x >> 8) % 3000));
  }
  return s;
}

const Universe& narrow_universe() {
  static const Universe u(tdtest::narrow_config(), narrow_starts());
  return u;
}

std::vector<Shape> narrow_shapes() {
  const auto seven = iota_ids(7, 14);  // starts 2047 .. 8191 (page and window boundaries)
  return {
      {2,
       1,  // MTP: S = 2, commit 1
       {{0, 18},
        {18, 0},
        seven,
        reversed(seven),
        rotated(seven, 3),
        iota_ids(64),
        reversed(iota_ids(64))}},
      {1,
       -1,  // S = 1: odd token counts (T = 7), every tile tail
       {seven, rotated(seven, 4), reversed(iota_ids(64))}},
  };
}

TEST(batch_invariant, SwaLayerAndEveryKernelNarrowB1To64) {
  run_family(narrow_universe(), LayerKind::swa, narrow_shapes());
}
TEST(batch_invariant, CsaLayerAndEveryKernelNarrowB1To64) {
  run_family(narrow_universe(), LayerKind::csa, narrow_shapes());
}
TEST(batch_invariant, HcaLayerAndEveryKernelNarrowB1To64) {
  run_family(narrow_universe(), LayerKind::hca, narrow_shapes());
}

// The scalar tier (always compiled, the reference of the SIMD paths): B = 7 and 64, S = 2 and 1.
std::vector<Shape> scalar_shapes() {
  const auto seven = iota_ids(7, 14);
  return {{2, 1, {seven, reversed(iota_ids(64))}}, {1, -1, {rotated(seven, 4)}}};
}
TEST(batch_invariant, SwaLayerAndEveryKernelNarrowScalar) {
  run_family(narrow_universe(), LayerKind::swa, scalar_shapes(), td::cpu::Isa::scalar);
}
TEST(batch_invariant, CsaLayerAndEveryKernelNarrowScalar) {
  run_family(narrow_universe(), LayerKind::csa, scalar_shapes(), td::cpu::Isa::scalar);
}
TEST(batch_invariant, HcaLayerAndEveryKernelNarrowScalar) {
  run_family(narrow_universe(), LayerKind::hca, scalar_shapes(), td::cpu::Isa::scalar);
}

// Full flash widths: 8 requests alone and in one batch of 8 (both orders).
const Universe& flash_universe() {
  static const Universe u(td::flash_config(), {0, 3, 127, 128, 2047, 4100, 8191, 16000});
  return u;
}
std::vector<Shape> flash_shapes() {
  return {{2, 1, {iota_ids(8), reversed(iota_ids(8))}}};
}

TEST(batch_invariant, SwaLayerAndEveryKernelFullFlashB1B8) {
  run_family(flash_universe(), LayerKind::swa, flash_shapes());
}
TEST(batch_invariant, CsaLayerAndEveryKernelFullFlashB1B8) {
  run_family(flash_universe(), LayerKind::csa, flash_shapes());
}
TEST(batch_invariant, HcaLayerAndEveryKernelFullFlashB1B8) {
  run_family(flash_universe(), LayerKind::hca, flash_shapes());
}

}  // namespace
