"""AllGather–GEMM overlap (python/sluice/ag_gemm.py) against NCCL all_gather_into_tensor + matmul.

Y = AllGather(X_shard) @ W with X_shard [m, k] per rank and W [k, 4k], for the shapes of issue 14
(m per rank 1024..8192, k 4096 and 8192; bf16 and fp16). Per shape, interleaved rounds of:
  nccl            dist.all_gather_into_tensor + torch.mm (the reference and the baseline)
  sluice+mm       the sluice AllGather, then torch.mm (no overlap)
  overlap/<mode>/c<chunks>   AllGatherMatmul, chunks in --chunks, out_mode in --out-modes
  overlap/direct/c<chunks>/so<S>   the same with torch's experimental matmul SM carveout of S SMs
                  (--sm-carveout S,...), so the AllGather kernel finds SMs beside the GEMM
each timed eager and as a CUDA graph (median of --rounds rounds [min-max]); ratio = time / nccl's.

Checks, before timing and after a graph replay with fresh data:
  sluice+mm must be bit-equal to nccl (same gathered bytes, the same single GEMM);
  overlap must be within tolerance of nccl: |y - ref| <= tol * (1 + |ref|), tol = 2 ulps of the
  dtype (bf16 2^-7, fp16 2^-10). The overlap computes each output row block with a smaller GEMM
  (per chunk, and this rank's rows in one GEMM of m rows) than nccl's single [world*m, k] GEMM;
  cuBLAS may choose another kernel (tile, split-K) for it, which changes the fp32 accumulation
  order: the fp32 sums then differ by far less than a bf16/fp16 ulp, and the rounding to the
  output dtype can move by one ulp. Inputs are scaled so |Y| is about 1 (W ~ N(0, 1/k)). The
  table also gives the fraction of bit-equal elements and the largest difference.
  peak+ is the allocator's peak above the steady state during one overlap call given `out`
  (0 means no hidden copy or scratch allocation in the call).

Runs under torchrun (one process per GPU) or spawns --world processes itself:
    SLUICE_LIBRARY=$BIN/libsluice.so python3 tools/sluice-gpu-bench/ag_gemm_bench.py --world 2 --quick
    SLUICE_LIBRARY=$BIN/libsluice.so torchrun --nproc-per-node 2 tools/sluice-gpu-bench/ag_gemm_bench.py
    ... --inter [--ranks-per-node 1] [--nccl-socket]   # HierAllGather, forced inter-node on one host
    ... --json ag_gemm.json --out ag_gemm.md

Exit status: 0 when every check passed, 1 otherwise; 0 with a message when there are not enough GPUs.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

FULL_M = [1024, 2048, 4096, 8192]
FULL_K = [4096, 8192]
QUICK = [(1024, 4096), (4096, 4096), (2048, 8192)]
TOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from sluice_by_path import load  # noqa: E402  (python/sluice's modules without the compiled package)


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def shapes(args):
    """(m, k) pairs to run; n = 4k."""
    if args.m or args.k:
        return [(m, k) for m in (args.m or FULL_M) for k in (args.k or FULL_K)]
    return QUICK if args.quick else [(m, k) for k in FULL_K for m in FULL_M]


def compare(y, ref, tol):
    """(within tolerance, fraction bit-equal, max |diff|) of y against ref."""
    d = (y.float() - ref.float()).abs()
    ok = bool((d <= tol * (1 + ref.float().abs())).all())
    return ok, float((y == ref).float().mean()), float(d.max())


class Timer:
    """Eager and graph timing of one callable, the same way for every variant."""

    def __init__(self, fn, iters, per_graph):
        self.fn, self.iters, self.per_graph = fn, iters, per_graph
        st = torch.cuda.Stream()  # warm-up off the capture stream, as torch.cuda.graph advises
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            fn()
        torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(per_graph):
                fn()
        torch.cuda.synchronize()

    def _time(self, launch, n_ops):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1000 / n_ops

    def eager(self):
        def run():
            for _ in range(self.iters):
                self.fn()
        return self._time(run, self.iters)

    def graphed(self):
        reps = max(1, self.iters // self.per_graph)

        def run():
            for _ in range(reps):
                self.graph.replay()
        return self._time(run, reps * self.per_graph)


def peak_extra(fn):
    """Bytes the allocator's peak rose above the current allocation during one call of fn."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def carveouts(args):
    """The --sm-carveout values, none where this torch has no carveout."""
    vals = [int(v) for v in args.sm_carveout.split(",") if v]
    if vals and not hasattr(torch._C, "_set_sm_carveout_experimental"):
        print(f"ag_gemm_bench: torch {torch.__version__} has no SM carveout; --sm-carveout ignored", flush=True)
        return []
    return vals


def with_carveout(sms, pipe, x, w, y):
    """One pipeline call with torch's (experimental) matmul SM carveout: the GEMMs leave `sms`
    SMs free, so the AllGather kernel (which waits on its peers) can run beside them. A cuBLAS
    GEMM may otherwise fill every SM (Hopper's persistent kernels) and the AllGather of the next
    chunk would only start when it ends. Global state in torch: set and reset around the call
    (a graph keeps what was set when it was captured)."""
    torch._C._set_sm_carveout_experimental(sms)
    try:
        pipe(x, w, out=y)
    finally:
        torch._C._set_sm_carveout_experimental(None)


def make_allgather(args, world, rank, max_bytes):
    """The AllGather under test: intra (NVLink LL) or, with --inter, the hierarchical one."""
    if args.inter:
        hier = load("hier_allgather")
        nodes = [r // args.ranks_per_node for r in range(world)]
        hag = hier.HierAllGather(max_bytes, node_of_rank=nodes, transport=args.transport)
        return hag, f"HierAllGather {world // args.ranks_per_node} nodes x {args.ranks_per_node} over {hag.transport}"
    ag = load("cuda_allgather").AllGather(max_tokens=max_bytes, hidden=1, dtype=torch.uint8)
    return ag, "AllGather (NVLink)"


def run_shape(ag, agg, world, rank, m, k, dtype, args):
    """All variants of one shape: checks, then interleaved timing. Returns rows and failures."""
    n = 4 * k
    g = torch.Generator(device="cuda").manual_seed(1000 * rank + m + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    gw = torch.Generator(device="cuda").manual_seed(7 + k)  # the same W on every rank
    w = (torch.randn(k, n, generator=gw, device="cuda") / k ** 0.5).to(dtype)
    gbuf = torch.empty(world * m, k, dtype=dtype, device="cuda")
    gbuf2 = torch.empty_like(gbuf)
    y_ref = torch.empty(world * m, n, dtype=dtype, device="cuda")
    y_b = torch.empty_like(y_ref)
    y_c = torch.empty_like(y_ref)

    def f_nccl():
        dist.all_gather_into_tensor(gbuf, x)
        torch.mm(gbuf, w, out=y_ref)

    def f_sluice():
        ag.all_gather(x, out=gbuf2)
        torch.mm(gbuf2, w, out=y_b)

    variants = [("nccl", f_nccl, None), ("sluice+mm", f_sluice, None)]
    for mode in args.out_modes.split(","):
        for c in [int(v) for v in args.chunks.split(",")]:
            if c > m:
                continue
            pipe = agg.AllGatherMatmul(ag, max_rows=m, k=k, n=n, dtype=dtype, chunks=c, out_mode=mode,
                                       local_first=not args.no_local_first)
            variants.append((f"overlap/{mode}/c{c}", (lambda p=pipe: p(x, w, out=y_c)), pipe))
            for so in (carveouts(args) if mode == "direct" else []):
                variants.append((f"overlap/{mode}/c{c}/so{so}", (lambda p=pipe, so=so: with_carveout(so, p, x, w, y_c)),
                                 pipe))
    fails = 0
    checks = {}

    def check(name, fn):
        fn()
        torch.cuda.synchronize()
        if hasattr(ag, "check"):
            ag.check()
        if name == "nccl":
            return None
        if name == "sluice+mm":
            ok = torch.equal(y_b, y_ref)
            diff = float((y_b.float() - y_ref.float()).abs().max())
            return ok, (1.0 if ok else float((y_b == y_ref).float().mean())), diff
        return compare(y_c, y_ref, TOL[dtype])

    flops = 2 * world * m * k * n
    est_us = flops / 400e12 * 1e6  # a guess at the GEMM's time, only to size the loops
    iters = max(3, min(args.iters, int(args.budget_ms * 1000 / max(est_us, 1))))
    rows = []
    for name, fn, pipe in variants:
        y_c.fill_(float("nan"))
        f_nccl()
        c = check(name, fn)
        extra = peak_extra(fn) if pipe is not None else None
        checks[name] = (c, extra)
    timers = {name: Timer(fn, iters, args.per_graph) for name, fn, _ in variants}
    res = {name: {"eager": [], "graph": []} for name, _, _ in variants}
    for _ in range(args.rounds):  # interleaved: drift hits every variant alike
        for name, _, _ in variants:
            res[name]["eager"].append(timers[name].eager())
            res[name]["graph"].append(timers[name].graphed())
    # Graph-mode correctness: fresh data, one replay each (nccl's first: it makes the reference).
    x.copy_(torch.randn(m, k, generator=g, device="cuda").to(dtype))
    for name, _, _ in variants:
        y_c.fill_(float("nan"))
        timers[name].graph.replay()
        torch.cuda.synchronize()
        if name == "nccl":
            continue
        if name == "sluice+mm":
            gc = (torch.equal(y_b, y_ref), None, None)
        else:
            gc = compare(y_c, y_ref, TOL[dtype])
        checks[name] = checks[name] + (gc[0],)
    if hasattr(ag, "check"):
        ag.check()
    base = {mode: median(res["nccl"][mode]) for mode in ("eager", "graph")}
    for name, _, _ in variants:
        c, extra = checks[name][:2]
        graph_ok = checks[name][2] if len(checks[name]) > 2 else None
        ok = True if c is None else (c[0] and graph_ok)
        fails += 0 if ok else 1
        row = {"dtype": str(dtype).replace("torch.", ""), "m": m, "k": k, "n": n, "world": world, "variant": name,
               "iters": iters, "ok": ok, "bit_equal_fraction": None if c is None else c[1],
               "max_abs_diff": None if c is None else c[2], "peak_extra_bytes": extra}
        for mode in ("eager", "graph"):
            v = res[name][mode]
            row[mode + "_us"] = median(v)
            row[mode + "_min_us"], row[mode + "_max_us"] = min(v), max(v)
            row[mode + "_ratio"] = median(v) / base[mode]
        rows.append(row)
    del timers
    return rows, fails


def table(rows, head):
    lines = [head, "",
             "Time per call in us, median of the rounds [min-max]; ratio = time / nccl's (issue 14's bar: "
             "<= 0.85 intra-node). check: nccl's result bit-equal (sluice+mm) or within 2 ulps (overlap), "
             "eager and graph; eq = fraction of bit-equal elements; peak+ = allocator peak above steady "
             "state during one call.", "",
             "| dtype | m/rank | k | n | variant | eager | ratio | graph | ratio | check | eq | max diff | peak+ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = lambda md: f"{r[md + '_us']:.0f} [{r[md + '_min_us']:.0f}-{r[md + '_max_us']:.0f}]"  # noqa: E731
        eq = "" if r["bit_equal_fraction"] is None else f"{r['bit_equal_fraction']:.4f}"
        md = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"
        pk = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2 ** 20:.1f} MiB"
        chk = "ref" if r["variant"] == "nccl" else ("ok" if r["ok"] else "FAIL")
        lines.append(f"| {r['dtype']} | {r['m']} | {r['k']} | {r['n']} | {r['variant']} | {c('eager')} | "
                     f"{r['eager_ratio']:.2f} | {c('graph')} | {r['graph_ratio']:.2f} | {chk} | {eq} | {md} | {pk} |")
    return "\n".join(lines)


def worker(rank, world, args, init):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if args.nccl_socket:  # NCCL over the network path too (before its communicator exists)
        os.environ["NCCL_P2P_DISABLE"] = "1"
        os.environ["NCCL_SHM_DISABLE"] = "1"
        if args.transport == "tcp":
            os.environ["NCCL_IB_DISABLE"] = "1"
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", local))
    agg = load("ag_gemm")
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    if args.dtype:
        dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtype.split(",")]
    sh = shapes(args)
    max_bytes = max(m * k for m, k in sh) * 2
    ag, what = make_allgather(args, world, rank, max_bytes)
    rows, fails = [], 0
    for dtype in dtypes:
        for m, k in sh:
            r, f = run_shape(ag, agg, world, rank, m, k, dtype, args)
            rows += r
            fails += f
            if rank == 0:
                print(f"done: {dtype} m={m} k={k} ({f} failed)", flush=True)
            torch.cuda.empty_cache()
    t = torch.tensor([fails], device="cuda")
    dist.all_reduce(t)  # every rank's checks count
    fails = int(t.item())
    if rank == 0:
        nccl = "NCCL forced onto sockets" if args.nccl_socket else "NCCL on its default path"
        head = (f"# AllGather-GEMM overlap, {world} x {torch.cuda.get_device_name(0)}, sluice {what}; {nccl}; "
                f"torch {torch.__version__}")
        text = table(rows, head) + f"\n\nchecks failed: {fails} (all ranks)"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "device": torch.cuda.get_device_name(0), "allgather": what,
                           "nccl": nccl, "torch": torch.__version__, "failed": fails, "rows": rows}, f, indent=1)
    dist.barrier()
    if hasattr(ag, "close"):
        ag.close()
    dist.destroy_process_group()
    return fails


def _spawned(rank, world, args, init):
    if worker(rank, world, args, init):
        sys.exit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--quick", action="store_true", help="3 shapes, bf16 only")
    p.add_argument("--m", type=int, action="append", help="rows per rank (repeatable); default 1024..8192")
    p.add_argument("--k", type=int, action="append", help="hidden (repeatable); default 4096 and 8192")
    p.add_argument("--dtype", default="", help="bf16,fp16 (default both; --quick: bf16)")
    p.add_argument("--chunks", default="2,4,8")
    p.add_argument("--out-modes", default="direct,copy")
    p.add_argument("--no-local-first", action="store_true")
    p.add_argument("--sm-carveout", default="", help="e.g. 16,32: also overlap/direct with torch's "
                   "experimental matmul SM carveout (SMs left to the AllGather)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="calls per timing (fewer for large shapes)")
    p.add_argument("--budget-ms", type=float, default=40.0, help="about this long per timing")
    p.add_argument("--per-graph", type=int, default=2, help="calls captured per graph")
    p.add_argument("--inter", action="store_true", help="HierAllGather (forced inter-node on one host)")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--transport", default="", help="--inter: tcp, rdma or empty (automatic)")
    p.add_argument("--nccl-socket", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for NCCL")
    p.add_argument("--out", default="", help="markdown table here")
    p.add_argument("--json", default="", help="rows as JSON here")
    args = p.parse_args()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2 or have < (int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else world):
        print(f"ag_gemm_bench: skipped, needs {max(2, world)} GPUs (one per rank), have {have}")
        return 0
    if world % args.ranks_per_node:
        print("--ranks-per-node must divide the world size")
        return 2
    if under_torchrun:
        return 1 if worker(int(os.environ["RANK"]), world, args, "env://") else 0
    import random
    import torch.multiprocessing as mp
    init = f"tcp://127.0.0.1:{random.randint(20000, 40000)}"
    try:
        mp.spawn(_spawned, args=(world, args, init), nprocs=world, join=True)
    except Exception as e:  # a rank raised or exited non-zero (a failed check)
        print(f"ag_gemm_bench: a rank failed: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
