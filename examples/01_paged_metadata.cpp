// Example 01: the paged-KV metadata of one decode step (spec §3), the cache write and the
// sliding-window gather.
//
// One step of B = 4 requests, S = 2 tokens each (MTP: previous + draft token) at start positions
// 8192 / 0 / 2 / 3 over the spec fixture block tables (§3.2, §3.9):
//   1. build every metadata tensor of spec §3.7 once (StepMetadata),
//   2. write the step's new KV rows (synthetic BF16 [8, 512]) into the paged ori cache,
//   3. gather each token's 128-row sliding window back into a contiguous tile,
// and print what happened. Run by ./scripts/demo.sh until the decode-step example exists.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/paged/step_metadata.hpp"

namespace td = tiledecode;
namespace pg = tiledecode::paged;
using td::index_t;

namespace {

// FNV-1a over the bytes of a row: a checksum that changes if any bit of the row changes.
std::uint64_t fnv1a(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// "15873..15999, 0" — the physical rows of a window list as contiguous runs.
std::string runs(td::ConstView<std::int32_t, 2> idx, index_t t, index_t len) {
  std::string out;
  index_t k = 0;
  while (k < len) {
    index_t e = k;
    while (e + 1 < len && idx(t, e + 1) == idx(t, e) + 1 && idx(t, e) >= 0) ++e;
    if (!out.empty()) out += ", ";
    out += idx(t, k) < 0 ? std::string("unmapped")
                         : (e > k ? std::to_string(idx(t, k)) + ".." + std::to_string(idx(t, e))
                                  : std::to_string(idx(t, k)));
    k = e + 1;
  }
  return out;
}

std::string slot_text(std::int64_t s) {
  return s < 0 ? "-" : std::to_string(s);
}

}  // namespace

int main() {
  const td::ModelConfig cfg = td::flash_config();
  const std::vector<std::int32_t> starts = {8192, 0, 2, 3};
  const pg::StepShape shape{4, 2};  // commit_tokens -1: both tokens committed (kernel tests)
  const index_t T = shape.tokens(), W = cfg.head_dim;

  // 1. Metadata, built once for the step and shared by every layer.
  pg::FixtureTables fx(shape.batch);  // spec fixture tables and pools (ori 128 blocks, ...)
  pg::StepMetadata md(starts, shape, fx.tables(), fx.pools, cfg);

  std::printf("TileDecode example 01: paged-KV metadata, cache write and window gather\n");
  std::printf("step: B=%d requests x S=%d tokens = T=%lld rows, page %d, window %d\n", shape.batch,
              shape.seq, static_cast<long long>(T), cfg.page, cfg.window);
  std::printf(
      "pools (blocks): ori %lld, cmp %lld, idx %lld, hca_state %lld, csa_state %lld, "
      "csa_inner_state %lld\n\n",
      static_cast<long long>(fx.pools.ori), static_cast<long long>(fx.pools.cmp),
      static_cast<long long>(fx.pools.idx), static_cast<long long>(fx.pools.hca_state),
      static_cast<long long>(fx.pools.csa_state), static_cast<long long>(fx.pools.csa_inner_state));

  std::printf("request  start  kv_seq_len\n");
  for (int b = 0; b < shape.batch; ++b)
    std::printf("%7d  %5d  %10d\n", b, starts[b], md.kv_seq_lens()(b));

  std::printf(
      "\n t  b  s    pos  ori_slot  csa_cmp  csa_idx  hca_cmp  hca_state  csa_state  "
      "csa_inner\n");
  for (index_t t = 0; t < T; ++t) {
    std::printf("%2lld %2lld %2lld %6d %9s %8s %8s %8s %10s %10s %10s\n", static_cast<long long>(t),
                static_cast<long long>(t / shape.seq), static_cast<long long>(t % shape.seq),
                md.position_ids()(t), slot_text(md.ori_slot_mapping()(t)).c_str(),
                slot_text(md.csa_cmp_slot_mapping()(t)).c_str(),
                slot_text(md.csa_idx_slot_mapping()(t)).c_str(),
                slot_text(md.hca_cmp_slot_mapping()(t)).c_str(),
                slot_text(md.hca_state_slot_mapping()(t)).c_str(),
                slot_text(md.csa_state_slot_mapping()(t)).c_str(),
                slot_text(md.csa_inner_state_slot_mapping()(t)).c_str());
  }

  std::printf("\ncompressed boundaries ((pos+1) %% R == 0):\n");
  int n_boundaries = 0;
  for (index_t t = 0; t < T; ++t) {
    const int pos = md.position_ids()(t);
    for (int R : {4, 128}) {
      const std::int64_t slot =
          R == 4 ? md.csa_cmp_slot_mapping()(t) : md.hca_cmp_slot_mapping()(t);
      if ((pos + 1) % R != 0) continue;
      ++n_boundaries;
      std::printf("  token %lld (request %lld, pos %d) closes ratio-%d row %d -> cmp slot %s\n",
                  static_cast<long long>(t), static_cast<long long>(t / shape.seq), pos, R, pos / R,
                  slot_text(slot).c_str());
    }
  }
  if (n_boundaries == 0) std::printf("  none\n");

  std::printf("\nsliding windows (positions -> physical ori rows, oldest -> newest):\n");
  for (index_t t = 0; t < T; ++t) {
    const int pos = md.position_ids()(t), len = md.window_lens()(t);
    std::printf("  token %lld: positions %d..%d, len %3d, rows %s\n", static_cast<long long>(t),
                pos - len + 1, pos, len, runs(md.window_indices(), t, len).c_str());
  }

  // 2. Write the new KV rows [T, 512] (synthetic BF16) into the ori cache [blocks*128, 512].
  td::Tensor<td::bf16, 2> kv({T, W});
  for (index_t t = 0; t < T; ++t)
    for (index_t j = 0; j < W; ++j)
      kv.view()(t, j) = td::bf16(std::sin(0.01f * float(j + 1) * float(t + 1)) + 0.001f * float(t));
  td::Tensor<td::bf16, 2> ori_cache({fx.pools.ori * cfg.page, W});
  pg::write_cache(ori_cache.view(), kv.view(), md.ori_slot_mapping());
  std::printf("\nwrote %lld BF16 rows of %lld into the ori cache (%lld rows, %.1f MiB)\n",
              static_cast<long long>(T), static_cast<long long>(W),
              static_cast<long long>(ori_cache.extent(0)),
              double(ori_cache.size() * sizeof(td::bf16)) / (1 << 20));

  // 3. Gather the windows [T, 128, 512] + validity mask [T, 128].
  td::Tensor<td::bf16, 3> win({T, cfg.window, W});
  td::Tensor<std::uint8_t, 2> valid({T, cfg.window});
  pg::gather_windows(win.view(), valid.view(), ori_cache.view(), md.window_indices());

  std::printf(
      "gathered windows: token -> valid rows, checksum(current row gathered) vs "
      "checksum(row written)\n");
  bool all_equal = true;
  for (index_t t = 0; t < T; ++t) {
    int n_valid = 0;
    for (index_t k = 0; k < cfg.window; ++k) n_valid += valid.view()(t, k);
    const index_t last = md.window_lens()(t) - 1;  // the token itself is the newest row
    const std::uint64_t got = fnv1a(&win.view()(t, last, 0), std::size_t(W) * sizeof(td::bf16));
    const std::uint64_t want = fnv1a(&kv.view()(t, 0), std::size_t(W) * sizeof(td::bf16));
    all_equal = all_equal && got == want;
    std::printf("  token %lld: %3d valid, %016llx vs %016llx %s\n", static_cast<long long>(t),
                n_valid, static_cast<unsigned long long>(got),
                static_cast<unsigned long long>(want), got == want ? "equal" : "DIFFERENT");
  }
  std::printf("\n%s\n", all_equal ? "OK: every token's gathered current row equals the row written"
                                  : "ERROR: a gathered row differs from the row written");
  return all_equal ? 0 : 1;
}
