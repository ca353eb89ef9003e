"""AllGather with sluice under torchrun, checked against NCCL's all_gather_into_tensor.

    torchrun --nproc-per-node 2 examples/python/all_gather_ll.py --mode intra
    torchrun --nproc-per-node 2 examples/python/all_gather_ll.py --mode inter     # forced inter
    SLUICE_HIER_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 examples/python/all_gather_ll.py --mode inter
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/python/all_gather_ll.py --mode inter

--mode intra: the NVLink LL AllGather (python/sluice/cuda_allgather.py), one host.
--mode inter: the hierarchical AllGather (python/sluice/hier_allgather.py). Nodes come from
torchrun's environment; on a single host every rank is its own node (the inter-node path,
port channels over tcp/rdma, between GPUs of one host) unless SLUICE_HIER_RANKS_PER_NODE says
otherwise. Calls are captured in a CUDA graph unless --eager-mode.

Set SLUICE_LIBRARY to a libsluice.so built with CUDA. Exits 0 after printing a message when
there is no GPU.
"""
import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "common"))
from sluice_by_path import load  # noqa: E402  (python/sluice's modules without the compiled package)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["intra", "inter"], default="intra")
    ap.add_argument("--eager-mode", action="store_true", help="no CUDA graph")
    ap.add_argument("--max-mib", type=int, default=4)
    ap.add_argument("--transport", default="", help="inter: tcp, rdma or empty (automatic)")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("all_gather_ll: skipped, no CUDA GPU on this host")
        return 0
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    max_bytes = args.max_mib << 20
    if args.mode == "intra":
        ag = load("cuda_allgather").AllGather(max_tokens=max_bytes, hidden=1, dtype=torch.uint8)
        run = lambda x, out: ag.all_gather(x, out=out)  # noqa: E731
        what = "LL AllGather"
    else:
        hier = load("hier_allgather")
        rpn = None  # SLUICE_HIER_RANKS_PER_NODE, else torchrun's hosts ...
        one_host = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
        if one_host and "SLUICE_HIER_RANKS_PER_NODE" not in os.environ:
            rpn = 1  # ... but on one host, forced inter: every rank its own node
        ag = hier.HierAllGather(max_bytes, ranks_per_node=rpn, transport=args.transport)
        run = lambda x, out: ag.all_gather(x, out=out)  # noqa: E731
        what = f"hierarchical AllGather ({ag.nodes} nodes x {ag.ranks_per_node}, {ag.transport})"

    fails = 0
    for nb in [1 << 10, 1 << 16, 1 << 20, max_bytes]:
        if nb > max_bytes:
            continue
        x = torch.randint(0, 256, (nb,), dtype=torch.uint8, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(rank * 7919 + nb))
        ref = torch.empty(world * nb, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(ref)
        dist.all_gather_into_tensor(ref, x)
        if args.eager_mode:
            for _ in range(3):
                out.fill_(0xEE)
                run(x, out)
        else:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run(x, out)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(x, out)
            for _ in range(3):
                out.fill_(0xEE)
                g.replay()
        torch.cuda.synchronize()
        if args.mode == "inter":
            ag.check()
        ok = torch.equal(out, ref)
        fails += 0 if ok else 1
        if rank == 0 or not ok:
            print(f"rank {rank}: {what}, {nb} B per rank, {'graph' if not args.eager_mode else 'eager'}: "
                  f"{'bit-equal to NCCL' if ok else 'MISMATCH'}", flush=True)
    dist.barrier()
    if hasattr(ag, "close"):
        ag.close()
    dist.destroy_process_group()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
