"""Run under torchrun with 2 ranks: rank 1 dies (SIGKILL) mid-run; rank 0's pending recv and
its next collective must raise within the group timeout naming peer rank 1."""
from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch  # noqa: F401


def main() -> int:
    rank = int(os.environ["RANK"])
    dist.init_process_group("sluice", timeout=timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT_S", "20"))))
    t = torch.ones(4)
    dist.all_reduce(t)
    # Rank 1 dies only after rank 0's all_reduce returned: a send completes on the peer's
    # acknowledgement, and a rank that kills itself the moment its own all_reduce returns can
    # take the ack of rank 0's last send with it (a legitimate failure of that all_reduce,
    # but not the case this test is about). The Store orders the two.
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("killed_worker/all_reduce_done", "1")
    else:
        store.wait(["killed_worker/all_reduce_done"])
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.recv(torch.empty(4), src=1)
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - start
        print(f"recv raised after {took:.1f}s: {e}", flush=True)
        assert "peer rank 1" in str(e), str(e)
    else:
        print("recv returned without error", flush=True)
        return 1
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        print(f"all_reduce raised: {e}", flush=True)
        assert "peer rank 1" in str(e), str(e)
    else:
        print("all_reduce returned without error", flush=True)
        return 1
    dist.destroy_process_group()
    print("killed-rank OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
