"""Time the same torch.distributed operation through `sluice` and a baseline in one run,
interleaved (sluice, baseline, sluice, ...), and print medians with their spread. The baseline
is `gloo` on CPU tensors and `nccl` on CUDA tensors.

    torchrun --nproc_per_node=2 tools/sluice-torch-bench/bench.py [--ops sendrecv,all_reduce,all_gather,reduce_scatter]
        [--min-bytes 8] [--max-bytes 268435456] [--iters 20] [--markdown] [--device cpu|cuda]

--wakeups also counts, per call and per thread name of rank 0's process, how often its threads went
to sleep (voluntary context switches, /proc/self/task/*/status) over a further --iters calls run
back to back after the timed ones (a send/recv call = one round trip): where a message's time
goes in wake-ups (docs/torch.md, "Who runs the mailbox").

send/recv is a ping-pong between ranks 0 and 1 (one-way time = half the round trip); the
collectives run on every rank. Rank 0 prints one row per (op, size): the median time of each
backend with the spread of the samples (10th-90th percentile), the median bandwidth (bytes
per rank / time), and sluice's speedup over the baseline (median over median). --markdown prints
the rows as a Markdown table (docs/torch.md). SLUICE_TORCH_TRANSPORT=tcp forces tcp.
--device cuda times CUDA tensors (rank r on GPU r % count; a collective's sample is
--back-to-back calls, default 10, issued back to back and ended by one torch.cuda.synchronize(),
time per call; a send/recv sample is one ping-pong) against NCCL in the same processes (gloo's tcp pairs abort the process
on CUDA tensors). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set here).
--baseline names another baseline: `sluice-host` is a second sluice group whose CUDA tensors go
through host memory (SLUICE_TORCH_CUDA_PATH=host), against the device path of the first, e.g.
with both ranks on one GPU, where NCCL refuses to run.
all_gather on CUDA tensors of up to SLUICE_TORCH_LL_ALLGATHER_BYTES per rank (default 1 MiB; 0 turns it off) takes
the low-latency NVLink kernel where the group allows it (docs/torch.md); the header says whether
it is on, and the last line how many of the timed calls took it. For issue 12's small-message
bar on two GPUs:
    torchrun --nproc_per_node=2 tools/sluice-torch-bench/bench.py --device cuda --ops all_gather \
        --max-bytes 1048576 --iters 200 --markdown
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

import sluice.torch as st


def sizes(lo: int, hi: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if s < (1 << 20) else 2
    return out


def thread_sleeps() -> Dict[str, int]:
    """Voluntary context switches of this process's threads so far, summed per thread name."""
    out: Dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[name] = out.get(name, 0) + int(line.split()[1])
        except OSError:  # the thread ended meanwhile
            pass
    return out


def sleeps_per_call(before: Dict[str, int], after: Dict[str, int], calls: int) -> str:
    """'name n.n, ...' for the threads that slept at least once in 10 calls, most first."""
    d = {k: (after.get(k, 0) - before.get(k, 0)) / calls for k in after}
    rows = sorted(((v, k) for k, v in d.items() if v >= 0.1), reverse=True)
    return ", ".join(f"{k} {v:.1f}" for v, k in rows) or "none"


def pct(sorted_values: List[float], p: float) -> float:
    """The p-th percentile of already sorted values (nearest rank)."""
    i = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def timed(fn: Callable[[], None], group: dist.ProcessGroup, reps: int = 1, cuda: bool = False) -> float:
    """Seconds per call of `reps` back-to-back calls, started together after a barrier. On CUDA
    the barrier's own work is waited for first, and the calls are issued back to back with one
    synchronize at the end (as nccl-tests and allgather_bench.py time), so a small collective is
    not measured as a host round trip per call."""
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps

OPS = ("sendrecv", "all_reduce", "all_gather", "reduce_scatter")


def main() -> None:
    faulthandler.enable()  # a crash in the backend prints where Python was
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--back-to-back", type=int, default=None,
                    help="calls per sample, one synchronize at the end (CUDA collectives; default 10 on cuda, 1 on cpu)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--wakeups", action="store_true",
                    help="also count rank 0's thread wake-ups per call, by thread name (Linux)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--baseline", choices=("gloo", "nccl", "sluice-host"), default=None,
                    help="default: gloo for --device cpu, nccl for --device cuda")
    args = ap.parse_args()
    unknown = [op for op in args.ops.split(",") if op not in OPS]
    if unknown:
        ap.error(f"--ops: unknown {', '.join(unknown)} (known: {', '.join(OPS)})")

    dev = torch.device("cpu")
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("cpu:sluice" if args.device == "cpu" else "cpu:sluice,cuda:sluice")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = args.baseline or ("gloo" if args.device == "cpu" else "nccl")
    if base == "sluice-host":
        os.environ["SLUICE_TORCH_CUDA_PATH"] = "host"
        base_group = dist.new_group(backend="cpu:sluice,cuda:sluice")
        del os.environ["SLUICE_TORCH_CUDA_PATH"]
    else:
        base_group = dist.new_group(backend=base)
    groups: Dict[str, dist.ProcessGroup] = {"sluice": dist.group.WORLD, base: base_group}
    if rank == 0:
        print(f"# world={world} transport={st.backend_transport()} cuda path={st.backend_cuda_path()} "
              f"device={args.device} host cores={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
        if args.device == "cuda":
            print(f"# low-latency all_gather: {st.backend_ll_allgather()['state']}")
            print(f"# stream-ordered send/recv (SLUICE_TORCH_CUDA_PATH=stream): {st.backend_stream_p2p()['state']}")
        if args.markdown:
            print(f"| op | bytes | sluice us (p10-p90) | {base} us (p10-p90) | sluice GB/s | {base} GB/s | speedup |")
            print("|---|---:|---:|---:|---:|---:|---:|")
        else:
            print(f"{'op':<11}{'bytes':>11}{'sluice us':>12}{'p10-p90':>18}{base + ' us':>12}{'p10-p90':>18}"
                  f"{'sluice GB/s':>13}{base + ' GB/s':>11}{'speedup':>9}")
    for op in args.ops.split(","):
        for nbytes in sizes(args.min_bytes, args.max_bytes):
            n = max(nbytes // 4, 1)
            x = torch.ones(n, device=dev)
            out = torch.empty(n * world, device=dev)
            iters = args.iters if nbytes <= (16 << 20) else max(3, args.iters // 4)
            # send/recv is a ping-pong that waits on the host anyway: one call per sample.
            reps = 1 if op == "sendrecv" or dev.type != "cuda" else (args.back_to_back or 10)

            def run(g: dist.ProcessGroup) -> None:
                if op == "sendrecv":
                    if rank == 0:
                        dist.send(x, 1, group=g)
                        dist.recv(x, 1, group=g)
                    elif rank == 1:
                        dist.recv(x, 0, group=g)
                        dist.send(x, 0, group=g)
                elif op == "all_reduce":
                    dist.all_reduce(x, group=g)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(out, x, group=g)
                elif op == "reduce_scatter":  # bytes = each rank's result
                    dist.reduce_scatter_tensor(x, out, group=g)

            times: Dict[str, List[float]] = {"sluice": [], base: []}
            live = dict(groups)
            for name, g in groups.items():
                try:
                    run(g)  # warm up
                except RuntimeError as e:  # a baseline that refuses this op
                    if name == "sluice":
                        raise
                    if rank == 0:
                        print(f"# {base} {op} on {args.device} tensors: n/a ({str(e).splitlines()[0][:120]})")
                    del live[name]
                    times[name] = [float("nan")]
            for _ in range(iters):
                for name, g in live.items():
                    times[name].append(timed(lambda: run(g), g, reps, dev.type == "cuda"))
            sleeps: Dict[str, str] = {}
            if args.wakeups:
                for name, g in live.items():
                    dist.barrier(group=g)
                    before = thread_sleeps()
                    for _ in range(iters):
                        run(g)
                    sleeps[name] = sleeps_per_call(before, thread_sleeps(), iters)
            if rank == 0:
                div = 2 if op == "sendrecv" else 1  # one-way time of a round trip
                us = {k: sorted(t / div * 1e6 for t in v) for k, v in times.items()}
                med = {k: statistics.median(v) for k, v in us.items()}
                spread = {k: f"{pct(v, 10):.1f}-{pct(v, 90):.1f}" for k, v in us.items()}
                gbs = {k: nbytes / v / 1e3 for k, v in med.items()}
                speedup = med[base] / med["sluice"]
                if args.markdown:
                    print(f"| {op} | {nbytes} | {med['sluice']:.1f} ({spread['sluice']}) | {med[base]:.1f} "
                          f"({spread[base]}) | {gbs['sluice']:.3f} | {gbs[base]:.3f} | {speedup:.2f} |", flush=True)
                else:
                    print(f"{op:<11}{nbytes:>11}{med['sluice']:>12.1f}{spread['sluice']:>18}{med[base]:>12.1f}"
                          f"{spread[base]:>18}{gbs['sluice']:>13.3f}{gbs[base]:>11.3f}{speedup:>9.2f}", flush=True)
                for name, text in sleeps.items():
                    print(f"# wake-ups per call, rank 0, {name}: {text}", flush=True)
    if rank == 0 and args.device == "cuda":
        ll = st.backend_ll_allgather()
        print(f"# low-latency all_gather: {ll['calls']} calls took it; {ll['state']}")
        print(f"# collectives GPU to GPU (SLUICE_TORCH_DEVICE_COLLECTIVES): {st.backend_device_collectives()} calls")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
