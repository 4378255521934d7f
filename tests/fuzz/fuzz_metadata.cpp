// Fuzz target: paged decode metadata builders (paged/metadata.hpp) with arbitrary start
// positions, commit tokens, table widths and table contents, and small custom configs; then
// StepMetadata::build (paged/step_metadata.hpp) in all three layouts (base, #862 device ring,
// #955 prefix caching; HEAD addendum §2, §3) with ring tables (periodic, perturbed, random),
// random block_counts, the addendum §7 state-page pairings and contexts up to 2^20.
// Invariants: a builder either throws tiledecode::Error having written nothing, or writes
// exactly what an independent plain model of spec §3 predicts; it throws iff that model says
// the input is invalid; it never writes outside its output views (canaries). For StepMetadata:
// it throws iff a plain model of the documented contract says the input is invalid, a failed
// build leaves the previous step's metadata bit-identical, and a successful one equals the
// golden twins (golden/paged.hpp) with every slot -1 or inside its pool (no write outside a
// pool, ever).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz_common.hpp"
#include "tiledecode/golden/paged.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace td = tiledecode;
namespace tp = tiledecode::paged;
using td::index_t;

namespace {

using tdfuzz::g_verbose;  // TDFUZZ_DUMP=1: print each decoded case and every error message
using tdfuzz::kFill;

void note(const td::Error& e) {
  if (g_verbose) std::fprintf(stderr, "  threw: %s\n", e.what());
}

// An int32 biased toward the interesting edges of [lo, hi).
std::int32_t edge_int(FuzzedDataProvider& in, std::int64_t lo, std::int64_t hi) {
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0:
      return static_cast<std::int32_t>(lo - 1);
    case 1:
      return static_cast<std::int32_t>(lo);
    case 2:
      return static_cast<std::int32_t>(hi - 1);
    case 3:
      return static_cast<std::int32_t>(hi);
    case 4:
      return in.ConsumeIntegral<std::int32_t>();
    case 5:
      return -1;
    default:
      return static_cast<std::int32_t>(in.ConsumeIntegralInRange<std::int64_t>(lo - 2, hi + 1));
  }
}

struct Case {
  td::ModelConfig cfg = td::flash_config();
  tp::StepShape sh;
  std::vector<std::int32_t> start;
  std::vector<std::int32_t> pos;
  index_t rows = 0, cols = 0;
  std::vector<std::int32_t> table;
  index_t num_blocks = 0;
  int ratio = 4;
  int state_page = 4;
  int len_delta = 0;  // output-extent mismatch to exercise the extent checks

  bool shape_ok() const {
    return sh.batch >= 1 && sh.batch < (1 << 20) && sh.seq >= 1 && sh.seq < (1 << 10) &&
           sh.commit_tokens >= -1 && sh.commit_tokens <= sh.seq;
  }
  std::int64_t committed() const { return sh.commit_tokens < 0 ? sh.seq : sh.commit_tokens; }
  index_t tokens() const { return index_t(sh.batch) * sh.seq; }
  bool starts_ok() const {
    if (index_t(start.size()) != sh.batch) return false;
    for (auto s : start)
      if (s < 0 || s > cfg.max_seq_len - sh.seq) return false;
    return true;
  }
  bool positions_ok() const {
    if (index_t(pos.size()) != tokens()) return false;
    for (auto p : pos)
      if (p < 0 || p >= cfg.max_seq_len) return false;
    return true;
  }
  // A table has a row per request (more rows allowed) and at least one column.
  bool table_ok() const { return rows >= sh.batch && cols >= 1; }
  // Pool size: >= 1 block and every slot below `max_rows` (2^62 INT64 maps, 2^31 INT32 lists).
  bool blocks_ok(index_t page, index_t max_rows) const {
    return num_blocks >= 1 && num_blocks <= max_rows / page;
  }
  // Block of logical column c of request b: -1 unmapped (entry -1) or past the width,
  // -2 invalid (entry < -1 or >= pool blocks).
  index_t block(index_t b, index_t c) const {
    if (c < 0 || c >= cols) return -1;
    const index_t e = table[b * cols + c];
    if (e == -1) return -1;
    return (e < -1 || e >= num_blocks) ? -2 : e;
  }
  // Slot of absolute row `row` through the table with `page` rows per block (-2: invalid).
  std::int64_t slot(index_t b, index_t row, index_t page) const {
    const index_t blk = block(b, row / page);
    return blk < 0 ? blk : blk * page + row % page;
  }
};

Case make_case(FuzzedDataProvider& in) {
  Case k;
  static constexpr int kPages[] = {1, 4, 7, 128};
  static constexpr int kWindows[] = {1, 5, 128};
  static constexpr int kMaxLens[] = {16, 300, 16384};
  k.cfg.page = in.PickValueInArray(kPages);
  k.cfg.window = in.PickValueInArray(kWindows);
  k.cfg.max_seq_len = in.PickValueInArray(kMaxLens);
  k.sh.batch = in.ConsumeIntegralInRange(-1, 6);
  k.sh.seq = in.ConsumeIntegralInRange(-1, 5);
  k.sh.commit_tokens = in.ConsumeIntegralInRange(-2, 6);
  k.len_delta = in.ConsumeProbability<float>() < 0.1f ? in.ConsumeIntegralInRange(-1, 1) : 0;
  const int nb = std::max(0, k.sh.batch) + (in.ConsumeProbability<float>() < 0.05f ? 1 : 0);
  const int seq = std::max(1, k.sh.seq);
  for (int b = 0; b < nb; ++b) k.start.push_back(edge_int(in, 0, k.cfg.max_seq_len - seq + 1));
  // Positions: mostly start + s (what an engine passes), sometimes arbitrary.
  const bool raw_pos = in.ConsumeProbability<float>() < 0.2f;
  for (int b = 0; b < nb; ++b)
    for (int s = 0; s < std::max(0, k.sh.seq); ++s)
      k.pos.push_back(raw_pos ? edge_int(in, 0, k.cfg.max_seq_len)
                              : static_cast<std::int32_t>(std::int64_t(k.start[b]) + s));
  k.num_blocks = in.ConsumeProbability<float>() < 0.05f
                     ? in.ConsumeIntegralInRange<index_t>(-4, index_t(1) << 40)
                     : in.ConsumeIntegralInRange<index_t>(0, 80);
  k.rows = std::max(0, k.sh.batch) + (in.ConsumeProbability<float>() < 0.05f ? 1 : 0);
  k.cols = in.ConsumeIntegralInRange<index_t>(0, 40);
  k.table.resize(std::size_t(k.rows * k.cols));
  for (auto& e : k.table) {
    e = in.ConsumeProbability<float>() < 0.05f
            ? edge_int(in, 0, std::max<index_t>(1, std::min<index_t>(k.num_blocks, INT32_MAX)))
            : in.ConsumeIntegralInRange<std::int32_t>(-3, 80);
  }
  static constexpr int kRatios[] = {4, 128, 4, 128, 3};
  static constexpr int kStatePages[] = {4, 8, 4, 8, 16};
  k.ratio = in.PickValueInArray(kRatios);
  k.state_page = in.PickValueInArray(kStatePages);
  return k;
}

template <class T>
void expect_untouched(const tdfuzz::Guarded<T>& g) {
  TDFUZZ_CHECK(g.canaries_intact());
  TDFUZZ_CHECK(g.body_is(kFill));
}

void fuzz_positions(const Case& k) {
  const bool lens_ok = k.shape_ok() && k.starts_ok();
  for (int which = 0; which < 2; ++which) {
    const index_t want = which == 0 ? k.tokens() : k.sh.batch;
    const index_t n = std::max<index_t>(0, want + k.len_delta);
    tdfuzz::Guarded<std::int32_t> out(std::size_t(n), kFill);
    td::View<std::int32_t, 1> v(out.data(), {n});
    bool threw = false;
    try {
      if (which == 0)
        tp::build_position_ids(v, k.start, k.sh, k.cfg);
      else
        tp::build_kv_seq_lens(v, k.start, k.sh, k.cfg);
    } catch (const td::Error&) {
      threw = true;
    }
    const bool valid = lens_ok && n == want;
    TDFUZZ_CHECK(threw == !valid, which, n);
    if (threw) {
      expect_untouched(out);
      continue;
    }
    TDFUZZ_CHECK(out.canaries_intact());
    for (index_t b = 0; b < k.sh.batch; ++b) {
      if (which == 0) {
        for (index_t s = 0; s < k.sh.seq; ++s)
          TDFUZZ_CHECK(out[b * k.sh.seq + s] == k.start[b] + s, b, s);
      } else {
        TDFUZZ_CHECK(out[b] == k.start[b] + k.committed(), b);
      }
    }
  }
}

void fuzz_fixture_table(const Case& k) {
  const index_t rows = std::max<index_t>(0, k.rows), cols = k.cols;
  tdfuzz::Guarded<std::int32_t> out(std::size_t(rows * cols), kFill);
  td::View<std::int32_t, 2> v(out.data(), {rows, cols});
  const bool permuted = (k.ratio == 128);
  bool threw = false;
  try {
    tp::build_fixture_block_table(v, k.num_blocks, permuted);
  } catch (const td::Error& e) {
    threw = true;
    note(e);
  }
  const bool valid = k.num_blocks >= 1 && k.num_blocks < (index_t(1) << 31);
  TDFUZZ_CHECK(threw == !valid, k.num_blocks);
  if (threw) return expect_untouched(out);
  TDFUZZ_CHECK(out.canaries_intact());
  const index_t p = k.num_blocks;
  for (index_t b = 0; b < rows; ++b)
    for (index_t c = 0; c < cols; ++c) {
      const index_t phys = permuted ? ((c % p) * 7 + 3) % p : c % p;
      const index_t e = out[b * cols + c];
      TDFUZZ_CHECK(e == (phys * rows + b) % p, b, c);
      TDFUZZ_CHECK(e >= 0 && e < p, e, p);
    }
}

// One of the three slot-mapping builders; `kind` 0 = ori, 1 = compressed, 2 = state.
void fuzz_slot_mapping(const Case& k, int kind) {
  const index_t n = std::max<index_t>(0, k.tokens() + k.len_delta);
  tdfuzz::Guarded<std::int64_t> out(std::size_t(n), kFill);
  td::View<std::int64_t, 1> v(out.data(), {n});
  td::ConstView<std::int32_t, 1> pos(k.pos.data(), {index_t(k.pos.size())});
  td::ConstView<std::int32_t, 2> table(k.table.data(), {k.rows, k.cols});
  bool threw = false;
  try {
    if (kind == 0) tp::build_ori_slot_mapping(v, pos, table, k.num_blocks, k.sh, k.cfg);
    if (kind == 1)
      tp::build_compressed_slot_mapping(v, pos, table, k.num_blocks, k.ratio, k.sh, k.cfg);
    if (kind == 2)
      tp::build_state_slot_mapping(v, pos, table, k.num_blocks, k.state_page, k.sh, k.cfg);
  } catch (const td::Error& e) {
    threw = true;
    note(e);
  }
  const index_t page = kind == 2 ? k.state_page : k.cfg.page;
  bool valid = k.shape_ok() && k.positions_ok() && k.table_ok() && n == k.tokens() &&
               k.blocks_ok(page, index_t(1) << 62);
  if (kind == 1) valid = valid && (k.ratio == 4 || k.ratio == 128);
  if (kind == 2) valid = valid && (k.state_page == 4 || k.state_page == 8);
  std::vector<std::int64_t> want;
  if (valid) {
    for (index_t t = 0; t < k.tokens(); ++t) {
      const index_t b = t / k.sh.seq, s = t % k.sh.seq, p = k.pos[t];
      std::int64_t slot = -1;
      if (kind == 0) slot = k.slot(b, p, k.cfg.page);
      if (kind == 1 && (p + 1) % k.ratio == 0 && s < k.committed())
        slot = k.slot(b, p / k.ratio, k.cfg.page);
      if (kind == 2) slot = k.slot(b, p, k.state_page);
      if (slot == -2) valid = false;
      want.push_back(slot);
    }
  }
  TDFUZZ_CHECK(threw == !valid, kind, threw);
  if (threw) return expect_untouched(out);
  TDFUZZ_CHECK(out.canaries_intact());
  for (index_t t = 0; t < n; ++t) TDFUZZ_CHECK(out[t] == want[t], t, out[t]);
}

void fuzz_window(const Case& k) {
  const index_t n = std::max<index_t>(0, k.tokens() + k.len_delta), w = k.cfg.window;
  tdfuzz::Guarded<std::int32_t> idx(std::size_t(n * w), kFill), lens(std::size_t(n), kFill);
  td::View<std::int32_t, 2> vi(idx.data(), {n, w});
  td::View<std::int32_t, 1> vl(lens.data(), {n});
  td::ConstView<std::int32_t, 1> pos(k.pos.data(), {index_t(k.pos.size())});
  td::ConstView<std::int32_t, 2> table(k.table.data(), {k.rows, k.cols});
  bool threw = false;
  try {
    tp::build_window_indices(vi, vl, pos, table, k.num_blocks, k.sh, k.cfg);
  } catch (const td::Error& e) {
    threw = true;
    note(e);
  }
  bool valid = k.shape_ok() && k.positions_ok() && k.table_ok() && n == k.tokens() &&
               k.blocks_ok(k.cfg.page, index_t(1) << 31);
  std::vector<std::int32_t> want_idx, want_len;
  if (valid) {
    for (index_t t = 0; t < n; ++t) {
      const index_t b = t / k.sh.seq, p = k.pos[t], w0 = std::max<index_t>(0, p - w + 1);
      want_len.push_back(std::int32_t(p - w0 + 1));
      for (index_t j = 0; j < w; ++j) {
        std::int64_t slot = j < p - w0 + 1 ? k.slot(b, w0 + j, k.cfg.page) : -1;
        if (slot == -2) valid = false;
        want_idx.push_back(std::int32_t(slot));
      }
    }
  }
  TDFUZZ_CHECK(threw == !valid, threw);
  if (threw) {
    expect_untouched(idx);
    expect_untouched(lens);
    return;
  }
  TDFUZZ_CHECK(idx.canaries_intact() && lens.canaries_intact());
  for (index_t t = 0; t < n; ++t) {
    TDFUZZ_CHECK(lens[t] == want_len[t], t, lens[t]);
    TDFUZZ_CHECK(lens[t] >= 1 && lens[t] <= w, t, lens[t]);
    for (index_t j = 0; j < w; ++j) {
      const std::int32_t s = idx[t * w + j];
      TDFUZZ_CHECK(s == want_idx[t * w + j], t, j);
      TDFUZZ_CHECK(s == -1 || (s >= 0 && s < k.num_blocks * k.cfg.page), s);
    }
  }
}

// --- StepMetadata::build in every layout ------------------------------------------------------

namespace gd = tiledecode::golden;
using tp::Layout;

// The eight table fields of StepTables, in this order.
enum TableField { kOriT, kCmpT, kIdxT, kHstT, kCstT, kIstT, kHcmpT, kCcmpT, kNumFields };

struct StepCase {
  td::ModelConfig cfg = td::flash_config();
  Layout layout = Layout::base;
  tp::StepShape sh;
  std::vector<std::int32_t> start;
  index_t rows[kNumFields] = {}, cols[kNumFields] = {};
  std::vector<std::int32_t> table[kNumFields];
  index_t bc_rows = 0, bc_cols = 0;
  std::vector<std::int32_t> counts;
  tp::PoolSizes pools;

  td::ConstView<std::int32_t, 2> view(int f) const { return {table[f].data(), {rows[f], cols[f]}}; }
  tp::StepTables tables() const {
    tp::StepTables t{view(kOriT), view(kCmpT), view(kIdxT), view(kHstT), view(kCstT), view(kIstT)};
    t.layout = layout;
    t.hca_cmp_block_table = view(kHcmpT);
    t.csa_cmp_block_table = view(kCcmpT);
    t.block_counts = td::ConstView<std::int32_t, 2>(counts.data(), {bc_rows, bc_cols});
    return t;
  }
};

constexpr int kMaxBatch = 6, kMaxSeq = 8;
constexpr index_t kTwo62 = index_t(1) << 62;

// What each ring group reads in the model (plain restatement of the documented contract).
struct Group {
  int field;      // TableField
  int count_col;  // block_counts column
  index_t P;      // pool pages
  index_t rows;   // storage rows per page
  int ratio;
  bool state;
};

// The ring groups of a layout (device_ring: the CSA ratio-4 use of the shared table is served
// only with a CSA state table).
int ring_groups(const StepCase& k, Group* g) {
  const auto& c = k.cfg;
  const auto& p = k.pools;
  int n = 0;
  if (k.layout == Layout::prefix_caching) {
    g[n++] = {kHcmpT, 1, p.hca_cmp, c.page / 128, 128, false};
    g[n++] = {kCcmpT, 2, p.csa_cmp, c.page / 4, 4, false};
    g[n++] = {kIdxT, 3, p.idx, c.page / 4, 4, false};
    g[n++] = {kHstT, 4, p.hca_state, c.c128_state_page, 128, true};
    g[n++] = {kCstT, 5, p.csa_state, c.c4_state_page, 4, true};
    g[n++] = {kIstT, 6, p.csa_inner_state, c.c4_state_page, 4, true};
  } else {
    g[n++] = {kCmpT, 1, p.cmp, c.page, 128, false};
    if (k.cols[kCstT] > 0) g[n++] = {kCmpT, 1, p.cmp, c.page, 4, false};
    g[n++] = {kIdxT, 2, p.idx, c.page, 4, false};
    g[n++] = {kHstT, 3, p.hca_state, c.c128_state_page, 128, true};
    g[n++] = {kCstT, 4, p.csa_state, c.c4_state_page, 4, true};
    g[n++] = {kIstT, 5, p.csa_inner_state, c.c4_state_page, 4, true};
  }
  return n;
}

bool entry_ok(std::int64_t e, index_t P) {
  return e == -1 || (e >= 0 && e < P);
}

// Does the plain model accept this step?
bool step_valid(const StepCase& k) {
  const auto& c = k.cfg;
  const auto& sh = k.sh;
  if (sh.batch < 1 || sh.batch > kMaxBatch || sh.seq < 1 || sh.seq > kMaxSeq) return false;
  if (sh.commit_tokens < -1 || sh.commit_tokens > sh.seq) return false;
  for (int v : {c.page, c.c4_state_page, c.c128_state_page})
    if (v < 1 || v >= (1 << 30)) return false;
  if (k.layout == Layout::prefix_caching && c.page % 128 != 0) return false;
  if (index_t(k.start.size()) != sh.batch) return false;
  for (auto s : k.start)
    if (s < 0 || std::int64_t(s) + sh.seq > c.max_seq_len) return false;
  const auto& p = k.pools;
  if (p.ori < 1 || p.ori > (index_t(1) << 31) / c.page) return false;
  const index_t B = sh.batch, S = sh.seq;
  const index_t committed = sh.commit_tokens < 0 ? S : sh.commit_tokens;
  auto pos = [&](index_t b, index_t s) { return index_t(k.start[b]) + s; };
  // A table a base builder reads: a row per request and a column.
  auto shaped = [&](int f) { return k.rows[f] >= B && k.cols[f] >= 1; };
  auto entry = [&](int f, index_t b, index_t col) -> std::int64_t {
    return col < k.cols[f] ? k.table[f][b * k.cols[f] + col] : -1;
  };
  // ori and windows (every layout): the page of each token and of each window position.
  if (!shaped(kOriT)) return false;
  for (index_t b = 0; b < B; ++b)
    for (index_t s = 0; s < S; ++s) {
      const index_t x = pos(b, s), w0 = std::max<index_t>(0, x - c.window + 1);
      for (index_t col = w0 / c.page; col <= x / c.page; ++col)
        if (!entry_ok(entry(kOriT, b, col), p.ori)) return false;
    }
  if (k.layout == Layout::base) {
    const index_t pool[kNumFields] = {p.ori,       p.cmp,       p.idx,
                                      p.hca_state, p.csa_state, p.csa_inner_state};
    const index_t page[kNumFields] = {c.page,          c.page,         c.page, c.c128_state_page,
                                      c.c4_state_page, c.c4_state_page};
    for (int f = kCmpT; f <= kIstT; ++f)
      if (pool[f] < 1 || pool[f] > kTwo62 / page[f] || !shaped(f)) return false;
    for (index_t b = 0; b < B; ++b)
      for (index_t s = 0; s < S; ++s) {
        const index_t x = pos(b, s);
        for (int f = kHstT; f <= kIstT; ++f)
          if (!entry_ok(entry(f, b, x / page[f]), pool[f])) return false;
        if (s >= committed) continue;
        if ((x + 1) % 128 == 0 && !entry_ok(entry(kCmpT, b, x / 128 / c.page), p.cmp)) return false;
        if ((x + 1) % 4 == 0 && !entry_ok(entry(kCmpT, b, x / 4 / c.page), p.cmp)) return false;
        if ((x + 1) % 4 == 0 && !entry_ok(entry(kIdxT, b, x / 4 / c.page), p.idx)) return false;
      }
    return true;
  }
  if (k.bc_rows < B || k.bc_cols != (k.layout == Layout::prefix_caching ? 7 : 6)) return false;
  Group g[6];
  const int ng = ring_groups(k, g);
  for (int i = 0; i < ng; ++i)
    if (k.cols[g[i].field] > 0 && (g[i].P < 1 || g[i].P > kTwo62 / g[i].rows)) return false;
  for (int i = 0; i < ng; ++i) {
    const Group& r = g[i];
    const index_t width = k.cols[r.field];
    if (width == 0) continue;  // not served
    if (k.rows[r.field] < B) return false;
    for (index_t b = 0; b < B; ++b) {
      const index_t n = k.counts[b * k.bc_cols + r.count_col];
      if (n < 1 || n > width) return false;
      const index_t p_min = pos(b, 0), p_max = pos(b, S - 1);
      index_t lo = 0, hi = -1;
      if (r.state) {
        index_t first = p_min;
        for (index_t x = p_min; x <= p_max; ++x) {
          if ((x + 1) % r.ratio) continue;
          const index_t cr = x / r.ratio;
          first = std::min(first, (r.ratio == 4 && cr > 0) ? (cr - 1) * 4 : cr * r.ratio);
        }
        lo = first / r.rows;
        hi = p_max / r.rows;
      } else if ((p_max + 1) / r.ratio >= 1) {
        hi = ((p_max + 1) / r.ratio - 1) / r.rows;
      }
      if (hi >= width) return false;
      for (index_t col = lo; col <= hi; ++col) {
        const std::int64_t ring = k.table[r.field][b * width + col % n];
        if (!entry_ok(ring, r.P)) return false;
        if (k.table[r.field][b * width + col] != ring) return false;  // not periodic
      }
    }
  }
  return true;
}

// Every output of a bundle, flattened (for "unchanged after a failed build" and golden checks).
struct Snapshot {
  std::vector<std::int64_t> v;
  bool operator==(const Snapshot&) const = default;
};
Snapshot snapshot(const tp::StepMetadata& md) {
  Snapshot s;
  auto add1 = [&](auto view) {
    s.v.push_back(view.extent(0));
    for (index_t i = 0; i < view.extent(0); ++i) s.v.push_back(view(i));
  };
  add1(md.position_ids());
  add1(md.kv_seq_lens());
  for (int g = 0; g < td::rules::kNumTables; ++g) add1(md.slot_mapping(tp::Table(g)));
  add1(md.window_lens());
  const auto w = md.window_indices();
  for (index_t t = 0; t < w.extent(0); ++t)
    for (index_t j = 0; j < w.extent(1); ++j) s.v.push_back(w(t, j));
  s.v.push_back(md.shape().batch);
  s.v.push_back(md.shape().seq);
  s.v.push_back(md.shape().commit_tokens);
  return s;
}

// The golden bundle (same flattening) for a valid case.
Snapshot golden_snapshot(const StepCase& k) {
  const auto& c = k.cfg;
  const auto& sh = k.sh;
  const index_t T = sh.tokens(), B = sh.batch;
  const auto tb = k.tables();
  std::vector<std::int32_t> pos(T), lens(B), wl(T), win(T * c.window);
  td::View<std::int32_t, 1> pv(pos.data(), {T});
  gd::build_position_ids(pv, k.start, sh, c);
  gd::build_kv_seq_lens(td::View<std::int32_t, 1>(lens.data(), {B}), k.start, sh, c);
  std::vector<std::int64_t> m[7];
  for (auto& v : m) v.assign(T, -1);
  auto mv = [&](int i) { return td::View<std::int64_t, 1>(m[i].data(), {T}); };
  gd::build_ori_slot_mapping(mv(0), pv, tb.block_table, 0, sh, c);
  gd::build_window_indices(td::View<std::int32_t, 2>(win.data(), {T, index_t(c.window)}),
                           td::View<std::int32_t, 1>(wl.data(), {T}), pv, tb.block_table, 0, sh, c);
  if (k.layout == Layout::base) {
    gd::build_compressed_slot_mapping(mv(1), pv, tb.cmp_block_table, 0, 128, sh, c);
    gd::build_compressed_slot_mapping(mv(2), pv, tb.cmp_block_table, 0, 4, sh, c);
    gd::build_compressed_slot_mapping(mv(3), pv, tb.idx_block_table, 0, 4, sh, c);
    gd::build_state_slot_mapping(mv(4), pv, tb.hca_state_table, 0, c.c128_state_page, sh, c);
    gd::build_state_slot_mapping(mv(5), pv, tb.csa_state_table, 0, c.c4_state_page, sh, c);
    gd::build_state_slot_mapping(mv(6), pv, tb.csa_inner_state_table, 0, c.c4_state_page, sh, c);
  } else {
    const auto bc = tb.block_counts;
    const bool prefix = k.layout == Layout::prefix_caching;
    auto cmp = [&](int out, td::ConstView<std::int32_t, 2> t, int col, int ratio) {
      if (t.extent(1) == 0) return;
      if (prefix)
        gd::build_prefix_compressed_slot_mapping(mv(out), pv, t, bc, col, ratio, sh, c);
      else
        gd::build_ring862_compressed_slot_mapping(mv(out), pv, t, bc, col, ratio, sh, c);
    };
    cmp(1, prefix ? tb.hca_cmp_block_table : tb.cmp_block_table, 1, 128);
    if (prefix || k.cols[kCstT] > 0)
      cmp(2, prefix ? tb.csa_cmp_block_table : tb.cmp_block_table, prefix ? 2 : 1, 4);
    cmp(3, tb.idx_block_table, prefix ? 3 : 2, 4);
    const int sc = prefix ? 4 : 3;
    auto st = [&](int out, td::ConstView<std::int32_t, 2> t, int col, int sb) {
      if (t.extent(1) > 0) gd::build_ring_state_slot_mapping(mv(out), pv, t, bc, col, sb, sh);
    };
    st(4, tb.hca_state_table, sc, c.c128_state_page);
    st(5, tb.csa_state_table, sc + 1, c.c4_state_page);
    st(6, tb.csa_inner_state_table, sc + 2, c.c4_state_page);
  }
  Snapshot s;
  auto addv = [&](const auto& v) {
    s.v.push_back(index_t(v.size()));
    for (auto x : v) s.v.push_back(x);
  };
  addv(pos);
  addv(lens);
  for (auto& v : m) addv(v);
  addv(wl);
  for (auto x : win) s.v.push_back(x);
  s.v.push_back(sh.batch);
  s.v.push_back(sh.seq);
  s.v.push_back(sh.commit_tokens);
  return s;
}

// One table row: `n` entries drawn from the pool (1 in 11 is -1) repeated over the width `w`
// (n = w: arbitrary content). Table generation is harness code with no decisions the fuzzer can
// steer: kept out of the coverage / compare tracing, which made 2^20-column rows cost ~100 ns
// per entry.
__attribute__((no_sanitize("coverage"))) void fill_table_row(std::int32_t* row, index_t w,
                                                             index_t n, index_t pool,
                                                             tdfuzz::Mix& mix) {
  for (index_t c = 0; c < std::min(n, w); ++c) {
    const std::uint64_t h = mix.next();
    row[c] = h % 11 == 0 ? -1 : std::int32_t(h % std::uint64_t(pool));
  }
  for (index_t c = n; c < w; ++c) row[c] = row[c - n];
}

// Like edge_int, but 0 (an exhausted provider) picks a value inside [lo, hi).
std::int32_t step_int(FuzzedDataProvider& in, std::int64_t lo, std::int64_t hi) {
  switch (in.ConsumeIntegralInRange(0, 19)) {  // 18, 19: edge_int (a third of them invalid)
    case 0:
      return static_cast<std::int32_t>(in.ConsumeIntegralInRange<std::int64_t>(lo, hi - 1));
    case 1:
      return static_cast<std::int32_t>(lo);
    case 2:
      return static_cast<std::int32_t>(hi - 1);
    case 3:
    case 4:
    case 5:
      return static_cast<std::int32_t>(std::max(lo, hi - 1 - in.ConsumeIntegralInRange(0, 200)));
    case 18:
    case 19:
      return edge_int(in, lo, hi);
    default:  // near a page / window boundary
      return static_cast<std::int32_t>(
          std::clamp<std::int64_t>(in.ConsumeIntegralInRange<std::int64_t>(0, hi / 128) * 128 -
                                       in.ConsumeIntegralInRange(0, 9),
                                   lo, hi - 1));
  }
}

StepCase make_step_case(FuzzedDataProvider& in) {
  // Rare (invalid-making) choices sit at the top of each range: an exhausted provider reads 0,
  // so short inputs decode to a valid base-layout step.
  StepCase k;
  static constexpr Layout kLayouts[] = {Layout::base, Layout::device_ring, Layout::prefix_caching};
  k.layout = in.PickValueInArray(kLayouts);
  // Pages: the addendum's 32 / 128 (and 256); 64 and 7 are invalid for prefix caching. State
  // pages: the §7 pairings 4/8, 8/32, 2/8; 1/3 (odd but valid) and 0/8 (invalid) rarely.
  static constexpr int kPages[] = {32, 128, 256, 128, 32, 128, 32, 128, 64, 7};
  static constexpr int kStatePairs[][2] = {{4, 8}, {8, 32}, {2, 8}, {4, 8}, {2, 8},
                                           {4, 8}, {8, 32}, {2, 8}, {1, 3}, {0, 8}};
  static constexpr int kMaxLens[] = {300, 2048, 4096, 16384, 300, 2048, 300, 1024};
  static constexpr int kWindows[] = {128, 5, 1};
  k.cfg.page = in.PickValueInArray(kPages);
  // Prefix caching needs a multiple of 128: keep most of its cases valid.
  if (k.layout == Layout::prefix_caching && in.ConsumeProbability<float>() < 0.9f)
    k.cfg.page = k.cfg.page == 256 ? 256 : 128;
  // Prefix caching needs a multiple of 128: keep most of its cases valid.
  if (k.layout == Layout::prefix_caching && in.ConsumeProbability<float>() < 0.9f)
    k.cfg.page = k.cfg.page == 256 ? 256 : 128;
  const auto& pair = kStatePairs[in.ConsumeIntegralInRange(0, 9)];
  k.cfg.c4_state_page = pair[0];
  k.cfg.c128_state_page = pair[1];
  k.cfg.max_seq_len = in.PickValueInArray(kMaxLens);
  // 2^20 (addendum §1.3) in 1 case of 24: its covering tables are megabytes (one such input costs
  // as much as a few hundred others).
  if (in.ConsumeIntegralInRange(0, 23) == 23) k.cfg.max_seq_len = 1 << 20;
  k.cfg.window = in.PickValueInArray(kWindows);
  const bool huge = k.cfg.max_seq_len > 16384;
  // At 2^20 the covering state tables hold 2^20 / SB columns per request: keep SB >= 2 there
  // (the addendum's smallest page) so one input stays a few milliseconds.
  if (huge && k.cfg.c4_state_page < 2) k.cfg.c4_state_page = 2;
  static constexpr int kSeqs[] = {1, 2, 4, 8, 8, 2};  // addendum §8: S in {1, 2, 4, 8}
  // Ranges start at a valid value: an exhausted input (which reads the minimum) stays valid.
  // Invalid shapes are rare, so most inputs reach the table checks.
  k.sh.batch = in.ConsumeIntegralInRange(1, huge ? 2 : kMaxBatch);
  k.sh.seq = in.PickValueInArray(kSeqs);
  k.sh.commit_tokens = in.ConsumeIntegralInRange(-1, k.sh.seq);
  if (in.ConsumeProbability<float>() > 0.98f) {
    static constexpr int kBad[][3] = {{0, 2, -1}, {kMaxBatch + 1, 2, -1},
                                      {2, 0, -1}, {2, kMaxSeq + 1, -1},
                                      {2, 2, 3},  {2, 2, -2}};
    const auto& bad = kBad[in.ConsumeIntegralInRange(0, 5)];
    k.sh = {bad[0], bad[1], bad[2]};
  }
  const int B = std::max(0, k.sh.batch), S = std::max(1, k.sh.seq);
  const int nb = B + (in.ConsumeProbability<float>() > 0.95f ? 1 : 0);
  for (int b = 0; b < nb; ++b) k.start.push_back(step_int(in, 0, k.cfg.max_seq_len - S + 1));
  // Positions the tables must cover (for the "wide enough" widths).
  index_t p_max = 0;
  for (auto s : k.start) p_max = std::max<index_t>(p_max, std::min<index_t>(s, k.cfg.max_seq_len));
  p_max += S;
  auto pool = [&](index_t lo, index_t hi) {
    return in.ConsumeProbability<float>() > 0.97f
               ? in.ConsumeIntegralInRange<index_t>(-1, index_t(1) << 40)
               : in.ConsumeIntegralInRange<index_t>(lo, hi);
  };
  k.pools.ori = pool(1, 600);
  k.pools.cmp = pool(1, 80);
  k.pools.idx = pool(1, 80);
  k.pools.hca_state = pool(1, 80);
  k.pools.csa_state = pool(1, 80);
  k.pools.csa_inner_state = pool(1, 80);
  k.pools.hca_cmp = pool(1, 80);
  k.pools.csa_cmp = pool(1, 80);
  const index_t P[kNumFields] = {k.pools.ori,       k.pools.cmp,       k.pools.idx,
                                 k.pools.hca_state, k.pools.csa_state, k.pools.csa_inner_state,
                                 k.pools.hca_cmp,   k.pools.csa_cmp};
  // Tokens per column of each table (for the covering width).
  const bool prefix = k.layout == Layout::prefix_caching;
  const index_t pg = std::max(1, k.cfg.page);
  const index_t per_col[kNumFields] = {pg,
                                       prefix ? pg : pg * 4,
                                       prefix ? pg : pg * 4,
                                       std::max(1, k.cfg.c128_state_page),
                                       std::max(1, k.cfg.c4_state_page),
                                       std::max(1, k.cfg.c4_state_page),
                                       pg,
                                       pg};
  k.bc_rows = B + (in.ConsumeProbability<float>() > 0.95f ? -1 : 0);
  k.bc_rows = std::max<index_t>(0, k.bc_rows);
  k.bc_cols = prefix ? 7 : 6;
  if (in.ConsumeProbability<float>() > 0.95f) k.bc_cols = in.ConsumeIntegralInRange(0, 8);
  k.counts.assign(std::size_t(k.bc_rows * k.bc_cols), 0);
  tdfuzz::Mix mix{in.ConsumeIntegral<std::uint64_t>()};
  for (int f = 0; f < kNumFields; ++f) {
    const index_t need = p_max / per_col[f] + 1;
    switch (in.ConsumeIntegralInRange(0, 39)) {  // mostly covering; 37..39 empty / narrow
      case 37:
        k.cols[f] = 0;  // empty: not served (ring) / an error (base)
        break;
      case 38:
        k.cols[f] = in.ConsumeIntegralInRange<index_t>(1, 40);
        break;
      case 39:
        k.cols[f] = std::max<index_t>(1, need + in.ConsumeIntegralInRange(-2, 1));
        break;
      default:
        k.cols[f] = need + in.ConsumeIntegralInRange(0, 3);
        break;
    }
    k.rows[f] = B + (in.ConsumeProbability<float>() > 0.96f ? (in.ConsumeBool() ? 1 : -1) : 0);
    k.rows[f] = std::max<index_t>(0, k.rows[f]);
    const index_t W = k.cols[f], pf = std::max<index_t>(1, std::min<index_t>(P[f], INT32_MAX));
    k.table[f].resize(std::size_t(k.rows[f] * W));  // every row is filled below
    // Which block_counts column holds this table's count (the count fuzzed per row below).
    int col = -1;
    if (k.layout == Layout::device_ring) {
      static constexpr int kCol862[kNumFields] = {0, 1, 2, 3, 4, 5, -1, -1};
      col = kCol862[f];
    } else if (prefix) {
      static constexpr int kCol955[kNumFields] = {0, -1, 3, 4, 5, 6, 1, 2};
      col = kCol955[f];
    }
    const int mode = in.ConsumeIntegralInRange(0, 19);  // 19: random, 18: perturbed, else periodic
    for (index_t b = 0; b < k.rows[f]; ++b) {
      index_t n = W <= 0 ? 1 : index_t(mix.next() % std::uint64_t(W)) + 1;
      if (mix.next() % 4 == 0) n = std::min<index_t>(std::max<index_t>(1, W), 1 + mix.next() % 8);
      if (mix.next() % 3 == 0 && W > 0) n = W;
      if (col >= 0 && b < k.bc_rows && col < k.bc_cols) {
        std::int32_t cnt = std::int32_t(n);
        if (in.ConsumeProbability<float>() > 0.97f) cnt = edge_int(in, 1, W + 1);
        k.counts[b * k.bc_cols + col] = cnt;
      }
      fill_table_row(k.table[f].data() + b * W, W, mode == 19 ? W : n, pf, mix);
      if (mode == 18 && W > 0) {  // one bad entry: aperiodic, < -1 or past the pool
        // Half the time at the last columns this request touches (state tables are read only
        // there), else anywhere.
        const index_t p =
            b < index_t(k.start.size()) ? std::max<index_t>(0, k.start[b]) + S - 1 : 0;
        index_t c = index_t(mix.next() % std::uint64_t(W));
        if (mix.next() % 2)
          c = std::clamp<index_t>(p / per_col[f] - index_t(mix.next() % 3), 0, W - 1);
        k.table[f][b * W + c] = edge_int(in, 0, std::min<index_t>(P[f], INT32_MAX));
      }
    }
  }
  return k;
}

void fuzz_step_metadata(FuzzedDataProvider& in) {
  const StepCase k = make_step_case(in);
  if (g_verbose) {
    std::fprintf(stderr, "step: layout=%d page=%d SB=%d/%d max_seq=%d window=%d B=%d S=%d c=%d\n",
                 int(k.layout), k.cfg.page, k.cfg.c4_state_page, k.cfg.c128_state_page,
                 k.cfg.max_seq_len, k.cfg.window, k.sh.batch, k.sh.seq, k.sh.commit_tokens);
    for (int f = 0; f < kNumFields; ++f)
      std::fprintf(stderr, "  table %d: %lldx%lld\n", f, static_cast<long long>(k.rows[f]),
                   static_cast<long long>(k.cols[f]));
  }
  // A valid previous step (base layout, one request at 0) that a failed build must not touch.
  td::ModelConfig base_cfg = td::flash_config();
  base_cfg.window = k.cfg.window;
  tp::StepMetadata md(kMaxBatch, kMaxSeq, base_cfg);
  std::vector<std::int32_t> one_row(64, 0);
  const td::ConstView<std::int32_t, 2> t1(one_row.data(), {1, 64});
  tp::StepTables prev{t1, t1, t1, t1, t1, t1};
  md.build(std::vector<std::int32_t>{5}, {1, 2}, prev, tp::PoolSizes{}, base_cfg);
  const Snapshot before = snapshot(md);

  bool threw = false;
  try {
    md.build(k.start, k.sh, k.tables(), k.pools, k.cfg);
  } catch (const td::Error& e) {
    threw = true;
    note(e);
  }
  const bool valid = step_valid(k);
  TDFUZZ_CHECK(threw == !valid, threw, int(k.layout));
  if (threw) {
    TDFUZZ_CHECK(snapshot(md) == before);
    return;
  }
  // Equal to golden, and no slot outside its pool.
  TDFUZZ_CHECK(snapshot(md) == golden_snapshot(k), int(k.layout));
  for (int g = 0; g < td::rules::kNumTables; ++g) {
    const auto m = md.slot_mapping(tp::Table(g));
    const index_t rows = md.pool_rows(tp::Table(g));
    for (index_t t = 0; t < m.extent(0); ++t)
      TDFUZZ_CHECK(m(t) == -1 || (m(t) >= 0 && m(t) < rows), g, m(t));
  }
  const auto w = md.window_indices();
  for (index_t t = 0; t < w.extent(0); ++t)
    for (index_t j = 0; j < w.extent(1); ++j)
      TDFUZZ_CHECK(w(t, j) == -1 || (w(t, j) >= 0 && w(t, j) < md.pool_rows(tp::Table::ori)), t, j);
}

// TDFUZZ_DUMP=1 prints each decoded case (for reproducing a failure by hand).
void dump(const Case& k) {
  std::fprintf(stderr,
               "cfg page=%d window=%d max_seq_len=%d; B=%d S=%d commit=%d; num_blocks=%lld"
               " ratio=%d state_page=%d len_delta=%d\nstart:",
               k.cfg.page, k.cfg.window, k.cfg.max_seq_len, k.sh.batch, k.sh.seq,
               k.sh.commit_tokens, static_cast<long long>(k.num_blocks), k.ratio, k.state_page,
               k.len_delta);
  for (auto s : k.start) std::fprintf(stderr, " %d", s);
  std::fprintf(stderr, "\npos:");
  for (auto p : k.pos) std::fprintf(stderr, " %d", p);
  std::fprintf(stderr, "\ntable %lldx%lld:", static_cast<long long>(k.rows),
               static_cast<long long>(k.cols));
  for (auto e : k.table) std::fprintf(stderr, " %d", e);
  std::fprintf(stderr, "\n");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const Case k = make_case(in);
  g_verbose = std::getenv("TDFUZZ_DUMP") != nullptr;
  if (g_verbose) dump(k);
  fuzz_positions(k);
  fuzz_fixture_table(k);
  for (int kind = 0; kind < 3; ++kind) fuzz_slot_mapping(k, kind);
  fuzz_window(k);
  // The step case decodes the same bytes reversed: the builder cases above read from the back of
  // the input (committed corpus inputs keep their meaning) and rarely reach its front, which
  // thus drives the step case's first decisions.
  std::vector<std::uint8_t> reversed(data, data + size);
  std::reverse(reversed.begin(), reversed.end());
  FuzzedDataProvider step_in(reversed.data(), reversed.size());
  fuzz_step_metadata(step_in);
  return 0;
}
