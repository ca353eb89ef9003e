#!/usr/bin/env bash
# Runs INSIDE one of the two guests of two-guests.sh: the rdma_wire_peer server or client
# against the other guest, over rxe0 on the virtio NIC of the QEMU socket network.
# Usage: wire-guest.sh server|client BUILD_DIR PEER_IP PORT
# Env: WIRE_ROUNDS (of "plain", "netem", "delay"; e.g. "plain netem delay"), WIRE_SECONDS
# (client's random write/read time in a plain round), WIRE_NETEM_SECONDS (in the others),
# WIRE_PEER_TIMEOUT (each rdma_wire_peer's total timeout).
# Round "netem": the client guest drops 1% of the packets arriving on its NIC (an ingress
# filter, `gact drop` with probability 1/100), so the rxe retransmission path (NAK / timeout
# and go-back-N) runs on both sides; the rxe retry counters are printed. The loss is on the
# receiving side, as a lossy wire loses packets: the sender's transmit succeeded (`netem
# loss` on the sender's egress, used before, makes rxe's own transmit fail instead, a path a
# real wire never takes; see docs/rdma.md).
# Round "delay": `netem delay 5ms` on the same egress (every packet of the client, ACKs and
# read requests included, 5 ms late: 5 ms more round trip; netem's queue raised to 10000
# packets so the delay line itself drops nothing). Every round prints the client's measured
# 64 B write latency and 1 MiB write rate (rdma_wire_peer's "measure" line). Before the
# rounds the client checks that rdma.min_mtu above the path MTU is refused by name
# (WIRE_MTU_CHECK=0 skips it).
set -u
ROLE=${1:?role}; B=${2:?build dir}; PEER=${3:?peer ip}; PORT=${4:?port}
P=$B/tests/rdma/rdma_wire_peer
T=${WIRE_PEER_TIMEOUT:-100}
export SLUICE_LOG_LEVEL=${SLUICE_LOG_LEVEL:-warn}
echo "guest $ROLE: $(uname -r), $RXE_DEV on $RXE_NETDEV $RXE_IP (RoCE v2 GID index $RXE_GID_INDEX), peer $PEER," \
  "$(ibv_devinfo -d "$RXE_DEV" | grep -E 'state:|active_mtu' | tr -s ' \t' ' ' | tr '\n' ';')"
counters() {  # non-zero rxe counters (retransmissions, NAKs, duplicates)
  local d=/sys/class/infiniband/$RXE_DEV/ports/1/hw_counters f v out=
  for f in "$d"/*; do v=$(cat "$f" 2>/dev/null) || continue; [ "${v:-0}" != 0 ] && out="$out ${f##*/}=$v"; done
  echo "guest $ROLE: $RXE_DEV counters:${out:- (all zero)}"
}
cnt() { cat "/sys/class/infiniband/$RXE_DEV/ports/1/hw_counters/$1" 2>/dev/null || echo 0; }
# RNR NAKs this device sent in a round. A receiver-not-ready NAK for an empty receive queue
# must never happen (the engine's credits keep QP 0's receives posted ahead of every imm and
# control message). SoftRoCE also reports a failed *transmit* of an RDMA READ response as an
# RNR NAK (rxe_resp.c read_reply: rxe_xmit_packet() fails -> RESPST_ERR_RNR), and a transmit
# fails only on the lossy NIC, where it is counted in send_err too. So: 0 RNR NAKs in a plain
# round, and no more RNR NAKs than transmit failures in a lossy one.
check_rnr() {  # round rnr_before err_before
  local rnr=$(( $(cnt send_rnr_err) - $2 )) err=$(( $(cnt send_err) - $3 ))
  if [ "$1" = plain ] && [ $rnr -ne 0 ]; then
    echo "guest $ROLE: FAIL: $rnr RNR NAKs sent in a plain round (receive queue ran empty)"; return 1
  fi
  if [ $rnr -gt $err ]; then
    echo "guest $ROLE: FAIL: $rnr RNR NAKs sent but only $err transmit failures: a receive queue ran empty"; return 1
  fi
  echo "guest $ROLE: RNR NAKs sent this round: $rnr (transmit failures: $err)"
}
rc=0; n=0
# MTU negotiation across the wire: the client's port has active_mtu 1024; a minimum of 2048
# must be refused at connect, naming the minimum and both ports (kUnsupported: exit 2), not
# connect and not hang. Two QPs, so the refusal (on channel 0's reply) leaves the server's
# half-open endpoint unaccepted and round 1's client is the one the server serves.
if [ "$ROLE" = client ] && [ "${WIRE_MTU_CHECK:-1}" != 0 ]; then
  out=$(SLUICE_RDMA_MIN_MTU=2048 SLUICE_CHANNELS=2 "$P" client --connect "$PEER:$PORT" --bind "$RXE_IP" \
        --seconds 0 --timeout 30 2>&1); r=$?
  echo "$out" | grep -m1 "min_mtu" | sed 's/^/guest client: rdma.min_mtu=2048: /'
  if [ $r != 2 ] || ! grep -q "below rdma.min_mtu 2048: ours $RXE_DEV:1 has active_mtu" <<< "$out" \
     || ! grep -q "the peer's [A-Za-z0-9_]*:1 [0-9]" <<< "$out"; then
    echo "guest client: FAIL: rdma.min_mtu=2048 was not refused by name (exit $r)"; echo "$out" | tail -5; exit 1
  fi
fi
for round in ${WIRE_ROUNDS:-plain}; do
  port=$((PORT + n)); n=$((n + 1))
  netem= drop=
  case $round in netem) drop=${WIRE_DROP:-100};; delay) netem="delay 5ms limit 10000";; esac
  if [ -n "$netem" ] && [ "$ROLE" = client ]; then
    modprobe sch_netem && tc qdisc add dev "$RXE_NETDEV" root netem $netem \
      || { echo "guest client: FAIL: cannot add netem $netem on $RXE_NETDEV"; rc=1; break; }
    echo "guest client: $(tc qdisc show dev "$RXE_NETDEV")"
  fi
  if [ -n "$drop" ] && [ "$ROLE" = client ]; then
    { modprobe sch_ingress && modprobe cls_matchall && modprobe act_gact &&
      tc qdisc add dev "$RXE_NETDEV" ingress &&
      tc filter add dev "$RXE_NETDEV" parent ffff: matchall action gact ok random netrand drop "$drop"; } \
      || { echo "guest client: FAIL: cannot drop 1/$drop of the packets arriving on $RXE_NETDEV"; rc=1; break; }
    echo "guest client: dropping 1/$drop of the packets arriving on $RXE_NETDEV (ingress gact, netrand)"
  fi
  rnr0=$(cnt send_rnr_err); err0=$(cnt send_err)
  t0=$(date +%s.%N)
  echo "=== round $n ($round) $ROLE"
  if [ "$ROLE" = server ]; then
    "$P" server --listen "$RXE_IP:$port" --timeout "$T"; r=$?
  else
    secs=${WIRE_SECONDS:-4}; [ "$round" != plain ] && secs=${WIRE_NETEM_SECONDS:-2}
    "$P" client --connect "$PEER:$port" --bind "$RXE_IP" --seconds "$secs" --timeout "$T"; r=$?
  fi
  printf '=== round %d (%s) %s: rc=%d (%.1fs)\n' $n "$round" "$ROLE" $r "$(echo "$(date +%s.%N) - $t0" | bc)"
  # A failed round whose peer no longer answers ping: the emulated wire itself is down (under
  # TCG a guest's virtio transmit queue has stalled for 10 s and more, "NETDEV WATCHDOG" in its
  # kernel log), which no engine can cause or cure; two-guests.sh runs the test again on
  # fresh guests once when it sees this line.
  if [ $r != 0 ] && [ "$ROLE" = client ] && ! ping -c 3 -W 2 "$PEER" >/dev/null 2>&1; then
    echo "guest client: LINK DOWN: $PEER does not answer ping after round $n failed"
  fi
  if [ -n "$netem" ] && [ "$ROLE" = client ]; then
    echo "guest client: $(tc -s qdisc show dev "$RXE_NETDEV" | tr -s ' \n' ' ')"
    tc qdisc del dev "$RXE_NETDEV" root 2>/dev/null
  fi
  if [ -n "$drop" ] && [ "$ROLE" = client ]; then
    echo "guest client: ingress drops: $(tc -s filter show dev "$RXE_NETDEV" parent ffff: | grep -m1 -o "Sent [0-9]* bytes [0-9]* pkt (dropped [0-9]*")"
    tc qdisc del dev "$RXE_NETDEV" ingress 2>/dev/null
  fi
  counters
  check_rnr "$round" "$rnr0" "$err0" || { [ $r = 0 ] && r=1; }
  # The client stops at its first failed round; the server serves every round (two-guests.sh
  # stops its guest once the client is done).
  [ $r = 0 ] || { rc=$r; [ "$ROLE" = client ] && break; }
done
exit $rc
