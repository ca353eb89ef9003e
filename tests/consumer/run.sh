#!/usr/bin/env bash
# Builds and runs tests/consumer against an installed Sluice.
#
#   tests/consumer/run.sh --install BUILD_DIR WORK_DIR   cmake --install BUILD_DIR (components
#                                                        runtime and dev) into WORK_DIR/prefix,
#                                                        check its exported symbols, then build
#   tests/consumer/run.sh --prefix PREFIX WORK_DIR       build against PREFIX as it is (the
#                                                        wheel: sluice.cmake_prefix_path())
# The consumer is built in WORK_DIR/build and run; exit status 0 only if everything passed.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=${1:?usage: run.sh --install BUILD_DIR WORK_DIR | --prefix PREFIX WORK_DIR}
src=${2:?}
work=${3:?}
rm -rf "$work" && mkdir -p "$work"

if [ "$mode" = --install ]; then
  prefix=$work/prefix
  for c in runtime dev; do cmake --install "$src" --prefix "$prefix" --component "$c" >/dev/null; done
  lib=$(ls "$prefix"/lib*/libsluice.so)
  # Hidden visibility: the public API is exported, nothing vendored and nothing internal.
  syms=$(nm -D --defined-only -C "$lib")
  leaked=$(grep -E 'nlohmann|sluice::detail' <<<"$syms" || true)
  if [ -n "$leaked" ]; then
    echo "consumer: $lib exports internal symbols:"; head -20 <<<"$leaked"; exit 1
  fi
  grep -q 'sluice::Engine::Engine' <<<"$syms" || { echo "consumer: $lib does not export sluice::Engine"; exit 1; }
  grep -q 'typeinfo for sluice::Error' <<<"$syms" || { echo "consumer: $lib does not export sluice::Error's type info"; exit 1; }
elif [ "$mode" = --prefix ]; then
  prefix=$src
else
  echo "run.sh: unknown mode $mode" >&2; exit 2
fi

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$HERE" -B "$work/build" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; echo "consumer: configure against $prefix failed"; exit 1; }
grep 'sluice_consumer: sluice' "$work/configure.log" || true
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; echo "consumer: build failed"; exit 1; }
"$work/build/sluice_consumer"
