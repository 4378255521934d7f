#!/usr/bin/env bash
# Installs what is missing, builds Release, runs the main example (arguments pass through).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
configure_and_build "$BUILD_DIR" -DTILEDECODE_BUILD_TESTS=OFF -DTILEDECODE_BUILD_BENCH=OFF \
  -DTILEDECODE_BUILD_EXAMPLES=ON
if [ -x "$BUILD_DIR/examples/decode_step" ]; then
  exec "$BUILD_DIR/examples/decode_step" "$@"
fi
exec "$BUILD_DIR/examples/paged_metadata" "$@"
