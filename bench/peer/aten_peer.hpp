#pragma once
// The ATen peer of `peer_compare`: the same math as TileDecode's kernels written the way an
// engine without TileDecode would run it on the CPU — idiomatic PyTorch C++ tensor ops
// (index_select gathers, matmul/bmm on the BLAS, softmax, topk), FP32 compute, no Python.
// Only aten_peer.cpp includes Torch; this interface is plain C++ so the other translation
// units of the benchmark compile without Torch headers.
//
// Each `make_*` wraps the case's memory (no copy) plus any per-kernel preprocessing that an
// engine would do once at load time (e.g. FP32 copies of weights), and returns a callable
// running one decode step of that kernel, and an accessor for its primary output as floats.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "peer/fixtures.hpp"
#include "peer/layer_case.hpp"

namespace tdpeer {

using PeerKernel = Runner;

// How the peer holds BF16/INT8 weights of the projections.
enum class WeightMode {
  fp32_copy,  // FP32 copies made at load time (memory ×2–×4, no per-step conversion)
  dequant,    // keep BF16/INT8 weights, convert to FP32 inside every step
};

// Threads for ATen's intra-op pool (OpenMP) and for OpenBLAS's own pthread pool.
void peer_set_threads(int aten_threads, int blas_threads);
// Wakes the peer's worker threads (returns once every ATen thread has entered one parallel
// region, after a 256^3 sgemm that OpenBLAS splits over its own threads), so that a call timed
// right after starts with awake threads, as inside a decode step; see peer_compare's sampling.
void peer_wake_threads(int aten_threads, int blas_threads);
// "OpenBLAS 0.3.21 ... core Haswell; sgemm_ resolved from /path" and the ATen parallel info.
std::string peer_blas_info();
std::string peer_version();
// openblas_get_corename(): the kernel set OpenBLAS picked at load time (DYNAMIC_ARCH; forced by
// OPENBLAS_CORETYPE), e.g. "Haswell", "SkylakeX", "Cooperlake"; "" when the BLAS is not OpenBLAS.
std::string peer_blas_corename();
// One FP32 product on the BLAS as the peer calls it: at::mm(a, bᵀ) with a [m, k], b [n, k]
// (batch 1: the projections, x @ Wᵀ), or at::bmm(a, bᵀ) of [batch, m, k] and [batch, n, k]
// (attention Q·Kᵀ, the indexer). The short probe that picks OpenBLAS's core (peer_compare
// --blas-probe) times it.
PeerKernel make_peer_sgemm(int64_t batch, int64_t m, int64_t n, int64_t k);

// Indexer score + top-k (spec §7.2–7.3): score [T, score_len], topk [T, idx_topk] (output:
// the score's visible region, masked tail excluded).
PeerKernel make_peer_indexer(const Weights& w, Case& cs);
// Sparse attention core of one family (0 SWA, 4 CSA, 128 HCA) with inverse RoPE into
// o_packed [O_GROUPS*T, O_GROUP_IN] BF16 (spec §8.1–8.4).
PeerKernel make_peer_attention(const Weights& w, Case& cs, int ratio);
// Grouped W8A8 output projection (spec §8.5): attn_out [T, D] BF16.
PeerKernel make_peer_oproj(const Weights& w, Case& cs, WeightMode mode);
// Compressor step (spec §6): which = 4 (CSA main), 128 (HCA), 0 (indexer inner). Writes state
// rows and, on boundaries, the compressed (or index) cache rows; output: the emitted rows.
PeerKernel make_peer_compressor(const Weights& w, Case& cs, int which, WeightMode mode);
// One whole CSA layer step (spec §4, §9.2) from x_hc to x_out [T, 4, D] FP32 on the layer
// case's pools and metadata (output: x_out).
PeerKernel make_peer_layer(const LayerModel& m, LayerCase& lc, WeightMode mode);

}  // namespace tdpeer
