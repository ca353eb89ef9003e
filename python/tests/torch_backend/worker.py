"""Run under torchrun: every operation through the sluice backend, compared bit for bit with
gloo in the same processes (a second group). Prints 'sluice-torch OK <checks>' on success."""
from __future__ import annotations

import os
import time
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch as st

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
SIZES = [0, 1, 7, 1000, 70_001]  # empty, one, odd, direct path, chunked (reduce-scatter) path


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    # Small integers: every reduction order gives the same bits, so gloo's and ours compare exactly.
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo, hi = (1, 3) if dtype in (torch.int8, torch.uint8) else (-4, 5)
    t = torch.randint(lo, hi, (n,), generator=g).to(dtype)
    return t


def canon(t: torch.Tensor) -> torch.Tensor:
    # gloo adds bool bytes as uint8 (True + True leaves a byte of 2); compare truth values.
    return (t.view(torch.uint8) != 0) if t.dtype == torch.bool else t


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(canon(a), canon(b)):
        raise AssertionError(f"{what}: sluice {a[:8].tolist()} != gloo {b[:8].tolist()}")


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("cpu:sluice", timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    checks = 0
    big = os.environ.get("SLUICE_TORCH_TEST_BIG") == "1"

    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    for dtype in DTYPES:
        for n in SIZES:
            x = data(rank, n, dtype)
            for op in ops:
                if op == dist.ReduceOp.PRODUCT and n > 1000:
                    continue  # products of many small ints overflow differently per dtype path
                a, b = x.clone(), x.clone()
                dist.all_reduce(a, op=op)
                dist.all_reduce(b, op=op, group=gloo)
                same(a, b, f"all_reduce {op} {dtype} n={n}")
                checks += 1
            # broadcast from the last rank
            a, b = x.clone(), x.clone()
            dist.broadcast(a, src=world - 1)
            dist.broadcast(b, src=world - 1, group=gloo)
            same(a, b, f"broadcast {dtype} n={n}")
            # all_gather and all_gather_into_tensor
            la = [torch.empty_like(x) for _ in range(world)]
            lb = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(la, x)
            dist.all_gather(lb, x, group=gloo)
            for i in range(world):
                same(la[i], lb[i], f"all_gather {dtype} n={n}")
            oa = torch.empty(n * world, dtype=dtype)
            ob = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(oa, x)
            dist.all_gather_into_tensor(ob, x, group=gloo)
            same(oa, ob, f"all_gather_into_tensor {dtype} n={n}")
            # reduce_scatter_tensor (gloo: SUM) and reduce to rank 0
            if dtype != torch.bool:
                inp = data(rank, n * world, dtype, salt=1)
                ra, rb = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(ra, inp)
                dist.reduce_scatter_tensor(rb, inp, group=gloo)
                same(ra, rb, f"reduce_scatter_tensor {dtype} n={n}")
            a, b = x.clone(), x.clone()
            dist.reduce(a, dst=0)
            dist.reduce(b, dst=0, group=gloo)
            if rank == 0:
                same(a, b, f"reduce {dtype} n={n}")
            # all_to_all_single with uneven splits: rank r sends (j + 1) * m rows to rank j
            m = max(n // 64, 1) if n else 0
            in_splits = [(j + 1) * m for j in range(world)]
            out_splits = [(rank + 1) * m] * world
            src = data(rank, sum(in_splits), dtype, salt=2)
            oa = torch.empty(sum(out_splits), dtype=dtype)
            ob = torch.empty(sum(out_splits), dtype=dtype)
            dist.all_to_all_single(oa, src, out_splits, in_splits)
            dist.all_to_all_single(ob, src, out_splits, in_splits, group=gloo)
            same(oa, ob, f"all_to_all_single {dtype} n={n}")
            # gather / scatter at rank 0
            ga = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
            gb = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
            dist.gather(x, ga, dst=0)
            dist.gather(x, gb, dst=0, group=gloo)
            if rank == 0:
                for i in range(world):
                    same(ga[i], gb[i], f"gather {dtype} n={n}")
            sl = [data(i, n, dtype, salt=3) for i in range(world)] if rank == 0 else None
            sa, sb = torch.empty_like(x), torch.empty_like(x)
            dist.scatter(sa, sl, src=0)
            dist.scatter(sb, sl, src=0, group=gloo)
            same(sa, sb, f"scatter {dtype} n={n}")
            checks += 9
    # AVG (gloo has none): compare with gloo's SUM / world
    for dtype in (torch.float32, torch.float64):
        x = data(rank, 1001, dtype) * world
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        dist.all_reduce(b, group=gloo)
        same(a, b / world, f"all_reduce AVG {dtype}")
        checks += 1
    # Non-contiguous inputs and outputs
    base = data(rank, 64 * 33, torch.float32).view(64, 33)
    a, b = torch.empty(33, 64).t().copy_(base), base.clone()
    assert not a.is_contiguous()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    same(a.contiguous(), b, "all_reduce non-contiguous")
    col = data(rank, 64 * 2, torch.int64).view(64, 2)[:, 1]
    la = [torch.empty(64, dtype=torch.int64) for _ in range(world)]
    lb = [torch.empty(64, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(la, col)
    dist.all_gather(lb, col, group=gloo)
    for i in range(world):
        same(la[i], lb[i], "all_gather non-contiguous input")
    checks += 2
    # Point to point: ring with tags, isend/irecv, batch_isend_irecv, ANY_SOURCE
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in (torch.float32, torch.int64, torch.uint8):
        for n in (0, 1, 4097, 1 << 18):
            x = data(rank, n, dtype, salt=5)
            y = torch.empty_like(x)
            reqs = [dist.isend(x, nxt, tag=7), dist.irecv(y, prv, tag=7)]
            for r in reqs:
                r.wait()
            same(y, data(prv, n, dtype, salt=5), f"isend/irecv {dtype} n={n}")
            checks += 1
    # Tags out of order: tag 2 is sent first, received second.
    x1, x2 = torch.full((5,), rank + 1.0), torch.full((9,), rank + 2.0)
    y1, y2 = torch.empty(5), torch.empty(9)
    s2 = dist.isend(x2, nxt, tag=2)
    s1 = dist.isend(x1, nxt, tag=1)
    dist.recv(y1, prv, tag=1)
    dist.recv(y2, prv, tag=2)
    s1.wait(), s2.wait()
    same(y1, torch.full((5,), prv + 1.0), "tagged recv 1")
    same(y2, torch.full((9,), prv + 2.0), "tagged recv 2")
    ops_list = [dist.P2POp(dist.isend, x1, nxt), dist.P2POp(dist.irecv, y1, prv)]
    for r in dist.batch_isend_irecv(ops_list):
        r.wait()
    same(y1, torch.full((5,), prv + 1.0), "batch_isend_irecv")
    # recv from any source at rank 0; the future carries the tensor
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            t = torch.empty(3, dtype=torch.int64)
            w = dist.irecv(t, tag=11)  # src=None: any source
            fut = w.get_future()
            w.wait()
            assert w.is_completed()
            src = int(t[0])
            assert fut.value()[0] is t or torch.equal(fut.value()[0], t)
            seen.add(src)
        assert seen == set(range(1, world)), seen
    else:
        dist.send(torch.full((3,), rank, dtype=torch.int64), 0, tag=11)
    checks += 4
    # Progress without wait(): only is_completed() is polled, so no thread drives the mailbox
    # and its own thread must (docs/torch.md, "Who runs the mailbox").
    polled = torch.empty(4)
    rw = dist.irecv(polled, prv, tag=21)
    sw = dist.isend(torch.full((4,), float(rank)), nxt, tag=21)
    give_up = time.monotonic() + 60
    while not (rw.is_completed() and sw.is_completed()):
        assert time.monotonic() < give_up, "is_completed() never turned true without wait()"
        time.sleep(0.001)
    same(polled, torch.full((4,), float(prv)), "polled irecv")
    # A request made from inside a completion (a then() callback of a recv): it runs on
    # whichever thread completed the recv, while that thread runs the mailbox's tasks.
    first, second, nested = torch.empty(4), torch.empty(4), []

    def post_next(f):
        nested.append(dist.irecv(second, prv, tag=23))
        return f.value()

    fut = dist.irecv(first, prv, tag=22).get_future().then(post_next)
    s1 = dist.isend(torch.full((4,), float(rank)), nxt, tag=22)
    s2 = dist.isend(torch.full((4,), float(rank + 100)), nxt, tag=23)
    fut.wait()
    nested[0].wait()
    s1.wait(), s2.wait()
    same(first, torch.full((4,), float(prv)), "recv whose callback posts a recv")
    same(second, torch.full((4,), float(prv + 100)), "recv posted from a completion callback")
    checks += 3
    # async collective with future chaining
    t = torch.ones(10) * (rank + 1)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future().then(lambda f: f.value()[0] * 2)
    expect = sum(range(1, world + 1)) * 2
    assert torch.equal(fut.wait(), torch.full((10,), float(expect))), fut.wait()
    checks += 1
    if big:
        x = data(rank, 16 << 20, torch.float32)  # 64 MiB
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        same(a, b, "all_reduce 64 MiB")
        y = torch.empty_like(x)
        reqs = [dist.isend(x, nxt), dist.irecv(y, prv)]
        [r.wait() for r in reqs]
        same(y, data(prv, 16 << 20, torch.float32), "send/recv 64 MiB")
        checks += 2
    dist.barrier()
    # CPU tensors never take the low-latency all_gather (CUDA tensors only); without a GPU it is
    # off, saying why.
    ll = st.backend_ll_allgather()
    assert ll["calls"] == 0 and ll["allreduce_calls"] == 0, ll
    assert st.backend_device_collectives() == 0, "a CPU collective took the CUDA device path"
    if not torch.cuda.is_available() or world == 1:
        assert ll["state"].startswith("off: "), ll
    transport = st.backend_transport()
    want = os.environ.get("SLUICE_TORCH_TRANSPORT")
    if want and world > 1:
        assert transport == want, (transport, want)
    dist.destroy_process_group()
    print(f"sluice-torch OK rank={rank} world={world} transport={transport} checks={checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
