"""sluice.weights.staging: a sidecar (StagingServer, in this process) pulls a trainer process's
weights into a staging buffer shared with a consumer process (StagingClient: torch only), bin
by bin, double buffered; the consumer copies them into its own tensors. Bytes are checked
against what the trainer wrote. The CUDA test skips without a GPU."""

import os
import threading
import zlib

import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import WeightsChangedError, WeightSubscriber  # noqa: E402
from sluice.weights.staging import (ConsumerError, ConsumerLostError, StagingCapacityError,  # noqa: E402
                                    StagingClient, StagingServer, StagingServerLostError, receive_from_staging)

import weights_peer as wp  # noqa: E402
from test_weights_update import CTX, NAMES, SPEC, Trainer  # noqa: E402

CAP = 80 << 10  # two slots of 40 KiB: the 660 KiB model moves in ~20 bins (its largest tensor is 32 KiB)
WAIT = 30  # seconds any one wait of a test may take before it fails (never reached when things work)


def crc(t) -> int:
    return zlib.crc32(wp.as_bytes(t.detach().cpu().contiguous()).numpy().tobytes())


def want(name: str, version: int) -> int:
    """The crc32 of ``name``'s bytes at ``version`` (0: never written, zeros)."""
    d, s = {n: (d, s) for n, d, s in SPEC}[name]
    return crc(torch.zeros(s, dtype=d) if version == 0 else wp.expected(name, d, s, version))


def wrong_bytes(digests, version_of):
    return [n for n in NAMES if digests[n] != want(n, version_of(n))]


# ---------------------------------------------------------------- processes

def consumer(conn, address, device="cpu", timeout=20.0):
    """The inference side: its own tensors, one StagingClient kept across updates. Obeys
    ("receive", opts) and answers (outcome, crc32 per tensor, slots seen by run(), names run()
    got); opts: "run" (also pass run), "raise_on" (run raises on that name), "die_at_bin"
    (exit hard inside run at that bin), "wrong" (a tensor of the wrong dtype in params)."""
    torch.set_num_threads(1)
    targets = wp.empty_targets(SPEC, device)
    client = StagingClient(address, timeout=timeout)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        opts = cmd[1]
        slots, ran, bins = set(), [], [0]
        if opts.get("wrong"):
            n = opts["wrong"]
            targets[n] = torch.zeros(targets[n].shape, dtype=torch.float64, device=device)

        def run(pairs):
            bins[0] += 1
            for n, v in pairs:
                if v.numel():
                    slots.add((v.data_ptr() - client.buffer.data_ptr()) // client.slot_bytes)
                if n == opts.get("raise_on"):
                    raise ValueError(f"cannot load {n}")
            ran.extend(n for n, _ in pairs)
            if bins[0] == opts.get("die_at_bin"):
                os._exit(3)

        try:
            res = client.receive(targets, run if opts.get("run") else None, timeout=opts.get("timeout", timeout))
            out = ("ok", res.version, sorted(res.tensors), res.bins, res.nbytes)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = ("error", type(e).__name__, str(e))
        if opts.get("wrong"):  # back to a right one, never written
            n = opts["wrong"]
            d, s = {n_: (d, s) for n_, d, s in SPEC}[n]
            targets[n] = torch.zeros(s, dtype=d, device=device)
        conn.send((out, {n: crc(t) for n, t in targets.items()}, sorted(slots), ran))
    client.close()
    conn.send("stopped")


class Consumer:
    def __init__(self, address, device="cpu"):
        self.conn, child = CTX.Pipe()
        self.p = CTX.Process(target=consumer, args=(child, address, device), daemon=True)
        self.p.start()
        assert self.conn.poll(60), "consumer did not start"
        assert self.conn.recv() == "ready"

    def receive(self, **opts):
        self.conn.send(("receive", opts))

    def result(self):
        assert self.conn.poll(WAIT), "consumer did not answer"
        return self.conn.recv()

    def stop(self):
        if self.p.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.poll(10)
            except OSError:
                pass
            self.p.join(10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(10)


class _DieOnPull(WeightSubscriber):
    """Exits the process hard on its n-th update() call (a staging server that dies)."""

    die_at = None
    calls = 0

    def update(self, *a, **k):
        self.calls += 1
        if self.calls == self.die_at:
            os._exit(3)
        return super().update(*a, **k)


def staging_server(conn, trainer_ref, die_at_pull):
    """A staging server in its own process: sends its address, then runs ("update",) and
    exits hard on its ``die_at_pull``-th bin."""
    torch.set_num_threads(1)
    engine = sluice.Engine()
    sub = _DieOnPull(engine, trainer_ref, timeout=20)
    sub.die_at = die_at_pull
    server = StagingServer(sub, device="cpu", capacity=CAP, timeout=20)
    conn.send(server.address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "update":
            try:
                server.update()
                conn.send("done")
            except Exception as e:  # noqa: BLE001
                conn.send(f"{type(e).__name__}: {e}")
        else:
            break
    server.close()
    engine.close()


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def trainer():
    t = Trainer()
    yield t
    t.stop()


@pytest.fixture
def engine():
    e = sluice.Engine()
    yield e
    e.close()


def serve(engine, trainer, **kw):
    kw.setdefault("capacity", CAP)
    return StagingServer(engine=engine, trainer_ref=trainer.ref, device="cpu", timeout=20, **kw)


def update_with(server, consumer, **opts):
    """server.update() while the consumer receives; returns (result or exception, consumer's answer)."""
    consumer.receive(**opts)
    try:
        res = server.update()
    except Exception as e:  # noqa: BLE001 - the tests look at it
        res = e
    return res, consumer.result()


# ---------------------------------------------------------------- tests

def test_full_then_incremental_double_buffered_registered_once(trainer, engine):
    registered = []
    register = engine.register
    engine.register = lambda *a, **k: registered.append(1) or register(*a, **k)
    server = serve(engine, trainer)
    c = Consumer(server.address)
    try:
        assert (server.capacity, server.slots) == (CAP, 2)
        res, (out, digests, slots, ran) = update_with(server, c, run=True)
        assert out[0] == "ok", out
        assert not wrong_bytes(digests, trainer.versions.get)
        assert sorted(res.tensors) == NAMES and res.unchanged == [] and sorted(ran) == NAMES
        assert res.version == out[1] == max(trainer.versions.values())
        assert res.bins == out[3] > 4 and slots == [0, 1]  # bins alternate between both slots
        total = sum(wp.as_bytes(t).numel() for t in wp.empty_targets(SPEC).values())
        assert res.nbytes == out[4] == total
        once = len(registered)
        assert 0 < once <= len(NAMES)

        # incremental: only what the trainer changed moves
        base = max(trainer.versions.values())
        changed = ["embed", "l3.w", "l20.q", "l29.b"]
        trainer.publish(base + 1, changed)
        res, (out, digests, _, ran) = update_with(server, c)
        assert out[0] == "ok", out
        assert sorted(res.tensors) == sorted(changed) == out[2]
        assert len(res.unchanged) == len(NAMES) - len(changed) and ran == []
        assert not wrong_bytes(digests, trainer.versions.get)

        # nothing changed: an empty update; force: everything again, no new registration
        res, (out, _, _, _) = update_with(server, c)
        assert out[0] == "ok" and res.tensors == [] and res.bins == 0 == out[3]
        c.receive()
        res = server.update(force=True)
        out, digests, _, _ = c.result()
        assert out[0] == "ok" and sorted(res.tensors) == NAMES
        assert not wrong_bytes(digests, trainer.versions.get)
        assert len(registered) == once  # the layout is fixed: each view registered once

        # names=: only those
        trainer.publish(base + 2)
        c.receive()
        res = server.update(names=["l0.w", "scalar", "empty"])
        out, digests, _, _ = c.result()
        assert sorted(res.tensors) == ["empty", "l0.w", "scalar"]
        assert not wrong_bytes(digests, lambda n: base + 2 if n in ("l0.w", "scalar", "empty") else
                               (base + 1 if n in changed else base))
    finally:
        c.stop()
        server.close()


def test_tensor_larger_than_a_slot_and_default_sizing(trainer, engine):
    server = serve(engine, trainer, capacity=32 << 10)  # slots of 16 KiB; "embed" has 32,896 bytes
    try:
        with pytest.raises(StagingCapacityError, match=r"'embed'.*32896 bytes.*16384"):
            server.update(timeout=5)  # raised before waiting for any consumer
        assert not server.connected
    finally:
        server.close()
    # default: sized from the model (no GPU here): it fits one slot, waiting for a consumer is bounded
    server = StagingServer(engine=engine, trainer_ref=trainer.ref, device="cpu")
    try:
        with pytest.raises(sluice.SluiceTimeoutError, match="no consumer connected"):
            server.update(timeout=0.3)
        total = sum(-(-wp.as_bytes(t).numel() // 256) * 256 for t in wp.empty_targets(SPEC).values())
        assert server.slots == 1 and server.capacity == total
    finally:
        server.close()


def test_consumer_that_raises_or_mismatches(trainer, engine):
    server = serve(engine, trainer)
    c = Consumer(server.address)
    try:
        trainer.publish(max(trainer.versions.values()) + 1)
        res, (out, digests, _, ran) = update_with(server, c, run=True, raise_on="l10.w")
        assert isinstance(res, ConsumerError), res
        assert "ValueError: cannot load l10.w" in str(res) and "while run()" in str(res) and "'l10.w'" in str(res)
        assert "l10.w" in res.tensors and res.bin > 0 and "ValueError" in res.remote_traceback
        assert out[:2] == ("error", "ValueError")  # the consumer raises its own exception
        delivered = set(ran)  # the bins acked before the failing one
        assert delivered and "l10.w" not in delivered

        # the next update sends what was not delivered, and works
        res, (out, digests, _, _) = update_with(server, c)
        assert out[0] == "ok" and set(res.tensors) == set(NAMES) - delivered
        assert not wrong_bytes(digests, trainer.versions.get)

        # a parameter of the wrong dtype: named on both sides, nothing of its bin copied
        trainer.publish(max(trainer.versions.values()) + 1)
        res, (out, _, _, _) = update_with(server, c, wrong="l2.b")
        assert isinstance(res, ConsumerError) and "'l2.b'" in str(res) and "float64" in str(res), res
        assert out[:2] == ("error", "TensorMismatchError") and "l2.b" in out[2]
        res, (out, digests, _, _) = update_with(server, c)
        assert out[0] == "ok" and "l2.b" in res.tensors
        assert not wrong_bytes(digests, trainer.versions.get)
    finally:
        c.stop()
        server.close()


def test_consumer_that_dies(trainer, engine):
    server = serve(engine, trainer)
    c = Consumer(server.address)
    try:
        c.receive(run=True, die_at_bin=2)
        with pytest.raises(ConsumerLostError, match="went away"):
            server.update()
        c.p.join(WAIT)
        assert c.p.exitcode == 3
        assert not server.connected
        # a new consumer (restarted inference process) gets everything
        c = Consumer(server.address)
        res, (out, digests, _, _) = update_with(server, c)
        assert out[0] == "ok" and sorted(res.tensors) == NAMES
        assert not wrong_bytes(digests, trainer.versions.get)
    finally:
        c.stop()
        server.close()


def test_server_that_dies_and_client_waits_bounded(trainer):
    # nothing listens there
    with pytest.raises(StagingServerLostError, match="unreachable"):
        receive_from_staging("unix:@sluice-staging-nobody#" + "00" * 32, run=lambda pairs: None, timeout=2)
    conn, child = CTX.Pipe()
    p = CTX.Process(target=staging_server, args=(child, trainer.ref, 3), daemon=True)
    p.start()
    try:
        assert conn.poll(60)
        address = conn.recv()
        targets = wp.empty_targets(SPEC)
        with StagingClient(address, timeout=20) as client:
            # the server is idle (not in update()): a wait for it is bounded by the timeout
            with pytest.raises(sluice.SluiceTimeoutError, match="did not accept"):
                client.receive(targets, timeout=0.3)
            conn.send(("update",))
            with pytest.raises(StagingServerLostError, match="went away"):
                client.receive(targets)  # the server exits hard while pulling its third bin
        p.join(WAIT)
        assert p.exitcode == 3
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


def test_wrong_key_is_refused(trainer, engine):
    server = serve(engine, trainer)
    try:
        got = []
        th = threading.Thread(target=lambda: got.append(server.accept(timeout=WAIT)), daemon=True)
        th.start()
        bad = server.address.rsplit("#", 1)[0] + "#" + "ab" * 32
        with pytest.raises(StagingServerLostError, match="wrong key"):
            StagingClient(bad, timeout=WAIT).connect()
        with StagingClient(server.address, timeout=WAIT) as client:  # the server keeps waiting for a right one
            client.connect()
            th.join(WAIT)
            assert got == [None] and server.connected
            assert client.buffer.numel() == server.capacity
    finally:
        server.close()


def test_consumer_that_never_acks(trainer, engine):
    server = serve(engine, trainer)
    try:
        th = threading.Thread(target=server.accept, kwargs={"timeout": WAIT}, daemon=True)
        th.start()
        with StagingClient(server.address, timeout=WAIT) as client:
            client.connect()  # connected, then never calls receive()
            th.join(WAIT)
            with pytest.raises(ConsumerLostError, match="did not answer within the timeout"):
                server.update(timeout=0.5)
            assert not server.connected  # dropped: the client's next receive() fails, then connects again
            with pytest.raises(StagingServerLostError):
                client.receive(run=lambda pairs: None, timeout=5)
    finally:
        server.close()


class _Racing(WeightSubscriber):
    """Runs ``hook`` after its n-th update() call: the trainer publishes between bins."""

    hook_at, hook, calls = None, None, 0

    def update(self, *a, **k):
        res = super().update(*a, **k)
        self.calls += 1
        if self.calls == self.hook_at:
            self.hook()
        return res


def test_publish_racing_the_update(trainer, engine):
    sub = _Racing(engine, trainer.ref, timeout=20)
    server = StagingServer(sub, device="cpu", capacity=CAP, timeout=20)
    c = Consumer(server.address)
    try:
        old = max(trainer.versions.values())
        trainer.publish(old)  # every tensor at one version
        sub.hook_at, sub.hook = 2, lambda: trainer.publish(old + 1)  # after bin 2 is pulled
        res, (out, digests, _, ran) = update_with(server, c, run=True)
        assert isinstance(res, WeightsChangedError), res
        assert out[:2] == ("error", "StagingAbortedError") and "changed its tensors" in out[2]
        # bin 1 (delivered) holds the old version, the rest were never written: no new bytes
        assert ran and not wrong_bytes(digests, lambda n: old if n in ran else 0)
        # again: one consistent version everywhere
        res, (out, digests, _, _) = update_with(server, c)
        assert out[0] == "ok" and res.version == old + 1 and sorted(res.tensors) == NAMES
        assert not wrong_bytes(digests, lambda n: old + 1)
    finally:
        c.stop()
        server.close()
        sub.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
@pytest.mark.parametrize("capacity", [None, CAP])
def test_cuda_staging_into_a_consumer_on_the_same_gpu(trainer, capacity):
    with sluice.Engine() as e:
        server = StagingServer(engine=e, trainer_ref=trainer.ref, device="cuda:0", capacity=capacity, timeout=60)
        c = Consumer(server.address, device="cuda")
        try:
            res, (out, digests, slots, _) = update_with(server, c, run=True)
            assert out[0] == "ok", out
            assert server.buffer.device.type == "cuda" and sorted(res.tensors) == NAMES
            assert not wrong_bytes(digests, trainer.versions.get)
            if capacity is None:  # sized from free GPU memory and the model: one slot holds it
                free, _ = torch.cuda.mem_get_info(0)
                assert server.slots == 1 and server.capacity <= free and res.bins == 1
            else:
                assert slots == [0, 1] and res.bins > 4
            print(f"cuda staging, capacity {server.capacity}: {res.nbytes} B in {res.bins} bins, {res.seconds:.3f} s")
            base = max(trainer.versions.values())
            trainer.publish(base + 1, ["l4.w", "l9.q", "embed"])
            res, (out, digests, _, _) = update_with(server, c)
            assert out[0] == "ok" and sorted(res.tensors) == ["embed", "l4.w", "l9.q"]
            assert not wrong_bytes(digests, trainer.versions.get)
        finally:
            c.stop()
            server.close()


def test_a_connection_on_a_descriptor_above_1024():
    """The channel's liveness check must work on any descriptor: select() refuses those from
    1024 on, which a process with many sockets reaches (CI's pytest run did, and every second
    update of a server failed with "filedescriptor out of range in select()")."""
    import resource
    import socket

    from sluice.weights.staging._wire import _Channel

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fillers = []
    try:
        while not fillers or fillers[-1] < 1030:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        a, b = socket.socketpair()
        assert a.fileno() > 1024
        a.settimeout(5.0)  # as the channel's sockets have: the check must not wait for it
        ch = _Channel(a)
        assert not ch.closed_by_peer()
        b.sendall(b"x")
        assert not ch.closed_by_peer()  # pending data stays, the peer is alive
        assert a.recv(1) == b"x"
        b.close()
        assert ch.closed_by_peer()
        ch.close()
    finally:
        for fd in fillers:
            os.close(fd)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
