"""Y = AllGather(X_shard) @ W with the GEMM overlapping the AllGather (python/sluice/ag_gemm.py),
under torchrun, checked against NCCL's all_gather_into_tensor + matmul.

    torchrun --nproc-per-node 2 examples/python/all_gather_gemm_overlap.py
    torchrun --nproc-per-node 2 examples/python/all_gather_gemm_overlap.py --mode inter   # forced inter
    torchrun --nproc-per-node 2 examples/python/all_gather_gemm_overlap.py --eager-mode --dtype fp16

--mode intra: over the NVLink AllGather (python/sluice/cuda_allgather.py), one host.
--mode inter: over the hierarchical AllGather (python/sluice/hier_allgather.py); on one host
every rank is its own node unless SLUICE_HIER_RANKS_PER_NODE says otherwise.
The calls are captured in a CUDA graph and replayed unless --eager-mode.

The result must be within 2 ulps of the dtype of NCCL + matmul (the pieces are smaller GEMMs
than the reference's one, so cuBLAS may add in another order; see the benchmark's docstring).
Prints OK and exits 0 when it is; exits 0 after a message when there is no GPU. Set
SLUICE_LIBRARY to a libsluice.so built with CUDA.
"""
import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "common"))
from sluice_by_path import load  # noqa: E402  (python/sluice's modules without the compiled package)


def make_allgather(mode, max_bytes, transport):
    """The AllGather the overlap runs on, sized for one chunk."""
    import torch
    if mode == "intra":
        return load("cuda_allgather").AllGather(max_tokens=max_bytes, hidden=1, dtype=torch.uint8)
    hier = load("hier_allgather")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rpn = None  # SLUICE_HIER_RANKS_PER_NODE, else torchrun's hosts ...
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world and "SLUICE_HIER_RANKS_PER_NODE" not in os.environ:
        rpn = 1  # ... but on one host, forced inter: every rank its own node
    return hier.HierAllGather(max_bytes, ranks_per_node=rpn, transport=transport)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["intra", "inter"], default="intra")
    ap.add_argument("--eager-mode", action="store_true", help="no CUDA graph")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--m", type=int, default=1024, help="rows per rank")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--transport", default="", help="inter: tcp, rdma or empty (automatic)")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("all_gather_gemm_overlap: skipped, torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("all_gather_gemm_overlap: skipped, no CUDA GPU on this host")
        return 0
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    agg = load("ag_gemm")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    m, k, n = args.m, args.k, 4 * args.k
    mc = agg.chunk_rows(m, args.chunks)
    ag = make_allgather(args.mode, mc * k * torch.finfo(dtype).bits // 8, args.transport)
    agmm = agg.AllGatherMatmul(ag, max_rows=m, k=k, n=n, dtype=dtype, chunks=args.chunks)

    g = torch.Generator(device="cuda").manual_seed(rank + 1)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(k, n, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda") / k ** 0.5).to(dtype)
    y = torch.empty(world * m, n, dtype=dtype, device="cuda")
    gathered = torch.empty(world * m, k, dtype=dtype, device="cuda")
    ref = torch.empty_like(y)

    if args.eager_mode:
        run = lambda: agmm(x, w, out=y)  # noqa: E731
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            agmm(x, w, out=y)  # warm-up outside the graph (cuBLAS handles, workspaces)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            agmm(x, w, out=y)
        run = graph.replay

    tol = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    fails = 0
    for it in range(3):  # fresh data each time: a replay must read the current x
        x.copy_(torch.randn(m, k, generator=g, device="cuda").to(dtype))
        y.fill_(float("nan"))
        run()
        dist.all_gather_into_tensor(gathered, x)
        torch.matmul(gathered, w, out=ref)
        torch.cuda.synchronize()
        agmm.check()
        d = (y.float() - ref.float()).abs()
        ok = bool((d <= tol * (1 + ref.float().abs())).all())
        fails += 0 if ok else 1
        if rank == 0 or not ok:
            print(f"rank {rank}: {args.mode}, {args.dtype}, m={m} k={k} n={n} chunks={args.chunks}, "
                  f"{'eager' if args.eager_mode else 'graph'}, call {it}: "
                  f"{'within 2 ulps of NCCL + matmul' if ok else 'MISMATCH'} "
                  f"(max diff {float(d.max()):.3g}, bit-equal {float((y == ref).float().mean()):.4f})", flush=True)
    t = torch.tensor([fails], device="cuda")
    dist.all_reduce(t)
    if rank == 0:
        print("OK" if int(t.item()) == 0 else f"FAILED ({int(t.item())} checks)", flush=True)
    dist.barrier()
    if hasattr(ag, "close"):
        ag.close()
    dist.destroy_process_group()
    return 1 if int(t.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
