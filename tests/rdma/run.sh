#!/usr/bin/env bash
# The single entry point of the RDMA tests: configure + build (build dir $SLUICE_BUILD_DIR,
# default <repo>/build-rdma), then run the suite inside one SoftRoCE guest. Exits non-zero on
# any failure. SLUICE_RDMA_SKIP_BUILD=1 uses the build dir as it is; SLUICE_CMAKE_ARGS are
# passed to the first configure.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
B=${SLUICE_BUILD_DIR:-$ROOT/build-rdma}
if [ "${SLUICE_RDMA_SKIP_BUILD:-0}" != 1 ]; then
  [ -f "$B/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${SLUICE_CMAKE_ARGS:-} >/dev/null
  cmake --build "$B" -j "${SLUICE_BUILD_JOBS:-2}" --target sluice rdma_hca_filter_test rdma_conformance \
    $(grep -q rdma_shared_suites "$B/tests/rdma/Makefile" 2>/dev/null && echo rdma_shared_suites)
fi
start=$(date +%s)
set +e
"$HERE/run-in-guest.sh" "$B"
rc=$?
echo "tests/rdma/run.sh: exit $rc after $(( $(date +%s) - start )) s"
exit $rc
