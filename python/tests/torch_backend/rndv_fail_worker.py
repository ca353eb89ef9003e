"""Run as 3 ranks (test_torchrun.spawn: plain processes; torchrun would stop the others when one
dies): peers that fail in the middle of a rendezvous (large messages, mailbox.hpp). Rank 1 sends
a large message and is killed (SIGKILL) before rank 0 posts the recv; rank 2 sends one and stops
(SIGSTOP) after its header arrived, so rank 0's recv matches, posts its recv and clears the
send, and the payload never comes. Rank 0's recvs must raise within the group timeout naming the
peer; destroy_process_group() must return. Rank 0 then wakes rank 2, whose next operation must
fail too. Prints 'rndv-fail OK rank=<r>' for ranks 0 and 2."""
from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch  # noqa: F401

N = 1 << 20  # float32 elements: 4 MiB, far above the rendezvous threshold
WAIT = timedelta(seconds=60)


def main() -> int:
    timeout_s = float(os.environ.get("GROUP_TIMEOUT_S", "3"))
    limit_s = timeout_s + float(os.environ.get("HANG_MARGIN_S", "10"))
    dist.init_process_group("sluice", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, world
    store = dist.distributed_c10d._get_default_store()
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))

    if rank in (1, 2):
        w = dist.isend(torch.ones(N), dst=0, tag=rank)
        time.sleep(0.3)  # the header reaches rank 0 (it has no recv posted yet)
        store.set(f"rndv_fail/{rank}/sent", "1")
        os.kill(os.getpid(), signal.SIGKILL if rank == 1 else signal.SIGSTOP)
        # Rank 2, woken after rank 0 destroyed its group: the send cannot complete.
        start = time.monotonic()
        try:
            w.wait()
            dist.all_reduce(torch.ones(4))
        except Exception as e:  # noqa: BLE001
            print(f"rank {rank}: after wake-up raised after {time.monotonic() - start:.2f}s: {e}", flush=True)
            assert "peer rank" in str(e), str(e)
        else:
            raise AssertionError("the woken rank's operations succeeded although rank 0 is gone")
        print(f"rndv-fail OK rank={rank}", flush=True)
        os._exit(0)  # rank 1 is gone: a clean destroy would only wait for it

    store.wait(["rndv_fail/1/sent", "rndv_fail/2/sent"], WAIT)
    time.sleep(0.5)  # both have stopped by now
    for src, why in ((1, "killed"), (2, "stopped")):
        start = time.monotonic()
        try:
            dist.recv(torch.empty(N), src=src, tag=src)
        except Exception as e:  # noqa: BLE001
            took = time.monotonic() - start
            print(f"rank 0: recv from the {why} rank raised after {took:.2f}s: {e}", flush=True)
            assert f"peer rank {src}" in str(e), str(e)
            assert took < limit_s, f"recv from the {why} rank took {took:.1f}s (group timeout + margin)"
        else:
            raise AssertionError(f"recv from the {why} rank {src} returned")
    start = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - start
    assert took < limit_s, f"destroy_process_group took {took:.1f}s"
    os.kill(int(pids[2].item()), signal.SIGCONT)
    print(f"rndv-fail OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
