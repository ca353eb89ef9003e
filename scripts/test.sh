#!/usr/bin/env bash
# Installs what is missing and runs every test: C++ unit and integration tests (ctest),
# the ASan/UBSan and TSan builds, sluice-bench end-to-end checks, the Python package tests,
# the GPU tests (they skip without a GPU) and the RDMA suite inside a SoftRoCE guest.
# Exit status is non-zero if any suite failed. .ci/run calls this script.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
scripts/install-deps.sh --tests || { echo "test.sh: installing dependencies failed" >&2; exit 1; }

passed=0; failed=0; failed_names=()
suite() {  # suite NAME CMD...
  local name=$1; shift
  local t0=$SECONDS
  echo "=================== $name ==================="
  if "$@"; then
    passed=$((passed + 1)); echo "--- $name: PASSED in $((SECONDS - t0)) s"
  else
    failed=$((failed + 1)); failed_names+=("$name"); echo "--- $name: FAILED in $((SECONDS - t0)) s"
  fi
}

build_and_ctest() {
  # -g1 (line tables, enough for backtraces) instead of -g: a third less compile time in CI.
  # A unity build (8 sources per unit; SLUICE_UNITY=OFF builds file by file): the headers are
  # parsed and their templates instantiated once per batch: measured 360 instead of 768 CPU-s here.
  cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DCMAKE_UNITY_BUILD="${SLUICE_UNITY:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 >/dev/null &&
    ninja -C build-test -j "$JOBS" >/dev/null &&
    (cd build-test && ctest --output-on-failure -j "$JOBS" --timeout 300)
}

bench_checks() {  # every op over every host transport, every byte verified
  local b=build-test/tools/sluice-bench/sluice-bench rc=0
  for t in tcp shm; do
    for op in write read write_imm send; do
      "$b" --transport "$t" --op "$op" --min-size 1 --max-size 4M --batch-size 16 --concurrency 4 \
           --iterations 20 --check --quiet --csv > "build-test/bench-$t-$op.csv" || { echo "bench $t $op failed"; rc=1; }
    done
  done
  "$b" --transport shm --memfd --op write --min-size 4K --max-size 1M --iterations 20 --check --quiet --csv >/dev/null || rc=1
  for t in tcp shm; do  # write_with_imm ping-pong: every echo must arrive
    "$b" --transport "$t" --op pingpong --min-size 1 --max-size 64K --iterations 50 --quiet --csv >/dev/null || { echo "pingpong $t failed"; rc=1; }
  done
  [ $rc = 0 ] && echo "sluice-bench: 11 runs ok (9 checked byte for byte, 2 ping-pong)"
  return $rc
}

fuzz_suite() {  # libFuzzer targets for the bootstrap and frame parsers, bounded time each
  if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a >/dev/null 2>&1; then
    echo "fuzz: SKIPPED: clang or libFuzzer is not installed (scripts/install-deps.sh --tests installs clang and libclang-rt-14-dev)"
    return 0
  fi
  tests/fuzz/run.sh "${SLUICE_FUZZ_SECONDS:-30}"  # a fresh corpus each CI run; longer by hand
}

suite "C++ unit and integration tests (ctest)" build_and_ctest
suite "sluice-bench end-to-end checks" bench_checks
[ -x tests/sanitizers.sh ] && suite "sanitizers (ASan/UBSan, TSan)" tests/sanitizers.sh
suite "fuzzing (libFuzzer: bootstrap and frame parsers)" fuzz_suite
# The wheel builds in the ctest build tree (same flags): only the Python targets compile.
[ -x python/run_tests.sh ] && suite "Python package (pip install, pytest, examples)" \
  env SLUICE_WHEEL_BUILD_DIR="$ROOT/build-test" python/run_tests.sh
# Sluice and its peers on a few cells, every byte checked, no win/lose bar (issue 16). It runs
# in the Python suite's venv, whose sluice wheel was just built from this checkout, adding
# only the peers that venv lacks: no second wheel build, no second torch.
[ -x bench/peers/run.sh ] && suite "bench/peers --quick (Sluice beside its peers)" \
  env PEERS_VENV="$ROOT/.venv-test" PEERS_SKIP_WHEEL=1 bench/peers/run.sh --quick
# Many hosts on one machine (issue 19): engines in network namespaces, each its own host, in
# the Python suite's venv (its wheel); about a minute. Skips, saying why, without root.
[ -x tests/netns/run.sh ] && suite "network namespaces (many hosts on one machine)" tests/netns/run.sh
# The RDMA suite reuses the ctest build (its conformance suites are the same binaries, run
# with SLUICE_TEST_TRANSPORTS=rdma) and the TSan build of the sanitizer suite.
[ -x tests/rdma/run.sh ] && [ "${SLUICE_SKIP_RDMA:-0}" != 1 ] && suite "RDMA suite in a SoftRoCE guest" \
  env SLUICE_BUILD_DIR="$ROOT/build-test" SLUICE_RDMA_TSAN_BUILD_DIR="$ROOT/build-tsan" tests/rdma/run.sh

echo "==================================================="
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
