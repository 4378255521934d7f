#!/usr/bin/env bash
# Installs what is missing, builds Release, runs the main example: decode steps of a
# DeepSeek-V4-flash attention stack (arguments pass through; --help lists them).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
configure_and_build "$BUILD_DIR" -DTILEDECODE_BUILD_TESTS=OFF -DTILEDECODE_BUILD_BENCH=OFF \
  -DTILEDECODE_BUILD_EXAMPLES=ON
exec "$BUILD_DIR/examples/decode_step" "$@"
