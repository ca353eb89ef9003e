"""Endpoint metrics over real transports: the counters agree with what was done, and the
Prometheus text carries them (docs/metrics.md)."""
import re

import numpy as np
import pytest

from conftest import pattern


def test_counters_follow_the_operations(pair):
    n = 64 << 10
    src = pattern(n)
    dst = np.zeros(n, np.uint8)
    hs = pair.a.register(src)
    pair.b.register(dst, name="dst")
    rd = pair.ep.remote_region("dst")
    for i in range(5):
        pair.ep.write([(hs, 0, rd, 0, 1000 + i)]).result(10)
    pair.ep.read([(hs, 0, rd, 0, 4096)]).result(10)
    with pytest.raises(Exception):
        pair.ep.write([(hs, 0, rd, n - 4, 8)])  # out of range: refused at submit, not counted
    m = pair.ep.metrics()
    assert m["transport"] == pair.ep.transport
    assert m["peer_engine_id"] == pair.ep.peer_engine_id
    assert m["connected"] is True
    assert m["ops"]["write"] == {"started": 5, "completed": 5, "failed": 0, "bytes": 5 * 1000 + 10}
    assert m["ops"]["read"]["completed"] == 1 and m["ops"]["read"]["bytes"] == 4096
    assert m["ops"]["send"]["started"] == 0
    assert m["in_flight"] == 0
    lat = m["latency"]
    assert lat["count"] == 6 and sum(lat["counts"]) == 6
    assert lat["sum_s"] > 0 and lat["bounds_s"][0] == pytest.approx(1e-6)
    assert [x["endpoint"] for x in pair.a.metrics()] == [m["endpoint"]]


def test_messages_are_counted_on_both_sides(pair):
    buf = pattern(4096)
    into = np.zeros(4096, np.uint8)
    hb = pair.a.register(buf)
    hi = pair.b.register(into)
    r = pair.peer.recv_async(hi, 0, 4096)
    s = pair.ep.send(hb, 0, 4096)
    r.result(10)
    # The sender's future ends on the peer's ack, which can come after the receiver's.
    s.result(10)
    assert pair.ep.metrics()["ops"]["send"]["completed"] == 1
    got = pair.peer.metrics()["ops"]["recv"]
    assert got["completed"] == 1 and got["bytes"] == 4096


def test_prometheus_text(tcp_pair):
    src = pattern(4096)
    dst = np.zeros(4096, np.uint8)
    hs = tcp_pair.a.register(src)
    tcp_pair.b.register(dst, name="dst")
    tcp_pair.ep.write([(hs, 0, tcp_pair.ep.remote_region("dst"), 0, 4096)]).result(10)
    text = tcp_pair.a.metrics_text()
    lines = [l for l in text.splitlines() if l and not l.startswith("#")]
    assert all(re.fullmatch(r'[a-z_]+(\{[^}]*\})? \S+', l) for l in lines), text[:500]
    peer = tcp_pair.ep.peer_engine_id
    want = f'peer="{peer}",transport="tcp",kind="write"}} '
    assert any(l.startswith("sluice_endpoint_bytes_total{") and want in l and l.endswith(" 4096") for l in lines)
    assert any(l.startswith("sluice_endpoint_op_latency_seconds_count{") and l.endswith(" 1") for l in lines)


def test_a_replaced_channel_and_its_retry_are_counted(monkeypatch):
    """tcp channel failover (docs/cluster.md): b's first connection of channel 0 never answers
    (the test-only SLUICE_TCP_TEST_MUTE_CHANNEL, read as b's endpoint is made); a replaces the
    channel, sends the write again, and counts both, in metrics() and in the Prometheus text."""
    import sluice

    a = sluice.Engine(transports="tcp", channels=1, op_timeout_ms=20000, **{"tcp.failover_ms": 200})
    b = sluice.Engine(transports="tcp", channels=1)
    try:
        monkeypatch.setenv("SLUICE_TCP_TEST_MUTE_CHANNEL", "0")
        ep = a.connect(b.listen_address)
        peer = b.accept(timeout=10)
        monkeypatch.delenv("SLUICE_TCP_TEST_MUTE_CHANNEL")
        assert peer is not None
        src = pattern(64 << 10)
        dst = np.zeros(64 << 10, np.uint8)
        hs = a.register(src)
        b.register(dst, name="dst")
        ep.refresh_remote_regions()
        ep.write([(hs, 0, ep.remote_region("dst"), 0, 64 << 10)]).result(15)
        assert np.array_equal(src, dst)
        m = ep.metrics()
        assert (m["channels_replaced"], m["retries"]) == (1, 1), m
        assert m["ops"]["write"]["failed"] == 0
        text = a.metrics_text()
        assert re.search(r"^sluice_endpoint_channels_replaced_total\{[^}]*\} 1$", text, re.M), text
        assert re.search(r"^sluice_endpoint_retries_total\{[^}]*\} 1$", text, re.M), text
    finally:
        a.close()
        b.close()
