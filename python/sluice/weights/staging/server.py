"""The sidecar side of the staging buffer: :class:`StagingServer`, which pulls published weights
with a :class:`~sluice.weights.WeightSubscriber` into a buffer shared with one inference
process, bin by bin and double buffered, hands that process the buffer (a CUDA IPC handle or
a memfd) and waits for its acks."""

from __future__ import annotations

import collections
import hmac
import logging
import mmap
import os
import pickle
import secrets
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ... import ClosedError, InvalidArgumentError, SluiceTimeoutError
from .._torch import torch
from ..errors import TensorMismatchError, WeightsChangedError
from ._layout import ALIGN, _align, _Layout, _view
from ._results import StagingResult
from ._wire import ACK_FRAME, HANDSHAKE_FRAME, PROTOCOL, _Channel, _Gone, _mac, _shown, _Timeout
from .errors import ConsumerError, ConsumerLostError, StagingCapacityError, StagingError

log = logging.getLogger("sluice.weights")

_SETTLE_GRACE = 2.0  # seconds an aborted update waits at least for the consumer to release its slots


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


class StagingServer:
    """Sidecar side: pulls published weights into a staging buffer shared with one inference
    process (:class:`StagingClient`), bin by bin, double buffered.

    ``subscriber``: a :class:`~sluice.weights.WeightSubscriber` dedicated to this server (it
    registers views of the staging buffer as its targets); or None and ``engine`` +
    ``trainer_ref`` (+ ``name``, ``bucket_bytes``, ``depth``) to build one, which
    :meth:`close` then closes.

    ``device``: where the buffer is: a CUDA device (default when CUDA is available: the
    current one), or "cpu" (a memfd the consumer maps: tests, CPU inference). ``capacity``:
    the buffer's bytes, split in two slots; default: ``memory_fraction`` × the device's free
    memory (``torch.cuda.mem_get_info``), at most ``max_capacity``, no more than the model
    needs (one slot when the model fits in one), and at least two of its largest tensor when
    the memory allows (else one slot of it). Sized and allocated at the first :meth:`accept`
    or :meth:`update` (from the trainer's published table) unless ``capacity`` is given.

    ``path``: the unix socket's path; None: an abstract socket (no file, this network
    namespace). :attr:`address` is what the consumer passes to :class:`StagingClient`; it holds
    the connection key, so hand it only to the inference process.
    """

    def __init__(self, subscriber=None, *, engine=None, trainer_ref: Optional[str] = None,
                 name: Optional[str] = None, device=None, capacity: Optional[int] = None,
                 memory_fraction: float = 0.9, max_capacity: int = 4 << 30, path: Optional[str] = None,
                 timeout: float = 60.0, bucket_bytes: int = 64 << 20, depth: int = 2):
        from ..subscriber import WeightSubscriber

        t = torch()
        if subscriber is None:
            if engine is None or trainer_ref is None:
                raise InvalidArgumentError("StagingServer: pass a WeightSubscriber, or engine and trainer_ref")
        else:
            if not isinstance(subscriber, WeightSubscriber):
                raise InvalidArgumentError(f"StagingServer: subscriber must be a WeightSubscriber, "
                                           f"got {type(subscriber).__name__}")
            if engine is not None or trainer_ref is not None:
                raise InvalidArgumentError("StagingServer: pass a subscriber or engine and trainer_ref, not both")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 2 * ALIGN):
            raise InvalidArgumentError(f"StagingServer: capacity must be an int of at least {2 * ALIGN} bytes "
                                       f"(or None), got {capacity!r}")
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
                or not 0 < memory_fraction <= 1:
            raise InvalidArgumentError(f"StagingServer: memory_fraction must be in (0, 1], got {memory_fraction!r}")
        if isinstance(max_capacity, bool) or not isinstance(max_capacity, int) or max_capacity < 2 * ALIGN:
            raise InvalidArgumentError(f"StagingServer: max_capacity must be an int >= {2 * ALIGN}, "
                                       f"got {max_capacity!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise InvalidArgumentError(f"StagingServer: timeout must be a number of seconds > 0, got {timeout!r}")
        if path is not None and (not isinstance(path, str) or not path or path.startswith("\0")):
            raise InvalidArgumentError(f"StagingServer: path must be a filesystem path or None, got {path!r}")
        if device is None:
            device = "cuda" if t.cuda.is_available() else "cpu"
        try:
            dev = t.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(f"StagingServer: device {device!r}: {e}") from None
        if dev.type == "cuda":
            if not t.cuda.is_available():
                raise InvalidArgumentError(f"StagingServer: device {device!r}, but torch sees no CUDA device")
            dev = t.device("cuda", t.cuda.current_device() if dev.index is None else dev.index)
        elif dev.type != "cpu":
            raise InvalidArgumentError(f"StagingServer: device must be a CUDA device or 'cpu', got {device!r}")
        self._own_sub = subscriber is None
        if subscriber is None:
            subscriber = WeightSubscriber(engine, trainer_ref, name, bucket_bytes=bucket_bytes, depth=depth,
                                          timeout=timeout)
        self._sub = subscriber
        self.device = dev
        self.timeout = float(timeout)
        self.memory_fraction = float(memory_fraction)
        self.max_capacity = max_capacity
        self._lock = threading.RLock()
        self._closed = False
        # the buffer
        self._buf = None  # uint8 tensor of capacity bytes
        self._memfd = -1
        self._mmap = None
        self.slot_bytes = 0
        self.slots = 0
        self._layouts: Dict[tuple, _Layout] = {}
        # the consumer
        self._chan: Optional[_Channel] = None
        self._delivered: Dict[str, Tuple[int, int]] = {}  # name -> (instance, version), this connection
        self._uid = 0
        # the socket
        self._key = secrets.token_bytes(32)
        self._sockaddr = f"\0sluice-staging-{os.getpid()}-{secrets.token_hex(8)}" if path is None else path
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._lsock.bind(self._sockaddr)
            self._lsock.listen(8)
        except OSError as e:
            self._lsock.close()
            if self._own_sub:
                subscriber.close()
            raise InvalidArgumentError(f"StagingServer: cannot listen on {_shown(self._sockaddr)!r}: {e}") from None
        if capacity is not None:
            try:
                self._allocate(capacity // 2 // ALIGN * ALIGN, 2)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------ public

    @property
    def address(self) -> str:
        """What :class:`StagingClient` / :func:`receive_from_staging` take: the socket and the
        connection key ("unix:@name#key" or "unix:/path#key")."""
        where = "@" + self._sockaddr[1:] if self._sockaddr.startswith("\0") else self._sockaddr
        return f"unix:{where}#{self._key.hex()}"

    @property
    def subscriber(self):
        return self._sub

    @property
    def capacity(self) -> int:
        """The staging buffer's bytes (0 until it is allocated)."""
        return 0 if self._buf is None else self.slot_bytes * self.slots

    @property
    def buffer(self):
        """The staging tensor (uint8, ``capacity`` bytes), or None before it is allocated."""
        return self._buf

    @property
    def connected(self) -> bool:
        """Whether a consumer is connected (and had the buffer)."""
        return self._chan is not None and not self._chan.closed_by_peer()

    def accept(self, timeout: Optional[float] = None) -> None:
        """Wait (at most ``timeout`` s) until a consumer connects, and hand it the buffer
        (allocated first if needed). :meth:`update` does this itself when no consumer is
        connected. Raises :class:`~sluice.SluiceTimeoutError` if none came."""
        with self._lock:
            self._need_open()
            deadline = time.monotonic() + self._timeout(timeout)
            if self._buf is None:
                self._layout_for(self._sub.published(timeout=self._left(deadline, "reading the published table")))
            self._ensure_consumer(deadline)

    def update(self, names: Optional[Sequence[str]] = None, *, force: bool = False,
               timeout: Optional[float] = None) -> StagingResult:
        """Deliver to the consumer every tensor whose published version differs from what it
        got from this server over its current connection (``force``: all; ``names``: only
        these), bin by bin: pull a bin into a slot, send its descriptor, pull the next one
        into the other slot while the consumer copies. All bins hold one published version:
        if the trainer publishes or begins changing meanwhile, raises
        :class:`WeightsChangedError` (the consumer's update is aborted; the bins it got hold
        the earlier version). Raises :class:`StagingCapacityError` before anything moves if a
        tensor does not fit a slot, :class:`ConsumerError` if the consumer failed on a bin,
        :class:`ConsumerLostError` if it died or did not answer, the subscriber's errors
        (``TrainerLostError``, ...) as they are; ``timeout`` bounds the whole update."""
        with self._lock:
            self._need_open()
            t0 = time.monotonic()
            deadline = t0 + self._timeout(timeout)
            if isinstance(names, str):
                raise InvalidArgumentError("update: names must be a list of names, not one str")
            snap = self._sub.published(timeout=self._left(deadline, "reading the published table"))
            layout = self._layout_for(snap)
            version_of = {t.name: snap.versions[i] for i, t in enumerate(snap.tensors)}
            if names is None:
                selected = set(version_of)
            else:
                selected = set(names)
                unknown = sorted(selected - set(version_of))
                if unknown:
                    raise TensorMismatchError(f"update: the trainer publishes no tensor named {_few(unknown)}")
            self._ensure_consumer(deadline)
            result = StagingResult(version=snap.version)
            todo: List[Tuple[int, List[Tuple[object, int]]]] = []  # (layout bin, [(info, offset)])
            for b, items in enumerate(layout.bins):
                send = []
                for info, off in items:
                    if info.name not in selected:
                        continue
                    if not force and self._delivered.get(info.name) == (snap.instance, version_of[info.name]):
                        result.unchanged.append(info.name)
                    else:
                        send.append((info, off))
                if send:
                    todo.append((b, send))
            self._run(snap, layout, todo, version_of, result, deadline)
            result.seconds = time.monotonic() - t0
            return result

    def forget(self, names: Optional[Sequence[str]] = None) -> None:
        """Say that the consumer's copies changed outside :meth:`update` (or that it is a new
        one): the next update sends those again (default: all)."""
        with self._lock:
            if names is None:
                self._delivered.clear()
            else:
                for n in names:
                    self._delivered.pop(n, None)

    def close(self) -> None:
        """Close the socket and the consumer's connection (it sees the server gone), release
        the buffer, and close the subscriber if this server built it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_consumer()
            try:
                self._lsock.close()
            except OSError:
                pass
            if not self._sockaddr.startswith("\0"):
                try:
                    os.unlink(self._sockaddr)
                except OSError:
                    pass
            if self._own_sub:
                self._sub.close()
            self._buf = None
            self._layouts.clear()
            if self._memfd >= 0:
                os.close(self._memfd)
                self._memfd = -1
            if self._mmap is not None:
                try:
                    self._mmap.close()
                except BufferError:  # views still held (a given subscriber's targets): freed with them
                    pass
                self._mmap = None

    def __enter__(self) -> "StagingServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<StagingServer {self.address.split('#')[0]} device={self.device} capacity={self.capacity} "
                f"slots={self.slots}>")

    # ------------------------------------------------------------ the update

    def _run(self, snap, layout: _Layout, todo, version_of, result: StagingResult, deadline: float) -> None:
        chan = self._chan
        self._uid += 1
        uid = self._uid
        total = sum(info.nbytes for _, items in todo for info, _ in items)
        pending: collections.deque = collections.deque()  # (k, slot, names, nbytes) sent, not acked yet
        try:
            chan.send({"type": "begin", "update": uid, "version": snap.version, "bins": len(todo),
                       "tensors": sum(len(items) for _, items in todo), "nbytes": total},
                      deadline, "sending the update's start")
            for k, (b, items) in enumerate(todo):
                slot = layout.slot(b)
                while any(s == slot for _, s, _, _ in pending):  # the slot's previous bin must be acked
                    self._ack(pending.popleft(), uid, len(todo), snap, version_of, result, deadline)
                self._pull(items, snap, deadline, k, len(todo))
                chan.send({"type": "bin", "update": uid, "bin": k, "bins": len(todo), "slot": slot,
                           "tensors": [{"name": info.name, "dtype": info.dtype, "shape": list(info.shape),
                                        "offset": off} for info, off in items]},
                          deadline, f"sending bin {k + 1} of {len(todo)}")
                pending.append((k, slot, [info.name for info, _ in items], sum(info.nbytes for info, _ in items)))
                result.bins += 1
            while pending:
                self._ack(pending.popleft(), uid, len(todo), snap, version_of, result, deadline)
            chan.send({"type": "end", "update": uid, "version": snap.version, "tensors": len(result.tensors),
                       "nbytes": result.nbytes}, deadline, "sending the update's end")
        except (_Gone, _Timeout) as e:
            self._drop_consumer()
            if isinstance(e, _Timeout):
                raise ConsumerLostError(f"the consumer did not answer within the timeout ({e})") from None
            raise ConsumerLostError(f"the consumer went away ({e})") from None
        except ConsumerError as e:
            self._abort(uid, str(e), collections.deque(), deadline)  # it stopped reading this update: slots are free
            raise
        except BaseException as e:
            self._abort(uid, f"{type(e).__name__}: {e}", pending, deadline)
            raise

    def _pull(self, items, snap, deadline: float, k: int, n: int) -> None:
        views = {info.name: _view(self._buf, info.dtype, info.shape, off) for info, off in items}
        res = self._sub.update(views, names=list(views), force=True,
                               timeout=self._left(deadline, f"pulling bin {k + 1} of {n}"))
        # The update checked that the metadata stayed as it read it: its seq is this bin's.
        if (res.seq, res.instance) != (snap.seq, snap.instance):
            raise WeightsChangedError(
                f"the trainer changed its tensors during the staged update (bin {k + 1} of {n}; published version "
                f"was {snap.version}, now {res.version}); run update() again")

    def _ack(self, entry, uid: int, n: int, snap, version_of, result: StagingResult, deadline: float) -> None:
        k, _, names, nbytes = entry
        while True:
            msg = self._chan.recv(deadline, f"waiting for the consumer's ack of bin {k + 1} of {n}", ACK_FRAME)
            if msg.get("type") == "ack" and msg.get("update") == uid:
                break
            log.debug("sluice.weights staging: dropping a stale message %r", msg.get("type"))
        if msg.get("bin") != k:
            raise _Gone(f"the consumer acked bin {msg.get('bin')!r}, expected {k}")
        err = msg.get("error") or ""
        if err:
            tb = str(msg.get("traceback") or "")
            raise ConsumerError(f"the consumer failed on bin {k + 1} of {n} while {msg.get('where') or '?'} (the bin "
                                f"holds {_few(names)}): {err}" + (f"\n{tb}" if tb else ""),
                                bin=k, tensors=names, remote_traceback=tb)
        for name in names:
            self._delivered[name] = (snap.instance, version_of[name])
        result.tensors.extend(names)
        result.nbytes += nbytes

    def _abort(self, uid: int, why: str, pending, deadline: float) -> None:
        """Tell the consumer the update is off, then wait (until the update's deadline, or
        at least _SETTLE_GRACE s) until it released the slots it may still read; if it does
        not, drop the connection (its receive() then fails; it maps the buffer again)."""
        chan = self._chan
        if chan is None:
            return
        deadline = max(deadline, time.monotonic() + _SETTLE_GRACE)
        try:
            chan.send({"type": "abort", "update": uid, "error": why}, deadline, "sending abort")
            while pending:
                pending.popleft()
                while True:
                    msg = chan.recv(deadline, "waiting for the consumer to release its slots", ACK_FRAME)
                    if msg.get("type") == "ack" and msg.get("update") == uid:
                        break
                if msg.get("error"):
                    break  # it stopped reading this update
        except (_Gone, _Timeout):
            self._drop_consumer()

    # ------------------------------------------------------------ the consumer

    def _ensure_consumer(self, deadline: float) -> None:
        if self._chan is not None and self._chan.closed_by_peer():
            log.info("sluice.weights staging: the consumer closed its connection; waiting for a new one")
            self._drop_consumer()
        if self._chan is not None:
            return
        if self._buf is None:
            raise StagingError("internal: the staging buffer is not allocated")
        why = "none connected"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SluiceTimeoutError(
                    f"no consumer connected to the staging server {_shown(self._sockaddr)!r} within the timeout "
                    f"({why}); the inference process must call receive_from_staging(address, ...)")
            self._lsock.settimeout(left)
            try:
                sock, _ = self._lsock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                raise StagingError(f"accepting on {_shown(self._sockaddr)!r} failed: {e}") from None
            chan = _Channel(sock)
            try:
                self._handshake(chan, deadline)
            except (_Gone, _Timeout) as e:
                why = f"one connected but failed the handshake: {e}"
                log.warning("sluice.weights staging: %s", why)
                chan.close()
                continue
            self._chan = chan
            self._delivered.clear()  # a new consumer: it gets everything
            return

    def _handshake(self, chan: _Channel, deadline: float) -> None:
        nonce = secrets.token_bytes(32)
        chan.send({"type": "challenge", "protocol": PROTOCOL, "nonce": nonce.hex()}, deadline, "handshake")
        msg = chan.recv(deadline, "handshake", HANDSHAKE_FRAME)
        if msg.get("type") != "auth" or not isinstance(msg.get("mac"), str) or \
                not hmac.compare_digest(msg["mac"], _mac(self._key, b"client", nonce)):
            raise _Gone("the client does not hold this server's key")
        try:
            cnonce = bytes.fromhex(msg.get("nonce", ""))
        except (TypeError, ValueError):
            raise _Gone("bad client nonce") from None
        t = torch()
        uuid = ""
        if self.device.type == "cuda":
            uuid = str(getattr(t.cuda.get_device_properties(self.device), "uuid", ""))
        chan.send({"type": "hello", "mac": _mac(self._key, b"server", cnonce), "protocol": PROTOCOL,
                   "kind": self.device.type, "device": str(self.device), "uuid": uuid,
                   "capacity": self.capacity, "slots": self.slots, "slot_bytes": self.slot_bytes,
                   "pid": os.getpid()}, deadline, "handshake")
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            chan.send_raw(pickle.dumps(reduce_tensor(self._buf)), deadline, "sending the CUDA IPC handle")
        else:
            chan.send_fd(self._memfd, deadline, "sending the buffer's memfd")
        msg = chan.recv(deadline, "waiting for the consumer to map the buffer", ACK_FRAME)
        if msg.get("type") != "ready":
            raise _Gone(f"expected ready, got {msg.get('type')!r}")
        if msg.get("error"):
            raise _Gone(f"the consumer could not map the staging buffer: {msg['error']}")

    def _drop_consumer(self) -> None:
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
        self._delivered.clear()

    # ------------------------------------------------------------ the buffer

    def _layout_for(self, snap) -> _Layout:
        key = tuple((t.name, t.dtype, t.shape, t.nbytes) for t in snap.tensors)
        layout = self._layouts.get(key)
        if layout is None:
            if self._buf is None:
                self._size_and_allocate(snap.tensors)
            layout = _Layout(snap.tensors, self.slot_bytes, self.slots, self.capacity)
            if len(self._layouts) > 4:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def _size_and_allocate(self, tensors) -> None:
        t = torch()
        sizes = [(i.nbytes, i.name) for i in tensors]
        largest, big = max(sizes, default=(0, ""))
        largest = _align(max(largest, 1))
        model = _align(max(sum(_align(n) for n, _ in sizes), 1))  # one slot holding everything
        budget = self.max_capacity
        free = None
        if self.device.type == "cuda":
            free, _ = t.cuda.mem_get_info(self.device)
            budget = min(budget, int(self.memory_fraction * free))
        slot = max(min(budget // 2 // ALIGN * ALIGN, model), largest)
        slots = 1 if slot >= model else 2
        if slot * slots > budget and free is not None:
            slots = 1  # room for one slot of the largest tensor, not two: no double buffering
        if free is not None and slot * slots > int(self.memory_fraction * free):
            raise StagingCapacityError(
                f"tensor {big!r} ({largest} bytes) does not fit in {self.memory_fraction:g} of the free memory of "
                f"{self.device} ({free} bytes free); free memory, or pass capacity=")
        self._allocate(slot, slots)

    def _allocate(self, slot: int, slots: int) -> None:
        t = torch()
        cap = slot * slots
        if self.device.type == "cuda":
            self._buf = t.empty(cap, dtype=t.uint8, device=self.device)
        else:
            fd = os.memfd_create("sluice-staging", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, cap)
                mm = mmap.mmap(fd, cap)
            except BaseException:
                os.close(fd)
                raise
            self._memfd, self._mmap = fd, mm
            self._buf = t.frombuffer(mm, dtype=t.uint8)
        self.slot_bytes, self.slots = slot, slots
        log.info("sluice.weights staging: %d bytes on %s, %d slot(s) of %d", cap, self.device, slots, slot)

    # ------------------------------------------------------------ small things

    def _need_open(self) -> None:
        if self._closed:
            raise ClosedError("the StagingServer is closed")

    def _timeout(self, timeout: Optional[float]) -> float:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        return float(timeout)

    @staticmethod
    def _left(deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SluiceTimeoutError(f"the staged update ran out of time before {what}")
        return left
