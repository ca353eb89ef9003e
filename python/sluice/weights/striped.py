"""Striped pulls: the inference processes of one host (one per GPU) share the host-to-device
work, as checkpoint-engine shares its H2D through NCCL broadcasts, without a collective.

Member k of N pulls stripe k from the trainer and serves it as a relay; it takes every other
stripe j from member j, bucket by bucket while j receives it (GPU to GPU over nvlink between
GPUs of a host). A member that cannot serve in time (``relay_wait``) is replaced by the trainer
for the rest of that stripe (``WeightSubscriber``'s fallback).

Stripes: with one trainer, tensor i of its published table belongs to stripe i % N; with one
trainer per member (a sharded trainer, ``len(trainer_refs) == N``), stripe k is trainer k's
tensors. See docs/weights.md, "Striping".

A plan can say instead who pulls each stripe (``sources``, e.g. from
:func:`~sluice.weights.placement.plan_pulls`, chosen by NIC and GPU affinity) and in which
order (``rounds``); the stripes are then as many as ``sources`` says, one per trainer (owner)
or, with one trainer, tensor i in stripe i % len(sources).
"""

from __future__ import annotations

import threading
import time
from typing import List, Mapping, Optional, Sequence, Union

from .. import Engine, InvalidArgumentError
from .subscriber import BucketCallback, UpdateResult, WeightSubscriber


class StripedSubscriber:
    """``members``: every member's engine address ("host:port", the same list, in the same
    order, at every member), ours at index ``rank``; our ``engine`` must listen there.
    ``trainer_refs``: one trainer's ref, or one per member (one per stripe with ``sources``).

    ``sources`` (default: stripe k from member k, ours from the trainer): per stripe, None to
    pull it from its trainer ourselves, or the index ``j`` in ``members`` of the member to take
    it from; e.g. ``plan.sources[rank]`` of :func:`~sluice.weights.placement.plan_pulls` (then
    ``members`` are the plan's receivers' addresses). ``serve``: the stripes other members take
    from us (we relay them; default: every stripe we pull from a trainer), e.g.
    ``plan.relays(rank)``. ``rounds`` (default: every stripe at once): the stripes in groups,
    each stripe in one; an update runs a group's stripes at once and the groups one after
    another, e.g. ``plan.rounds[rank]``. Stripes of one trainer that come from the same place
    share one :class:`WeightSubscriber` (one update for those of a round). The other keywords
    are :class:`WeightSubscriber`'s.

    The same trainer given for two stripes that we both serve raises ``InvalidArgumentError``
    before any byte moves (a relay's region is named by the trainer's publisher and instance)."""

    def __init__(self, engine: Engine, trainer_refs: Union[str, Sequence[str]], members: Sequence[str], rank: int,
                 name: Optional[str] = None, *, sources: Optional[Sequence[Optional[int]]] = None,
                 serve: Optional[Sequence[int]] = None, rounds: Optional[Sequence[Sequence[int]]] = None,
                 bucket_bytes: int = 64 << 20, depth: int = 2, timeout: float = 60.0, relay_wait: float = 5.0):
        members = list(members)
        if not members or not all(isinstance(m, str) and m for m in members):
            raise InvalidArgumentError(f"StripedSubscriber: members must be the members' addresses, got {members!r}")
        if len(set(members)) != len(members):
            raise InvalidArgumentError(f"StripedSubscriber: members must differ, got {members!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(members):
            raise InvalidArgumentError(f"StripedSubscriber: rank must be in [0, {len(members)}), got {rank!r}")
        refs = [trainer_refs] if isinstance(trainer_refs, str) else list(trainer_refs)
        if sources is None:
            if len(refs) not in (1, len(members)):
                raise InvalidArgumentError(f"StripedSubscriber: one trainer, or one per member ({len(members)}); "
                                           f"got {len(refs)}")
            # Stripe k from member k; ours from the trainer (every stripe, with one member).
            src: List[Optional[int]] = [None if k == rank or len(members) == 1 else k for k in range(len(members))]
        else:
            src = list(sources)
            if not src or not all(s is None or (_is_int(s) and 0 <= s < len(members) and s != rank) for s in src):
                raise InvalidArgumentError(f"StripedSubscriber: sources must be, per stripe, None or the index of "
                                           f"another member (in [0, {len(members)}), not {rank}); got {sources!r}")
            if len(refs) not in (1, len(src)):
                raise InvalidArgumentError(f"StripedSubscriber: one trainer, or one per stripe ({len(src)}); "
                                           f"got {len(refs)}")
        n = len(src)
        direct = [k for k in range(n) if src[k] is None]
        served = set(direct) if serve is None else set(serve) if not isinstance(serve, (str, bytes)) else None
        if served is None or not all(_is_int(k) and k in direct for k in served):
            raise InvalidArgumentError(f"StripedSubscriber: serve must list stripes we pull from a trainer "
                                       f"({direct}); got {serve!r}")
        if rounds is None:
            order = [list(range(n))]
        else:
            order = [list(r) for r in rounds]
            flat = [k for r in order for k in r]
            if not all(_is_int(k) for k in flat) or sorted(flat) != list(range(n)):
                raise InvalidArgumentError(f"StripedSubscriber: rounds must hold each stripe 0..{n - 1} once; "
                                           f"got {rounds!r}")
        self.rank, self.members = rank, members
        self.sources: List[Optional[int]] = src
        self.rounds: List[List[int]] = order
        self._sharded = len(refs) > 1
        kw = dict(bucket_bytes=bucket_bytes, depth=depth, timeout=timeout, relay_wait=relay_wait)
        # Stripe k's subscriber, one per (trainer, where from): those from a trainer relay when a
        # member takes one of their stripes from us; the others pull from their member. Only the
        # first relaying one accepts endpoints (one accept thread per engine is enough: it holds
        # whatever endpoint any member opens to us).
        keys = [(k if self._sharded else 0, src[k]) for k in range(n)]
        relaying = {keys[k] for k in served}
        made = {}
        accepting = False
        self._subs: List[WeightSubscriber] = []
        for k in range(n):
            if keys[k] not in made:
                relay = keys[k] in relaying
                made[keys[k]] = WeightSubscriber(engine, refs[keys[k][0]], name, relay=relay,
                                                 relay_accept=relay and not accepting,
                                                 source=None if src[k] is None else members[src[k]], **kw)
                accepting = accepting or relay
            self._subs.append(made[keys[k]])
        self._lock = threading.Lock()  # on_bucket: one call at a time

    @property
    def subscribers(self) -> List[WeightSubscriber]:
        """Stripe k's subscriber at index k (by default ours at ``rank``)."""
        return list(self._subs)

    def _stripes(self, targets: Mapping[str, object]) -> List[dict]:
        if self._sharded:
            own = [set(t.name for t in sub.published().tensors) for sub in self._subs]
            return [{n: targets[n] for n in names if n in targets} for names in own]
        table = self._subs[0].published().tensors
        n = len(self._subs)
        return [{t.name: targets[t.name] for i, t in enumerate(table) if i % n == k and t.name in targets}
                for k in range(n)]

    def update(self, targets: Mapping[str, object], on_bucket: Optional[BucketCallback] = None, *,
               force: bool = False, timeout: Optional[float] = None) -> UpdateResult:
        """Every stripe into ``targets``, one thread per stripe (all at once, or a round at a
        time with ``rounds``). ``on_bucket`` is called for each bucket of every stripe, one call
        at a time. Raises the first stripe's error once every stripe of its round has stopped
        (nothing writes the targets afterwards; later rounds do not start)."""
        t0 = time.monotonic()
        stripes = self._stripes(targets)
        extra = [n for n in targets if not any(n in s for s in stripes)]
        if extra:
            from .errors import TensorMismatchError
            raise TensorMismatchError(f"StripedSubscriber: no trainer publishes {extra[:5]}"
                                      f"{' ...' if len(extra) > 5 else ''}")
        relays = list({id(sub): sub for sub in self._subs if sub.relay}.values())
        if len(relays) > 1:
            snaps = [sub.published(timeout) for sub in relays]
            keys = [(s.publisher, s.instance) for s in snaps]
            twice = sorted({p for p, i in keys if keys.count((p, i)) > 1})
            if twice:
                raise InvalidArgumentError(f"StripedSubscriber: this member would serve the same publisher {twice} "
                                           f"twice (the same trainer given for two stripes?)")
        cb = None
        if on_bucket is not None:
            def cb(pairs):
                with self._lock:
                    on_bucket(pairs)
        results: List[UpdateResult] = []
        errors: List[BaseException] = []

        def pull(sub: WeightSubscriber, part: dict) -> None:
            try:
                results.append(sub.update(part, cb, force=force, timeout=timeout))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        for group in self.rounds:  # a round's stripes at once; a failed round ends the update
            parts = {}  # one update per subscriber: the round's stripes it serves
            for k in group:
                if stripes[k]:
                    parts.setdefault(id(self._subs[k]), (self._subs[k], k, {}))[2].update(stripes[k])
            threads = [threading.Thread(target=pull, args=(sub, part), name=f"sluice-weights-stripe{k}")
                       for sub, k, part in parts.values()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        done = results
        out = UpdateResult(version=min((r.version for r in done), default=0))
        for r in done:
            out.updated += r.updated
            out.unchanged += r.unchanged
            out.nbytes += r.nbytes
            out.buckets += r.buckets
            out.from_source += r.from_source
            if r.source_fallback:
                out.source_fallback = (out.source_fallback + "; " if out.source_fallback else "") + r.source_fallback
        out.seconds = time.monotonic() - t0
        return out

    def forget(self, names=None) -> None:
        """:meth:`WeightSubscriber.forget` on every stripe."""
        names = None if names is None else list(names)
        for sub in self._distinct():
            sub.forget(names)

    def close(self) -> None:
        for sub in self._distinct():
            sub.close()

    def _distinct(self) -> List[WeightSubscriber]:
        return list({id(sub): sub for sub in self._subs}.values())

    def __enter__(self) -> "StripedSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
