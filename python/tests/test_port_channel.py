"""The port channel from Python with host producers, over tcp and shm: puts with signals land
before their counter moves, many Python threads share a small FIFO, the device handle comes
out as bytes of the documented size, caller errors raise typed errors, and a lost peer or a
stopped proxy makes wait() / flush() raise instead of hanging."""
import threading

import numpy as np
import pytest

import sluice
from conftest import Pair, pattern
from sluice.port_channel import PortChannel, ProxyService

N = 1 << 20
SEM = N - 8


@pytest.fixture(params=["tcp", "shm"])
def ends(request):
    p = Pair(transport=request.param)
    p.src = pattern(N, 1)
    p.src[N - 4096 :] = 0
    p.dst = np.zeros(N, dtype=np.uint8)
    p.hs = p.a.register(p.src)
    p.hd = p.b.register(p.dst, name="dst")
    p.remote = p.ep.remote_region("dst")
    yield p
    p.close()


def channel(p, **kw):
    proxy = ProxyService(p.a, **kw)
    ch = proxy.add_channel(p.ep, proxy.add_remote_memory(p.ep, p.remote), proxy.add_memory(p.hs),
                           remote_semaphore=(p.remote, SEM), local_semaphore=(p.hs, SEM))
    proxy.start()
    return proxy, ch


def counter(p) -> int:
    return int(p.dst[SEM:].view(np.uint64)[0])


def test_puts_signals_and_flush(ends):
    p = ends
    proxy, ch = channel(p)
    for k in range(32):
        ch.put(k * 8192, k * 8192, 8192, signal=True)
    ch.flush()
    assert counter(p) == 32
    assert np.array_equal(p.src[: 32 * 8192], p.dst[: 32 * 8192])
    assert not p.dst[32 * 8192 : SEM].any()
    assert proxy.stats()["puts"] == 32
    assert ch.error() is None
    assert not ch.poll()
    proxy.stop()


def test_many_threads_share_a_small_fifo(ends):
    p = ends
    proxy, ch = channel(p, fifo_depth=16)
    threads, each = 16, 32

    def produce(t):
        for i in range(each):
            off = (t * each + i) * 64
            ch.put(off, off, 64, signal=True)

    ts = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ch.flush()
    assert counter(p) == threads * each
    assert np.array_equal(p.src[: threads * each * 64], p.dst[: threads * each * 64])
    proxy.stop()


def test_handle_bytes_have_the_handle_size(ends):
    proxy, ch = channel(ends)
    b = ch.handle_bytes()
    assert isinstance(b, bytes) and len(b) == PortChannel.handle_size
    # The FIFO slots pointer (first field) is a real, non-null address.
    assert int.from_bytes(b[:8], "little") != 0
    proxy.stop()


def test_caller_errors(ends):
    p = ends
    proxy = ProxyService(p.a)
    with pytest.raises(sluice.UnknownHandleError):
        proxy.add_memory(987654)
    with pytest.raises(sluice.UnknownHandleError):
        proxy.add_remote_memory(p.ep, 987654)
    dst, src = proxy.add_remote_memory(p.ep, p.remote), proxy.add_memory(p.hs)
    with pytest.raises(sluice.InvalidArgumentError):
        proxy.add_channel(p.ep, src, dst, remote_semaphore=(p.remote, 0), local_semaphore=(p.hs, 0))
    with pytest.raises(sluice.InvalidArgumentError):
        proxy.add_channel(p.ep, dst, src, remote_semaphore=(p.remote, 3), local_semaphore=(p.hs, 0))
    with pytest.raises(sluice.InvalidArgumentError):
        ProxyService(p.a, fifo_depth=100)
    with pytest.raises(sluice.InvalidArgumentError):
        ProxyService(p.a, producers="tpu")
    ch = proxy.add_channel(p.ep, dst, src, remote_semaphore=(p.remote, SEM), local_semaphore=(p.hs, SEM))
    proxy.start()
    ch.put(N - 4, 0, 8)  # out of range at the peer: the proxy's post fails the channel
    with pytest.raises(sluice.OutOfRangeError):
        ch.flush()
    assert isinstance(ch.error(), sluice.OutOfRangeError)
    proxy.stop()


def test_wait_times_out_then_lost_peer_raises(ends):
    p = ends
    proxy, ch = channel(p)
    with pytest.raises(sluice.SluiceTimeoutError):
        ch.wait(timeout=0.05)
    p.peer.close()
    p.b.close()
    with pytest.raises(sluice.SluiceError) as exc:
        ch.wait(timeout=30)
    assert not isinstance(exc.value, sluice.SluiceTimeoutError), "wait() ran out its bound instead of failing"
    with pytest.raises(sluice.SluiceError):
        ch.flush()
    proxy.stop()


def test_stopped_proxy_raises_closed(ends):
    proxy, ch = channel(ends)
    proxy.stop()
    with pytest.raises(sluice.ClosedError):
        ch.put(0, 0, 8)
    with pytest.raises(sluice.ClosedError):
        ch.wait()
