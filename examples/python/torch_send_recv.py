"""Send/recv round trip through the torch.distributed backend `sluice`, bytes checked.

    torchrun --nproc_per_node=2 examples/python/torch_send_recv.py

Run without torchrun, it launches itself under torchrun with two processes. Rank 0 sends a
tensor to rank 1, which sends it back with every element doubled.
"""
from __future__ import annotations

import os
import subprocess
import sys


def launch_self() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    return subprocess.call(cmd)


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
        return launch_self()

    dist.init_process_group("sluice")  # env:// from torchrun
    rank = dist.get_rank()
    n = 1 << 20
    if rank == 0:
        x = torch.arange(n, dtype=torch.float32)
        dist.send(x, dst=1)
        back = torch.empty_like(x)
        dist.recv(back, src=1)
        assert torch.equal(back, x * 2), "round trip corrupted the bytes"
        print(f"rank 0: {n * 4} bytes went to rank 1 and came back doubled over "
              f"{sluice.torch.backend_transport()}: ok")
    else:
        x = torch.empty(n, dtype=torch.float32)
        dist.recv(x, src=0)
        dist.send(x * 2, dst=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
