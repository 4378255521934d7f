#pragma once
// Umbrella header: everything an engine needs to run DeepSeek-V4 attention decode steps on the
// CPU backend. The golden references (tiledecode/golden/*.hpp) and the a2a3 execution model
// (tiledecode/backend/a2a3/*.hpp) are included separately by the code that wants them.

#include "tiledecode/backend/cpu/compressor.hpp"
#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/hyper_connection.hpp"
#include "tiledecode/backend/cpu/indexer.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/backend/cpu/output_projection.hpp"
#include "tiledecode/backend/cpu/qkv_projection.hpp"
#include "tiledecode/backend/cpu/rmsnorm.hpp"
#include "tiledecode/backend/cpu/sparse_attention.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/hadamard.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
#include "tiledecode/decode/step.hpp"
#include "tiledecode/kernels/topk.hpp"
#include "tiledecode/paged/cache.hpp"
#include "tiledecode/paged/metadata.hpp"
#include "tiledecode/paged/step_metadata.hpp"
#include "tiledecode/rope/rope.hpp"
