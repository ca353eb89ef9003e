#!/usr/bin/env bash
# The single entry point of the RDMA tests: configure + build (build dir $SLUICE_BUILD_DIR,
# default <repo>/build-rdma), then run the suite inside one SoftRoCE guest, then the two-guest
# wire test (two-guests.sh; SLUICE_RDMA_SKIP_WIRE=1 skips it). Exits non-zero if either part
# fails. SLUICE_RDMA_SKIP_BUILD=1 uses the build dir as it is; SLUICE_CMAKE_ARGS are passed to
# the first configure. It also builds the conformance suite with ThreadSanitizer
# (build-rdma-tsan; SLUICE_RDMA_SKIP_TSAN=1 skips it) and runs it in the same guest.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
B=${SLUICE_BUILD_DIR:-$ROOT/build-rdma}
if [ "${SLUICE_RDMA_SKIP_BUILD:-0}" != 1 ]; then
  [ -f "$B/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${SLUICE_CMAKE_ARGS:-} >/dev/null
  cmake --build "$B" -j "${SLUICE_BUILD_JOBS:-2}" --target sluice rdma_hca_filter_test rdma_negotiate_test rdma_affinity_test rdma_conformance rdma_failover_test \
    sluice_loopback_tests sluice_multiprocess_tests sluice_port_channel_tests \
    $(cmake --build "$B" --target help 2>/dev/null | grep rdma_wire_peer >/dev/null && echo rdma_wire_peer)
fi
# The conformance suite again under ThreadSanitizer (the threading of waiters, progress thread
# and sweeper against a real verbs stack). SLUICE_RDMA_SKIP_TSAN=1 leaves it out.
if [ "${SLUICE_RDMA_SKIP_TSAN:-0}" != 1 ]; then
  TB=$(realpath -m "${SLUICE_RDMA_TSAN_BUILD_DIR:-$ROOT/build-rdma-tsan}")
  if [ "${SLUICE_RDMA_SKIP_BUILD:-0}" != 1 ] || [ ! -x "$TB/tests/rdma/rdma_conformance" ] || [ ! -x "$TB/tests/rdma/rdma_failover_test" ]; then
    [ -f "$TB/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$TB" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLUICE_SANITIZE=thread \
      -DSLUICE_BUILD_TOOLS=OFF -DSLUICE_BUILD_PYTHON=OFF ${SLUICE_CMAKE_ARGS:-} >/dev/null
    cmake --build "$TB" -j "${SLUICE_BUILD_JOBS:-2}" --target rdma_conformance rdma_failover_test
  fi
  export SLUICE_RDMA_TSAN_DIR=$TB
fi
start=$(date +%s)
set +e
"$HERE/run-in-guest.sh" "$B"
rc=$?
src=$rc
echo "tests/rdma/run.sh: one-guest suite exit $rc after $(( $(date +%s) - start )) s"
wrc=skipped
if [ "${SLUICE_RDMA_SKIP_WIRE:-0}" != 1 ]; then
  wstart=$(date +%s)
  "$HERE/two-guests.sh" "$B"
  wrc=$?
  echo "tests/rdma/run.sh: two-guest wire test exit $wrc after $(( $(date +%s) - wstart )) s"
  [ $rc != 0 ] || rc=$wrc
fi
echo "tests/rdma/run.sh: exit $rc after $(( $(date +%s) - start )) s (one-guest suite $src, two-guest wire test $wrc)"
exit $rc
