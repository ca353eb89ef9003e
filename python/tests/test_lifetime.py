"""Object lifetimes: the engine keeps registered objects alive; close() with pending
operations completes them with CancelledError and never hangs."""
import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import sluice
from conftest import pattern


class Arr(np.ndarray):
    """An ndarray subclass, so that it can be weak-referenced."""


def make_array(n, seed=0):
    return pattern(n, seed).view(Arr)


def test_registered_array_stays_alive(pair):
    arr = make_array(1 << 16, 5)
    ref = weakref.ref(arr)
    h = pair.b.register(arr, name="a")
    del arr
    gc.collect()
    assert ref() is not None  # the engine holds it
    dst = np.zeros(1 << 16, np.uint8)
    hd = pair.a.register(dst)
    pair.ep.read([(hd, 0, pair.ep.remote_region("a"), 0, 1 << 16)]).result(10)
    assert np.array_equal(dst, pattern(1 << 16, 5))
    pair.b.unregister(h)
    gc.collect()
    assert ref() is None  # released once unregistered


def test_close_releases_objects():
    e = sluice.Engine(channels=1)
    arr = make_array(4096)
    ref = weakref.ref(arr)
    e.register(arr)
    del arr
    gc.collect()
    assert ref() is not None
    e.close()
    gc.collect()
    assert ref() is None


def test_engine_gc_closes():
    e = sluice.Engine(channels=1)
    core_ref = weakref.ref(e)
    del e
    gc.collect()
    assert core_ref() is None


def test_bytearray_cannot_resize_while_registered():
    with sluice.Engine(channels=1) as e:
        b = bytearray(100)
        h = e.register(b)
        with pytest.raises(BufferError):
            b.extend(b"x" * 1000)
        e.unregister(h)
        b.extend(b"x" * 1000)  # fine once unregistered


def test_close_with_pending_futures_cancels():
    a, b = sluice.Engine(channels=1), sluice.Engine(channels=1)
    h = a.register(np.zeros(64, np.uint8))
    ep = a.connect(b.listen_address)
    pending = [ep.recv(h) for _ in range(10)] + [ep.imm_recv() for _ in range(5)]
    t0 = time.monotonic()
    a.close()
    for f in pending:
        with pytest.raises(sluice.CancelledError):
            f.result(5)
    assert time.monotonic() - t0 < 5
    b.close()


def test_close_while_another_thread_waits():
    a, b = sluice.Engine(channels=1), sluice.Engine(channels=1)
    h = a.register(np.zeros(64, np.uint8))
    ep = a.connect(b.listen_address)
    f = ep.recv(h)
    errors = []

    def waiter():
        try:
            f.wait()
        except sluice.SluiceError as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    a.close()
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], sluice.CancelledError)
    b.close()


def test_close_while_accept_waits():
    e = sluice.Engine(channels=1)
    got = []

    def accept():
        try:
            got.append(e.accept(None))
        except sluice.ClosedError as exc:
            got.append(exc)

    t = threading.Thread(target=accept)
    t.start()
    time.sleep(0.05)
    e.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(got[0], sluice.ClosedError)


def test_callback_holding_last_engine_reference():
    """An Engine dropped inside a completion callback (engine thread) is closed safely."""
    a = sluice.Engine(channels=1)
    b = sluice.Engine(channels=1)
    h = b.register(np.zeros(8, np.uint8))
    ep_b = b.connect(a.listen_address)
    ep_a = a.accept(5)
    box = {"engine": a}
    done = threading.Event()
    f = ep_a.recv(a.register(np.zeros(8, np.uint8)))

    def cb(_):
        box.pop("engine", None)
        done.set()

    f.add_done_callback(cb)
    ref = weakref.ref(a)
    del a, ep_a
    try:
        ep_b.send(h).result(10)
    except sluice.PeerLostError:
        pass  # `a` may be closed (by the callback) before it acknowledges the send
    assert done.wait(10)
    for _ in range(100):  # closed and collected from a helper thread
        if ref() is None:
            break
        time.sleep(0.05)
        gc.collect()
    assert ref() is None
    b.close()


def test_tensor_like_with_refcount():
    with sluice.Engine(channels=1) as e:
        arr = np.zeros(128, np.uint8)
        before = sys.getrefcount(arr)
        h = e.register(arr)
        assert sys.getrefcount(arr) > before
        e.unregister(h)
        gc.collect()
        assert sys.getrefcount(arr) == before


def test_allocation_outlives_engine():
    e = sluice.Engine(channels=1)
    buf, h = e.allocate(1 << 16)
    buf[:] = 3
    e.close()
    assert int(buf.sum()) == 3 * (1 << 16)  # our own mapping: still valid


def test_ops_after_engine_close_fail_fast(pair):
    h = pair.a.register(np.zeros(8, np.uint8))
    r = pair.b.register(np.zeros(8, np.uint8), name="r")
    rr = pair.ep.remote_region("r")
    pair.a.close()
    with pytest.raises((sluice.CancelledError, sluice.ClosedError)):
        pair.ep.read([(h, 0, rr, 0, 8)]).result(5)
    del r


# Daemon threads blocked in engine calls while the interpreter exits with the engine open:
# the atexit hook closes the engine, the calls return and retake the GIL just as the
# interpreter finalizes. CPython < 3.14 ends such a thread with a forced unwind, which used to
# cross a GIL guard's destructor and abort the process ("terminate called without an active
# exception") in about 1 exit in 20 (the Mooncake facade's accept thread hit it in CI).
_EXIT_WITH_BLOCKED_THREADS = r"""
import threading, sluice
a = sluice.Engine(channels=1)
b = sluice.Engine(channels=1)
ep = a.connect(b.listen_address, transport="tcp")
peer = b.accept(timeout=10)
buf = bytearray(64)
h = b.register(buf)
def accept_loop(e):
    while True:
        try:
            e.accept(timeout=0.002)
        except Exception:
            pass
def recv_loop():
    while True:
        try:
            peer.recv(h, 0, 64).wait(timeout=0.002)
        except Exception:
            pass
for _ in range(4):
    threading.Thread(target=accept_loop, args=(a,), daemon=True).start()
    threading.Thread(target=accept_loop, args=(b,), daemon=True).start()
    threading.Thread(target=recv_loop, daemon=True).start()
print("exiting", flush=True)
"""


def test_exit_with_open_engine_and_blocked_daemon_threads():
    import subprocess
    import sys
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_WITH_BLOCKED_THREADS], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(24)]
    bad = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode != 0 or out.strip() != "exiting":
            bad.append(f"rc={p.returncode} stdout={out.strip()!r} stderr={err.strip()[-400:]!r}")
    assert not bad, f"{len(bad)} of {len(procs)} exits failed:\n" + "\n".join(bad)
