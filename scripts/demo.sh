#!/usr/bin/env bash
# Builds Sluice and runs sluice-bench on loopback with the best transport available
# (the engine picks it; on one host that is shm), with the ceiling measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSLUICE_BUILD_TESTS=OFF >/dev/null
ninja -C build sluice-bench >/dev/null
exec build/tools/sluice-bench/sluice-bench --min-size 4K --max-size 16M --baseline "$@"
