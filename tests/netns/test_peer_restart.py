"""Scenario 3: a peer process killed (SIGKILL) while another engine streams checked writes and
reads to it, then restarted in its namespace under the same name, through a real directory
server (redis-server, etcd) running in the hub namespace. The old endpoint's pending operation
fails with PeerLost naming the peer (nothing hangs, no wrong bytes). The same endpoint's
next operations connect again by name (reconnection) and reach the new incarnation, and so
does a fresh connect(name). Reported: re-registration -> first successful operation, both ways."""
from __future__ import annotations

import time
from typing import List


import netns
from driver import WorkerProc, now, stop_all
import pytest
from store_server import KINDS, StoreServer

OP_TIMEOUT = 5.0
TTL_MS = 2000
SLOT = 1 << 20


@pytest.mark.parametrize("store", KINDS)
def test_peer_killed_and_restarted_under_its_name(topology, report, store):
    topo = topology(2, tag="kill")
    a_host, b_host = topo.hosts
    server = StoreServer(store, topo.hub)
    server.start()
    url = server.url("netns")
    common = dict(slot=SLOT, transports="tcp", op_timeout=OP_TIMEOUT, connect_timeout=10.0, directory=url,
                  options={"directory.ttl_ms": TTL_MS})
    workers: List[WorkerProc] = []
    try:
        a = WorkerProc(a_host, 0, 4, name="writer-a", **common)
        b = WorkerProc(b_host, 1, 4, name="peer-b", **common)
        workers += [a, b]
        a.ready()
        b.ready()
        old_id = b.hello["info"]["engine_id"]
        assert a.call("stream_start", target=1, addr="peer-b", wait=OP_TIMEOUT + 5)["transport"] == "tcp"
        deadline = now() + 30
        while a.call("stream_status", 10)["oks"] < 5:
            assert now() < deadline, "no 5 checked ops before the kill"
            time.sleep(0.05)

        # While a's next op is being worked on, the peer dies.
        t_kill = now()
        b.kill()
        deadline = now() + OP_TIMEOUT + 10
        while not a.call("stream_status", 10)["ended"]:
            assert now() < deadline, "the stream to a killed peer did not end within op_timeout + 10 s"
            time.sleep(0.05)
        log = a.call("stream_stop", 10, join=5)["log"]
        failed = [r for r in log if not r["ok"]]
        assert len(failed) == 1, failed  # the stream stops at its endpoint's failure
        last = failed[0]
        assert last["type"] == "PeerLostError", last
        assert old_id in last["message"], f"the error does not name the lost peer {old_id}: {last['message']}"
        t_failed = last["t1"]

        # (b2) Restart under the same name. Its registration is refused while the dead
        # engine's entry lives (TTL), so the worker retries; meanwhile a keeps submitting on
        # the failed endpoint, each op connecting again by name (refused by the dead listener
        # until the new engine registers).
        a.send("again", target=1, lslot=2, rslot=3, until=now() + 30, op_wait=OP_TIMEOUT + 5)
        # b2 registers its regions 1 s after it joins the directory: a's endpoint reconnects to
        # it before they exist, and must still reach them (it fetches the table again when the
        # name is missing) rather than keep the empty table of its handshake.
        b2 = WorkerProc(b_host, 1, 4, name="peer-b", register_within=TTL_MS / 1000 + 15, regions_after=1.0,
                        **common)
        workers.append(b2)
        b2.ready(40)
        again = a.reply("again", 45)
        new_id = b2.hello["info"]["engine_id"]
        assert new_id != old_id
        assert again["success"], f"the endpoint never reached the new incarnation: {again}"
        assert again["peer_engine_id"] == new_id, (again, new_id)
        assert again["reconnects"] == 1, again
        # A fresh connect by name reaches it too.
        fresh = a.call("fresh", 45, addr="peer-b", lslot=2, rslot=3, until=now() + 30, op_wait=OP_TIMEOUT + 5)
        assert fresh["success"], f"connect('peer-b') never reached the new incarnation: {fresh}"
        assert fresh["peer_engine_id"] == new_id, (fresh, new_id)

        report("peer_restart", directory=f"{store} (hub namespace)", ttl_ms=TTL_MS, op_timeout_s=OP_TIMEOUT,
               error=f"{last['type']}: {last['message'][:200]}",
               kill_to_error_s=round(t_failed - t_kill, 3),
               kill_to_reregistered_s=round(b2.hello["t_up"] - t_kill, 3),
               reregistered_to_first_ok_s=round(again["t_ok"] - b2.hello["t_up"], 3),
               regions_registered_after_s=1.0, op_tries=again["tries"], last_error_before=again["last_error"])
    finally:
        stop_all(workers)
        server.close()
