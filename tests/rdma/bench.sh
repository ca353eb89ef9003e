#!/usr/bin/env bash
# One command: build sluice-bench, boot one SoftRoCE guest and, in the same run on the same
# rxe0, measure sluice-bench --transport rdma (write and read, 64 KiB - 1 MiB, and a 2-byte write
# latency) against perftest ib_write_bw / ib_read_bw / ib_write_lat (-x $RXE_GID_INDEX), and
# print the ratios. Absolute numbers under emulation mean nothing; only ratios do. Then, where
# built, tcg_footprint: how user-space code between two posts slows SoftRoCE under TCG.
# Env: SLUICE_BUILD_DIR (default <repo>/build-rdma), SLUICE_BENCH_SIZES, SLUICE_BENCH_REPS, SLUICE_BENCH_CHANNELS,
# RXE_MTU (e.g. 9000 for RDMA MTU 4096).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
B=$(realpath -m "${SLUICE_BUILD_DIR:-$ROOT/build-rdma}")
if [ "${SLUICE_RDMA_SKIP_BUILD:-0}" != 1 ]; then
  [ -f "$B/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release ${SLUICE_CMAKE_ARGS:-} >/dev/null
  cmake --build "$B" -j "${SLUICE_BUILD_JOBS:-2}" --target sluice sluice-bench \
    $(cmake --build "$B" --target help 2>/dev/null | grep rdma_tcg_footprint >/dev/null && echo rdma_tcg_footprint)
fi
BENCH=$B/tools/sluice-bench/sluice-bench
[ -x "$BENCH" ] || { echo "bench.sh: $BENCH not built" >&2; exit 2; }
exec "$HERE/rxe-guest.sh" -q -t "${RXE_TIMEOUT:-900}" -s "$B" -C "$B" \
  ${SLUICE_BENCH_SIZES:+-e SLUICE_BENCH_SIZES} ${SLUICE_BENCH_REPS:+-e SLUICE_BENCH_REPS} ${SLUICE_BENCH_CHANNELS:+-e SLUICE_BENCH_CHANNELS} ${SLUICE_RDMA_BUSY_MS:+-e SLUICE_RDMA_BUSY_MS} \
  -- bash "$HERE/guest-bench.sh" "$BENCH" "$B/tests/rdma/rdma_tcg_footprint"
