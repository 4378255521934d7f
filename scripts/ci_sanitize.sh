#!/usr/bin/env bash
# The sanitizer pass of CI.
#  1. AddressSanitizer + UndefinedBehaviorSanitizer (clang, -DTILEDECODE_SANITIZE=ON) with
#     TILEDECODE_CHECKED_VIEWS (every View::operator() bounds-checked): builds every test
#     binary and runs each one once (one process per binary, one binary per core at a time,
#     the longest first). Lean mode, to fit the CI budget:
#     TILEDECODE_SANITIZE_LEAN=1 is exported so tests may shrink repeat counts; cases whose name
#     contains "Slow" or "Exhaustive" are filtered out; and a binary with more than
#     SAN_FULL_MAX cases runs one gtest shard of SAN_SHARDS (its cases dealt round-robin),
#     the shard index derived from the commit (its hash mod SAN_SHARDS), so a commit is always
#     checked the same way, successive commits rotate through the shards, and every binary runs
#     every time.
#  2. ThreadSanitizer (clang -fsanitize=thread): builds test_reliability and test_core (the
#     thread pool, determinism and concurrent-call tests) and runs them, and test_compressor's
#     request lanes and thread-count cases (TSAN_COMPRESSOR_FILTER).
#   SAN_BUILD_DIR / TSAN_BUILD_DIR   build folders (default build-asan, build-tsan)
#   SAN_GTEST_FILTER                 gtest filter for pass 1 (default: no *Slow*, *Exhaustive* or
#                                    full-width whole-layer cases, SAN_HEAVY)
#   SAN_SHARDS / SAN_SHARD_INDEX     shards per large binary (default 4; 1 = every case) and the
#                                    shard run (default: the HEAD commit's hash mod SAN_SHARDS;
#                                    0 outside a git checkout)
#   SAN_FULL_MAX                     binaries with at most this many cases run whole (default
#                                    SAN_SHARDS: any larger binary has a case in every shard)
#   SAN_PARALLEL                     binaries run at a time (default JOBS, the core count)
#   SAN_SKIP_TSAN=1                  skip pass 2
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing_packages clang libclang-rt-14-dev llvm

SAN_BUILD_DIR="${SAN_BUILD_DIR:-$ROOT/build-asan}"
TSAN_BUILD_DIR="${TSAN_BUILD_DIR:-$ROOT/build-tsan}"
# Full-width whole-layer cases take minutes each under ASan + checked views; the sanitizer pass
# covers the layer composition with the narrow-model cases instead (same paging, smaller widths).
SAN_HEAVY="DecodeStep.ConsecutiveMtp*:DecodeStep.ThreeHundred*:DecodeStep.NoHeapAllocation*"
SAN_HEAVY+=":LayerStep.*:Determinism.WholeLayerStep*:A2a3Layer.*:LongContext.long_context_???_*"
SAN_HEAVY+=":batch_invariant.*FullFlash*"
SAN_GTEST_FILTER="${SAN_GTEST_FILTER:--*Slow*:*Exhaustive*:$SAN_HEAVY}"
SAN_SHARDS="${SAN_SHARDS:-4}"
commit_shard() {
  local h
  h="$(git -C "$ROOT" rev-parse --short=8 HEAD 2>/dev/null || echo 0)"
  echo $(( 16#$h % SAN_SHARDS ))
}
SAN_SHARD_INDEX="${SAN_SHARD_INDEX:-$(commit_shard)}"
SAN_FULL_MAX="${SAN_FULL_MAX:-$SAN_SHARDS}"
command -v llvm-symbolizer >/dev/null && export ASAN_SYMBOLIZER_PATH="$(command -v llvm-symbolizer)"
export TILEDECODE_SANITIZE_LEAN=1

test_targets() {
  (cd "$ROOT/tests" && ls test_*.cpp | sed 's/\.cpp$//')
}

# Binaries that take longest under ASan start first, so the parallel slots finish together.
SAN_LONG_FIRST="test_backend_ops test_decode_step test_a2a3 test_reliability test_numerics"

run_one() {
  # run_one <label> <build dir> <gtest filter> <stem>: runs one binary, writes <stem>.log and
  # <stem>.result (one line: PASSED/FAILED, seconds, what ran).
  local label="$1" dir="$2" filter="$3" stem="$4" t1=$SECONDS n note shard_env=()
  n=$(cd "$dir/tests" && GTEST_FILTER="$filter" "./$stem" --gtest_list_tests | grep -c '^  ' || true)
  note="all $n cases"
  if [ "${SHARDS:-1}" -gt 1 ] && [ "$n" -gt "$SAN_FULL_MAX" ]; then
    shard_env=(GTEST_TOTAL_SHARDS="$SHARDS" GTEST_SHARD_INDEX="$SHARD_INDEX")
    note="shard $SHARD_INDEX/$SHARDS of $n cases"
  fi
  if (cd "$dir/tests" && env GTEST_FILTER="$filter" "${shard_env[@]}" timeout 900 "./$stem" \
        --gtest_brief=1 >"$dir/$stem.log" 2>&1); then
    echo "PASSED ($((SECONDS - t1)) s, $note: $(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' "$dir/$stem.log" | head -1))" >"$dir/$stem.result"
  else
    echo "FAILED ($((SECONDS - t1)) s)" >"$dir/$stem.result"
  fi
  echo "== $label: $stem $(cat "$dir/$stem.result")"
}

run_binaries() {
  # run_binaries <label> <build dir> <gtest filter> <binary...>
  # SHARDS (1 = whole binaries) and SHARD_INDEX come from the caller's environment. SAN_PARALLEL
  # binaries run at a time (default JOBS: the test binaries are single-threaded apart from the
  # thread-pool cases, so one per core keeps the runner busy without oversubscribing it).
  local label="$1" dir="$2" filter="$3"; shift 3
  local failed=() ordered=() s par="${SAN_PARALLEL:-$JOBS}"
  for s in $SAN_LONG_FIRST; do
    [[ " $* " == *" $s "* ]] && ordered+=("$s")
  done
  for s in "$@"; do
    [[ " ${ordered[*]} " == *" $s "* ]] || ordered+=("$s")
  done
  for s in "${ordered[@]}"; do
    rm -f "$dir/$s.result"
    while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do wait -n || true; done
    run_one "$label" "$dir" "$filter" "$s" &
  done
  wait
  for s in "${ordered[@]}"; do
    if ! grep -q '^PASSED' "$dir/$s.result" 2>/dev/null; then
      tail -n 80 "$dir/$s.log"
      echo "== $label: $s FAILED"
      failed+=("$s")
    fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "== $label: FAILED: ${failed[*]}"
    return 1
  fi
}

# --- pass 1: ASan + UBSan --------------------------------------------------------------------
t0=$SECONDS
mapfile -t stems < <(test_targets)
echo "== asan+ubsan: building ${stems[*]}"
# -O1 keeps the instrumented kernels reasonably fast and the build short; -g1 gives line numbers.
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$SAN_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1" -DCMAKE_CXX_FLAGS="-DTILEDECODE_CHECKED_VIEWS" \
  -DTILEDECODE_SANITIZE=ON -DTILEDECODE_BUILD_TESTS=ON -DTILEDECODE_BUILD_BENCH=OFF \
  -DTILEDECODE_BUILD_EXAMPLES=OFF >/dev/null
targets=()
for s in "${stems[@]}"; do targets+=(--target "$s"); done
cmake --build "$SAN_BUILD_DIR" -j "$JOBS" "${targets[@]}"
echo "== asan+ubsan: build took $((SECONDS - t0)) s"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
t1=$SECONDS
echo "== asan+ubsan: binaries with > $SAN_FULL_MAX cases run shard $SAN_SHARD_INDEX of $SAN_SHARDS"
SHARDS="$SAN_SHARDS" SHARD_INDEX="$SAN_SHARD_INDEX" \
  run_binaries "asan+ubsan" "$SAN_BUILD_DIR" "$SAN_GTEST_FILTER" "${stems[@]}"
echo "== asan+ubsan: all ${#stems[@]} test binaries passed (run $((SECONDS - t1)) s, total $((SECONDS - t0)) s)"
unset ASAN_OPTIONS UBSAN_OPTIONS

# --- pass 2: ThreadSanitizer -----------------------------------------------------------------
if [ "${SAN_SKIP_TSAN:-0}" = 1 ]; then
  echo "== tsan: skipped (SAN_SKIP_TSAN=1)"
  exit 0
fi
t0=$SECONDS
tsan_stems=()
for s in test_core test_reliability; do
  [ -f "$ROOT/tests/$s.cpp" ] && tsan_stems+=("$s")
done
# The compressor's requests on lanes at once (backend/cpu/compressor.hpp for_requests): only those
# cases of its binary (~25 s under TSan on the 2-core dev VM).
TSAN_COMPRESSOR_FILTER="${TSAN_COMPRESSOR_FILTER:-CompressorLanes.*:*.BitIdenticalForAnyThreadCount}"
tsan_extra=()
[ -f "$ROOT/tests/test_compressor.cpp" ] && tsan_extra+=(test_compressor)
echo "== tsan: building ${tsan_stems[*]} ${tsan_extra[*]}"
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$TSAN_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1" -DCMAKE_CXX_FLAGS="-fsanitize=thread" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DTILEDECODE_SANITIZE=OFF \
  -DTILEDECODE_BUILD_TESTS=ON -DTILEDECODE_BUILD_BENCH=OFF -DTILEDECODE_BUILD_EXAMPLES=OFF >/dev/null
targets=()
for s in "${tsan_stems[@]}" "${tsan_extra[@]}"; do targets+=(--target "$s"); done
cmake --build "$TSAN_BUILD_DIR" -j "$JOBS" "${targets[@]}"
echo "== tsan: build took $((SECONDS - t0)) s"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
t1=$SECONDS
run_binaries "tsan" "$TSAN_BUILD_DIR" "$SAN_GTEST_FILTER" "${tsan_stems[@]}"
if [ ${#tsan_extra[@]} -gt 0 ]; then
  run_binaries "tsan" "$TSAN_BUILD_DIR" "$TSAN_COMPRESSOR_FILTER" "${tsan_extra[@]}"
fi
echo "== tsan: passed (run $((SECONDS - t1)) s, total $((SECONDS - t0)) s)"
