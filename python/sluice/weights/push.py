"""Push: the trainer writes buckets into its receivers' targets, and each bucket's completion
reaches the receiver as a write-with-immediate notification (no request, no acknowledgement,
no collective per bucket).

Receiver::

    sink = WeightSink(engine, trainer_ref, rank=3)     # connects to the trainer
    res = sink.receive(dict(model.named_parameters()), on_bucket=model.load_weights)

Trainer::

    pub.publish(step)
    report = pub.push(expect=n_receivers)              # every connected, armed sink

``receive()`` registers the targets, writes its table (region ``sluice.weights.sink/<publisher>``,
layout in ``_sink.py``) and "arms" it, then waits for the trainer's immediates: BEGIN (the
control block with the manifest has landed), one per bucket (its bytes have landed: its
tensors' callback runs), DONE. ``push()`` finds the sinks among the endpoints receivers opened
to it, READs each one's table, and writes only the tensors whose version the sink does not
hold. A sink that dies or stalls fails alone, with its rank in the report; nothing waits past
``timeout``. See docs/weights.md, "Push".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .. import (ClosedError, Endpoint, InvalidArgumentError, PeerLostError, SluiceError, SluiceTimeoutError,
                UnknownHandleError)
from . import _meta, _sink
from ._plan import Item, plan
from ._torch import nbytes
from .errors import TrainerLostError, WeightsChangedError, WeightsError
from .subscriber import BucketCallback, UpdateResult, WeightSubscriber, _close_quietly, _named_regions, _where

log = logging.getLogger("sluice.weights")

_IMM_WAIT = 1.0  # seconds per imm_recv wait: the deadline is checked between them


# ---------------------------------------------------------------- receiver


class WeightSink(WeightSubscriber):
    """A receiver the trainer pushes to (:meth:`WeightPublisher.push`).

    ``trainer_ref`` and ``name`` as for :class:`WeightSubscriber`; ``rank``: this sink's label
    in the trainer's report (an int ≥ 0, or None). ``bucket_bytes``: the bytes of one
    write-with-imm batch (the trainer plans the same buckets). ``timeout`` bounds one
    :meth:`receive`, the wait for the trainer's push included. A sink can also pull
    (:meth:`update`); what either way brought counts for both (incremental updates).
    """

    def __init__(self, engine, trainer_ref: str, name: Optional[str] = None, *, rank: Optional[int] = None,
                 bucket_bytes: int = 64 << 20, timeout: float = 60.0):
        super().__init__(engine, trainer_ref, name, bucket_bytes=bucket_bytes, timeout=timeout)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2 ** 63):
            raise InvalidArgumentError(f"WeightSink: rank must be an int >= 0 or None, got {rank!r}")
        if not _sink.MIN_BUCKET_BYTES <= bucket_bytes < 2 ** 63:
            raise InvalidArgumentError(f"WeightSink: bucket_bytes must be at least {_sink.MIN_BUCKET_BYTES} "
                                       f"(and below 2**63), got {bucket_bytes}")
        self.rank = rank
        self._sink_buf = None
        self._sink_handle = None
        self._sink_region: Optional[str] = None
        self._arm = 0
        self._token = secrets.randbits(63) | 1
        self._hello = None  # (buffer, handle): the hello sent on each new endpoint to the trainer
        self._hello_ep = None

    def receive(self, targets: Mapping[str, object], on_bucket: Optional[BucketCallback] = None,
                names: Optional[Iterable[str]] = None, *, force: bool = False,
                timeout: Optional[float] = None) -> UpdateResult:
        """Arm this sink and wait, until ``timeout``, for the trainer to push into ``targets``
        (name -> tensor, as :meth:`WeightSubscriber.update` takes them) every tensor whose
        version this sink does not hold (``force``: all; ``names``: only these).
        ``on_bucket(pairs)`` runs for each bucket once its bytes have landed, while the trainer
        writes the next ones. Raises :class:`SluiceTimeoutError` if no push began in time,
        :class:`TrainerLostError` if the trainer died or stalled mid-push,
        :class:`WeightsChangedError` if its table changed since this sink armed; after an
        error nothing more is written into the targets (the endpoint is closed; the next
        receive reconnects). An exception from ``on_bucket`` is raised after the push ended."""
        t0, deadline, selected, snap = self._begin(targets, names, timeout)
        infos = {t.name: (i, t) for i, t in enumerate(snap.tensors)}
        self._validate(selected, {n: (t, snap.versions[i]) for n, (i, t) in infos.items()}, targets)
        entries: List[_sink.Entry] = []
        for name in selected:
            i, info = infos[name]
            tensor = targets[name]
            handle = int(self._local(name, tensor)) if info.nbytes else 0
            have = self._have.get(name)
            held = 0
            if not force and have is not None and have[0] == snap.instance and have[2] == _where(tensor):
                held = have[1] + 1
            entries.append(_sink.Entry(i, handle, info.nbytes, held))
        self._arm += 1
        self._write_table(snap, entries)
        try:
            result = self._await_push(selected, entries, targets, on_bucket, snap, deadline)
        except BaseException:
            self._disarm(len(entries))  # a later push must not take this table for a live one
            self._drop_endpoint()  # the trainer's writes into our targets stop here
            raise
        result.seconds = time.monotonic() - t0
        return result

    def close(self) -> None:
        super().close()
        handles = [self._sink_handle] + ([self._hello[1]] if self._hello is not None else [])
        self._sink_handle = self._sink_buf = self._hello = self._hello_ep = None
        for h in handles:
            if h is not None:
                try:
                    self._engine.unregister(h)
                except SluiceError:
                    pass

    # ------------------------------------------------------------ internals

    def _connect(self, deadline: float) -> Endpoint:
        ep = super()._connect(deadline)
        if ep is not self._hello_ep:
            # Our first message on a new endpoint: the trainer tells it apart from our engine's
            # other endpoints to it (an earlier one of ours among them, maybe not yet seen
            # closed there) by this token, new per endpoint: its immediates must come on this one.
            self._token = secrets.randbits(63) | 1
            if self._hello is None:
                self._hello = self._engine.allocate(_sink.HELLO.size)
            self._hello[0][:_sink.HELLO.size] = memoryview(_sink.encode_hello(self._token))
            try:
                ep.send(self._hello[1], 0, _sink.HELLO.size)
            except SluiceError as e:
                self._drop_endpoint()
                raise TrainerLostError(f"trainer {self._ref!r} lost while this sink said hello: {e}") from e
            self._hello_ep = ep
        return ep

    def _publisher_name(self) -> str:
        if self._name is not None:
            return self._name
        found = sorted(n for r in self._regions if (n := _meta.parse_meta_region_name(r)) is not None)
        if len(found) != 1:
            raise InvalidArgumentError(f"trainer {self._ref!r} has publishers {found}: pass name= to WeightSink")
        return found[0]

    def _write_table(self, snap: _meta.Snapshot, entries: Sequence[_sink.Entry]) -> None:
        region = _sink.region_name(self._publisher_name())
        need = _sink.region_size(len(entries))
        if self._sink_buf is None or len(self._sink_buf) < need or self._sink_region != region:
            if self._sink_handle is not None:
                self._engine.unregister(self._sink_handle)
                self._sink_handle = self._sink_buf = None
            self._sink_buf, self._sink_handle = self._engine.allocate(max(4096, need), name=region)
            self._sink_region = region
        # The control block keeps the trainer's last answer (an older arm): the trainer sees
        # the new arm differ from it, and this sink refuses a control block of another arm.
        _sink.write_table(self._sink_buf, arm=self._arm, instance=snap.instance, bucket_bytes=self.bucket_bytes,
                          rank=-1 if self.rank is None else self.rank, token=self._token, entries=entries)

    def _next_imm(self, deadline: float, begun: bool) -> Tuple[int, int]:
        """The next immediate on our endpoint to the trainer: (arm bits, code)."""
        ep = self._ep
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if begun:
                    raise TrainerLostError(f"trainer {self._ref!r} did not finish its push within the timeout")
                raise SluiceTimeoutError(f"trainer {self._ref!r} pushed nothing within the timeout "
                                         "(is it calling push()?)")
            if ep is None or not ep.connected:
                raise TrainerLostError(f"trainer {self._ref!r} is gone (endpoint closed while waiting for its push)")
            # An imm_recv still posted from an earlier wait on this endpoint is the next one.
            if self._pending_imm is not None and self._pending_imm[0] is ep:
                fut = self._pending_imm[1]
            else:
                fut = ep.imm_recv()
            self._pending_imm = (ep, fut)
            try:
                done = fut.wait(min(left, _IMM_WAIT))
            except SluiceTimeoutError:  # the endpoint's recv_timeout: wait again
                self._pending_imm = None
                continue
            except (PeerLostError, ClosedError) as e:
                self._pending_imm = None
                raise TrainerLostError(f"trainer {self._ref!r} lost while {'pushing' if begun else 'waited for'}: "
                                       f"{e}") from e
            except SluiceError as e:
                self._pending_imm = None
                raise TrainerLostError(f"trainer {self._ref!r}: waiting for its push failed: {e}") from e
            if not done:
                continue
            self._pending_imm = None
            return _sink.split_imm(int(fut.imm))

    _pending_imm = None  # (endpoint, imm_recv future) posted and not completed: the next wait reuses it

    def _await_push(self, selected: Sequence[str], entries: Sequence[_sink.Entry], targets,
                    on_bucket: Optional[BucketCallback], snap: _meta.Snapshot, deadline: float) -> UpdateResult:
        arm_bits = self._arm & 0xFF
        buckets = None
        landed: set = set()
        fired = 0
        done = False
        ctl = None
        error: Optional[BaseException] = None
        while not done or (buckets is not None and fired < len(buckets)):
            bits, code = self._next_imm(deadline, begun=buckets is not None)
            if bits != arm_bits:
                log.debug("sluice.weights: sink ignores an imm of an earlier push (%d, %d)", bits, code)
                continue
            if code == _sink.IMM_BEGIN or code == _sink.IMM_DONE:
                ctl = self._control(len(entries))
                if ctl.status != _sink.OK:
                    why = _sink.STATUS_TEXT.get(ctl.status, f"status {ctl.status}")
                    if ctl.status == _sink.STALE:
                        raise WeightsChangedError(f"trainer {self._ref!r}: {why}")
                    raise WeightsError(f"trainer {self._ref!r}: {why}")
                if buckets is None:
                    items = [Item(selected[e], entries[e].nbytes, entries[e].region, 0, 0) for e, _ in ctl.pushed]
                    buckets = plan(items, self.bucket_bytes)
                if code == _sink.IMM_DONE:
                    done = True
            elif buckets is None:
                raise WeightsError(f"trainer {self._ref!r} announced bucket {code} before its manifest")
            elif code >= len(buckets):
                raise WeightsError(f"trainer {self._ref!r} announced bucket {code} of {len(buckets)}")
            else:
                landed.add(code)
            # Callbacks in bucket order: a tensor is complete once its last bucket and every
            # earlier one have landed (imms may be delivered out of order between lanes).
            while buckets is not None and fired < len(buckets) and (fired in landed or not buckets[fired].entries):
                if on_bucket is not None and buckets[fired].done and error is None:
                    try:
                        on_bucket([(n, targets[n]) for n in buckets[fired].done])
                    except BaseException as e:  # noqa: BLE001 - raised once the push has ended
                        error = e
                fired += 1
        pushed = {selected[e]: v for e, v in ctl.pushed}
        if error is not None:
            raise error
        for name, version in pushed.items():
            self._have[name] = (snap.instance, version, _where(targets[name]))
        result = UpdateResult(version=ctl.version, seq=ctl.seq, instance=ctl.instance)
        result.updated = [n for n in selected if n in pushed]
        result.unchanged = [n for n in selected if n not in pushed]
        result.nbytes = sum(b.nbytes for b in buckets)
        result.buckets = len(buckets)
        return result

    def _disarm(self, n: int) -> None:
        """Mark our arm as answered in our own control block: the trainer then sees this sink
        as not armed (its table still names an endpoint we are closing)."""
        ctl = _sink.encode_control(status=_sink.ABORTED, arm=self._arm, seq=0, version=0, instance=0, pushed=())
        off = _sink.control_offset(n)
        self._sink_buf[off:off + len(ctl)] = memoryview(ctl)

    def _control(self, n: int) -> _sink.Control:
        try:
            ctl = _sink.read_control(self._sink_buf, n)
        except _sink.BadSink as e:
            raise WeightsError(f"trainer {self._ref!r}: {e}") from None
        if ctl.arm != self._arm:
            raise WeightsError(f"trainer {self._ref!r} answered arm {ctl.arm}, this sink armed {self._arm}")
        return ctl


# ---------------------------------------------------------------- trainer


@dataclass
class SinkReport:
    """One sink's part of a :meth:`WeightPublisher.push`."""

    rank: Optional[int]  # the sink's label (None: it gave none)
    peer: str  # the sink engine's id
    tensors: int = 0  # tensors written
    nbytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    error: str = ""  # why this sink did not get the push ("" if it did)


@dataclass
class PushResult:
    """What :meth:`WeightPublisher.push` did, per sink."""

    version: int
    sinks: List[SinkReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> List[SinkReport]:
        return [s for s in self.sinks if s.error]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sinks if not s.error)


@dataclass(frozen=True)
class PushState:
    """The publisher's state a push writes from (taken under its lock)."""

    publisher: str
    instance: int
    seq: int
    version: int
    names: Tuple[str, ...]
    nbytes: Tuple[int, ...]
    versions: Tuple[int, ...]
    locals: Tuple[Tuple[int, int], ...]  # (handle, offset) of each tensor


class Hellos:
    """Which endpoint of a sink's engine the sink listens on, when its engine has several to
    the trainer: each sink's first message on its endpoint is a hello with its token
    (``_sink.py``); the trainer posts a receive for it on such endpoints, once each, and keeps
    what arrives. Owned by the publisher, kept across pushes."""

    def __init__(self, engine):
        self._engine = engine
        self._posted: Dict[int, tuple] = {}  # id(endpoint) -> (endpoint, future, buffer, handle)

    def token(self, ep: Endpoint) -> Optional[int]:
        """The token ``ep``'s peer said hello with; None while none has arrived (a receive
        is then posted, if it was not)."""
        slot = self._posted.get(id(ep))
        if slot is None or slot[0] is not ep:
            buf, h = self._engine.allocate(_sink.HELLO.size)
            slot = (ep, ep.recv(h, 0, _sink.HELLO.size), buf, h)
            self._posted[id(ep)] = slot
        fut = slot[1]
        if not fut.done() or fut.code.name != "OK":
            return None
        return _sink.read_hello(slot[2])

    def prune(self) -> None:
        """Forget the endpoints that closed (their receives are over then)."""
        for k, (ep, fut, _, h) in list(self._posted.items()):
            if not ep.connected and fut.done():
                del self._posted[k]
                try:
                    self._engine.unregister(h)
                except SluiceError:
                    pass


def push(engine, state: PushState, endpoints: Sequence[Endpoint], *, timeout: float, expect: int,
         ranks: Optional[set], depth: int, hellos: Hellos, more=None) -> PushResult:
    """Runs the push on an asyncio loop of its own (in a helper thread if the caller's thread
    already runs one). ``more()``: endpoints accepted since (for ``expect``)."""
    hellos.prune()
    coro = _push_all(engine, state, list(endpoints), timeout, expect, ranks, depth, hellos, more)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-weights-push") as ex:
        return ex.submit(asyncio.run, coro).result()


def _by_peer(endpoints: Iterable[Endpoint]) -> Dict[str, List[Endpoint]]:
    """Live endpoints grouped by peer engine: one sink region per engine, whatever its endpoints."""
    groups: Dict[str, List[Endpoint]] = {}
    for ep in endpoints:
        if ep.connected:
            groups.setdefault(str(ep.peer_engine_id), []).append(ep)
    return groups


async def _push_all(engine, state: PushState, endpoints: List[Endpoint], timeout: float, expect: int,
                    ranks: Optional[set], depth: int, hellos: Hellos, more) -> PushResult:
    t0 = time.monotonic()
    deadline = t0 + timeout
    result = PushResult(version=state.version)
    seen: Dict[str, bool] = {}  # peer engine id -> it is a sink
    tasks: List[asyncio.Task] = []

    async def probe(peer: str, group: List[Endpoint]):
        region = await asyncio.to_thread(_sink_region, group[0], state.publisher)
        seen[peer] = region is not None
        if region is not None:
            tasks.append(asyncio.ensure_future(
                _push_one(engine, state, group, region, deadline, ranks, depth, hellos, more)))

    await asyncio.gather(*(probe(p, g) for p, g in _by_peer(endpoints).items()))
    # expect: sinks may still be connecting (their endpoints arrive through ``more``), or
    # connected and not yet armed once (no sink region yet).
    pause = 0.005
    while sum(seen.values()) < expect and time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)
        fresh = _by_peer(more() if more else endpoints)
        await asyncio.gather(*(probe(p, g) for p, g in fresh.items() if not seen.get(p)))
    for report in await asyncio.gather(*tasks):
        if report is not None:
            result.sinks.append(report)
    found = sum(seen.values())
    if found < expect:
        result.sinks.append(SinkReport(None, "", error=f"only {found} of the {expect} expected sinks connected "
                                                       "within the timeout"))
    for s in result.failed:
        log.warning("sluice.weights: push of version %d to sink %s (%s) failed: %s", state.version,
                    s.rank, s.peer, s.error)
    result.seconds = time.monotonic() - t0
    return result


def _sink_region(ep: Endpoint, publisher: str, refresh: bool = False) -> Optional[Tuple[int, int]]:
    """The peer's sink region for ``publisher`` (id, length), None if it is no sink of ours.
    The endpoint's copy of the peer's region table first (a sink keeps its region from push
    to push); a refresh (a round trip carrying the whole table) only on a miss."""
    if not ep.connected:
        return None
    name = _sink.region_name(publisher)
    try:
        if not refresh:
            found = _named_regions(ep).get(name)
            if found is not None:
                return found
        ep.refresh_remote_regions()
        return _named_regions(ep).get(name)
    except SluiceError:
        return None


async def _wait(fut, deadline: float, what: str):
    left = deadline - time.monotonic()
    if left <= 0:
        raise SluiceTimeoutError(f"no time left for {what}")
    try:
        return await asyncio.wait_for(_aw(fut), left)
    except asyncio.TimeoutError:
        raise SluiceTimeoutError(f"{what} did not complete within the timeout") from None


async def _aw(fut):
    return await fut


async def _sink_endpoint(group: List[Endpoint], token: int, hellos: Hellos, deadline: float, more) -> Endpoint:
    """The endpoint of the sink's engine that the sink with ``token`` listens on: the one its
    hello came on. Even a lone endpoint is checked: the sink's own may not be accepted yet."""
    peer = str(group[0].peer_engine_id)
    pause = 0.001
    while True:
        for ep in group:
            if ep.connected and hellos.token(ep) == token:
                return ep
        if time.monotonic() + pause > deadline:
            raise SluiceTimeoutError(f"none of the {len(group)} endpoints of the sink's engine said hello with its "
                                     "token (is something else using send/recv on them?)")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.02)
        if more is not None:
            group = _by_peer(more()).get(peer, group)


async def _push_one(engine, state: PushState, group: List[Endpoint], region: Tuple[int, int], deadline: float,
                    ranks: Optional[set], depth: int, hellos: Hellos, more) -> Optional[SinkReport]:
    t0 = time.monotonic()
    ep = group[0]  # for reading the table: any endpoint to the sink's engine reads the same
    report = SinkReport(None, str(ep.peer_engine_id))
    rid, rlen = region
    # What a sink decides is bounded by our own table: at most one entry per tensor, so we read
    # (and allocate for) no more than such a table's region, whatever length the sink registered.
    cap = max(4096, _sink.region_size(len(state.names)))
    rlen = min(rlen, cap)
    scratch = None
    writing = False
    try:
        scratch, sh = engine.allocate(rlen)
        # 1. The sink's table, once it is armed (its arm differs from the last one we answered).
        pause = 0.001
        while True:
            try:
                await _wait(ep.read([(sh, 0, rid, 0, rlen)]), deadline, "reading the sink's table")
            except UnknownHandleError:
                # The sink replaced its region (its table grew), or a sink closed and a new one
                # on the same engine has not armed yet: look again, until the deadline.
                found = await asyncio.to_thread(_sink_region, ep, state.publisher, True)
                if found is not None:
                    if min(found[1], cap) > rlen:
                        engine.unregister(sh)
                        scratch = None
                        scratch, sh = engine.allocate(min(found[1], cap))
                    rid, rlen = found[0], min(found[1], cap)
                    continue
                table, served, why = None, 0, "the sink's region is gone (the sink closed?)"
            else:
                try:
                    table, served = _sink.read_table(scratch[:rlen].tobytes())
                except _sink.BadSink as e:
                    table, served, why = None, 0, str(e)
            if table is not None:
                report.rank = None if table.rank < 0 else table.rank
                if ranks is not None and report.rank not in ranks:
                    return None
                if table.arm != 0 and table.arm != served:
                    break
                why = "the sink is not armed (its receive() has not been called)"
            if time.monotonic() + pause > deadline:
                raise SluiceTimeoutError(why)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)
        # Immediates reach only the endpoint they are written on: the sink's own.
        ep = await _sink_endpoint(group, table.token, hellos, deadline, more)
        n = len(table.entries)
        # 2. What to write: entries whose version the sink does not hold. The engine refuses
        #    writes outside the sink's registered regions; checking here gives a clear reason.
        status, problem = _sink.OK, ""
        total = sum(e.nbytes for e in table.entries)
        if table.instance != state.instance:
            status, problem = _sink.STALE, "the sink's table names an older tensor table"
        elif len({e.index for e in table.entries}) != n or table.bucket_bytes < _sink.MIN_BUCKET_BYTES or \
                -(-total // table.bucket_bytes) > _sink.MAX_BUCKETS:
            status, problem = _sink.BAD_TABLE, (f"a tensor listed twice, or bucket_bytes {table.bucket_bytes} "
                                                f"(at least {_sink.MIN_BUCKET_BYTES}, and at most "
                                                f"{_sink.MAX_BUCKETS} buckets)")
        else:
            # The targets were registered when the sink armed: after our last look, maybe.
            regions = _region_lengths(ep)
            if any(e.nbytes and e.region not in regions for e in table.entries):
                await asyncio.to_thread(ep.refresh_remote_regions)
                regions = _region_lengths(ep)
            for e in table.entries:
                if e.index >= len(state.names) or e.nbytes != state.nbytes[e.index]:
                    status, problem = _sink.BAD_TABLE, f"entry for tensor #{e.index} with {e.nbytes} bytes"
                elif e.nbytes and regions.get(e.region, -1) < e.nbytes:
                    status, problem = _sink.BAD_TABLE, f"target region {e.region} missing or short"
                if status:
                    break
        pushed = [] if status else [(k, state.versions[e.index]) for k, e in enumerate(table.entries)
                                    if e.held != state.versions[e.index] + 1]
        ctl_off = _sink.control_offset(n)
        ctl = _sink.encode_control(status=status, arm=table.arm, seq=state.seq, version=state.version,
                                   instance=state.instance, pushed=pushed)
        scratch[:len(ctl)] = memoryview(ctl)
        if status:
            await _wait(ep.write_with_imm([(sh, 0, rid, ctl_off, len(ctl))], _sink.imm(table.arm, _sink.IMM_DONE)),
                        deadline, "telling the sink why it gets nothing")
            report.error = problem
            return report
        writing = True
        await _wait(ep.write_with_imm([(sh, 0, rid, ctl_off, len(ctl))], _sink.imm(table.arm, _sink.IMM_BEGIN)),
                    deadline, "writing the manifest")
        # 3. The buckets: the sink's plan is the same (same items, same bucket_bytes).
        items = [Item(state.names[table.entries[k].index], table.entries[k].nbytes, table.entries[k].region,
                      *state.locals[table.entries[k].index]) for k, _ in pushed]
        buckets = plan(items, table.bucket_bytes)
        if len(buckets) > _sink.MAX_BUCKETS:
            raise WeightsError(f"{len(buckets)} buckets exceed the immediate's range: raise the sink's bucket_bytes")
        inflight: List = []
        for k, b in enumerate(buckets):
            if not b.entries:
                continue
            # plan() made (sink region, offset, our handle, our offset, length): write reverses it.
            batch = [(h, hoff, r, roff, ln) for (r, roff, h, hoff, ln) in b.entries]
            inflight.append(ep.write_with_imm(batch, _sink.imm(table.arm, k)))
            if len(inflight) >= depth:
                await _wait(inflight.pop(0), deadline, f"writing bucket {k - depth + 1}")
        for i, f in enumerate(inflight):
            await _wait(f, deadline, "writing the last buckets")
        await _wait(ep.write_with_imm([(sh, 0, rid, ctl_off, _sink.CONTROL.size)], _sink.imm(table.arm, _sink.IMM_DONE)),
                    deadline, "announcing the end")
        report.tensors = len(pushed)
        report.nbytes = sum(b.nbytes for b in buckets)
        report.buckets = len(buckets)
    except (SluiceError, WeightsError) as e:
        report.error = f"{type(e).__name__}: {e}"
        if writing and not isinstance(e, (PeerLostError, ClosedError)):
            _close_quietly(ep)  # stalled mid-push: stop writing into it (the sink reconnects)
    finally:
        report.seconds = time.monotonic() - t0
        if scratch is not None:
            try:
                engine.unregister(sh)
            except SluiceError:
                pass
    return report


def _region_lengths(ep: Endpoint) -> Dict[int, int]:
    """The peer's regions: id -> length (targets are registered without names)."""
    return {int(r["id"]): int(r["length"]) for r in ep.remote_regions()}
