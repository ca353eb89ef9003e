"""Sluice: batched one-sided and two-sided data transfer between engines.

Python binding of the C++ engine. See docs/python.md for a tour::

    import numpy as np, sluice

    with sluice.Engine() as a, sluice.Engine() as b:
        src = np.arange(1 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        hs = a.register(src, name="src")
        hd = b.register(dst)
        ep = b.connect(a.listen_address)
        ep.read([(hd, 0, ep.remote_region("src"), 0, src.nbytes)]).wait()
"""

from __future__ import annotations

import asyncio
import atexit
import math
import numbers
import operator
import threading
import weakref
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Union

from . import _sluice
from .errors import (  # noqa: F401  (re-exported)
    CancelledError,
    ClosedError,
    EmptyBatchError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    NoDeviceError,
    OutOfRangeError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    SluiceError,
    SluiceTimeoutError,
    SystemCallError,
    TruncatedError,
    UnknownHandleError,
    UnsupportedError,
)

__version__ = _sluice.version  # the C++ kVersion: CMakeLists.txt's project() version


def get_include() -> str:
    """The folder holding the C++ headers (``sluice/sluice.hpp``) that ship in this package."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def cmake_prefix_path() -> str:
    """A CMake prefix under which ``find_package(sluice)`` finds this package's libsluice:
    ``cmake -DCMAKE_PREFIX_PATH=$(python -c 'import sluice; print(sluice.cmake_prefix_path())')``,
    then link ``sluice::sluice``."""
    import os

    return os.path.dirname(os.path.abspath(__file__))

Future = _sluice.Future


# ---------------------------------------------------------------- handles


class MemoryHandle(int):
    """Handle of a region registered with the local engine (an int; 0 is never valid)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"MemoryHandle({int(self)})"


class RemoteHandle(int):
    """Handle of a region a peer registered (its id in the peer's registry)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"RemoteHandle({int(self)})"


class Allocation(NamedTuple):
    """Engine-allocated registered memory: ``buffer`` is a numpy uint8 array (a memoryview
    when numpy is not installed) that stays valid even after the engine frees its side."""

    buffer: Any
    handle: MemoryHandle


# ---------------------------------------------------------------- argument checks
#
# The binding's converters raise a bare TypeError for a negative, oversized or non-integer
# argument (pybind11 finds no overload). Every public method checks its arguments here first,
# so that a caller error raises the documented sluice error naming the argument.


def _describe_value(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _uint(value, what: str, bits: int = 64) -> int:
    """``value`` as an int in [0, 2**bits), else InvalidArgumentError naming ``what``.
    Accepts anything with ``__index__`` (numpy integers, handles), not floats or strings."""
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {_describe_value(value)}") from None
    if v < 0 or v >> bits:
        raise InvalidArgumentError(f"{what} must be in [0, 2**{bits}), got {v}")
    return v


def _opt_str(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a str, got {_describe_value(value)}")
    return value


def _seconds(value, what: str, *, forever_ok: bool):
    """A duration in seconds: a finite number >= 0. ``forever_ok`` marks a wait: ``None`` and
    ``inf`` mean "no limit" (returned as None) and a negative value means "do not wait" (0),
    as for ``threading.Event.wait``; otherwise ``None`` passes through as "not set"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {_describe_value(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise InvalidArgumentError(f"{what} must be at most {_MAX_SECONDS} s, got {value!r}") from None
    if value != value:
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {value!r}")
    if value < 0:
        if forever_ok:
            return 0.0
        raise InvalidArgumentError(f"{what} must be a number of seconds >= 0, got {value!r}")
    if math.isinf(value):
        if forever_ok:
            return None
        raise InvalidArgumentError(f"{what} must be finite, got {value!r}")
    # The binding converts to integer milliseconds; keep far below int64 overflow.
    if value > _MAX_SECONDS:
        raise InvalidArgumentError(f"{what} must be at most {_MAX_SECONDS} s, got {value!r}")
    return float(value)


_MAX_SECONDS = 10 ** 9  # about 31 years


# ---------------------------------------------------------------- futures


def _future_status(self):
    """``ErrorCode`` once complete (``ErrorCode.OK`` on success), ``None`` while pending."""
    return self.code


_future_wait_raw = Future.wait


def _future_wait(self, timeout: Optional[float] = None) -> bool:
    """Block until complete (``True``; raises the operation's error if it failed), or until
    ``timeout`` seconds passed (``False``). ``None`` or ``inf``: no limit."""
    if timeout is None:  # the common case: one call, no checks
        return _future_wait_raw(self)
    return _future_wait_raw(self, _seconds(timeout, "wait: timeout", forever_ok=True))


def _future_result(self, timeout: Optional[float] = None):
    """Wait, raise the operation's error if it failed, and return the future itself.
    Raises :class:`SluiceTimeoutError` if ``timeout`` seconds pass first."""
    if not self.wait(timeout):
        raise SluiceTimeoutError(f"operation still pending after {timeout} s")
    return self


def _settle(af: asyncio.Future) -> None:
    if not af.done():
        af.set_result(None)


def _future_await(self):
    if not self.done():
        loop = asyncio.get_running_loop()
        af = loop.create_future()

        def on_complete():  # an engine thread, GIL held; must not block
            try:
                loop.call_soon_threadsafe(_settle, af)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self._on_complete(on_complete)
        yield from af.__await__()
    self.wait()  # complete: raises the operation's error, if any
    return self


def _future_add_done_callback(self, fn):
    """Call ``fn(future)`` once the operation completes, on an engine thread (or at once if
    already complete). ``fn`` must be quick and must not block."""
    self._on_complete(lambda: fn(self))


def _future_repr(self) -> str:
    if not self.done():
        return "<sluice.Future pending>"
    return f"<sluice.Future {self.code.name} bytes={self.bytes} elapsed={self.elapsed * 1e6:.1f}us>"


Future.status = property(_future_status)
Future.wait = _future_wait
Future.result = _future_result
Future.__await__ = _future_await
Future.add_done_callback = _future_add_done_callback
Future.__repr__ = _future_repr


def wait_all(futures: Iterable[Future], timeout: Optional[float] = None) -> None:
    """Wait for every future; raise the first error (after all have completed)."""
    first = None
    for f in futures:
        try:
            f.result(timeout)
        except SluiceError as e:
            first = first or e
    if first is not None:
        raise first


# ---------------------------------------------------------------- batches


def _as_batch(batch):
    """Lists/tuples go to C++ as they are; numpy arrays become a C-contiguous (N, 5) uint64."""
    if type(batch) is list:  # the common case, without the getattr miss below
        return batch
    dtype = getattr(batch, "dtype", None)
    if dtype is None:
        return batch
    import numpy as np

    arr = batch
    if dtype.names:  # structured: fields in the order local, local_off, remote, remote_off, length
        names = dtype.names
        if len(names) != 5:
            raise InvalidArgumentError(f"a structured batch needs 5 fields, got {names}")
        for n in names:  # a cast to uint64 would turn -1 into 2**64-1 and 1.5 into 1
            _check_int_array(arr[n], f"batch field {n!r}")
        arr = np.stack([np.asarray(arr[n], dtype=np.uint64) for n in names], axis=-1)
    elif dtype != np.uint64:
        _check_int_array(arr, "a batch array")
        arr = arr.astype(np.uint64)
    if arr.ndim == 1 and arr.shape[0] == 5:
        arr = arr.reshape(1, 5)
    return np.ascontiguousarray(arr)


def _check_int_array(arr, what: str) -> None:
    kind = arr.dtype.kind
    if kind not in "iub":
        raise InvalidArgumentError(f"{what} must hold integers, got {arr.dtype}")
    if kind == "i" and arr.size and arr.min() < 0:
        raise InvalidArgumentError(f"{what} holds a negative value ({int(arr.min())})")


BATCH_DTYPE = [("local", "<u8"), ("local_offset", "<u8"), ("remote", "<u8"),
               ("remote_offset", "<u8"), ("length", "<u8")]
"""numpy dtype (list form) of a structured batch: ``np.zeros(n, dtype=sluice.BATCH_DTYPE)``."""


_CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy: the CUDA runtime's other name for stream 0


def _stream(stream, what: str) -> Optional[int]:
    """The ``stream=`` argument of read / write / write_with_imm as the handle the engine
    takes: None (not stream-ordered) stays None; an int is a ``cudaStream_t``; an object with
    ``__cuda_stream__()`` (the CUDA stream protocol: ``(version, handle)``) or with a
    ``cuda_stream`` attribute (``torch.cuda.Stream``) gives its handle. Handle 0, the legacy
    default stream (``torch.cuda.default_stream()``), is passed as cudaStreamLegacy, because
    the engine reads a null stream as "no stream". Anything else is InvalidArgumentError."""
    if stream is None:
        return None
    handle = stream
    if callable(getattr(type(stream), "__cuda_stream__", None)):
        got = stream.__cuda_stream__()
        if not (isinstance(got, tuple) and len(got) == 2):
            raise InvalidArgumentError(f"{what}: stream.__cuda_stream__() must return (version, handle), "
                                       f"got {_describe_value(got)}")
        handle = got[1]
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    # bool is an int to operator.index, but True is never a stream.
    if isinstance(handle, bool) or not hasattr(handle, "__index__"):
        raise InvalidArgumentError(f"{what}: stream must be None, an int cudaStream_t or a CUDA stream "
                                   f"object (torch.cuda.Stream), got {_describe_value(stream)}")
    return _uint(handle, f"{what}: stream handle") or _CUDA_STREAM_LEGACY


# ---------------------------------------------------------------- endpoint


class Endpoint:
    """A connection to one peer engine (``Engine.connect`` / ``Engine.accept``).

    One-sided operations take a batch: a list of ``(local, local_offset, remote,
    remote_offset, length)`` tuples, or an (N, 5) uint64 / structured numpy array. They return
    a :class:`Future` at once; caller errors (unknown handle, out of range, empty batch, closed
    endpoint) raise immediately and transfer nothing. ``await``-able variants end in
    ``_async``; a Future is itself awaitable.
    """

    __slots__ = ("_ep", "_engine", "__weakref__")

    def __init__(self, core, engine: "Engine"):
        self._ep = core
        self._engine = engine

    # one-sided. ``stream``: None, a ``torch.cuda.Stream`` (or any object with
    # ``__cuda_stream__``) or an int cudaStream_t; with one, the op's copies are enqueued on
    # that stream (after the work queued on it; later work on it sees the data). Only
    # transports with the ``stream_ordered`` capability take it (UnsupportedError otherwise).
    def read(self, batch, stream=None) -> Future:
        return self._ep.read(_as_batch(batch), _stream(stream, "read"))

    def write(self, batch, stream=None) -> Future:
        return self._ep.write(_as_batch(batch), _stream(stream, "write"))

    def write_with_imm(self, batch, imm: int, stream=None) -> Future:
        """Write; the peer then gets exactly one ``imm_recv`` completion carrying ``imm``
        (an unsigned 32-bit integer)."""
        return self._ep.write_with_imm(_as_batch(batch), _uint(imm, "write_with_imm: imm", 32),
                                       _stream(stream, "write_with_imm"))

    @property
    def capabilities(self) -> dict:
        """What the endpoint's transport can do: ``host_memory``, ``cuda_memory``,
        ``stream_ordered``, ``stream_ordered_messages``, ``imm``, ``signal``, ``rma_post``
        (bools). Choose a path from these, not from the transport's name."""
        return self._ep.capabilities

    # two-sided
    def _span(self, what, local, offset, length):
        h = _uint(local, f"{what}: local handle")
        offset = _uint(offset, f"{what}: offset")
        if length is None:
            size = self._engine._length_of(h)
            if offset > size:
                raise OutOfRangeError(f"{what}: offset {offset} is past the end of region {h} ({size} bytes)")
            length = size - offset
        else:
            length = _uint(length, f"{what}: length")
        return h, offset, length

    def send(self, local, offset: int = 0, length: Optional[int] = None) -> Future:
        """Send ``length`` bytes (default: to the end of the region) of region ``local``."""
        return self._ep.send(*self._span("send", local, offset, length))

    def recv(self, local, offset: int = 0, length: Optional[int] = None) -> Future:
        """Receive the next message into region ``local``; ``Future.bytes`` is its size."""
        return self._ep.recv(*self._span("recv", local, offset, length))

    def imm_recv(self) -> Future:
        """Completes with the next imm the peer delivered (``Future.imm``)."""
        return self._ep.imm_recv()

    # thin post path (capabilities["rma_post"]): no Future per call, for proxies
    def post_write(self, local, local_offset: int, remote, remote_offset: int, length: int) -> None:
        """Post a write of ``length`` bytes; returns once accepted. The bytes are at the peer
        (and the source may change) after the next :meth:`flush` returned."""
        self._ep.post_write(_uint(local, "post_write: local handle"), _uint(local_offset, "post_write: local_offset"),
                            _uint(remote, "post_write: remote handle"),
                            _uint(remote_offset, "post_write: remote_offset"), _uint(length, "post_write: length"))

    def post_signal(self, remote, offset: int, add: int = 1) -> None:
        """Raise the peer's 64-bit counter at ``remote + offset`` (8-byte aligned) by ``add``
        after every byte of every earlier ``post_write`` is visible there."""
        self._ep.post_signal(_uint(remote, "post_signal: remote handle"), _uint(offset, "post_signal: offset"),
                             _uint(add, "post_signal: add", 64))

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every earlier post finished; raises the first error any met since the
        last flush (or TimeoutError after ``timeout`` seconds; default: the op timeout)."""
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        self._ep.flush(ms)

    # asyncio: each submits at once (caller errors raise here) and returns the Future, which
    # is awaitable: ``f = await ep.read_async(batch)``. Completion wakes the event loop
    # through call_soon_threadsafe; no thread per operation.
    def read_async(self, batch, stream=None) -> Future:
        return self._ep.read(_as_batch(batch), _stream(stream, "read"))

    def write_async(self, batch, stream=None) -> Future:
        return self._ep.write(_as_batch(batch), _stream(stream, "write"))

    def write_with_imm_async(self, batch, imm: int, stream=None) -> Future:
        return self._ep.write_with_imm(_as_batch(batch), _uint(imm, "write_with_imm: imm", 32),
                                       _stream(stream, "write_with_imm"))

    def send_async(self, local, offset: int = 0, length: Optional[int] = None) -> Future:
        return self._ep.send(*self._span("send", local, offset, length))

    def recv_async(self, local, offset: int = 0, length: Optional[int] = None) -> Future:
        return self._ep.recv(*self._span("recv", local, offset, length))

    def imm_recv_async(self) -> Future:
        return self._ep.imm_recv()

    # peer regions
    def remote_region(self, name: str, refresh: bool = True) -> RemoteHandle:
        """The handle of the region the peer registered as ``name``. If the peer's table (as
        of connect or the last refresh) has no such name and ``refresh`` is true, the table is
        refreshed once. Raises :class:`UnknownHandleError` if the peer has none."""
        if not isinstance(name, str):
            raise InvalidArgumentError(f"remote_region: name must be a str, got {_describe_value(name)}")
        h = self._ep.remote_region(name)
        if h is None and refresh:
            self._ep.refresh_remote_regions()
            h = self._ep.remote_region(name)
        if h is None:
            raise UnknownHandleError(f"the peer has no region named {name!r} "
                                     "(call refresh_remote_regions() after it registers one)")
        return RemoteHandle(h)

    def remote_regions(self) -> list:
        return self._ep.remote_regions()

    def refresh_remote_regions(self) -> None:
        self._ep.refresh_remote_regions()

    def import_region(self, descriptor: str) -> RemoteHandle:
        """The handle of a region the peer described with :meth:`Engine.region_descriptor`
        and handed over in-band (no directory round trip; kept across refreshes). The peer
        checks every access against its own registry, so a forged descriptor reaches nothing
        it did not register. Raises :class:`InvalidArgumentError` for a malformed descriptor
        or one of another engine."""
        if not isinstance(descriptor, str):
            raise InvalidArgumentError(f"import_region: descriptor must be a str, got {_describe_value(descriptor)}")
        return RemoteHandle(self._ep.import_region(descriptor))

    @property
    def transport(self) -> str:
        return self._ep.transport

    @property
    def channels(self) -> int:
        return self._ep.channels

    @property
    def peer_engine_id(self) -> str:
        return self._ep.peer_engine_id

    @property
    def connected(self) -> bool:
        return self._ep.connected

    def metrics(self) -> dict:
        """Counters of this endpoint's operations so far (docs/metrics.md): per kind
        (``ops["write"]["completed"]``, ``["failed"]``, ``["bytes"]``, ...), ``in_flight``,
        ``timeouts``, ``peer_lost``, ``reconnects``, thin-path ``posts``, and a ``latency``
        histogram."""
        return self._ep.metrics()

    def close(self) -> None:
        """Fail pending operations with :class:`CancelledError` and close the channels."""
        self._ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<sluice.Endpoint {self.transport} x{self.channels} peer={self.peer_engine_id}>"


# ---------------------------------------------------------------- engine


class _Region:
    __slots__ = ("obj", "pin", "length")

    def __init__(self, obj, pin, length):
        self.obj = obj
        self.pin = pin
        self.length = length


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3

_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _describe(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _option_text(key: str, value) -> str:
    """An option's value as the text its SLUICE_* variable would hold; the C++ parser checks it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    try:
        return str(operator.index(value))  # ints and numpy integers
    except TypeError:
        raise InvalidArgumentError(
            f"{key} must be a str, an integer or a bool, got {_describe_value(value)}") from None


def list_params() -> list:
    """Every engine parameter of this build: a list of dicts with ``name`` (the key for
    :class:`Engine` keyword options), ``env`` (its SLUICE_* variable), ``default``, ``doc`` and
    ``scope`` ("engine", "process": read from the variable where it is used, "test")."""
    return _sluice.list_params()


class Engine:
    """One transfer engine (normally one per process).

    ``transports``: names (list or "tcp,shm") this engine may use, default every one that runs
    here; ``channels``: channels per peer; ``listen``: "host:port" of the handshake listener
    (port 0 = any). ``connect_timeout`` and ``op_timeout`` are in seconds.

    Every other parameter of :func:`list_params` is a keyword option by its name, its value a
    str, int or bool parsed exactly as its SLUICE_* variable: ``busy_wait_us=0``,
    ``recv_timeout_ms=5000``, and per-transport options through a dict,
    ``Engine(**{"rdma.hca": "mlx5_0", "rdma.gid_index": 3})``. An unknown name is an
    InvalidArgumentError. SLUICE_* environment variables override them, as in C++.
    """

    def __init__(
        self,
        transports: Union[None, str, Sequence[str]] = None,
        channels: Optional[int] = None,
        listen: Optional[str] = None,
        *,
        host_id: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        op_timeout: Optional[float] = None,
        chunk_size: Optional[int] = None,
        stripe_threshold: Optional[int] = None,
        max_unexpected_bytes: Optional[int] = None,
        log_level: Optional[str] = None,
        **options,
    ):
        self._regions: dict = {}
        self._lock = threading.Lock()
        self._core = None
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        elif transports is not None:
            try:
                transports = list(transports)
            except TypeError:
                raise InvalidArgumentError(
                    f"transports must be a list of names or 'tcp,shm', got {_describe_value(transports)}") from None
            for t in transports:
                _opt_str(t, "transports: each name")
        if channels is not None:
            channels = _uint(channels, "channels", 31)
        for what, text in (("listen", listen), ("host_id", host_id), ("log_level", log_level)):
            _opt_str(text, what)
        connect_timeout = _seconds(connect_timeout, "connect_timeout", forever_ok=False)
        op_timeout = _seconds(op_timeout, "op_timeout", forever_ok=False)
        for what, n in (("chunk_size", chunk_size), ("stripe_threshold", stripe_threshold),
                        ("max_unexpected_bytes", max_unexpected_bytes)):
            if n is not None:
                _uint(n, what)
        params = {key: _option_text(key, value) for key, value in options.items()}
        named = {
            "transports": ",".join(transports) if transports else None, "channels": channels, "listen": listen,
            "host_id": host_id, "chunk_size": chunk_size, "stripe_threshold": stripe_threshold,
            "max_unexpected_bytes": max_unexpected_bytes, "log_level": log_level,
            "connect_timeout_ms": None if connect_timeout is None else int(connect_timeout * 1000),
            "op_timeout_ms": None if op_timeout is None else int(op_timeout * 1000),
        }
        for key, value in named.items():
            if value is None:
                continue
            if key in params:
                raise InvalidArgumentError(f"{key} is given twice")
            params[key] = _option_text(key, value)
        self._core = _sluice.Engine(params)
        _live_engines.add(self)

    # ------------------------------------------------------------ memory

    def register(self, obj, name: Optional[str] = None, location: Optional[str] = None) -> MemoryHandle:
        """Register memory and return its handle.

        ``obj`` may be a numpy array, a CPU torch tensor, anything with the (contiguous,
        writable) buffer protocol or ``__dlpack__``, or a ``(ptr, length)`` tuple of raw
        memory. The engine keeps ``obj`` alive until :meth:`unregister` or :meth:`close`.
        ``name`` lets peers find the region with ``Endpoint.remote_region(name)``.
        """
        core = self._need()
        name = _opt_str(name, "register: name")
        _opt_str(location, "register: location")
        pin = None
        keep = obj
        if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
            addr = _uint(obj[0], "register: the pointer of a (ptr, length) tuple")
            length = _uint(obj[1], "register: the length of a (ptr, length) tuple")
            keep = None
            loc = location or "host"
        elif _is_torch_tensor(obj):
            if not obj.is_contiguous():
                raise InvalidArgumentError("register: the tensor is not contiguous")
            addr, length = obj.data_ptr(), obj.numel() * obj.element_size()
            dev = obj.device
            loc = location or ("host" if dev.type == "cpu" else
                               f"cuda:{dev.index or 0}" if dev.type == "cuda" else dev.type)
        elif _has_buffer(obj):
            try:
                pin, addr, length, _ = _sluice.pin_buffer(obj, True)
            except InvalidArgumentError as e:
                try:
                    ro, *_ = _sluice.pin_buffer(obj, False)
                except InvalidArgumentError:
                    raise e from None
                ro.release()
                raise InvalidArgumentError(
                    f"register: the {_describe(obj)} buffer is read-only (peers may write into "
                    "registered memory); register a writable copy, or (ptr, length) if you are sure"
                ) from None
            loc = location or "host"
        elif hasattr(obj, "__dlpack__"):
            addr, length, dev_type, dev_id = _sluice.dlpack_info(obj.__dlpack__())
            if dev_type in (_DL_CPU, _DL_CUDA_HOST):
                loc = location or "host"
            elif dev_type == _DL_CUDA:
                loc = location or f"cuda:{dev_id}"
            else:
                raise UnsupportedError(f"register: DLPack device type {dev_type} is not supported")
        else:
            raise InvalidArgumentError(
                f"register: cannot register a {_describe(obj)}: pass a numpy array, a torch tensor, "
                "a buffer-protocol or DLPack object, or a (ptr, length) tuple")
        try:
            h = MemoryHandle(core.register_memory(addr, length, loc, name))
        except BaseException:
            if pin is not None:
                pin.release()
            raise
        with self._lock:
            self._regions[int(h)] = _Region(keep, pin, length)
        return h

    def unregister(self, handle) -> None:
        """Stop exposing a region (or free an :meth:`allocate` one). Blocks until operations
        already using it finish; then the engine drops its reference to the object."""
        core = self._need()
        h = _uint(handle, "unregister: handle")
        if core.is_allocation(h):
            core.free(h)
        else:
            core.unregister_memory(h)
        with self._lock:
            r = self._regions.pop(h, None)
        if r is not None and r.pin is not None:
            r.pin.release()

    free = unregister

    def allocate(self, length: int, name: Optional[str] = None, location: Optional[str] = None) -> Allocation:
        """Allocate registered, shareable (memfd) host memory, zero filled.
        Returns ``Allocation(buffer, handle)``; release it with :meth:`unregister`."""
        core = self._need()
        length = _uint(length, "allocate: length")
        name = _opt_str(name, "allocate: name")
        location = _opt_str(location, "allocate: location") or "host"
        h, size, mapping = core.allocate(length, location, name)
        try:
            import numpy as np

            buf = np.frombuffer(mapping, dtype=np.uint8)
        except ImportError:
            buf = memoryview(mapping)
        with self._lock:
            self._regions[h] = _Region(mapping, None, size)
        return Allocation(buf, MemoryHandle(h))

    def _length_of(self, handle: int) -> int:
        r = self._regions.get(handle)
        if r is None:
            raise UnknownHandleError(f"handle {int(handle)} is not registered with this engine")
        return r.length

    # ------------------------------------------------------------ peers

    def local_info(self) -> str:
        """JSON blob describing this engine (pass it to a peer's :meth:`connect`)."""
        return self._need().local_info()

    def region_descriptor(self, handle: int) -> str:
        """A registered region as a self-contained descriptor (a str) to hand to a connected
        peer, whose :meth:`Endpoint.import_region` makes it addressable there: for regions
        registered after the peer connected, without a directory round trip."""
        return self._need().region_descriptor(int(handle))

    @property
    def listen_address(self) -> str:
        """"host:port" of the handshake listener."""
        return self._need().listen_address()

    @property
    def transports(self) -> list:
        return self._need().transports()

    def metrics(self) -> list:
        """:meth:`Endpoint.metrics` of every open endpoint of this engine."""
        return self._need().metrics()

    def metrics_text(self) -> str:
        """The same counters in Prometheus text format, for a ``/metrics`` handler."""
        return self._need().metrics_text()

    def connect(self, blob_or_addr: str, transport: Optional[str] = None,
                timeout: Optional[float] = None, reconnect: bool = True) -> Endpoint:
        """Connect to a peer given its :meth:`local_info` blob, its "host:port" or its
        directory name.

        ``reconnect`` (default on): once the endpoint failed because its peer was lost or
        stopped answering, the next operation connects again to the same target first
        (operations pending at the failure still fail; a restarted peer's regions have new
        handles). ``False`` keeps a failed endpoint failed (docs/cluster.md)."""
        core = self._need()
        if not isinstance(blob_or_addr, str):
            raise InvalidArgumentError(
                f"connect: expected an info blob or 'host:port' str, got {_describe_value(blob_or_addr)}")
        transport = _opt_str(transport, "connect: transport")
        timeout = _seconds(timeout, "connect: timeout", forever_ok=False)
        if not isinstance(reconnect, bool):
            raise InvalidArgumentError(f"connect: reconnect must be a bool, got {_describe_value(reconnect)}")
        return Endpoint(core.connect(blob_or_addr, transport, timeout, reconnect), self)

    def accept(self, timeout: Optional[float] = None) -> Optional[Endpoint]:
        """The next endpoint a peer opened to us; ``None`` if none arrives within ``timeout``
        seconds (``None`` = wait forever)."""
        core = self._need()
        ep = core.accept(_seconds(timeout, "accept: timeout", forever_ok=True))
        return None if ep is None else Endpoint(ep, self)

    # ------------------------------------------------------------ lifetime

    def _need(self):
        core = self._core
        if core is None or core.closed:
            raise ClosedError("the engine is closed")
        return core

    @property
    def closed(self) -> bool:
        return self._core is None or self._core.closed

    def close(self) -> None:
        """Fail every pending operation with :class:`CancelledError`, close every endpoint,
        stop the threads and drop the registered objects. Idempotent."""
        core = self._core
        if core is None:
            return
        core.close()
        with self._lock:
            regions, self._regions = self._regions, {}
        for r in regions.values():
            if r.pin is not None:
                r.pin.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        core = getattr(self, "_core", None)
        if core is None or core.closed:
            return
        if isinstance(threading.current_thread(), threading._DummyThread):
            # Dropped on an engine thread (inside a completion callback): closing here would
            # join that very thread, so close from a helper thread instead.
            threading.Thread(target=self.close, daemon=True).start()
        else:
            self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<sluice.Engine closed>"
        return f"<sluice.Engine {self.listen_address} transports={self.transports}>"


def _is_torch_tensor(obj) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "element_size")


def _has_buffer(obj) -> bool:
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


@atexit.register
def _close_all() -> None:
    # Engine threads must not call into Python while the interpreter shuts down, and no
    # thread may be between releasing the GIL and retaking it when finalization starts
    # (CPython < 3.14 ends such a thread with a forced unwind: see python/src/gil.hpp).
    for e in list(_live_engines):
        try:
            e.close()
        except Exception:
            pass
    _sluice.quiesce_at_exit(2.0)


__all__ = [
    "get_include", "cmake_prefix_path", "Engine", "list_params", "Endpoint", "Future", "MemoryHandle", "RemoteHandle", "Allocation", "BATCH_DTYPE",
    "wait_all", "ErrorCode", "SluiceError", "InvalidArgumentError", "EmptyBatchError",
    "UnknownHandleError", "OutOfRangeError", "TruncatedError", "PeerLostError",
    "SluiceTimeoutError", "CancelledError", "RemoteError", "ProtocolError", "UnsupportedError",
    "NoDeviceError", "SystemCallError", "ClosedError", "InternalError",
]
