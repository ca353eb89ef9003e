#!/usr/bin/env bash
# Builds the libFuzzer targets (reusing the build directory) and runs each for a bounded time.
#
#   tests/fuzz/run.sh [SECONDS]        default 60 s per target
#   SLUICE_FUZZ_BUILD=dir              build directory (default build-fuzz at the repo root)
#   SLUICE_FUZZ_TARGETS="fuzz_frames"  a subset
#
# Before fuzzing it checks that docs/wire-protocol.md's header-check examples are what the
# engine's own code computes, and replays tests/fuzz/crashes/<target>/* (inputs that crashed
# once must stay fixed). Inputs the run discovers go to $BUILD/corpus-<target>/ (kept between
# runs, never into the committed seed corpus); a crash leaves its input in
# $BUILD/artifacts/<target>/ (see README.md to reproduce). Exit status: 0 only if nothing
# crashed, leaked, hung or tripped a sanitizer.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SECS=${1:-60}
BUILD=${SLUICE_FUZZ_BUILD:-$ROOT/build-fuzz}
TARGETS=${SLUICE_FUZZ_TARGETS:-fuzz_bootstrap fuzz_frames}
JOBS=${JOBS:-$(nproc)}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/install-deps.sh --tests installs it)" >&2; exit 1; }

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  CC=clang CXX=clang++ cmake -S "$HERE" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" >/dev/null ||  # libFuzzer's usual -O1; -g1: backtraces, half the build
    { echo "fuzz: cmake failed" >&2; exit 1; }
fi
cmake --build "$BUILD" -j "$JOBS" >"$BUILD/build.log" 2>&1 ||
  { tail -30 "$BUILD/build.log"; echo "fuzz: build failed (log: $BUILD/build.log)" >&2; exit 1; }

rc=0
# The document's examples, row by row, must appear in it exactly as the code prints them.
missing=$("$BUILD/wire_vectors" | grep '^|' | while IFS= read -r row; do
  grep -qF -- "$row" "$ROOT/docs/wire-protocol.md" || echo "$row"; done)
if [ -n "$missing" ]; then
  echo "fuzz: docs/wire-protocol.md lacks these header-check examples (from tests/fuzz/wire_vectors.cpp):"
  echo "$missing"
  rc=1
else
  echo "wire_vectors: docs/wire-protocol.md examples match the code"
fi

for t in $TARGETS; do
  bin=$BUILD/$t
  work=$BUILD/corpus-$t
  art=$BUILD/artifacts/$t/
  mkdir -p "$work" "$art"
  # Inputs that crashed once, each on its own (libFuzzer stops at the first crash of a list).
  for c in "$HERE"/crashes/"$t"/*; do
    [ -e "$c" ] || continue
    if ! "$bin" -rss_limit_mb=2048 -timeout=10 "$c" >"$BUILD/$t.replay.log" 2>&1; then
      why=$(grep -m1 -E "SUMMARY|what\(\)|fuzz_frames:" "$BUILD/$t.replay.log")
      echo "$t: FAILED on tests/fuzz/crashes/$t/$(basename "$c"): ${why:-see $BUILD/$t.replay.log}"
      rc=1
    fi
  done
  log=$BUILD/$t.log
  "$bin" -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$art" "$work" "$HERE/corpus/$t" >"$log" 2>&1
  code=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  corp=$(grep -oE 'corp: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+')
  if [ $code -eq 0 ]; then
    echo "$t: ok, ${SECS} s, ${execs:-?} execs, corpus ${corp:-?} inputs"
  else
    grep -E "ERROR|SUMMARY|what\(\)|Test unit written|fuzz_frames:" "$log" | tail -8
    echo "$t: FAILED (exit $code) after ${execs:-?} execs; log $log, input in $art"
    rc=1
  fi
done
exit $rc
