"""connect.retry_ms (docs/cluster.md, "Measured recovery"): a TCP connection attempt whose SYN
was lost is joined by a fresh one instead of waiting for the kernel's resend, 1 s later.

A lost SYN is made deterministically: a listener whose accept queue is full drops it (and
counts it in TcpExt ListenOverflows). Once the drop is counted the queue is freed; the
engine's connect (timeout 0.8 s, less than the kernel's 1 s SYN resend) can then only get
through with a fresh attempt."""
import socket
import threading
import time

import pytest

import sluice


def _listen_overflows():
    with open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:]))["ListenOverflows"])
    raise RuntimeError("no TcpExt ListenOverflows")


def _connect_through_a_dropped_syn(monkeypatch, retry_ms):
    monkeypatch.setenv("SLUICE_CONNECT_RETRY_MS", str(retry_ms))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)  # the accept queue holds one connection
    filler = socket.create_connection(srv.getsockname())  # ... and now it is full
    seen = {}
    base = _listen_overflows()

    def serve():
        deadline = time.monotonic() + 5
        while _listen_overflows() == base and time.monotonic() < deadline:
            time.sleep(0.002)  # until the engine's SYN has been dropped
        seen["dropped"] = _listen_overflows() > base
        srv.accept()[0].close()  # the filler: room for one more
        srv.settimeout(2)
        try:
            conn = srv.accept()[0]  # the engine's info query; closed unanswered
            seen["request"] = conn.recv(64)
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve)
    t.start()
    try:
        with sluice.Engine(transports="tcp") as e:
            with pytest.raises(sluice.SluiceError) as err:
                e.connect("127.0.0.1:%d" % srv.getsockname()[1], timeout=0.8)
    finally:
        t.join(10)
        filler.close()
        srv.close()
    return seen, str(err.value)


def test_a_lost_syn_is_retried_with_a_fresh_attempt(monkeypatch):
    seen, msg = _connect_through_a_dropped_syn(monkeypatch, 100)
    assert seen.get("dropped"), "the full accept queue did not drop the first SYN"
    # Connected: the engine sent its query and saw the listener close unanswered.
    assert seen.get("request"), msg
    assert "cannot connect" not in msg, msg


def test_without_retries_the_kernels_resend_is_too_late(monkeypatch):
    # The control: one attempt (connect.retry_ms 0) never connects within 0.8 s.
    seen, msg = _connect_through_a_dropped_syn(monkeypatch, 0)
    assert seen.get("dropped")
    assert "cannot connect" in msg and "timed out" in msg, msg
