#!/usr/bin/env bash
# Boot one SoftRoCE guest and run the whole RDMA suite (guest-suite.sh) in it.
# Usage: tests/rdma/run-in-guest.sh [BUILD_DIR]   (default: build-rdma next to the sources)
# Installs what the guest needs with apt when missing (qemu-system-x86, linux-image-amd64,
# busybox-static, rdma-core, ibverbs-providers, ibverbs-utils, perftest, ...).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
B=$(realpath "${1:-${SLUICE_BUILD_DIR:-$ROOT/build-rdma}}")
[ -x "$B/tests/rdma/rdma_conformance" ] || { echo "run-in-guest.sh: $B/tests/rdma/rdma_conformance not built" >&2; exit 2; }
# The guest sees the host's root read-only but mounts fresh tmpfs on /tmp, /run, /var/tmp and
# /root: share the sources too, so a checkout under one of those (a CI clone in /tmp) is visible.
shares=(-s "$ROOT")
case "$B/" in "$ROOT"/*) ;; *) shares+=(-s "$B") ;; esac
if [ -n "${SLUICE_RDMA_TSAN_DIR:-}" ]; then
  case "$SLUICE_RDMA_TSAN_DIR/" in "$ROOT"/*) ;; *) shares+=(-s "$SLUICE_RDMA_TSAN_DIR") ;; esac
fi
# Two SoftRoCE devices: the suite runs once on one rail (rxe0) and once striped over both.
exec "$HERE/rxe-guest.sh" -q -t "${RXE_TIMEOUT:-900}" --rxe-devices "${SLUICE_RDMA_RAILS:-2}" "${shares[@]}" -C "$B" \
  ${SLUICE_RDMA_GTEST_ARGS:+-e SLUICE_RDMA_GTEST_ARGS} ${SLUICE_RDMA_TSAN_DIR:+-e SLUICE_RDMA_TSAN_DIR} \
  -e SLUICE_LOG_LEVEL=${SLUICE_LOG_LEVEL:-warn} \
  -- bash "$HERE/guest-suite.sh" "$B"
