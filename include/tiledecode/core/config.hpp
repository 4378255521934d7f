#pragma once
// Model presets (spec §1.1, §12) and deployment constants (spec §1.3) in one struct.
// Every kernel takes a `const ModelConfig&`; shapes in views are validated against it.

#include <cmath>
#include <cstdint>
#include <string_view>

#include "tiledecode/core/error.hpp"

namespace tiledecode {

// Most negative finite FP32: the "-inf" of masked scores (spec `FP32_NEG_INF`).
inline constexpr float kNegBig = -3.4028234663852886e38f;
// Additive softmax mask of invalid attention columns (spec `MASK_NEG`).
inline constexpr float kMaskNeg = -1e20f;

enum class LayerKind : std::uint8_t { swa = 0, csa = 4, hca = 128 };

constexpr int compress_ratio(LayerKind k) {
  return static_cast<int>(k);
}
constexpr std::string_view to_string(LayerKind k) {
  return k == LayerKind::swa ? "swa" : (k == LayerKind::csa ? "csa" : "hca");
}

struct ModelConfig {
  std::string_view name;
  // --- model (spec §1.1)
  int hidden = 4096;       // D
  int n_heads = 64;        // H
  int head_dim = 512;      // one latent KV row = key = value
  int rope_dim = 64;       // last 64 dims of a head
  int q_lora = 1024;       // Q_LORA
  int o_lora = 1024;       // O_LORA
  int o_groups = 8;        // O_GROUPS
  int idx_n_heads = 64;    // indexer heads
  int idx_head_dim = 128;  // indexer head dim (rope = dims 64..127)
  int idx_topk = 512;      // IDX_TOPK
  int n_layers = 43;       // main layers (+1 MTP)
  int hc_mult = 4;         // hyper-connection streams
  float rms_eps = 1e-6f;
  float rope_theta = 10000.0f;            // SWA layers, no YaRN
  float compress_rope_theta = 160000.0f;  // CSA/HCA layers, YaRN
  float yarn_factor = 16.0f;
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  int yarn_orig_len = 65536;
  // --- deployment (spec §1.3)
  int max_seq_len = 16384;  // kernel budget
  int page = 128;           // BLOCK_SIZE: rows per page of ori, compressed and index caches
  int c4_state_page = 4;    // ratio-4 compressor-state page rows
  int c128_state_page = 8;  // ratio-128 compressor-state page rows
  int window = 128;         // WIN, inclusive of the current token
  int attn_k_tile = 128;    // sparse-attention column block

  constexpr int nope_dim() const { return head_dim - rope_dim; }
  constexpr int heads_per_group() const { return n_heads / o_groups; }
  constexpr int o_group_in() const { return heads_per_group() * head_dim; }
  constexpr int score_len() const { return max_seq_len / 4; }       // ratio-4 rows per request
  constexpr int hca_capacity() const { return max_seq_len / 128; }  // ratio-128 rows per request
  constexpr int ori_table_cols() const { return max_seq_len / page; }
  float softmax_scale() const { return 1.0f / std::sqrt(float(head_dim)); }
  float index_weights_scale() const {
    return 1.0f / std::sqrt(float(idx_head_dim) * float(idx_n_heads));
  }
  // Sparse-attention columns per token: window + compressed list (spec §8.1).
  constexpr int attn_cols(LayerKind k) const {
    switch (k) {
      case LayerKind::swa:
        return window;
      case LayerKind::csa:
        return window + idx_topk;
      case LayerKind::hca:
        return window + hca_capacity();
    }
    return window;
  }
  // Layer schedule (spec §1.1): kind of main layer `l`.
  constexpr LayerKind layer_kind(int l) const {
    if (name == "pro") return (l < 2 || l % 2 == 1) ? LayerKind::hca : LayerKind::csa;
    if (l < 2) return LayerKind::swa;
    return l % 2 == 0 ? LayerKind::csa : LayerKind::hca;
  }
};

// DeepSeek-V4-Flash (spec §1.1).
inline constexpr ModelConfig flash_config() {
  return ModelConfig{.name = "flash"};
}

// DeepSeek-V4-Pro shapes (spec §12); kernels use the same 16384 budget.
inline constexpr ModelConfig pro_config() {
  ModelConfig c{.name = "pro"};
  c.hidden = 7168;
  c.n_heads = 128;
  c.q_lora = 1536;
  c.o_groups = 16;
  c.idx_topk = 1024;
  c.n_layers = 61;
  return c;
}

inline ModelConfig config_by_name(std::string_view name) {
  if (name == "flash") return flash_config();
  if (name == "pro") return pro_config();
  throw Error("config_by_name: argument 'name' = " + std::string(name) +
              " is not a preset; allowed flash, pro");
}

}  // namespace tiledecode
