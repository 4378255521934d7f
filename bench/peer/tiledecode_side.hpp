#pragma once
// TileDecode's side of `peer_compare`: its kernels and its golden references bound to a case.
// Compiled without Torch. Where a fast kernel is not available yet the TileDecode runner falls
// back to the golden reference and says so in `impl`.

#include <string>

#include "peer/fixtures.hpp"
#include "peer/layer_case.hpp"
#include "tiledecode/backend/cpu/context.hpp"

namespace tdpeer {

struct TdRunner : Runner {
  std::string impl;  // "kernel" or "golden stand-in"
};

// `ctx` is read at every run (the driver switches its executor between thread counts);
// `max_threads` sizes per-thread workspaces.
TdRunner make_td_indexer(const Weights& w, Case& cs, const tiledecode::cpu::Context* ctx,
                         int max_threads);
TdRunner make_td_attention(const Weights& w, Case& cs, int ratio,
                           const tiledecode::cpu::Context* ctx, int max_threads);
TdRunner make_td_oproj(const Weights& w, Case& cs, const tiledecode::cpu::Context* ctx);
TdRunner make_td_compressor(const Weights& w, Case& cs, int which,
                            const tiledecode::cpu::Context* ctx);
// decode::csa_step on the layer case (output: x_out).
TdRunner make_td_layer(const LayerModel& m, LayerCase& lc, const tiledecode::cpu::Context* ctx,
                       int max_threads);

Runner make_golden_indexer(const Weights& w, Case& cs);
Runner make_golden_attention(const Weights& w, Case& cs, int ratio);
Runner make_golden_oproj(const Weights& w, Case& cs);
Runner make_golden_compressor(const Weights& w, Case& cs, int which);
Runner make_golden_layer(const LayerModel& m, LayerCase& lc);

}  // namespace tdpeer
