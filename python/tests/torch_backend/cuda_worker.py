"""GPU check of the sluice torch backend, for a machine with >= 2 GPUs (run_cuda.sh launches it
under torchrun, one rank per GPU). The backend moves CPU tensors only in this build, so:

1. A group "cpu:sluice,cuda:nccl": CPU tensors go through sluice and CUDA tensors through NCCL
   in the same group. Every collective on CPU tensors is compared bit for bit with gloo, and
   the same collective on CUDA tensors with NCCL's result of a plain "nccl" group.
2. A group "cpu:sluice,cuda:sluice": an op on a CUDA tensor must raise the "not supported yet"
   error (never a wrong result, never a hang).
Prints 'sluice-torch-cuda OK rank=<r> checks=<n>'.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch as st


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    return torch.randint(-4, 5, (n,), generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise AssertionError(f"{what}: {a[:8].tolist()} != {b[:8].tolist()}")


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("cpu:sluice,cuda:nccl", timeout=timedelta(seconds=60), device_id=dev)
    gloo = dist.new_group(backend="gloo")
    nccl = dist.new_group(backend="nccl")
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (0, 1, 7, 70_001, 4 << 20):
            x = data(rank, n, dtype)
            # CPU tensors: sluice vs gloo
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            dist.all_reduce(b, group=gloo)
            same(a, b, f"cpu all_reduce {dtype} n={n}")
            oa, ob = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(oa, x)
            dist.all_gather_into_tensor(ob, x, group=gloo)
            same(oa, ob, f"cpu all_gather_into_tensor {dtype} n={n}")
            # CUDA tensors in the same mixed group: NCCL, as a plain NCCL group computes it
            xc = x.to(dev)
            a, b = xc.clone(), xc.clone()
            dist.all_reduce(a)
            dist.all_reduce(b, group=nccl)
            same(a, b, f"cuda all_reduce (mixed group) {dtype} n={n}")
            checks += 3
    # Point to point in the mixed group: a CPU tensor over sluice
    peer = 1 - rank if rank < 2 else None
    if peer is not None:
        t = torch.arange(1 << 20, dtype=torch.float32) + rank
        r = torch.empty_like(t)
        reqs = [dist.isend(t, peer), dist.irecv(r, peer)]
        [q.wait() for q in reqs]
        same(r, torch.arange(1 << 20, dtype=torch.float32) + peer, "cpu isend/irecv")
        checks += 1
    assert st.backend_transport() in ("shm", "tcp"), st.backend_transport()
    dist.barrier(group=gloo)

    # CUDA tensors on a sluice group: refused clearly
    sl = dist.new_group(backend="cpu:sluice,cuda:sluice")
    try:
        dist.all_reduce(torch.ones(4, device=dev), group=sl)
    except Exception as e:  # noqa: BLE001
        assert "not supported yet" in str(e), str(e)
        checks += 1
    else:
        raise AssertionError("an all_reduce of a CUDA tensor on a cuda:sluice group returned")
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    print(f"sluice-torch-cuda OK rank={rank} checks={checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
