#!/usr/bin/env bash
# Issue 15 part 1 acceptance: checkpoint-engine 0.4.2 from PyPI, unmodified, runs its own
# tests/test_update.py (ParameterServer, register_checkpoint, gather_metas, a checker process
# with update_weights_from_ipc; update() with ranks=[] (NCCL broadcast) and with rank subsets
# (P2P: batch_transfer_sync_read through mooncake.engine), the remote-error case and the files
# case) under torchrun on every GPU of this host (>= 2), with SLUICE_MOONCAKE_COMPAT=1 and NO
# Mooncake installed, so that the Sluice facade is the only mooncake.engine there is.
#
#   tests/compat/run_checkpoint_engine.sh fetch DIR   # on a host with PyPI: wheels + sdist into DIR
#   tests/compat/run_checkpoint_engine.sh run [DIR]   # on the GPU host; DIR = that wheelhouse (offline)
#   tests/compat/run_checkpoint_engine.sh bench [DIR] [ARGS...]
#       the same venv, then issue 15's comparison under torchrun on every GPU (>= 1):
#       tools/sluice-weights-bench/vs_checkpoint_engine.py ARGS (checkpoint-engine broadcast,
#       checkpoint-engine P2P on the facade, sluice.weights, the pinned H2D ceiling)
#
# `run` makes a venv (.venv-ce, --system-site-packages so that the host's torch and CUDA serve),
# installs sluice (from DIR, else built here with CUDA: needs nvcc), checkpoint-engine and its
# dependencies, refuses to go on if a real mooncake.engine is importable, and runs
# `pytest -m gpu tests/test_update.py` in the extracted sdist. P2P updates need a P2P store, and
# checkpoint-engine only has one if `from mooncake.engine import TransferEngine` worked, so a
# pass means the facade served every P2P read.
#
# No RDMA NIC is needed: PS_P2P_STORE_RDMA_DEVICES (default sl0..sl{N-1}, one distinct name per
# GPU, so that every GPU is its own P2P receiver) stands in for checkpoint-engine's ibverbs
# device scan, and the facade treats the device names as hints (shm between the ranks here).
#
# STATUS: written without a GPU (CPU CI); the lead's 2xH200 run is its first. Env knobs:
#   PYTHON (python3), CE_VENV ($ROOT/.venv-ce), CE_VERSION (0.4.2), CE_TIMEOUT (1800 s per test),
#   TARGET_PY (fetch: the GPU host's Python version, e.g. 3.12, when it differs from ours).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
CE_VERSION=${CE_VERSION:-0.4.2}
DEPS=(fastapi "pydantic>=2" safetensors pyzmq uvicorn loguru numpy httpx pytest pytest-timeout)
say() { printf '\n=== %s\n' "$*"; }
die() { echo "run_checkpoint_engine.sh: $*" >&2; exit 1; }

fetch() {
  local dir=$1
  mkdir -p "$dir"
  say "checkpoint-engine $CE_VERSION (wheel and sdist) and its dependencies into $dir (torch excluded)"
  "$PY" -m pip download -q -d "$dir" --no-deps "checkpoint-engine==$CE_VERSION"
  "$PY" -m pip download -q -d "$dir" --no-deps --no-binary :all: "checkpoint-engine==$CE_VERSION"
  # The GPU host's Python may differ from ours (3.12 on the lent H200 machines): TARGET_PY=3.12
  # fetches binary wheels for it instead.
  local target=()
  [ -z "${TARGET_PY:-}" ] || target=(--python-version "$TARGET_PY" --only-binary :all: --platform manylinux2014_x86_64
                                     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
  "$PY" -m pip download -q -d "$dir" "${target[@]}" "${DEPS[@]}"
  if [ -n "${TARGET_PY:-}" ]; then
    say "no sluice wheel: ours would be for this Python, not $TARGET_PY (build it on the GPU host: gpu-matrix.sh wheel)"
  else
    say "sluice wheel (CUDA support needs nvcc on this host)"
    CMAKE_ARGS="${CMAKE_ARGS:-} -DSLUICE_WITH_CUDA=ON" "$PY" -m pip wheel -q -w "$dir" --no-deps "$ROOT"
  fi
  ls -1 "$dir"
}

# setup WH MIN_GPUS: the venv with sluice, checkpoint-engine and its dependencies, no Mooncake;
# sets vpy, venv, ngpu.
setup() {
  local wh=$1 min_gpus=$2
  venv=${CE_VENV:-$ROOT/.venv-ce}
  [ -z "$wh" ] || [ -d "$wh" ] || die "wheelhouse $wh is not a directory"
  say "venv $venv (with the system's site-packages, for torch)"
  [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv"
  vpy=$venv/bin/python
  # A PYTHON that is itself a venv's (the GPU image's torch lives in one) lends the new venv
  # only the base interpreter's site-packages: name its own in a .pth file too.
  "$PY" -c 'import site, sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' &&
    "$PY" -c 'import site; print("".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))' \
      >"$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_parent_venv.pth"
  pipi() {
    if [ -n "$wh" ]; then "$vpy" -m pip install -q --disable-pip-version-check --no-index --find-links "$wh" "$@"
    else "$vpy" -m pip install -q --disable-pip-version-check "$@"; fi
  }
  ngpu=$("$vpy" -c 'import torch; print(torch.cuda.device_count())') || die "torch is not importable here"
  [ "$ngpu" -ge "$min_gpus" ] || die "this needs >= $min_gpus GPUs, torch sees $ngpu"

  say "sluice"
  if [ -n "$wh" ] && ls "$wh"/sluice-*.whl >/dev/null 2>&1; then
    pipi --force-reinstall --no-deps "$wh"/sluice-*.whl
  elif (cd / && "$vpy" -c 'import sluice') 2>/dev/null; then
    echo "sluice: the one $PY already has ($(cd / && "$vpy" -c 'import sluice; print(sluice.__file__)'))"
  else
    command -v nvcc >/dev/null || echo "run_checkpoint_engine.sh: no nvcc: sluice builds without CUDA and cannot register the GPU bucket" >&2
    CMAKE_ARGS="${CMAKE_ARGS:-} -DSLUICE_WITH_CUDA=ON" "$vpy" -m pip install -q --disable-pip-version-check "$ROOT"
  fi
  env -u SLUICE_MOONCAKE_COMPAT "$vpy" - <<'PYEOF' || die "this sluice cannot register CUDA memory (build it with nvcc on PATH)"
import torch, sluice
e = sluice.Engine()
t = torch.zeros(1 << 20, device="cuda")
e.unregister(e.register(t))
e.close()
print(f"sluice {sluice.__version__}: CUDA registration works; transports {sluice.Engine().transports}")
PYEOF

  say "checkpoint-engine $CE_VERSION (no [p2p] extra: no Mooncake)"
  pipi "checkpoint-engine==$CE_VERSION" "${DEPS[@]}"
  if env -u SLUICE_MOONCAKE_COMPAT "$vpy" -c 'import mooncake.engine' 2>/dev/null; then
    die "a real mooncake.engine is importable in $venv (from the system site-packages?); uninstall it: the run must show the facade alone"
  fi

  SLUICE_MOONCAKE_COMPAT=1 "$vpy" -c 'from mooncake.engine import TransferEngine; import sluice.compat.mooncake as m; assert TransferEngine is m.TransferEngine' ||
    die "SLUICE_MOONCAKE_COMPAT=1 does not make mooncake.engine the Sluice facade in $venv (is the import hook's .pth installed?)"
}

# One distinct device name per GPU (so that every GPU is its own P2P receiver) unless set.
p2p_devices() { echo "${PS_P2P_STORE_RDMA_DEVICES:-$(seq -s, -f 'sl%g' 0 $((ngpu - 1)))}"; }

run() {
  local wh=${1:-} vpy venv ngpu
  setup "$wh" 2  # checkpoint-engine's test_update needs two GPUs

  say "test_update.py from the checkpoint-engine $CE_VERSION sdist"
  local work sdist
  work=$(mktemp -d /tmp/ce-acceptance.XXXXXX)
  if [ -n "$wh" ]; then
    sdist=$(ls "$wh"/checkpoint_engine-"$CE_VERSION".tar.gz "$wh"/checkpoint-engine-"$CE_VERSION".tar.gz 2>/dev/null | head -1 || true)
  else
    "$vpy" -m pip download -q -d "$work" --no-deps --no-binary :all: "checkpoint-engine==$CE_VERSION"
    sdist=$(ls "$work"/checkpoint*engine-"$CE_VERSION".tar.gz | head -1)
  fi
  [ -n "$sdist" ] || die "no checkpoint-engine $CE_VERSION sdist (run 'fetch' first)"
  tar -xzf "$sdist" -C "$work"
  local src
  src=$(ls -d "$work"/checkpoint*engine-"$CE_VERSION" | head -1)
  [ -f "$src/tests/test_update.py" ] || die "$sdist has no tests/test_update.py"
  # The test starts `torchrun`; it must be this venv's Python (the system's lacks sluice).
  printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$vpy" >"$venv/bin/torchrun"
  chmod +x "$venv/bin/torchrun"

  local devices
  devices=$(p2p_devices)
  say "pytest -m gpu tests/test_update.py: SLUICE_MOONCAKE_COMPAT=1 PS_P2P_STORE_RDMA_DEVICES=$devices"
  # Uninstalled checkpoint_engine must not shadow the installed one: run from the sdist root
  # (test_update runs torchrun there) with the package dir moved aside.
  mv "$src/checkpoint_engine" "$src/checkpoint_engine.sdist"
  cd "$src"
  PATH="$venv/bin:$PATH" SLUICE_MOONCAKE_COMPAT=1 PS_P2P_STORE_RDMA_DEVICES="$devices" \
    "$vpy" -m pytest -v -m gpu tests/test_update.py -p no:cacheprovider --timeout="${CE_TIMEOUT:-1800}" -s
  say "checkpoint-engine $CE_VERSION test_update passed on the Sluice facade ($ngpu GPUs)"
}

bench() {
  local wh=${1:-} vpy venv ngpu
  [ $# -eq 0 ] || shift
  setup "$wh" 1
  local devices
  devices=$(p2p_devices)
  say "vs_checkpoint_engine.py on $ngpu GPUs: $*"
  # From /tmp, so that the checkout's python/ never shadows the installed sluice.
  (cd /tmp && PS_P2P_STORE_RDMA_DEVICES="$devices" "$vpy" -m torch.distributed.run --standalone \
    --nproc-per-node "$ngpu" "$ROOT/tools/sluice-weights-bench/vs_checkpoint_engine.py" "$@")
}

case "${1:-}" in
  fetch) [ $# -eq 2 ] || die "usage: $0 fetch DIR"; fetch "$2" ;;
  run) run "${2:-}" ;;
  bench) shift; bench "$@" ;;
  *) die "usage: $0 fetch DIR | run [DIR] | bench [DIR] [ARGS...]" ;;
esac
