"""Collectives through the torch.distributed backend `sluice`, checked against their
definitions.

    torchrun --nproc_per_node=2 examples/python/torch_collectives.py

Run without torchrun, it launches itself under torchrun with two processes.
"""
from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("skipped: torch is not installed (pip install torch==2.13.0)")
        return 0
    import sluice.torch

    if not sluice.torch.available():
        print("skipped: this sluice was built without the torch backend (see docs/torch.md)")
        return 0
    if "RANK" not in os.environ:
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node=2", __file__])

    dist.init_process_group("cpu:sluice")
    rank, world = dist.get_rank(), dist.get_world_size()

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == sum(range(1, world + 1)))

    parts = [torch.empty(4, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), rank, dtype=torch.int64))
    assert all(torch.all(p == i) for i, p in enumerate(parts))

    b = torch.arange(8) if rank == 0 else torch.zeros(8, dtype=torch.int64)
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(8))

    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.ones(2 * world))
    assert torch.all(out == world)

    work = dist.all_reduce(torch.ones(3), async_op=True)
    total = work.get_future().then(lambda f: f.value()[0].sum()).wait()
    assert float(total) == 3 * world

    dist.barrier()
    if rank == 0:
        print(f"all_reduce, all_gather, broadcast, reduce_scatter_tensor, async all_reduce over "
              f"{sluice.torch.backend_transport()} with {world} ranks: ok")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
