#!/usr/bin/env bash
# Runs INSIDE the SoftRoCE guest (started by bench.sh): sluice-bench over rdma and perftest
# on the same rxe device in the same run, then the ratios. Usage: guest-bench.sh BENCH_BINARY
# [TCG_FOOTPRINT_BINARY]
set -u
BENCH=${1:?sluice-bench binary}
FOOTPRINT=${2:-}
DEV=${RXE_DEV:-rxe0}; GIDX=${RXE_GID_INDEX:-1}; IP=${RXE_IP:-10.0.0.1}
SIZES=${SLUICE_BENCH_SIZES:-"65536 262144 1048576"}  # SLUICE_BENCH_REPS: pairs per size (3)
CH=${SLUICE_BENCH_CHANNELS:-1}  # perftest runs one QP: like for like
export SLUICE_LOG_LEVEL=error
# Engine defaults (SLUICE_RDMA_BUSY_MS etc. pass through when set): waiters poll the CQs
# themselves, so the progress thread does not compete with rdma_rxe for the 2 vCPUs.
T=$(mktemp -d)
echo "SLUICE_RDMA_BUSY_MS=${SLUICE_RDMA_BUSY_MS:-default} channels (bench --channels)=$CH"
echo "guest: $(uname -r); $DEV on $RXE_NETDEV $IP, GID index $GIDX, $(ibv_devinfo -d $DEV | grep -m1 active_mtu | tr -s " \t" " ")"

# perftest: server in the background, client against it; prints the client's report.
perf() {  # tool args...
  local tool=$1; shift
  "$tool" -d "$DEV" -x "$GIDX" -F "$@" > "$T/srv" 2>&1 &
  local spid=$!
  local out=""
  for try in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.3
    if out=$("$tool" -d "$DEV" -x "$GIDX" -F "$@" "$IP" 2>&1); then break; fi
  done
  wait $spid 2>/dev/null
  echo "$out"
}
perf_bw() {  # tool size -> MB/s (10^6 bytes/s)
  perf "$1" -s "$2" -n "${3:-2000}" --report_gbits | awk -v s="$2" '$1==s && NF>=4 {printf "%.1f", $4*1000/8; exit}'
}
perf_lat() {  # tool -> "t_typical t_avg" one-way latency in us (perftest: half the round trip)
  perf "$1" -s 2 -n "${2:-2000}" | awk '$1==2 && NF>=6 {print $5, $6; exit}'
}
perf_op_us() {  # ib_write_bw -s 2 -t 1: one write at a time -> us per write completion
  perf ib_write_bw -s 2 -t 1 -n "${1:-5000}" | awk '$1==2 && NF>=5 && $5+0 > 0 {printf "%.2f", 1/$5; exit}'
}
sluice_bw() {  # op size -> MB/s
  "$BENCH" --transport rdma --listen "$IP:0" --op "$1" --size "$2" --batch-size 8 --concurrency 8 \
    --channels "$CH" --iterations "${3:-40}" --csv --quiet 2>"$T/err" | awk -F, 'NR>1 {print $7; exit}'
}
sluice_lat() {  # -> average completion latency of a 2-byte write in us (a full round trip)
  "$BENCH" --transport rdma --listen "$IP:0" --op write --size 2 --batch-size 1 --concurrency 1 \
    --channels "$CH" --iterations "${1:-2000}" --csv --quiet 2>"$T/err" | awk -F, 'NR>1 {printf "%.1f", $6*1000; exit}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b+0 > 0 && a != "") printf "%.2f", a/b; else printf "n/a" }'; }

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}'; }
# Each size: REPS interleaved pairs (perftest, then sluice-bench); the table shows the median
# of each and the median of the pairs' ratios (single runs here vary by +-8%, perftest too).
REPS=${SLUICE_BENCH_REPS:-3}
printf '\n%-22s %10s %14s %16s %8s   %s\n' "op" "size" "sluice MB/s" "perftest MB/s" "ratio" "ratio of each pair"
for op in write read; do
  tool=ib_${op}_bw
  for s in $SIZES; do
    it=$(( 8 * 1024 * 1024 * 64 / s )); [ $it -gt 4000 ] && it=4000
    ps=""; bs=""; rs=""
    for rep in $(seq "$REPS"); do
      p=$(perf_bw "$tool" "$s" "$it")
      b=$(sluice_bw "$op" "$s" 80)
      [ -n "$b" ] || { echo "sluice-bench failed:"; cat "$T/err"; }
      ps="$ps $p"; bs="$bs $b"; rs="$rs $(ratio "$b" "$p")"
    done
    pm=$(echo $ps | median); bm=$(echo $bs | median); rm_=$(echo $rs | tr ' ' '\n' | grep -v n/a | median)
    printf '%-22s %10s %14s %16s %8s  %s\n' "$op ($tool)" "$s" "${bm:-FAIL}" "${pm:-FAIL}" "${rm_:-n/a}" "$rs"
  done
done
sluice_pingpong() {  # notify iterations -> half round trip of a 2-byte ping-pong in us
  "$BENCH" --transport rdma --listen "$IP:0" --op pingpong --notify "$1" --min-size 2 --max-size 2 \
    --channels "$CH" --iterations "${2:-2000}" --csv --quiet 2>"$T/err" | awk -F, 'NR>1 {printf "%.2f", $6*1000; exit}'
}
# REPS interleaved rounds of ib_write_lat and both ping-pongs; medians.
pas=""; pts=""; sps=""; sis=""
for rep in $(seq "$REPS"); do
  set -- $(perf_lat ib_write_lat 2000); pts="$pts ${1:-}"; pas="$pas ${2:-}"
  v=$(sluice_pingpong flag 2000); [ -n "$v" ] || { echo "sluice-bench pingpong (flag) failed:"; cat "$T/err"; }; sps="$sps $v"
  v=$(sluice_pingpong imm 2000); [ -n "$v" ] || { echo "sluice-bench pingpong (imm) failed:"; cat "$T/err"; }; sis="$sis $v"
done
pa=$(echo $pas | median); pt=$(echo $pts | median); sp=$(echo $sps | median); si=$(echo $sis | median)
echo "rounds: ib_write_lat t_avg:$pas | flag:$sps | imm:$sis"
po=$(perf_op_us 5000)
sl=$(sluice_lat 2000)
[ -n "$sl" ] || { echo "sluice-bench failed:"; cat "$T/err"; }
printf '\n%-60s %10s\n' "2-byte write latency" "us"
printf '%-60s %10s\n' "ib_write_lat, half round trip (t_avg, median)" "${pa:-FAIL}"
printf '%-60s %10s\n' "ib_write_lat t_typical" "${pt:-FAIL}"
printf '%-60s %10s\n' "sluice pingpong --notify flag (ib_write_lat's loop), median" "${sp:-FAIL}"
printf '%-60s %10s\n' "ratio flag pingpong / ib_write_lat (medians; bar 1.1)" "$(ratio "$sp" "$pa")"
printf '%-60s %10s\n' "sluice pingpong --notify imm (write_with_imm + imm_recv)" "${si:-FAIL}"
printf '%-60s %10s\n' "ratio imm pingpong / ib_write_lat" "$(ratio "$si" "$pa")"
printf '%-60s %10s\n' "sluice write completion, batch 1 (mean)" "${sl:-FAIL}"
printf '%-60s %10s\n' "ib_write_bw -t 1: one write to completion (mean)" "${po:-FAIL}"
printf '%-60s %10s\n' "ratio sluice / perftest (write to completion)" "$(ratio "$sl" "$po")"
if [ -n "$FOOTPRINT" ] && [ -x "$FOOTPRINT" ]; then
  echo
  echo "TCG footprint (raw verbs, no engine): user code run between two posts, then one 2-byte"
  echo "inline write posted and polled; 'distinct' runs that many different functions, 'same'"
  echo "one function that many times (docs/rdma.md, Latency under emulation)"
  "$FOOTPRINT" 3000 || echo "tcg_footprint failed"
fi
rm -rf "$T"
[ -n "$sl" ] && [ -n "$sp" ] && [ -n "$si" ]
