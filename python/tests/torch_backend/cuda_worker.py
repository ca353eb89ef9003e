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
4. The low-latency all_gather (one NVLink kernel on the caller's stream, docs/torch.md): all_gather
   and all_gather_into_tensor below, at and above the threshold (1 MiB, and 4 KiB on a second
   group) in six dtypes, bit for bit against gloo and NCCL, the backend's counter saying which
   calls took it, Work/stream semantics and a CUDA graph replayed twice; off (and still right) on
   the host-path group, on a threshold-0 group, and wherever ranks share a GPU.
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


def ll_calls(group) -> int:
    return st.backend_ll_allgather(group)["calls"]


def ll_allgather_checks(sl, gloo, nccl, rank: int, world: int, dev: torch.device, expect_ll: bool,
                        threshold: int) -> int:
    """all_gather and all_gather_into_tensor of CUDA tensors on `sl` below, at and above the
    low-latency threshold, bit for bit against gloo on CPU tensors and, given `nccl`, against
    NCCL; `expect_ll`: calls of at most `threshold` bytes per rank must take the low-latency
    path (the backend's counter), larger ones must not. Returns the number of checks."""
    checks = 0
    poison = 77  # not a value data() makes, in any dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.float16):
        es = torch.empty(0, dtype=dtype).element_size()
        counts = sorted({0, 1, 7, 1001, 65_537, max(threshold // es - 1, 0), threshold // es,
                         threshold // es + 1, threshold // es + 4099})
        for n in counts:
            nbytes = n * es
            what = f"ll all_gather {dtype} n={n} ({nbytes} B/rank, threshold {threshold})"
            x = data(rank, n, dtype, salt=31)
            want = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(want, x, group=gloo)
            xc = x.to(dev)
            before = ll_calls(sl)
            out = torch.full((n * world,), poison, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, xc, group=sl)
            same(out, want, f"{what}: into_tensor")
            outs = [torch.full((n,), poison, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, xc, group=sl)
            for i in range(world):
                same(outs[i], want[i * n:(i + 1) * n], f"{what}: list[{i}]")
            took = ll_calls(sl) - before
            exp = 2 if expect_ll and 0 < nbytes <= threshold else 0  # 0 bytes: no kernel
            assert took == exp, f"{what}: {took} of 2 calls took the low-latency path, expected {exp} " \
                                f"({st.backend_ll_allgather(sl)['state']})"
            if nccl is not None and n > 0:
                ref = torch.full((n * world,), poison, dtype=dtype, device=dev)
                dist.all_gather_into_tensor(ref, xc, group=nccl)
                same(out, ref, f"{what}: against nccl")
                checks += 1
            checks += 3
    # Shapes, non-contiguous input and outputs (contiguous copies on the stream, same path).
    n = 3001
    base = data(rank, 2 * n, torch.float32, salt=33)
    x = base[::2]
    want = torch.empty(n * world)
    dist.all_gather_into_tensor(want, x.contiguous(), group=gloo)
    before = ll_calls(sl)
    big = torch.full((2 * n * world,), float(poison), device=dev)
    dist.all_gather_into_tensor(big[1::2], base.to(dev)[::2], group=sl)
    same(big[1::2], want, "ll non-contiguous into_tensor")
    same(big[0::2], torch.full((n * world,), float(poison)), "ll non-contiguous: the other elements untouched")
    bigs = [torch.full((2 * n,), float(poison), device=dev) for _ in range(world)]
    dist.all_gather([b[::2] for b in bigs], base.to(dev)[::2], group=sl)
    for i in range(world):
        same(bigs[i][::2], want[i * n:(i + 1) * n], f"ll non-contiguous list[{i}]")
    x2 = data(rank, 15, torch.int32, salt=34).view(3, 5)
    want2 = torch.empty(3 * world, 5, dtype=torch.int32)
    dist.all_gather_into_tensor(want2, x2, group=gloo)
    out2 = torch.full((3 * world, 5), poison, dtype=torch.int32, device=dev)
    dist.all_gather_into_tensor(out2, x2.to(dev), group=sl)
    same(out2, want2, "ll 2-d into_tensor")
    took = ll_calls(sl) - before
    exp = (2 * (n * 4 <= threshold) + (15 * 4 <= threshold)) if expect_ll else 0
    assert took == exp, f"ll shapes: {took} calls took the low-latency path, expected {exp}"
    checks += 4
    # Stream order and Work semantics: the input is written on a side stream that is current
    # during the op (after ~10 ms of GPU sleep); async_op; wait() on another stream; polling
    # is_completed(); the future.
    n = 4096
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    expect_out = torch.cat([torch.full((n,), float(r + 1)) for r in range(world)])
    with torch.cuda.stream(s1):
        x = torch.empty(n, device=dev)
        out = torch.full((n * world,), float(poison), device=dev)
        torch.cuda._sleep(20_000_000)
        x.fill_(float(rank + 1))
        work = dist.all_gather_into_tensor(out, x, group=sl, async_op=True)
    with torch.cuda.stream(s2):
        work.wait()  # s2 waits for the op
        y = out * 2
    s2.synchronize()
    same(y, expect_out * 2, "ll stream order (wait on another stream)")
    while not work.is_completed():
        pass
    assert work.is_success()
    fut = work.get_future()
    val = fut.wait()
    same(val[0], expect_out, "ll future value")
    with torch.cuda.stream(s1):
        torch.cuda._sleep(20_000_000)
        x.fill_(float(rank + 10))
        work = dist.all_gather_into_tensor(out, x, group=sl, async_op=True)
        chained = work.get_future().then(lambda f: f.value()[0] * 3)
    got = chained.wait()
    torch.cuda.current_stream().synchronize()
    same(got, torch.cat([torch.full((n,), float(r + 10)) for r in range(world)]) * 3, "ll future then()")
    checks += 4
    # Works' events are reused once their Works are gone (event_pool.hpp): 100 Works alive at
    # once (more than a device's pool keeps), their futures asked for late, then 100 more after
    # they are dropped; every output checked, every Work completed.
    for phase in range(2):
        outs = [torch.full((64 * world,), float(poison), device=dev) for _ in range(100)]
        works = [dist.all_gather_into_tensor(o, torch.full((64,), float(rank * 1000 + i + phase), device=dev),
                                             group=sl, async_op=True) for i, o in enumerate(outs)]
        for i, (w, o) in enumerate(zip(works, outs)):
            val = w.get_future().wait()[0] if i % 2 else (w.wait(), o)[1]
            same(val, torch.cat([torch.full((64,), float(r * 1000 + i + phase)) for r in range(world)]),
                 f"ll work {i} of 100 alive at once (phase {phase})")
        torch.cuda.current_stream().synchronize()
        assert all(w.is_completed() for w in works), "a Work of the 100 never completed"
        del works, outs
    checks += 2
    # A CUDA graph: captured once (after the warm-up calls above set the path up), replayed
    # twice with new inputs.
    n = 1000
    xg = torch.empty(n, device=dev)
    og = torch.full((n * world,), float(poison), device=dev)
    lg = [torch.full((n,), float(poison), device=dev) for _ in range(world)]
    xg.copy_(data(rank, n, torch.float32, salt=40).to(dev))
    dist.all_gather_into_tensor(og, xg, group=sl)  # warm-up on this stream
    torch.cuda.synchronize()
    before = ll_calls(sl)
    if expect_ll:
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of these processes (NCCL's watchdog, the engine's progress
        # threads) may query events meanwhile, which a global-mode capture would fail on; the
        # capturing thread itself (the backend's launch path) is held to the strict rules.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            dist.all_gather_into_tensor(og, xg, group=sl)
            dist.all_gather(lg, xg, group=sl)
        assert ll_calls(sl) - before == 2, "the captured calls did not take the low-latency path"
        for rep in range(2):
            xg.copy_(data(rank, n, torch.float32, salt=41 + rep).to(dev))
            og.fill_(float(poison))
            for t in lg:
                t.fill_(float(poison))
            graph.replay()
            torch.cuda.synchronize()
            want = torch.cat([data(r, n, torch.float32, salt=41 + rep) for r in range(world)])
            same(og, want, f"ll graph replay {rep}: into_tensor")
            for i in range(world):
                same(lg[i], want[i * n:(i + 1) * n], f"ll graph replay {rep}: list[{i}]")
            checks += 2
        assert ll_calls(sl) - before == 2, "replays must not count as calls"
        # eager calls after the graph still work, on this stream and on another one
        for k, stream in enumerate((torch.cuda.current_stream(), torch.cuda.Stream())):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                xg.copy_(data(rank, n, torch.float32, salt=50 + k).to(dev))
                dist.all_gather_into_tensor(og, xg, group=sl)
            stream.synchronize()
            same(og, torch.cat([data(r, n, torch.float32, salt=50 + k) for r in range(world)]),
                 f"ll eager after the graph, stream {k}")
            checks += 1
        del graph
    return checks


def ll_state_checks(group, rank: int, world: int, dev: torch.device, want_off: str) -> int:
    """A group where the low-latency path must be off, saying `want_off`; its all_gather still
    gives the right bits (host staging)."""
    n = 257
    x = data(rank, n, torch.float32, salt=60).to(dev)
    out = torch.empty(n * world, device=dev)
    dist.all_gather_into_tensor(out, x, group=group)
    same(out, torch.cat([data(r, n, torch.float32, salt=60) for r in range(world)]), f"off ({want_off})")
    y = data(rank, n, torch.float32, salt=61).to(dev)
    dist.all_reduce(y, group=group)
    same(y, ordered_reduce([data(r, n, torch.float32, salt=61) for r in range(world)], dist.ReduceOp.SUM, world),
         f"all_reduce off ({want_off})")
    info = st.backend_ll_allgather(group)
    assert info["calls"] == 0 and info["allreduce_calls"] == 0, info
    assert info["state"].startswith("off") and want_off in info["state"], info
    return 2


def ordered_reduce(parts, op, world):
    """The backend's reduction: rank order, in the dtype (reduce_ops.hpp)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            acc.add_(p)
        elif op == dist.ReduceOp.PRODUCT:
            acc.mul_(p)
        elif op == dist.ReduceOp.MIN:
            acc = torch.minimum(acc, p)
        else:
            acc = torch.maximum(acc, p)
    return acc.div_(world) if op == dist.ReduceOp.AVG else acc


def ll_allreduce_checks(sl, rank: int, world: int, dev: torch.device, expect: bool) -> int:
    """all_reduce of CUDA tensors up to the low-latency threshold: every rank's tensor through
    the low-latency AllGather, then the rank-ordered reduction, on the caller's stream. Bit-equal
    to that reduction computed here: every op the dtype allows, 1, 7, 1001 elements and the
    threshold; a non-contiguous tensor (the elements between untouched); a CUDA graph replayed
    with new inputs. Counted (allreduce_calls) when the group takes the path, none otherwise."""
    checks = calls = 0
    before = st.backend_ll_allgather(sl)["allreduce_calls"]
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        esz = torch.tensor([], dtype=dtype).element_size()
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
        ops += [dist.ReduceOp.AVG] if dtype.is_floating_point else []
        for n in (1, 7, 1001, (1 << 20) // esz):
            for op in ops if n <= 1001 else [dist.ReduceOp.SUM]:
                xs = [data(r, n, dtype, salt=21) for r in range(world)]
                t = xs[rank].to(dev)
                dist.all_reduce(t, op=op, group=sl)
                same(t, ordered_reduce(xs, op, world), f"ll all_reduce {op} {dtype} n={n}")
                checks += 1
                calls += 1
    n = 4096
    wide = data(rank, 2 * n, torch.float32, salt=22).to(dev)
    v = wide[::2]
    dist.all_reduce(v, group=sl)
    same(v, ordered_reduce([data(r, 2 * n, torch.float32, salt=22)[::2] for r in range(world)], dist.ReduceOp.SUM,
                           world), "ll all_reduce non-contiguous")
    same(wide[1::2], data(rank, 2 * n, torch.float32, salt=22)[1::2], "ll all_reduce: the elements between")
    checks += 2
    calls += 1
    if expect:
        x = torch.zeros(1000, device=dev)
        dist.all_reduce(x, group=sl)  # warm-up on this stream
        torch.cuda.synchronize()
        calls += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            dist.all_reduce(x, group=sl)
        calls += 1
        for rep in range(2):
            x.copy_(data(rank, 1000, torch.float32, salt=23 + rep).to(dev))
            graph.replay()
            torch.cuda.synchronize()
            want = ordered_reduce([data(r, 1000, torch.float32, salt=23 + rep) for r in range(world)],
                                  dist.ReduceOp.SUM, world)
            same(x, want, f"ll all_reduce graph replay {rep}")
            checks += 1
    took = st.backend_ll_allgather(sl)["allreduce_calls"] - before
    if expect:
        assert took == calls, f"{took} of {calls} all_reduce calls took the low-latency path"
    else:
        assert took == 0, f"{took} all_reduce calls took the low-latency path where it is off"
    return checks + 1


def device_collective_checks(rank: int, world: int, dev: torch.device, expect: bool) -> int:
    """Collectives GPU to GPU (SLUICE_TORCH_DEVICE_COLLECTIVES, on by default; the low-latency all_gather off
    so that every size takes the device path), bit-equal to what every rank can compute:
    all_gather_into_tensor at the rendezvous size, an odd size and 64 MiB per rank, three dtypes,
    an input at an offset inside a larger allocation and a non-contiguous one, the bytes around
    the output unchanged; all_to_all_single with even and uneven splits, and with a slice too
    small for the path (it stages); broadcast from the first and the last rank; all_reduce with
    every reduce op the dtype allows (a short last chunk, 64 MiB, and a size that stages) and
    reduce_scatter_tensor (a separate output, one aliasing the input, one that stages). The calls that
    took the path are counted when the group has device endpoints to every peer (expect), none
    otherwise."""
    # The path is on by default: the group is made without SLUICE_TORCH_DEVICE_COLLECTIVES.
    saved = os.environ.pop("SLUICE_TORCH_DEVICE_COLLECTIVES", None)
    os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"] = "0"
    grp = dist.new_group(backend="cpu:sluice,cuda:sluice")
    if saved is not None:
        os.environ["SLUICE_TORCH_DEVICE_COLLECTIVES"] = saved
    del os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"]
    checks = 0
    calls = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        esz = torch.tensor([], dtype=dtype).element_size()
        for nbytes in (256 << 10, (4 << 20) + 4 * esz, 64 << 20):
            n = nbytes // esz
            big = torch.full((n + 3 * 64,), 7, dtype=dtype, device=dev)
            x = big[64:64 + n]  # at an offset in its allocation
            x.copy_(data(rank, n, dtype, salt=5).to(dev))
            out_all = torch.full((world * n + 2 * 64,), 9, dtype=dtype, device=dev)
            out = out_all[64:64 + world * n]
            dist.all_gather_into_tensor(out, x, group=grp)
            torch.cuda.synchronize(dev)
            want = torch.cat([data(r, n, dtype, salt=5) for r in range(world)])
            same(out, want, f"device all_gather_into_tensor {dtype} {nbytes} B")
            same(out_all[:64], torch.full((64,), 9, dtype=dtype), "bytes before the output")
            same(out_all[64 + world * n:], torch.full((64,), 9, dtype=dtype), "bytes after the output")
            checks += 3
            calls += 1
    # A non-contiguous input (every other element of a larger tensor) is sent from a copy.
    n = 1 << 20
    wide = data(rank, 2 * n, torch.float32, salt=6).to(dev)
    out = torch.empty(world * n, dtype=torch.float32, device=dev)
    dist.all_gather_into_tensor(out, wide[::2], group=grp)
    torch.cuda.synchronize(dev)
    same(out, torch.cat([data(r, 2 * n, torch.float32, salt=6)[::2] for r in range(world)]), "non-contiguous input")
    checks += 1
    calls += 1
    # all_to_all_single: even splits of 64 MiB, then uneven ones (every slice at least the
    # rendezvous size), then one with a small slice, which stages (not counted) and is right too.
    rows = 1 << 16  # float32 rows of 64 elements = 256 B each
    for splits, counted in ((None, True), ([(r + 1) * 1024 + 1024 for r in range(world)], True),
                            ([8] + [2048] * (world - 1), False)):
        in_splits = splits if splits is not None else [rows // world] * world
        # What rank r sends to j is j's receive from r: out_splits[r] on j = in_splits of r at j.
        send_rows = [s_ + rank for s_ in in_splits] if splits is not None and counted else in_splits
        recv_rows = [(in_splits[rank] + r) if splits is not None and counted else in_splits[rank] for r in range(world)]
        x = data(rank, sum(send_rows) * 64, torch.float32, salt=7).to(dev).view(-1, 64)
        out = torch.empty(sum(recv_rows), 64, dtype=torch.float32, device=dev)
        dist.all_to_all_single(out, x, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=grp)
        torch.cuda.synchronize(dev)
        parts = []
        for r in range(world):
            r_send = [s_ + r for s_ in in_splits] if splits is not None and counted else in_splits
            xr = data(r, sum(r_send) * 64, torch.float32, salt=7).view(-1, 64)
            off = sum(r_send[:rank])
            parts.append(xr[off:off + r_send[rank]])
        same(out, torch.cat(parts), f"device all_to_all_single splits={splits}")
        checks += 1
        calls += 1 if counted else 0
    # broadcast of 16 MiB from the first and from the last rank.
    for root in (0, world - 1):
        t = data(rank, 4 << 20, torch.float32, salt=8 + root).to(dev)
        dist.broadcast(t, src=root, group=grp)
        torch.cuda.synchronize(dev)
        same(t, data(root, 4 << 20, torch.float32, salt=8 + root), f"device broadcast from rank {root}")
        checks += 1
        calls += 1
    # all_reduce (reduce-scatter, then all-gather; the reduction on the GPU) and
    # reduce_scatter_tensor: bit-equal to the rank-ordered reduction every rank can compute
    # (small integers, so exact in every dtype here).
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        esz = torch.tensor([], dtype=dtype).element_size()
        per = (256 << 10) // esz + 100  # every chunk of the algorithm at least the rendezvous size
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
        ops += [dist.ReduceOp.AVG] if dtype.is_floating_point else []
        # (elements, counted): a short last chunk; 64 MiB; a last chunk below the rendezvous
        # size, so the call stages (not counted) and must be right too.
        for numel, counted in ((per * world - 50, True), ((64 << 20) // esz, True), (per * (world - 1) + 10, False)):
            for op in ops if numel < (1 << 20) else [dist.ReduceOp.SUM]:
                xs = [data(r, numel, dtype, salt=12) for r in range(world)]
                t = xs[rank].to(dev)
                dist.all_reduce(t, op=op, group=grp)
                torch.cuda.synchronize(dev)
                same(t, ordered_reduce(xs, op, world), f"device all_reduce {op} {dtype} n={numel}")
                checks += 1
                calls += 1 if counted else 0
        # reduce_scatter_tensor: a separate output, then the output aliasing its own chunk of
        # the input (as FSDP does), then an output too small for the path (stages).
        for m, alias, counted in ((per + 7, False, True), (per + 7, True, True), (100, False, False)):
            op = dist.ReduceOp.SUM if dtype == torch.int64 else dist.ReduceOp.AVG
            bigs = [data(r, m * world, dtype, salt=13) for r in range(world)]
            inp = bigs[rank].to(dev)
            if alias:
                out = inp[rank * m:(rank + 1) * m]
            else:
                out_all = torch.full((m + 128,), 9, dtype=dtype, device=dev)
                out = out_all[64:64 + m]
            dist.reduce_scatter_tensor(out, inp, op=op, group=grp)
            torch.cuda.synchronize(dev)
            want = ordered_reduce([b[rank * m:(rank + 1) * m] for b in bigs], op, world)
            same(out, want, f"device reduce_scatter_tensor {dtype} m={m} alias={alias}")
            if not alias:
                same(out_all[:64], torch.full((64,), 9, dtype=dtype), "bytes before the reduce_scatter output")
                same(out_all[64 + m:], torch.full((64,), 9, dtype=dtype), "bytes after the reduce_scatter output")
            checks += 1
            calls += 1 if counted else 0
    took = st.backend_device_collectives(grp)
    if expect:
        assert took == calls, f"{took} of {calls} collectives took the device path"
    else:
        assert took == 0, f"{took} collectives took the device path without device endpoints"
    checks += 1
    dist.destroy_process_group(grp)
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

    # The low-latency all_gather (one NVLink kernel on the caller's stream): on the group above
    # at the default threshold (SLUICE_TORCH_LL_ALLGATHER_BYTES, 1 MiB), on one made with a 4 KiB threshold, and off on
    # the host-staging group and on one made with the threshold 0.
    nccl = dist.new_group(backend="nccl") if own_gpu else None
    expect_ll = own_gpu and want == "nvlink"
    # The main group was made with the environment's threshold (unset: the default, 1 MiB).
    main_on = expect_ll and int(os.environ.get("SLUICE_TORCH_LL_ALLGATHER_BYTES", str(1 << 20)) or "0") >= 1 << 20
    before = ll_calls(sl)
    checks += ll_allgather_checks(sl, gloo, nccl, rank, world, dev, main_on, 1 << 20)
    checks += ll_allreduce_checks(sl, rank, world, dev, main_on)
    info = st.backend_ll_allgather(sl)
    if main_on:
        assert before > 0, f"cuda_on_sluice's small all_gathers did not take the low-latency path: {info}"
        assert info["state"].startswith("on:"), info
    else:
        assert info["calls"] == 0 and info["state"].startswith("off"), info
        if rank == 0:
            print(f"cuda_worker: the low-latency all_gather is off here, as expected: {info['state']}", flush=True)
    os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"] = "4096"
    small = dist.new_group(backend="cpu:sluice,cuda:sluice")
    del os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"]
    checks += ll_allgather_checks(small, gloo, nccl, rank, world, dev, expect_ll, 4096)
    checks += ll_state_checks(hsl, rank, world, dev, "SLUICE_TORCH_CUDA_PATH=host")
    os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"] = "0"
    zero = dist.new_group(backend="cpu:sluice,cuda:sluice")
    del os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"]
    checks += ll_state_checks(zero, rank, world, dev, "SLUICE_TORCH_LL_ALLGATHER_BYTES=0")
    dist.barrier(group=gloo)
    # Collectives GPU to GPU (opt-in until this has passed on GPUs; docs/torch.md).
    checks += device_collective_checks(rank, world, dev, want == "nvlink")
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    print(f"sluice-torch-cuda OK rank={rank} checks={checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
