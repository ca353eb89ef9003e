#!/usr/bin/env bash
# Runs INSIDE the SoftRoCE guest (a step of guest-suite.sh): the rdma conformance suite built
# with ThreadSanitizer (tests/rdma/run.sh builds it), on one rail and striped over every rail.
# Then the failover test (both rails). Fails on any ThreadSanitizer report. Tests that fork (a killed peer) are left out: TSan does
# not support fork() of a threaded process; 64 MiB messages are left out for time.
# Usage: guest-tsan.sh TSAN_BUILD_DIR
set -u
TB=${1:?TSan build dir}
HERE=$(cd "$(dirname "$0")" && pwd)
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 intercept_send=0 suppressions=$HERE/../tsan.supp"
DEVS=${RXE_DEVS:-$RXE_DEV}
rc=0
# One run's verdict: its exit status and its ThreadSanitizer reports (printed when any).
report() {  # name, output, exit status
  local reports
  reports=$(grep -c "WARNING: ThreadSanitizer" <<< "$2")
  echo "$1: exit $3, $reports ThreadSanitizer report(s); $(grep -E '^\[  (PASSED|FAILED) ' <<< "$2" | tr '\n' ' ')"
  if [ "$3" != 0 ] || [ "$reports" != 0 ]; then
    grep -A12 "WARNING: ThreadSanitizer" <<< "$2" | head -80
    grep -E "FAILED|Failure" <<< "$2" | head -20
    rc=1
  fi
}
for hca in "=$RXE_DEV" "=$(echo $DEVS | tr ' ' ',')"; do
  out=$(SLUICE_IB_HCA=$hca "$TB/tests/rdma/rdma_conformance" --gtest_brief=1 \
        --gtest_filter='Channels/Rdma.*/ch2:-*PeerKilled*:*SixtyFour*' 2>&1)
  report "SLUICE_IB_HCA=$hca" "$out" $?
done
# Failover under TSan: the progress thread, the rails' monitor, the redialer and the listener
# all touch a channel being replaced.
if [ -x "$TB/tests/rdma/rdma_failover_test" ]; then
  out=$(SLUICE_IB_HCA="=$(echo $DEVS | tr ' ' ',')" "$TB/tests/rdma/rdma_failover_test" --gtest_brief=1 2>&1)
  st=$?
  for nd in ${RXE_NETDEVS:-}; do ip link set "$nd" up; done
  report failover "$out" $st
else
  echo "failover: $TB/tests/rdma/rdma_failover_test was not built"
  rc=1
fi
exit $rc
