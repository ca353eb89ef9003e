"""Trainer side: expose named tensors once, publish versions through a metadata region."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import weakref
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

from .. import ClosedError, Endpoint, Engine, InvalidArgumentError
from . import _meta
from ._handles import unregister_all
from ._torch import dtype_name, nbytes, torch
from .errors import TensorMismatchError

log = logging.getLogger("sluice.weights")

NamedTensors = Union[Mapping[str, object], Iterable[Tuple[str, object]]]

_MIN_META = 4096
_SHARE_ALIGN = 256  # share(): each tensor's offset in its block (any dtype's alignment, and the GPU's)


class WeightPublisher:
    """Exposes a trainer's tensors to :class:`~sluice.weights.WeightSubscriber` s.

    ``register(named_tensors)`` registers each tensor (CPU or CUDA) once as a region of
    ``engine`` (the tensors stay owned by the caller; keep them alive and in place);
    ``share(named_tensors)`` copies them into shareable host memory instead, which receivers
    on this host read fastest (and their GPUs with the copy engine); ``publish(version)``
    declares the registered bytes to be ``version``. Receivers READ the tensors themselves,
    one-sided: the trainer's threads serve them, its Python code does nothing per update.

    Between publishes the trainer may change tensors only inside :meth:`updating` (or between
    :meth:`begin_update` and :meth:`publish`): a receiver that reads then fails with
    :class:`~sluice.weights.WeightsChangedError` instead of keeping mixed bytes.

    ``accept``: take the endpoints receivers open to ``engine`` (a thread that holds them;
    the engine keeps at most ``max_pending_accepts`` unaccepted ones). Pass False if your
    code already calls ``engine.accept()`` and holds what it returns.
    """

    def __init__(self, engine: Engine, name: str = "default", *, accept: bool = True):
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidArgumentError(f"WeightPublisher: name must be a non-empty str without '/', got {name!r}")
        self._engine = engine
        self._name = name
        self._lock = threading.Lock()
        self._infos: List[_meta.TensorInfo] = []
        self._tensors: Dict[str, object] = {}
        self._handles: List[int] = []  # register(): each tensor's own handle (0: shared or empty)
        self._locals: List[Tuple[int, int]] = []  # (handle, offset) of each tensor's bytes: push() writes from there
        self._versions: List[int] = []
        self._version = 0
        self._seq = 1  # odd: nothing published yet, receivers wait
        self._instance = secrets.randbits(63) | 1
        self._meta_buf = None
        self._meta_handle = None
        self._table: bytes = b""
        self._blocks: List[Tuple[object, int]] = []  # share(): (buffer, handle) of each block
        self._cuda_devices: set = set()  # devices of registered CUDA tensors (publish() syncs them)
        self._closed = False
        self._stop = threading.Event()
        self._accept_thread: Optional[threading.Thread] = None
        self._peers: List[Endpoint] = []  # what the accept thread holds: push() finds sinks there
        self._hellos = None  # push.Hellos, made by the first push()
        self._write_meta(new_table=True)
        if accept:
            self._accept_thread = threading.Thread(target=_accept_loop, args=(engine, self._stop, self._peers),
                                                   name=f"sluice-weights-accept-{name}", daemon=True)
            self._accept_thread.start()

    # ------------------------------------------------------------ registration

    def register(self, named_tensors: NamedTensors) -> None:
        """Register tensors (a dict or (name, tensor) pairs): contiguous CPU (pinned or not)
        or CUDA tensors of any dtype (fp8 included). A name registered before must be the same
        tensor (a no-op); new names extend the published table. Registration is done once;
        publish() reuses the regions. For receivers on this host, :meth:`share` is faster
        for CPU weights."""
        new = self._check_new("register", named_tensors, copying=False)
        if not new:
            return
        with self._lock:
            self._need_open()
            base = len(self._infos)
            try:
                for name, tensor in new:
                    size = nbytes(tensor)
                    region = _meta.tensor_region_name(self._name, len(self._infos)) if size else None
                    handle = self._engine.register(tensor, name=region) if size else 0
                    self._add(name, tensor, region, 0, handle)
            except BaseException:
                self._drop_from(base)
                raise
            self._write_meta(new_table=True)

    def share(self, named_tensors: NamedTensors) -> Dict[str, object]:
        """Copy tensors (CPU or CUDA, any dtype, contiguous or not) into one block of
        shareable host memory that the engine allocates (a memfd), register them there, and
        return the copies by name: the trainer updates those in place from then on (inside
        :meth:`updating`), and they stay valid while it holds them.

        Why: a receiver on this host maps the block instead of reading the trainer's memory
        with process_vm_readv, and its GPU copies straight out of the mapping with the copy
        engine (page-locked once on the receiver's side: pinned host-to-device speed, no
        staging). Across hosts the block is ordinary registered memory. Names already
        registered or shared are refused."""
        t = torch()
        new = self._check_new("share", named_tensors, copying=True)
        if not new:
            return {}
        offsets, total = [], 0
        for _, tensor in new:
            total = (total + _SHARE_ALIGN - 1) // _SHARE_ALIGN * _SHARE_ALIGN
            offsets.append(total)
            total += nbytes(tensor)
        with self._lock:
            self._need_open()
            base = len(self._infos)
            region = _meta.tensor_region_name(self._name, base)
            buf, handle = self._engine.allocate(max(total, 1), name=region)
            block = t.from_numpy(buf)
            out: Dict[str, object] = {}
            try:
                for (name, tensor), off in zip(new, offsets):
                    size = nbytes(tensor)
                    view = block[off:off + size].view(tensor.dtype).view(tensor.shape)
                    view.copy_(tensor)
                    self._add(name, view, region if size else None, off if size else 0, 0, local=handle)
                    out[name] = view
            except BaseException:
                self._drop_from(base)
                self._engine.unregister(handle)
                raise
            self._blocks.append((buf, handle))
            self._write_meta(new_table=True)
        return out

    def _check_new(self, what: str, named_tensors: NamedTensors, *, copying: bool) -> List[Tuple[str, object]]:
        t = torch()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        new: List[Tuple[str, object]] = []
        seen = set()
        for name, tensor in items:
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"{what}: tensor names must be non-empty str, got {name!r}")
            if name in seen:
                raise InvalidArgumentError(f"{what}: tensor {name!r} is given twice")
            seen.add(name)
            if not isinstance(tensor, t.Tensor):
                raise InvalidArgumentError(f"{what}: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if tensor.device.type not in ("cpu", "cuda"):
                raise TensorMismatchError(f"{what}: tensor {name!r} is on {tensor.device}; CPU and CUDA tensors "
                                          "are published")
            if copying:
                if name in self._tensors:
                    raise TensorMismatchError(f"{what}: tensor {name!r} is already published")
                new.append((name, tensor))
                continue
            if not tensor.is_contiguous():
                raise TensorMismatchError(f"{what}: tensor {name!r} is not contiguous (call .contiguous() "
                                          "and register the result, which you then update in place)")
            old = self._tensors.get(name)
            if old is not None:
                if (old.data_ptr(), old.dtype, tuple(old.shape)) != (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)):
                    raise TensorMismatchError(f"register: tensor {name!r} is already registered as a different "
                                              "tensor (update it in place instead)")
                continue
            new.append((name, tensor))
        return new

    def _add(self, name: str, tensor, region: Optional[str], offset: int, handle: int,
             local: Optional[int] = None) -> None:
        self._handles.append(handle)
        self._locals.append((handle if local is None else local, offset))
        self._infos.append(_meta.TensorInfo(name, dtype_name(tensor), tuple(int(d) for d in tensor.shape),
                                            nbytes(tensor), region, offset))
        self._tensors[name] = tensor
        self._versions.append(0)
        if tensor.device.type == "cuda":
            self._cuda_devices.add(tensor.device.index or 0)

    def _drop_from(self, base: int) -> None:
        """Undo the _add()s from index ``base`` on (a register/share that failed midway)."""
        for h in self._handles[base:]:
            if h:
                self._engine.unregister(h)
        for info in self._infos[base:]:
            self._tensors.pop(info.name, None)
        del self._infos[base:], self._handles[base:], self._versions[base:], self._locals[base:]
        t = torch()
        self._cuda_devices = {x.device.index or 0 for x in self._tensors.values()
                              if isinstance(x, t.Tensor) and x.device.type == "cuda"}

    # ------------------------------------------------------------ versions

    def begin_update(self) -> None:
        """The trainer is about to change registered tensors: receivers that read now see
        :class:`~sluice.weights.WeightsChangedError` (or wait, if they start now) until the
        next :meth:`publish`."""
        with self._lock:
            self._need_open()
            if self._seq % 2 == 0:
                self._seq += 1
                _meta.set_seq(self._meta_buf, self._seq)

    def publish(self, version: int, names: Optional[Iterable[str]] = None) -> None:
        """Declare the registered bytes to be ``version`` (an int that grows). ``names``: only
        these tensors changed (receivers pull only them); None: all did."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0 or version >> 64:
            raise InvalidArgumentError(f"publish: version must be an int in [0, 2**64), got {version!r}")
        with self._lock:
            self._need_open()
            if version < self._version:
                raise InvalidArgumentError(f"publish: version {version} is older than the published {self._version}")
            if names is None:
                self._versions = [version] * len(self._infos)
            else:
                index = {t.name: i for i, t in enumerate(self._infos)}
                picked = []
                for n in names:
                    if n not in index:
                        raise TensorMismatchError(f"publish: no tensor named {n!r} is registered")
                    picked.append(index[n])
                for i in picked:
                    self._versions[i] = version
            # CUDA tensors: the kernels that changed them (on each device's current stream)
            # must be done before receivers may read.
            if self._cuda_devices:
                t = torch()
                for d in sorted(self._cuda_devices):
                    t.cuda.current_stream(d).synchronize()
            self._version = version
            self._seq += 2 if self._seq % 2 == 0 else 1
            self._write_meta(new_table=False)

    @contextlib.contextmanager
    def updating(self, version: int, names: Optional[Iterable[str]] = None) -> Iterator[None]:
        """``with pub.updating(v): optimizer.step()``: begin_update(), then publish(v, names)
        if the block succeeds (if it raises, the tensors stay marked as changing)."""
        self.begin_update()
        yield
        self.publish(version, names)

    # ------------------------------------------------------------ push

    def push(self, *, timeout: float = 60.0, expect: int = 0, ranks: Optional[Iterable[int]] = None,
             depth: int = 2, endpoints: Optional[Iterable[Endpoint]] = None):
        """Write the published tensors into every :class:`~sluice.weights.WeightSink` connected
        to this trainer (their ``receive()`` armed them; those not armed yet are waited for),
        each bucket a write-with-immediate the sink's callback runs on. Only the tensors whose
        version a sink does not hold are written. ``expect``: wait until that many sinks
        connected; ``ranks``: only sinks with these ranks; ``depth``: buckets in flight per
        sink; ``endpoints``: the endpoints to look for sinks on (default: those the accept
        thread holds; a sink's first message on its endpoint is a hello that push() may
        receive: keep your own send/recv off them). Returns a
        :class:`~sluice.weights.PushResult`: a sink that died, stalled or never armed fails
        alone (its ``error`` says why, its ``rank`` names it) within ``timeout``; nothing
        raises for it. Call after :meth:`publish` (not inside
        :meth:`updating`); register, publish and begin_update wait until the push ends."""
        from .push import Hellos, PushState, push
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise InvalidArgumentError(f"push: timeout must be a number of seconds > 0, got {timeout!r}")
        for what, v, low in (("expect", expect, 0), ("depth", depth, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidArgumentError(f"push: {what} must be an int >= {low}, got {v!r}")
        rank_set = None
        if ranks is not None:
            rank_set = set(ranks)
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rank_set):
                raise InvalidArgumentError(f"push: ranks must be ints >= 0, got {sorted(rank_set, key=str)!r}")
        if endpoints is None:
            if self._accept_thread is None:
                raise InvalidArgumentError("push: this publisher does not accept endpoints (accept=False): pass "
                                           "endpoints=[...] (the ones your code accepted)")
            eps, more = list(self._peers), (lambda: list(self._peers))
        else:
            eps, more = list(endpoints), None
            if not all(isinstance(e, Endpoint) for e in eps):
                raise InvalidArgumentError("push: endpoints must be sluice.Endpoint objects")
        with self._lock:
            self._need_open()
            if self._seq % 2:
                raise InvalidArgumentError(f"push: publisher {self._name!r} has nothing published to push "
                                           "(call publish() first; not between begin_update() and publish())")
            state = PushState(self._name, self._instance, self._seq, self._version,
                              tuple(t.name for t in self._infos), tuple(t.nbytes for t in self._infos),
                              tuple(self._versions), tuple(self._locals))
            if self._hellos is None:
                self._hellos = Hellos(self._engine)
            return push(self._engine, state, eps, timeout=float(timeout), expect=expect, ranks=rank_set,
                        depth=depth, hellos=self._hellos, more=more)

    @property
    def version(self) -> int:
        return self._version

    @property
    def name(self) -> str:
        return self._name

    def names(self) -> List[str]:
        return [t.name for t in self._infos]

    # ------------------------------------------------------------ metadata region

    def _write_meta(self, *, new_table: bool) -> None:
        if new_table:
            self._table = _meta.encode_table(self._name, self._infos)
        need = _meta.region_size(len(self._infos), len(self._table))
        if self._meta_buf is None or need > len(self._meta_buf):
            # Grow with slack so that a few more register() calls keep the region: receivers
            # re-find a replaced one by name, but meanwhile they wait.
            size = max(_MIN_META, 2 * need)
            if self._meta_handle is not None:
                self._engine.unregister(self._meta_handle)
                self._meta_handle = None
            buf, handle = self._engine.allocate(size, name=_meta.meta_region_name(self._name))
            self._meta_buf, self._meta_handle = buf, handle
            new_table = True
        _meta.write(self._meta_buf, seq=self._seq, version=self._version, instance=self._instance,
                    versions=self._versions, table=self._table if new_table else None)

    # ------------------------------------------------------------ lifetime

    def _need_open(self) -> None:
        if self._closed:
            raise ClosedError(f"WeightPublisher {self._name!r} is closed")

    def close(self) -> None:
        """Stop publishing: unregister the metadata region and the tensors (receivers
        reading then fail). Idempotent; the engine stays open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            handles = ([h for h in self._handles if h] + [h for _, h in self._blocks] +
                       ([self._meta_handle] if self._meta_handle else []))
            self._handles, self._meta_handle = [], None
            # The blocks' buffers stay mapped while the caller holds the tensors share() returned.
            self._blocks = []
        unregister_all(self._engine, handles)

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<WeightPublisher {self._name!r} tensors={len(self._infos)} version={self._version}>"


def _accept_loop(engine: Engine, stop: threading.Event, held: Optional[List[Endpoint]] = None) -> None:
    """Holds the endpoints receivers open (dropping one would close it), forgetting those
    whose peer went away. One thread per publisher, whatever the number of receivers.
    ``held``: the list to keep them in (the publisher's, which push() reads)."""
    if held is None:
        held = []
    ref = weakref.ref(engine)
    del engine
    while not stop.is_set():
        e = ref()
        if e is None or e.closed:
            return
        try:
            ep = e.accept(timeout=0.5)
        except ClosedError:
            return
        except Exception as err:  # noqa: BLE001 - keep serving the other receivers
            log.warning("sluice.weights: accepting a receiver's endpoint failed: %s", err)
            continue
        finally:
            del e
        held[:] = [h for h in held if h.connected]
        if ep is not None:
            held.append(ep)
