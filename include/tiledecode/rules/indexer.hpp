#pragma once
// The spec's lightning-indexer rules (spec §7), written once for every backend. Golden keeps its
// own copy (golden/indexer.hpp).

#include <algorithm>
#include <cstdint>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/rules/paging.hpp"

namespace tiledecode::rules {

// Visible compressed rows of a token (spec §7.2): vis_t = min(kv_len // 4, (pos + 1) // 4,
// score_len). Score columns j >= vis_t are NEG_BIG and never selected by top-k.
inline int indexer_visible_rows(const ModelConfig& cfg, int pos, int kv_len) {
  return std::min({kv_len / 4, (pos + 1) / 4, cfg.score_len()});
}

// Pool row of index key j of request b (spec §7.2): idx_block_table[b, j / page] * page + j % page
// (-1 if unmapped; the kernels reject an unmapped page inside a visible range).
inline std::int64_t indexer_key_row(ConstView<std::int32_t, 2> idx_block_table, index_t b,
                                    index_t j, index_t page) {
  return slot_of(idx_block_table, b, j, page);
}

// RoPE position of the indexer query of token t (spec §5 [QUIRK] §11.1): the reference CSA
// composition rotates both S tokens of request b at start_b = positions[b * S]; the absolute
// rule rotates at pos_t.
inline std::int32_t indexer_query_rope_position(ConstView<std::int32_t, 1> positions, index_t t,
                                                int seq, bool request_start) {
  return request_start ? positions((t / seq) * seq) : positions(t);
}

}  // namespace tiledecode::rules
