#!/usr/bin/env bash
# Build, install and test the sluice Python package from a clean clone.
#
#   python/run_tests.sh              venv in .venv-test, pip install ., pytest, examples
#   SLUICE_VENV=/tmp/v python/run_tests.sh
#   SLUICE_SKIP_TORCH=1 ...          do not install torch (its tests skip)
#   SLUICE_SKIP_MOONCAKE=1 ...       do not install Mooncake's wheel (the compat tests' Mooncake half skips)
#   SLUICE_SKIP_EXAMPLES=1 ...       pytest only
#   extra arguments go to pytest, e.g. python/run_tests.sh -k async
#
# Needs python3 (>= 3.8) with pip, a C++20 compiler and the Python headers; CMake and Ninja
# come from PyPI if the system has none. On Debian/Ubuntu the headers and venv support are
# the python3-dev and python3-venv packages; the script installs them with apt-get when it
# runs as root and they are missing (set SLUICE_NO_APT=1 to forbid that).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SLUICE_VENV:-$ROOT/.venv-test}
PY=${PYTHON:-python3}
cd "$ROOT"

say() { printf '\n=== %s\n' "$*"; }

have_headers() {
  "$PY" - <<'PYEOF'
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PYEOF
}

if ! have_headers; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -z "${SLUICE_NO_APT:-}" ]; then
    say "Python headers missing: apt-get install python3-dev python3-venv"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-dev python3-venv >/dev/null
  fi
  if ! have_headers; then
    echo "run_tests.sh: Python.h not found for $("$PY" -c 'import sys; print(sys.executable)');" \
         "install the Python development headers (Debian/Ubuntu: apt-get install python3-dev)" >&2
    exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    # Debian without python3-venv: no ensurepip. Make the venv bare and let the system pip
    # install pip into it.
    rm -rf "$VENV"
    "$PY" -m venv --without-pip "$VENV"
    "$PY" -m pip --python "$VENV/bin/python" install -q pip
  fi
fi
VPY="$VENV/bin/python"

say "installing test dependencies"
"$VPY" -m pip install -q --disable-pip-version-check pytest pytest-timeout numpy
if [ -z "${SLUICE_SKIP_TORCH:-}" ]; then
  "$VPY" -c 'import torch' 2>/dev/null || "$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0 ||
    echo "run_tests.sh: torch==2.13.0 could not be installed; the torch tests will skip" >&2
fi

# Mooncake's own engine: python/tests/compat runs each test against it and against the Sluice
# facade (sluice.compat.mooncake); without it that half skips, saying why.
if [ -z "${SLUICE_SKIP_MOONCAKE:-}" ]; then
  env -u SLUICE_MOONCAKE_COMPAT "$VPY" -c 'import mooncake.engine' 2>/dev/null ||
    "$VPY" -m pip install -q --disable-pip-version-check mooncake-transfer-engine-non-cuda==0.3.13.post1 ||
    echo "run_tests.sh: mooncake-transfer-engine-non-cuda could not be installed; the compat tests run against the facade only" >&2
fi

# SLUICE_WHEEL_BUILD_DIR=DIR: build the wheel in an existing CMake build tree (scripts/test.sh
# passes its ctest build): with the same build type and flags, only the Python targets compile
# and the library relinks, instead of a second compile of every source (CUDA's included) in
# build-wheel/. Tests and tools stay on in that tree, as the later suites reuse them.
SKB=()
if [ -n "${SLUICE_WHEEL_BUILD_DIR:-}" ] && [ -f "$SLUICE_WHEEL_BUILD_DIR/CMakeCache.txt" ]; then
  bt=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$SLUICE_WHEEL_BUILD_DIR/CMakeCache.txt")
  fl=$(sed -n "s/^CMAKE_CXX_FLAGS_$(echo "${bt:-RelWithDebInfo}" | tr a-z A-Z):STRING=//p" "$SLUICE_WHEEL_BUILD_DIR/CMakeCache.txt")
  SKB=(-C "build-dir=$SLUICE_WHEEL_BUILD_DIR" -C "cmake.build-type=${bt:-RelWithDebInfo}"
       -C "cmake.define.CMAKE_CXX_FLAGS_$(echo "${bt:-RelWithDebInfo}" | tr a-z A-Z)=$fl"
       -C cmake.define.SLUICE_BUILD_TESTS=ON -C cmake.define.SLUICE_BUILD_TOOLS=ON)
  say "pip install . (scikit-build-core + CMake; reusing the build tree $SLUICE_WHEEL_BUILD_DIR)"
else
  say "pip install . (scikit-build-core + CMake; build tree in build-wheel/)"
fi
if "$VPY" -c 'import torch' 2>/dev/null; then
  # sluice.torch (the torch.distributed backend) builds against the venv's torch, which pip's
  # isolated build environment cannot see: build without isolation, with the build
  # requirements in the venv, and require the backend's tests to run rather than skip.
  say "torch found: building sluice.torch too (pip install --no-build-isolation .)"
  "$VPY" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.8" "pybind11>=2.11"
  { command -v cmake && command -v ninja; } >/dev/null ||
    { "$VPY" -m pip install -q --disable-pip-version-check cmake ninja; PATH=$VENV/bin:$PATH; }
  torch_t0=$SECONDS
  SKBUILD_CMAKE_DEFINE="SLUICE_TORCH_PYTHON=$VPY" "$VPY" -m pip install -q --disable-pip-version-check \
    --no-build-isolation "${SKB[@]}" "$ROOT"
  echo "pip install with sluice.torch: $((SECONDS - torch_t0)) s"
  export SLUICE_REQUIRE_TORCH_BACKEND=1
else
  "$VPY" -m pip install -q --disable-pip-version-check "${SKB[@]}" "$ROOT"
fi

say "version and C++ package in the wheel"
"$VPY" - <<'PYEOF'
import importlib.metadata, os, sluice
assert importlib.metadata.version("sluice") == sluice.__version__, (importlib.metadata.version("sluice"), sluice.__version__)
assert os.path.isfile(os.path.join(sluice.get_include(), "sluice", "sluice.hpp")), sluice.get_include()
print(f"sluice {sluice.__version__}: headers in {sluice.get_include()}")
PYEOF
# An out-of-tree C++ project that does find_package(sluice) against the installed wheel.
command -v cmake >/dev/null || { "$VPY" -m pip install -q --disable-pip-version-check cmake ninja; PATH=$VENV/bin:$PATH; }
"$ROOT/tests/consumer/run.sh" --prefix "$("$VPY" -c 'import sluice; print(sluice.cmake_prefix_path())')" \
  "$ROOT/build-wheel/consumer"

# Run from a directory without a 'sluice' folder so that the installed package is tested.
say "pytest"
"$VPY" -m pytest "$ROOT/python/tests" -q --timeout=120 --durations=15 -p no:cacheprovider --rootdir "$ROOT" "$@"

if [ -z "${SLUICE_SKIP_EXAMPLES:-}" ]; then
  say "examples"
  failed=0
  # Each example as it is, then the ones whose options take another path.
  runs=("$ROOT"/examples/python/*.py "$ROOT/examples/python/weight_update.py --relay"
        "$ROOT/examples/python/weight_update.py --push")
  for run in "${runs[@]}"; do
    read -r -a cmd <<<"$run"
    if timeout 120 "$VPY" "${cmd[@]}" >/tmp/sluice-example.$$.log 2>&1; then
      echo "ok    $(basename "${cmd[0]}") ${cmd[*]:1}"
    else
      echo "FAIL  $(basename "${cmd[0]}") ${cmd[*]:1}"
      cat /tmp/sluice-example.$$.log
      failed=1
    fi
  done
  rm -f /tmp/sluice-example.$$.log
  [ "$failed" = 0 ] || exit 1
fi
say "all Python tests passed"
