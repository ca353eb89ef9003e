#!/usr/bin/env bash
# Reproduces the performance tables of docs/performance.md: every run measures its ceiling in
# the same run (--baseline). Setup from the core issue: loopback, batch 64, concurrency 8.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-build/tools/sluice-bench/sluice-bench}
[ -x "$B" ] || { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSLUICE_BUILD_TESTS=OFF >/dev/null; ninja -C build sluice-bench >/dev/null; }
common=(--batch-size 64 --concurrency 8 --baseline --quiet)
echo "## tcp write";            "$B" --transport tcp --op write --min-size 64K --max-size 64M "${common[@]}"
echo "## tcp read";             "$B" --transport tcp --op read  --min-size 64K --max-size 64M "${common[@]}"
echo "## shm write (process_vm_writev)"; "$B" --transport shm --op write --min-size 64K --max-size 64M "${common[@]}"
echo "## shm read (process_vm_readv)";   "$B" --transport shm --op read  --min-size 64K --max-size 64M "${common[@]}"
echo "## shm write, engine-allocated memory (vs memcpy)"; "$B" --transport shm --memfd --op write --min-size 64K --max-size 64M "${common[@]}"
echo "## tcp latency, 8 B write, batch 1, concurrency 1"
for i in 1 2 3; do "$B" --transport tcp --op write --size 8 --batch-size 1 --concurrency 1 --iterations 20000 --baseline --quiet | tail -1; done
echo "## small messages, tcp and shm"
"$B" --transport tcp --op write --min-size 8 --max-size 4K --quiet
"$B" --transport shm --op write --min-size 8 --max-size 4K --quiet
