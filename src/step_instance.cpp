// The decode stack compiled once for this repository's own programs (tests, benchmarks,
// examples): the one translation unit that defines decode/step.hpp's entry points when the
// programs are built with TILEDECODE_SEPARATE_STEP (see the comment above the declarations in
// decode/step.hpp). The installed library stays header-only; an engine that wants the same
// compile-time saving adds a file like this one to its own build.
#define TILEDECODE_STEP_IMPLEMENTATION
#include "tiledecode/decode/step.hpp"
