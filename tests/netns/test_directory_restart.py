"""Scenario 4: the directory server (redis-server or etcd, in the hub namespace) killed and
restarted empty while one engine streams checked operations to another it found by name. The data path
does not go through the store, so the stream goes on without a failure. Both engines publish
themselves again on their next heartbeat, and a new connect by name reaches the same engine.
Reported: restart -> both entries back, restart -> first successful connect by name."""
from __future__ import annotations

import time
from typing import List

import pytest

from driver import WorkerError, WorkerProc, now, stop_all
from store_server import KINDS, StoreServer

OP_TIMEOUT = 5.0
TTL_MS = 2000


@pytest.mark.parametrize("store", KINDS)
def test_directory_restarted_empty_during_traffic(topology, report, store):
    topo = topology(2, tag="dir")
    server = StoreServer(store, topo.hub)
    server.start()
    url = server.url("netns")
    common = dict(slot=1 << 20, transports="tcp", op_timeout=OP_TIMEOUT, connect_timeout=10.0, directory=url,
                  options={"directory.ttl_ms": TTL_MS})
    workers: List[WorkerProc] = []
    try:
        a = WorkerProc(topo.hosts[0], 0, 4, name="writer-a", **common)
        b = WorkerProc(topo.hosts[1], 1, 4, name="peer-b", **common)
        workers += [a, b]
        a.ready()
        b.ready()
        assert server.keys("netns") == ["netns/peer-b", "netns/writer-a"]
        a.call("stream_start", target=1, addr="peer-b", wait=OP_TIMEOUT + 5)
        deadline = now() + 30
        while a.call("stream_status", 10)["oks"] < 5:
            assert now() < deadline, "no 5 checked ops before the restart"
            time.sleep(0.05)

        server.kill()
        server.start(wipe=True)  # empty: every entry and lease lost
        t_restart = now()
        fresh = a.call("fresh", timeout=40, addr="peer-b", lslot=2, rslot=3, until=t_restart + 30,
                       op_wait=OP_TIMEOUT + 5)
        t_keys = None
        while t_keys is None:
            if server.keys("netns") == ["netns/peer-b", "netns/writer-a"]:
                t_keys = now()
            elif now() > t_restart + 30:
                raise WorkerError(f"the engines did not publish themselves again: keys {server.keys('netns')}")
            else:
                time.sleep(0.05)
        # The stream must have gone on past the restart.
        deadline = now() + 30
        while (a.call("stream_status", 10)["last_ok_t1"] or 0) <= t_keys:
            assert now() < deadline, "the stream made no progress after the store came back"
            time.sleep(0.05)
        log = a.call("stream_stop", 30, join=OP_TIMEOUT + 10)["log"]
        failed = [r for r in log if not r["ok"]]
        assert not failed, f"operations failed while only the directory was down: {failed}"
        assert fresh["success"], f"connect('peer-b') never succeeded after the store restarted: {fresh}"
        assert fresh["peer_engine_id"] == b.hello["info"]["engine_id"]

        report("directory_restart", directory=f"{store} (hub namespace), restarted empty", ttl_ms=TTL_MS,
               stream_ops=len(log), stream_failures=len(failed),
               restart_to_both_entries_back_s=round(t_keys - t_restart, 3),
               restart_to_first_connect_by_name_ok_s=round(fresh["t_ok"] - t_restart, 3), connect_tries=fresh["tries"])
    finally:
        stop_all(workers)
        server.close()
