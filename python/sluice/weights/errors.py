"""Errors of sluice.weights. Each is a :class:`sluice.SluiceError`, so one ``except`` catches
engine and weight-service failures alike."""

from __future__ import annotations

from ..errors import ErrorCode, SluiceError


class WeightsError(SluiceError):
    """Base of the weight-service errors."""


class TrainerLostError(WeightsError, ConnectionError):
    """The trainer (named by its ref) could not be reached, or died during an update. The
    subscriber reconnects on its next update."""

    code = ErrorCode.PEER_LOST


class TensorMismatchError(WeightsError, ValueError):
    """A target tensor does not match the published one (dtype, shape, device, layout), or a
    name is unknown to one side. The message names the tensor; nothing was transferred."""

    code = ErrorCode.INVALID_ARGUMENT


class WeightsChangedError(WeightsError):
    """The trainer began changing or published its tensors while this update read them: the
    bytes may mix versions. The update is not recorded; run it again."""

    code = ErrorCode.REMOTE_ERROR
