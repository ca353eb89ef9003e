"""StripedSubscriber: members of one host pull their stripe from the trainer (or their shard's
trainer) and the other stripes from each other, every byte checked against the trainer's."""

import threading

import pytest

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import StripedSubscriber, TensorMismatchError  # noqa: E402

import weights_peer as wp  # noqa: E402
from test_weights_update import NAMES, SPEC, Trainer, check  # noqa: E402

TOTAL = sum(wp.as_bytes(torch.empty(s, dtype=d)).numel() for _, d, s in SPEC)


def together(members, targets, per_member=None, **kw):
    """Every member's update at once; their results in member order (exceptions re-raised).
    ``per_member(k)``: keywords for member k's update on top of ``kw``."""
    out, errs = [None] * len(members), []

    def run(k):
        try:
            out[k] = members[k].update(targets[k], **kw, **(per_member(k) if per_member else {}))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(len(members))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errs:
        raise errs[0]
    return out


def two_members(engines, trainer_refs):
    """A StripedSubscriber per engine, the engines' addresses as the members."""
    addrs = [e.listen_address for e in engines]
    return [StripedSubscriber(e, trainer_refs, addrs, k, bucket_bytes=64 << 10, relay_wait=20.0)
            for k, e in enumerate(engines)]


@pytest.fixture(scope="module")
def trainer():
    t = Trainer()
    yield t
    t.stop()


def test_two_members_share_one_trainer(trainer):
    with sluice.Engine() as a, sluice.Engine() as b:
        members = two_members((a, b), trainer.ref)
        targets = [wp.empty_targets(SPEC), wp.empty_targets(SPEC)]
        res = together(members, targets, force=True)
        for k in range(2):
            check(targets[k], SPEC, trainer.versions.get)
            assert sorted(res[k].updated) == NAMES and res[k].nbytes == TOTAL
            assert 0 < res[k].from_source < TOTAL and res[k].source_fallback == "", res[k]
        for m in members:
            m.close()


def test_members_incremental_and_callbacks(trainer):
    with sluice.Engine() as a, sluice.Engine() as b:
        members = two_members((a, b), trainer.ref)
        targets = [wp.empty_targets(SPEC), wp.empty_targets(SPEC)]
        together(members, targets)
        v = max(trainer.versions.values()) + 1
        trainer.publish(v, ["l3.w", "embed", "l7.q"])
        seen = [[], []]
        res = together(members, targets, per_member=lambda k: {"on_bucket": lambda p: seen[k].extend(n for n, _ in p)})
        for k in range(2):
            check(targets[k], SPEC, trainer.versions.get)
            assert sorted(res[k].updated) == ["embed", "l3.w", "l7.q"], res[k]
            assert sorted(seen[k]) == ["embed", "l3.w", "l7.q"]
        for m in members:
            m.close()


def test_one_trainer_per_member():
    half = len(SPEC) // 2
    ta, tb = Trainer(spec=SPEC[:half]), Trainer(spec=SPEC[half:])
    try:
        with sluice.Engine() as a, sluice.Engine() as b:
            members = two_members((a, b), [ta.ref, tb.ref])
            targets = [wp.empty_targets(SPEC), wp.empty_targets(SPEC)]
            res = together(members, targets)
            for k in range(2):
                check(targets[k], SPEC, lambda n: 1)
                assert res[k].nbytes == TOTAL and 0 < res[k].from_source < TOTAL, res[k]
            with pytest.raises(TensorMismatchError):  # a name neither trainer publishes
                members[0].update({**targets[0], "nope": torch.zeros(3)})
            for m in members:
                m.close()
    finally:
        ta.stop()
        tb.stop()


def test_a_member_that_is_gone_is_replaced_by_the_trainer(trainer):
    with sluice.Engine() as a:
        b = sluice.Engine()
        addrs = [a.listen_address, b.listen_address]
        b.close()  # member 1 never serves
        m = StripedSubscriber(a, trainer.ref, addrs, 0, bucket_bytes=64 << 10, relay_wait=0.5)
        targets = wp.empty_targets(SPEC)
        res = m.update(targets, force=True)
        check(targets, SPEC, trainer.versions.get)
        assert res.nbytes == TOTAL and res.from_source == 0 and res.source_fallback, res
        m.close()


def test_arguments(trainer):
    with sluice.Engine() as a:
        me = a.listen_address
        for members, rank, refs in [([], 0, trainer.ref), ([me, me], 0, trainer.ref), ([me], 1, trainer.ref),
                                    ([me, "x:1"], 0, [trainer.ref] * 3)]:
            with pytest.raises(sluice.InvalidArgumentError):
                StripedSubscriber(a, refs, members, rank)
