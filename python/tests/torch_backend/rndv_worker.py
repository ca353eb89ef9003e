"""Run as 3 ranks (test_torchrun.spawn: plain processes, env:// rendezvous) with
SLUICE_TORCH_RNDV_BYTES set: the rendezvous protocol of large messages (mailbox.hpp). Rank 0
receives, ranks 1 and 2 send. Cases: a recv posted late (the header waits as unexpected), one
posted early, ANY_SOURCE from two ranks, tags taken out of order, eager and rendezvous messages
interleaved, a length mismatch (both sides fail, the pair keeps working), and a send whose recv
comes after the group timeout (the send times out naming the peer; the late recv fails; the pair
keeps working). Prints 'rndv OK rank=<r>' per rank."""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import sluice.torch

N = 300_000  # float32 elements: 1.2 MB, above the threshold the test sets


def payload(src: int, case: int, n: int = N) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (src + 1) + case


def check(got: torch.Tensor, src: int, case: int, what: str) -> None:
    want = payload(src, case, got.numel())
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:4].flatten().tolist()
        raise AssertionError(f"{what}: wrong data from rank {src} at {bad}")


def expect_error(what: str, fn, *needles: str) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{what}: the error does not say '{needle}': {msg}"
        print(f"rank {dist.get_rank()}: {what} raised as expected: {msg.splitlines()[0][:200]}", flush=True)
        return msg
    raise AssertionError(f"rank {dist.get_rank()}: {what} returned without error")


def rtr_cases(rank: int, store) -> None:
    """Rank 0 receives, rank 1 sends; each case lines the two up through the Store so that the
    RTR has surely reached the sender (or surely not) before it sends."""
    def stats() -> dict:
        return sluice.torch.backend_recv_ready()

    def line_up(key: str) -> None:
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=60))
            time.sleep(0.3)  # the RTR travels meanwhile

    # a. A recv posted well before its send: the payload goes on the RTR, no RTS / CTS.
    before = stats()
    if rank == 0:
        t = torch.empty(N)
        w = dist.irecv(t, src=1, tag=20)
        line_up("rtr/a")
        w.wait()
        check(t, 1, 20, "recv with an RTR")
        assert stats()["offered"] == before["offered"] + 1, (before, stats())
    else:
        line_up("rtr/a")
        dist.send(payload(1, 20), dst=0, tag=20)
        assert stats()["used"] == before["used"] + 1, (before, stats())

    # b. Another length: the RTR is voided, the message goes by RTS and both sides fail as
    #    for any mismatch; the pair then still works.
    before = stats()
    if rank == 0:
        out = torch.empty(2 * N)
        w = dist.irecv(out, src=1, tag=21)
        line_up("rtr/b")
        expect_error("recv whose RTR a shorter message voided", w.wait, "peer rank 1", str(N * 4))
    else:
        line_up("rtr/b")
        expect_error("send shorter than the RTR", lambda: dist.send(payload(1, 21), dst=0, tag=21), "peer rank 0")
        assert stats()["voided"] == before["voided"] + 1 and stats()["used"] == before["used"], (before, stats())

    # c. A small (eager) message for a recv with an RTR: voided; the recv fails as a mismatch,
    #    nothing lands in it afterwards, and the pair still works.
    if rank == 0:
        out = torch.full((N,), -1.0)
        w = dist.irecv(out, src=1, tag=22)
        line_up("rtr/c")
        expect_error("recv whose RTR an eager message voided", w.wait, "peer rank 1")
        time.sleep(0.1)
        assert torch.equal(out, torch.full((N,), -1.0)), "bytes landed in a failed recv"
    else:
        line_up("rtr/c")
        dist.send(payload(1, 22, 10), dst=0, tag=22)

    # d. Two RTRs used out of order: tag 24 is sent first, so tag 23's RTR (it came first) is
    #    voided (the data endpoint's order) and that message goes by RTS.
    before = stats()
    if rank == 0:
        t23, t24 = torch.empty(N), torch.empty(N)
        w23, w24 = dist.irecv(t23, src=1, tag=23), dist.irecv(t24, src=1, tag=24)
        line_up("rtr/d")
        w24.wait()
        w23.wait()
        check(t23, 1, 23, "recv whose RTR was voided")
        check(t24, 1, 24, "recv with the later RTR")
    else:
        line_up("rtr/d")
        dist.send(payload(1, 24), dst=0, tag=24)
        dist.send(payload(1, 23), dst=0, tag=23)
        after = stats()
        assert (after["used"], after["voided"]) == (before["used"] + 1, before["voided"] + 1), (before, after)

    # e. A ping-pong: recvs posted while the other side's message may already be on its way
    #    (the RTR crosses its RTS, whose payload then rides on the RTR). Every byte checked.
    x = torch.empty(N)
    for i in range(30):
        if rank == 0:
            dist.send(payload(0, 100 + i), dst=1, tag=25)
            dist.recv(x, src=1, tag=25)
            check(x, 1, 100 + i, f"ping-pong round {i}")
        else:
            dist.recv(x, src=0, tag=25)
            check(x, 0, 100 + i, f"ping-pong round {i}")
            dist.send(payload(1, 100 + i), dst=0, tag=25)
    print(f"rank {rank}: ready-to-receive {stats()}", flush=True)
    assert stats()["used"] > 0, stats()


def main() -> int:
    timeout_s = float(os.environ.get("GROUP_TIMEOUT_S", "4"))
    dist.init_process_group("sluice", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, world
    store = dist.distributed_c10d._get_default_store()

    # 1. Posted late: the sender's header arrives first and waits as an unexpected message.
    if rank == 1:
        w = dist.isend(payload(1, 1), dst=0, tag=1)
        store.set("rndv/1/sent", "1")
        w.wait()
    elif rank == 0:
        store.wait(["rndv/1/sent"], timedelta(seconds=60))
        time.sleep(0.3)
        t = torch.empty(N)
        dist.recv(t, src=1, tag=1)
        check(t, 1, 1, "late recv")

    # 2. Posted early: the recv waits for the header.
    if rank == 0:
        t = torch.empty(N)
        w = dist.irecv(t, src=2, tag=2)
        store.set("rndv/2/posted", "1")
        w.wait()
        check(t, 2, 2, "early recv")
    elif rank == 2:
        store.wait(["rndv/2/posted"], timedelta(seconds=60))
        time.sleep(0.2)
        dist.send(payload(2, 2), dst=0, tag=2)

    # 3. ANY_SOURCE with large messages from ranks 1 and 2, plus a small one from each.
    if rank == 0:
        seen = set()
        for _ in range(2):
            t = torch.empty(N)
            w = dist.irecv(t, tag=3)  # no src: any source
            w.wait()
            src = w._source_rank() if hasattr(w, "_source_rank") else None
            who = 1 if torch.equal(t, payload(1, 3)) else 2
            check(t, who, 3, "any-source recv")
            if src is not None:
                assert src == who, (src, who)
            seen.add(who)
        assert seen == {1, 2}, seen
        for src in (1, 2):
            s = torch.empty(4)
            dist.recv(s, src=src, tag=4)
            check(s, src, 4, "small after large")
    else:
        dist.send(payload(rank, 3), dst=0, tag=3)
        dist.send(payload(rank, 4, 4), dst=0, tag=4)

    # 4. Tags out of order, eager and rendezvous interleaved: rank 1 sends tags 5 (large),
    #    6 (small), 7 (large); rank 0 takes 7, then 6, then 5.
    if rank == 1:
        ws = [dist.isend(payload(1, 5), dst=0, tag=5), dist.isend(payload(1, 6, 10), dst=0, tag=6),
              dist.isend(payload(1, 7), dst=0, tag=7)]
        for w in ws:
            w.wait()
    elif rank == 0:
        for tag, n in ((7, N), (6, 10), (5, N)):
            t = torch.empty(n)
            dist.recv(t, src=1, tag=tag)
            check(t, 1, tag, f"out-of-order tag {tag}")

    # 5. A length mismatch on a large message: both sides fail, naming the sizes; the pair
    #    then still works.
    if rank == 1:
        expect_error("mismatched send", lambda: dist.send(payload(1, 8), dst=0, tag=8), "peer rank 0",
                     str(2 * N * 4))
        dist.send(payload(1, 9), dst=0, tag=9)
    elif rank == 0:
        expect_error("mismatched recv", lambda: dist.recv(torch.empty(2 * N), src=1, tag=8), "peer rank 1",
                     str(N * 4))
        t = torch.empty(N)
        dist.recv(t, src=1, tag=9)
        check(t, 1, 9, "after a mismatch")

    # 6. A send nobody takes within the group timeout fails naming the peer; the recv posted
    #    after that fails too (the sender gave up); the pair then still works.
    if rank == 2:
        expect_error("untaken send", lambda: dist.send(payload(2, 10), dst=0, tag=10), "peer rank 0", "timeout")
        store.set("rndv/10/timed_out", "1")
        dist.send(payload(2, 11), dst=0, tag=11)
    elif rank == 0:
        store.wait(["rndv/10/timed_out"], timedelta(seconds=60))
        expect_error("late recv of an abandoned send", lambda: dist.recv(torch.empty(N), src=2, tag=10),
                     "peer rank 2", "gave up")
        t = torch.empty(N)
        dist.recv(t, src=2, tag=11)
        check(t, 2, 11, "after an abandoned send")

    # 6b. Ready-to-receive (RTR, mailbox.hpp). Ranks 0 and 1 only; rank 2 meets them at 7.
    if rank in (0, 1):
        rtr_cases(rank, store)

    # 7. Collectives over the rendezvous path still agree with a plain computation. Ranks
    #    arrive here up to a group timeout apart (case 6): line them up through the Store.
    store.set(f"rndv/7/{rank}", "1")
    store.wait([f"rndv/7/{r}" for r in range(world)], timedelta(seconds=60))
    x = payload(rank, 12)
    dist.all_reduce(x)
    assert torch.equal(x, sum(payload(r, 12) for r in range(world))), "all_reduce"

    # 7b. A recv with an RTR out that no message matches within the group timeout: it fails
    #     naming the peer, and so does the pair (its engine recv ends only by closing the data
    #     endpoint), so a later op with that rank fails at once instead of waiting again.
    if rank == 0:
        t0 = time.monotonic()
        expect_error("recv with an RTR that times out", lambda: dist.recv(torch.empty(N), src=2, tag=30),
                     "peer rank 2", "group timeout")
        expect_error("send after it", lambda: dist.send(payload(0, 31), dst=2, tag=31), "peer rank 2")
        assert time.monotonic() - t0 < 2 * timeout_s + 2, time.monotonic() - t0
        store.set("rndv/30/done", "1")
    elif rank == 2:
        store.wait(["rndv/30/done"], timedelta(seconds=60))

    # 8. A threshold that is not a byte count is refused when a group is made (before it
    #    connects anything, so every rank fails alike and nobody waits).
    os.environ["SLUICE_TORCH_RNDV_BYTES"] = "12abc"
    expect_error("a group with a bad threshold", lambda: dist.new_group(backend="sluice"),
                 "SLUICE_TORCH_RNDV_BYTES must be a byte count, got '12abc'")
    del os.environ["SLUICE_TORCH_RNDV_BYTES"]
    os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"] = "1M"
    expect_error("a group with a bad low-latency all_gather threshold", lambda: dist.new_group(backend="sluice"),
                 "SLUICE_TORCH_LL_ALLGATHER_BYTES must be a byte count, got '1M'")
    del os.environ["SLUICE_TORCH_LL_ALLGATHER_BYTES"]
    os.environ["SLUICE_TORCH_DEVICE_COLLECTIVES"] = "2"
    expect_error("a group with a bad device-collectives switch", lambda: dist.new_group(backend="sluice"),
                 "SLUICE_TORCH_DEVICE_COLLECTIVES must be 0 or 1, got 2")
    del os.environ["SLUICE_TORCH_DEVICE_COLLECTIVES"]
    before = os.environ.get("SLUICE_TORCH_SPIN_US")
    os.environ["SLUICE_TORCH_SPIN_US"] = "2000000"
    expect_error("a group that would poll for 2 s", lambda: dist.new_group(backend="sluice"),
                 "SLUICE_TORCH_SPIN_US must be at most 1000000 (1 s), got 2000000")
    if before is None:
        del os.environ["SLUICE_TORCH_SPIN_US"]
    else:
        os.environ["SLUICE_TORCH_SPIN_US"] = before
    for name in ("SLUICE_TORCH_CALLER_RUNS", "SLUICE_TORCH_QUIET_ACKS"):
        before = os.environ.get(name)
        os.environ[name] = "2"
        expect_error(f"a group with a bad {name}", lambda: dist.new_group(backend="sluice"),
                     f"{name} must be 0 or 1, got 2")
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before

    os.environ["SLUICE_TORCH_CUDA_PATH"] = "nccl"
    expect_error("a group with an unknown CUDA path", lambda: dist.new_group(backend="sluice"),
                 "SLUICE_TORCH_CUDA_PATH must be 'auto', 'host' or 'stream', got 'nccl'")
    # 9. The stream-ordered CUDA send/recv has no peer to take on a host without GPUs: the group
    #    says so and works as any other.
    os.environ["SLUICE_TORCH_CUDA_PATH"] = "stream"
    sg = dist.new_group(backend="sluice")
    del os.environ["SLUICE_TORCH_CUDA_PATH"]
    info = sluice.torch.backend_stream_p2p(sg)
    assert info["calls"] == 0 and info["state"].startswith("off"), info
    x = payload(rank, 40)
    y = torch.empty(N)
    reqs = [dist.isend(x, (rank + 1) % world, group=sg), dist.irecv(y, (rank - 1) % world, group=sg)]
    [q.wait() for q in reqs]
    assert torch.equal(y, payload((rank - 1) % world, 40)), "send/recv on a stream-path group without GPUs"
    assert sluice.torch.backend_stream_p2p(sg)["calls"] == 0

    dist.destroy_process_group()
    print(f"rndv OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
