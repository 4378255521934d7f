# Sourced by demo.sh and test.sh: install missing Debian packages, configure, build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
JOBS="${JOBS:-$(nproc)}"

TD_PACKAGES=(g++ cmake ninja-build libgtest-dev libgmock-dev libbenchmark-dev libeigen3-dev libfmt-dev)
# The PyTorch binding (python/, docs/python.md): libtorch and Debian's torch for python3, pytest for
# its tests (test.sh, python_demo.sh install them; ~80 s on a fresh machine).
TD_PYTHON_PACKAGES=(libtorch-dev python3-torch pybind11-dev python3-pytest python3-numpy)
# A clang build (CC=clang CXX=clang++ ./scripts/test.sh) needs clang as well.
case "${CXX:-}" in clang*) TD_PACKAGES+=(clang) ;; esac

install_missing_packages() {
  local missing=()
  for p in "${TD_PACKAGES[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

configure_and_build() {
  # configure_and_build <build dir> [extra cmake args...]
  local dir="$1"; shift
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$dir" -j "$JOBS"
}
