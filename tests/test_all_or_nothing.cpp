// All or nothing at the layer level (issue 15): for every class of bad input, decode::layer_step
// throws tiledecode::Error and EVERY buffer the step could write — x_out, every workspace buffer
// (each intermediate and each kernel's scratch), every pool of the layer (kv_cache, cmp_kv, the
// compressor states, the index cache and its scales) and, for a failed StepMetadata::build, the
// metadata bundle — is byte-identical to a snapshot taken just before the call.
// Families SWA, CSA and HCA at the flash shapes on the CPU backend; a subset of the classes on the
// a2a3 execution model (it validates the same plan). Plus the accepted cases: tables with more
// rows than the batch give the same bytes as exact-size tables, and a huge finite indexer
// scale (1e38) either is rejected before anything is written or runs to the end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/decode_fixture.hpp"
#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/decode/step.hpp"

namespace td = tiledecode;
using td::bf16;
using td::index_t;
using td::LayerKind;

namespace {

// ---- snapshots ----------------------------------------------------------------------------

// Named byte copies of buffers; diff() names every buffer whose bytes changed.
class Snapshot {
 public:
  void add(std::string name, const void* p, std::size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(p);
    parts_.push_back({std::move(name), p, std::vector<unsigned char>(b, b + (p ? bytes : 0))});
  }
  template <class T, std::size_t R>
  void add(std::string name, td::View<T, R> v) {
    add(std::move(name), v.data(), std::size_t(std::max<index_t>(0, v.size())) * sizeof(T));
  }
  void add(std::string name, std::span<std::byte> s) { add(std::move(name), s.data(), s.size()); }

  // Empty if `now` (a snapshot of the same buffers taken later) holds the same bytes.
  std::string diff(const Snapshot& now) const {
    std::string d;
    if (now.parts_.size() != parts_.size()) return "different buffer lists";
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      const auto& a = parts_[i].bytes;
      const auto& b = now.parts_[i].bytes;
      if (a.size() != b.size() || (!a.empty() && std::memcmp(a.data(), b.data(), a.size()) != 0)) {
        std::size_t first = 0;
        while (first < a.size() && first < b.size() && a[first] == b[first]) ++first;
        d += parts_[i].name + " (first changed byte " + std::to_string(first) + " of " +
             std::to_string(a.size()) + ") ";
      }
    }
    return d;
  }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& p : parts_) n += p.bytes.size();
    return n;
  }

 private:
  struct Part {
    std::string name;
    const void* ptr;
    std::vector<unsigned char> bytes;
  };
  std::vector<Part> parts_;
};

void add_caches(Snapshot& s, td::decode::LayerCacheStorage& c) {
  s.add("kv_cache", c.kv_cache.view());
  s.add("cmp_kv", c.cmp_kv.view());
  s.add("state", c.state.view());
  s.add("inner_state", c.inner_state.view());
  s.add("idx_kv_cache", c.idx_kv_cache.view());
  s.add("idx_kv_scale", c.idx_kv_scale.view());
}

// Every buffer of the workspace, through views of its full size (all max_batch x max_seq rows).
void add_workspace(Snapshot& s, td::decode::Workspace& ws) {
  const auto v = ws.views(ws.max_batch(), ws.max_seq());
  s.add("ws.x_mixed", v.x_mixed);
  s.add("ws.post", v.post);
  s.add("ws.comb", v.comb);
  s.add("ws.hc_ws", v.hc_ws);
  s.add("ws.x_n", v.x_n);
  s.add("ws.q", v.q);
  s.add("ws.kv", v.kv);
  s.add("ws.qr", v.qr);
  s.add("ws.qr_scale", v.qr_scale);
  s.add("ws.qkv_scratch.x", v.qkv_scratch.x);
  s.add("ws.qkv_scratch.cq", v.qkv_scratch.cq);
  s.add("ws.qkv_scratch.kvf", v.qkv_scratch.kvf);
  s.add("ws.qkv_scratch.qr_pairs", v.qkv_scratch.qr_pairs);
  s.add("ws.qkv_scratch.extra", v.qkv_scratch.extra);
  s.add("ws.compressor_ws", v.compressor_ws);
  s.add("ws.cmp_kv_out", v.cmp_kv_out);
  s.add("ws.idx_kv_out", v.idx_kv_out);
  s.add("ws.idx_q_i8", v.idx_q_i8);
  s.add("ws.idx_q_scale", v.idx_q_scale);
  s.add("ws.idx_weights", v.idx_weights);
  s.add("ws.idx_rope_pos", v.idx_rope_pos);
  s.add("ws.score", v.score);
  s.add("ws.topk_idxs", v.topk_idxs);
  s.add("ws.o_packed", v.o_packed);
  s.add("ws.attn_ws", v.attn_ws);
  s.add("ws.attn_out", v.attn_out);
  s.add("ws.oproj_ws", v.oproj_ws);
}

// The tensors of a built bundle (positions, lens, every slot mapping, the window lists).
void add_metadata(Snapshot& s, const td::paged::StepMetadata& md) {
  const auto sh = md.shape();
  s.add("md.shape", &sh, sizeof sh);
  s.add("md.position_ids", md.position_ids());
  s.add("md.kv_seq_lens", md.kv_seq_lens());
  for (int g = 0; g < td::rules::kNumTables; ++g)
    s.add("md.slot_mapping[" + std::to_string(g) + "]", md.slot_mapping(td::paged::Table(g)));
  s.add("md.window_indices", md.window_indices());
  s.add("md.window_lens", md.window_lens());
}

// ---- one layer of one family with everything a step touches --------------------------------

constexpr int kMaxBatch = 4, kB = 2, kS = 2;

std::string family_name(LayerKind k) {
  return std::string(td::to_string(k));
}

struct Rig {
  td::ModelConfig cfg = td::flash_config();
  LayerKind kind;
  td::ThreadPool pool{2};
  td::decode::Backend be = td::decode::Backend::cpu(&pool);
  td::paged::FixtureTables fx{kMaxBatch, cfg};  // max-batch tables (4 rows; steps use 2)
  tdtest::LayerSetup L;
  td::paged::StepMetadata md{kMaxBatch, kS, cfg};
  td::decode::Workspace ws{cfg, kMaxBatch, kS, be.concurrency()};
  // Request 0 closes a ratio-4 window at 8191 (CSA reads the previous window's state page too)
  // and a ratio-128 window (HCA reads 16 state pages); its index cache has 16 visible pages.
  // Request 1 closes both at 127.
  std::vector<std::int32_t> starts{8191, 127};
  td::paged::StepShape sh{kB, kS, 1};
  td::Tensor<float, 3> x_hc, x_out;

  explicit Rig(LayerKind k)
      : kind(k),
        L(cfg, k, fx.pools, 0, 4242, be.cpu_ctx),
        x_hc({index_t(kB) * kS, 4, cfg.hidden}),
        x_out({index_t(kB) * kS, 4, cfg.hidden}) {
    td::decode::synthetic::fill_x_hc(be.cpu_ctx, x_hc.view(), 9, 0);
    md.build(starts, sh, fx.tables(), fx.pools, cfg);
  }
  Snapshot snapshot() {
    Snapshot s;
    s.add("x_out", x_out.view());
    add_caches(s, L.caches);
    add_workspace(s, ws);
    return s;
  }
};

// One call's arguments (copies of views), plus whatever storage a case made for them.
struct Call {
  td::decode::Backend be;
  td::View<float, 3> x_out;
  td::ConstView<float, 3> x_hc;
  td::decode::LayerWeights w;
  td::decode::LayerCaches c;
  const td::paged::StepMetadata* md;
  td::RopeTableView rope;
  td::decode::Workspace* ws;
  std::vector<std::shared_ptr<void>> keep;  // storage the modified views point into

  template <class T, class... A>
  T& make(A&&... a) {
    auto p = std::make_shared<T>(std::forward<A>(a)...);
    keep.push_back(p);
    return *p;
  }
  void run(const td::ModelConfig& cfg) const {
    td::decode::layer_step(be, x_out, x_hc, w, c, *md, rope, *ws, cfg);
  }
};

Call base_call(Rig& r, const td::decode::Backend& be, td::decode::Workspace& ws) {
  return Call{be,
              r.x_out.view(),
              r.x_hc.view(),
              r.L.weights.view(),
              r.L.caches.view(),
              &r.md,
              r.L.rope.view(),
              &ws,
              {}};
}

// A copy of a 1-D FP32 weight with one element replaced.
td::ConstView<float, 1> patched(Call& c, td::ConstView<float, 1> v, index_t i, float value) {
  auto& t = c.make<td::Tensor<float, 1>>(std::array<index_t, 1>{v.extent(0)});
  std::copy_n(v.data(), v.size(), t.data());
  t.data()[i] = value;
  return t.view();
}

// Metadata built from the rig's tables with one entry changed (must build: the kernels reject it).
const td::paged::StepMetadata& md_with_table_entry(
    Call& c, Rig& r, td::Tensor<std::int32_t, 2>& (*pick)(td::paged::FixtureTables&), index_t row,
    index_t col, std::int32_t value, std::vector<std::int32_t> starts = {}) {
  auto& fx = c.make<td::paged::FixtureTables>(r.fx);
  pick(fx).view()(row, col) = value;
  auto& md = c.make<td::paged::StepMetadata>(kMaxBatch, kS, r.cfg);
  md.build(starts.empty() ? r.starts : starts, r.sh, fx.tables(), fx.pools, r.cfg);
  return md;
}

constexpr unsigned kSwa = 1, kCsa = 2, kHca = 4, kAll = 7, kCmp = kCsa | kHca;
unsigned family_bit(LayerKind k) {
  return k == LayerKind::swa ? kSwa : (k == LayerKind::csa ? kCsa : kHca);
}

struct BadCase {
  const char* name;
  unsigned families;
  bool a2a3;  // also run on the a2a3 model
  std::function<void(Call&, Rig&)> make;
};

td::Tensor<std::int32_t, 2>& idx_table(td::paged::FixtureTables& f) {
  return f.idx_block_table;
}
td::Tensor<std::int32_t, 2>& csa_state_table(td::paged::FixtureTables& f) {
  return f.csa_state_table;
}
td::Tensor<std::int32_t, 2>& inner_state_table(td::paged::FixtureTables& f) {
  return f.csa_inner_state_table;
}
td::Tensor<std::int32_t, 2>& hca_state_table(td::paged::FixtureTables& f) {
  return f.hca_state_table;
}

const std::vector<BadCase>& bad_cases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  static const std::vector<BadCase> cases = {
      {"attn_sink NaN", kAll, true,
       [=](Call& c, Rig&) { c.w.attn_sink = patched(c, c.w.attn_sink, 3, nan); }},
      {"attn_sink +Inf", kAll, false,
       [=](Call& c, Rig&) { c.w.attn_sink = patched(c, c.w.attn_sink, 0, inf); }},
      {"attn_sink -Inf", kAll, false,
       [=](Call& c, Rig& r) {
         c.w.attn_sink = patched(c, c.w.attn_sink, r.cfg.n_heads - 1, -inf);
       }},
      {"wo_b_scale extent D-1", kAll, true,
       [](Call& c, Rig& r) { c.w.wo_b_scale = c.w.wo_b_scale.slice(0, 0, r.cfg.hidden - 1); }},
      {"wo_b_scale extent D+1", kAll, false,
       [](Call& c, Rig& r) {
         auto& t = c.make<td::Tensor<float, 1>>(std::array<index_t, 1>{r.cfg.hidden + 1});
         c.w.wo_b_scale = t.view();
       }},
      {"empty wo_a", kAll, false, [](Call& c, Rig&) { c.w.wo_a = {}; }},
      {"wo_a extent -1", kAll, true,
       [](Call& c, Rig& r) {
         c.w.wo_a =
             td::ConstView<bf16, 3>(c.w.wo_a.data(), {r.cfg.o_groups, -1, r.cfg.o_group_in()});
       }},
      {"kv_cache extent -1", kAll, true,
       [](Call& c, Rig& r) {
         c.c.kv_cache = td::View<bf16, 2>(c.c.kv_cache.data(), {-1, r.cfg.head_dim});
       }},
      {"kv_cache smaller than md.pools()", kAll, false,
       [](Call& c, Rig& r) { c.c.kv_cache = c.c.kv_cache.slice(0, 0, r.cfg.page); }},
      {"x_hc extent -1", kAll, true,
       [](Call& c, Rig&) {
         c.x_hc = td::ConstView<float, 3>(c.x_hc.data(), {c.x_hc.extent(0), 4, -1});
       }},
      {"x_hc batch extent -1", kAll, false,
       [](Call& c, Rig& r) {
         c.x_hc = td::ConstView<float, 3>(c.x_hc.data(), {-1, 4, r.cfg.hidden});
       }},
      {"x_out one token short", kAll, false,
       [](Call& c, Rig&) { c.x_out = c.x_out.slice(0, 0, c.x_out.extent(0) - 1); }},
      {"x_out aliases x_hc", kAll, false,
       [](Call& c, Rig&) {
         c.x_out = td::View<float, 3>(const_cast<float*>(c.x_hc.data()), c.x_hc.shape());
       }},
      {"LayerKind(7)", kAll, true, [](Call& c, Rig&) { c.w.kind = LayerKind(7); }},
      {"attn_norm extent D-1", kAll, false,
       [](Call& c, Rig& r) { c.w.attn_norm = c.w.attn_norm.slice(0, 0, r.cfg.hidden - 1); }},
      {"qkv wq_b_scale extent short", kAll, false,
       [](Call& c, Rig&) {
         c.w.qkv.wq_b_scale = c.w.qkv.wq_b_scale.slice(0, 0, c.w.qkv.wq_b_scale.extent(0) - 1);
       }},
      {"hc_fn rows 23", kAll, false, [](Call& c, Rig&) { c.w.hc.fn = c.w.hc.fn.slice(0, 0, 23); }},
      // RoPE: the sin half shorter than cos (16000 vs 16384) at positions 16000/16001.
      {"rope sin 16000 rows < cos 16384, positions 16000/16001", kAll, true,
       [](Call& c, Rig& r) {
         auto& md = c.make<td::paged::StepMetadata>(kMaxBatch, kS, r.cfg);
         const std::vector<std::int32_t> st{16000, 127};
         md.build(st, r.sh, r.fx.tables(), r.fx.pools, r.cfg);
         c.md = &md;
         c.rope.sin = c.rope.sin.slice(0, 0, 16000);
       }},
      {"rope 16000 rows (both halves), positions 16000/16001", kAll, false,
       [](Call& c, Rig& r) {
         auto& md = c.make<td::paged::StepMetadata>(kMaxBatch, kS, r.cfg);
         const std::vector<std::int32_t> st{16000, 127};
         md.build(st, r.sh, r.fx.tables(), r.fx.pools, r.cfg);
         c.md = &md;
         c.rope.sin = c.rope.sin.slice(0, 0, 16000);
         c.rope.cos = c.rope.cos.slice(0, 0, 16000);
       }},
      {"rope 31 columns", kAll, false,
       [](Call& c, Rig&) {
         c.rope.sin = c.rope.sin.slice(1, 0, 31);
         c.rope.cos = c.rope.cos.slice(1, 0, 31);
       }},
      {"rope sin 31 columns", kAll, false,
       [](Call& c, Rig&) { c.rope.sin = c.rope.sin.slice(1, 0, 31); }},
      {"empty rope", kAll, false, [](Call& c, Rig&) { c.rope = {}; }},
      // Compressor (CSA main, HCA).
      {"compressor ape rows R-1", kCmp, false,
       [](Call& c, Rig&) {
         c.w.compressor.ape = c.w.compressor.ape.slice(0, 0, c.w.compressor.ape.extent(0) - 1);
       }},
      {"compressor ape columns short", kCmp, false,
       [](Call& c, Rig&) {
         c.w.compressor.ape = c.w.compressor.ape.slice(1, 0, c.w.compressor.ape.extent(1) - 8);
       }},
      {"compressor norm_w without data", kCmp, true,
       [](Call& c, Rig& r) {
         c.w.compressor.norm_w = td::ConstView<bf16, 1>(nullptr, {r.cfg.head_dim});
       }},
      {"compressor norm_w extent -1", kCmp, false,
       [](Call& c, Rig&) {
         c.w.compressor.norm_w = td::ConstView<bf16, 1>(c.w.compressor.norm_w.data(), {-1});
       }},
      {"cmp_kv extent -1", kCmp, false,
       [](Call& c, Rig& r) {
         c.c.cmp_kv = td::View<bf16, 2>(c.c.cmp_kv.data(), {-1, r.cfg.head_dim});
       }},
      {"empty compressor wkv", kCmp, false, [](Call& c, Rig&) { c.w.compressor.wkv = {}; }},
      // A state-table entry -2 in a page only the compressor's pooling reads (the previous
      // ratio-4 window / the first page of the ratio-128 window): StepMetadata::build reads the
      // tokens' own pages only and accepts it; the compressor's validation must reject it.
      {"csa_state_table entry -2 (previous window)", kCsa, false,
       [](Call& c, Rig& r) {
         c.md = &md_with_table_entry(c, r, csa_state_table, 0, 8184 / 4, -2);
       }},
      {"csa_inner_state_table entry -2 (previous window)", kCsa, false,
       [](Call& c, Rig& r) {
         c.md = &md_with_table_entry(c, r, inner_state_table, 0, 8184 / 4, -2);
       }},
      {"hca_state_table entry -2 (window start)", kHca, true,
       [](Call& c, Rig& r) {
         c.md = &md_with_table_entry(c, r, hca_state_table, 0, 8064 / 8, -2);
       }},
      // Indexer (CSA).
      {"indexer hadamard rows 127", kCsa, false,
       [](Call& c, Rig&) { c.w.indexer.hadamard = c.w.indexer.hadamard.slice(0, 0, 127); }},
      {"indexer hadamard columns 127", kCsa, false,
       [](Call& c, Rig&) { c.w.indexer.hadamard = c.w.indexer.hadamard.slice(1, 0, 127); }},
      {"indexer weights_proj columns H-1", kCsa, false,
       [](Call& c, Rig& r) {
         c.w.indexer.weights_proj = c.w.indexer.weights_proj.slice(1, 0, r.cfg.idx_n_heads - 1);
       }},
      {"indexer weights_proj rows D-1", kCsa, false,
       [](Call& c, Rig& r) {
         c.w.indexer.weights_proj = c.w.indexer.weights_proj.slice(0, 0, r.cfg.hidden - 1);
       }},
      {"indexer wq_b rows short (a2a3 reads the plain views)", 0, true,
       [](Call& c, Rig&) {
         c.w.indexer.wq_b = c.w.indexer.wq_b.slice(0, 0, c.w.indexer.wq_b.extent(0) - 256);
       }},
      {"indexer wq_b_scale empty (a2a3 reads the plain views)", 0, true,
       [](Call& c, Rig&) { c.w.indexer.wq_b_scale = {}; }},
      {"missing idx_kv_scale", kCsa, true, [](Call& c, Rig&) { c.c.idx_kv_scale = {}; }},
      {"idx_kv_scale one row short", kCsa, false,
       [](Call& c, Rig&) {
         c.c.idx_kv_scale = c.c.idx_kv_scale.slice(0, 0, c.c.idx_kv_scale.extent(0) - 1);
       }},
      {"missing inner_state", kCsa, false, [](Call& c, Rig&) { c.c.inner_state = {}; }},
      {"missing packed indexer query (CPU)", kCsa, false,
       [](Call& c, Rig&) { c.w.indexer.packed_query = nullptr; }},
      // Page 3 of request 0 (start 8191: 2048 visible index rows = pages 0..15) unmapped; the
      // metadata accepts it (no slot of this step is in that page), the indexer score must not.
      {"idx_block_table -1 inside the visible range", kCsa, true,
       [](Call& c, Rig& r) { c.md = &md_with_table_entry(c, r, idx_table, 0, 3, -1); }},
  };
  return cases;
}

// Runs every case of `family` on backend `be` (workspace `ws`): each must throw tiledecode::Error
// and leave every buffer unchanged. Returns the number of cases run.
int expect_all_rejected_unchanged(Rig& r, const td::decode::Backend& be, td::decode::Workspace& ws,
                                  bool a2a3_only) {
  int n = 0;
  const unsigned bit = family_bit(r.kind);
  for (const BadCase& bc : bad_cases()) {
    const bool applies =
        a2a3_only
            ? (bc.a2a3 && (bc.families == 0 ? r.kind == LayerKind::csa : (bc.families & bit) != 0))
            : (bc.families & bit) != 0;
    if (!applies) continue;
    SCOPED_TRACE(family_name(r.kind) + ": " + bc.name);
    Call call = base_call(r, be, ws);
    bc.make(call, r);
    Snapshot before;
    before.add("x_out", r.x_out.view());
    add_caches(before, r.L.caches);
    add_workspace(before, ws);
    // Also the buffer x_out aliases in that case (x_hc) and the rig's metadata.
    before.add("x_hc", r.x_hc.view());
    add_metadata(before, r.md);
    std::string msg;
    try {
      call.run(r.cfg);
    } catch (const td::Error& e) {
      msg = e.what();
    }
    EXPECT_FALSE(msg.empty()) << "accepted (no tiledecode::Error)";
    Snapshot after;
    after.add("x_out", r.x_out.view());
    add_caches(after, r.L.caches);
    add_workspace(after, ws);
    after.add("x_hc", r.x_hc.view());
    add_metadata(after, r.md);
    const std::string changed = before.diff(after);
    EXPECT_TRUE(changed.empty()) << "written before the throw: " << changed << "; error: " << msg;
    if (std::getenv("TD_AON_VERBOSE"))
      std::fprintf(stderr, "  [%s%s] %s -> %s\n", family_name(r.kind).c_str(),
                   be.kind == td::decode::BackendKind::a2a3 ? " a2a3" : "", bc.name, msg.c_str());
    ++n;
  }
  return n;
}

void run_family_cpu(LayerKind kind) {
  Rig r(kind);
  // The base arguments are valid: one real step (it also fills the workspace).
  ASSERT_NO_THROW(td::decode::layer_step(r.be, r.x_out.view(), r.x_hc.view(), r.L.weights.view(),
                                         r.L.caches.view(), r.md, r.L.rope.view(), r.ws, r.cfg));
  const int n = expect_all_rejected_unchanged(r, r.be, r.ws, false);
  EXPECT_GE(n, 20);
  std::printf("%s: %d bad-input classes rejected with every buffer unchanged\n",
              family_name(kind).c_str(), n);
}

TEST(AllOrNothing, SwaEveryBadClassRejectedNothingWritten) {
  run_family_cpu(LayerKind::swa);
}
TEST(AllOrNothing, CsaEveryBadClassRejectedNothingWritten) {
  run_family_cpu(LayerKind::csa);
}
TEST(AllOrNothing, HcaEveryBadClassRejectedNothingWritten) {
  run_family_cpu(LayerKind::hca);
}

// The a2a3 model validates the same plan (plus its own schedule checks) before its first launch.
void run_family_a2a3(LayerKind kind) {
  Rig r(kind);
  td::a2a3::Machine machine(&r.pool);
  const auto be = td::decode::Backend::a2a3(&machine);
  td::decode::Workspace ws(r.cfg, kMaxBatch, kS, be);
  // The base arguments pass the whole validation on this backend.
  ASSERT_NO_THROW(td::decode::validate_layer_step(be, r.x_out.view(), r.x_hc.view(),
                                                  r.L.weights.view(), r.L.caches.view(), r.md,
                                                  r.L.rope.view(), ws, r.cfg));
  const int n = expect_all_rejected_unchanged(r, be, ws, true);
  EXPECT_GE(n, 6);
  std::printf("%s on a2a3: %d bad-input classes rejected with every buffer unchanged\n",
              family_name(kind).c_str(), n);
}

TEST(AllOrNothing, A2a3SwaBadClassesRejectedNothingWritten) {
  run_family_a2a3(LayerKind::swa);
}
TEST(AllOrNothing, A2a3CsaBadClassesRejectedNothingWritten) {
  run_family_a2a3(LayerKind::csa);
}
TEST(AllOrNothing, A2a3HcaBadClassesRejectedNothingWritten) {
  run_family_a2a3(LayerKind::hca);
}

// A state-table entry -2 in a page the metadata builder reads (the token's own state page): the
// build throws and the previous step's bundle is intact (nothing of it changed).
TEST(AllOrNothing, MetadataBuildRejectsStateEntryMinus2AndKeepsTheBundle) {
  const td::ModelConfig cfg = td::flash_config();
  td::paged::FixtureTables fx(kMaxBatch, cfg);
  td::paged::StepMetadata md(kMaxBatch, kS, cfg);
  const std::vector<std::int32_t> starts{8191, 127};
  const td::paged::StepShape sh{kB, kS, 1};
  md.build(starts, sh, fx.tables(), fx.pools, cfg);
  struct Entry {
    const char* name;
    td::Tensor<std::int32_t, 2>& (*pick)(td::paged::FixtureTables&);
    index_t col;
  };
  const Entry entries[] = {{"csa_state_table", csa_state_table, 8191 / 4},
                           {"csa_inner_state_table", inner_state_table, 8192 / 4},
                           {"hca_state_table", hca_state_table, 8192 / 8}};
  for (const Entry& e : entries) {
    SCOPED_TRACE(e.name);
    td::paged::FixtureTables bad = fx;
    e.pick(bad).view()(0, e.col) = -2;
    Snapshot before;
    add_metadata(before, md);
    EXPECT_THROW(md.build(starts, sh, bad.tables(), bad.pools, cfg), td::Error);
    Snapshot after;
    add_metadata(after, md);
    EXPECT_TRUE(before.diff(after).empty()) << before.diff(after);
    EXPECT_EQ(md.tables().csa_state_table.data(), fx.csa_state_table.data());
  }
}

// Tables with more rows than the batch (an engine's max-batch tables) are accepted and give the
// same bytes (x_out, every pool, every workspace buffer, the metadata) as exact-size tables.
td::Tensor<std::int32_t, 2> first_rows(const td::Tensor<std::int32_t, 2>& t, index_t rows) {
  td::Tensor<std::int32_t, 2> r({rows, t.extent(1)});
  std::copy_n(t.data(), r.size(), r.data());
  return r;
}

TEST(AllOrNothing, MaxBatchTablesAcceptedAndEqualExactSizeTables) {
  for (LayerKind kind : {LayerKind::swa, LayerKind::csa, LayerKind::hca}) {
    SCOPED_TRACE(family_name(kind));
    Rig r(kind);
    const td::decode::LayerCacheStorage pristine = r.L.caches;
    auto restore = [&] {
      auto copy = [](auto& dst, const auto& src) {
        std::copy_n(src.data(), src.size(), dst.data());
      };
      copy(r.L.caches.kv_cache, pristine.kv_cache);
      copy(r.L.caches.cmp_kv, pristine.cmp_kv);
      copy(r.L.caches.state, pristine.state);
      copy(r.L.caches.inner_state, pristine.inner_state);
      copy(r.L.caches.idx_kv_cache, pristine.idx_kv_cache);
      copy(r.L.caches.idx_kv_scale, pristine.idx_kv_scale);
    };
    auto step = [&](const td::paged::StepMetadata& md) {
      td::decode::layer_step(r.be, r.x_out.view(), r.x_hc.view(), r.L.weights.view(),
                             r.L.caches.view(), md, r.L.rope.view(), r.ws, r.cfg);
      Snapshot s = r.snapshot();
      add_metadata(s, md);
      return s;
    };
    ASSERT_EQ(r.fx.block_table.extent(0), kMaxBatch);
    const Snapshot wide = step(r.md);  // built from the 4-row tables, B = 2
    restore();
    td::paged::FixtureTables exact = r.fx;
    exact.block_table = first_rows(r.fx.block_table, kB);
    exact.cmp_block_table = first_rows(r.fx.cmp_block_table, kB);
    exact.idx_block_table = first_rows(r.fx.idx_block_table, kB);
    exact.hca_state_table = first_rows(r.fx.hca_state_table, kB);
    exact.csa_state_table = first_rows(r.fx.csa_state_table, kB);
    exact.csa_inner_state_table = first_rows(r.fx.csa_inner_state_table, kB);
    td::paged::StepMetadata md(kB, kS, r.cfg);
    md.build(r.starts, r.sh, exact.tables(), exact.pools, r.cfg);
    const Snapshot narrow = step(md);
    EXPECT_TRUE(wide.diff(narrow).empty()) << wide.diff(narrow);
  }
}

// A huge finite indexer query scale (1e38 for every column): the dequantised query overflows to
// Inf inside the step. q_sc is produced inside the step, so there is nothing to reject up front
// (the weights are finite); the step must then run to the end — never write and throw. Checked
// on the CPU (the packed weights re-packed from the patched scale) and on the a2a3 model (plain
// views). If a backend does reject it, nothing may have been written.
void huge_idx_scale(bool a2a3) {
  Rig r(LayerKind::csa);
  td::a2a3::Machine machine(&r.pool);
  const auto be = a2a3 ? td::decode::Backend::a2a3(&machine) : r.be;
  td::decode::Workspace ws_a2a3;
  if (a2a3) ws_a2a3 = td::decode::Workspace(r.cfg, kMaxBatch, kS, be);
  td::decode::Workspace& ws = a2a3 ? ws_a2a3 : r.ws;
  Call call = base_call(r, be, ws);
  auto& scale =
      call.make<td::Tensor<float, 1>>(std::array<index_t, 1>{r.L.weights.idx_wq_b_scale.extent(0)});
  std::fill_n(scale.data(), scale.size(), 1e38f);
  call.w.indexer.wq_b_scale = scale.view();
  std::string pack_error;
  try {
    auto& packed =
        call.make<td::kernels::IndexerQueryWeights>(td::kernels::pack_indexer_query_weights(
            r.cfg, r.L.weights.idx_wq_b.view(), scale.view(), r.L.weights.hadamard.view()));
    call.w.indexer.packed_query = &packed;
  } catch (const td::Error& e) {
    pack_error = e.what();  // rejected at load time: nothing of a step ran
  }
  if (!pack_error.empty()) {
    std::printf("idx_wq_b_scale 1e38 rejected by pack_indexer_query_weights: %s\n",
                pack_error.c_str());
    return;
  }
  Snapshot before = [&] {
    Snapshot s;
    s.add("x_out", r.x_out.view());
    add_caches(s, r.L.caches);
    add_workspace(s, ws);
    return s;
  }();
  std::string msg;
  try {
    call.run(r.cfg);
  } catch (const td::Error& e) {
    msg = e.what();
  }
  if (!msg.empty()) {
    Snapshot after;
    after.add("x_out", r.x_out.view());
    add_caches(after, r.L.caches);
    add_workspace(after, ws);
    EXPECT_TRUE(before.diff(after).empty())
        << "threw after writing: " << before.diff(after) << "; " << msg;
    std::printf("idx_wq_b_scale 1e38 (%s): rejected up front: %s\n", a2a3 ? "a2a3" : "cpu",
                msg.c_str());
    return;
  }
  // It ran: the indexer query scales overflow (Inf / NaN), the top-k never selects NaN, the
  // attention and everything after it still see finite inputs.
  const auto v = ws.views(kB, kS);
  index_t nonfinite_qsc = 0, topk_valid = 0, nonfinite_x = 0;
  for (index_t i = 0; i < v.idx_q_scale.size(); ++i)
    nonfinite_qsc += !std::isfinite(v.idx_q_scale.data()[i]);
  for (index_t t = 0; t < v.T; ++t)
    for (index_t k = 0; k < r.cfg.idx_topk; ++k) topk_valid += v.topk_idxs(t, k) >= 0;
  for (index_t i = 0; i < r.x_out.view().size(); ++i)
    nonfinite_x += !std::isfinite(r.x_out.data()[i]);
  std::printf(
      "idx_wq_b_scale 1e38 (%s): step ran; %lld/%lld non-finite q_sc, %lld valid top-k ids, "
      "%lld non-finite x_out values\n",
      a2a3 ? "a2a3" : "cpu", (long long)nonfinite_qsc, (long long)v.idx_q_scale.size(),
      (long long)topk_valid, (long long)nonfinite_x);
  EXPECT_EQ(nonfinite_x, 0) << "x_out must stay finite (top-k skips the NaN scores)";
}

TEST(AllOrNothing, HugeIndexerScaleNeverWritesThenThrowsCpu) {
  huge_idx_scale(false);
}
TEST(AllOrNothing, HugeIndexerScaleNeverWritesThenThrowsA2a3) {
  huge_idx_scale(true);
}

}  // namespace

namespace {

// The indexer query's rope_pos is workspace the step fills when the kernel runs; validation checks
// the positions it will derive (decode/step.hpp, validate_plan), never the buffer's leftovers:
// a valid CSA step on a workspace whose idx_rope_pos holds garbage runs and gives the same bytes.
TEST(AllOrNothing, StaleIndexerRopePositionsDoNotRejectAValidStep) {
  Rig r(LayerKind::csa);
  auto step = [&] {
    td::decode::layer_step(r.be, r.x_out.view(), r.x_hc.view(), r.L.weights.view(),
                           r.L.caches.view(), r.md, r.L.rope.view(), r.ws, r.cfg);
  };
  const td::decode::LayerCacheStorage pristine = r.L.caches;
  step();
  const Snapshot clean = r.snapshot();
  r.L.caches = pristine;
  // Garbage in the rows this step uses (kB x kS tokens; the rows past them are not this step's).
  const auto v = r.ws.views(kB, kS);
  ASSERT_EQ(v.idx_rope_pos.size(), kB * kS);
  std::fill_n(v.idx_rope_pos.data(), v.idx_rope_pos.size(), 0x5A5A5A5A);
  EXPECT_NO_THROW(td::decode::layer_step(r.be, r.x_out.view(), r.x_hc.view(), r.L.weights.view(),
                                         r.L.caches.view(), r.md, r.L.rope.view(), r.ws, r.cfg));
  const Snapshot stale = r.snapshot();
  EXPECT_TRUE(clean.diff(stale).empty()) << clean.diff(stale);
}

}  // namespace
