"""A Mooncake-compatible ``TransferEngine`` on Sluice.

``sluice.compat.mooncake.TransferEngine`` has the Python API of Mooncake's
``mooncake.engine.TransferEngine`` (``mooncake-integration/transfer_engine/transfer_engine_py.cpp``)
with its conventions, so that checkpoint-engine, vLLM's ``MooncakeConnector``, verl and SGLang
run on Sluice unchanged:

* integer returns: 0 is success, a negative Mooncake error code a failure (-1 for a failed
  transfer); an async submit returns a batch id, 0 on failure. A transfer call never raises;
  the reason of a failure is logged (logger ``sluice.compat.mooncake``).
* remote memory is named by the PEER's raw virtual addresses; ``target`` is ``"ip:port"``
  from the peer's ``get_rpc_port()``. Each range is resolved to the one region the peer
  registered that covers it; a range no region covers fails (-1) and nothing is transferred.
* ``initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)``: ``protocol`` and
  ``device_name`` are hints. Sluice picks the transport per peer (shm or nvlink on one host,
  rdma where both have a device, tcp otherwise) and logs the choice; a host without an RDMA
  device still initialises.
* the GIL is released while a call waits for the network.

``import mooncake.engine`` gives this module when ``SLUICE_MOONCAKE_COMPAT=1`` (an import hook
installed with the wheel) or after :func:`install`. See docs/mooncake-compat.md.
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import operator
import os
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import sluice

from . import _cuda_pointer
from ._hook import install, uninstall
from ._regions import RangeTable, Region, remote_table

log = logging.getLogger("sluice.compat.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's return codes (mooncake-transfer-engine/include/error.h), the ones this facade gives.
OK = 0
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102

_NOTIFY_BYTES = 64 * 1024  # largest notify message (name + msg), per endpoint buffer
_GiB_PER_S = 1 << 30       # Mooncake's deadline allows 1 ns per byte on top of its timeout


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent with a transfer (``transfer_sync(..., notify=...)``) and returned by
    the peer's ``get_notifies()``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)


class _Fail(Exception):
    """A failure whose message is the logged reason; ``code`` is the value returned."""

    def __init__(self, message: str, code: int = ERR_INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def _int(value, what: str) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise _Fail(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None
    if v < 0 or v >> 64:
        raise _Fail(f"{what} must be in [0, 2**64), got {v}")
    return v


def _ints(values, what: str) -> List[int]:
    try:
        seq = list(values)
    except TypeError:
        raise _Fail(f"{what} must be a list of integers, got {type(values).__name__}") from None
    return [_int(v, f"{what}[{i}]") for i, v in enumerate(seq)]


def _split_host(local_hostname: str) -> str:
    """The host part of Mooncake's ``local_hostname`` ("host", "host:port", "[v6]:port").
    With P2PHANDSHAKE Mooncake ignores the port and picks a free one, and so do we."""
    h = local_hostname.strip()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def _parse_target(target) -> str:
    if not isinstance(target, str) or not target.strip():
        raise _Fail(f"target must be the peer's 'ip:port' (its get_rpc_port()), got {target!r}")
    t = target.strip().lstrip("/")
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _Fail(f"target {target!r} is not 'ip:port' (the port is the peer's get_rpc_port())")
    return t


def _mc_timeout_s() -> float:
    """MC_TRANSFER_TIMEOUT as Mooncake reads it: seconds, at least 5, default 30."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if not raw:
        return 30.0
    try:
        return float(max(5, int(raw)))
    except ValueError:
        log.warning("MC_TRANSFER_TIMEOUT=%r is not an integer; using 30 s", raw)
        return 30.0


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (a socket can bind to it)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


class _Peer:
    """One target: its endpoint and its region table (refreshed when a lookup misses)."""

    __slots__ = ("target", "ep", "table", "lock")

    def __init__(self, target: str, ep: sluice.Endpoint):
        self.target = target
        self.ep = ep
        self.lock = threading.Lock()
        self.table = remote_table(ep.remote_regions())

    def resolve(self, addr: int, length: int) -> Tuple[int, int]:
        with self.lock:
            hit = self.table.find(addr, length)
            if hit is None:
                # The peer may have registered the region after we connected: refresh once.
                self.ep.refresh_remote_regions()
                self.table = remote_table(self.ep.remote_regions())
                hit = self.table.find(addr, length)
            if hit is None:
                raise _Fail(f"no region registered by {self.target} covers [{addr:#x}, {addr + length:#x}) "
                            f"({length} bytes); it has {self.table.describe()}")
            region, off = hit
            return region.handle, off


class _Batch:
    __slots__ = ("future", "deadline", "target", "bytes")

    def __init__(self, future, deadline: float, target: str, nbytes: int):
        self.future = future
        self.deadline = deadline
        self.target = target
        self.bytes = nbytes


class _Inbox:
    """Notifications arriving on endpoints peers opened to us: one posted recv per endpoint
    into its own registered buffer; ``get_notifies`` collects the completed ones."""

    __slots__ = ("ep", "buf", "handle", "pending")

    def __init__(self, engine: sluice.Engine, ep: sluice.Endpoint):
        import numpy as np

        self.ep = ep
        self.buf = np.zeros(_NOTIFY_BYTES, dtype=np.uint8)
        self.handle = engine.register(self.buf)
        self.pending = ep.recv(self.handle, 0, _NOTIFY_BYTES)


def _encode_notify(n: TransferNotify) -> bytes:
    name = str(n.name).encode()
    return len(name).to_bytes(4, "little") + name + str(n.msg).encode()


def _decode_notify(raw: bytes) -> TransferNotify:
    k = int.from_bytes(raw[:4], "little")
    return TransferNotify(raw[4:4 + k].decode(errors="replace"), raw[4 + k:].decode(errors="replace"))


class TransferEngine:
    """Mooncake's ``TransferEngine`` API on a Sluice engine. See the module docstring."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._engine: Optional[sluice.Engine] = None
        self._lock = threading.RLock()          # tables below
        self._local = RangeTable()
        self._managed: Dict[int, object] = {}   # allocate_managed_buffer: addr -> buffer
        self._peers: Dict[str, _Peer] = {}
        self._connecting: Dict[str, threading.Lock] = {}
        self._batches: Dict[int, _Batch] = {}
        self._next_batch = 1
        self._inboxes: List[_Inbox] = []
        self._notify_lock = threading.Lock()    # the send buffer below
        self._notify_rx_lock = threading.Lock()
        self._notify_buf = None
        self._notify_handle = 0
        self._accept_thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._timeout_s = _mc_timeout_s()
        self._self_hosts: Dict[str, bool] = {}  # target host -> whether it is an address of this host

    # ------------------------------------------------------------ set-up

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str = "rdma",
                   device_name: str = "") -> int:
        """Start the engine. Only ``metadata_server="P2PHANDSHAKE"`` is served: peers are
        found by ``"ip:port"`` alone. ``protocol`` ("rdma", "tcp", "efa", ...) and
        ``device_name`` (a device, a comma list, or NCCL_IB_HCA syntax) are hints."""
        return self._call("initialize", self._initialize, local_hostname, metadata_server, protocol, device_name)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        if metadata_server == P2PHANDSHAKE or not metadata_type:
            return self.initialize(local_hostname, metadata_server, protocol, device_name)
        return self.initialize(local_hostname, f"{metadata_type}://{metadata_server}", protocol, device_name)

    def _initialize(self, local_hostname, metadata_server, protocol, device_name) -> int:
        if self._engine is not None:
            raise _Fail("initialize: this TransferEngine is already initialised")
        if not isinstance(local_hostname, str):
            raise _Fail(f"initialize: local_hostname must be a str, got {local_hostname!r}")
        if metadata_server != P2PHANDSHAKE:
            raise _Fail(f"initialize: metadata server {metadata_server!r} is not supported by the Sluice facade; "
                        f"use {P2PHANDSHAKE!r} (peers are addressed as 'ip:port' from get_rpc_port())")
        protocol = protocol or ""
        device_name = device_name or ""
        host = _split_host(local_hostname) or "127.0.0.1"
        options = {"listen": f"{host}:0", "op_timeout": self._timeout_s,
                   # recv is used only for notifications, which may come at any time.
                   "recv_timeout_ms": 0}
        engine = None
        if device_name:
            try:
                engine = sluice.Engine(**options, **{"rdma.hca": device_name})
            except sluice.SluiceError as e:
                log.warning("initialize: device_name %r not usable for rdma (%s); using every transport "
                            "this host runs", device_name, e)
        if engine is None:
            engine = sluice.Engine(**options)
        self._engine = engine
        transports = engine.transports
        rdma = "rdma" in transports
        choice = ("shm/nvlink to peers on this host, " if any(t in transports for t in ("shm", "nvlink")) else "") + \
                 ("rdma to peers with a device, " if rdma else "") + "tcp otherwise"
        if protocol in ("rdma", "efa") and not rdma:  # checkpoint-engine issue #1: go on without
            log.warning("initialize: protocol %r asked but no usable RDMA device here; this engine (rpc %s) "
                        "runs %s: %s", protocol, engine.listen_address, ",".join(transports), choice)
        else:
            log.info("initialize: protocol %r device %r asked; this engine (rpc %s) runs %s: %s",
                     protocol, device_name, engine.listen_address, ",".join(transports), choice)
        self._stop.clear()
        # The thread holds a weak reference: dropping the TransferEngine (as Mooncake's users
        # do instead of closing it) still closes the engine, through __del__.
        self._accept_thread = threading.Thread(target=_accept_loop, args=(weakref.ref(self), engine, self._stop),
                                               name="sluice-mooncake-accept", daemon=True)
        self._accept_thread.start()
        return OK

    def get_rpc_port(self) -> int:
        """The port peers use in their ``target`` ("ip:port"); -1 before initialize."""
        engine = self._engine
        if engine is None or engine.closed:
            log.error("get_rpc_port: the engine is not initialised")
            return -1
        return int(engine.listen_address.rsplit(":", 1)[1])

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """JSON of what this host offers Sluice (its transports); not Mooncake's HCA matrix."""
        engine = self._engine
        return json.dumps({"engine": "sluice", "transports": engine.transports if engine else []})

    def close(self) -> None:
        """Stop the engine (Mooncake does this when the object is destroyed)."""
        self._stop.set()
        t = self._accept_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        with self._lock:
            self._peers.clear()
            self._inboxes.clear()
            self._batches.clear()
            self._local = RangeTable()
            self._managed.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ memory

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        return self._call("register_memory", self._register, [(buffer_addr, capacity)], location)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        def run():
            addrs = _ints(buffer_addresses, "batch_register_memory: buffer_addresses")
            caps = _ints(capacities, "batch_register_memory: capacities")
            if len(addrs) != len(caps):
                raise _Fail(f"batch_register_memory: {len(addrs)} addresses but {len(caps)} capacities")
            return self._register(list(zip(addrs, caps)), location)

        return self._call("batch_register_memory", run)

    def _register(self, spans, location) -> int:
        engine = self._need()
        spans = [(_int(a, "buffer address"), _int(c, "capacity")) for a, c in spans]
        for a, c in spans:
            if c == 0:
                raise _Fail(f"register_memory: zero-length region at {a:#x}")
        with self._lock:
            # Overlaps with what is registered and within the batch: nothing is registered then.
            staged = RangeTable(self._local)
            for a, c in spans:
                other = staged.overlaps(a, c)
                if other is not None:
                    raise _Fail(f"register_memory: [{a:#x}, {a + c:#x}) overlaps the registered region "
                                f"[{other.base:#x}, {other.base + other.length:#x})", ERR_ADDRESS_OVERLAPPED)
                staged.add(Region(a, c, 0, ""))
            done: List[Region] = []
            try:
                for a, c in spans:
                    loc = self._location(a, location)
                    h = engine.register((a, c), location=loc)
                    done.append(Region(a, c, int(h), loc))
            except BaseException:
                for r in done:
                    engine.unregister(r.handle)
                raise
            for r in done:
                self._local.add(r)
        return OK

    @staticmethod
    def _location(addr: int, location) -> str:
        text = str(location or "*").strip().lower()
        if text.startswith("cuda"):
            return text if ":" in text else "cuda:0"
        if text not in ("*", "") and not text.startswith("cpu"):
            log.warning("register_memory: location %r is not cpu:N / cuda:N / '*'; finding out from the pointer",
                        location)
        return _cuda_pointer.location_of(addr)

    def unregister_memory(self, buffer_addr: int) -> int:
        return self._call("unregister_memory", self._unregister, [buffer_addr])

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        return self._call("batch_unregister_memory",
                          lambda: self._unregister(_ints(buffer_addresses, "batch_unregister_memory: buffer_addresses")))

    def _unregister(self, addrs) -> int:
        engine = self._need()
        addrs = [_int(a, "buffer address") for a in addrs]
        with self._lock:
            regions = []
            for a in addrs:
                r = self._local.at(a)
                if r is None:
                    raise _Fail(f"unregister_memory: no region is registered at {a:#x} "
                                "(give the address register_memory was given)", ERR_ADDRESS_NOT_REGISTERED)
                regions.append(r)
            for r in regions:
                self._local.remove(r.base)
        # Blocks (GIL released) until operations using a region finished.
        first: Optional[Exception] = None
        for r in regions:
            try:
                engine.unregister(r.handle)
            except sluice.SluiceError as e:
                first = first or e
        if first is not None:
            raise _Fail(f"unregister_memory: {first}")
        return OK

    def allocate_managed_buffer(self, length: int) -> int:
        """Registered host memory owned by the engine; its address, 0 on failure."""
        def run():
            engine = self._need()
            n = _int(length, "allocate_managed_buffer: length")
            if n == 0:
                raise _Fail("allocate_managed_buffer: zero length")
            buf, h = engine.allocate(n)
            addr = buf.ctypes.data
            with self._lock:
                self._local.add(Region(addr, n, int(h), "host"))
                self._managed[addr] = buf
            return addr

        return self._call("allocate_managed_buffer", run, fail=0)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        def run():
            a = _int(buffer_addr, "free_managed_buffer: address")
            with self._lock:
                if a not in self._managed:
                    raise _Fail(f"free_managed_buffer: {a:#x} is not from allocate_managed_buffer")
            self._unregister([a])
            with self._lock:
                self._managed.pop(a, None)
            return OK

        return self._call("free_managed_buffer", run)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        ctypes.memmove(dest_address, bytes(src_ptr), length)
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        return ctypes.string_at(source_address, length)

    # ------------------------------------------------------------ transfers

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, TransferOpcode.Write)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, TransferOpcode.Read)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode=TransferOpcode.Write, notify: Optional[TransferNotify] = None,
                      transport_hint: str = "") -> int:
        return self._call("transfer_sync", self._sync, target_hostname, [buffer], [peer_buffer_address], [length],
                          opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                                  transport_hint: str = "") -> int:
        return self._call("batch_transfer_sync_write", self._sync, target_hostname, buffers, peer_buffer_addresses,
                          lengths, TransferOpcode.Write, None)

    def batch_transfer_sync_read(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                                 transport_hint: str = "") -> int:
        return self._call("batch_transfer_sync_read", self._sync, target_hostname, buffers, peer_buffer_addresses,
                          lengths, TransferOpcode.Read, None)

    def batch_transfer_sync(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                            opcode=TransferOpcode.Write, notify: Optional[TransferNotify] = None,
                            transport_hint: str = "") -> int:
        return self._call("batch_transfer_sync", self._sync, target_hostname, buffers, peer_buffer_addresses,
                          lengths, opcode, notify)

    def batch_transfer_async_write(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                                   transport_hint: str = "") -> int:
        return self._call("batch_transfer_async_write", self._async, target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Write, fail=0)

    def batch_transfer_async_read(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                                  transport_hint: str = "") -> int:
        return self._call("batch_transfer_async_read", self._async, target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Read, fail=0)

    def batch_transfer_async(self, target_hostname: str, buffers, peer_buffer_addresses, lengths,
                             opcode=TransferOpcode.Write, transport_hint: str = "") -> int:
        return self._call("batch_transfer_async", self._async, target_hostname, buffers, peer_buffer_addresses,
                          lengths, opcode, fail=0)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        return self._call("transfer_submit_write", self._async, target_hostname, [buffer], [peer_buffer_address],
                          [length], TransferOpcode.Write, fail=0)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch; 0 if all succeeded, -1 if any failed, timed out or is unknown.
        The ids are used up either way (as Mooncake frees them)."""
        return self._call("get_batch_transfer_status", self._status, batch_ids)

    def transfer_check_status(self, batch_id: int) -> int:
        """Without waiting: 1 done, 0 in flight, -1 failed (or unknown), -2 past its deadline."""
        def run():
            bid = _int(batch_id, "transfer_check_status: batch id")
            with self._lock:
                b = self._batches.get(bid)
            if b is None:
                raise _Fail(f"transfer_check_status: unknown batch id {bid}")
            if not b.future.done():
                return -2 if time.monotonic() > b.deadline else 0
            with self._lock:
                self._batches.pop(bid, None)
            try:
                b.future.wait()
            except sluice.SluiceError as e:
                raise _Fail(f"transfer to {b.target} failed: {e}")
            return 1

        return self._call("transfer_check_status", run)

    def get_notifies(self) -> List[TransferNotify]:
        """Notifications peers sent with ``transfer_sync(..., notify=...)`` since the last call."""
        with self._notify_rx_lock:  # one collector at a time: a box's buffer is reused per message
            return self._collect_notifies()

    def _collect_notifies(self) -> List[TransferNotify]:
        out: List[TransferNotify] = []
        with self._lock:
            inboxes = list(self._inboxes)
        for box in inboxes:
            try:
                while box.pending.done():
                    fut = box.pending
                    try:
                        fut.wait()
                    except sluice.SluiceError:  # the endpoint closed: no more from it
                        with self._lock:
                            if box in self._inboxes:
                                self._inboxes.remove(box)
                        break
                    out.append(_decode_notify(bytes(box.buf[:fut.bytes])))
                    box.pending = box.ep.recv(box.handle, 0, _NOTIFY_BYTES)
            except sluice.SluiceError as e:
                log.warning("get_notifies: dropping an endpoint: %s", e)
                with self._lock:
                    if box in self._inboxes:
                        self._inboxes.remove(box)
        return out

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer answers at ``"ip:port"``, else non-zero (-102 when unreachable)."""
        def run():
            target = _parse_target(peer_server_name)
            peer = self._peer(target, probe=True)
            try:
                peer.ep.refresh_remote_regions()  # a round trip to the peer's listener
            except sluice.SluiceError as e:
                self._drop(peer)
                raise _Fail(f"send_probe: {target} does not answer: {e}", ERR_SOCKET)
            return OK

        return self._call("send_probe", run)

    def get_engine(self):
        raise NotImplementedError("get_engine(): the Sluice facade has no Mooncake C++ TransferEngine to hand out "
                                  "(Mooncake Store and EP need Mooncake itself)")

    def get_engine_ptr(self):
        raise NotImplementedError("get_engine_ptr(): the Sluice facade has no Mooncake C++ TransferEngine")

    # ------------------------------------------------------------ internals

    def _call(self, what: str, fn, *args, fail: int = -1):
        """Mooncake's convention: an int, never an exception (KeyboardInterrupt passes)."""
        try:
            return fn(*args)
        except _Fail as e:
            log.error("%s: %s", what, e)
            return fail if e.code == ERR_INVALID_ARGUMENT or fail == 0 else e.code
        except Exception as e:  # noqa: BLE001 - the API returns codes, and says why in the log
            log.error("%s failed: %s: %s", what, type(e).__name__, e)
            return fail

    def _need(self) -> sluice.Engine:
        engine = self._engine
        if engine is None or engine.closed:
            raise _Fail("the engine is not initialised (call initialize() first)")
        return engine

    def _peer(self, target: str, probe: bool = False) -> _Peer:
        engine = self._need()
        with self._lock:
            peer = self._peers.get(target)
            if peer is not None and peer.ep.connected:
                return peer
            gate = self._connecting.setdefault(target, threading.Lock())
        with gate:  # one connect per target; other threads wait for it
            with self._lock:
                peer = self._peers.get(target)
                if peer is not None and peer.ep.connected:
                    return peer
            try:
                # Reconnection is _drop()'s (a new _Peer, its handles looked up again), not
                # the endpoint's.
                ep = engine.connect(target, reconnect=False)
            except sluice.SluiceError as e:
                raise _Fail(f"cannot reach {target}: {e}", ERR_SOCKET if probe else ERR_INVALID_ARGUMENT)
            peer = _Peer(target, ep)
            log.info("connected to %s over %s", target, ep.transport)
            with self._lock:
                self._peers[target] = peer
            return peer

    def _drop(self, peer: _Peer) -> None:
        """Forget a peer whose endpoint failed, so that the next call reconnects (a restarted
        peer at the same address)."""
        with self._lock:
            if self._peers.get(peer.target) is peer:
                del self._peers[peer.target]
        try:
            peer.ep.close()
        except sluice.SluiceError:
            pass

    def _plan(self, target_hostname, buffers, peer_addresses, lengths, opcode):
        """Check and resolve a request: (peer, sluice batch, total bytes, is_write)."""
        self._need()
        op = TransferOpcode(int(opcode)) if not isinstance(opcode, TransferOpcode) else opcode
        bufs = _ints(buffers, "buffers")
        peers = _ints(peer_addresses, "peer_buffer_addresses")
        lens = _ints(lengths, "lengths")
        if not (len(bufs) == len(peers) == len(lens)):
            raise _Fail(f"buffers, peer_buffer_addresses and lengths have different sizes "
                        f"({len(bufs)}, {len(peers)}, {len(lens)})")
        target = _parse_target(target_hostname)
        batch = []
        with self._lock:
            for i, (b, p, n) in enumerate(zip(bufs, peers, lens)):
                if n == 0:
                    continue  # nothing to move (Mooncake accepts these too)
                hit = self._local.find(b, n)
                if hit is None:
                    raise _Fail(f"entry {i}: local buffer [{b:#x}, {b + n:#x}) is not inside one region registered "
                                f"with register_memory (this engine has {self._local.describe()})")
                batch.append([hit[0].handle, hit[1], 0, p, n])
        if self._is_self(target):
            return None, self._self_pieces(target, bufs, peers, lens), sum(lens), op == TransferOpcode.Write
        peer = self._peer(target)
        for entry in batch:  # the peer's raw address -> (its region id, offset)
            entry[2], entry[3] = peer.resolve(entry[3], entry[4])
        return peer, [tuple(e) for e in batch], sum(lens), op == TransferOpcode.Write

    def _submit(self, peer: _Peer, batch, is_write: bool):
        try:
            return peer.ep.write(batch) if is_write else peer.ep.read(batch)
        except sluice.SluiceError as e:
            if not peer.ep.connected:
                self._drop(peer)
            raise _Fail(f"{'write to' if is_write else 'read from'} {peer.target} refused: {e}")

    def _deadline(self, nbytes: int) -> float:
        # Mooncake's bound: MC_TRANSFER_TIMEOUT plus 1 ns per byte. Sluice fails an op whose
        # peer makes no progress for op_timeout (set to the same value) first; this is the
        # last guard, a little later, so the engine's own error is what the log shows.
        return time.monotonic() + self._timeout_s + nbytes / _GiB_PER_S + 5.0

    def _wait(self, peer: _Peer, future, deadline: float) -> None:
        try:
            if not future.wait(max(0.0, deadline - time.monotonic())):  # GIL released inside
                raise _Fail(f"transfer with {peer.target} still not complete at its deadline "
                            f"({self._timeout_s:.0f} s + 1 s/GiB); it may still land")
        except sluice.SluiceError as e:
            if not peer.ep.connected:
                self._drop(peer)
            raise _Fail(f"transfer with {peer.target} failed: {e}")

    def _sync(self, target_hostname, buffers, peer_addresses, lengths, opcode, notify) -> int:
        peer, batch, nbytes, is_write = self._plan(target_hostname, buffers, peer_addresses, lengths, opcode)
        if peer is None:
            self._copy_self(batch, is_write)
        elif batch:
            self._wait(peer, self._submit(peer, batch, is_write), self._deadline(nbytes))
        if notify is not None:
            self._send_notify(peer or self._peer(_parse_target(target_hostname)), notify)
        return OK

    def _async(self, target_hostname, buffers, peer_addresses, lengths, opcode) -> int:
        peer, batch, nbytes, is_write = self._plan(target_hostname, buffers, peer_addresses, lengths, opcode)
        if peer is None:  # this engine itself: copied now, the batch is complete when returned
            self._copy_self(batch, is_write)
            future, target = None, _parse_target(target_hostname)
        else:
            future, target = (self._submit(peer, batch, is_write) if batch else None), peer.target
        with self._lock:
            bid = self._next_batch
            self._next_batch += 1
            self._batches[bid] = _Batch(future, self._deadline(nbytes), target, nbytes)
        return bid

    # A target that is this engine itself (checkpoint-engine's P2P reads a rank's own shard
    # through its own rpc address): both ranges are this process's registered memory, so the
    # transfer is a local copy, not a loopback endpoint (the same-host transports never serve
    # their own engine; tcp loopback ran at 1.4 GB/s into a GPU on H200).

    def _is_self(self, target: str) -> bool:
        engine = self._need()
        host, _, port = target.rpartition(":")
        own_host, _, own_port = engine.listen_address.rpartition(":")
        if port != own_port:
            return False
        host = host.strip("[]")
        with self._lock:
            known = self._self_hosts.get(host)
        if known is None:
            known = host in (own_host.strip("[]"), "localhost") or _is_local_address(host)
            with self._lock:
                self._self_hosts[host] = known
        return known

    def _self_pieces(self, target: str, bufs, peers, lens):
        """(local addr, its location, own addr, its location, length) per non-empty entry;
        both ranges must lie in regions this engine registered (else nothing is copied)."""
        pieces = []
        with self._lock:
            for i, (b, p, n) in enumerate(zip(bufs, peers, lens)):
                if n == 0:
                    continue
                mine, theirs = self._local.find(b, n), self._local.find(p, n)
                if theirs is None:
                    raise _Fail(f"entry {i}: no region registered by {target} (this engine itself) covers "
                                f"[{p:#x}, {p + n:#x}) ({n} bytes); it has {self._local.describe()}")
                pieces.append((b, mine[0].location, p, theirs[0].location, n))
        return pieces

    def _copy_self(self, pieces, is_write: bool) -> None:
        # The lock keeps unregister_memory (which takes it) from releasing a region mid-copy.
        with self._lock:
            for b, bloc, p, ploc, n in pieces:
                dst, dloc, src, sloc = (p, ploc, b, bloc) if is_write else (b, bloc, p, ploc)
                if dloc.startswith("cuda") or sloc.startswith("cuda"):
                    device = int((dloc if dloc.startswith("cuda") else sloc).split(":", 1)[1])
                    try:
                        _cuda_pointer.copy(dst, src, n, device)
                    except RuntimeError as e:
                        raise _Fail(f"local copy within this engine failed: {e}")
                else:
                    ctypes.memmove(dst, src, n)

    def _status(self, batch_ids) -> int:
        ids = _ints(batch_ids, "batch_ids")
        with self._lock:
            batches = [(bid, self._batches.pop(bid, None)) for bid in ids]
        failed = []
        for bid, b in batches:  # wait for all, even after a failure: the caller may free memory next
            if b is None:
                failed.append(f"batch id {bid} is unknown (never returned, or already waited for)")
                continue
            if b.future is None:
                continue
            try:
                if not b.future.wait(max(0.0, b.deadline - time.monotonic())):
                    failed.append(f"batch {bid} to {b.target} not complete at its deadline")
            except sluice.SluiceError as e:
                failed.append(f"batch {bid} to {b.target} failed: {e}")
                with self._lock:
                    peer = self._peers.get(b.target)
                if peer is not None and not peer.ep.connected:
                    self._drop(peer)
        if failed:
            raise _Fail("; ".join(failed))
        return OK

    def _send_notify(self, peer: _Peer, notify: TransferNotify) -> None:
        import numpy as np

        raw = _encode_notify(notify)
        if len(raw) > _NOTIFY_BYTES:
            raise _Fail(f"notify: name + msg is {len(raw)} bytes, more than {_NOTIFY_BYTES}")
        with self._notify_lock:
            if self._notify_buf is None:
                self._notify_buf = np.zeros(_NOTIFY_BYTES, dtype=np.uint8)
                self._notify_handle = self._need().register(self._notify_buf)
            self._notify_buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            self._wait(peer, peer.ep.send(self._notify_handle, 0, len(raw)), self._deadline(len(raw)))

    def _adopt(self, engine: sluice.Engine, ep: sluice.Endpoint) -> None:
        """An endpoint a peer opened to us: post a notification recv on it."""
        box = _Inbox(engine, ep)
        with self._lock:
            dead = [b for b in self._inboxes if not b.ep.connected]
            self._inboxes = [b for b in self._inboxes if b.ep.connected] + [box]
        for b in dead:  # their recv failed with the endpoint: the buffer is free again
            try:
                engine.unregister(b.handle)
            except sluice.SluiceError:
                pass


def _accept_loop(ref, engine: sluice.Engine, stop: threading.Event) -> None:
    """Takes the endpoints peers open to us (the engine holds at most max_pending_accepts
    unaccepted ones) and hands them to the TransferEngine, while it lives."""
    while not stop.is_set():
        try:
            ep = engine.accept(timeout=0.5)
        except sluice.ClosedError:
            return
        except Exception as e:  # noqa: BLE001 - keep serving other peers
            if not stop.is_set():
                log.warning("accepting a peer's endpoint failed: %s", e)
            continue
        if ep is None:
            continue
        me = ref()
        if me is None:
            return
        try:
            me._adopt(engine, ep)
        except Exception as e:  # noqa: BLE001
            if not stop.is_set():
                log.warning("setting up notifications from a peer failed: %s", e)
        del me


__all__ = [
    "TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write", "P2PHANDSHAKE",
    "install", "uninstall",
]
