"""The staging protocol's wire, shared by both sides: length-prefixed JSON messages on a unix
stream socket with a deadline on every call (:class:`_Channel`, which also passes the memfd
by SCM_RIGHTS), the protocol version, the address format ("unix:@name#key" or
"unix:/path#key") and its parsing, the handshake's HMAC, and the two internal exceptions
(:class:`_Gone`: the peer closed or spoke something else; :class:`_Timeout`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from typing import Tuple

from ... import InvalidArgumentError

PROTOCOL = 1
_LEN = struct.Struct("<Q")
_MAX_FRAME = 256 << 20
HANDSHAKE_FRAME = 64 << 10  # before the peer proved it holds the key
ACK_FRAME = 16 << 20  # a consumer's ack (its traceback included)


class _Gone(Exception):
    """The peer closed the connection, or sent something that is not our protocol."""


class _Timeout(Exception):
    """A wait on the peer ran out of time."""


def _mac(key: bytes, label: bytes, nonce: bytes) -> str:
    return hmac.new(key, label + nonce, hashlib.sha256).hexdigest()


def _parse_address(address: str) -> Tuple[str, bytes]:
    """"unix:@name#keyhex" (abstract socket) or "unix:/path#keyhex" -> (sockaddr, key)."""
    if not isinstance(address, str) or not address.startswith("unix:") or "#" not in address:
        raise InvalidArgumentError(f"staging address must be what StagingServer.address gave "
                                   f"(\"unix:@name#key\" or \"unix:/path#key\"), got {address!r}")
    where, keyhex = address[len("unix:"):].rsplit("#", 1)
    try:
        key = bytes.fromhex(keyhex)
    except ValueError:
        raise InvalidArgumentError(f"staging address {address!r}: the part after '#' is not a hex key") from None
    if not where or len(key) < 16:
        raise InvalidArgumentError(f"staging address {address!r}: no socket, or a key shorter than 16 bytes")
    return ("\0" + where[1:] if where.startswith("@") else where), key


def _shown(sockaddr: str) -> str:
    return "@" + sockaddr[1:] if sockaddr.startswith("\0") else sockaddr


class _Channel:
    """Length-prefixed JSON messages on a unix stream socket; every call has a deadline."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def _arm(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout(what)
        self.sock.settimeout(left)

    def send(self, msg: dict, deadline: float, what: str) -> None:
        self.send_raw(json.dumps(msg, separators=(",", ":")).encode(), deadline, what)

    def send_raw(self, data: bytes, deadline: float, what: str) -> None:
        self._arm(deadline, what)
        try:
            self.sock.sendall(_LEN.pack(len(data)) + data)
        except socket.timeout:
            raise _Timeout(what) from None
        except OSError as e:
            raise _Gone(f"{what}: {e}") from None

    def recv_raw(self, deadline: float, what: str, limit: int = _MAX_FRAME) -> bytes:
        (n,) = _LEN.unpack(self._exact(_LEN.size, deadline, what))
        if n > limit:
            raise _Gone(f"{what}: a message of {n} bytes is not our protocol")
        return self._exact(n, deadline, what)

    def recv(self, deadline: float, what: str, limit: int = _MAX_FRAME) -> dict:
        """One message; ``limit``: the most bytes the peer may make us allocate for it (small
        before the peer proved it holds the key)."""
        raw = self.recv_raw(deadline, what, limit)
        try:
            msg = json.loads(raw)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise _Gone(f"{what}: the peer sent something that is not our protocol")
        return msg

    def _exact(self, n: int, deadline: float, what: str) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self._arm(deadline, what)
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise _Timeout(what) from None
            except OSError as e:
                raise _Gone(f"{what}: {e}") from None
            if k == 0:
                raise _Gone(f"{what}: the peer closed the connection")
            got += k
        return bytes(buf)

    def send_fd(self, fd: int, deadline: float, what: str) -> None:
        self._arm(deadline, what)
        try:
            socket.send_fds(self.sock, [b"F"], [fd])
        except socket.timeout:
            raise _Timeout(what) from None
        except OSError as e:
            raise _Gone(f"{what}: {e}") from None

    def recv_fd(self, deadline: float, what: str) -> int:
        self._arm(deadline, what)
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        except socket.timeout:
            raise _Timeout(what) from None
        except OSError as e:
            raise _Gone(f"{what}: {e}") from None
        if data != b"F" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise _Gone(f"{what}: the peer closed the connection" if not data else
                        f"{what}: expected one file descriptor")
        return fds[0]

    def closed_by_peer(self) -> bool:
        """True if the peer closed its end (or reset it); pending data is left in place."""
        # A non-blocking peek, not select(): select() refuses descriptors from 1024 on, which a
        # process with many engines and sockets reaches (CI's pytest run did).
        # (A socket with a timeout would wait for data first: look with no timeout at all.)
        prev = self.sock.gettimeout()
        try:
            self.sock.settimeout(0.0)
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, nothing pending
        except OSError:
            return True
        finally:
            try:
                self.sock.settimeout(prev)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
