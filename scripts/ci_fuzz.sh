#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, -fsanitize=fuzzer,address,undefined) and runs each one
# for a bounded time, starting from its committed seed corpus (copied: the committed corpus is
# never modified). Any crash, sanitizer report, timeout or OOM fails the script; the crashing
# input is kept under $FUZZ_ARTIFACTS.
#   FUZZ_RUNS        inputs per target (default: per-target counts below, ~30 s each on the
#                    2-core dev machine); with the fixed seed the run is then deterministic: the
#                    same commit explores the same inputs on any machine, however fast
#   FUZZ_SECONDS     wall-clock cap per target (default 90; a slow runner stops early)
#   FUZZ_SEED        libFuzzer seed (default 1; 0 = random, for fuzzing by hand)
#   FUZZ_BUILD_DIR   build folder (default build-fuzz)
#   FUZZ_ARTIFACTS   where crash/timeout inputs go (default $FUZZ_BUILD_DIR/artifacts)
#   FUZZ_TARGETS     space-separated subset, e.g. "metadata cache" (default: every fuzz_*.cpp)
#   FUZZ_PARALLEL    targets fuzzed at a time (default JOBS, the core count)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages clang libclang-rt-14-dev llvm

FUZZ_SECONDS="${FUZZ_SECONDS:-90}"
# Inputs per target: ~20-45 s each at the execution rates measured on the dev machine (2026-12-02,
# Zen 3, with a compile running beside: metadata ~670/s, cache ~9800/s, indexer ~76/s,
# sparse_attention ~180/s, layer_step ~13/s).
declare -A DEFAULT_RUNS=([metadata]=20000 [cache]=300000 [indexer]=2500 [sparse_attention]=5000
  [layer_step]=500)
FUZZ_BUILD_DIR="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
FUZZ_ARTIFACTS="${FUZZ_ARTIFACTS:-$FUZZ_BUILD_DIR/artifacts}"
if [ -z "${FUZZ_TARGETS:-}" ]; then
  FUZZ_TARGETS="$(cd "$ROOT/tests/fuzz" && ls fuzz_*.cpp | sed 's/^fuzz_//; s/\.cpp$//' | tr '\n' ' ')"
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
command -v llvm-symbolizer >/dev/null && export ASAN_SYMBOLIZER_PATH="$(command -v llvm-symbolizer)"

echo "== fuzz: building targets: $FUZZ_TARGETS"
t0=$SECONDS
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$FUZZ_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTILEDECODE_BUILD_FUZZERS=ON -DTILEDECODE_BUILD_TESTS=OFF -DTILEDECODE_BUILD_BENCH=OFF \
  -DTILEDECODE_BUILD_EXAMPLES=OFF >/dev/null
targets=()
for t in $FUZZ_TARGETS; do targets+=(--target "fuzz_$t"); done
cmake --build "$FUZZ_BUILD_DIR" -j "$JOBS" "${targets[@]}"
echo "== fuzz: build took $((SECONDS - t0)) s"

mkdir -p "$FUZZ_ARTIFACTS"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
run_target() {
  # run_target <name>: fuzzes one target from its seed corpus; writes $work/<name>.result.
  local t="$1" bin="$FUZZ_BUILD_DIR/tests/fuzz/fuzz_$1" seeds runs t1=$SECONDS
  mkdir -p "$work/$t"
  [ -d "$ROOT/tests/fuzz/corpus/$t" ] && cp "$ROOT/tests/fuzz/corpus/$t/"* "$work/$t/" 2>/dev/null || true
  seeds=$(ls "$work/$t" | wc -l)
  runs="${FUZZ_RUNS:-${DEFAULT_RUNS[$t]:-100000}}"
  echo "== fuzz: fuzz_$t, $runs inputs (cap ${FUZZ_SECONDS} s) from $seeds seed inputs"
  # -timeout: one input may take at most 10 s; -rss_limit_mb bounds memory on the CI runner.
  # A fixed seed and a fixed number of inputs keep a CI run reproducible (a time budget alone
  # made the explored inputs depend on the runner's speed).
  if "$bin" "$work/$t" -seed="${FUZZ_SEED:-1}" -runs="$runs" -max_total_time="$FUZZ_SECONDS" \
       -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$FUZZ_ARTIFACTS/${t}-" >"$work/$t.log" 2>&1; then
    {
      grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' \
        "$work/$t.log" | sed 's/^/   /'
      echo "== fuzz: fuzz_$t PASSED ($((SECONDS - t1)) s, corpus now $(ls "$work/$t" | wc -l) inputs)"
    } >"$work/$t.result"
  else
    {
      tail -n 60 "$work/$t.log"
      echo "== fuzz: fuzz_$t FAILED; reproducer(s): $(ls "$FUZZ_ARTIFACTS" | grep "^${t}-" | tr '\n' ' ')"
    } >"$work/$t.result"
  fi
  cat "$work/$t.result"
}

# FUZZ_PARALLEL targets fuzz at a time (default JOBS: each libFuzzer process is single-threaded).
failed=()
for t in $FUZZ_TARGETS; do
  while [ "$(jobs -rp | wc -l)" -ge "${FUZZ_PARALLEL:-$JOBS}" ]; do wait -n || true; done
  run_target "$t" &
done
wait
for t in $FUZZ_TARGETS; do
  grep -q "fuzz_$t PASSED" "$work/$t.result" 2>/dev/null || failed+=("$t")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "== fuzz: FAILED targets: ${failed[*]} (inputs in $FUZZ_ARTIFACTS)"
  exit 1
fi
echo "== fuzz: all targets passed ($((SECONDS - t0)) s total)"
