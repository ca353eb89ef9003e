#!/usr/bin/env bash
# Interleaved A/B (or A/B/C/...) of sluice-bench binaries (say, the previous commit's and this
# one's): ROUNDS rounds, each running every binary in turn on the same work; prints per-size
# medians with the spread (min-max) and each binary's ratio to the first, for bandwidth and for
# latency (us).
#   scripts/ab-bench.sh BIN_A BIN_B [BIN_C ...] [ROUNDS] -- <sluice-bench args>
# e.g. scripts/ab-bench.sh /tmp/old/sluice-bench build/tools/sluice-bench/sluice-bench 3 -- \
#        --transport shm --op write --min-size 64K --max-size 16M --batch-size 64 --concurrency 8
# A binary may be given as NAME=PATH to name its column. A binary linked against a library in
# its own directory finds it there first (LD_LIBRARY_PATH=its directory), so copies of several
# builds can be compared side by side on another machine.
set -euo pipefail
bins=(); ROUNDS=3
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  if [[ "$1" =~ ^[0-9]+$ ]]; then ROUNDS=$1; else bins+=("$1"); fi
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#bins[@]} -ge 2 ] || { echo "usage: $0 BIN_A BIN_B [BIN ...] [ROUNDS] -- <sluice-bench args>" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
names=()
for i in "${!bins[@]}"; do
  b=${bins[$i]}
  if [[ "$b" == *=* ]]; then names+=("${b%%=*}"); bins[$i]=${b#*=}; else names+=("$(printf "\\x$(printf %x $((65 + i)))")"); fi
done
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  for i in "${!bins[@]}"; do
    LD_LIBRARY_PATH="$(dirname "${bins[$i]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "${bins[$i]}" "$@" --quiet --csv > "$tmp/$i-$r.csv"
  done
done
python3 - "$tmp" "$ROUNDS" "${names[@]}" <<'PYEOF'
import csv, statistics, sys
d, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(i, col):
    out = {}
    for r in range(1, rounds + 1):
        for row in csv.DictReader(open(f"{d}/{i}-{r}.csv")):
            out.setdefault(int(row["message_size"]), []).append(float(row[col]))
    return out
for col, unit, scale in (("bandwidth_mbps", "MB/s", 1.0), ("avg_latency_ms", "us", 1000.0)):
    data = [load(i, col) for i in range(len(names))]
    print(f"\n{unit} (median, min-max; {rounds} rounds)\n")
    print("| size | " + " | ".join(f"{n} {unit}" for n in names) + " | " + " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for size in sorted(data[0]):
        med = [statistics.median(x[size]) * scale for x in data]
        cells = [f"{m:,.1f} ({min(x[size]) * scale:,.1f}-{max(x[size]) * scale:,.1f})" for m, x in zip(med, data)]
        human = f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB" if size >= 1 << 10 else f"{size}B"
        print(f"| {human} | " + " | ".join(cells) + " | " + " | ".join(f"{m / med[0]:.2f}" for m in med[1:]) + " |")
PYEOF
