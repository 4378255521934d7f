#!/usr/bin/env bash
# The Python route: installs what is missing (Debian: libtorch-dev, python3-torch, pytest, ...),
# builds the PyTorch binding (torch.ops.tiledecode + the tiledecode package) in $PY_BUILD_DIR
# (default build-py: no tests, benchmarks or examples), then runs examples/python/decode_step.py
# (arguments pass through; --help lists them).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PY_BUILD_DIR="${PY_BUILD_DIR:-$ROOT/build-py}"
install_missing_packages "${TD_PYTHON_PACKAGES[@]}"
cmake -S "$ROOT" -B "$PY_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTILEDECODE_BUILD_TESTS=OFF -DTILEDECODE_BUILD_BENCH=OFF -DTILEDECODE_BUILD_EXAMPLES=OFF \
  -DTILEDECODE_BUILD_PYTHON=ON
cmake --build "$PY_BUILD_DIR" --target tiledecode_python -j "$JOBS"
PYTHON="$(sed -n 's/^TILEDECODE_PYTHON:FILEPATH=//p' "$PY_BUILD_DIR/CMakeCache.txt")"
if [ -z "$PYTHON" ]; then
  echo "python_demo: the binding was not configured (see the 'tiledecode python:' line above)" >&2
  exit 1
fi
PYTHONPATH="$PY_BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" \
  "$ROOT/examples/python/decode_step.py" "$@"
