"""Time the same torch.distributed operation through `sluice` and `gloo` in one run,
interleaved (sluice, gloo, sluice, ...), and print medians.

    torchrun --nproc_per_node=2 tools/sluice-torch-bench/bench.py [--ops sendrecv,all_reduce,all_gather]
        [--min 8] [--max 268435456] [--iters 20]

send/recv is a ping-pong between ranks 0 and 1 (one-way time = half the round trip); the
collectives run on every rank. Rank 0 prints one row per (op, size): the median time of each
backend, the bandwidth, and sluice's speedup over gloo. SLUICE_TORCH_TRANSPORT=tcp forces tcp.
"""
from __future__ import annotations

import argparse
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


def timed(fn: Callable[[], None], group: dist.ProcessGroup) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="sendrecv,all_reduce,all_gather")
    ap.add_argument("--min", type=int, default=8)
    ap.add_argument("--max", type=int, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    dist.init_process_group("cpu:sluice")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups: Dict[str, dist.ProcessGroup] = {"sluice": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    if rank == 0:
        print(f"# world={world} transport={st.backend_transport()} host cores={os.cpu_count()}")
        print(f"{'op':<11}{'bytes':>11}{'sluice us':>12}{'gloo us':>12}{'sluice GB/s':>13}{'gloo GB/s':>11}{'speedup':>9}")
    for op in args.ops.split(","):
        for nbytes in sizes(args.min, args.max):
            n = max(nbytes // 4, 1)
            x = torch.ones(n)
            out = torch.empty(n * world)
            iters = args.iters if nbytes <= (16 << 20) else max(3, args.iters // 4)

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
                else:
                    raise SystemExit(f"unknown op {op}")

            times: Dict[str, List[float]] = {"sluice": [], "gloo": []}
            for name, g in groups.items():
                run(g)  # warm up
            for _ in range(iters):
                for name, g in groups.items():
                    times[name].append(timed(lambda: run(g), g))
            if rank == 0:
                med = {k: statistics.median(v) / (2 if op == "sendrecv" else 1) for k, v in times.items()}
                gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
                print(f"{op:<11}{nbytes:>11}{med['sluice'] * 1e6:>12.1f}{med['gloo'] * 1e6:>12.1f}"
                      f"{gbs['sluice']:>13.2f}{gbs['gloo']:>11.2f}{med['gloo'] / med['sluice']:>9.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
