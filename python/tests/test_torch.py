"""CPU torch tensors: registration, transfers into/out of tensors, lifetimes."""
import gc
import weakref

import numpy as np
import pytest

import sluice

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")


def test_register_and_read_into_tensor(pair):
    src = torch.arange(65536, dtype=torch.float32)
    dst = torch.zeros(65536, dtype=torch.float32)
    pair.b.register(src, name="t")
    hd = pair.a.register(dst)
    n = src.numel() * src.element_size()
    pair.ep.read([(hd, 0, pair.ep.remote_region("t"), 0, n)]).result(10)
    assert torch.equal(src, dst)


def test_write_from_tensor_views(pair):
    base = torch.arange(1024, dtype=torch.int64)
    view = base[256:512]  # contiguous slice with a storage offset
    dst = np.zeros(256, np.int64)
    hv = pair.a.register(view)
    pair.b.register(dst, name="d")
    pair.ep.write([(hv, 0, pair.ep.remote_region("d"), 0, 256 * 8)]).result(10)
    assert np.array_equal(dst, np.arange(256, 512))


def test_non_contiguous_tensor_rejected():
    with sluice.Engine(channels=1) as e:
        with pytest.raises(sluice.InvalidArgumentError, match="contiguous"):
            e.register(torch.zeros(16, 16).t())


def test_tensor_deleted_while_registered_stays_alive(pair):
    t = torch.full((1 << 16,), 7, dtype=torch.uint8)
    ref = weakref.ref(t)
    h = pair.b.register(t, name="t")
    del t
    gc.collect()
    assert ref() is not None
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    hd = pair.a.register(dst)
    pair.ep.read([(hd, 0, pair.ep.remote_region("t"), 0, 1 << 16)]).result(10)
    assert int(dst.sum()) == 7 * (1 << 16)
    pair.b.unregister(h)
    gc.collect()
    assert ref() is None


def test_tensor_via_dlpack_object(pair):
    class Wrapper:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None, **kw):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = torch.arange(100, dtype=torch.uint8)
    pair.b.register(Wrapper(t), name="w")
    dst = np.zeros(100, np.uint8)
    hd = pair.a.register(dst)
    pair.ep.read([(hd, 0, pair.ep.remote_region("w"), 0, 100)]).result(10)
    assert np.array_equal(dst, np.arange(100))


def test_recv_into_tensor(pair):
    out = torch.arange(32, dtype=torch.uint8)
    into = torch.zeros(64, dtype=torch.uint8)
    ho, hi = pair.a.register(out), pair.b.register(into)
    r = pair.peer.recv(hi)
    pair.ep.send(ho).result(10)
    assert r.result(10).bytes == 32
    assert torch.equal(into[:32], out)
