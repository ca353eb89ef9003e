"""Scenario 2: a link taken down for 2 s under a stream of checked writes and reads, then
brought back. Every operation either completes with the right bytes or fails with PeerLost or
Timeout naming the peer, within op_timeout (plus the progress checker's slack); nothing hangs.
With op_timeout 5 s the endpoint must survive (every operation succeeds): its stalled tcp
channels are replaced by fresh connections (tcp.failover_ms) or, with that off, resume at the
kernel's next retransmission. The recovery time (link up -> first successful operation, on the
surviving endpoint and on a fresh connect) is measured and reported, never asserted (the
issue's bar is <= 1 s)."""
from __future__ import annotations

import time
from typing import Any, Dict, List

import pytest

from driver import WorkerError, WorkerProc, now, stop_all

DOWN_S = 2.0
SLOT = 1 << 20
SLACK_S = 5.0  # past op_timeout, a still-pending op counts as a hang (HangError in the worker)


def _wait_for(w: WorkerProc, pred, timeout: float, what: str) -> Dict[str, Any]:
    deadline = now() + timeout
    while True:
        st = w.call("stream_status", 10)
        if pred(st):
            return st
        if now() > deadline:
            raise WorkerError(f"{what}: not within {timeout} s (stream status {st})")
        time.sleep(0.05)


@pytest.mark.parametrize("op_timeout", [5.0, 1.0], ids=["op_timeout_5s", "op_timeout_1s"])
def test_link_down_2s(topology, report, op_timeout: float):
    topo = topology(2, tag="flap")
    a_host, b_host = topo.hosts
    workers: List[WorkerProc] = []
    try:
        a = WorkerProc(a_host, 0, 4, slot=SLOT, transports="tcp", op_timeout=op_timeout)
        b = WorkerProc(b_host, 1, 4, slot=SLOT, transports="tcp", op_timeout=op_timeout)
        workers += [a, b]
        a.ready()
        b.ready()
        assert a.call("stream_start", target=1, addr=b.listen, wait=op_timeout + SLACK_S)["transport"] == "tcp"
        _wait_for(a, lambda s: s["oks"] >= 5, 30, "5 checked ops before the flap")

        t_down = now()
        b_host.link(False)  # B's veth end, inside B's namespace
        time.sleep(DOWN_S)
        b_host.link(True)
        t_up = now()
        # (c) an endpoint that failed during the outage (op_timeout shorter than it): its next
        # operations connect again (reconnection), tried as soon as the link is back.
        again = None
        if a.call("stream_status", 10)["ended"]:
            again = a.call("again", timeout=40, target=1, lslot=2, rslot=3, until=t_up + 30,
                           op_wait=op_timeout + SLACK_S)
        # (b) a fresh connect from the same engine, started as soon as the link is back. Its
        # slots differ from the stream's, which may still be running.
        fresh = a.call("fresh", timeout=40, addr=b.listen, lslot=2, rslot=3, until=t_up + 30,
                       op_wait=op_timeout + SLACK_S)
        # (a) the stream's endpoint: wait until it did an op after the link came back, or ended.
        _wait_for(a, lambda s: s["ended"] or (s["last_ok_t1"] or 0) > t_up, op_timeout + 30,
                  "the stream to succeed again or end")
        log = a.call("stream_stop", 30, join=op_timeout + SLACK_S + 5)["log"]

        hangs = [r for r in log if not r["ok"] and r["type"] in ("HangError", "AssertionError")]
        assert not hangs, f"hung or wrong-byte operations: {hangs}"
        failed = [r for r in log if not r["ok"]]
        for r in failed:
            assert r["type"] in ("PeerLostError", "SluiceTimeoutError"), r
            # The error must say which peer: its address or engine id.
            assert b.listen in r["message"] or b.hello["info"]["engine_id"] in r["message"], r
        assert fresh["success"], f"no fresh connect succeeded within 30 s of link up: {fresh}"
        if again is not None:
            assert again["success"], f"the failed endpoint did not reconnect within 30 s of link up: {again}"
            assert again["reconnects"] == 1, again
        assert fresh["transport"] == "tcp"

        ok_after = [r for r in log if r["ok"] and r["t1"] > t_up]
        survived = not failed
        if op_timeout > DOWN_S:
            assert survived, f"the endpoint did not survive a {DOWN_S} s flap with op_timeout {op_timeout} s: {failed}"
        first_ok = min((r["t1"] for r in ok_after), default=None)
        report("link_flap", op_timeout_s=op_timeout, down_s=round(t_up - t_down, 2),
               endpoint_survived=survived, ops=len(log), failed_ops=len(failed),
               failures=sorted({f"{r['type']}: {r['message'][:160]}" for r in failed}),
               recovery_same_endpoint_s=None if first_ok is None or not survived else round(first_ok - t_up, 3),
               recovery_fresh_connect_s=round(fresh["t_ok"] - t_up, 3), fresh_connect_tries=fresh["tries"],
               recovery_reconnected_endpoint_s=None if again is None else round(again["t_ok"] - t_up, 3),
               longest_op_s=round(max(r["t1"] - r["t0"] for r in log), 3))
    finally:
        stop_all(workers)
