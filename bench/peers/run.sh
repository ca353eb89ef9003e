#!/usr/bin/env bash
# Sluice and its peers side by side on the same work (issue 16); see docs/peers.md.
#
#   bench/peers/run.sh [--quick] [driver options]     (python3 bench/peers/driver.py --help)
#
# Installs what it needs: a virtual environment in bench/peers/.venv with the peers from PyPI
# (mooncake-transfer-engine-non-cuda, nixl, dlslime, torch for gloo, matplotlib) and the
# sluice wheel built from this checkout; Open MPI with apt-get when it is missing and this
# runs as root (PEERS_NO_APT=1 forbids that; MPI rows then say why). Results go to
# bench/peers/results/ (every sample as CSV and JSON, peers.md, plots). A full run
# (without --quick, and without a subset: --only, --sizes, --ops, --shapes, --out) that
# succeeded also rewrites docs/peers.md, the peers section of docs/performance.md and
# docs/img/peers-*.png unless --no-docs. PEERS_SKIP_WHEEL=1 reuses the sluice already in the
# venv (a re-run of the same checkout without the wheel build).
# The rdma section runs in the same invocation, after the host sections: the driver boots one
# SoftRoCE guest (tests/rdma/rxe-guest.sh, QEMU; it installs qemu and the kernel with apt when
# missing and root) and runs itself in it on Sluice rdma, Mooncake rdma, NIXL/UCX rc, DLSlime
# rdma and perftest (--quick: Sluice and perftest only; --no-guest leaves it out; a guest that
# cannot boot turns those rows into its reason). Its own options: driver.py --help.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${PEERS_VENV:-$HERE/.venv}
PY=${PYTHON:-python3}
say() { printf '=== %s\n' "$*"; }

quick=0; docs=1; args=()
for a in "$@"; do
  case "$a" in
    --quick) quick=1; args+=("$a") ;;
    --no-docs) docs=0 ;;
    # Only a full run rewrites the docs: a subset (or help) would replace the tables with part of them.
    -h|--help|--only|--only=*|--sizes|--sizes=*|--ops|--ops=*|--shapes|--shapes=*|--out|--out=*|\
    --rdma-sizes|--rdma-sizes=*|--rdma-shapes|--rdma-shapes=*|--no-guest) docs=0; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -z "${PEERS_NO_APT:-}" ]; then
    say "Open MPI missing: apt-get install openmpi-bin libopenmpi-dev"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev >/dev/null; } || echo "run.sh: Open MPI could not be installed; its rows will say so" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v 'is ignored: it is neither' || true; }
# Pinned as python/run_tests.sh pins them (pip's cache serves both): torch==2.13.0 resolves to
# the CPU wheel where one is offered beside PyPI's CUDA build (gloo needs no CUDA, and the CUDA
# build pulls in gigabytes of nvidia-* wheels).
if ! "$VPY" -c 'import numpy, matplotlib, torch, nixl, dlslime, mooncake.engine' 2>/dev/null; then
  say "installing the peers into $VENV"
  pip_q numpy matplotlib torch==2.13.0 nixl==1.5.1 dlslime==0.1.23 mooncake-transfer-engine-non-cuda==0.3.13.post1
fi

# The sluice wheel from this checkout. scikit-build-core builds in build-wheel/, as
# python/run_tests.sh does with the same settings, so after that suite this is a relink.
if [ -n "${PEERS_SKIP_WHEEL:-}" ] && "$VPY" -c 'import sluice' 2>/dev/null; then
  say "PEERS_SKIP_WHEEL: using the sluice already in $VENV (not rebuilt from this checkout)"
else
  say "pip install . (the sluice wheel from this checkout)"
  # Not through pip_q: a wheel that does not build must stop the run, not measure an old one.
  "$VPY" -m pip install -q --disable-pip-version-check "$ROOT"
fi
"$VPY" -c 'import sluice; print("sluice", sluice.__version__)'

say "building the native programs (ceilings, Open MPI adapter, Sluice's C++ adapter)"
mkdir -p "$HERE/.build"
cc -O2 -pthread -o "$HERE/.build/ceilings" "$HERE/native/ceilings.c"
# Against the headers and library the wheel ships (sluice/include, sluice/libsluice.so).
SLUICE_PKG=$("$VPY" -c 'import os, sluice; print(os.path.dirname(sluice.__file__))')
rm -f "$HERE/.build/sluice_peer"
c++ -O2 -std=c++20 -pthread -I"$SLUICE_PKG/include" -o "$HERE/.build/sluice_peer" "$HERE/native/sluice_peer.cpp" \
  -L"$SLUICE_PKG" -lsluice -Wl,-rpath,"$SLUICE_PKG" || echo "run.sh: the C++ adapter did not build; its rows will say so" >&2
if command -v mpicc >/dev/null; then
  mpicc -O2 -o "$HERE/.build/mpi_peer" "$HERE/native/mpi_peer.c"
fi

say "running (python driver.py ${args[*]:-})"
rc=0
"$VPY" "$HERE/driver.py" "${args[@]}" || rc=$?
if [ "$quick" = 0 ] && [ "$docs" = 1 ] && [ "$rc" = 0 ]; then
  "$VPY" "$HERE/report.py" "$HERE/results" --md "$HERE/results/peers-docs.md" --img "$ROOT/docs/img" --img-prefix img/ \
    --summary "$HERE/results/performance-docs.md"
  "$VPY" "$HERE/docs_section.py" "$HERE/results/peers-docs.md" "$ROOT/docs/peers.md"
  "$VPY" "$HERE/docs_section.py" "$HERE/results/performance-docs.md" "$ROOT/docs/performance.md" peers-summary
  say "docs/peers.md, docs/performance.md's peers section and docs/img/peers-*.png rewritten"
fi
exit $rc
