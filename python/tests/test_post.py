"""The thin post path from Python: post_write / post_signal / flush over tcp and shm. Bytes
land by flush, the counter moves by the sum of the adds, caller errors raise the library's
typed errors before anything is posted, and posts to a closed peer fail instead of hanging."""
import time

import numpy as np
import pytest

import sluice
from conftest import Pair, pattern

N = 1 << 20


@pytest.fixture(params=["tcp", "shm"])
def ends(request):
    p = Pair(transport=request.param)
    src = pattern(N, 1)
    dst = np.zeros(N, dtype=np.uint8)
    p.hs = p.a.register(src)
    p.hd = p.b.register(dst, name="dst")
    p.remote = p.ep.remote_region("dst")
    p.src, p.dst = src, dst
    yield p
    p.close()


def test_capability_is_declared(ends):
    assert ends.ep.capabilities["rma_post"] is True
    assert ends.ep.capabilities["signal"] is True


def test_writes_and_signals(ends):
    p = ends
    sem = N - 8
    for k in range(64):
        p.ep.post_write(p.hs, k * 4096, p.remote, k * 4096, 4096)
        p.ep.post_signal(p.remote, sem, 2)
    p.ep.flush()
    assert np.array_equal(p.src[: 64 * 4096], p.dst[: 64 * 4096])
    assert int(p.dst[sem:].view(np.uint64)[0]) == 128
    # Nothing outside the posted ranges moved.
    assert not p.dst[64 * 4096 : sem].any()


def test_caller_errors_raise_before_posting(ends):
    p = ends
    with pytest.raises(sluice.OutOfRangeError):
        p.ep.post_write(p.hs, 0, p.remote, N - 4, 8)
    with pytest.raises(sluice.UnknownHandleError):
        p.ep.post_write(p.hs, 0, 987654, 0, 8)
    with pytest.raises(sluice.InvalidArgumentError):
        p.ep.post_signal(p.remote, 3)
    with pytest.raises(sluice.InvalidArgumentError):
        p.ep.post_write(p.hs, -1, p.remote, 0, 8)
    with pytest.raises(sluice.InvalidArgumentError):
        p.ep.post_signal(p.remote, 0, 1 << 64)
    p.ep.flush()  # the refused calls left nothing to report


def test_closed_peer_fails_without_hanging(ends):
    p = ends
    p.peer.close()
    p.b.close()
    t0 = time.monotonic()
    with pytest.raises(sluice.SluiceError):
        for _ in range(1000):
            p.ep.post_write(p.hs, 0, p.remote, 0, 65536)
        p.ep.flush(timeout=5)
    assert time.monotonic() - t0 < 15
