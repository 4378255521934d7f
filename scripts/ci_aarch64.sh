#!/usr/bin/env bash
# The aarch64 pass of CI: cross-builds every test binary (and every public header on its own) for
# Linux aarch64 with Debian's GNU cross compiler and the project's -Wall -Wextra -Wpedantic
# -Werror, then runs the ctest suite under qemu-aarch64 user mode (CMAKE_CROSSCOMPILING_EMULATOR,
# so gtest_discover_tests lists the cases through qemu at build time). On aarch64
# TILEDECODE_X86 is 0: the scalar CPU backend is the only tier, and every #if TILEDECODE_X86
# branch is compiled out, which the x86 builds never check.
#
# GoogleTest is built from Debian's source package (googletest, /usr/src/googletest) with the
# cross compiler into $AARCH64_BUILD_DIR/gtest-prefix, once (a stamp records the googletest and
# compiler versions); Eigen is header-only. No multiarch (dpkg --add-architecture) is needed.
#
# Under qemu floating-point code runs ~40-50x slower than natively (TCG emulates FP in software),
# so the whole suite takes over an hour on 2 cores. AARCH64_TESTS selects the cases:
#   quick (default)  the areas with architecture-dependent behaviour or exact expectations:
#                    core (ISA dispatch, thread pool, views), paged_metadata, paged_cache, topk
#                    (integer code), rope (libm), layer (hc/rmsnorm/qkv, "BothIsas" = scalar
#                    here), indexer (its output is a top-k selection: one rounding difference
#                    changes the picked indices) and reliability (determinism and concurrency
#                    of every kernel family; lean, as in the sanitizer pass). The full-width
#                    whole-layer cases are left out with the sanitizer pass's rule (SAN_HEAVY:
#                    *Slow*, *Exhaustive*, DecodeStep.ConsecutiveMtp*, .ThreeHundred*,
#                    .NoHeapAllocation*, LayerStep.*, Determinism.WholeLayerStep*), and
#                    core.install_consumer (packaging, arch-independent, would build for the
#                    host). The other areas (compressor, sparse_attn, oproj, decode_step, a2a3)
#                    are compiled but not run.
#   all              every case (except core.install_consumer): ~1 h+ on 2 cores
#   <regex>          any other value is a ctest -R regex, e.g. '^indexer\.'
#   AARCH64_EXCLUDE    ctest -E regex applied in every mode (default: see above; "" = none)
#   AARCH64_BUILD_DIR  build folder (default build-aarch64)
#   AARCH64_CXXFLAGS   extra compiler flags (e.g. -ffp-contract=off), default none
#   AARCH64_TIMEOUT    per-case ctest timeout in seconds (default 900)
#   AARCH64_BUILD_ONLY=1  build (and list the cases) only, run nothing
# Exit status is non-zero on any build error or failing case. Idempotent: a rerun reuses the
# packages, GoogleTest and the build folder.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

t_all=$SECONDS
t0=$SECONDS
install_missing_packages g++-aarch64-linux-gnu qemu-user googletest
echo "== aarch64: packages ready ($((SECONDS - t0)) s): $(aarch64-linux-gnu-g++ --version | head -1), $(qemu-aarch64 --version | head -1)"

AARCH64_BUILD_DIR="${AARCH64_BUILD_DIR:-$ROOT/build-aarch64}"
AARCH64_TESTS="${AARCH64_TESTS:-quick}"
AARCH64_TIMEOUT="${AARCH64_TIMEOUT:-900}"
TOOLCHAIN="$ROOT/cmake/toolchain-aarch64-linux-gnu.cmake"
GTEST_SRC=/usr/src/googletest
GTEST_PREFIX="$AARCH64_BUILD_DIR/gtest-prefix"
TD_BUILD="$AARCH64_BUILD_DIR/tiledecode"

# --- GoogleTest for aarch64, from Debian's source package --------------------------------------
t0=$SECONDS
stamp="googletest $(dpkg-query -W -f='${Version}' googletest) / $(aarch64-linux-gnu-g++ -dumpfullversion)"
if [ -f "$GTEST_PREFIX/lib/libgtest.a" ] && [ "$(cat "$GTEST_PREFIX/.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "== aarch64: GoogleTest up to date ($stamp)"
else
  echo "== aarch64: building GoogleTest ($stamp) into $GTEST_PREFIX"
  rm -rf "$AARCH64_BUILD_DIR/googletest" "$GTEST_PREFIX"
  cmake -S "$GTEST_SRC" -B "$AARCH64_BUILD_DIR/googletest" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON \
    -DCMAKE_INSTALL_PREFIX="$GTEST_PREFIX" >/dev/null
  cmake --build "$AARCH64_BUILD_DIR/googletest" -j "$JOBS" >/dev/null
  cmake --install "$AARCH64_BUILD_DIR/googletest" >/dev/null
  echo "$stamp" >"$GTEST_PREFIX/.stamp"
  echo "== aarch64: GoogleTest built ($((SECONDS - t0)) s)"
fi

# --- the test suite, cross-built ---------------------------------------------------------------
t0=$SECONDS
cmake -S "$ROOT" -B "$TD_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DCMAKE_PREFIX_PATH="$GTEST_PREFIX" \
  -DCMAKE_CXX_FLAGS="${AARCH64_CXXFLAGS:-}" \
  -DTILEDECODE_BUILD_TESTS=ON -DTILEDECODE_BUILD_BENCH=OFF -DTILEDECODE_BUILD_EXAMPLES=OFF >/dev/null
if ! grep -q '^TILEDECODE_QEMU:FILEPATH=/' "$TD_BUILD/CMakeCache.txt"; then
  echo "== aarch64: no qemu-aarch64 found for CMAKE_CROSSCOMPILING_EMULATOR" >&2
  exit 1
fi
# Every test binary and the header_selfcontained objects (all of "all" without bench/examples).
cmake --build "$TD_BUILD" -j "$JOBS"
echo "== aarch64: cross build took $((SECONDS - t0)) s"

# --- run under qemu ----------------------------------------------------------------------------
SAN_HEAVY='Slow|Exhaustive|DecodeStep\.(ConsecutiveMtp|ThreeHundred|NoHeapAllocation)|LayerStep\.'
SAN_HEAVY+='|Determinism\.WholeLayerStep'
QUICK_AREAS='^(core|paged_metadata|paged_cache|topk|rope|layer|indexer|reliability)\.'
sel=()
case "$AARCH64_TESTS" in
  quick)
    sel=(-R "$QUICK_AREAS")
    exclude="${AARCH64_EXCLUDE-$SAN_HEAVY|^core\.install_consumer\$}"
    # Tests may shrink repeat counts under instrumentation (reliability.*); qemu is as slow.
    export TILEDECODE_SANITIZE_LEAN=1
    ;;
  all)
    exclude="${AARCH64_EXCLUDE-^core\.install_consumer\$}"
    ;;
  *)
    sel=(-R "$AARCH64_TESTS")
    exclude="${AARCH64_EXCLUDE-^core\.install_consumer\$}"
    ;;
esac
[ -n "$exclude" ] && sel+=(-E "$exclude")
n_sel=$(ctest --test-dir "$TD_BUILD" -N "${sel[@]}" | sed -n 's/^Total Tests: //p')
n_all=$(ctest --test-dir "$TD_BUILD" -N | sed -n 's/^Total Tests: //p')
echo "== aarch64: AARCH64_TESTS=$AARCH64_TESTS selects $n_sel of $n_all cases (${sel[*]})"
if [ "${AARCH64_BUILD_ONLY:-0}" = 1 ]; then
  echo "== aarch64: build only (AARCH64_BUILD_ONLY=1), total $((SECONDS - t_all)) s"
  exit 0
fi
t0=$SECONDS
rc=0
ctest --test-dir "$TD_BUILD" --output-on-failure -j "$JOBS" --timeout "$AARCH64_TIMEOUT" \
  "${sel[@]}" || rc=$?
echo "== aarch64: ctest under qemu took $((SECONDS - t0)) s (rc $rc)"
if [ "$rc" -ne 0 ]; then
  echo "== aarch64: FAILED (total $((SECONDS - t_all)) s)"
  exit "$rc"
fi
echo "== aarch64: passed (total $((SECONDS - t_all)) s)"
