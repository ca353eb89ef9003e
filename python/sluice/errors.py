"""Exceptions raised by sluice: one class per ``sluice::ErrorCode``.

Every engine failure raises a :class:`SluiceError` subclass; ``exc.code`` is the
:class:`ErrorCode` and ``exc.message`` the engine's text. Where a built-in exception means
the same thing the class also derives from it, so ``except ValueError`` or
``except ConnectionError`` keep working::

    SluiceError
    ├── InvalidArgumentError  (ValueError)
    │   └── EmptyBatchError
    ├── UnknownHandleError    (KeyError)
    ├── OutOfRangeError       (IndexError)
    ├── TruncatedError
    ├── PeerLostError         (ConnectionError)
    ├── SluiceTimeoutError    (TimeoutError)
    ├── CancelledError
    ├── RemoteError
    ├── ProtocolError
    ├── UnsupportedError
    ├── NoDeviceError
    ├── SystemCallError       (OSError)
    ├── ClosedError
    └── InternalError
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mirror of ``sluice::ErrorCode`` (same numbers)."""

    OK = 0
    INVALID_ARGUMENT = 1
    UNKNOWN_HANDLE = 2
    OUT_OF_RANGE = 3
    EMPTY_BATCH = 4
    TRUNCATED = 5
    PEER_LOST = 6
    TIMEOUT = 7
    CANCELLED = 8
    REMOTE_ERROR = 9
    PROTOCOL = 10
    UNSUPPORTED = 11
    NO_DEVICE = 12
    SYSTEM = 13
    CLOSED = 14
    INTERNAL = 15


class SluiceError(Exception):
    """Base class of every error the engine reports."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", code: ErrorCode | int | None = None):
        if code is not None:
            self.code = ErrorCode(code)
        self.message = message
        text = self.code.name.lower().replace("_", " ")
        super().__init__(f"{text}: {message}" if message else text)

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.message, int(self.code)))

    # KeyError.__str__ would repr() the message; keep the plain text for every class.
    def __str__(self) -> str:
        return Exception.__str__(self)


class InvalidArgumentError(SluiceError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class EmptyBatchError(InvalidArgumentError):
    code = ErrorCode.EMPTY_BATCH


class UnknownHandleError(SluiceError, KeyError):
    code = ErrorCode.UNKNOWN_HANDLE


class OutOfRangeError(SluiceError, IndexError):
    code = ErrorCode.OUT_OF_RANGE


class TruncatedError(SluiceError):
    code = ErrorCode.TRUNCATED


class PeerLostError(SluiceError, ConnectionError):
    code = ErrorCode.PEER_LOST


class SluiceTimeoutError(SluiceError, TimeoutError):
    code = ErrorCode.TIMEOUT


class CancelledError(SluiceError):
    """The endpoint or engine was closed while the operation was pending.

    Not :class:`asyncio.CancelledError`: that one means *your task* was cancelled.
    """

    code = ErrorCode.CANCELLED


class RemoteError(SluiceError):
    code = ErrorCode.REMOTE_ERROR


class ProtocolError(SluiceError):
    code = ErrorCode.PROTOCOL


class UnsupportedError(SluiceError):
    code = ErrorCode.UNSUPPORTED


class NoDeviceError(SluiceError):
    code = ErrorCode.NO_DEVICE


class SystemCallError(SluiceError, OSError):
    code = ErrorCode.SYSTEM

    def __init__(self, message: str = "", code: ErrorCode | int | None = None):
        SluiceError.__init__(self, message, code)


class ClosedError(SluiceError):
    code = ErrorCode.CLOSED


class InternalError(SluiceError):
    code = ErrorCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, EmptyBatchError, UnknownHandleError, OutOfRangeError, TruncatedError,
        PeerLostError, SluiceTimeoutError, CancelledError, RemoteError, ProtocolError,
        UnsupportedError, NoDeviceError, SystemCallError, ClosedError, InternalError,
    )
}


def _from_code(code: int, message: str) -> SluiceError:
    """The exception instance for an engine status (called by the C++ binding)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return InternalError(f"unknown error code {code}: {message}")
    return _BY_CODE.get(ec, InternalError)(message, ec)


__all__ = ["ErrorCode", "SluiceError"] + [c.__name__ for c in _BY_CODE.values()]
