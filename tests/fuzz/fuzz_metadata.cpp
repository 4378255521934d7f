// Fuzz target: paged decode metadata builders (paged/metadata.hpp) with arbitrary start
// positions, commit tokens, table widths and table contents, and small custom configs.
// Invariants: a builder either throws tiledecode::Error having written nothing, or writes
// exactly what an independent plain model of spec §3 predicts; it throws iff that model says
// the input is invalid; it never writes outside its output views (canaries).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz_common.hpp"
#include "tiledecode/paged/metadata.hpp"

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
  return 0;
}
