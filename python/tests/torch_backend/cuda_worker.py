"""GPU check of the sluice torch backend (run_cuda.sh launches it under torchrun). With one GPU
per rank it also runs NCCL beside it; with fewer GPUs than ranks the ranks share them (NCCL
refuses that, so its part is skipped, saying so).

1. A group "cpu:sluice,cuda:nccl" (one GPU per rank only): CPU tensors go through sluice and
   CUDA tensors through NCCL in the same group. Every collective on CPU tensors is compared bit
   for bit with gloo, and the same collective on CUDA tensors with a plain "nccl" group.
2. A group "cpu:sluice,cuda:sluice": CUDA tensors go through sluice (host copies, see
   src/torch/host_staging.hpp). Every collective and point-to-point op on CUDA tensors must
   give, bit for bit, what the same op gives on CPU tensors through gloo; the result must be
   visible to a kernel launched on a side stream right after wait(); a CUDA tensor written on
   a side stream just before the op must be read after that write.
3. The device path of that group (large CUDA send/recv straight between GPU memories over the
   nvlink transport, docs/torch.md): CUDA to CUDA both ways at once, CUDA to CPU and CPU to
   CUDA, tensors at an offset inside a larger allocation with the bytes around them untouched,
   fresh allocations every round (the registration cache must notice a new buffer at an old
   address), non-contiguous tensors, a send written on a side stream, a size mismatch that
   fails both sides and leaves the pair working, and the same through SLUICE_TORCH_CUDA_PATH=host.
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


def mixed_group_checks(rank: int, world: int, dev: torch.device, gloo) -> int:
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
    return checks


def cuda_on_sluice(sl, gloo, rank: int, world: int, dev: torch.device) -> int:
    """Every op of `sl` on CUDA tensors against the same op of `sl` on CPU tensors (which the
    CPU suites compare with gloo bit for bit). Returns the number of checks."""
    checks = 0
    root = 1 % world
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (0, 1, 7, 70_001, 1 << 20):
            x = data(rank, n, dtype, salt=5)
            what = f"{dtype} n={n}"
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                a, c = x.clone(), x.to(dev)
                dist.all_reduce(a, op=op, group=sl)
                dist.all_reduce(c, op=op, group=sl)
                same(c, a, f"cuda all_reduce {op} {what}")
            a, c = x.clone(), x.to(dev)
            dist.broadcast(a, src=root, group=sl)
            dist.broadcast(c, src=root, group=sl)
            same(c, a, f"cuda broadcast {what}")
            a, c = x.clone(), x.to(dev)
            dist.reduce(a, dst=root, group=sl)
            dist.reduce(c, dst=root, group=sl)
            if rank == root:
                same(c, a, f"cuda reduce {what}")
            oa = torch.empty(n * world, dtype=dtype)
            oc = torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(oa, x, group=sl)
            dist.all_gather_into_tensor(oc, x.to(dev), group=sl)
            same(oc, oa, f"cuda all_gather_into_tensor {what}")
            la = [torch.empty(n, dtype=dtype) for _ in range(world)]
            lc = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(la, x, group=sl)
            dist.all_gather(lc, x.to(dev), group=sl)
            for i in range(world):
                same(lc[i], la[i], f"cuda all_gather[{i}] {what}")
            big = data(rank, n * world, dtype, salt=9)
            ra, rc = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(ra, big, group=sl)
            dist.reduce_scatter_tensor(rc, big.to(dev), group=sl)
            same(rc, ra, f"cuda reduce_scatter_tensor {what}")
            aa, ac = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_to_all_single(aa, big, group=sl)
            dist.all_to_all_single(ac, big.to(dev), group=sl)
            same(ac, aa, f"cuda all_to_all_single {what}")
            ga = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
            gc = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
            dist.gather(x, ga, dst=root, group=sl)
            dist.gather(x.to(dev), gc, dst=root, group=sl)
            if rank == root:
                for i in range(world):
                    same(gc[i], ga[i], f"cuda gather[{i}] {what}")
            parts = [data(i, n, dtype, salt=11) for i in range(world)]
            sa, sc = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype, device=dev)
            dist.scatter(sa, parts if rank == root else None, src=root, group=sl)
            dist.scatter(sc, [p.to(dev) for p in parts] if rank == root else None, src=root, group=sl)
            same(sc, sa, f"cuda scatter {what}")
            checks += 10
    # Point to point, CUDA on both sides and CUDA to CPU; recv from any source names the sender
    if world >= 2 and rank < 2:
        peer = 1 - rank
        t = (torch.arange(1 << 20, dtype=torch.float32) + rank).to(dev)
        r = torch.empty(1 << 20, dtype=torch.float32, device=dev)
        reqs = [dist.isend(t, peer, group=sl), dist.irecv(r, peer, group=sl)]
        [q.wait() for q in reqs]
        same(r, torch.arange(1 << 20, dtype=torch.float32) + peer, "cuda isend/irecv")
        if rank == 0:
            dist.send(torch.full((7,), 3.0, device=dev), 1, group=sl)
            h = torch.empty(7)
            src = dist.recv(h, group=sl)  # any source
            assert src == 1, src
            same(h, torch.full((7,), 4.0), "cuda->cpu recv from any source")
        else:
            h = torch.empty(7, device=dev)
            src = dist.recv(h, group=sl)
            assert src == 0, src
            same(h, torch.full((7,), 3.0), "cpu<-cuda recv from any source")
            dist.send(torch.full((7,), 4.0), 0, group=sl)
        checks += 2
    # Stream order: the input is written on a side stream that is current during the op, and
    # the result is read by a kernel on another stream launched right after wait().
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    n = 1 << 22
    with torch.cuda.stream(s1):
        x = torch.empty(n, device=dev)
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before the write lands
        x.fill_(float(rank + 1))
        work = dist.all_reduce(x, group=sl, async_op=True)
    work.wait()
    with torch.cuda.stream(s2):
        y = x * 2
    s2.synchronize()
    same(y, torch.full((n,), 2.0 * sum(range(1, world + 1))), "cuda stream order")
    checks += 1
    return checks


def device_path_checks(sl, rank: int, world: int, dev: torch.device, expect_path: str) -> int:
    """Point-to-point checks of the device path between ranks 0 and 1 (see the docstring)."""
    path = st.backend_cuda_path(sl)
    assert path == expect_path, f"cuda path {path!r}, expected {expect_path!r}"
    if rank >= 2:
        return 0
    peer, checks = 1 - rank, 0

    def expect(n: int, dtype: torch.dtype, who: int, salt: int) -> torch.Tensor:
        return data(who, n, dtype, salt=salt)

    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for nbytes in (256 << 10, (4 << 20) + 4, 64 << 20):
            n = nbytes // torch.empty(0, dtype=dtype).element_size()
            what = f"{path} {dtype} {nbytes} B"
            # CUDA to CUDA, both directions at once
            t = expect(n, dtype, rank, 1).to(dev)
            r = torch.empty(n, dtype=dtype, device=dev)
            reqs = [dist.isend(t, peer, group=sl), dist.irecv(r, peer, group=sl)]
            [q.wait() for q in reqs]
            same(r, expect(n, dtype, peer, 1), f"cuda<->cuda {what}")
            # inside larger allocations, guards around both ends
            big_s = torch.full((3 * n,), 7, dtype=dtype, device=dev)
            big_r = torch.full((3 * n,), 9, dtype=dtype, device=dev)
            big_s[n:2 * n] = expect(n, dtype, rank, 2).to(dev)
            reqs = [dist.isend(big_s[n:2 * n], peer, group=sl), dist.irecv(big_r[n:2 * n], peer, group=sl)]
            [q.wait() for q in reqs]
            same(big_r[n:2 * n], expect(n, dtype, peer, 2), f"offset {what}")
            same(big_r[:n], torch.full((n,), 9, dtype=dtype), f"guard before {what}")
            same(big_r[2 * n:], torch.full((n,), 9, dtype=dtype), f"guard after {what}")
            # CUDA to CPU, then CPU to CUDA
            if rank == 0:
                dist.send(expect(n, dtype, 0, 3).to(dev), 1, group=sl)
                h = torch.empty(n, dtype=dtype, device=dev)
                dist.recv(h, 1, group=sl)
                same(h, expect(n, dtype, 1, 4), f"cpu->cuda {what}")
            else:
                h = torch.empty(n, dtype=dtype)
                dist.recv(h, 0, group=sl)
                same(h, expect(n, dtype, 0, 3), f"cuda->cpu {what}")
                dist.send(expect(n, dtype, 1, 4), 0, group=sl)
            checks += 5
    # Fresh allocations each round: torch may hand back the same address for a new buffer.
    n = 8 << 20
    for i in range(4):
        t = expect(n, torch.float32, rank, 10 + i).to(dev)
        r = torch.empty(n, device=dev)
        reqs = [dist.isend(t, peer, group=sl), dist.irecv(r, peer, group=sl)]
        [q.wait() for q in reqs]
        same(r, expect(n, torch.float32, peer, 10 + i), f"fresh allocation round {i}")
        del t, r
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        checks += 1
    # Non-contiguous on both sides.
    src = expect(2 * n, torch.float32, rank, 20).to(dev)
    dst = torch.zeros(2 * n, device=dev)
    reqs = [dist.isend(src[::2], peer, group=sl), dist.irecv(dst[1::2], peer, group=sl)]
    [q.wait() for q in reqs]
    same(dst[1::2], expect(2 * n, torch.float32, peer, 20)[::2], "non-contiguous")
    same(dst[0::2], torch.zeros(n), "non-contiguous: the other elements untouched")
    checks += 2
    # Written on a side stream that is current at the send: the send must see the write.
    s1 = torch.cuda.Stream()
    if rank == 0:
        with torch.cuda.stream(s1):
            x = torch.empty(n, device=dev)
            torch.cuda._sleep(20_000_000)
            x.fill_(5.0)
            dist.send(x, 1, group=sl)
    else:
        x = torch.empty(n, device=dev)
        dist.recv(x, 0, group=sl)
        same(x, torch.full((n,), 5.0), "send of a tensor written on a side stream")
    checks += 1
    # A size mismatch fails both sides (tensor sizes must match) and the pair keeps working.
    big, small = torch.ones(2 << 20, device=dev), torch.empty(1 << 20, device=dev)
    try:
        if rank == 0:
            dist.send(big, 1, group=sl)
        else:
            dist.recv(small, 0, group=sl)
        raise AssertionError("a size mismatch was accepted")
    except RuntimeError as e:
        assert "sizes must match" in str(e), str(e)
    t = expect(1 << 20, torch.float32, rank, 30).to(dev)
    r = torch.empty(1 << 20, device=dev)
    reqs = [dist.isend(t, peer, group=sl), dist.irecv(r, peer, group=sl)]
    [q.wait() for q in reqs]
    same(r, expect(1 << 20, torch.float32, peer, 30), "after a size mismatch")
    checks += 2
    return checks


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    own_gpu = torch.cuda.device_count() >= world
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if own_gpu:
        dist.init_process_group("cpu:sluice,cuda:nccl", timeout=timedelta(seconds=60), device_id=dev)
    else:
        dist.init_process_group("sluice", timeout=timedelta(seconds=60))
        if rank == 0:
            print(f"cuda_worker: {torch.cuda.device_count()} GPU(s) for {world} ranks: ranks share GPUs, "
                  "so the NCCL comparison (one GPU per rank) is skipped", flush=True)
    gloo = dist.new_group(backend="gloo")
    checks = 0
    if own_gpu:
        checks += mixed_group_checks(rank, world, dev, gloo)
    dist.barrier(group=gloo)

    # CUDA tensors on a sluice group, against gloo on CPU tensors
    sl = dist.new_group(backend="cpu:sluice,cuda:sluice")
    checks += cuda_on_sluice(sl, gloo, rank, world, dev)
    dist.barrier(group=gloo)
    want = os.environ.get("SLUICE_TORCH_CUDA_PATH_EXPECTED", "nvlink")
    checks += device_path_checks(sl, rank, world, dev, want)
    dist.barrier(group=gloo)
    os.environ["SLUICE_TORCH_CUDA_PATH"] = "host"
    hsl = dist.new_group(backend="cpu:sluice,cuda:sluice")
    del os.environ["SLUICE_TORCH_CUDA_PATH"]
    checks += device_path_checks(hsl, rank, world, dev, "host")
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    print(f"sluice-torch-cuda OK rank={rank} checks={checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
