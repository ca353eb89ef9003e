"""sluice.weights between processes: a trainer process publishes a synthetic model, receivers
pull it; bytes are checked against what the trainer wrote."""

import multiprocessing as mp
import socket

import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import TrainerLostError, WeightsChangedError, WeightSubscriber  # noqa: E402

import weights_peer as wp  # noqa: E402

# forkserver: torch and sluice are imported once, in the server; every trainer and receiver
# is then a cheap fork of it (a spawned process would import torch again, seconds each).
CTX = mp.get_context("forkserver")
# torch and sluice first: Python 3.11's server does not get our sys.path, so weights_peer
# itself may not import there (the children then import only it, which is cheap).
CTX.set_forkserver_preload(["torch", "sluice.weights", "weights_peer"])
SPEC = wp.model_spec()
NAMES = sorted(n for n, _, _ in SPEC)


class Trainer:
    def __init__(self, spec=SPEC, listen=None, transports=None, mode="register"):
        self.conn, child = CTX.Pipe()
        self.p = CTX.Process(target=wp.trainer, args=(child, spec, listen, transports, "model", mode), daemon=True)
        self.p.start()
        assert self.conn.poll(60), "trainer did not start"
        self.ref = self.conn.recv()
        self.versions = {n: 1 for n, _, _ in spec}  # what the trainer's tensors hold

    def publish(self, version, names=None):
        assert self.call("publish", version, names) == "ok"
        self.versions.update({n: version for n in (names or self.versions)})

    def call(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(30), f"trainer did not answer {cmd}"
        return self.conn.recv()

    def kill(self):
        self.p.kill()
        self.p.join(10)

    def stop(self):
        if self.p.is_alive():
            try:
                self.call("stop")
            except (OSError, EOFError, AssertionError):
                pass
            self.p.join(10)
            if self.p.is_alive():
                self.kill()


@pytest.fixture(scope="module")
def trainer():
    """One trainer for the tests that leave it alive; each reads its versions from it."""
    t = Trainer()
    yield t
    t.stop()


def check(targets, spec, version_of):
    bad = [n for n, d, s in spec if not torch.equal(wp.as_bytes(targets[n]), wp.expected(n, d, s, version_of(n)))]
    assert not bad, f"wrong bytes in {bad[:5]}"


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_full_update_bytes_buckets_and_callbacks(trainer, transport):
    with sluice.Engine(transports=transport) as e:
        targets = wp.empty_targets(SPEC)
        calls = []
        sub = WeightSubscriber(e, trainer.ref, bucket_bytes=64 << 10)
        res = sub.update(targets, on_bucket=lambda pairs: calls.append([n for n, _ in pairs]))
        check(targets, SPEC, trainer.versions.get)
        assert sorted(res.updated) == NAMES and res.unchanged == []
        assert res.version == max(trainer.versions.values())
        assert sorted(n for c in calls for n in c) == NAMES  # each tensor once
        total = sum(wp.as_bytes(x).numel() for x in targets.values())
        assert res.nbytes == total and res.buckets == -(-total // (64 << 10)) > 1
        assert any("empty" in c for c in calls) and any("scalar" in c for c in calls)
        # the callback gets the target tensors themselves (load_weights-style)
        seen = {}
        sub.update(targets, on_bucket=lambda pairs: seen.update(pairs), force=True)
        assert all(seen[n] is targets[n] for n in NAMES)
        sub.close()


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_shared_block_trainer(transport):
    """A trainer that share()s its tensors: one memfd block, tensors at offsets in it, updated
    in place; a same-host receiver maps it (shm), a tcp one reads it as any region."""
    t = Trainer(mode="share")
    try:
        with sluice.Engine(transports=transport) as e:
            regions = {r["name"] for r in e.connect(t.ref).remote_regions() if r["name"]}
            assert len([r for r in regions if not r.endswith("/meta")]) == 1, regions  # one block
            targets = wp.empty_targets(SPEC)
            sub = WeightSubscriber(e, t.ref, bucket_bytes=256 << 10)
            assert sorted(sub.update(targets).updated) == NAMES
            check(targets, SPEC, t.versions.get)
            t.publish(2, ["l5.w", "embed"])  # the trainer writes the shared copies in place
            assert sorted(sub.update(targets).updated) == ["embed", "l5.w"]
            check(targets, SPEC, t.versions.get)
            sub.close()
    finally:
        t.stop()


def test_incremental_and_subset(trainer):
    with sluice.Engine() as e:
        targets = wp.empty_targets(SPEC)
        sub = WeightSubscriber(e, trainer.ref, bucket_bytes=1 << 20)
        assert len(sub.update(targets).updated) == len(SPEC)
        again = sub.update(targets)
        assert again.updated == [] and again.nbytes == 0 and len(again.unchanged) == len(SPEC)

        base = max(trainer.versions.values())
        changed = ["l3.w", "l7.q", "embed"]
        trainer.publish(base + 1, changed)
        res = sub.update(targets)
        assert sorted(res.updated) == sorted(changed) and res.version == base + 1
        check(targets, SPEC, trainer.versions.get)

        # a subset of names: only those move, the rest keep their bytes
        before = dict(trainer.versions)
        trainer.publish(base + 2)
        res = sub.update(targets, names=["l0.w", "l1.b"])
        assert sorted(res.updated) == ["l0.w", "l1.b"]
        check(targets, SPEC, lambda n: base + 2 if n in ("l0.w", "l1.b") else before[n])
        res = sub.update(targets)  # the rest catch up
        assert len(res.updated) == len(SPEC) - 2
        check(targets, SPEC, trainer.versions.get)

        # a new target tensor for a name is pulled whatever its version
        targets["l2.w"] = torch.zeros_like(targets["l2.w"])
        assert sub.update(targets).updated == ["l2.w"]
        check(targets, SPEC, trainer.versions.get)
        sub.close()


def test_two_receivers_at_once_and_one_that_dies(trainer):
    kids = []
    version = max(trainer.versions.values())
    trainer.publish(version)  # every tensor at one version, which the receivers check
    for die in (None, None, 2):
        conn, child = CTX.Pipe()
        p = CTX.Process(target=wp.receiver, args=(child, trainer.ref, SPEC, version, 32 << 10, die), daemon=True)
        p.start()
        kids.append((conn, p))
    try:
        for conn, _ in kids:
            assert conn.poll(60) and conn.recv() == "ready"
        for conn, _ in kids:
            conn.send("go")
        for conn, p in kids[:2]:
            assert conn.poll(60), "receiver did not finish"
            got, updated, bad, seen = conn.recv()
            assert (got, updated, bad, seen) == (version, NAMES, [], NAMES)
        kids[2][1].join(30)
        assert kids[2][1].exitcode == 3  # died inside its update
        # the trainer keeps serving: a new update after the death works
        trainer.publish(version + 1)
        with sluice.Engine() as e:
            targets = wp.empty_targets(SPEC)
            WeightSubscriber(e, trainer.ref).update(targets)
            check(targets, SPEC, trainer.versions.get)
    finally:
        for _, p in kids:
            p.join(10)
            if p.is_alive():
                p.kill()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_trainer_killed_mid_update_then_restarted(transport):
    spec = wp.big_spec(8)
    listen = f"127.0.0.1:{_free_port()}"
    t = Trainer(spec, listen=listen)
    try:
        with sluice.Engine(transports=transport, op_timeout=10) as e:
            targets = wp.empty_targets(spec)
            sub = WeightSubscriber(e, t.ref, bucket_bytes=64 << 10, depth=2, timeout=30)
            buckets = []

            def kill_after_first(pairs):
                buckets.append(pairs)
                if t.p.is_alive():
                    t.kill()

            with pytest.raises(TrainerLostError, match=listen.replace(".", r"\.")):
                sub.update(targets, on_bucket=kill_after_first)
            assert len(buckets) == 1  # it failed in the middle, not at the end

            t = Trainer(spec, listen=listen)  # restarted, same address, a new publisher instance
            t.publish(4)
            res = sub.update(targets)
            assert sorted(res.updated) == sorted(n for n, _, _ in spec) and res.version == 4
            check(targets, spec, t.versions.get)
            sub.close()
    finally:
        t.stop()


def test_trainer_changing_tensors_mid_update(trainer):
    with sluice.Engine() as e:
        targets = wp.empty_targets(SPEC)
        sub = WeightSubscriber(e, trainer.ref, bucket_bytes=16 << 10)
        begun = []

        def begin_once(pairs):
            if not begun:
                begun.append(trainer.call("begin"))

        with pytest.raises(WeightsChangedError, match="changed its tensors"):
            sub.update(targets, on_bucket=begin_once)
        with pytest.raises(sluice.SluiceTimeoutError, match="changing"):
            sub.update(targets, timeout=0.5)  # still mid-update: waits, then says why
        trainer.publish(max(trainer.versions.values()) + 1)
        res = sub.update(targets)
        assert len(res.updated) == len(SPEC)  # nothing was recorded by the failed update
        check(targets, SPEC, trainer.versions.get)
        sub.close()
