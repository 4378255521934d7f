#pragma once
// The narrow flash model of the layer tests and the layer-step fuzz target (no gtest here).

#include "tiledecode/core/config.hpp"

namespace tdtest {

// A narrow DeepSeek-V4-flash for long multi-step tests: every cache and paging constant of flash
// (head_dim 512, rope_dim 64, page 128, window 128, attention tile 128, max_seq_len 16384, state
// pages 4/8, idx_head_dim 128, idx_topk 512, so the same pools, tables, slot mappings, window
// lists, compressed-row counts and top-k sizes) with the dense widths cut to the smallest values
// every kernel accepts: hidden 512, 8 heads (sparse attention: a multiple of 8 and of o_groups),
// q_lora 256 (qkv_projection: a multiple of 256), o_lora 128 (output projection: a multiple of 32),
// 2 output groups (4 heads, 2048 inputs per group), 16 indexer heads (indexer: a multiple of 16).
inline tiledecode::ModelConfig narrow_config() {
  tiledecode::ModelConfig c = tiledecode::flash_config();
  c.name = "flash-narrow";
  c.hidden = 512;
  c.n_heads = 8;
  c.q_lora = 256;
  c.o_lora = 128;
  c.o_groups = 2;
  c.idx_n_heads = 16;
  return c;
}

}  // namespace tdtest
