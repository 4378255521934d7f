#!/usr/bin/env bash
# Installs what is missing, builds Release with tests, runs the whole suite with ctest.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages
# The ATen peer comparison (bench/peer) is not part of the test build: scripts/peer_compare.sh.
configure_and_build "$BUILD_DIR" -DTILEDECODE_BUILD_TESTS=ON -DTILEDECODE_BUILD_BENCH=ON \
  -DTILEDECODE_BUILD_EXAMPLES=ON -DTILEDECODE_BUILD_PEER=OFF
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" "$@"
