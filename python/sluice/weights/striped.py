"""Striped pulls: the inference processes of one host (one per GPU) share the host-to-device
work, as checkpoint-engine shares its H2D through NCCL broadcasts, without a collective.

Member k of N pulls stripe k from the trainer and serves it as a relay; it takes every other
stripe j from member j, bucket by bucket while j receives it (GPU to GPU over nvlink between
GPUs of a host). A member that cannot serve in time (``relay_wait``) is replaced by the trainer
for the rest of that stripe (``WeightSubscriber``'s fallback).

Stripes: with one trainer, tensor i of its published table belongs to stripe i % N; with one
trainer per member (a sharded trainer, ``len(trainer_refs) == N``), stripe k is trainer k's
tensors. See docs/weights.md, "Striping".
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
    ``trainer_refs``: one trainer's ref, or one per member. The other keywords are
    :class:`WeightSubscriber`'s."""

    def __init__(self, engine: Engine, trainer_refs: Union[str, Sequence[str]], members: Sequence[str], rank: int,
                 name: Optional[str] = None, *, bucket_bytes: int = 64 << 20, depth: int = 2, timeout: float = 60.0,
                 relay_wait: float = 5.0):
        members = list(members)
        if not members or not all(isinstance(m, str) and m for m in members):
            raise InvalidArgumentError(f"StripedSubscriber: members must be the members' addresses, got {members!r}")
        if len(set(members)) != len(members):
            raise InvalidArgumentError(f"StripedSubscriber: members must differ, got {members!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(members):
            raise InvalidArgumentError(f"StripedSubscriber: rank must be in [0, {len(members)}), got {rank!r}")
        refs = [trainer_refs] if isinstance(trainer_refs, str) else list(trainer_refs)
        if len(refs) not in (1, len(members)):
            raise InvalidArgumentError(f"StripedSubscriber: one trainer, or one per member ({len(members)}); "
                                       f"got {len(refs)}")
        self.rank, self.members = rank, members
        self._sharded = len(refs) > 1
        n = len(members)
        kw = dict(bucket_bytes=bucket_bytes, depth=depth, timeout=timeout, relay_wait=relay_wait)
        # Stripe k's subscriber: ours pulls from the trainer and relays; the others pull from
        # member k. Only ours accepts endpoints (one accept thread per engine is enough).
        self._subs: List[WeightSubscriber] = [
            WeightSubscriber(engine, refs[k if self._sharded else 0], name, relay=k == rank,
                             source=None if k == rank or n == 1 else members[k], **kw)
            for k in range(n)]
        self._lock = threading.Lock()  # on_bucket: one call at a time

    @property
    def subscribers(self) -> List[WeightSubscriber]:
        """Stripe k's subscriber at index k (ours at ``rank``)."""
        return list(self._subs)

    def _stripes(self, targets: Mapping[str, object]) -> List[dict]:
        if self._sharded:
            own = [set(t.name for t in sub.published().tensors) for sub in self._subs]
            return [{n: targets[n] for n in names if n in targets} for names in own]
        table = self._subs[self.rank].published().tensors
        n = len(self._subs)
        return [{t.name: targets[t.name] for i, t in enumerate(table) if i % n == k and t.name in targets}
                for k in range(n)]

    def update(self, targets: Mapping[str, object], on_bucket: Optional[BucketCallback] = None, *,
               force: bool = False, timeout: Optional[float] = None) -> UpdateResult:
        """Every stripe into ``targets`` at once (one thread per stripe). ``on_bucket`` is
        called for each bucket of every stripe, one call at a time. Raises the first stripe's
        error once every stripe has stopped (nothing writes the targets afterwards)."""
        t0 = time.monotonic()
        stripes = self._stripes(targets)
        extra = [n for n in targets if not any(n in s for s in stripes)]
        if extra:
            from .errors import TensorMismatchError
            raise TensorMismatchError(f"StripedSubscriber: no trainer publishes {extra[:5]}"
                                      f"{' ...' if len(extra) > 5 else ''}")
        cb = None
        if on_bucket is not None:
            def cb(pairs):
                with self._lock:
                    on_bucket(pairs)
        results: List[Optional[UpdateResult]] = [None] * len(stripes)
        errors: List[BaseException] = []

        def pull(k: int) -> None:
            try:
                if stripes[k]:
                    results[k] = self._subs[k].update(stripes[k], cb, force=force, timeout=timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=pull, args=(k,), name=f"sluice-weights-stripe{k}")
                   for k in range(len(stripes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done = [r for r in results if r is not None]
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
        for sub in self._subs:
            sub.forget(names)

    def close(self) -> None:
        for sub in self._subs:
            sub.close()

    def __enter__(self) -> "StripedSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
