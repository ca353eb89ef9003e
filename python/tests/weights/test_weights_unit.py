"""sluice.weights pieces that need no second process: bucket planning, the metadata
format, argument and mismatch errors (publisher and subscriber in one process)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import (TensorMismatchError, TrainerLostError, WeightPublisher,  # noqa: E402
                            WeightSubscriber)
from sluice.weights import _meta  # noqa: E402
from sluice.weights._meta import Snapshot, TensorInfo  # noqa: E402
from sluice.weights._plan import Item, plan  # noqa: E402


def test_plan_splits_large_tensors_and_bounds_buckets():
    items = [Item("a", 10, 1, 11, 0), Item("z", 0, 0, 0, 0), Item("b", 25, 2, 12, 100), Item("c", 3, 3, 13, 0)]
    buckets = plan(items, 16)
    assert [b.nbytes for b in buckets] == [16, 16, 6]
    assert all(b.nbytes <= 16 for b in buckets)
    assert [b.done for b in buckets] == [["a", "z"], [], ["b", "c"]]
    # every byte of b exactly once, at the right offsets
    pieces = [e for bk in buckets for e in bk.entries if e[0] == 2]
    assert pieces == [(2, 0, 12, 100, 6), (2, 6, 12, 106, 16), (2, 22, 12, 122, 3)]
    assert plan([], 16) == []
    assert [b.done for b in plan([Item("e", 0, 0, 0, 0)], 16)] == [["e"]]
    with pytest.raises(ValueError):
        plan(items, 0)


def _region(seq=2, versions=(1, 2)):
    infos = [_meta.TensorInfo(f"t{i}", "float32", (2,), 8, f"r{i}", 0) for i in range(len(versions))]
    table = _meta.encode_table("m", infos)
    buf = np.zeros(_meta.region_size(len(infos), len(table)) + 100, np.uint8)
    _meta.write(buf, seq=seq, version=7, instance=99, versions=list(versions), table=table)
    return buf


def test_meta_roundtrip_and_torn_reads():
    buf = _region()
    snap = _meta.read(buf.tobytes())
    assert (snap.seq, snap.version, snap.instance, snap.publisher, snap.versions) == (2, 7, 99, "m", [1, 2])
    assert snap.tensors[1] == _meta.TensorInfo("t1", "float32", (2,), 8, "r1", 0)
    torn = buf.copy()
    torn[_meta.HEADER_SIZE] ^= 1  # a version byte changed after the crc was computed
    with pytest.raises(_meta.TornRead, match="checksum"):
        _meta.read(torn.tobytes())
    with pytest.raises(_meta.TornRead, match="changing"):
        _meta.read(_region(seq=3).tobytes())
    with pytest.raises(_meta.TornRead, match="does not fit"):
        _meta.read(buf.tobytes()[:_meta.HEADER_SIZE + 4])
    with pytest.raises(_meta.BadMeta, match="magic"):
        _meta.read(bytes(len(buf)))
    # publish() path: versions rewritten, table kept
    _meta.write(buf, seq=4, version=8, instance=99, versions=[8, 2], table=None)
    snap = _meta.read(buf.tobytes())
    assert (snap.seq, snap.version, snap.versions, len(snap.tensors)) == (4, 8, [8, 2], 2)


@pytest.fixture
def pair():
    a, b = sluice.Engine(), sluice.Engine()
    yield a, b
    a.close()
    b.close()


def test_in_process_update_and_mismatch_errors(pair):
    a, b = pair
    src = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": torch.ones(5, dtype=torch.bfloat16)}
    pub = WeightPublisher(a, "m")
    pub.register(src)
    pub.register({"w": src["w"]})  # same tensor again: a no-op
    with pytest.raises(TensorMismatchError, match="'w'"):
        pub.register({"w": torch.zeros(3, 4)})
    with pytest.raises(TensorMismatchError, match="contiguous"):
        pub.register({"t": torch.zeros(4, 4).t()})
    sub = WeightSubscriber(b, a.listen_address, timeout=0.5)
    with pytest.raises(sluice.SluiceTimeoutError, match="not published|changing"):
        sub.update({"w": torch.zeros(3, 4)})  # registered but never published: waits, then says so
    pub.publish(1)
    sub.timeout = 10
    good = {"w": torch.zeros(3, 4), "h": torch.zeros(5, dtype=torch.bfloat16)}
    cases = [
        ({"w": torch.zeros(3, 4, dtype=torch.float64)}, r"'w'.*float32\[3, 4\].*float64\[3, 4\]"),
        ({"w": torch.zeros(4, 3)}, r"'w'.*float32\[3, 4\].*float32\[4, 3\]"),
        ({"w": torch.zeros(4, 3).t()}, r"'w'.*not contiguous"),
        ({"nope": torch.zeros(1)}, r"'nope'.*publishes no tensor"),
        ({"w": np.zeros((3, 4), np.float32)}, r"'w'.*not a torch.Tensor"),
    ]
    for targets, pattern in cases:
        with pytest.raises(TensorMismatchError, match=pattern):
            sub.update({**good, **targets} if "nope" in targets else targets)
    assert not good["w"].any()  # nothing moved on a mismatch
    with pytest.raises(TensorMismatchError, match="'x'.*targets does not hold"):
        sub.update(good, names=["w", "x"])
    res = sub.update(good)
    assert sorted(res.updated) == ["h", "w"] and torch.equal(good["w"], src["w"]) and torch.equal(good["h"], src["h"])
    assert sub.published().version == 1 and sub.wait_for_version(1) == 1
    with pytest.raises(sluice.SluiceTimeoutError):
        sub.wait_for_version(2, timeout=0.2)
    pub.close()
    with pytest.raises(sluice.SluiceTimeoutError, match="publishes no weights"):
        sub.update(good, timeout=0.3)
    sub.close()


def test_share_copies_into_one_block_and_refuses_what_it_cannot(pair):
    a, b = pair
    pub = WeightPublisher(a, "m")
    src = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3).t(),  # not contiguous: copied anyway
           "s": torch.tensor(7, dtype=torch.int64), "e": torch.zeros(0, 2, dtype=torch.float16),
           "b": torch.tensor([True, False, True]), "h": torch.ones(5, dtype=torch.bfloat16)}
    shared = pub.share(src)
    assert sorted(shared) == sorted(src)
    for n, x in shared.items():
        assert torch.equal(x, src[n]) and x.dtype == src[n].dtype and x.shape == src[n].shape
        assert x.data_ptr() != src[n].data_ptr() or x.numel() == 0
    ptrs = [shared[n].data_ptr() for n in ("w", "s", "b", "h")]
    assert all(p % 256 == 0 for p in ptrs) and len(set(ptrs)) == 4
    with pytest.raises(TensorMismatchError, match="'w'.*already published"):
        pub.share({"w": torch.zeros(3, 4)})
    with pytest.raises(TensorMismatchError, match="meta"):
        pub.register({"m": torch.empty(3, device="meta")})
    with pytest.raises(TensorMismatchError, match="meta"):
        pub.share({"m": torch.empty(3, device="meta")})
    with pytest.raises(sluice.InvalidArgumentError, match="given twice"):
        pub.share([("z", torch.zeros(1)), ("z", torch.zeros(1))])
    pub.register({"r": torch.full((2,), 3.0)})  # register and share mix in one table
    pub.publish(1)
    shared["w"].fill_(5.0)  # the trainer updates the shared copy in place
    pub.publish(2, names=["w"])
    sub = WeightSubscriber(b, a.listen_address, timeout=10)
    got = {"w": torch.zeros(3, 4), "s": torch.zeros((), dtype=torch.int64), "e": torch.zeros(0, 2, dtype=torch.float16),
           "b": torch.zeros(3, dtype=torch.bool), "h": torch.zeros(5, dtype=torch.bfloat16), "r": torch.zeros(2)}
    res = sub.update(got)
    assert sorted(res.updated) == sorted(got) and res.version == 2
    assert (got["w"] == 5.0).all() and got["s"].item() == 7 and got["b"].tolist() == [True, False, True]
    assert got["r"].tolist() == [3.0, 3.0] and torch.equal(got["h"], src["h"])
    sub.close()
    pub.close()
    assert (shared["w"] == 5.0).all()  # the block stays mapped while the caller holds the tensors


def test_two_publishers_need_a_name_and_bad_arguments(pair):
    a, b = pair
    p1, p2 = WeightPublisher(a, "one"), WeightPublisher(a, "two")
    p1.register({"x": torch.ones(2)})
    p2.register({"x": torch.full((2,), 2.0)})
    p1.publish(1)
    p2.publish(5)
    with pytest.raises(sluice.InvalidArgumentError, match="one, two"):
        WeightSubscriber(b, a.listen_address).update({"x": torch.zeros(2)})
    x = torch.zeros(2)
    assert WeightSubscriber(b, a.listen_address, "two").update({"x": x}).version == 5 and x.tolist() == [2.0, 2.0]
    with pytest.raises(sluice.InvalidArgumentError):
        WeightPublisher(a, "a/b")
    with pytest.raises(sluice.InvalidArgumentError):
        p1.publish(-1)
    with pytest.raises(sluice.InvalidArgumentError, match="older"):
        p2.publish(4)
    with pytest.raises(TensorMismatchError, match="'y'"):
        p1.publish(2, names=["y"])
    with pytest.raises(sluice.InvalidArgumentError):
        WeightSubscriber(b, a.listen_address, bucket_bytes=0)


def test_unreachable_trainer_is_named():
    with sluice.Engine() as e:
        sub = WeightSubscriber(e, "127.0.0.1:1", timeout=2)
        with pytest.raises(TrainerLostError, match="127.0.0.1:1"):
            sub.update({"x": torch.zeros(1)})


def test_register_more_tensors_later_grows_the_metadata(pair):
    a, b = pair
    pub = WeightPublisher(a, "m")
    first = {"w0": torch.full((4,), 1.0)}
    pub.register(first)
    pub.publish(1)
    sub = WeightSubscriber(b, a.listen_address, timeout=10)
    got = {"w0": torch.zeros(4)}
    assert sub.update(got).updated == ["w0"]
    more = {f"layer{i}.with_a_long_name.weight": torch.full((3,), float(i)) for i in range(300)}
    pub.register(more)  # the table outgrows the metadata region: it is replaced
    pub.publish(2, names=list(more))
    got.update({n: torch.zeros(3) for n in more})
    res = sub.update(got)
    assert sorted(res.updated) == sorted(more) and res.unchanged == ["w0"]
    assert all(torch.equal(got[n], more[n]) for n in more)
    sub.close()
    pub.close()


class _FakeFuture:
    def __init__(self, events, k):
        self.events, self.k = events, k

    def wait(self, timeout=None):
        self.events.append(f"done{self.k}")
        return True

    def done(self):
        return True


class _FakeEndpoint:
    def __init__(self, events):
        self.events, self.n = events, 0

    def read(self, batch):
        self.events.append(f"read{self.n}")
        self.n += 1
        return _FakeFuture(self.events, self.n - 1)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_callback_runs_while_next_buckets_are_in_flight(depth):
    """The pipeline's order, with the transfer faked: before bucket i's callback runs, the
    READs of buckets i+1 .. i+depth have been submitted (depth buckets move during it)."""
    with sluice.Engine() as e:
        sub = WeightSubscriber(e, "127.0.0.1:1", depth=depth)
        events = []
        ep = _FakeEndpoint(events)
        sub._connect = lambda deadline: ep
        buckets = plan([Item(f"t{i}", 10, 1, 2, 0) for i in range(5)], 10)
        snap = Snapshot(2, 1, 1, "p", [TensorInfo(f"t{i}", "uint8", (10,), 10, "r", 0) for i in range(5)], [1] * 5)
        sub._pull(buckets, {f"t{i}": i for i in range(5)}, lambda pairs: events.append(f"cb{pairs[0][1]}"),
                  deadline=float("inf"), snap=snap)
    for i in range(5):
        cb = events.index(f"cb{i}")
        assert events.index(f"done{i}") < cb
        for j in range(i + 1, min(i + depth + 1, 5)):
            assert events.index(f"read{j}") < cb, events
    assert events.count("read0") == 1 and len([x for x in events if x.startswith("read")]) == 5
