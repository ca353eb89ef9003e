#!/usr/bin/env bash
# Interleaved A/B of two sluice-bench binaries (say, the previous commit's and this one's):
# ROUNDS rounds, each running A then B on the same work; prints per-size medians, the spread
# (min-max) and the B/A ratio of the medians.
#   scripts/ab-bench.sh OLD/sluice-bench NEW/sluice-bench [ROUNDS] -- <sluice-bench args>
# e.g. scripts/ab-bench.sh /tmp/old/sluice-bench build/tools/sluice-bench/sluice-bench 3 -- \
#        --transport shm --op write --min-size 64K --max-size 16M --batch-size 64 --concurrency 8
set -euo pipefail
A=$1; B=$2; ROUNDS=${3:-3}
shift 3 || true
[ "${1:-}" = "--" ] && shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  "$A" "$@" --quiet --csv > "$tmp/a$r.csv"
  "$B" "$@" --quiet --csv > "$tmp/b$r.csv"
done
python3 - "$tmp" "$ROUNDS" <<'EOF'
import csv, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def load(side):
    out = {}
    for r in range(1, rounds + 1):
        for row in csv.DictReader(open(f"{d}/{side}{r}.csv")):
            out.setdefault(int(row["message_size"]), []).append(float(row["bandwidth_mbps"]))
    return out
a, b = load("a"), load("b")
print("| size | A median MB/s (min-max) | B median MB/s (min-max) | B/A |")
print("|---|---|---|---|")
for size in sorted(a):
    ma, mb = statistics.median(a[size]), statistics.median(b[size])
    human = f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB" if size >= 1 << 10 else f"{size}B"
    print(f"| {human} | {ma:,.0f} ({min(a[size]):,.0f}-{max(a[size]):,.0f}) | {mb:,.0f} ({min(b[size]):,.0f}-{max(b[size]):,.0f}) | {mb / ma:.2f} |")
EOF
