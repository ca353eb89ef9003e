"""A peer whose message header announces an eager message far larger than anything it sends:
the backend must not allocate what the header says. Rank 0 is a real sluice backend; "rank 1"
is a bare sluice Engine in the same process that joins through the same Store and forges the
48-byte header (tag, length, kind and three fields of the device path; src/torch/mailbox.hpp). With the default
SLUICE_TORCH_MAX_UNEXPECTED_BYTES the header alone is refused; with the bound lifted to its
maximum, the failed allocation is. Either way rank 0's pending and later ops with the peer fail
at once naming it, and the peer's control endpoint is closed (before, the allocation threw on
the progress thread and the peer's later messages timed out)."""
from __future__ import annotations

import os
import struct
import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
np = pytest.importorskip("numpy")
st = pytest.importorskip("sluice.torch")
if not st.available():
    if os.environ.get("SLUICE_REQUIRE_TORCH_BACKEND") == "1":  # run_tests.sh built it: a missing one is a failure
        raise ImportError("sluice.torch: the backend extension is missing although torch was installed for the build")
    pytest.skip("sluice was built without the torch backend", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import sluice  # noqa: E402

HEADER = struct.Struct("<QQQQQQ")  # tag, length, kind << 56 | id (eager: 0), region, offset, aux
PARAM = "SLUICE_TORCH_MAX_UNEXPECTED_BYTES"


class ForgedPeer:
    """Rank 1 of a world of 2, as a bare engine: rank 0 dials it twice (control, data)."""

    def __init__(self, store: dist.Store) -> None:
        self.engine = sluice.Engine()
        store.set("sluice/rank/1", self.engine.local_info())
        self.ctrl = None
        self.data = None
        self.error: BaseException | None = None

    def take_endpoints(self) -> None:
        try:
            eps = {}
            for _ in range(2):
                ep = self.engine.accept(timeout=30)
                assert ep is not None, "rank 0 did not dial"
                role = np.zeros(1, np.uint8)  # its first message says which endpoint it is
                ep.recv(self.engine.register(role)).result(30)
                eps[int(role[0])] = ep
            self.ctrl, self.data = eps[0], eps[1]
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def send_header(self, tag: int, length: int, kind: int = 0, extra: bytes = b"", ident: int = 0,
                    region: int = 0) -> None:
        hdr = np.frombuffer(HEADER.pack(tag, length, kind << 56 | ident, region, 0, 0) + extra, np.uint8).copy()
        try:
            self.ctrl.send(self.engine.register(hdr)).result(10)
        except sluice.SluiceError:
            pass  # rank 0 may close the endpoint before it acknowledged the header


def forged_pair(monkeypatch: pytest.MonkeyPatch):
    """Rank 0 as a real backend and the forged rank 1, connected through one HashStore."""
    monkeypatch.delenv("SLUICE_TORCH_TRANSPORT", raising=False)
    store = dist.HashStore()
    peer = ForgedPeer(store)
    t = threading.Thread(target=peer.take_endpoints)
    t.start()
    backend = st._create(store, 0, 2, timedelta(seconds=20))
    t.join(60)
    assert peer.error is None and peer.ctrl is not None, peer.error
    return backend, peer


def refused(monkeypatch: pytest.MonkeyPatch, limit: str | None, length: int, *needles: str) -> None:
    if limit is None:
        monkeypatch.delenv(PARAM, raising=False)
    else:
        monkeypatch.setenv(PARAM, limit)
    backend, peer = forged_pair(monkeypatch)
    try:
        # A recv of another tag, so that the forged header matches no recv: it is unexpected.
        pending = backend.recv([torch.empty(4)], 1, 6)
        peer.send_header(5, length)
        msgs = []
        for what, op in (("pending recv", lambda: pending), ("later recv", lambda: backend.recv([torch.empty(4)], 1, 5)),
                         ("later send", lambda: backend.send([torch.ones(4)], 1, 7))):
            with pytest.raises(Exception) as e:
                op().wait()
            msg = str(e.value)
            for needle in ("peer rank 1", f"{length}-byte eager message (tag 5)", *needles):
                assert needle in msg, f"{what}: the error does not say '{needle}': {msg}"
            assert "group timeout" not in msg, f"{what}: failed by the timeout, not at once: {msg}"
            msgs.append(msg)
        # The peer learns too: rank 0 closed the pair's control endpoint.
        with pytest.raises(sluice.SluiceError) as e:
            peer.ctrl.recv(peer.engine.register(np.zeros(24, np.uint8))).result(10)
        assert not isinstance(e.value, sluice.SluiceTimeoutError), e.value
    finally:
        del backend  # destroys the group: its goodbye to the failed peer ends at once
        peer.engine.close()


@pytest.mark.timeout(60)
def test_a_huge_header_is_refused_by_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 PiB announced: the default bound (1 GiB) refuses it without allocating.
    refused(monkeypatch, None, 1 << 50, f"{PARAM} = {1 << 30} bytes", "0 + 1125899906842624 bytes")


@pytest.mark.timeout(60)
def test_a_failed_allocation_fails_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The bound lifted to its maximum: 4 EiB cannot be allocated (bad_alloc), which fails the
    # peer the same way instead of escaping the progress thread.
    refused(monkeypatch, str(2**64 - 1), 1 << 62, "could not be allocated", f"{PARAM} = {2**64 - 1} bytes")


@pytest.mark.timeout(60)
def test_an_inline_header_without_its_bytes_fails_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    # EAGER_INLINE (kind 6) carries its payload inside the header's message: a header that
    # announces 100 bytes and carries 3 is refused as a protocol error naming the peer, and
    # nothing is copied out of the receive buffer.
    backend, peer = forged_pair(monkeypatch)
    try:
        out = torch.full((25,), 7.0)  # 100 bytes
        pending = backend.recv([out], 1, 5)
        peer.send_header(5, 100, kind=6, extra=b"abc")
        with pytest.raises(Exception) as e:
            pending.wait()
        msg = str(e.value)
        assert "peer rank 1" in msg and "kind 6, length 100" in msg, msg
        assert torch.equal(out, torch.full((25,), 7.0)), "the recv buffer was written"
        with pytest.raises(Exception):
            backend.send([torch.ones(4)], 1, 7).wait()
    finally:
        del backend
        peer.engine.close()


RTR, RTR_DATA = 7, 8
RNDV = 256 << 10  # the default SLUICE_TORCH_RNDV_BYTES


def take_rtr(peer: ForgedPeer) -> tuple[int, int, int, int]:
    """The next header rank 0 sent the forged peer, which must be a ready-to-receive:
    (tag, length, id, our messages it had seen)."""
    buf = np.zeros(HEADER.size, np.uint8)
    peer.ctrl.recv(peer.engine.register(buf)).result(10)
    tag, length, kind_id, region, _, _ = HEADER.unpack(buf.tobytes())
    assert kind_id >> 56 == RTR, kind_id >> 56
    return tag, length, kind_id & ((1 << 55) - 1), region


@pytest.mark.timeout(60)
def test_ready_to_receive_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recv of at least the rendezvous threshold tells its sender at once that it is posted
    # (RTR, mailbox.hpp): the sender puts the payload on the data endpoint and names the RTR in
    # an RTR_DATA header, with no RTS / CTS. Then a payload of the wrong size for an RTR: a
    # protocol error naming the peer, never a short recv reported as complete.
    backend, peer = forged_pair(monkeypatch)
    try:
        out = torch.zeros(RNDV // 4)
        pending = backend.recv([out], 1, 9)
        tag, length, ident, seen = take_rtr(peer)
        assert (tag, length, seen) == (9, RNDV, 0), (tag, length, seen)
        src = np.arange(RNDV // 4, dtype=np.float32)
        peer.data.send(peer.engine.register(src)).result(10)
        peer.send_header(9, RNDV, kind=RTR_DATA, ident=ident)
        pending.wait()
        assert torch.equal(out, torch.from_numpy(src)), "the RTR payload did not land"

        pending = backend.recv([torch.zeros(RNDV // 4)], 1, 9)
        tag, length, ident, seen = take_rtr(peer)
        assert seen == 1, seen  # the first message's RTR_DATA header counts as its header
        try:
            peer.data.send(peer.engine.register(np.zeros(3, np.uint8))).result(10)
        except sluice.SluiceError:
            pass  # rank 0 may fail the pair (closing the endpoint) before the send completed
        with pytest.raises(Exception) as e:
            pending.wait()
        msg = str(e.value)
        assert "peer rank 1" in msg and f"3-byte payload for our ready-to-receive of {RNDV} bytes" in msg, msg
        with pytest.raises(Exception):
            backend.send([torch.ones(4)], 1, 7).wait()
    finally:
        del backend
        peer.engine.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["unknown RTR", "RTR counting unsent messages"])
def test_a_forged_ready_to_receive_fails_the_peer(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    # An RTR_DATA header naming no RTR of ours, and an RTR that counts more of our messages
    # than we sent: protocol errors naming the peer; the pending recv fails at once.
    backend, peer = forged_pair(monkeypatch)
    try:
        pending = backend.recv([torch.empty(4)], 1, 6)
        if case == "unknown RTR":
            peer.send_header(5, RNDV, kind=RTR_DATA, ident=77)
            needle = "ready-to-receive 77 (tag 5, 262144 bytes), which names no recv of ours"
        else:
            peer.send_header(5, RNDV, kind=RTR, ident=3, region=5)
            needle = "a ready-to-receive counting 5 of our messages; we sent 0"
        with pytest.raises(Exception) as e:
            pending.wait()
        msg = str(e.value)
        assert "peer rank 1" in msg and needle in msg, msg
        assert "group timeout" not in msg, msg
    finally:
        del backend
        peer.engine.close()
