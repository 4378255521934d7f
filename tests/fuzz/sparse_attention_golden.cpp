// The oracle of fuzz_sparse_attention (golden::sparse_attention), in its own translation unit
// compiled without the fuzzer's sanitizers and coverage (tests/fuzz/CMakeLists.txt): with them its
// double-precision loops took about a quarter of every execution.
#include "sparse_attention_golden.hpp"

#include "tiledecode/golden/sparse_attention.hpp"

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
                             const tiledecode::RopeTableView& rope) {
  tiledecode::golden::sparse_attention(cfg, kind, o_packed, q, kv_cache, cmp_kv, window_idx,
                                       window_lens, topk_idxs, cmp_block_table, positions,
                                       kv_seq_lens, seq, attn_sink, rope);
}

}  // namespace tdfuzz
