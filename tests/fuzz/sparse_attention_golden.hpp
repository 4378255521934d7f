#pragma once
// golden::sparse_attention behind a function boundary (sparse_attention_golden.cpp, built
// uninstrumented: the oracle is not the code under test).
#include <cstdint>

#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdfuzz {

void golden_sparse_attention(const tiledecode::ModelConfig& cfg, tiledecode::LayerKind kind,
                             tiledecode::View<tiledecode::bf16, 2> o_packed,
                             tiledecode::ConstView<tiledecode::bf16, 3> q,
                             tiledecode::ConstView<tiledecode::bf16, 2> kv_cache,
                             tiledecode::ConstView<tiledecode::bf16, 2> cmp_kv,
                             tiledecode::ConstView<std::int32_t, 2> window_idx,
                             tiledecode::ConstView<std::int32_t, 1> window_lens,
                             tiledecode::ConstView<std::int32_t, 2> topk_idxs,
                             tiledecode::ConstView<std::int32_t, 2> cmp_block_table,
                             tiledecode::ConstView<std::int32_t, 1> positions,
                             tiledecode::ConstView<std::int32_t, 1> kv_seq_lens, int seq,
                             tiledecode::ConstView<float, 1> attn_sink,
                             const tiledecode::RopeTableView& rope);

}  // namespace tdfuzz
