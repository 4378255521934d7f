#pragma once
// Paged metadata of one standalone sparse-attention step (spec §10.3) shared by the sparse
// attention tests and benchmark: position ids, kv lengths, the fixture ori/compressed block
// tables and the SWA window lists for B requests of S tokens each, starting at `starts`.
// It draws no random numbers, so a fixture that fills pools or q from its own Rng before or after
// building it sees the same sequence either way.
#include <cstdint>
#include <vector>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/paged/metadata.hpp"

namespace tdtest {

struct SparseAttnMetadata {
  int B, S;
  tiledecode::index_t T;
  tiledecode::Tensor<std::int32_t, 1> pos, lens, win_lens;
  tiledecode::Tensor<std::int32_t, 2> ori_table, cmp_table, win_idx;

  // `ori_blocks` / `cmp_blocks`: pages in the original / compressed pools the fixture tables
  // spread over. The compressed table has 32 columns (4096 CSA rows at 16384 tokens / 128).
  SparseAttnMetadata(const tiledecode::ModelConfig& cfg, const std::vector<std::int32_t>& starts,
                     int seq, tiledecode::index_t ori_blocks, tiledecode::index_t cmp_blocks)
      : B(int(starts.size())), S(seq), T(tiledecode::index_t(starts.size()) * seq) {
    namespace paged = tiledecode::paged;
    const paged::StepShape sh{B, S, -1};
    pos = tiledecode::Tensor<std::int32_t, 1>({T});
    lens = tiledecode::Tensor<std::int32_t, 1>({B});
    win_lens = tiledecode::Tensor<std::int32_t, 1>({T});
    paged::build_position_ids(pos.view(), starts, sh, cfg);
    paged::build_kv_seq_lens(lens.view(), starts, sh, cfg);
    ori_table = tiledecode::Tensor<std::int32_t, 2>({B, cfg.ori_table_cols()});
    cmp_table = tiledecode::Tensor<std::int32_t, 2>({B, 32});
    paged::build_fixture_block_table(ori_table.view(), ori_blocks);
    paged::build_fixture_block_table(cmp_table.view(), cmp_blocks);
    win_idx = tiledecode::Tensor<std::int32_t, 2>({T, cfg.window});
    paged::build_window_indices(win_idx.view(), win_lens.view(), pos.view(), ori_table.view(),
                                ori_blocks, sh, cfg);
  }
};

}  // namespace tdtest
