#pragma once
// Umbrella header: everything an engine needs.

#include "tiledecode/backend/cpu/context.hpp"
#include "tiledecode/backend/cpu/isa.hpp"
#include "tiledecode/core/bf16.hpp"
#include "tiledecode/core/config.hpp"
#include "tiledecode/core/error.hpp"
#include "tiledecode/core/parallel.hpp"
#include "tiledecode/core/quant.hpp"
#include "tiledecode/core/view.hpp"
