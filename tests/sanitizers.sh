#!/usr/bin/env bash
# Builds the test suite with AddressSanitizer + UndefinedBehaviorSanitizer (build-asan) and
# with ThreadSanitizer (build-tsan) and runs ctest in each.
#
#   tests/sanitizers.sh            # both
#   tests/sanitizers.sh asan       # only ASan+UBSan (the whole suite, fork tests included)
#   tests/sanitizers.sh tsan       # only TSan (tests labelled "nofork": core unit tests and
#                                  # two engines in one process over loopback tcp and shm;
#                                  # TSan does not support fork() of a threaded process)
#
# Built at -O1 -g1: half the compile time of -O2 -g under the sanitizers (measured: ASan+UBSan
# 40 s instead of 84 s of CPU for one test file), and -g1 still gives file:line in reports.
# Unity build (CMAKE_UNITY_BUILD, 8 sources per unit): each batch parses the headers (gtest,
# nlohmann/json, the engine's) and instantiates their templates once instead of eight times;
# measured on this project's ASan+UBSan targets, 496 instead of 811 CPU-seconds (-39 %).
# SLUICE_UNITY=OFF builds file by file (what a compile error is easier to read in).
# Extra configure arguments: SLUICE_CMAKE_ARGS="-D..." ; parallelism: JOBS (default nproc).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="${JOBS:-$(nproc)}"
WHICH="${1:-all}"
read -r -a EXTRA <<< "${SLUICE_CMAKE_ARGS:-}"

# CUDA is left out of these builds unless SLUICE_SANITIZE_CUDA=ON: the suites they run (labels
# core/engine, nofork) never reach a GPU, and on a machine without one the CUDA code only takes
# its "no device" branches, which the ctest suite covers; compiling it twice more cost about 100
# CPU-seconds of CI. On a GPU machine compute-sanitizer checks the CUDA code (docs/gpu.md).
configure_and_build() {
  local dir="$1" san="$2"
  cmake -S "$ROOT" -B "$ROOT/$dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DSLUICE_SANITIZE="$san" \
    -DSLUICE_BUILD_TOOLS=OFF -DSLUICE_BUILD_PYTHON=OFF -DSLUICE_BUILD_TESTS=ON \
    -DSLUICE_WITH_CUDA="${SLUICE_SANITIZE_CUDA:-OFF}" \
    -DSLUICE_TEST_TIMEOUT_SCALE=4 \
    -DCMAKE_UNITY_BUILD="${SLUICE_UNITY:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
    "${EXTRA[@]}"
  shift 2
  ninja -C "$ROOT/$dir" -j "$JOBS" sluice_core_tests sluice_loopback_tests sluice_multiprocess_tests "$@"
}

status=0

if [[ "$WHICH" == all || "$WHICH" == asan ]]; then
  echo "=== ASan + UBSan: $ROOT/build-asan ==="
  configure_and_build build-asan "address;undefined" sluice_port_channel_tests sluice_port_channel_fork_tests
  # detect_leaks stays on; fork children leave with _exit, which LSan does not check.
  ( cd "$ROOT/build-asan" &&
    ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest -L "core|engine" -j "$JOBS" --output-on-failure --no-tests=error ) || status=1
fi

if [[ "$WHICH" == all || "$WHICH" == tsan ]]; then
  echo "=== TSan: $ROOT/build-tsan (tests labelled nofork) ==="
  # intercept_send=0: TSan's send/sendmsg interceptor releases the socket *before* it records
  # the read of the buffer, so a peer that orders a later write of that buffer through the
  # network (the reply to this send, then a new request) is reported as racing with it: a
  # false positive on every tcp read-after-write of the same bytes (TcpWaiter, seen with the
  # waiting thread receiving itself). Races on the engine's own state are still caught.
  # The port channel's proxy workers against host producer threads.
  configure_and_build build-tsan "thread" sluice_port_channel_tests
  ( cd "$ROOT/build-tsan" &&
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:intercept_send=0:suppressions=$ROOT/tests/tsan.supp" \
    ctest -L nofork -j "$JOBS" --output-on-failure --no-tests=error ) || status=1
fi

if [[ $status -eq 0 ]]; then echo "sanitizers: all passed"; else echo "sanitizers: FAILURES"; fi
exit $status
