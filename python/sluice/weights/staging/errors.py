"""Errors of sluice.weights.staging: the base :class:`StagingError`, raised by the sidecar
(:class:`StagingCapacityError`, :class:`ConsumerError`, :class:`ConsumerLostError`) and by the
inference side (:class:`StagingServerLostError`, :class:`StagingAbortedError`). Each is a
:class:`~sluice.weights.WeightsError`."""

from __future__ import annotations

from typing import Sequence

from ...errors import ErrorCode
from ..errors import WeightsError


class StagingError(WeightsError):
    """Base of the staging errors."""


class StagingCapacityError(StagingError, ValueError):
    """The staging buffer cannot hold a tensor (the message names it and the sizes), or the
    GPU has too little free memory for it. Raised before anything moves."""

    code = ErrorCode.INVALID_ARGUMENT


class ConsumerError(StagingError):
    """The inference side failed on a bin (its ``run`` raised, a tensor did not match its
    parameter). ``bin`` (0-based), ``tensors`` (the bin's names) and ``remote_traceback``
    say where; the update was aborted."""

    code = ErrorCode.REMOTE_ERROR

    def __init__(self, message: str = "", code=None, *, bin: int = -1, tensors: Sequence[str] = (),
                 remote_traceback: str = ""):
        super().__init__(message, code)
        self.bin = bin
        self.tensors = list(tensors)
        self.remote_traceback = remote_traceback


class ConsumerLostError(StagingError, ConnectionError):
    """The inference side went away (its process died, it closed) or did not answer within
    the timeout. The next update waits for it to connect again."""

    code = ErrorCode.PEER_LOST


class StagingServerLostError(StagingError, ConnectionError):
    """Inference side: the staging server cannot be reached, went away, or did not answer
    within the timeout during an update. The next receive() connects again."""

    code = ErrorCode.PEER_LOST


class StagingAbortedError(StagingError):
    """Inference side: the staging server aborted the update (its message says why: the
    trainer changed its tensors, could not be reached, ...). Bins received before it hold
    one published version; run the update again."""

    code = ErrorCode.REMOTE_ERROR
