"""What a staged update returns: :class:`StagingResult` (what one
:meth:`StagingServer.update` delivered) and :class:`ReceiveResult` (what one
:meth:`StagingClient.receive` took in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class StagingResult:
    """What one :meth:`StagingServer.update` delivered."""

    version: int  # the trainer's published version every delivered tensor holds
    tensors: List[str] = field(default_factory=list)  # delivered to the consumer (acked)
    unchanged: List[str] = field(default_factory=list)  # skipped: the consumer holds them at their version
    nbytes: int = 0
    bins: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ReceiveResult:
    """What one :meth:`StagingClient.receive` took in."""

    version: int
    tensors: List[str] = field(default_factory=list)
    nbytes: int = 0
    bins: int = 0
    seconds: float = 0.0
