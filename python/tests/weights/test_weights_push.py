"""Push (WeightPublisher.push / WeightSink.receive): the trainer writes buckets into the sinks'
targets with write-with-immediate; bytes checked against what the trainer wrote; sinks and
trainers that die, stall or lie."""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import (PushResult, TensorMismatchError, TrainerLostError, WeightPublisher,  # noqa: E402
                            WeightSink, WeightSubscriber)
from sluice.weights import _sink  # noqa: E402

import weights_peer as wp  # noqa: E402
from test_weights_update import CTX, NAMES, SPEC, Trainer, check  # noqa: E402


def receive_in_threads(sinks, targets, **kw):
    """Start every sink's receive(); returns (threads, results, errors, seen-per-sink)."""
    out, errs, seen = [None] * len(sinks), [None] * len(sinks), [[] for _ in sinks]

    def run(k):
        try:
            out[k] = sinks[k].receive(targets[k], on_bucket=lambda pairs: seen[k].extend(n for n, _ in pairs), **kw)
        except BaseException as e:  # noqa: BLE001
            errs[k] = e

    ts = [threading.Thread(target=run, args=(k,)) for k in range(len(sinks))]
    for t in ts:
        t.start()
    return ts, out, errs, seen


def join(ts):
    for t in ts:
        t.join(60)
        assert not t.is_alive(), "receive() did not return"


@pytest.fixture(scope="module")
def trainer():
    t = Trainer()
    yield t
    t.stop()


def push(trainer, **kw):
    trainer.conn.send(("push", kw))
    assert trainer.conn.poll(60), "push did not return"
    return trainer.conn.recv()


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_push_to_two_sinks_bytes_callbacks_then_incremental(trainer, transport):
    version = max(trainer.versions.values()) + 1
    trainer.publish(version)
    engines = [sluice.Engine(transports=transport) for _ in range(2)]
    try:
        sinks = [WeightSink(e, trainer.ref, rank=k, bucket_bytes=24 << 10) for k, e in enumerate(engines)]
        targets = [wp.empty_targets(SPEC) for _ in sinks]
        ts, out, errs, seen = receive_in_threads(sinks, targets, timeout=30)
        got, reports = push(trainer, expect=2, timeout=30)
        join(ts)
        assert errs == [None, None]
        assert got == version and sorted(r[0] for r in reports) == [0, 1]
        assert all(r[3] == "" and r[1] == len(SPEC) for r in reports), reports
        for k in range(2):
            check(targets[k], SPEC, trainer.versions.get)
            assert sorted(seen[k]) == NAMES  # every tensor in exactly one callback
            assert out[k].version == version and sorted(out[k].updated) == NAMES and out[k].buckets > 10
        # Incremental: only the changed tensors are written, and only they reach the callbacks.
        trainer.publish(version + 1, ["l3.w", "embed"])
        ts, out, errs, seen = receive_in_threads(sinks, targets, timeout=30)
        _, reports = push(trainer, expect=2, timeout=30)
        join(ts)
        assert errs == [None, None] and all(r[1] == 2 and r[3] == "" for r in reports), (errs, reports)
        for k in range(2):
            assert sorted(out[k].updated) == ["embed", "l3.w"] and sorted(seen[k]) == ["embed", "l3.w"]
            check(targets[k], SPEC, trainer.versions.get)
        # force and names: everything named is written again.
        ts, out, errs, _ = receive_in_threads(sinks[:1], targets[:1], names=["l1.b", "ids"], force=True, timeout=30)
        _, reports = push(trainer, timeout=3)
        join(ts)
        assert errs == [None] and sorted(out[0].updated) == ["ids", "l1.b"]
        assert [(r[0], r[1]) for r in reports if not r[3]] == [(0, 2)]
        # the other sink is connected but not armed: it is waited for, then reported
        assert [r[0] for r in reports if "not armed" in r[3]] == [1]
    finally:
        for e in engines:
            e.close()


def test_ranks_subset_and_a_sink_that_never_arms(trainer):
    version = max(trainer.versions.values()) + 1
    trainer.publish(version)
    with sluice.Engine() as a, sluice.Engine() as b:
        sa, sb = WeightSink(a, trainer.ref, rank=7), WeightSink(b, trainer.ref, rank=8)
        ta, tb = wp.empty_targets(SPEC), wp.empty_targets(SPEC)
        ts, out, errs, _ = receive_in_threads([sa, sb], [ta, tb], timeout=30)
        _, reports = push(trainer, expect=2, ranks=[8], timeout=30)
        assert [(r[0], r[3]) for r in reports] == [(8, "")]
        ts[1].join(30)
        check(tb, SPEC, trainer.versions.get)
        assert ts[0].is_alive()  # sink 7 still waits: nothing was written to it
        assert not ta["embed"].any()
        _, reports = push(trainer, ranks=[7], timeout=30)
        join(ts)
        assert errs == [None, None] and [(r[0], r[3]) for r in reports] == [(7, "")]
        check(ta, SPEC, trainer.versions.get)


def test_a_sink_sharing_its_engine_with_a_subscriber(trainer):
    """Two endpoints from one engine to the trainer: the imms must go on the sink's (found by
    its hello), once, and the subscriber's endpoint keeps working."""
    with sluice.Engine() as e:
        sub = WeightSubscriber(e, trainer.ref)
        sub.published()  # this engine's first endpoint to the trainer is the subscriber's
        for _ in range(2):
            s = WeightSink(e, trainer.ref, rank=4)
            targets = wp.empty_targets(SPEC)
            ts, out, errs, seen = receive_in_threads([s], [targets], timeout=30)
            _, reports = push(trainer, expect=1, timeout=30)
            join(ts)
            assert errs == [None] and [(r[0], r[3]) for r in reports] == [(4, "")], (errs, reports)
            assert sorted(seen[0]) == NAMES
            check(targets, SPEC, trainer.versions.get)
            s.close()  # the next round's sink is a new one on the same engine (a new token)
        pulled = wp.empty_targets(SPEC)
        sub.update(pulled)
        check(pulled, SPEC, trainer.versions.get)


def test_sink_waiting_without_a_push_times_out_then_works(trainer):
    with sluice.Engine() as e:
        s = WeightSink(e, trainer.ref, rank=0)
        targets = wp.empty_targets(SPEC)
        t0 = time.monotonic()
        with pytest.raises(sluice.SluiceTimeoutError, match="pushed nothing"):
            s.receive(targets, timeout=1.5)
        assert time.monotonic() - t0 < 10
        ts, out, errs, _ = receive_in_threads([s], [targets], timeout=30)
        _, reports = push(trainer, expect=1, timeout=30)
        join(ts)
        assert errs == [None] and reports[0][3] == ""
        check(targets, SPEC, trainer.versions.get)


def test_mismatched_target_refused_before_arming(trainer):
    with sluice.Engine() as e:
        s = WeightSink(e, trainer.ref)
        targets = wp.empty_targets(SPEC)
        targets["embed"] = torch.zeros(3)
        with pytest.raises(TensorMismatchError, match="embed"):
            s.receive(targets, timeout=5)


def test_callback_error_raised_after_the_push_and_not_recorded(trainer):
    with sluice.Engine() as e:
        s = WeightSink(e, trainer.ref, bucket_bytes=16 << 10)
        targets = wp.empty_targets(SPEC)

        def boom(pairs):
            raise RuntimeError("load_weights failed")

        err = []
        t = threading.Thread(target=lambda: err.append(pytest.raises(RuntimeError, s.receive, targets,
                                                                      on_bucket=boom, timeout=30)))
        t.start()
        _, reports = push(trainer, expect=1, timeout=30)
        t.join(30)
        assert reports[0][3] == "" and "load_weights failed" in str(err[0].value)
        check(targets, SPEC, trainer.versions.get)  # the push itself completed
        ts, out, errs, _ = receive_in_threads([s], [targets], timeout=30)
        push(trainer, expect=1, timeout=30)
        join(ts)
        assert errs == [None] and sorted(out[0].updated) == NAMES  # not recorded: written again


def test_a_sink_that_dies_mid_push_fails_alone(trainer):
    version = max(trainer.versions.values()) + 1
    trainer.publish(version)
    kids = []
    for rank, die in ((0, None), (1, 3), (2, None)):
        conn, child = CTX.Pipe()
        p = CTX.Process(target=wp.sink, args=(child, trainer.ref, SPEC, version, 16 << 10, rank, die), daemon=True)
        p.start()
        kids.append((conn, p))
    try:
        for conn, _ in kids:
            assert conn.poll(60) and conn.recv() == "ready"
        got, reports = push(trainer, expect=3, timeout=30)
        by_rank = {r[0]: r for r in reports}
        assert sorted(by_rank) == [0, 1, 2]
        assert by_rank[0][3] == "" and by_rank[2][3] == ""
        assert by_rank[1][3], "the dead sink's failure must be reported with its rank"
        for conn, _ in (kids[0], kids[2]):
            assert conn.poll(60)
            got, updated, bad, seen = conn.recv()
            assert (got, updated, bad, seen) == (version, NAMES, [], NAMES)
        kids[1][1].join(30)
        assert kids[1][1].exitcode == 3
        # the trainer goes on: a sink armed after the death gets the next push
        trainer.publish(version + 1)
        with sluice.Engine() as e:
            s = WeightSink(e, trainer.ref, rank=5)
            targets = wp.empty_targets(SPEC)
            ts, out, errs, _ = receive_in_threads([s], [targets], timeout=30)
            _, reports = push(trainer, expect=1, ranks=[5], timeout=30)
            join(ts)
            assert errs == [None] and reports[0][3] == ""
            check(targets, SPEC, trainer.versions.get)
    finally:
        for _, p in kids:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_trainer_killed_mid_push(transport):
    spec = wp.big_spec(8)
    t = Trainer(spec)
    try:
        with sluice.Engine(transports=transport, op_timeout=10) as e:
            s = WeightSink(e, t.ref, bucket_bytes=64 << 10, timeout=30)
            targets = wp.empty_targets(spec)
            buckets = []

            def kill_after_first(pairs):
                buckets.append(pairs)
                if t.p.is_alive():
                    t.kill()

            err = []
            th = threading.Thread(target=lambda: err.append(
                pytest.raises(TrainerLostError, s.receive, targets, on_bucket=kill_after_first)))
            th.start()
            t.conn.send(("push", {"expect": 1, "timeout": 30}))
            th.join(40)
            assert not th.is_alive() and err, "receive() must fail, not hang"
            assert len(buckets) == 1  # it failed in the middle
    finally:
        t.stop()


def test_push_arguments_and_states():
    with sluice.Engine() as e:
        pub = WeightPublisher(e, "p")
        pub.register({"w": torch.ones(4)})
        with pytest.raises(sluice.InvalidArgumentError, match="publish"):
            pub.push(timeout=1)  # nothing published yet
        pub.publish(1)
        for bad in ({"timeout": 0}, {"expect": -1}, {"depth": 0}, {"ranks": ["a"]}, {"endpoints": [1]}):
            with pytest.raises(sluice.InvalidArgumentError):
                pub.push(**bad)
        res = pub.push(timeout=0.5)  # no sinks: nothing to do, nothing fails
        assert isinstance(res, PushResult) and res.sinks == [] and res.ok
        res = pub.push(timeout=0.5, expect=1)
        assert not res.ok and "expected" in res.failed[0].error
        pub.close()
        quiet = WeightPublisher(e, "q", accept=False)
        quiet.register({"w": torch.ones(4)})
        quiet.publish(1)
        with pytest.raises(sluice.InvalidArgumentError, match="endpoints"):
            quiet.push(timeout=1)
        quiet.close()
    with pytest.raises(sluice.InvalidArgumentError):
        WeightSink(sluice.Engine(), "127.0.0.1:1", rank=-1)
    with pytest.raises(sluice.InvalidArgumentError, match="bucket_bytes"):
        WeightSink(sluice.Engine(), "127.0.0.1:1", bucket_bytes=100)


def _fake_sink(engine, publisher, *, n, entries, instance, region_len=None, bucket_bytes=1 << 20):
    """A hostile sink: a hand-written table in a region named like a sink's."""
    size = region_len or _sink.region_size(n)
    buf, h = engine.allocate(max(size, 4096), name=_sink.region_name(publisher))
    _sink.write_table(buf, arm=1, instance=instance, bucket_bytes=bucket_bytes, rank=9, token=5, entries=entries)
    return buf, h


def test_hostile_sink_tables_are_refused_and_nothing_outside_is_written():
    with sluice.Engine(listen="127.0.0.1:0") as tr, sluice.Engine() as evil:
        pub = WeightPublisher(tr, "p")
        w = torch.arange(1024, dtype=torch.float32)
        pub.register({"w": w})
        pub.publish(1)
        ep = evil.connect(tr.listen_address)
        hello = np.frombuffer(_sink.encode_hello(5), np.uint8).copy()  # as a sink with token 5 says
        ep.send(evil.register(hello), 0, hello.nbytes).wait(5)
        meta = ep.remote_region("sluice.weights/p/meta")
        raw = np.zeros(64, np.uint8)
        rh = evil.register(raw)
        ep.read([(rh, 0, meta, 0, 64)]).wait(5)
        instance = int(np.frombuffer(raw[56:64].tobytes(), np.uint64)[0])
        small = np.zeros(16, np.uint8)  # a target region too small for the tensor
        sh = evil.register(small)
        trainer_region = int(pub._handles[0])  # a region of the trainer's own, not the sink's
        big = np.zeros(8192, np.uint8)
        bh = evil.register(big)
        cases = [
            ("index past the table", [_sink.Entry(5, int(sh), 4096, 0)], 1 << 20),
            ("wrong size", [_sink.Entry(0, int(sh), 16, 0)], 1 << 20),
            ("region too small", [_sink.Entry(0, int(sh), 4096, 0)], 1 << 20),
            ("a region the sink does not have", [_sink.Entry(0, trainer_region, 4096, 0)], 1 << 20),
            ("one tensor twice", [_sink.Entry(0, int(bh), 4096, 0), _sink.Entry(0, int(bh), 4096, 0)], 1 << 20),
            ("a bucket per byte", [_sink.Entry(0, int(bh), 4096, 0)], 1),
        ]
        for why, entries, bucket_bytes in cases:
            buf, h = _fake_sink(evil, "p", n=len(entries), entries=entries, instance=instance,
                                bucket_bytes=bucket_bytes)
            res = pub.push(timeout=5, endpoints=[_accepted(tr, pub)])
            assert [s.rank for s in res.failed] == [9], (why, res)
            ctl = _sink.read_control(buf, len(entries))
            assert ctl.status == _sink.BAD_TABLE and ctl.pushed == (), why
            evil.unregister(h)
        assert not small.any() and not big.any() and torch.equal(w, torch.arange(1024, dtype=torch.float32))
        # a torn or foreign table is never armed: the push reports it and writes nothing
        buf, h = evil.allocate(4096, name=_sink.region_name("p"))
        buf[:8] = np.frombuffer(b"SLWSINK1", np.uint8)
        res = pub.push(timeout=1, endpoints=[_accepted(tr, pub)])
        assert [s.rank for s in res.failed] == [None] and "not a sink region" in res.failed[0].error, res
        assert not buf[8:].any() and not small.any()  # the trainer wrote nothing into it
        ep.close()
        pub.close()


def _accepted(engine, pub):
    """The trainer's side of the evil engine's endpoint (held by the publisher's accept thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        live = [p for p in pub._peers if p.connected]
        if live:
            return live[-1]
        time.sleep(0.01)
    raise AssertionError("the publisher never accepted the endpoint")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_push_into_cuda_targets():
    spec = wp.model_spec(6)
    with sluice.Engine(listen="127.0.0.1:0") as tr, sluice.Engine() as rx:
        tensors = {n: torch.empty(s, dtype=d) for n, d, s in spec}
        for n, t in tensors.items():
            wp.fill(t, n, 3)
        pub = WeightPublisher(tr, "g")
        tensors = pub.share(tensors)
        pub.publish(3)
        s = WeightSink(rx, tr.listen_address, bucket_bytes=32 << 10)
        targets = wp.empty_targets(spec, device="cuda")
        ts, out, errs, seen = receive_in_threads([s], [targets], timeout=60)
        res = pub.push(expect=1, timeout=60)
        join(ts)
        assert res.ok and errs == [None], (res, errs)
        check({n: t.cpu() for n, t in targets.items()}, spec, lambda n: 3)
        pub.close()
