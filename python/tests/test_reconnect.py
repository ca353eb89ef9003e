"""Reconnection from Python (docs/cluster.md, "Reconnection"): the peer engine closes and a
new one starts on the same address; the endpoint's next operation connects to it. The rules one
by one are tested in C++ (tests/core/reconnect_test.cpp)."""
import time

import numpy as np
import pytest

import sluice

N = 1 << 16


def _restart_peer(transport, reconnect):
    a = sluice.Engine(transports=transport, channels=1)
    b = sluice.Engine(transports=transport, channels=1)
    src = np.arange(N, dtype=np.uint32).view(np.uint8)[:N].copy()
    hs = a.register(src, name="src")
    old = np.zeros(N, np.uint8)
    b.register(old, name="dst")
    ep = a.connect(b.listen_address, reconnect=reconnect)
    old_r = ep.remote_region("dst")
    ep.write([(hs, 0, old_r, 0, N)]).result(10)
    old_id = ep.peer_engine_id
    addr = b.listen_address
    b.close()
    # The loss is noticed on the connection (EOF), without an operation.
    deadline = time.monotonic() + 10
    while ep.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ep.connected, "the endpoint never noticed that its peer closed"
    b2 = sluice.Engine(transports=transport, channels=1, listen=addr)
    new = np.zeros(N, np.uint8)
    b2.register(new, name="dst")
    return a, b2, ep, hs, src, old_r, old_id, new


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_next_op_reaches_the_restarted_peer(transport):
    a, b2, ep, hs, src, old_r, old_id, new = _restart_peer(transport, reconnect=True)
    try:
        # The old handle is refused by the new engine, never mapped onto one of its regions.
        with pytest.raises(sluice.UnknownHandleError):
            ep.write([(hs, 0, old_r, 0, N)])
        assert ep.connected and ep.peer_engine_id != old_id
        assert ep.metrics()["reconnects"] == 1
        r = ep.remote_region("dst")
        assert r != old_r
        ep.write([(hs, 0, r, 0, N)]).result(10)
        assert np.array_equal(new, src)
        assert "sluice_endpoint_reconnects_total" in a.metrics_text()
    finally:
        a.close()
        b2.close()


def test_opted_out_endpoint_stays_failed():
    a, b2, ep, hs, src, old_r, old_id, new = _restart_peer("tcp", reconnect=False)
    try:
        with pytest.raises(sluice.PeerLostError):
            ep.write([(hs, 0, old_r, 0, N)])
        assert not ep.connected and ep.peer_engine_id == old_id
        assert ep.metrics()["reconnects"] == 0
        assert not new.any()
    finally:
        a.close()
        b2.close()


def test_reconnect_must_be_a_bool():
    with sluice.Engine(channels=1) as a, sluice.Engine(channels=1) as b:
        with pytest.raises(sluice.InvalidArgumentError, match="reconnect"):
            a.connect(b.listen_address, reconnect="yes")
