// The oracle of fuzz_layer_step (golden::decode_layer), in its own translation unit compiled
// without the fuzzer's sanitizers and coverage (tests/fuzz/CMakeLists.txt): it is not the code
// under test, and instrumented it cost ~100x (about 0.3 s per token of the narrow model), which
// made the target run at < 1 input per second.
#include "layer_step_golden.hpp"

#include "tiledecode/golden/decode_layer.hpp"

namespace tdfuzz {

void golden_layer(tiledecode::View<float, 3> x_out, tiledecode::ConstView<float, 3> x_hc,
                  const tiledecode::decode::LayerWeights& w,
                  const tiledecode::decode::LayerCaches& c, std::span<const std::int32_t> starts,
                  const tiledecode::paged::StepShape& sh, const tiledecode::paged::StepTables& t,
                  const tiledecode::RopeTableView& rope, const tiledecode::ModelConfig& cfg) {
  tiledecode::golden::decode_layer(x_out, x_hc, w, c, starts, sh, t, rope, cfg);
}

}  // namespace tdfuzz
