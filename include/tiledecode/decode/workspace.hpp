#pragma once
// The scratch memory of one decode-step layer, sized ONCE from the config, the largest batch
// and the backend (the CPU: one sparse-attention slot per thread; the a2a3 model: its kernels'
// GM scratch); a step only slices it (no allocation inside a step). Every
// intermediate tensor of spec §4/§7/§8 has its own buffer, so after a step they can be read back
// (the decode example dumps them) — the buffers hold the LAST layer's values.
//
//   decode::Workspace ws(cfg, /*max_batch=*/4, /*max_seq=*/2, be);
//   auto v = ws.views(B, S);   // views of the first B*S token rows
//
// Sizes (flash, T tokens): x_mixed/x_n 8 KB·T, q 64 KB·T, score/topk 16 KB·T each, o_packed
// 64 KB·T, plus the kernels' own workspaces (sparse attention ~350 KB per concurrent item slot,
// output projection ~130 KB·T + the compressors' FP32 copies of x_n).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "tiledecode/backend/a2a3/hyper_connection.hpp"
#include "tiledecode/backend/a2a3/output_projection.hpp"
#include "tiledecode/backend/a2a3/qkv_projection.hpp"
#include "tiledecode/backend/a2a3/sparse_attention.hpp"
#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/backend.hpp"

namespace tiledecode::decode {

// Views of the workspace for one step of T token rows (names are the spec's tensor names).
struct StepViews {
  index_t T = 0;
  // hc_pre / rmsnorm
  View<bf16, 2> x_mixed;       // (T, D)
  View<float, 2> post;         // (T, 4)
  View<float, 3> comb;         // (T, 4, 4) [i][o]
  std::span<std::byte> hc_ws;  // hc_pre's scratch (the mixes)
  View<bf16, 2> x_n;           // (T, D)
  // qkv_proj_rope
  View<bf16, 3> q;          // (T, H, 512)
  View<bf16, 2> kv;         // (T, 512)
  View<std::int8_t, 2> qr;  // (T, Q_LORA)
  View<float, 1> qr_scale;  // (T)
  QkvScratch qkv_scratch;
  // compressors (shared FP32 workspace; the main and inner compressors run one after another)
  View<float, 1> compressor_ws;
  View<float, 2> cmp_kv_out;  // (B, 512) FP32 emitted main row (diagnostic, zeroed per step)
  View<float, 2> idx_kv_out;  // (B, 128) FP32 emitted inner row before Hadamard (diagnostic)
  // indexer
  View<std::int8_t, 3> idx_q_i8;       // (T, 64, 128)
  View<float, 2> idx_q_scale;          // (T, 64)
  View<float, 2> idx_weights;          // (T, 64)
  View<std::int32_t, 1> idx_rope_pos;  // (T) rotation position of the indexer query
  View<float, 2> score;                // (T, 4096)
  View<std::int32_t, 2> topk_idxs;     // (T, 4096): first idx_topk meaningful, rest -1
  // sparse attention + output projection
  View<bf16, 2> o_packed;  // (O_GROUPS*T, O_GROUP_IN)
  std::span<std::byte> attn_ws;
  View<bf16, 2> attn_out;  // (T, D)
  std::span<std::byte> oproj_ws;
};

class Workspace {
 public:
  Workspace() = default;
  // Sized for up to max_batch × max_seq token rows on the CPU backend with `concurrency` parallel
  // sparse-attention items (pass Backend::concurrency()).
  Workspace(const ModelConfig& cfg, int max_batch, int max_seq = 2, std::size_t concurrency = 1)
      : Workspace(cfg, max_batch, max_seq, Backend::cpu(nullptr, cpu::Isa::scalar), concurrency) {}
  // Sized for up to max_batch × max_seq token rows on backend `be` (its kernels' scratch; on the
  // CPU one sparse-attention slot per thread of be's executor).
  Workspace(const ModelConfig& cfg, int max_batch, int max_seq, const Backend& be)
      : Workspace(cfg, max_batch, max_seq, be, be.concurrency()) {}

 private:
  Workspace(const ModelConfig& cfg, int max_batch, int max_seq, const Backend& be,
            std::size_t concurrency)
      : cfg_(cfg), max_batch_(max_batch), max_seq_(max_seq), kind_(be.kind) {
    check_range("decode::Workspace", "max_batch", max_batch, 1, 1 << 16);
    check_range("decode::Workspace", "max_seq", max_seq, 1, 1 << 10);
    const index_t T = index_t(max_batch) * max_seq, B = max_batch;
    const index_t D = cfg.hidden, H = cfg.n_heads, HD = cfg.head_dim, QL = cfg.q_lora;
    const auto n = [](index_t v) { return static_cast<std::size_t>(v); };
    x_mixed_ = Buffer<bf16>(n(T * D));
    post_ = Buffer<float>(n(T * 4));
    comb_ = Buffer<float>(n(T * 16));
    hc_ws_ = Buffer<std::byte>(kernels::hc_pre_workspace_bytes(be, cfg, T));
    x_n_ = Buffer<bf16>(n(T * D));
    q_ = Buffer<bf16>(n(T * H * HD));
    kv_ = Buffer<bf16>(n(T * HD));
    qr_ = Buffer<std::int8_t>(n(T * QL));
    qr_scale_ = Buffer<float>(n(T));
    qkv_x_ = Buffer<float>(n(T * D));
    qkv_cq_ = Buffer<float>(n(T * QL));
    qkv_kvf_ = Buffer<float>(n(T * HD));
    qkv_pairs_ = Buffer<std::int32_t>(n(T * (QL / 2)));
    qkv_extra_ = Buffer<std::byte>(kernels::qkv_projection_workspace_bytes(be, cfg, T));
    const index_t cws = std::max(
        {kernels::compressor_workspace_size(cfg, kernels::csa_compressor_spec(cfg), T),
         kernels::compressor_workspace_size(cfg, kernels::hca_compressor_spec(cfg), T),
         kernels::compressor_workspace_size(cfg, kernels::indexer_compressor_spec(cfg), T)});
    compressor_ws_ = Buffer<float>(n(cws));
    cmp_kv_out_ = Buffer<float>(n(B * HD));
    idx_kv_out_ = Buffer<float>(n(B * cfg.idx_head_dim));
    idx_q_i8_ = Buffer<std::int8_t>(n(T * cfg.idx_n_heads * cfg.idx_head_dim));
    idx_q_scale_ = Buffer<float>(n(T * cfg.idx_n_heads));
    idx_weights_ = Buffer<float>(n(T * cfg.idx_n_heads));
    idx_rope_pos_ = Buffer<std::int32_t>(n(T));
    score_ = Buffer<float>(n(T * cfg.score_len()));
    topk_ = Buffer<std::int32_t>(n(T * cfg.score_len()));
    o_packed_ = Buffer<bf16>(n(index_t(cfg.o_groups) * T * cfg.o_group_in()));
    std::size_t attn = 0;
    if (be.kind == BackendKind::cpu) {
      attn = kernels::sparse_attention_workspace_bytes(cfg, std::max<std::size_t>(1, concurrency));
    } else {
      for (LayerKind k : {LayerKind::swa, LayerKind::csa, LayerKind::hca})
        attn = std::max(attn, kernels::sparse_attention_workspace_bytes(be, cfg, k, T));
    }
    attn_ws_ = Buffer<std::byte>(attn);
    attn_out_ = Buffer<bf16>(n(T * D));
    oproj_ws_ = Buffer<std::byte>(kernels::output_projection_workspace_bytes(be, cfg, T));
  }

 public:
  int max_batch() const { return max_batch_; }
  BackendKind backend() const { return kind_; }
  int max_seq() const { return max_seq_; }
  index_t max_tokens() const { return index_t(max_batch_) * max_seq_; }

  // Views of the first T = batch × seq rows (validated against the sizes).
  StepViews views(int batch, int seq) {
    constexpr std::string_view where = "decode::Workspace::views";
    check_range(where, "batch", batch, 1, max_batch_ + 1);
    check_range(where, "seq", seq, 1, max_seq_ + 1);
    const ModelConfig& c = cfg_;
    const index_t T = index_t(batch) * seq, B = batch;
    const index_t D = c.hidden, H = c.n_heads, HD = c.head_dim, QL = c.q_lora;
    StepViews v;
    v.T = T;
    v.x_mixed = View<bf16, 2>(x_mixed_.data(), {T, D});
    v.post = View<float, 2>(post_.data(), {T, 4});
    v.comb = View<float, 3>(comb_.data(), {T, 4, 4});
    v.hc_ws = hc_ws_.span();
    v.x_n = View<bf16, 2>(x_n_.data(), {T, D});
    v.q = View<bf16, 3>(q_.data(), {T, H, HD});
    v.kv = View<bf16, 2>(kv_.data(), {T, HD});
    v.qr = View<std::int8_t, 2>(qr_.data(), {T, QL});
    v.qr_scale = View<float, 1>(qr_scale_.data(), {T});
    v.qkv_scratch = {View<float, 2>(qkv_x_.data(), {T, D}), View<float, 2>(qkv_cq_.data(), {T, QL}),
                     View<float, 2>(qkv_kvf_.data(), {T, HD}),
                     View<std::int32_t, 2>(qkv_pairs_.data(), {T, QL / 2}), qkv_extra_.span()};
    v.compressor_ws = View<float, 1>(compressor_ws_.data(), {index_t(compressor_ws_.size())});
    v.cmp_kv_out = View<float, 2>(cmp_kv_out_.data(), {B, HD});
    v.idx_kv_out = View<float, 2>(idx_kv_out_.data(), {B, c.idx_head_dim});
    v.idx_q_i8 = View<std::int8_t, 3>(idx_q_i8_.data(), {T, c.idx_n_heads, c.idx_head_dim});
    v.idx_q_scale = View<float, 2>(idx_q_scale_.data(), {T, c.idx_n_heads});
    v.idx_weights = View<float, 2>(idx_weights_.data(), {T, c.idx_n_heads});
    v.idx_rope_pos = View<std::int32_t, 1>(idx_rope_pos_.data(), {T});
    v.score = View<float, 2>(score_.data(), {T, c.score_len()});
    v.topk_idxs = View<std::int32_t, 2>(topk_.data(), {T, c.score_len()});
    v.o_packed = View<bf16, 2>(o_packed_.data(), {index_t(c.o_groups) * T, c.o_group_in()});
    v.attn_ws = attn_ws_.span();
    v.attn_out = View<bf16, 2>(attn_out_.data(), {T, D});
    v.oproj_ws = oproj_ws_.span();
    return v;
  }

  // Total bytes held.
  std::size_t bytes() const {
    return x_mixed_.size() * 2 + post_.size() * 4 + comb_.size() * 4 + hc_ws_.size() +
           qkv_extra_.size() + x_n_.size() * 2 + q_.size() * 2 + kv_.size() * 2 + qr_.size() +
           qr_scale_.size() * 4 + qkv_x_.size() * 4 + qkv_cq_.size() * 4 + qkv_kvf_.size() * 4 +
           qkv_pairs_.size() * 4 + compressor_ws_.size() * 4 + cmp_kv_out_.size() * 4 +
           idx_kv_out_.size() * 4 + idx_q_i8_.size() + idx_q_scale_.size() * 4 +
           idx_weights_.size() * 4 + idx_rope_pos_.size() * 4 + score_.size() * 4 +
           topk_.size() * 4 + o_packed_.size() * 2 + attn_ws_.size() + attn_out_.size() * 2 +
           oproj_ws_.size();
  }

 private:
  ModelConfig cfg_{};
  int max_batch_ = 0, max_seq_ = 0;
  BackendKind kind_ = BackendKind::cpu;
  Buffer<bf16> x_mixed_, x_n_, q_, kv_, o_packed_, attn_out_;
  Buffer<float> post_, comb_, qr_scale_, qkv_x_, qkv_cq_, qkv_kvf_, compressor_ws_, cmp_kv_out_,
      idx_kv_out_, idx_q_scale_, idx_weights_, score_;
  Buffer<std::int8_t> qr_, idx_q_i8_;
  Buffer<std::int32_t> qkv_pairs_, idx_rope_pos_, topk_;
  Buffer<std::byte> attn_ws_, oproj_ws_, hc_ws_, qkv_extra_;
};

}  // namespace tiledecode::decode
