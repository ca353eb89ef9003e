"""Releasing what a publisher or subscriber registered."""

from __future__ import annotations

from typing import Iterable

from .. import ClosedError, Engine


def unregister_all(engine: Engine, handles: Iterable) -> None:
    """Unregisters each handle; stops quietly once the engine is closed (closing it already
    dropped every region)."""
    if engine.closed:
        return
    for h in handles:
        try:
            engine.unregister(h)
        except ClosedError:
            return
