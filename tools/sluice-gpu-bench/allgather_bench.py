"""AllGather: sluice (python/sluice/cuda_allgather.py) against NCCL all_gather_into_tensor.

Checks that both give the same bytes at every size, then times both, eager and captured in a
CUDA graph, 1 KiB .. 64 MiB per rank. Run on a host with >= 2 GPUs:
    SLUICE_LIBRARY=build/libsluice.so python3 tools/sluice-gpu-bench/allgather_bench.py --out ag.md
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from sluice_by_path import load  # noqa: E402  (python/sluice's modules without the compiled package)


def load_allgather():
    return load("cuda_allgather").AllGather
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def run(rank, world, args, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    AllGather = load_allgather()

    max_bytes = args.max_mib << 20
    ag = AllGather(max_tokens=max_bytes // 2, hidden=1, dtype=torch.bfloat16)
    sizes = [1 << k for k in range(10, 27) if (1 << k) <= max_bytes]
    rows, fails = [], 0
    inp = torch.empty(max_bytes // 2, dtype=torch.bfloat16, device="cuda")
    o1 = torch.empty(world * max_bytes // 2, dtype=torch.bfloat16, device="cuda")
    o2 = torch.empty_like(o1)
    for nb in sizes:
        n = nb // 2
        x = inp[:n]
        a, b = o1[: world * n], o2[: world * n]
        # Correctness: random data, odd seeds per rank and size.
        g = torch.Generator(device="cuda").manual_seed(1000 * rank + nb)
        x.copy_(torch.randn(n, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16))
        dist.all_gather_into_tensor(b, x)
        ag.all_gather(x, out=a)
        torch.cuda.synchronize()
        ok = torch.equal(a.view(torch.int16), b.view(torch.int16))
        fails += 0 if ok else 1
        iters = 200 if nb <= (1 << 20) else 50 if nb <= (16 << 20) else 20

        # The warm-up collectives right before the start event line the ranks up on the GPU
        # (each waits for its peer), so host-side skew after the barrier is not timed.
        def t_eager(fn):
            dist.barrier()
            torch.cuda.synchronize()
            for _ in range(5):
                fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1000 / iters

        def t_graph(fn):
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(10):
                    fn()
            gr.replay()
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            gr.replay()  # lines the ranks up (see t_eager)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = max(2, iters // 10)
            s.record()
            for _ in range(reps):
                gr.replay()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1000 / (reps * 10)

        f_s = lambda: ag.all_gather(x, out=a)
        f_n = lambda: dist.all_gather_into_tensor(b, x)
        r = [t_eager(f_s), t_eager(f_n), t_graph(f_s), t_graph(f_n)]
        # graph-mode correctness too
        torch.cuda.synchronize()
        ok2 = torch.equal(a.view(torch.int16), b.view(torch.int16))
        fails += 0 if ok2 else 1
        rows.append((nb, r, ok and ok2))
    dist.barrier()
    if rank == 0:
        lines = [f"# AllGather, {world} x {torch.cuda.get_device_name(0)}, bf16, per-rank size; time per op in us "
                 f"(back-to-back, CUDA events); algbw = world*size/time",
                 "",
                 "| size/rank | sluice eager | NCCL eager | ratio | sluice graph | NCCL graph | ratio | "
                 "sluice graph algbw GB/s | NCCL graph algbw GB/s | equal to NCCL |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for nb, r, ok in rows:
            bw = lambda t: world * nb / (t * 1e-6) / 1e9
            lines.append(f"| {human(nb)} | {r[0]:.1f} | {r[1]:.1f} | {r[0]/r[1]:.2f} | {r[2]:.1f} | {r[3]:.1f} | "
                         f"{r[2]/r[3]:.2f} | {bw(r[2]):.1f} | {bw(r[3]):.1f} | {'yes' if ok else 'NO'} |")
        lines.append("")
        lines.append(f"correctness: {len(rows) * 2 - fails}/{len(rows) * 2} comparisons equal to NCCL")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    ag.close()
    dist.destroy_process_group()
    if fails:
        sys.exit(1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    args = p.parse_args()
    if args.world < 2:
        print("needs 2 GPUs; skipping")
        sys.exit(0)
    import random
    mp.spawn(run, args=(args.world, args, random.randint(20000, 40000)), nprocs=args.world, join=True)
