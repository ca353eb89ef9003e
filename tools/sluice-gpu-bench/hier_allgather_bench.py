"""Hierarchical AllGather (python/sluice/hier_allgather.py) against NCCL all_gather_into_tensor.

One host, `--world` GPUs split into nodes of `--ranks-per-node` (1 = every rank its own node:
the forced inter-node path, port channels over tcp/rdma between GPUs of one host). Checks that
both give the same bytes at every size (1 KiB .. --max-mib per rank, eager and CUDA graph), then
times both, interleaved (sluice, NCCL, sluice, ... per round), median of --rounds rounds and
the spread (min-max). Markdown table to --out.

    SLUICE_LIBRARY=$BIN/libsluice.so python3 tools/sluice-gpu-bench/hier_allgather_bench.py \\
        --world 2 --ranks-per-node 1 --out hier-2x1.md
    ... --world 4 --ranks-per-node 2 --out hier-2x2.md
    ... --world 2 --ranks-per-node 1 --nccl-socket --out hier-2x1-socket.md  # NCCL over sockets too
    ... --world 2 --ranks-per-node 1 --kill-test       # one rank dies mid-loop; the others must raise

Exit status: 0 when every comparison is equal (or the kill test passed), 1 otherwise.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from sluice_by_path import load  # noqa: E402  (python/sluice's modules without the compiled package)


def load_hier():
    return load("hier_allgather")


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def setup(rank, world, args, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if args.nccl_socket:  # NCCL over the network path too (set before its communicator exists)
        os.environ["NCCL_P2P_DISABLE"] = "1"
        os.environ["NCCL_SHM_DISABLE"] = "1"
        if args.transport == "tcp":
            os.environ["NCCL_IB_DISABLE"] = "1"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    hier = load_hier()
    nodes = [r // args.ranks_per_node for r in range(world)]
    return hier, nodes


def bench(rank, world, args, port):
    hier, nodes = setup(rank, world, args, port)
    max_bytes = args.max_mib << 20
    hag = hier.HierAllGather(max_bytes, node_of_rank=nodes, transport=args.transport, timeout_ms=args.timeout_ms)
    sizes = [1 << k for k in range(10, 27, 2) if (1 << k) <= max_bytes]
    inp = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
    o1 = torch.empty(world * max_bytes, dtype=torch.uint8, device="cuda")
    o2 = torch.empty_like(o1)
    rows, fails = [], 0
    for nb in sizes:
        x = inp[:nb]
        a, b = o1[: world * nb], o2[: world * nb]
        g = torch.Generator(device="cuda").manual_seed(1000 * rank + nb)
        x.copy_(torch.randint(0, 256, (nb,), generator=g, device="cuda", dtype=torch.uint8))
        a.fill_(0xEE)
        dist.all_gather_into_tensor(b, x)
        hag.all_gather(x, out=a)
        torch.cuda.synchronize()
        hag.check()
        ok = torch.equal(a, b)
        iters = args.iters if nb <= (1 << 20) else max(3, args.iters // 10)

        def t_eager(fn):
            dist.barrier()
            torch.cuda.synchronize()
            for _ in range(3):
                fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1000 / iters

        def make_graph(fn, n):
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                fn()
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(n):
                    fn()
            return gr

        def t_graph(gr, n):
            dist.barrier()
            torch.cuda.synchronize()
            gr.replay()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = max(2, iters // n)
            s.record()
            for _ in range(reps):
                gr.replay()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1000 / (reps * n)

        f_s = lambda: hag.all_gather(x, out=a)  # noqa: E731
        f_n = lambda: dist.all_gather_into_tensor(b, x)  # noqa: E731
        per_graph = 5
        g_s, g_n = make_graph(f_s, per_graph), make_graph(f_n, per_graph)
        res = {"se": [], "ne": [], "sg": [], "ng": []}
        for _ in range(args.rounds):  # interleaved: drift on the host hits both alike
            res["se"].append(t_eager(f_s))
            res["ne"].append(t_eager(f_n))
            res["sg"].append(t_graph(g_s, per_graph))
            res["ng"].append(t_graph(g_n, per_graph))
        # Graph-mode correctness: fresh data, one replay each, compare.
        x.copy_(torch.randint(0, 256, (nb,), generator=g, device="cuda", dtype=torch.uint8))
        a.fill_(0xEE)
        g_s.replay()
        g_n.replay()
        torch.cuda.synchronize()
        hag.check()
        ok2 = torch.equal(a, b)
        fails += (0 if ok else 1) + (0 if ok2 else 1)
        rows.append((nb, {k: (median(v), min(v), max(v)) for k, v in res.items()}, ok, ok2))
        del g_s, g_n
    dist.barrier()
    if rank == 0:
        nodes_n = world // args.ranks_per_node
        path = "NCCL forced onto sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)" if args.nccl_socket else \
            "NCCL on its default path"
        lines = [f"# Hierarchical AllGather, {world} x {torch.cuda.get_device_name(0)}, {nodes_n} nodes x "
                 f"{args.ranks_per_node} (one host), sluice over {hag.transport}; {path}",
                 "",
                 f"Time per op in us, median of {args.rounds} interleaved rounds [min-max]; uint8; "
                 "algbw = world*size/time.",
                 "",
                 "| size/rank | sluice eager | NCCL eager | ratio | sluice graph | NCCL graph | ratio | "
                 "sluice graph algbw GB/s | equal eager | equal graph |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for nb, r, ok, ok2 in rows:
            c = lambda k: f"{r[k][0]:.1f} [{r[k][1]:.1f}-{r[k][2]:.1f}]"  # noqa: E731
            bw = world * nb / (r["sg"][0] * 1e-6) / 1e9
            lines.append(f"| {human(nb)} | {c('se')} | {c('ne')} | {r['se'][0] / r['ne'][0]:.2f} | {c('sg')} | "
                         f"{c('ng')} | {r['sg'][0] / r['ng'][0]:.2f} | {bw:.2f} | {'yes' if ok else 'NO'} | "
                         f"{'yes' if ok2 else 'NO'} |")
        lines += ["", f"correctness: {len(rows) * 2 - fails}/{len(rows) * 2} comparisons bit-equal to NCCL"]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    hag.close()
    dist.destroy_process_group()
    if fails:
        sys.exit(1)


def kill_worker(rank, world, args, port, result_dir):
    hier, nodes = setup(rank, world, args, port)
    hag = hier.HierAllGather(1 << 20, node_of_rank=nodes, transport=args.transport, timeout_ms=args.timeout_ms)
    victim = world - 1
    x = torch.full((65536,), rank, dtype=torch.uint8, device="cuda")
    out = torch.empty(world * 65536, dtype=torch.uint8, device="cuda")
    last_ok = time.monotonic()
    outcome = "no error after 100000 calls"
    try:
        for i in range(100000):
            if rank == victim and i == 50:
                os.kill(os.getpid(), 9)  # mid-loop, with calls of the others in flight
            hag.all_gather(x, out=out)
            if i % 10 == 9:
                torch.cuda.synchronize()
                hag.check()
                last_ok = time.monotonic()
    except hier.HierAllGatherError as e:
        took = time.monotonic() - last_ok
        good = e.code in (hier.PEER_LOST, hier.TIMEOUT, hier.CLOSED) and "HierAllGather" in str(e)
        # A rank whose own steps succeeded learns of the failure when its next wait for a failed
        # rank's credit or data times out: up to about two timeouts after the kill (three with
        # an intra-node phase in between), plus the 10 calls between checks.
        limit = 3 * args.timeout_ms / 1000 + 10
        outcome = ("ok" if good and took < limit else "bad") + f": code {e.code} after {took:.1f} s " \
            f"(limit {limit:.0f} s): {e}"
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(outcome + "\n")
    os._exit(0)  # the process group lost a member: skip its teardown


def kill_test(args, port):
    import tempfile
    world = args.world
    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="hier-kill-")
    procs = [ctx.Process(target=kill_worker, args=(r, world, args, port, d)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120 + 3 * args.timeout_ms / 1000
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    failed = 0
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            print(f"rank {r}: HUNG (still running at the deadline)")
            failed += 1
            continue
        if r == world - 1:
            ok = p.exitcode == -9
            print(f"rank {r} (victim): exit code {p.exitcode} ({'killed' if ok else 'NOT killed by the test'})")
            failed += 0 if ok else 1
            continue
        path = os.path.join(d, f"rank{r}")
        text = open(path).read().strip() if os.path.exists(path) else f"no result (exit code {p.exitcode})"
        print(f"rank {r}: exit code {p.exitcode}: {text}")
        failed += 0 if (p.exitcode == 0 and text.startswith("ok")) else 1
    print("kill test: " + ("PASSED" if not failed else f"FAILED ({failed} ranks)"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    p.add_argument("--ranks-per-node", type=int, default=1, help="1 = every rank its own node (forced inter)")
    p.add_argument("--transport", default="", help="tcp, rdma or empty (rdma when the host has it)")
    p.add_argument("--timeout-ms", type=int, default=10000)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nccl-socket", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for NCCL")
    p.add_argument("--kill-test", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world or args.world < 2:
        print(f"hier_allgather_bench: skipped, needs {max(2, args.world)} GPUs, have "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        sys.exit(0)
    if args.world % args.ranks_per_node or args.ranks_per_node > 8:
        print("--ranks-per-node must divide --world and be at most 8")
        sys.exit(2)
    import random
    port = random.randint(20000, 40000)
    if args.kill_test:
        sys.exit(kill_test(args, port))
    mp.spawn(bench, args=(args.world, args, port), nprocs=args.world, join=True)
