"""GPU check of the stream-ordered CUDA send/recv (SLUICE_TORCH_CUDA_PATH=stream, docs/torch.md);
run_cuda.sh launches it under torchrun. Ranks 0 and 1 exchange; the others only take part in the
groups. Needs a GPU per rank (ranks sharing a GPU take the path too, but a rank's kernels then
share the GPU with its peer's: still checked).

Checks, every byte against what the peer sent: both directions at once (isend + irecv, each
larger than the ring, so they must run side by side), 8 bytes to 64 MiB in three dtypes, tensors
at an offset inside larger allocations with the bytes around them untouched, non-contiguous
sends and recvs, a send of a tensor written on a side stream just before, the result used on the
caller's stream right after wait() with no host synchronisation, 200 messages queued before any
wait (order kept), a CUDA graph of a send and a recv replayed with new contents, the state and
call counter; the same against NCCL bit for bit; a CUDA recv from any source refused; and on a
group of its own, a size mismatch: the receiver gets nothing of the message and both ranks
refuse every later call, naming it, well before the group timeout.
Prints 'sluice-torch-stream-p2p OK rank=<r> checks=<n>'.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch as st


def data(rank: int, n: int, dtype: torch.dtype, salt: int, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 1000 + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype).to(dev)
    return torch.randint(0, 255, (n,), generator=g, dtype=torch.int64).to(dtype).to(dev)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise AssertionError(f"{what}: got {a.flatten()[:8].tolist()} want {b.flatten()[:8].tolist()}")


def stream_group():
    os.environ["SLUICE_TORCH_CUDA_PATH"] = "stream"
    try:
        return dist.new_group(backend="cpu:sluice,cuda:sluice")
    finally:
        del os.environ["SLUICE_TORCH_CUDA_PATH"]


def exchange_checks(sl, nccl, rank: int, dev) -> int:
    peer, checks = 1 - rank, 0
    info = st.backend_stream_p2p(sl)
    assert info["state"].startswith("not set up") and info["calls"] == 0, info
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        if rank == 0:
            print(f"stream_p2p_worker: {dtype}", flush=True)
        for nbytes in (8, 1000, 256 << 10, (4 << 20) + 4, 64 << 20):
            n = nbytes // torch.empty(0, dtype=dtype).element_size()
            what = f"{dtype} {nbytes} B"
            t = data(rank, n, dtype, 1, dev)
            r = torch.empty(n, dtype=dtype, device=dev)
            reqs = [dist.isend(t, peer, group=sl), dist.irecv(r, peer, group=sl)]
            [q.wait() for q in reqs]
            same(r, data(peer, n, dtype, 1, dev), f"both ways {what}")
            big_s = torch.full((3 * n,), 7, dtype=dtype, device=dev)
            big_r = torch.full((3 * n,), 9, dtype=dtype, device=dev)
            big_s[n:2 * n] = data(rank, n, dtype, 2, dev)
            reqs = [dist.isend(big_s[n:2 * n], peer, group=sl), dist.irecv(big_r[n:2 * n], peer, group=sl)]
            [q.wait() for q in reqs]
            same(big_r[n:2 * n], data(peer, n, dtype, 2, dev), f"offset {what}")
            same(big_r[:n], torch.full((n,), 9, dtype=dtype), f"guard before {what}")
            same(big_r[2 * n:], torch.full((n,), 9, dtype=dtype), f"guard after {what}")
            if nccl is not None:
                # NCCL's unbatched isend + irecv on both ranks can hang while it connects the pair:
                # one rank sends first.
                rn = torch.empty(n, dtype=dtype, device=dev)
                for turn in (0, 1):
                    if rank == turn:
                        dist.send(t, peer, group=nccl)
                    else:
                        dist.recv(rn, peer, group=nccl)
                same(r, rn, f"against NCCL {what}")
                checks += 1
            checks += 4
    info = st.backend_stream_p2p(sl)
    assert info["state"].startswith("on:") and info["calls"] >= 60, info
    n = 4 << 20
    if rank == 0:
        print("stream_p2p_worker: Non-contiguous on both sides", flush=True)
    # Non-contiguous on both sides.
    src = data(rank, 2 * n, torch.float32, 20, dev)
    dst = torch.zeros(2 * n, device=dev)
    reqs = [dist.isend(src[::2], peer, group=sl), dist.irecv(dst[1::2], peer, group=sl)]
    [q.wait() for q in reqs]
    same(dst[1::2], data(peer, 2 * n, torch.float32, 20, dev)[::2], "non-contiguous")
    same(dst[0::2], torch.zeros(n), "non-contiguous: the other elements untouched")
    checks += 2
    # Written on a side stream current at the send; the result used on the caller's stream
    # right after wait(), without a host synchronisation.
    s1 = torch.cuda.Stream()
    if rank == 0:
        with torch.cuda.stream(s1):
            x = torch.empty(n, device=dev)
            torch.cuda._sleep(20_000_000)
            x.fill_(5.0)
            dist.send(x, 1, group=sl)
        y = torch.empty(n, device=dev)
        dist.recv(y, 1, group=sl)
        z = y * 2
        same(z, torch.full((n,), 12.0), "recv then use on the stream")
    else:
        x = torch.empty(n, device=dev)
        dist.recv(x, 0, group=sl)
        z = x + 1
        torch.cuda._sleep(20_000_000)
        z.fill_(6.0)
        dist.send(z, 0, group=sl)
        same(x, torch.full((n,), 5.0), "send of a tensor written on a side stream")
    checks += 2
    if rank == 0:
        print("stream_p2p_worker: 200 messages queued before any wait", flush=True)
    # 200 messages queued before any wait: matched in order.
    ts = [torch.full((1000 + i,), float(rank * 1000 + i), device=dev) for i in range(200)]
    rs = [torch.empty(1000 + i, device=dev) for i in range(200)]
    reqs = [dist.isend(t, peer, group=sl) for t in ts] + [dist.irecv(r, peer, group=sl) for r in rs]
    [q.wait() for q in reqs]
    for i, r in enumerate(rs):
        same(r, torch.full((1000 + i,), float(peer * 1000 + i)), f"queued message {i}")
    checks += 1
    if rank == 0:
        print("stream_p2p_worker: A CUDA graph of a send and a recv, replayed with new contents", flush=True)
    # A CUDA graph of a send and a recv, replayed with new contents.
    a = torch.zeros(1 << 20, device=dev)
    b = torch.zeros(1 << 20, device=dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        reqs = [dist.isend(a, peer, group=sl), dist.irecv(b, peer, group=sl)]  # warm-up outside the capture
        [q.wait() for q in reqs]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        reqs = [dist.isend(a, peer, group=sl), dist.irecv(b, peer, group=sl)]
        [q.wait() for q in reqs]
    for k in range(3):
        a.fill_(float(rank * 10 + k))
        g.replay()
        torch.cuda.synchronize()
        same(b, torch.full((1 << 20,), float(peer * 10 + k)), f"graph replay {k}")
    checks += 3
    # A CUDA recv from any source cannot take the stream path.
    try:
        dist.irecv(torch.empty(10, device=dev), group=sl)
        raise AssertionError("a CUDA recv from any source was accepted")
    except RuntimeError as e:
        assert "any source" in str(e), str(e)
    checks += 1
    return checks


def mismatch_checks(rank: int, gloo, dev) -> int:
    bad = stream_group()
    if rank >= 2:
        dist.barrier(group=gloo)
        return 0
    t0 = time.monotonic()
    if rank == 0:
        dist.send(torch.ones(2 << 20, device=dev), 1, group=bad)  # fits the ring: completes
        torch.cuda.synchronize()
    else:
        r = torch.full((1 << 20,), 3.0, device=dev)
        dist.recv(r, 0, group=bad)
        torch.cuda.synchronize()
        same(r, torch.full((1 << 20,), 3.0), "a mismatched message delivered nothing")
        state = st.backend_stream_p2p(bad)["state"]
        assert state.startswith("failed") and "met a message of 8388608 bytes" in state, state
    dist.barrier(group=gloo)
    if rank == 0:
        # The receiver's word stops the sender's next kernel at once (no timeout needed).
        dist.isend(torch.ones(8, device=dev), 1, group=bad)
        torch.cuda.synchronize()
        state = st.backend_stream_p2p(bad)["state"]
        assert state.startswith("failed") and "peer's side failed" in state, state
    assert time.monotonic() - t0 < 30, "the mismatch took the group timeout to surface"
    try:
        dist.send(torch.ones(8, device=dev), 1 - rank, group=bad)
        raise AssertionError("a call after the failure was accepted")
    except RuntimeError as e:
        assert "unusable" in str(e), str(e)
    return 3


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A hang shows where it is (every wait here is bounded far below this).
    faulthandler.dump_traceback_later(float(os.environ.get("STREAM_P2P_WORKER_LIMIT_S", "240")), exit=True)
    local = int(os.environ.get("LOCAL_RANK", rank))
    own_gpu = torch.cuda.device_count() >= world
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo", timeout=timedelta(seconds=60))
    gloo = dist.group.WORLD
    sl = stream_group()
    nccl = dist.new_group(backend="nccl") if own_gpu else None
    checks = exchange_checks(sl, nccl, rank, dev) if rank < 2 else 0
    dist.barrier(group=gloo)
    if rank == 0:
        print("stream_p2p_worker: a size mismatch", flush=True)
    checks += mismatch_checks(rank, gloo, dev)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    print(f"sluice-torch-stream-p2p OK rank={rank} checks={checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
