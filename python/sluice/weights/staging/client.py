"""The inference side of the staging buffer (torch only, no sluice engine):
:class:`StagingClient`, which maps a :class:`StagingServer`'s buffer once and takes in its
updates bin by bin, :func:`receive_from_staging` (one update on a connection of its own), and
the helper that rebuilds the CUDA buffer from the server's IPC handle."""

from __future__ import annotations

import hmac
import mmap
import os
import pickle
import secrets
import socket
import sys
import time
import traceback
from typing import Callable, List, Mapping, Optional, Tuple

from ... import ClosedError, InvalidArgumentError, SluiceTimeoutError
from .._torch import describe, dtype_name, torch
from ..errors import TensorMismatchError
from ._layout import _view
from ._results import ReceiveResult
from ._wire import HANDSHAKE_FRAME, PROTOCOL, _Channel, _Gone, _mac, _parse_address, _shown, _Timeout
from .errors import StagingAbortedError, StagingServerLostError

RunCallback = Callable[[List[Tuple[str, object]]], None]


class StagingClient:
    """Inference side: maps a :class:`StagingServer`'s buffer once and takes in its updates.
    Needs torch only (no sluice engine). ``address``: the server's :attr:`StagingServer.address`.
    Connects on the first :meth:`receive` (or :meth:`connect`); after the server is lost, the
    next receive connects again."""

    def __init__(self, address: str, *, timeout: float = 60.0):
        self._sockaddr, self._key = _parse_address(address)
        self._check_timeout(timeout)
        self.timeout = float(timeout)
        self._chan: Optional[_Channel] = None
        self._buf = None
        self._mmap = None
        self._hello: dict = {}
        self._closed = False

    @property
    def buffer(self):
        """The mapped staging tensor (uint8), or None while not connected."""
        return self._buf

    @property
    def slot_bytes(self) -> int:
        return int(self._hello.get("slot_bytes", 0))

    def connect(self, timeout: Optional[float] = None) -> None:
        """Connect and map the buffer now (receive() does it when needed). Waits for the
        server to accept (it does in accept() and update())."""
        if self._closed:
            raise ClosedError("the StagingClient is closed")
        self._ensure(time.monotonic() + self._pick(timeout))

    def receive(self, params: Optional[Mapping[str, object]] = None, run: Optional[RunCallback] = None, *,
                timeout: Optional[float] = None) -> ReceiveResult:
        """Take in one update: per bin, copy each tensor into ``params[name]`` (dtype and shape
        checked; any device) and/or call ``run([(name, view), ...])`` with views of the
        staging buffer, valid only during the call (copy out of them: ``load_weights`` style),
        then ack. Names the bin holds that ``params`` lacks are left to ``run``; without
        ``run`` they are an error. If a copy or ``run`` raises, the server is told (it raises
        :class:`ConsumerError` with this traceback) and the exception is raised here.
        Raises :class:`StagingAbortedError` if the server aborted the update,
        :class:`StagingServerLostError` if it went away or stalled mid-update, and
        :class:`~sluice.SluiceTimeoutError` if no update started within ``timeout`` (which
        bounds the whole call)."""
        if self._closed:
            raise ClosedError("the StagingClient is closed")
        if params is None and run is None:
            raise InvalidArgumentError("receive: pass params (name -> tensor) and/or run(pairs)")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidArgumentError(f"receive: params must be a dict of name -> tensor, got {type(params).__name__}")
        t0 = time.monotonic()
        deadline = t0 + self._pick(timeout)
        self._ensure(deadline)
        chan = self._chan
        try:
            while True:  # anything before "begin" is left from an aborted update
                try:
                    msg = chan.recv(deadline, "waiting for an update to begin")
                except _Timeout:
                    raise SluiceTimeoutError(f"no update from the staging server {_shown(self._sockaddr)!r} began "
                                             f"within the timeout") from None
                if msg["type"] == "begin":
                    break
            uid = msg.get("update")
            result = ReceiveResult(version=int(msg.get("version", 0)))
            while True:
                msg = chan.recv(deadline, "waiting for the next bin")
                kind = msg["type"]
                if msg.get("update") != uid:
                    continue
                if kind == "bin":
                    self._bin(msg, params, run, uid, result, deadline)
                elif kind == "end":
                    result.seconds = time.monotonic() - t0
                    return result
                elif kind == "abort":
                    raise StagingAbortedError(f"the staging server aborted the update: {msg.get('error', '')}")
                else:
                    raise _Gone(f"unexpected message {kind!r}")
        except _Timeout as e:
            self._drop()
            raise StagingServerLostError(f"the staging server {_shown(self._sockaddr)!r} did not answer within the "
                                         f"timeout ({e})") from None
        except _Gone as e:
            self._drop()
            raise StagingServerLostError(f"the staging server {_shown(self._sockaddr)!r} went away ({e})") from None

    def close(self) -> None:
        """Close the connection and unmap the buffer. Idempotent."""
        self._closed = True
        self._drop()

    def __enter__(self) -> "StagingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ per bin

    def _bin(self, msg: dict, params, run, uid, result: ReceiveResult, deadline: float) -> None:
        k = msg.get("bin")
        where = "reading the bin's descriptor"
        try:
            pairs = [(d["name"], _view(self._buf, d["dtype"], d["shape"], int(d["offset"]))) for d in msg["tensors"]]
            if params is not None:
                where = "checking the tensors against params"
                problems = []
                for name, v in pairs:
                    p = params.get(name)
                    if p is None:
                        if run is None:
                            problems.append(f"{name!r}: not in params")
                    elif not isinstance(p, torch().Tensor):
                        problems.append(f"{name!r}: params holds a {type(p).__name__}, not a tensor")
                    elif p.dtype != v.dtype or tuple(p.shape) != tuple(v.shape):
                        problems.append(f"{name!r}: staged {dtype_name(v)}{list(v.shape)}, params has {describe(p)}")
                if problems:
                    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
                    raise TensorMismatchError("receive: " + "; ".join(problems[:5]) + more)
                for name, v in pairs:
                    p = params.get(name)
                    if p is not None:
                        where = f"copying {name!r} into params"
                        p.copy_(v)
            if run is not None:
                where = "run()"
                run(pairs)
            where = "synchronizing the device"
            self._sync(params, pairs)
        except BaseException:
            self._nack(uid, k, where, deadline)  # the server aborts; we raise what failed
            raise
        self._chan.send({"type": "ack", "update": uid, "bin": k, "error": ""}, deadline, "acking a bin")
        result.bins += 1
        result.tensors.extend(n for n, _ in pairs)
        result.nbytes += sum(v.numel() * v.element_size() for _, v in pairs)

    def _nack(self, uid, k, where: str, deadline: float) -> None:
        e = sys.exc_info()[1]
        err = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        try:
            self._chan.send({"type": "ack", "update": uid, "bin": k, "error": err, "where": where,
                             "traceback": traceback.format_exc()},
                            max(deadline, time.monotonic() + 1.0), "reporting an error")
        except (_Gone, _Timeout):
            self._drop()

    def _sync(self, params, pairs) -> None:
        """The copies out of the slot must be done before the ack lets the server reuse it."""
        t = torch()
        devices = set()
        if self._buf.device.type == "cuda":
            devices.add(self._buf.device)
        if params is not None:
            for name, _ in pairs:
                p = params.get(name)
                if isinstance(p, t.Tensor) and p.device.type == "cuda":
                    devices.add(p.device)
        for d in devices:
            t.cuda.synchronize(d)

    # ------------------------------------------------------------ connection

    def _ensure(self, deadline: float) -> None:
        if self._chan is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(self._sockaddr)
        except OSError as e:
            sock.close()
            raise StagingServerLostError(f"the staging server {_shown(self._sockaddr)!r} is unreachable: {e}") from None
        chan = _Channel(sock)
        try:
            self._handshake(chan, deadline)
        except _Timeout as e:
            chan.close()
            self._unmap()
            raise SluiceTimeoutError(f"the staging server {_shown(self._sockaddr)!r} did not accept us within the "
                                     f"timeout ({e}); it accepts in accept() and update()") from None
        except _Gone as e:
            chan.close()
            self._unmap()
            raise StagingServerLostError(f"connecting to the staging server {_shown(self._sockaddr)!r} failed: "
                                         f"{e}") from None
        self._chan = chan

    def _handshake(self, chan: _Channel, deadline: float) -> None:
        msg = chan.recv(deadline, "waiting for the server's challenge", HANDSHAKE_FRAME)
        if msg.get("type") != "challenge" or msg.get("protocol") != PROTOCOL:
            raise _Gone(f"not a sluice staging server of protocol {PROTOCOL} (got {msg.get('type')!r}, "
                        f"protocol {msg.get('protocol')!r})")
        try:
            nonce = bytes.fromhex(msg.get("nonce", ""))
        except (TypeError, ValueError):
            raise _Gone("bad server nonce") from None
        cnonce = secrets.token_bytes(32)
        chan.send({"type": "auth", "mac": _mac(self._key, b"client", nonce), "nonce": cnonce.hex()},
                  deadline, "authenticating")
        try:
            hello = chan.recv(deadline, "authenticating")
        except _Gone as e:
            raise _Gone(f"the server refused us (wrong key in the address?): {e}") from None
        if hello.get("type") != "hello" or not isinstance(hello.get("mac"), str) or \
                not hmac.compare_digest(hello["mac"], _mac(self._key, b"server", cnonce)):
            raise _Gone("the server does not hold the address's key")
        self._hello = hello
        t = torch()
        err = ""
        try:
            cap = int(hello["capacity"])
            if hello.get("kind") == "cuda":
                raw = chan.recv_raw(deadline, "receiving the CUDA IPC handle")
                try:
                    if hello.get("pid") == os.getpid():
                        raise RuntimeError("the staging server runs in this process: CUDA IPC maps another "
                                           "process's memory only (use its buffer directly)")
                    self._buf = _rebuild_cuda(raw, hello.get("uuid", ""))
                except Exception as e:  # noqa: BLE001 - reported to the server, then raised here
                    err = f"{type(e).__name__}: {e}"
            else:
                fd = chan.recv_fd(deadline, "receiving the buffer's memfd")
                try:
                    self._mmap = mmap.mmap(fd, cap)
                    self._buf = t.frombuffer(self._mmap, dtype=t.uint8)
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
                finally:
                    os.close(fd)
            if not err and self._buf.numel() != cap:
                err = f"the mapped buffer has {self._buf.numel()} bytes, the server says {cap}"
        except (KeyError, TypeError, ValueError) as e:
            raise _Gone(f"bad hello: {e}") from None
        chan.send({"type": "ready", "error": err}, deadline, "acknowledging the buffer")
        if err:
            raise _Gone(f"could not map the staging buffer: {err}")

    def _drop(self) -> None:
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
        self._unmap()

    def _unmap(self) -> None:
        self._buf = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # the caller still holds a view: freed with it
                pass
            self._mmap = None

    def _pick(self, timeout: Optional[float]) -> float:
        if timeout is None:
            return self.timeout
        self._check_timeout(timeout)
        return float(timeout)

    @staticmethod
    def _check_timeout(timeout) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def _rebuild_cuda(raw: bytes, uuid: str):
    """The staging tensor from the server's reduce_tensor(), on the GPU whose uuid it named
    (its index may differ here: CUDA_VISIBLE_DEVICES)."""
    t = torch()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fn, args = pickle.loads(raw)  # only after the server proved it holds the key
    if fn is not rebuild_cuda_tensor:
        raise _Gone("the server did not send a CUDA tensor handle")
    args = list(args)
    if uuid:
        local = [i for i in range(t.cuda.device_count())
                 if str(getattr(t.cuda.get_device_properties(i), "uuid", "")) == uuid]
        if not local:
            raise RuntimeError(f"the staging buffer's GPU (uuid {uuid}) is not visible to this process")
        if len(args) == 15 and isinstance(args[6], int):
            args[6] = local[0]  # storage_device of rebuild_cuda_tensor
    return fn(*args)


def receive_from_staging(address: str, params: Optional[Mapping[str, object]] = None,
                         run: Optional[RunCallback] = None, *, timeout: float = 60.0) -> ReceiveResult:
    """One update from a :class:`StagingServer`, with a connection of its own (the buffer is
    mapped again each call; keep a :class:`StagingClient` to map it once, and to get only
    the changed tensors on later updates). See :meth:`StagingClient.receive`."""
    with StagingClient(address, timeout=timeout) as client:
        return client.receive(params, run, timeout=timeout)
