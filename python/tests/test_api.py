"""The synchronous API: registration of every kind of object, the operations, batches,
futures, connect/accept."""
import array
import json

import numpy as np
import pytest

import sluice
from conftest import pattern


def test_version_and_exports():
    assert sluice.__version__
    for name in sluice.__all__:
        assert hasattr(sluice, name)


def test_engine_basics():
    with sluice.Engine(transports="tcp", channels=1, listen="127.0.0.1:0") as e:
        assert e.transports == ["tcp"]
        host, port = e.listen_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        info = json.loads(e.local_info())
        assert isinstance(info, dict) and info
        assert "sluice.Engine" in repr(e)
    assert e.closed
    assert repr(e) == "<sluice.Engine closed>"
    e.close()  # idempotent


def test_register_kinds():
    with sluice.Engine(channels=1) as e:
        objs = [np.zeros(100, np.float32), bytearray(64), memoryview(bytearray(32)),
                array.array("d", [1.0, 2.0]), np.zeros((4, 4), order="F")]
        handles = [e.register(o) for o in objs]
        assert len(set(handles)) == len(handles)
        assert all(isinstance(h, sluice.MemoryHandle) and int(h) > 0 for h in handles)
        assert repr(handles[0]).startswith("MemoryHandle(")
        raw = np.zeros(16, np.uint8)
        h = e.register((raw.ctypes.data, raw.nbytes))
        for x in handles + [h]:
            e.unregister(x)


def test_register_dlpack_only_object():
    class OnlyDLPack:
        def __init__(self, arr):
            self.arr = arr

        def __dlpack__(self, stream=None, **kw):
            return self.arr.__dlpack__()

        def __dlpack_device__(self):
            return self.arr.__dlpack_device__()

    src = pattern(4096)
    with sluice.Engine(channels=1) as a, sluice.Engine(channels=1) as b:
        a.register(OnlyDLPack(src), name="dl")
        dst = np.zeros(4096, np.uint8)
        hd = b.register(dst)
        ep = b.connect(a.listen_address)
        ep.read([(hd, 0, ep.remote_region("dl"), 0, 4096)]).result(10)
        assert np.array_equal(src, dst)


def test_register_rejects():
    with sluice.Engine(channels=1) as e:
        with pytest.raises(sluice.InvalidArgumentError, match="read-only"):
            e.register(b"immutable bytes")
        with pytest.raises(sluice.InvalidArgumentError):
            e.register(np.zeros((8, 8))[:, ::2])  # not contiguous
        with pytest.raises(sluice.InvalidArgumentError, match="cannot register"):
            e.register(object())
        with pytest.raises(sluice.InvalidArgumentError):
            e.register(np.zeros(8), location="mars")
        e.register(np.zeros(8), name="dup")
        with pytest.raises(sluice.SluiceError):
            e.register(np.zeros(8), name="dup")


def test_read_write_all_batch_forms(pair):
    n = 1 << 16
    src, dst = pattern(n), np.zeros(n, np.uint8)
    hs = pair.b.register(src, name="src")
    hd = pair.a.register(dst)
    hw = pair.b.register(np.zeros(n, np.uint8), name="dst")
    r = pair.ep.remote_region("src")
    assert isinstance(r, sluice.RemoteHandle) and "RemoteHandle" in repr(r)
    q = n // 4
    # list of tuples, (N, 5) uint64, int64, structured
    pair.ep.read([(hd, 0, r, 0, q)]).result(10)
    pair.ep.read(np.array([[hd, q, r, q, q]], dtype=np.uint64)).result(10)
    pair.ep.read(np.array([hd, 2 * q, r, 2 * q, q], dtype=np.int64)).result(10)
    sb = np.zeros(2, dtype=sluice.BATCH_DTYPE)
    sb["local"], sb["remote"], sb["length"] = hd, r, q // 2
    sb["local_offset"] = sb["remote_offset"] = [3 * q, 3 * q + q // 2]
    f = pair.ep.read(sb)
    assert f.result(10) is f
    assert f.bytes == q
    assert np.array_equal(src, dst)
    # write back into another region
    w = pair.ep.write([(hd, 0, pair.ep.remote_region("dst"), 0, n)]).result(10)
    assert w.bytes == n and w.status == sluice.ErrorCode.OK and w.code == 0 and w.message == ""
    assert w.exception() is None and w.elapsed > 0 and w.done()
    del hs, hw


def test_batch_validation(pair):
    h = pair.a.register(np.zeros(64, np.uint8))
    r = pair.b.register(np.zeros(64, np.uint8), name="r")
    rr = pair.ep.remote_region("r")
    for bad in ([(h, 0, rr, 0)], [(h, -1, rr, 0, 8)], [5], 42, np.zeros((2, 4), np.uint64),
                np.zeros((1, 5), np.float64), np.array([[h, 0, rr, 0, -1]], np.int64)):
        with pytest.raises(sluice.InvalidArgumentError):
            pair.ep.read(bad)
    del r


def test_write_with_imm(pair):
    src = pattern(8192, 3)
    dst = np.zeros(8192, np.uint8)
    hs = pair.a.register(src)
    pair.b.register(dst, name="d")
    imm = pair.peer.imm_recv()
    assert not imm.done() and imm.status is None and imm.code is None and imm.exception() is None
    assert "pending" in repr(imm)
    pair.ep.write_with_imm([(hs, 0, pair.ep.remote_region("d"), 0, 8192)], 0xDEADBEEF).result(10)
    assert imm.result(10).imm == 0xDEADBEEF
    assert np.array_equal(src, dst)


def test_send_recv_ordering_and_lengths(pair):
    out = np.arange(256, dtype=np.uint8)
    inbox = np.zeros(1024, np.uint8)
    ho, hi = pair.a.register(out), pair.b.register(inbox)
    recvs = [pair.peer.recv(hi, i * 256, 256) for i in range(4)]
    sends = [pair.ep.send(ho, i, 10 * (i + 1)) for i in range(4)]
    sluice.wait_all(sends + recvs, timeout=10)
    for i, r in enumerate(recvs):
        assert r.bytes == 10 * (i + 1)
        assert np.array_equal(inbox[i * 256: i * 256 + r.bytes], out[i: i + r.bytes])
    # default length: to the end of the region
    r = pair.peer.recv(hi)
    pair.ep.send(ho, 200).result(10)
    assert r.result(10).bytes == 56
    with pytest.raises(sluice.UnknownHandleError):
        pair.ep.send(12345)


def test_future_wait_timeout_and_callbacks(pair):
    h = pair.b.register(np.zeros(64, np.uint8))
    f = pair.peer.recv(h)
    assert f.wait(timeout=0.05) is False
    with pytest.raises(sluice.SluiceTimeoutError):
        f.result(timeout=0.05)
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.bytes))
    pair.ep.send(pair.a.register(np.ones(8, np.uint8))).result(10)
    assert f.wait() is True
    import time

    for _ in range(100):
        if seen:
            break
        time.sleep(0.01)
    assert seen == [8]
    done = []
    f.add_done_callback(done.append)  # already complete: runs at once
    assert done == [f]


def test_connect_with_blob_and_accept_timeout():
    with sluice.Engine(channels=1) as a, sluice.Engine(channels=1) as b:
        assert b.accept(timeout=0.05) is None
        a.register(np.zeros(8, np.uint8), name="n")
        ep = b.connect(a.local_info())
        assert ep.connected and ep.channels == 1 and ep.peer_engine_id
        assert ep.transport in a.transports
        assert "sluice.Endpoint" in repr(ep)
        assert any(r["name"] == "n" for r in ep.remote_regions())
        with pytest.raises(sluice.UnknownHandleError):
            ep.remote_region("later")
        a.register(np.zeros(8, np.uint8), name="later")
        ep.refresh_remote_regions()
        assert ep.remote_region("later")
        peer = a.accept(timeout=5)
        assert peer is not None
        with ep:
            pass
        assert not ep.connected


def test_region_descriptor_in_band(pair):
    # A region registered after the connect, handed over as a descriptor: readable without a
    # refresh; another engine's descriptor and garbage are refused.
    src = pattern(8192, 3)
    hb = pair.b.register(src)
    dst = np.zeros(8192, np.uint8)
    hd = pair.a.register(dst)
    desc = pair.b.region_descriptor(hb)
    assert isinstance(desc, str)
    r = pair.ep.import_region(desc)
    assert int(r) == int(hb)
    pair.ep.read([(hd, 0, r, 0, 8192)]).result(10)
    assert np.array_equal(dst, src)
    with sluice.Engine(channels=1) as other:
        ho = other.register(np.zeros(64, np.uint8))
        with pytest.raises(sluice.InvalidArgumentError, match="peer is"):
            pair.ep.import_region(other.region_descriptor(ho))
    with pytest.raises(sluice.InvalidArgumentError):
        pair.ep.import_region("{not json")
    with pytest.raises(sluice.InvalidArgumentError):
        pair.ep.import_region(42)
    with pytest.raises(sluice.UnknownHandleError):
        pair.b.region_descriptor(987654)


def test_allocate(pair):
    alloc = pair.b.allocate(10000, name="alloc")
    buf, h = alloc
    assert buf.nbytes >= 10000 and buf.dtype == np.uint8 and not buf.any()
    buf[:100] = 7
    dst = np.zeros(100, np.uint8)
    hd = pair.a.register(dst)
    pair.ep.read([(hd, 0, pair.ep.remote_region("alloc"), 0, 100)]).result(10)
    assert (dst == 7).all()
    pair.b.unregister(h)  # frees it
    assert buf[0] == 7  # our mapping stays valid
    with pytest.raises(sluice.UnknownHandleError):
        pair.b.unregister(h)


def test_many_small_ops(pair):
    src = pattern(1 << 20)
    pair.b.register(src, name="s")
    dst = np.zeros_like(src)
    hd = pair.a.register(dst)
    r = pair.ep.remote_region("s")
    fs = [pair.ep.read([(hd, i * 4096, r, i * 4096, 4096)]) for i in range(256)]
    sluice.wait_all(fs, timeout=30)
    assert np.array_equal(src, dst)
