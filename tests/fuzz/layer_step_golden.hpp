#pragma once
// golden::decode_layer behind a function boundary (layer_step_golden.cpp, built uninstrumented).
#include <cstdint>
#include <span>

#include "tiledecode/core/config.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/layer.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"

namespace tdfuzz {

void golden_layer(tiledecode::View<float, 3> x_out, tiledecode::ConstView<float, 3> x_hc,
                  const tiledecode::decode::LayerWeights& w,
                  const tiledecode::decode::LayerCaches& c, std::span<const std::int32_t> starts,
                  const tiledecode::paged::StepShape& sh, const tiledecode::paged::StepTables& t,
                  const tiledecode::RopeTableView& rope, const tiledecode::ModelConfig& cfg);

}  // namespace tdfuzz
