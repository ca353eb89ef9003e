#!/usr/bin/env bash
# Runs INSIDE the SoftRoCE guest (started by run-in-guest.sh): every RDMA check against the
# real kernel verbs stack, one boot. Usage: guest-suite.sh BUILD_DIR
set -u
B=${1:?build dir}
export SLUICE_LISTEN=${RXE_IP:-10.0.0.1}:0   # engine handshakes over the rxe netdev
export SLUICE_LOG_LEVEL=${SLUICE_LOG_LEVEL:-warn}
fails=0; total=0
step() {  # name, command...
  local name=$1; shift
  total=$((total+1))
  local t0=$(date +%s.%N)
  echo "=== [$name] $*"
  "$@"; local rc=$?
  printf '=== [%s] rc=%d (%.1fs)\n' "$name" $rc "$(echo "$(date +%s.%N) - $t0" | bc)"
  [ $rc = 0 ] || { fails=$((fails+1)); FAILED="${FAILED:-} $name"; }
}
echo "guest: $(uname -r), device $RXE_DEV on $RXE_NETDEV $RXE_IP, RoCE v2 GID index $RXE_GID_INDEX"
step devices ibv_devinfo -d "$RXE_DEV"
step hca-filter "$B/tests/rdma/rdma_hca_filter_test" --gtest_brief=1
step negotiate "$B/tests/rdma/rdma_negotiate_test" --gtest_brief=1
step no-libibverbs env SLUICE_IBVERBS_LIB=/nonexistent/libibverbs.so.1 "$B/tests/rdma/rdma_conformance" --expect-unavailable "libibverbs not found"
DEVS=${RXE_DEVS:-$RXE_DEV}
ALL=$(echo $DEVS | tr ' ' ',')
step hca-excludes-all env SLUICE_IB_HCA="^=$ALL" "$B/tests/rdma/rdma_conformance" --expect-unavailable "no RDMA device"
step affinity "$B/tests/rdma/rdma_affinity_test" --gtest_brief=1
# One rail: every check on rxe0 alone.
step conformance-1rail env SLUICE_IB_HCA="=$RXE_DEV" "$B/tests/rdma/rdma_conformance" ${SLUICE_RDMA_GTEST_ARGS:-}
if [ "$(echo $DEVS | wc -w)" -ge 2 ]; then
  # Every device: queue pairs striped over the rails (QP c on rail c % rails).
  step conformance-rails env SLUICE_IB_HCA="=$ALL" "$B/tests/rdma/rdma_conformance" ${SLUICE_RDMA_GTEST_ARGS:-}
fi
# The shared conformance suites (what tcp and shm pass), from the same binaries, over rdma.
for bin in sluice_loopback_tests sluice_multiprocess_tests; do
  if [ -x "$B/tests/$bin" ]; then
    # SendStress at 1/16 of its bytes (4 MiB messages): its 8-in-flight cases hold over 1 GiB,
    # more than the guest's memory beside the kernel (the step was killed).
    step "conformance-$bin" env SLUICE_IB_HCA="=$ALL" SLUICE_TEST_TRANSPORTS=rdma SLUICE_TEST_SEND_STRESS_DIVISOR=16 "$B/tests/$bin" \
      --gtest_filter='Conformance/*' ${SLUICE_RDMA_GTEST_ARGS:-}
  else
    step "conformance-$bin" sh -c "echo '$B/tests/$bin was not built'; false"
  fi
done
# The port channel's proxy posting through rdma's thin path (RDMA WRITE, atomic signal, CQ
# flush). Left out here, and run over tcp and shm on the host: 64 producer threads spinning on
# a full FIFO on the guest's 2 emulated CPUs (100 s here, the proxy starved), and 2 x 5 GiB
# regions that rxe would pin in a 1.5 GiB guest.
if [ -x "$B/tests/port_channel/sluice_port_channel_tests" ]; then
  step conformance-port-channel env SLUICE_IB_HCA="=$ALL" SLUICE_TEST_TRANSPORTS=rdma \
    "$B/tests/port_channel/sluice_port_channel_tests" \
    --gtest_filter='Conformance/*:-*SixtyFourProducers*:*OffsetsBeyondFourGiB*' ${SLUICE_RDMA_GTEST_ARGS:-}
else
  step conformance-port-channel sh -c "echo '$B/tests/port_channel/sluice_port_channel_tests was not built'; false"
fi
# Queue-pair and rail failover: a queue pair broken under traffic, and each rail's netdev
# taken down for 2 s and brought back (the rail tests need two devices; they skip otherwise).
# Every rail's netdev is up again afterwards, whatever the test did.
step failover env SLUICE_IB_HCA="=$ALL" "$B/tests/rdma/rdma_failover_test" --gtest_brief=1 ${SLUICE_RDMA_GTEST_ARGS:-}
for nd in ${RXE_NETDEVS:-}; do ip link set "$nd" up; done
if [ -n "${SLUICE_RDMA_TSAN_DIR:-}" ] && [ -x "$SLUICE_RDMA_TSAN_DIR/tests/rdma/rdma_conformance" ]; then
  step tsan bash "$(dirname "$0")/guest-tsan.sh" "$SLUICE_RDMA_TSAN_DIR"
fi
echo "guest suite: $((total-fails))/$total steps passed${FAILED:+; failed:$FAILED}"
[ $fails = 0 ]
