#!/usr/bin/env bash
# The sluice torch backend on a machine with GPUs (not part of CI, which has none).
#
#   python/tests/torch_backend/run_cuda.sh [nproc]      default: 2 ranks, one per GPU (they
#                                                       share GPUs when there are fewer)
#
# Needs a CUDA build of torch in the Python that runs it (PYTHON, default python3) and sluice
# installed in it with the torch backend (docs/torch.md, "Getting the backend"). Runs
# cuda_worker.py under torchrun: CPU tensors over sluice vs gloo and CUDA tensors over NCCL in
# one "cpu:sluice,cuda:nccl" group (one GPU per rank only), then every op on CUDA tensors over
# a "cuda:sluice" group against the same op on CPU tensors, and stream ordering, the device path
# of send/recv and the low-latency all_gather (against NCCL too, one GPU per rank); then the
# stream-ordered send/recv (stream_p2p_worker.py). Then the CPU matrix (worker.py, shm and tcp)
# on the same machine.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
N=${1:-2}
export OMP_NUM_THREADS=1
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)' ||
  { echo "run_cuda.sh: needs torch with CUDA and a GPU" >&2; exit 1; }
"$PY" -c 'import sluice.torch as st, sys; sys.exit(0 if st.available() else 1)' ||
  { echo "run_cuda.sh: sluice.torch is not built (docs/torch.md)" >&2; exit 1; }
echo "== cuda_worker.py: $N ranks"
# The low-latency all_gather is on by default (1 MiB per rank): cuda_worker.py's main group
# takes it at that size unless SLUICE_TORCH_LL_ALLGATHER_BYTES says otherwise.
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$N" "$HERE/cuda_worker.py"
echo "== stream_p2p_worker.py: $N ranks (SLUICE_TORCH_CUDA_PATH=stream)"
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$N" "$HERE/stream_p2p_worker.py"
for t in shm tcp; do
  echo "== worker.py (CPU tensors): $N ranks, $t forced"
  SLUICE_TORCH_TRANSPORT=$t SLUICE_TORCH_TEST_BIG=1 "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$N" "$HERE/worker.py"
done
echo "run_cuda.sh: all passed"
