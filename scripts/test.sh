#!/usr/bin/env bash
# Installs what is missing, builds Release with tests, runs the whole suite with ctest (the Python
# tests of the PyTorch binding included: ctest names python.*; TD_NO_PYTHON=1 skips the binding).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ "${TD_NO_PYTHON:-0}" = 1 ]; then
  install_missing_packages
  python_flag=-DTILEDECODE_BUILD_PYTHON=OFF
else
  install_missing_packages "${TD_PYTHON_PACKAGES[@]}"
  python_flag=-DTILEDECODE_BUILD_PYTHON=ON
fi
# The ATen peer comparison (bench/peer) is not part of the test build: scripts/peer_compare.sh.
configure_and_build "$BUILD_DIR" -DTILEDECODE_BUILD_TESTS=ON -DTILEDECODE_BUILD_BENCH=ON \
  -DTILEDECODE_BUILD_EXAMPLES=ON -DTILEDECODE_BUILD_PEER=OFF "$python_flag"
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" "$@"
