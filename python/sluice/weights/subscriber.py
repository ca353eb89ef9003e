"""Inference side: pull published tensors into the receiver's own tensors, in buckets."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .. import (ClosedError, Endpoint, Engine, InvalidArgumentError, PeerLostError, SluiceError,
                SluiceTimeoutError, UnknownHandleError)
from . import _meta, _relay
from ._handles import unregister_all
from ._plan import Bucket, Item, plan
from ._torch import describe, dtype_name, nbytes, torch
from .errors import TensorMismatchError, TrainerLostError, WeightsChangedError, WeightsError

log = logging.getLogger("sluice.weights")

BucketCallback = Callable[[List[Tuple[str, object]]], None]


@dataclass
class UpdateResult:
    """What one :meth:`WeightSubscriber.update` did."""

    version: int  # the trainer's published version the targets now hold
    updated: List[str] = field(default_factory=list)  # tensors pulled
    unchanged: List[str] = field(default_factory=list)  # tensors skipped: already at their version
    nbytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    from_source: int = 0  # bytes pulled from the relay given as ``source`` (the rest: from the trainer)
    source_fallback: str = ""  # why this update stopped pulling from ``source`` ("" if it did not)
    seq: int = 0  # the trainer's metadata seq the update read, unchanged until it ended
    instance: int = 0  # the trainer publisher's instance (a restarted trainer has a new one)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSubscriber:
    """Pulls a :class:`~sluice.weights.WeightPublisher`'s tensors into local tensors.

    ``trainer_ref``: what ``engine.connect`` takes: the trainer engine's "host:port", its
    info blob, or its name in the engine's directory (``Engine(directory=..., name=...)``),
    which also finds a restarted trainer at its new address. ``name``: the publisher's name;
    None picks the trainer's only publisher. ``bucket_bytes`` bounds one READ; ``depth``
    buckets are in flight at once (while the callback of an earlier one runs). ``timeout``
    (seconds) bounds a whole update, connecting included.

    Relays (docs/weights.md, "Relays"): ``relay=True`` serves what this subscriber's targets
    hold to other subscribers (its engine must listen; a thread holds the endpoints they open,
    unless ``relay_accept=False``). ``source``: the ref of such a relay to pull from instead of
    the trainer, bucket by bucket as the relay receives them; the trainer is still asked for
    the metadata and checked afterwards. When the relay cannot be reached, fails, or holds
    nothing new of what a bucket needs for ``relay_wait`` seconds, the update pulls the rest
    from the trainer (``UpdateResult.source_fallback`` says why).
    """

    def __init__(self, engine: Engine, trainer_ref: str, name: Optional[str] = None, *,
                 bucket_bytes: int = 64 << 20, depth: int = 2, timeout: float = 60.0,
                 relay: bool = False, source: Optional[str] = None, relay_wait: float = 5.0,
                 relay_accept: bool = True):
        if not isinstance(trainer_ref, str) or not trainer_ref:
            raise InvalidArgumentError(f"WeightSubscriber: trainer_ref must be a non-empty str, got {trainer_ref!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidArgumentError(f"WeightSubscriber: name must be a non-empty str or None, got {name!r}")
        for what, v in (("bucket_bytes", bucket_bytes), ("depth", depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"WeightSubscriber: {what} must be an int > 0, got {v!r}")
        if not isinstance(relay, bool) or not isinstance(relay_accept, bool):
            raise InvalidArgumentError(f"WeightSubscriber: relay and relay_accept must be bools, got {relay!r}, "
                                       f"{relay_accept!r}")
        if source is not None and (not isinstance(source, str) or not source):
            raise InvalidArgumentError(f"WeightSubscriber: source must be a non-empty str (a relay's ref) or None, "
                                       f"got {source!r}")
        if source is not None and source == trainer_ref:
            raise InvalidArgumentError("WeightSubscriber: source is the trainer itself; leave it None to pull "
                                       "from the trainer")
        if isinstance(relay_wait, bool) or not isinstance(relay_wait, (int, float)) or not 0 < relay_wait < 1e9:
            raise InvalidArgumentError(f"WeightSubscriber: relay_wait must be a number of seconds > 0, got {relay_wait!r}")
        self._check_timeout(timeout)
        self._engine = engine
        self._ref = trainer_ref
        self._name = name
        self.bucket_bytes = bucket_bytes
        self.depth = depth
        self.timeout = float(timeout)
        self._ep: Optional[Endpoint] = None
        self._regions: Dict[str, Tuple[int, int]] = {}  # trainer region name -> (id, length)
        self._instance: Optional[int] = None
        self._scratch = None  # (numpy buffer, handle) for metadata reads
        self._targets: Dict[str, Tuple[object, int]] = {}  # name -> (tensor, handle)
        self._have: Dict[str, Tuple[int, int, tuple]] = {}  # name -> (instance, version, _where(target))
        self._closed = False
        # Pulling from a relay (source=): its endpoint and region table, like the trainer's.
        self._source = source
        self.relay_wait = float(relay_wait)
        self._src_ep: Optional[Endpoint] = None
        self._src_regions: Dict[str, Tuple[int, int]] = {}
        # Serving as a relay (relay=True): the holdings region (_relay.py) and its accept thread.
        self.relay = relay
        self._relay_buf = None
        self._relay_handle = None
        self._relay_publisher: Optional[str] = None
        self._relay_region: Optional[str] = None  # its name: the trainer's publisher and instance
        self._relay_index: Dict[str, int] = {}  # tensor name -> its index in the holdings (last update's table)
        self._relay_stop = threading.Event()
        self._relay_thread: Optional[threading.Thread] = None
        if relay and relay_accept:
            from .publisher import _accept_loop
            self._relay_thread = threading.Thread(target=_accept_loop, args=(engine, self._relay_stop),
                                                  name="sluice-weights-relay-accept", daemon=True)
            self._relay_thread.start()

    @staticmethod
    def _check_timeout(timeout) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise InvalidArgumentError(f"WeightSubscriber: timeout must be a number of seconds > 0, got {timeout!r}")

    # ------------------------------------------------------------ public

    def update(self, targets: Mapping[str, object], on_bucket: Optional[BucketCallback] = None,
               names: Optional[Iterable[str]] = None, *, force: bool = False,
               timeout: Optional[float] = None) -> UpdateResult:
        """Pull into ``targets`` (name -> tensor of the published dtype and shape, contiguous,
        CPU or CUDA, whatever the trainer's tensor is on) every tensor whose published version differs from what this subscriber last
        pulled into that same tensor (``force``: all of them). ``names``: only these.

        ``on_bucket(pairs)`` gets the ``[(name, tensor), ...]`` a bucket completed (CUDA
        targets: the bytes are on the device, visible to any stream), while the
        next buckets are in flight (``model.load_weights(pairs)`` fits). Raises
        :class:`TensorMismatchError` before moving a byte if a target does not match,
        :class:`TrainerLostError` (naming the trainer) if it cannot be reached or dies, within
        ``timeout``; :class:`WeightsChangedError` if it changed the tensors meanwhile. After
        an error the update is not recorded: the next one pulls those tensors again."""
        t0, deadline, selected, snap = self._begin(targets, names, timeout)
        infos = {t.name: (t, snap.versions[i]) for i, t in enumerate(snap.tensors)}
        self._validate(selected, infos, targets)

        result = UpdateResult(version=snap.version, seq=snap.seq, instance=snap.instance)
        items: List[Item] = []
        for name in selected:
            tensor = targets[name]
            info, version = infos[name]
            if not force and self._have.get(name) == (snap.instance, version, _where(tensor)):
                result.unchanged.append(name)
                continue
            result.updated.append(name)
            if info.nbytes == 0:
                items.append(Item(name, 0, 0, 0, 0))
                continue
            rid, rlen = self._region(info.region, deadline)
            if info.offset + info.nbytes > rlen:
                raise WeightsError(f"trainer {self._ref!r}: tensor {name!r} ({info.nbytes} bytes at {info.offset}) "
                                   f"lies outside its region {info.region!r} of {rlen} bytes")
            items.append(Item(name, info.nbytes, self._local(name, tensor), rid, info.offset))
        buckets = plan(items, self.bucket_bytes)
        self._relay_begin(snap, result.updated, result.unchanged)
        try:
            try:
                result.from_source, result.source_fallback = self._pull(buckets, targets, on_bucket, deadline, snap)
            except UnknownHandleError as e:  # the trainer unregistered a region we were reading
                raise WeightsChangedError(f"trainer {self._ref!r} withdrew tensors during the update: {e}") from e
            self._check_unchanged(snap, deadline)
        except BaseException:
            self._relay_clear(snap, result.updated)  # what we hold now may be torn
            raise
        for name in result.updated:
            self._have[name] = (snap.instance, infos[name][1], _where(targets[name]))
        result.nbytes = sum(b.nbytes for b in buckets)
        result.buckets = len(buckets)
        result.seconds = time.monotonic() - t0
        return result

    @property
    def source(self) -> Optional[str]:
        """The relay this subscriber pulls from (None: the trainer). Settable between
        updates, e.g. when a relay tree is laid out again."""
        return self._source

    @source.setter
    def source(self, ref: Optional[str]) -> None:
        if ref is not None and (not isinstance(ref, str) or not ref or ref == self._ref):
            raise InvalidArgumentError(f"WeightSubscriber.source: a relay's ref (not the trainer's) or None, got {ref!r}")
        if ref != self._source:
            self._drop_source()
            self._source = ref

    def forget(self, names: Optional[Iterable[str]] = None) -> None:
        """Say that targets were changed outside :meth:`update` (zeroed, transformed in
        place): the next update pulls them again, as ``force=True`` would, and a relay
        (``relay=True``) stops serving them at once, until an update has written them again.
        ``names``: only these (default: every tensor this subscriber pulled)."""
        self._need_open()
        chosen = list(self._have) if names is None else list(names)
        for name in chosen:
            self._have.pop(name, None)
        if self.relay and self._relay_buf is not None:
            for name in chosen:
                i = self._relay_index.get(name)
                if i is not None:
                    _relay.clear(self._relay_buf, i)

    def published(self, timeout: Optional[float] = None) -> _meta.Snapshot:
        """The trainer's current metadata: ``.version``, ``.tensors`` (name, dtype, shape,
        nbytes, ...), ``.versions`` per tensor. Waits while the trainer is mid-update."""
        self._need_open()
        return self._fetch(time.monotonic() + (self.timeout if timeout is None else float(timeout)))

    def wait_for_version(self, version: int, timeout: Optional[float] = None, poll: float = 0.01) -> int:
        """Block until the trainer published ``version`` or later; returns the version seen.
        Raises :class:`~sluice.SluiceTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
        while True:
            snap = self._fetch(deadline)
            if snap.version >= version:
                return snap.version
            if time.monotonic() + poll > deadline:
                raise SluiceTimeoutError(f"trainer {self._ref!r} published version {snap.version}, "
                                         f"not {version}, within the timeout")
            time.sleep(poll)

    def close(self) -> None:
        """Unregister the targets, the scratch buffer and the relay region, close the
        endpoints. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._relay_stop.set()
        self._drop_endpoint()
        self._drop_source()
        handles = [h for _, h in self._targets.values() if h] + ([self._scratch[1]] if self._scratch else [])
        if self._relay_handle is not None:
            handles.append(self._relay_handle)
        self._targets.clear()
        self._scratch = None
        self._relay_buf = self._relay_handle = None
        unregister_all(self._engine, handles)

    def __enter__(self) -> "WeightSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        extra = (" relay" if self.relay else "") + (f" source={self._source!r}" if self._source else "")
        return f"<WeightSubscriber trainer={self._ref!r} name={self._name!r}{extra}>"

    # ------------------------------------------------------------ checks

    def _need_open(self) -> None:
        if self._closed:
            raise ClosedError("the WeightSubscriber is closed")

    def _begin(self, targets: Mapping[str, object], names: Optional[Iterable[str]], timeout: Optional[float]):
        """An update's start (update(), WeightSink.receive()): its clock, deadline, the names
        it takes, and one consistent read of the trainer's metadata."""
        self._need_open()
        if timeout is not None:
            self._check_timeout(timeout)
        t0 = time.monotonic()
        deadline = t0 + (self.timeout if timeout is None else float(timeout))
        selected = self._select(targets, names)
        return t0, deadline, selected, self._fetch(deadline)

    def _select(self, targets: Mapping[str, object], names: Optional[Iterable[str]]) -> List[str]:
        if not isinstance(targets, Mapping):
            raise InvalidArgumentError(f"update: targets must be a dict of name -> tensor, got {type(targets).__name__}")
        if names is None:
            return list(targets)
        if isinstance(names, str):
            raise InvalidArgumentError("update: names must be a list of names, not one str")
        selected = list(dict.fromkeys(names))
        missing = [n for n in selected if n not in targets]
        if missing:
            raise TensorMismatchError(f"update: names lists {_few(missing)} that targets does not hold")
        return selected

    def _validate(self, selected: Sequence[str], infos: Mapping[str, tuple], targets: Mapping[str, object]) -> None:
        t = torch()
        problems = []
        for name in selected:
            tensor = targets[name]
            if name not in infos:
                problems.append(f"{name!r}: the trainer {self._ref!r} publishes no tensor of that name")
                continue
            info = infos[name][0]
            if not isinstance(tensor, t.Tensor):
                problems.append(f"{name!r}: target is a {type(tensor).__name__}, not a torch.Tensor")
            elif dtype_name(tensor) != info.dtype or tuple(tensor.shape) != info.shape:
                problems.append(f"{name!r}: published {info.dtype}{list(info.shape)}, target is {describe(tensor)}")
            elif tensor.device.type not in ("cpu", "cuda"):
                problems.append(f"{name!r}: target is on {tensor.device}; targets are CPU or CUDA tensors")
            elif not tensor.is_contiguous():
                problems.append(f"{name!r}: target is not contiguous")
            elif nbytes(tensor) != info.nbytes:
                problems.append(f"{name!r}: published {info.nbytes} bytes, target has {nbytes(tensor)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise TensorMismatchError("update: target mismatch: " + "; ".join(problems[:5]) + more)

    # ------------------------------------------------------------ connection and metadata

    def _connect(self, deadline: float) -> Endpoint:
        ep = self._ep
        if ep is not None and ep.connected:
            return ep
        self._drop_endpoint()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrainerLostError(f"trainer {self._ref!r}: no time left to connect")
        try:
            # Reconnection is ours (this method, with the region table reloaded), not the
            # endpoint's: a restarted trainer must be met by _load_regions().
            ep = self._engine.connect(self._ref, timeout=left, reconnect=False)
        except ClosedError:
            raise
        except SluiceError as e:
            raise TrainerLostError(f"trainer {self._ref!r} is unreachable: {e}") from e
        self._ep = ep
        self._load_regions()
        return ep

    def _drop_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        self._regions = {}
        _close_quietly(ep)

    def _load_regions(self, refresh: bool = False) -> None:
        if refresh:
            self._ep.refresh_remote_regions()
        self._regions = _named_regions(self._ep)

    def _meta_region(self) -> Optional[Tuple[int, int]]:
        if self._name is not None:
            return self._regions.get(_meta.meta_region_name(self._name))
        found = sorted(n for r in self._regions if (n := _meta.parse_meta_region_name(r)) is not None)
        if len(found) > 1:
            raise InvalidArgumentError(f"trainer {self._ref!r} has several publishers ({', '.join(found)}): "
                                       "pass name= to WeightSubscriber")
        return self._regions[_meta.meta_region_name(found[0])] if found else None

    def _scratch_for(self, length: int):
        if self._scratch is None or len(self._scratch[0]) < length:
            if self._scratch is not None:
                self._engine.unregister(self._scratch[1])
                self._scratch = None
            self._scratch = tuple(self._engine.allocate(max(4096, length)))
        return self._scratch

    def _read(self, entries: list, deadline: float, what: str) -> None:
        ep = self._connect(deadline)
        try:
            fut = ep.read(entries)
        except (PeerLostError, ClosedError) as e:
            self._drop_endpoint()
            raise TrainerLostError(f"trainer {self._ref!r} lost while {what}: {e}") from e
        self._wait(fut, deadline, what)

    def _wait(self, fut, deadline: float, what: str) -> None:
        try:
            done = fut.wait(max(0.0, deadline - time.monotonic()))
        except UnknownHandleError:
            raise
        except SluiceError as e:
            self._drop_endpoint()
            raise TrainerLostError(f"trainer {self._ref!r} failed while {what}: {e}") from e
        if not done:
            self._drop_endpoint()  # cancels what is in flight
            try:
                fut.wait(5.0)
            except SluiceError:
                pass
            raise TrainerLostError(f"trainer {self._ref!r} did not answer within the timeout while {what}")

    def _fetch(self, deadline: float) -> _meta.Snapshot:
        """One consistent read of the metadata: retried while it races a publish or the
        trainer is mid-update, until ``deadline``."""
        pause, why = 0.001, "no metadata yet"
        while True:
            self._connect(deadline)
            meta = self._meta_region()
            if meta is None:
                self._load_regions(refresh=True)
                meta = self._meta_region()
            if meta is None:
                why = "it publishes no weights (no sluice.weights metadata region" + \
                      (f" named {self._name!r})" if self._name else ")")
            else:
                rid, length = meta
                buf, h = self._scratch_for(length)
                try:
                    self._read([(h, 0, rid, 0, length)], deadline, "reading the weight metadata")
                    snap = _meta.read(buf[:length].tobytes())
                    if snap.instance != self._instance:
                        if self._instance is not None:
                            log.info("sluice.weights: trainer %r restarted (new publisher instance)", self._ref)
                            self._load_regions(refresh=True)
                        self._instance = snap.instance
                    return snap
                except UnknownHandleError as e:  # the trainer replaced the region (it grew)
                    why = str(e)
                    self._load_regions(refresh=True)
                except _meta.TornRead as e:
                    why = str(e)
                    if "does not fit" in why:
                        self._load_regions(refresh=True)
                except _meta.BadMeta as e:
                    raise WeightsError(f"trainer {self._ref!r}: {e}") from None
            if time.monotonic() + pause > deadline:
                raise SluiceTimeoutError(f"trainer {self._ref!r}: no consistent weight metadata within the "
                                         f"timeout: {why}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _region(self, region: str, deadline: float) -> Tuple[int, int]:
        r = self._regions.get(region)
        if r is None:
            self._load_regions(refresh=True)
            r = self._regions.get(region)
        if r is None:
            raise WeightsError(f"trainer {self._ref!r} lists region {region!r} but does not expose it")
        return r

    def _check_unchanged(self, snap: _meta.Snapshot, deadline: float) -> None:
        rid, _ = self._meta_region() or (None, None)
        if rid is None:
            raise WeightsChangedError(f"trainer {self._ref!r} withdrew its weights during the update")
        buf, h = self._scratch_for(_meta.HEADER_SIZE)
        self._read([(h, 0, rid, 0, _meta.HEADER_SIZE)], deadline, "re-reading the weight metadata")
        raw = buf[:_meta.HEADER_SIZE].tobytes()
        seq, instance = _meta.header_seq(raw), _meta.HEADER.unpack_from(raw, 0)[9]
        if (seq, instance) != (snap.seq, snap.instance):
            raise WeightsChangedError(f"trainer {self._ref!r} changed its tensors during the update "
                                      f"(published version was {snap.version}); run update() again")

    # ------------------------------------------------------------ transfer

    def _local(self, name: str, tensor) -> int:
        """The handle of ``tensor`` in our engine, registered once and reused while the
        caller passes the same tensor for ``name``; a replaced one is unregistered."""
        held = self._targets.get(name)
        if held is not None:
            old, h = held
            if old is tensor or (_where(old) == _where(tensor) and nbytes(old) == nbytes(tensor)):
                return h
            del self._targets[name]
            self._engine.unregister(h)
        h = self._engine.register(tensor)
        self._targets[name] = (tensor, h)
        return h

    def _pull(self, buckets: List[Bucket], targets, on_bucket: Optional[BucketCallback], deadline: float,
              snap: _meta.Snapshot) -> Tuple[int, str]:
        """Moves the buckets, ``depth`` at a time, from the relay given as ``source`` while it
        serves them, else from the trainer. Returns (bytes from the relay, why it stopped
        using the relay or "")."""
        import numpy as np

        index = snap.index()
        inflight: collections.deque = collections.deque()  # (bucket, future, from the relay)
        nxt = 0
        from_source = 0
        use_source = self._source is not None
        fallback = ""

        def give_up_source(why: str) -> None:
            nonlocal use_source, fallback
            if use_source:
                log.warning("sluice.weights: relay %r: %s; pulling the rest from the trainer %r", self._source, why,
                            self._ref)
                use_source, fallback = False, why
                self._drop_source()  # cancels what is in flight from it (re-pulled from the trainer)

        def from_trainer(b: Bucket):
            ep = self._connect(deadline)
            try:
                return ep.read(np.asarray(b.entries, dtype=np.uint64))
            except (PeerLostError, ClosedError) as e:
                self._drop_endpoint()
                raise TrainerLostError(f"trainer {self._ref!r} lost during the update: {e}") from e

        def fill():
            nonlocal nxt
            while nxt < len(buckets) and len(inflight) < self.depth:
                b = buckets[nxt]
                fut, relayed = None, False
                if b.entries and use_source:
                    try:
                        # Waits for the relay only when nothing else is in flight; otherwise
                        # the completions are handled first and this bucket asked again.
                        entries = self._source_entries(b, snap, index, deadline, block=not inflight)
                        if entries is None:
                            return
                        fut, relayed = self._src_ep.read(np.asarray(entries, dtype=np.uint64)), True
                    except _SourceDown as e:
                        give_up_source(str(e))
                    except SluiceError as e:
                        give_up_source(f"reading from it failed: {e}")
                if b.entries and fut is None:
                    fut = from_trainer(b)
                nxt += 1
                inflight.append((b, fut, relayed))

        try:
            fill()
            while inflight:
                b, fut, relayed = inflight.popleft()
                what = f"pulling bucket {nxt - len(inflight)} of {len(buckets)}"
                if relayed:
                    if self._source_landed(fut, b, snap, index, deadline, what, give_up_source):
                        from_source += b.nbytes
                    else:  # failed, or the relay began writing these tensors meanwhile
                        self._wait(from_trainer(b), deadline, what)
                elif fut is not None:
                    self._wait(fut, deadline, what)
                self._relay_landed(snap, index, b)
                fill()  # the next buckets move while the callback runs
                if on_bucket is not None and b.done:
                    on_bucket([(n, targets[n]) for n in b.done])
        except BaseException:
            # Nothing may still write into the targets once we return: cancel and reap.
            if any(f is not None and not f.done() and not r for _, f, r in inflight):
                self._drop_endpoint()
            if any(f is not None and not f.done() and r for _, f, r in inflight):
                self._drop_source()
            for _, f, _ in inflight:
                if f is not None:
                    try:
                        f.wait(5.0)
                    except SluiceError:
                        pass
            raise
        return from_source, fallback

    # ------------------------------------------------------------ pulling from a relay

    def _source_connect(self, deadline: float) -> Endpoint:
        ep = self._src_ep
        if ep is not None and ep.connected:
            return ep
        self._drop_source()
        left = min(deadline - time.monotonic(), self.relay_wait)
        if left <= 0:
            raise _SourceDown("no time left to connect")
        try:
            ep = self._engine.connect(self._source, timeout=left, reconnect=False)
        except ClosedError:
            raise
        except SluiceError as e:
            raise _SourceDown(f"unreachable: {e}") from e
        self._src_ep = ep
        self._src_regions = _named_regions(ep)
        return ep

    def _drop_source(self) -> None:
        ep, self._src_ep = self._src_ep, None
        self._src_regions = {}
        _close_quietly(ep)

    def _source_holdings(self, snap: _meta.Snapshot, deadline: float) -> Optional[_relay.Holdings]:
        """One read of the relay's holdings region; None while it has none for this publisher
        (it has not begun an update yet). Raises _SourceDown if it cannot be read."""
        ep = self._source_connect(deadline)
        name = _relay.region_name(snap.publisher, snap.instance)
        for attempt in range(2):
            r = self._src_regions.get(name)
            if r is None or attempt:
                try:
                    ep.refresh_remote_regions()
                except SluiceError as e:
                    raise _SourceDown(f"its region table could not be read: {e}") from e
                self._src_regions = _named_regions(ep)
                r = self._src_regions.get(name)
                if r is None:
                    return None
            rid, length = r
            buf, h = self._scratch_for(length)
            try:
                fut = ep.read([(h, 0, rid, 0, length)])
                done = fut.wait(max(0.0, min(deadline - time.monotonic(), self.relay_wait)))
            except UnknownHandleError:
                continue  # the relay replaced its region (more tensors): look it up again
            except SluiceError as e:
                raise _SourceDown(f"reading its holdings failed: {e}") from e
            if not done:
                raise _SourceDown(f"it did not answer within {self.relay_wait:g} s")
            try:
                return _relay.read(buf[:length].tobytes())
            except _relay.BadRelay as e:
                raise _SourceDown(str(e)) from None
        return None

    def _relay_entries(self, b: Bucket, held: Optional[_relay.Holdings], snap: _meta.Snapshot,
                       index: Dict[str, int]) -> Optional[list]:
        """The bucket's READ entries against the relay's regions, or None unless the relay
        holds the published version of every tensor the bucket reads."""
        if held is None:
            return None
        out = []
        for (local, local_off, _, _, n), (name, off) in zip(b.entries, b.parts):
            i = index[name]
            region = held.holds(i, snap.instance, snap.versions[i], off + n)
            if region is None:
                return None
            out.append((local, local_off, region, off, n))
        return out

    def _source_entries(self, b: Bucket, snap: _meta.Snapshot, index: Dict[str, int], deadline: float,
                        block: bool) -> Optional[list]:
        """The bucket's entries against the relay once it holds them. ``block``: poll until
        it does (raising _SourceDown after relay_wait seconds in which it took nothing new);
        else one look (None: not yet)."""
        pause, last, still_since = 0.0002, None, time.monotonic()
        while True:
            held = self._source_holdings(snap, deadline)
            entries = self._relay_entries(b, held, snap, index)
            if entries is not None or not block:
                return entries
            now = time.monotonic()
            progress = None if held is None else (held.instance, held.landed())
            if progress != last:
                last, still_since = progress, now
            elif now - still_since > self.relay_wait:
                raise _SourceDown(f"it took nothing new for {self.relay_wait:g} s (relay_wait) while this update "
                                  f"waited for a bucket of {len(b.entries)} piece(s)")
            if now + pause > deadline:
                raise _SourceDown("the update's timeout came while waiting for it")
            time.sleep(pause)
            pause = min(pause * 2, 0.0005)  # a READ of 24 bytes a tensor: cheap next to a bucket

    def _source_landed(self, fut, b: Bucket, snap: _meta.Snapshot, index: Dict[str, int], deadline: float,
                       what: str, give_up) -> bool:
        """A bucket READ from the relay: True if it landed and the relay still holds the same
        tensors afterwards (so no write of its next update raced the read)."""
        try:
            done = fut.wait(max(0.0, deadline - time.monotonic()))
        except SluiceError as e:
            give_up(f"{what} failed: {e}")
            return False
        if not done:
            give_up(f"{what} did not finish within the update's timeout")
            try:
                fut.wait(5.0)
            except SluiceError:
                pass
            return False
        try:
            held = self._source_holdings(snap, deadline)
        except _SourceDown as e:
            give_up(str(e))
            return False
        if self._relay_entries(b, held, snap, index) is None:
            log.info("sluice.weights: relay %r began changing tensors while %s; those bytes come from the "
                     "trainer", self._source, what)
            return False
        return True

    # ------------------------------------------------------------ serving as a relay

    def _relay_begin(self, snap: _meta.Snapshot, names: Sequence[str], unchanged: Sequence[str]) -> None:
        """relay=True: before any target is written, the holdings say that ``names`` are not
        held (and, for another trainer instance or table, that nothing is but ``unchanged``,
        which our targets hold at their published versions already)."""
        if not self.relay:
            return
        n = len(snap.tensors)
        need = _relay.region_size(n)
        region = _relay.region_name(snap.publisher, snap.instance)
        fresh = self._relay_buf is None or len(self._relay_buf) < need or region != self._relay_region
        if fresh:
            if self._relay_handle is not None:
                self._engine.unregister(self._relay_handle)
                self._relay_buf = self._relay_handle = None
            buf, h = self._engine.allocate(max(4096, 2 * need), name=region)
            self._relay_region = region
            buf[:] = 0
            self._relay_buf, self._relay_handle = buf, h
        raw = self._relay_buf[:_relay.HEADER_SIZE].tobytes()
        _, _, _, instance, count = _relay.HEADER.unpack_from(raw, 0)
        if fresh or instance != snap.instance or count != n or self._relay_publisher != snap.publisher:
            self._relay_buf[_relay.HEADER_SIZE:] = 0
            _relay.write_header(self._relay_buf, snap.instance, n)
            self._relay_publisher = snap.publisher
        index = snap.index()
        self._relay_index = index
        for name in names:
            _relay.clear(self._relay_buf, index[name])
        for name in unchanged:  # held whole already
            i = index[name]
            _, h = self._targets.get(name, (None, 0))
            if h:  # 0-byte tensors have no region: nothing to read, nothing to serve
                _relay.set_held(self._relay_buf, i, snap.versions[i], int(h), snap.tensors[i].nbytes)

    def _relay_landed(self, snap: _meta.Snapshot, index: Dict[str, int], b: Bucket) -> None:
        """relay=True: bucket ``b`` landed in our targets: each tensor it wrote holds its bytes
        up to the end of its part (the parts of a tensor land in order)."""
        if not self.relay:
            return
        for (local, _, _, _, n), (name, off) in zip(b.entries, b.parts):
            i = index[name]
            _relay.set_held(self._relay_buf, i, snap.versions[i], int(local), off + n)

    def _relay_clear(self, snap: _meta.Snapshot, names: Sequence[str]) -> None:
        if not self.relay or self._relay_buf is None:
            return
        index = snap.index()
        for name in names:
            _relay.clear(self._relay_buf, index[name])


class _SourceDown(Exception):
    """The relay given as ``source`` cannot serve this update (the message says why)."""


def _named_regions(ep: Endpoint) -> Dict[str, Tuple[int, int]]:
    """A peer's named regions: name -> (id, length)."""
    return {r["name"]: (int(r["id"]), int(r["length"])) for r in ep.remote_regions() if r["name"]}


def _close_quietly(ep: Optional[Endpoint]) -> None:
    """Close an endpoint we are dropping; one already broken may refuse, which changes nothing."""
    if ep is not None:
        try:
            ep.close()
        except SluiceError:
            pass


def _where(tensor) -> tuple:
    """Where a target's bytes are: a CUDA and a host pointer may be the same number."""
    return (tensor.device.type, tensor.device.index, tensor.data_ptr())


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
