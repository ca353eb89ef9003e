"""Run under torchrun with 3 ranks: rank 2 stops participating (SIGSTOP on itself: every
thread of it, the engine's included, freezes, as in a rank stuck in a driver call). Ranks 0
and 1 must see their collective, a recv and a send involving rank 2 raise within the group
timeout, each naming peer rank 2; destroy_process_group() must return promptly. Once both have
released their groups, rank 0 wakes rank 2 (SIGCONT), whose next operation must raise too (its
peers are gone), and every rank
exits. Prints 'hung-rank OK rank=<r>' per rank and the time each failure took."""
from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch  # noqa: F401

HUNG = 2


def expect_raise(what: str, fn, limit_s: float) -> None:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - start
        print(f"rank {dist.get_rank()}: {what} raised after {took:.2f}s: {e}", flush=True)
        assert f"peer rank {HUNG}" in str(e), f"{what}: the error does not name peer rank {HUNG}: {e}"
        # Not a performance check: an op that waits far past the group timeout is a hang.
        assert took < limit_s, f"{what} took {took:.1f}s, over {limit_s:.1f}s (group timeout + margin)"
        return
    raise AssertionError(f"rank {dist.get_rank()}: {what} returned although rank {HUNG} is stopped")


def main() -> int:
    timeout_s = float(os.environ.get("GROUP_TIMEOUT_S", "3"))
    limit_s = timeout_s + float(os.environ.get("HANG_MARGIN_S", "10"))
    dist.init_process_group("sluice", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, world
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))
    t = torch.ones(1000)
    dist.all_reduce(t)  # everyone is healthy so far
    assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]

    # Rank 2 stops only after the others' all_reduce returned (a send completes on the peer's
    # acknowledgement, which a rank stopping at once could withhold): the Store orders it.
    store = dist.distributed_c10d._get_default_store()
    if rank != HUNG:
        store.set(f"hung_worker/all_reduce_done/{rank}", "1")
    if rank == HUNG:
        store.wait([f"hung_worker/all_reduce_done/{r}" for r in range(world) if r != HUNG])
        os.kill(os.getpid(), signal.SIGSTOP)
        # Woken by rank 0 after the others destroyed the group: our peers are gone, so the
        # next collective must fail (naming one of them) rather than wait forever.
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            print(f"rank {rank}: all_reduce after wake-up raised after {time.monotonic() - start:.2f}s: {e}", flush=True)
            assert "peer rank" in str(e), str(e)
        else:
            raise AssertionError("the woken rank's all_reduce returned although its peers are gone")
        dist.destroy_process_group()
        print(f"hung-rank OK rank={rank}", flush=True)
        return 0

    # Give rank 2 time to stop; a collective posted now cannot complete either way.
    time.sleep(0.5)
    # Rank 0 first waits on a recv (no message arrives: the recv expires), rank 1 on a send
    # (the stopped peer takes nothing: the engine fails the endpoint); then both run a
    # collective, on a peer already known failed (rank 1) or not yet (rank 0).
    if rank == 0:
        expect_raise("recv", lambda: dist.recv(torch.empty(16), src=HUNG), limit_s)
    else:
        expect_raise("send", lambda: dist.send(torch.ones(1 << 20), dst=HUNG), limit_s)
    expect_raise("all_reduce", lambda: dist.all_reduce(torch.ones(1000)), limit_s)
    start = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - start
    print(f"rank {rank}: destroy_process_group took {took:.2f}s", flush=True)
    assert took < limit_s, f"destroy_process_group took {took:.1f}s with rank {HUNG} stopped"
    # Rank 2 is woken only once both peers released their groups: a peer still tearing down
    # holds its connection open, and a small send to it would be taken eagerly (rightly), so the
    # woken rank's collective could complete on messages buffered before the peers gave up.
    store.set(f"hung_worker/destroyed/{rank}", "1")
    if rank == 0:
        store.wait([f"hung_worker/destroyed/{r}" for r in range(world) if r != HUNG])
        os.kill(int(pids[HUNG].item()), signal.SIGCONT)
    print(f"hung-rank OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
