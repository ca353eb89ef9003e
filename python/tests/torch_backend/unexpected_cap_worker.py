"""Run as 2 ranks (test_torchrun.spawn: plain processes) with SLUICE_TORCH_MAX_UNEXPECTED_BYTES
set (1 MiB) and the default rendezvous threshold (256 KiB): the bound on the unexpected eager
messages a rank holds (mailbox.hpp). Rank 1 sends 200 KiB messages (eager) that rank 0 has
not received yet, then a small marker message whose recv rank 0 did post: the control endpoint
is handled in order, so when the marker arrives every message before it is stashed (no sleep).

1. 4 messages (800 KiB held): received in order once the recvs are posted.
2. 5 messages (1000 KiB): fits only because the 800 KiB of case 1 were released on delivery.
3. 6 messages: the 6th would pass the bound. Rank 0's pending recv (the marker) fails at once
   naming rank 1, the bound and its parameter; so do a later recv from rank 1 (its stashed
   messages were dropped) and a send to it. Rank 1's own next op with rank 0 fails at once too
   (rank 0 closed the pair's control endpoint), not after the group timeout.
4. A value of the parameter that is not a byte count is refused on every rank when a group is
   made (before it connects).
Prints 'cap OK rank=<r>' per rank."""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch  # noqa: F401

K = 51_200  # float32 elements: 200 KiB, below the default rendezvous threshold (eager)
PARAM = "SLUICE_TORCH_MAX_UNEXPECTED_BYTES"
WAIT = timedelta(seconds=60)


def payload(case: int, i: int) -> torch.Tensor:
    return torch.arange(K, dtype=torch.float32) + 100_000 * case + i


def expect_error(what: str, fn, *needles: str) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{what}: the error does not say '{needle}': {msg}"
        # A failure that took the group timeout would say so: these must fail at once.
        assert "group timeout" not in msg, f"{what}: failed by the timeout rather than at once: {msg}"
        print(f"rank {dist.get_rank()}: {what} raised as expected: {msg.splitlines()[0][:300]}", flush=True)
        return msg
    raise AssertionError(f"rank {dist.get_rank()}: {what} returned without error")


def send_case(case: int, count: int, check: bool) -> None:
    """Rank 1: `count` messages with tag 10 + case, then the marker (tag 20 + case)."""
    ws = [dist.isend(payload(case, i), dst=0, tag=10 + case) for i in range(count)]
    ws.append(dist.isend(torch.ones(1), dst=0, tag=20 + case))
    for i, w in enumerate(ws):
        if check:
            w.wait()
            continue
        try:  # rank 0 refuses the pair part way: the last sends may fail, naming rank 0
            w.wait()
        except Exception as e:  # noqa: BLE001
            assert "peer rank 0" in str(e), str(e)
            print(f"rank 1: send {i} of case {case} failed: {str(e).splitlines()[0][:200]}", flush=True)


def receive_case(case: int, count: int) -> None:
    """Rank 0: the marker first (all `count` messages are stashed once it came), then them."""
    dist.recv(torch.empty(1), src=1, tag=20 + case)
    for i in range(count):
        t = torch.empty(K)
        dist.recv(t, src=1, tag=10 + case)
        assert torch.equal(t, payload(case, i)), f"case {case}: message {i} is not the {i}-th sent"


def main() -> int:
    timeout_s = float(os.environ.get("GROUP_TIMEOUT_S", "20"))
    limit = int(os.environ[PARAM])
    assert 5 * K * 4 <= limit < 6 * K * 4, limit  # five messages fit, six do not
    dist.init_process_group("sluice", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    store = dist.distributed_c10d._get_default_store()

    # 1 and 2: under the bound. Rank 1 starts a case once rank 0 took the previous one (its
    # sends complete when rank 0's engine has the bytes, not when a recv took them).
    for case, count in ((1, 4), (2, 5)):
        if rank == 1:
            send_case(case, count, check=True)
            store.wait([f"cap/{case}/taken"], WAIT)
        else:
            receive_case(case, count)
            store.set(f"cap/{case}/taken", "1")

    # 3: past the bound.
    if rank == 1:
        send_case(3, 6, check=False)
        store.wait(["cap/3/refused"], WAIT)
        expect_error("rank 1's recv from rank 0 after rank 0 refused it",
                     lambda: dist.recv(torch.empty(1), src=0, tag=30), "peer rank 0")
        expect_error("rank 1's send to rank 0 after rank 0 refused it",
                     lambda: dist.send(torch.ones(1), dst=0, tag=31), "peer rank 0")
    else:
        needles = ("peer rank 1", PARAM, str(limit), f"{K * 4}-byte eager message")
        expect_error("the pending recv of the marker", lambda: dist.recv(torch.empty(1), src=1, tag=23), *needles)
        expect_error("a later recv of a message stashed before", lambda: dist.recv(torch.empty(K), src=1, tag=13),
                     *needles)
        expect_error("a send to the refused peer", lambda: dist.send(torch.ones(1), dst=1, tag=32), *needles)
        store.set("cap/3/refused", "1")

    # 4: bad values, refused before connecting, on every rank alike.
    for bad in ("1MiB", "-1", "1 "):
        os.environ[PARAM] = bad
        expect_error(f"a group with {PARAM}={bad!r}", lambda: dist.new_group(backend="sluice"),
                     f"{PARAM} must be a byte count, got '{bad}'")
    os.environ[PARAM] = str(limit)

    # Rank 0 hosts the Store: it stays until rank 1 is done with it (under load rank 1 could
    # still be waiting for "cap/3/refused" when rank 0 had finished, and lost the Store).
    if rank == 1:
        store.set("cap/done", "1")
    else:
        store.wait(["cap/done"], WAIT)
    dist.destroy_process_group()
    print(f"cap OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
