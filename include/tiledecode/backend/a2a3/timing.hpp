#pragma once
// Timing-only tile programs of the a2a3 model: generic weight-streaming GEMMs, vector passes and
// the compressor launches, issued on the model's cores with the machine in timing-only mode (no
// data computed, GM views shape-only). Used for the kernels that have no functional a2a3
// schedule yet (layer.hpp) and for the indexer's inner compressor (indexer.hpp).

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"

namespace tiledecode::a2a3 {

namespace detail {

// Restores functional mode when a timing-only section ends.
struct TimingOnly {
  Machine& m;
  explicit TimingOnly(Machine& mm) : m(mm) { m.set_functional(false); }
  ~TimingOnly() { m.set_functional(true); }
  TimingOnly(const TimingOnly&) = delete;
  TimingOnly& operator=(const TimingOnly&) = delete;
};

// Cube GEMM (M x K activations, N x K weights streamed once from GM). Work items are (N chunk of
// 128, K slice): N chunks are dealt round-robin to the cube cores and, when there are fewer
// chunks than cores, K is split so that every core streams a slice (split-K; the partial
// outputs are written to GM and summed by the consumer's vector pass). Weights are staged in L1
// in double-buffered 128 KiB tiles (128 rows x 512 BF16 / 1024 INT8) and fed to L0 in 32 KiB
// tiles (128 x 128 BF16 / 128 x 256 INT8); M is padded to 16 rows.
template <class In>
void gemm_timing(Machine& m, std::string_view name, index_t M, index_t N, index_t K, int blocks) {
  constexpr index_t kTile = std::is_same_v<In, std::int8_t> ? 256 : 128;  // L0 depth
  constexpr index_t kL1 = 4 * kTile;                                      // L1 tile depth
  const index_t chunks = (N + 127) / 128;
  const index_t ksplit =
      std::max<index_t>(1, std::min<index_t>(blocks / chunks, (K + kL1 - 1) / kL1));
  const index_t kslice = (K + ksplit - 1) / ksplit;
  const index_t items = chunks * ksplit;
  const int grid = int(std::min<index_t>(blocks, items));
  m.launch_cube(name, grid, [&](CubeBlock& blk) {
    CubeCore& c = blk.cube;
    const index_t k_a = std::min<index_t>(kslice, 64 * 1024 / index_t(sizeof(In)) / 16);
    auto a1 = c.alloc<In>(Space::l1, "act", 16, k_a);
    std::array<Tile<In>, 2> w1{c.alloc<In>(Space::l1, "w[0]", 128, kL1),
                               c.alloc<In>(Space::l1, "w[1]", 128, kL1)};
    std::array<Tile<In>, 2> a0{c.alloc<In>(Space::l0a, "a[0]", 16, kTile),
                               c.alloc<In>(Space::l0a, "a[1]", 16, kTile)};
    std::array<Tile<In>, 2> b0{c.alloc<In>(Space::l0b, "b[0]", 128, kTile),
                               c.alloc<In>(Space::l0b, "b[1]", 128, kTile)};
    std::array<Tile<acc_t<In>>, 2> acc{c.alloc<acc_t<In>>(Space::l0c, "acc[0]", 16, 128),
                                       c.alloc<acc_t<In>>(Space::l0c, "acc[1]", 16, 128)};
    int step = 0, l1step = 0, j = 0;
    for (index_t it = blk.index; it < items; it += grid, ++j) {
      const index_t ch = it % chunks, ks = it / chunks;
      const index_t n_rows = std::min<index_t>(128, N - ch * 128);
      const index_t k_begin = ks * kslice, k_end = std::min(K, k_begin + kslice);
      auto& cc = acc[std::size_t(j % 2)];
      for (index_t k1 = k_begin; k1 < k_end; k1 += kL1, ++l1step) {
        auto& w = w1[std::size_t(l1step % 2)];
        const index_t d1 = std::min(kL1, k_end - k1);
        c.copy_in(w, 0, ConstView<In, 2>(nullptr, {n_rows, d1}), "w_in");
        for (index_t k0 = k1; k0 < k1 + d1; k0 += kTile, ++step) {
          const std::size_t s = std::size_t(step % 2);
          const index_t d0 = std::min(kTile, k1 + d1 - k0);
          if ((k0 - k_begin) % k_a == 0)
            c.copy_in(a1, 0, ConstView<In, 2>(nullptr, {M, std::min(k_a, k_end - k0)}), "act_in");
          c.load_l0(a0[s], a1, 0, 16, 0, d0, false, "a_l0");
          c.load_l0(b0[s], w, 0, 128, 0, d0, false, "b_l0");
          c.mmad(cc, a0[s], b0[s], M, n_rows, d0, k0 > k_begin, "mmad");
        }
      }
      c.copy_out(View<acc_t<In>, 2>(nullptr, {M, n_rows}), cc, 0, "out");
    }
  });
}

// Vector kernel: each of `blocks` blocks reads `in_bytes`, runs `passes` passes over `elems`
// FP32 elements (`exp_passes` of them at the transcendental rate), writes `out_bytes`. Data
// moves in <= 64 KiB DMA pieces; `descriptors` extra DMAs of `row_bytes` model row gathers;
// `small_ops` short vector ops on a handful of elements (issue-bound).
inline void vector_timing(Machine& m, std::string_view name, int blocks, std::int64_t in_bytes,
                          std::int64_t out_bytes, std::int64_t elems, int passes,
                          int exp_passes = 0, int descriptors = 0, index_t row_bytes = 1024,
                          int small_ops = 0) {
  m.launch_vector(name, blocks, [&](VectorBlock& blk) {
    VectorCore& v = blk.vec;
    constexpr index_t kPiece = 16 * 1024;  // floats = 64 KiB
    auto buf = v.alloc<float>(Space::ub, "in", 1, kPiece);
    auto work = v.alloc<float>(Space::ub, "work", 1, kPiece);
    auto out = v.alloc<float>(Space::ub, "out", 1, kPiece);
    for (std::int64_t off = 0; off < in_bytes; off += kPiece * 4)
      v.copy_in(
          buf, 0,
          ConstView<float, 2>(nullptr, {1, std::min<index_t>(kPiece, (in_bytes - off + 3) / 4)}),
          "in");
    for (int d = 0; d < descriptors; ++d)
      v.copy_in(buf, 0, ConstView<float, 2>(nullptr, {1, std::min<index_t>(kPiece, row_bytes / 4)}),
                "row_in");
    for (int p = 0; p < passes; ++p)
      v.vec(
          "pass", index_t(elems), 4, {&buf.state(), &work.state()}, {&work.state()}, [] {},
          p < exp_passes ? m.arch().vector_exp_cost_factor : 1.0);
    for (int i = 0; i < small_ops; ++i)  // short ops on a few elements (issue-bound)
      v.vec("small", 16, 4, {&work.state()}, {&work.state()}, [] {});
    v.vec("to_out", 1, 4, {&work.state()}, {&out.state()}, [] {});
    for (std::int64_t off = 0; off < out_bytes; off += kPiece * 4)
      v.copy_out(View<float, 2>(nullptr, {1, std::min<index_t>(kPiece, (out_bytes - off + 3) / 4)}),
                 out, 0, "out");
  });
}

// Gated-pooling compressor (§6): projections (cube, wkv and wgate together), then per request
// the state write and the pooling of the window (8 candidate rows for ratio 4, 128 for ratio
// 128; softmax over candidates per channel), RMSNorm, RoPE and the compressed-row write; the
// inner compressor adds the Hadamard rotation (cube) and Q8 (vector).
inline void compressor_launches(Machine& m, const ModelConfig& cfg, std::string_view prefix,
                                index_t T, index_t B, int ratio, index_t head_dim, bool inner) {
  const index_t out_dim = ratio == 4 ? 2 * head_dim : head_dim;
  const index_t cand = ratio == 4 ? 8 : 128;
  const std::string p(prefix);
  gemm_timing<bf16>(m, p + ".proj_mm", T, 2 * out_dim, cfg.hidden, m.arch().cube_cores);
  // Per request: its S state rows out, the window's candidate state rows in (one DMA each
  // through the state table), pooling (exp over candidates), RMSNorm, RoPE, row out.
  vector_timing(m, p + ".pool", int(B), T / B * 2 * out_dim * 4,
                T / B * 2 * out_dim * 4 + head_dim * 2, cand * head_dim, 6, 1, int(cand),
                2 * out_dim * 4);
  if (inner) {
    gemm_timing<bf16>(m, p + ".hadamard_mm", B, head_dim, head_dim, 1);
    vector_timing(m, p + ".quant", int(B), head_dim * 4, head_dim + 4, head_dim, 3);
  }
}

}  // namespace detail

}  // namespace tiledecode::a2a3
