"""sluice.weights relays: receivers that pull from another receiver (source=) which serves what
it holds (relay=True), bucket by bucket, and fall back to the trainer when it cannot. Bytes are
checked against what the trainer wrote."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import WeightSubscriber, _relay  # noqa: E402
from sluice.weights._plan import Item, plan  # noqa: E402

import weights_peer as wp  # noqa: E402
from test_weights_update import CTX, NAMES, SPEC, Trainer, check  # noqa: E402

TOTAL = sum(wp.as_bytes(torch.empty(s, dtype=d)).numel() for _, d, s in SPEC)


class Relay:
    """A relay process (weights_peer.relay) commanded through a pipe."""

    def __init__(self, trainer_ref, source=None, transports=None, spec=SPEC):
        self.conn, child = CTX.Pipe()
        self.p = CTX.Process(target=wp.relay, args=(child, trainer_ref, spec, transports, source), daemon=True)
        self.p.start()
        assert self.conn.poll(60), "relay did not start"
        self.ref = self.conn.recv()

    def start_update(self, hold_at=None, die_at=None):
        self.conn.send(("update", hold_at, die_at))

    def result(self, timeout=60):
        assert self.conn.poll(timeout), "relay did not finish its update"
        return self.conn.recv()

    def update(self):
        self.start_update()
        (version, nbytes, from_source, fallback), bad = self.result()
        assert bad == [], f"relay holds wrong bytes in {bad[:5]}"
        return version, nbytes, from_source, fallback

    def wait_held(self):
        assert self.conn.poll(60) and self.conn.recv() == "held"

    def resume(self):
        self.conn.send("resume")

    def stop(self):
        if self.p.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.poll(10)
            except (OSError, EOFError):
                pass
            self.p.join(10)
            if self.p.is_alive():
                self.p.kill()


@pytest.fixture
def trainer():
    t = Trainer()
    yield t
    t.stop()


def child(engine, t, source, **kw):
    return WeightSubscriber(engine, t.ref, source=source, bucket_bytes=64 << 10, timeout=60, **kw)


def test_a_chain_moves_every_byte_through_the_relays(trainer):
    """trainer -> relay A -> relay B (source A, relaying too) -> child (source B): the child's
    and B's bytes all come from their sources, and are right."""
    a = Relay(trainer.ref)
    b = Relay(trainer.ref, source=a.ref)
    try:
        assert a.update()[2] == 0  # A pulls from the trainer
        _, nbytes, from_source, fallback = b.update()
        assert (nbytes, from_source, fallback) == (TOTAL, TOTAL, "")
        with sluice.Engine() as e:
            targets = wp.empty_targets(SPEC)
            sub = child(e, trainer, b.ref)
            res = sub.update(targets)
            check(targets, SPEC, trainer.versions.get)
            assert (res.nbytes, res.from_source, res.source_fallback) == (TOTAL, TOTAL, "")
            assert sorted(res.updated) == NAMES
            # incremental through the chain: only the changed tensors move, again from B
            trainer.publish(2, ["l3.w", "embed"])
            a.update()
            b.update()
            res = sub.update(targets)
            assert sorted(res.updated) == ["embed", "l3.w"]
            assert res.from_source == res.nbytes > 0
            check(targets, SPEC, trainer.versions.get)
            sub.close()
    finally:
        b.stop()
        a.stop()


def test_a_child_follows_its_relay_bucket_by_bucket(trainer):
    """The relay holds after its 3rd bucket; the child, started then, takes what the relay
    holds and waits for the rest (not past relay_wait: the relay resumes before)."""
    r = Relay(trainer.ref)
    try:
        r.update()
        trainer.publish(5)
        r.start_update(hold_at=3)
        r.wait_held()
        with sluice.Engine() as e:
            targets = wp.empty_targets(SPEC)
            sub = child(e, trainer, r.ref, relay_wait=20.0)
            timer = threading.Timer(0.5, r.resume)
            timer.start()
            t0 = time.monotonic()
            res = sub.update(targets)
            timer.join()
            assert time.monotonic() - t0 >= 0.4  # it waited for the relay's next buckets
            assert (res.from_source, res.source_fallback) == (TOTAL, "")
            check(targets, SPEC, trainer.versions.get)
            sub.close()
        assert r.result()[1] == []
    finally:
        r.stop()


def test_a_stalled_relay_costs_relay_wait_then_the_trainer_serves(trainer):
    r = Relay(trainer.ref)
    try:
        r.update()
        trainer.publish(6)
        r.start_update(hold_at=2)
        r.wait_held()  # and it stays held while the child runs
        with sluice.Engine() as e:
            targets = wp.empty_targets(SPEC)
            sub = child(e, trainer, r.ref, relay_wait=0.5)
            t0 = time.monotonic()
            res = sub.update(targets)
            took = time.monotonic() - t0
            check(targets, SPEC, trainer.versions.get)
            assert "relay_wait" in res.source_fallback
            assert 0 < res.from_source < TOTAL  # the first buckets came from the relay
            assert took < 10
            sub.close()
        r.resume()
        assert r.result()[1] == []
    finally:
        r.stop()


def test_a_tensor_is_relayed_while_it_arrives():
    """Tensors of 100 KiB in 64 KiB buckets: the relay stalls after its 2nd bucket, which ends
    tensor a and holds the first 28 KiB of b. The child takes both of its first buckets from
    the relay (the second reads those 28 KiB of b: what has landed of a tensor is served),
    then the rest from the trainer after relay_wait."""
    spec = [(n, torch.float32, (25600,)) for n in ("a", "b", "c")]
    t = Trainer(spec)
    r = Relay(t.ref, spec=spec)
    try:
        r.start_update(hold_at=1)  # its first callback: the bucket that completed a
        r.wait_held()
        with sluice.Engine() as e:
            targets = wp.empty_targets(spec)
            res = child(e, t, r.ref, relay_wait=0.5).update(targets)
            check(targets, spec, t.versions.get)
            assert res.from_source == 2 * (64 << 10), res
            assert "relay_wait" in res.source_fallback
        r.resume()
        assert r.result()[1] == []
    finally:
        r.stop()
        t.stop()


def test_a_relay_that_dies_mid_update_leaves_the_child_whole(trainer):
    r = Relay(trainer.ref)
    try:
        r.update()
        trainer.publish(7)
        r.start_update(hold_at=2)
        r.wait_held()
        with sluice.Engine(op_timeout=5) as e:
            targets = wp.empty_targets(SPEC)
            sub = child(e, trainer, r.ref, relay_wait=30.0)
            killer = threading.Timer(0.3, r.p.kill)
            killer.start()
            res = sub.update(targets)
            killer.join()
            check(targets, SPEC, trainer.versions.get)
            assert res.source_fallback and res.from_source < TOTAL
            # the next update goes straight to the trainer: the relay is gone
            trainer.publish(8, ["l1.b"])
            res = sub.update(targets)
            assert res.updated == ["l1.b"] and res.from_source == 0 and "unreachable" in res.source_fallback
            check(targets, SPEC, trainer.versions.get)
            sub.close()
    finally:
        r.stop()


def test_a_source_that_relays_nothing(trainer):
    """source= names an engine that serves no relay region: the update waits relay_wait for
    one to appear, then pulls from the trainer and says why."""
    with sluice.Engine(listen="127.0.0.1:0") as other, sluice.Engine() as e:
        targets = wp.empty_targets(SPEC)
        sub = child(e, trainer, other.listen_address, relay_wait=0.3)
        res = sub.update(targets)
        check(targets, SPEC, trainer.versions.get)
        assert res.from_source == 0 and "relay_wait" in res.source_fallback
        sub.close()


def test_forget_stops_a_relay_serving_targets_changed_behind_its_back(trainer):
    """A relay whose targets were overwritten outside update() (zeroed here) and told so with
    forget() serves none of them: a child falls back to the trainer (after relay_wait) and gets
    the right bytes, not the zeros. The relay's next update pulls everything again."""
    with sluice.Engine() as re, sluice.Engine() as ce:
        held = wp.empty_targets(SPEC)
        relay = WeightSubscriber(re, trainer.ref, relay=True, bucket_bytes=64 << 10, timeout=60)
        assert sorted(relay.update(held).updated) == NAMES
        for t in held.values():
            t.zero_()
        relay.forget()
        targets = wp.empty_targets(SPEC)
        sub = child(ce, trainer, re.listen_address, relay_wait=0.5)
        res = sub.update(targets)
        check(targets, SPEC, trainer.versions.get)
        assert res.from_source == 0 and res.source_fallback, res
        assert sorted(relay.update(held).updated) == NAMES  # no force=True needed
        check(held, SPEC, trainer.versions.get)
        # forget(names): only those are pulled again
        relay.forget(["embed"])
        assert relay.update(held).updated == ["embed"]
        sub.close()
        relay.close()


def test_arguments():
    with sluice.Engine() as e:
        for kw in ({"relay": 1}, {"source": ""}, {"source": 5}, {"relay_wait": 0}, {"relay_wait": True},
                   {"source": "t:1"}):
            with pytest.raises(sluice.InvalidArgumentError):
                WeightSubscriber(e, "t:1", **kw)


# ------------------------------------------------------------ the pieces, without processes

def test_holdings_region_round_trip():
    import numpy as np

    buf = np.zeros(_relay.region_size(4), dtype=np.uint8)
    _relay.write_header(buf, instance=77, n=4)
    _relay.set_held(buf, 1, version=0, region=9, landed=100)  # version 0 is a version, not "not held"
    _relay.set_held(buf, 3, version=12, region=10, landed=4096)
    h = _relay.read(buf.tobytes())
    assert h.instance == 77 and h.entries == [None, (0, 9, 100), None, (12, 10, 4096)]
    assert h.landed() == 4196
    assert h.holds(1, 77, 0, 100) == 9 and h.holds(3, 77, 12, 4096) == 10 and h.holds(3, 77, 12, 1) == 10
    assert h.holds(1, 77, 0, 101) is None  # past what landed
    assert h.holds(3, 77, 11, 1) is None and h.holds(3, 78, 12, 1) is None and h.holds(0, 77, 0, 0) is None
    assert h.holds(9, 77, 0, 0) is None
    _relay.set_held(buf, 1, version=0, region=9, landed=200)  # the next bucket of tensor 1 landed
    assert _relay.read(buf.tobytes()).holds(1, 77, 0, 200) == 9
    _relay.clear(buf, 3)
    assert _relay.read(buf.tobytes()).entries[3] is None
    with pytest.raises(_relay.BadRelay, match="magic"):
        _relay.read(b"X" * 64)
    # A region read between its allocation and its header's write (CI saw one): it holds nothing.
    fresh = _relay.read(bytes(_relay.region_size(4)))
    assert fresh.entries == [] and fresh.holds(1, 77, 0, 0) is None and fresh.landed() == 0
    with pytest.raises(_relay.BadRelay, match="too small"):
        _relay.read(b"SLRELAY1")
    with pytest.raises(_relay.BadRelay, match="entries"):
        _relay.read(buf[:_relay.HEADER_SIZE + 8].tobytes())


def test_tree_parents():
    assert [_relay.tree_parent(i, 2) for i in range(7)] == [None, 0, 0, 1, 1, 2, 2]
    assert [_relay.tree_parent(i, 1) for i in range(4)] == [None, 0, 1, 2]
    assert [_relay.tree_depth(n, 2) for n in (0, 1, 2, 3, 4, 7, 8)] == [0, 1, 2, 2, 3, 3, 4]
    for bad in ((-1, 2), (1, 0), (True, 2), (1.0, 2)):
        with pytest.raises(ValueError):
            _relay.tree_parent(*bad)


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_host_layout_crosses_each_host_boundary_once(fanout):
    import random
    rng = random.Random(fanout)
    for trial in range(200):
        n = rng.randint(0, 12)
        hosts = [rng.choice("abcde") for _ in range(n)]
        trainer_host = rng.choice([None, "a", "t"])
        parents = _relay.host_layout(hosts, fanout, trainer_host)
        assert len(parents) == n
        # every receiver reaches the trainer without a cycle, through at most one leader per host
        for i in range(n):
            seen, j = set(), i
            while parents[j] is not None:
                assert j not in seen
                seen.add(j)
                j = parents[j]
        # bytes enter each host once: one receiver per host (none on the trainer's) pulls from
        # another host or the trainer, everyone else from their own host
        entering = {}
        for i, p in enumerate(parents):
            src = trainer_host if p is None else hosts[p]
            if src != hosts[i]:
                entering[hosts[i]] = entering.get(hosts[i], 0) + 1
        assert entering == {h: 1 for h in set(hosts) if h != trainer_host}
        # nobody serves more than fanout children over its uplink, nor more than fanout of its own host
        for k in range(n):
            kids = [i for i, p in enumerate(parents) if p == k]
            assert sum(hosts[i] != hosts[k] for i in kids) <= fanout
            assert sum(hosts[i] == hosts[k] for i in kids) <= fanout
        # the trainer: at most fanout receivers of its own host, and the first leader
        direct = [i for i, p in enumerate(parents) if p is None]
        assert sum(hosts[i] == trainer_host for i in direct) <= fanout
        assert sum(hosts[i] != trainer_host for i in direct) <= 1


def test_host_layout_examples():
    assert _relay.host_layout(list("aaabbb")) == [None, 0, 0, 0, 3, 3]
    # leaders 0, 1, 4 chain across hosts; members pull from their own host
    assert _relay.host_layout(list("ababc"), fanout=1) == [None, 0, 0, 1, 1]
    # receivers on the trainer's host: a tree under the trainer; host a's leader reads the trainer
    assert _relay.host_layout(list("ttaat"), trainer_host="t") == [None, None, None, 2, 0]
    assert _relay.host_layout([]) == []
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            _relay.host_layout(list("ab"), bad)
    from sluice.weights import relay_layout
    assert relay_layout is _relay.host_layout


def test_plan_parts_name_each_entry():
    items = [Item("a", 100, 1, 7, 0), Item("z", 0, 0, 0, 0), Item("b", 250, 2, 7, 100)]
    buckets = plan(items, 128)
    for b in buckets:
        assert len(b.parts) == len(b.entries)
        for (local, local_off, remote, remote_off, n), (name, off) in zip(b.entries, b.parts):
            it = {i.name: i for i in items}[name]
            assert (local, local_off, remote, remote_off) == (it.local, off, it.remote, it.remote_offset + off)
    assert [p for b in buckets for p in b.parts] == [("a", 0), ("b", 0), ("b", 28), ("b", 156)]
