#!/usr/bin/env bash
# The GPU matrix: every test and benchmark that needs one or more GPUs, in stages, each with a
# time limit and a log of its own. Not part of CI (CI has no GPU). Run on a host with >= 2 GPUs:
#
#   scripts/gpu-matrix.sh [STAGE ...]          default: info cxx ag hier aggemm port nvlink wheel torch tbench ce
#
# Stages:
#   info    GPUs, links (nvidia-smi topo), driver, Python and torch versions
#   cxx     sluice_cuda_tests and sluice_port_channel_cuda_tests (2-GPU tests included)
#   sanit   the port channel's GPU tests under compute-sanitizer memcheck and racecheck
#   ag      the LL AllGather against NCCL, bit-equality and timing, at 2 ranks and at every
#           GPU of the host when there are more (tools/sluice-gpu-bench/allgather_bench.py)
#   hier    the hierarchical AllGather against NCCL (tools/sluice-gpu-bench/hier_allgather_bench.py):
#           2 ranks forced inter (2 nodes x 1, port channels over the network between GPUs of
#           this host), the same with NCCL forced onto sockets, 2 nodes x 2 when the host has
#           >= 4 GPUs, the example under torchrun, and the kill test (a rank dies mid-loop, the
#           others must raise within the timeout; also 2 x 2 with >= 4 GPUs); HierAllGather.*
#           of sluice_cuda_tests runs in cxx
#   aggemm  the AllGather-GEMM overlap (python/sluice/ag_gemm.py) against NCCL all_gather_into_tensor
#           + matmul (tools/sluice-gpu-bench/ag_gemm_bench.py): 2 ranks intra-node, issue 14's
#           shapes, bf16 and fp16, chunks 2/4/8, with an SM-carveout variant; 2 ranks forced
#           inter (HierAllGather, --quick), also with NCCL on sockets; 4 ranks when the host has
#           them; the example under torchrun, intra and inter, graph and eager (203 s on 2xH200:
#           give it STAGE_TIMEOUT >= 240)
#   port    sluice-port-bench (port channel vs the copy engine, ping-pong, request rate), the
#           batched nvlink post path and nvlink.post_batch=false interleaved, 2 rounds each
#   nvlink  sluice-gpu-bench (nvlink transport vs cudaMemcpyPeerAsync)
#   wheel   builds the sluice wheel with CUDA and the torch backend against this host's torch,
#           installs it into this Python, and leaves it in $WH for the ce stage (46 s with 16
#           jobs on 1xH200; torch and ce need it)
#   torch   python/tests/torch_backend/run_cuda.sh at 2 ranks and at every GPU of the host
#   tbench  tools/sluice-torch-bench/bench.py --device cuda against NCCL, 2 ranks
#   ce      checkpoint-engine 0.4.2, unmodified, on the Mooncake facade
#           (tests/compat/run_checkpoint_engine.sh run $WH; $WH must hold its wheels: `fetch`)
#   weights sluice.weights on the GPU: the pull, push and staging tests with CUDA tensors
#           (python/tests/weights/test_weights_{cuda,push,staging}.py) and the bench, pull and
#           push rounds interleaved into GPU targets from share()d and from pinned trainer memory,
#           the staging path against a direct pull (staging_bench.py), nvlink's page-locking tests
#           (4 GiB in 1,000 tensors; WEIGHTS_MIB changes the size); needs the wheel stage first
#   cebench issue 15's comparison on every GPU of the host (>= 1): checkpoint-engine broadcast,
#           checkpoint-engine P2P on the facade and sluice.weights, 20 GiB in 1,000 tensors, with
#           the pinned H2D ceiling (run_checkpoint_engine.sh bench; CEBENCH_ARGS adds arguments,
#           e.g. --json FILE); not in the default stages (minutes of host memory copies)
#
# Environment: BIN = a folder with prebuilt libsluice.so, sluice_cuda_tests,
# sluice_port_channel_cuda_tests, sluice-gpu-bench, sluice-port-bench (default: build them
# here into build-gpu/ with cmake); LOGS = where the logs go (default gpu-logs/); WH = the
# wheelhouse (default .device/wh; `tests/compat/run_checkpoint_engine.sh fetch` fills it where
# PyPI is reachable; the GPU machine reaches nothing); STAGE_TIMEOUT = seconds per stage
# (default 900). Measured on 4xH200 (2026-11-27): info+cxx+ag+port+nvlink 57 s, wheel 391 s
# (one job at a time then: see JOBS below),
# torch (2 and 4 ranks) 167 s, tbench 25 s, ce 197 s. On 2xH200 (2026-11-29): info 7 s, wheel
# 53 s, cebench 92 s, nvlink 9 s, ce 162 s, tbench 18 s, torch 96 s, cxx 6 s, port 67 s, ag 12 s,
# hier 60 s (building the binaries for cxx..nvlink took under 40 s).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends): never remove that.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
LOGS=${LOGS:-$ROOT/gpu-logs}
WH=${WH:-$ROOT/.device/wh}
PY=${PYTHON:-python3}
mkdir -p "$LOGS"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 0)
# Build jobs. Not `nproc`: it honours OMP_NUM_THREADS, which this script sets to 1, so the wheel
# built one file at a time and took over 5 minutes on 2 x H200 (46 s in parallel on 1 x H200).
JOBS=${JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)}
[ "$NGPU" -ge 1 ] || { echo "gpu-matrix.sh: no GPU here (nvidia-smi -L lists none)" >&2; exit 1; }

bin_setup() {
  if [ -n "${BIN:-}" ]; then
    BIN=$(cd "$BIN" && pwd)
  else
    BIN=$ROOT/build-gpu
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
      ninja -C build-gpu -j "$JOBS" sluice sluice_cuda_tests sluice_port_channel_cuda_tests sluice-gpu-bench sluice-p2p-bench sluice-port-bench >/dev/null || return 1
    ln -sf tests/cuda/sluice_cuda_tests tests/port_channel/sluice_port_channel_cuda_tests \
      tools/sluice-gpu-bench/sluice-gpu-bench tools/sluice-gpu-bench/sluice-p2p-bench tools/sluice-port-bench/sluice-port-bench build-gpu/ 2>/dev/null
  fi
  export LD_LIBRARY_PATH=$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

s_info() {
  nvidia-smi -L; nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "nproc $(nproc), online CPUs $(getconf _NPROCESSORS_ONLN), build jobs $JOBS"; "$PY" --version; "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  command -v nvcc && nvcc --version | tail -1
}
s_cxx() {
  local rc=0
  "$BIN/sluice_cuda_tests" --gtest_brief=1 || rc=1
  "$BIN/sluice_port_channel_cuda_tests" --gtest_brief=1 || rc=1
  return $rc
}
s_sanit() {
  local rc=0 t
  for t in memcheck racecheck; do
    # API errors are not reported: enabling peer access that is already enabled (by us or by the
    # application) returns cudaErrorPeerAccessAlreadyEnabled, which the engine expects and clears,
    # and memcheck would count each as an error. Memory errors and hazards still fail the stage.
    compute-sanitizer --tool "$t" --report-api-errors no --error-exitcode 9 "$BIN/sluice_port_channel_cuda_tests" \
      --gtest_brief=1 --gtest_filter='-*OffsetsAndSizesBeyondFourGiB*' || rc=1
  done
  return $rc
}
s_ag() {
  local rc=0 w
  for w in 2 $([ "$NGPU" -gt 2 ] && echo "$NGPU"); do
    SLUICE_LIBRARY=$BIN/libsluice.so "$PY" tools/sluice-gpu-bench/allgather_bench.py --world "$w" \
      --out "$LOGS/allgather-$w.md" || rc=1
  done
  return $rc
}
s_hier() {
  local rc=0
  export SLUICE_LIBRARY=$BIN/libsluice.so
  "$PY" tools/sluice-gpu-bench/hier_allgather_bench.py --world 2 --ranks-per-node 1 \
    --out "$LOGS/hier-2x1.md" || rc=1
  "$PY" tools/sluice-gpu-bench/hier_allgather_bench.py --world 2 --ranks-per-node 1 --transport tcp --nccl-socket \
    --max-mib 16 --out "$LOGS/hier-2x1-socket.md" || rc=1
  if [ "$NGPU" -ge 4 ]; then
    "$PY" tools/sluice-gpu-bench/hier_allgather_bench.py --world 4 --ranks-per-node 2 \
      --out "$LOGS/hier-2x2.md" || rc=1
  fi
  for m in "" "--eager-mode"; do
    "$PY" -m torch.distributed.run --nproc-per-node 2 examples/python/all_gather_ll.py --mode inter $m || rc=1
  done
  "$PY" tools/sluice-gpu-bench/hier_allgather_bench.py --world 2 --ranks-per-node 1 --timeout-ms 3000 \
    --kill-test || rc=1
  if [ "$NGPU" -ge 4 ]; then
    "$PY" tools/sluice-gpu-bench/hier_allgather_bench.py --world 4 --ranks-per-node 2 --timeout-ms 3000 \
      --kill-test || rc=1
  fi
  return $rc
}
s_aggemm() {
  local rc=0 mode m
  export SLUICE_LIBRARY=$BIN/libsluice.so
  "$PY" tools/sluice-gpu-bench/ag_gemm_bench.py --world 2 --sm-carveout 16 \
    --out "$LOGS/aggemm-intra-2.md" --json "$LOGS/aggemm-intra-2.json" || rc=1
  "$PY" tools/sluice-gpu-bench/ag_gemm_bench.py --world 2 --inter --ranks-per-node 1 --quick \
    --out "$LOGS/aggemm-inter-2x1.md" --json "$LOGS/aggemm-inter-2x1.json" || rc=1
  "$PY" tools/sluice-gpu-bench/ag_gemm_bench.py --world 2 --inter --ranks-per-node 1 --quick --transport tcp \
    --nccl-socket --out "$LOGS/aggemm-inter-2x1-socket.md" --json "$LOGS/aggemm-inter-2x1-socket.json" || rc=1
  if [ "$NGPU" -ge 4 ]; then
    "$PY" tools/sluice-gpu-bench/ag_gemm_bench.py --world 4 --quick --sm-carveout 16 \
      --out "$LOGS/aggemm-intra-4.md" --json "$LOGS/aggemm-intra-4.json" || rc=1
    "$PY" tools/sluice-gpu-bench/ag_gemm_bench.py --world 4 --inter --ranks-per-node 2 --quick \
      --out "$LOGS/aggemm-inter-2x2.md" --json "$LOGS/aggemm-inter-2x2.json" || rc=1
  fi
  for mode in intra inter; do
    for m in "" "--eager-mode"; do
      "$PY" -m torch.distributed.run --nproc-per-node 2 examples/python/all_gather_gemm_overlap.py --mode $mode $m || rc=1
    done
  done
  return $rc
}
# The batched proxy path and the single-post path of the same build, interleaved (A/B).
s_port() {
  local r rc=0
  for r in 1 2; do
    echo "--- port bench round $r: nvlink.post_batch=true (default)"; "$BIN/sluice-port-bench" --peer-device 1 || rc=1
    echo "--- port bench round $r: nvlink.post_batch=false"; "$BIN/sluice-port-bench" --peer-device 1 --requests 100000 --set nvlink.post_batch=false || rc=1
  done
  return $rc
}
s_nvlink() { "$BIN/sluice-gpu-bench" --out "$LOGS/nvlink.md"; }
s_wheel() {
  mkdir -p "$WH" && rm -f "$WH"/sluice-*.whl
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS SKBUILD_CMAKE_DEFINE="SLUICE_TORCH_PYTHON=$(command -v "$PY")" \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WH" . &&
    "$PY" -m pip install -q --force-reinstall --no-deps "$WH"/sluice-*.whl &&
    (cd /tmp && "$PY" -c 'import sluice, sluice.torch as st; print("sluice", sluice.__version__, "torch backend", st.available())') || return 1
  # This host's compiler may link the C++ runtime statically: none of it may be exported
  # (cmake/sluice_link.cmake; an exported copy crashed the torch backend on 1xH200).
  local pkg f rc=0
  pkg=$(cd /tmp && "$PY" -c 'import os, sluice; print(os.path.dirname(sluice.__file__))') || return 1
  for f in "$pkg"/*.so; do "$ROOT/tests/cmake/check_exports.sh" "$f" hidden || rc=1; done
  return $rc
}
s_torch() {
  local rc=0 w
  for w in 2 $([ "$NGPU" -gt 2 ] && echo "$NGPU"); do
    PYTHON=$PY python/tests/torch_backend/run_cuda.sh "$w" || rc=1
  done
  return $rc
}
s_tbench() {
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 tools/sluice-torch-bench/bench.py \
    --device cuda --markdown ${TBENCH_ARGS:-}
}
# Each of checkpoint-engine's four tests took 40-50 s on 4xH200; a failing one can hang until
# its timeout (its checker process waits), so the timeout here is short.
s_ce() { CE_TIMEOUT=${CE_TIMEOUT:-300} PYTHON=$PY tests/compat/run_checkpoint_engine.sh run "$WH"; }

s_weights() {
  local rc=0 mem
  "$PY" -c 'import pytest' 2>/dev/null || "$PY" -m pip install -q --no-index --find-links "$WH" pytest pytest-timeout || rc=1
  (cd python/tests/weights && "$PY" -m pytest -q -rs -p no:cacheprovider test_weights_cuda.py test_weights_push.py \
    test_weights_staging.py) || rc=1
  "$PY" -m pytest -q -rs -p no:cacheprovider python/tests/test_nvlink_pinning.py || rc=1
  for mem in shared pinned; do
    "$PY" tools/sluice-weights-bench/bench.py --size-mib "${WEIGHTS_MIB:-4096}" --tensors 1000 --receivers 1 \
      --rounds 3 --mode both --trainer-memory "$mem" --targets cuda --check --json "$LOGS/weights-$mem.json" || rc=1
  done
  "$PY" tools/sluice-weights-bench/staging_bench.py --device cuda --size-mib "${WEIGHTS_MIB:-4096}" --tensors 1000 \
    --rounds 3 --check --json "$LOGS/weights-staging.json" || rc=1
  return $rc
}

s_cebench() {
  PYTHON=$PY tests/compat/run_checkpoint_engine.sh bench "$WH" --size-gib 20 --tensors 1000 --rounds 3 ${CEBENCH_ARGS:-}
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(info cxx ag hier aggemm port nvlink wheel torch tbench ce)
case " ${stages[*]} " in *" cxx "*|*" sanit "*|*" ag "*|*" hier "*|*" aggemm "*|*" port "*|*" nvlink "*) bin_setup || { echo "gpu-matrix.sh: building the GPU binaries failed" >&2; exit 1; } ;; esac
summary=()
for s in "${stages[@]}"; do
  declare -F "s_$s" >/dev/null || { echo "gpu-matrix.sh: unknown stage $s" >&2; exit 2; }
  t0=$SECONDS
  echo "=================== $s ($NGPU GPUs) ==================="
  timeout -k 10 "${STAGE_TIMEOUT:-900}" bash -c "$(declare -f "s_$s"); $(declare -p BIN ROOT LOGS WH PY NGPU JOBS 2>/dev/null); s_$s" \
    > >(tee "$LOGS/$s.log") 2>&1
  rc=$?
  summary+=("$s: $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s")
  echo "--- ${summary[-1]}"
done
printf '%s\n' "== gpu-matrix.sh summary" "${summary[@]}" | tee "$LOGS/summary.txt"
