#!/usr/bin/env bash
# TileDecode vs an ATen (libtorch) peer on OpenBLAS, next to this machine's ceilings; writes
# docs/performance.md and docs/img/*.png.
#
#   scripts/peer_compare.sh [--quick] [other peer_compare arguments...]
#   scripts/peer_compare.sh --isa avx2,avx512   # every listed TileDecode tier, same peer samples
#   scripts/peer_compare.sh --long-context   # the 1k -> 1M context sweep: writes
#                                            # docs/performance_long_context.md and
#                                            # docs/img/time_vs_context_1m.png instead
#
# Installs what is missing (Debian: libtorch-dev, libopenblas0-pthread, python3-matplotlib),
# makes sure libblas.so.3 — the BLAS ATen's sgemm_ calls on Debian, chosen through
# update-alternatives — is OpenBLAS (pthread) and not the reference BLAS (~50x slower: the
# peer would be a strawman), builds peer_compare in its own build folder $PEER_BUILD_DIR
# (default build-peer: tests and examples off, so it never touches the main build) and runs
# it, then bench/report. The binary prints which library sgemm_ resolved to at run time; the
# report quotes it.
#
# The peer runs OpenBLAS's fastest kernels for this CPU: OpenBLAS (DYNAMIC_ARCH) picks a "core"
# once at load time, and its pick is not always the fastest (0.3.21 ran Haswell/AVX2 kernels on
# an AVX-512 Zen 5). peer_compare itself measures the detected core and every core of this
# OpenBLAS the CPU can run (OPENBLAS_CORETYPE = Haswell, Zen, SkylakeX, Cooperlake,
# SapphireRapids as the ISA allows; a short 1-thread sgemm probe per core, each in a child
# process, ~2 s each) and re-executes itself with the fastest exported; the log, the JSON
# (peer.blas_core, peer.blas_cores_measured) and the report name it and list every core with
# its GFLOP/s. --blas-core NAME|detected skips the probe. An OPENBLAS_CORETYPE (or
# OPENBLAS_L2_SIZE) inherited from the environment is dropped, with a message: one such session
# environment held OPENBLAS_CORETYPE=Haswell on an AVX-512 Zen 5, where the probe's SkylakeX
# core is 1.4x faster (116 vs 82 GFLOP/s geomean, 1.9x at 512 token rows), so the peer would have
# run below its best. PEER_KEEP_BLAS_ENV=1 keeps them (the binary then skips the probe and says so).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PEER_BUILD_DIR="${PEER_BUILD_DIR:-$ROOT/build-peer}"
long_context=0
for arg in "$@"; do [ "$arg" = --long-context ] && long_context=1; done
if [ "$long_context" = 1 ]; then
  OUT_JSON="${OUT_JSON:-$PEER_BUILD_DIR/peer_compare_long_context.json}"
  NOTES="${NOTES:-$ROOT/bench/peer/notes_long_context.md}"
else
  OUT_JSON="${OUT_JSON:-$PEER_BUILD_DIR/peer_compare.json}"
  NOTES="${NOTES:-$ROOT/bench/peer/notes.md}"
fi
DOCS_DIR="${DOCS_DIR:-$ROOT/docs}"

install_missing_packages libtorch-dev libopenblas0-pthread python3-matplotlib

# The BLAS behind libblas.so.3 (ATen links libblas.so.3, not libopenblas directly).
arch="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
alt="libblas.so.3-$arch"
openblas="/usr/lib/$arch/openblas-pthread/libblas.so.3"
current="$(update-alternatives --query "$alt" 2>/dev/null | sed -n 's/^Value: //p')"
if [ "$current" != "$openblas" ]; then
  echo "== libblas.so.3 is '${current:-unset}'; selecting OpenBLAS (pthread): $openblas"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo update-alternatives --set "$alt" "$openblas"
fi
echo "== libblas.so.3 -> $(readlink -f "/usr/lib/$arch/libblas.so.3")"

cmake -S "$ROOT" -B "$PEER_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTILEDECODE_BUILD_TESTS=OFF -DTILEDECODE_BUILD_EXAMPLES=OFF -DTILEDECODE_BUILD_BENCH=ON
cmake --build "$PEER_BUILD_DIR" --target peer_compare -j "$JOBS"

lscpu > "$PEER_BUILD_DIR/lscpu.txt"
# The peer's worker threads spin after each call before they sleep: OpenBLAS's pthread workers
# for 2^28 cycles (~80 ms here), libgomp's (ATen's pool) for 300000 pause loops (several ms on
# Zen, whose PAUSE is ~65 cycles). In an interleaved comparison that spinning steals the second
# core from whatever is sampled next: TileDecode at 2 threads measured no faster than at 1 while
# its own benchmarks showed 1.74-1.85x. Bounded spins (~0.1-0.2 ms) still cover the gaps between
# the back-to-back BLAS calls and parallel regions inside one peer kernel. TileDecode's own pool
# spins at most 100 us before it blocks, and before every 2-thread sample peer_compare wakes the
# sampled side's threads (untimed), so this is not a handicap for the peer.
export OPENBLAS_THREAD_TIMEOUT="${OPENBLAS_THREAD_TIMEOUT:-18}"
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-10000}"
# Transparent huge pages for every malloc'd block (glibc >= 2.35; older ones ignore it). With THP
# in "madvise" mode (this VM) the peer's FP32 weights and ATen temporaries sat on 4 KB pages and
# its layer step took 385-690 ms instead of 68-93 ms, all user time and no page faults: perf put
# 74 % of it in OpenBLAS's packing copies (sgemm_itcopy/incopy), which walk the weights with a
# 16 KB stride, a TLB miss per row. An engine gets huge pages from THP=always or its allocator;
# TileDecode's own buffers of 2 MiB and more request them (Buffer).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
if [ "${PEER_KEEP_BLAS_ENV:-0}" != 1 ]; then
  for var in OPENBLAS_CORETYPE OPENBLAS_L2_SIZE; do
    if [ -n "${!var+x}" ]; then
      echo "== dropping $var=${!var} inherited from the environment (PEER_KEEP_BLAS_ENV=1 keeps it)"
      unset "$var"
    fi
  done
fi
"$PEER_BUILD_DIR/bench/peer/peer_compare" --json "$OUT_JSON" "$@" | tee "${OUT_JSON%.json}.log"

notes=()
[ -f "$NOTES" ] && notes=(--notes "$NOTES")
/usr/bin/python3 "$ROOT/bench/report" "$OUT_JSON" --out "$DOCS_DIR" --lscpu "$PEER_BUILD_DIR/lscpu.txt" \
  --command "scripts/peer_compare.sh $*" "${notes[@]}"
