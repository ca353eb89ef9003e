"""Where tensors lie in the staging buffer: the alignment (:data:`ALIGN`), the bins and slots
of a published table (:class:`_Layout`), and the typed view of a tensor at an offset of the
uint8 buffer (:func:`_view`), which both sides use."""

from __future__ import annotations

from typing import List, Tuple

from .._torch import torch
from ..errors import TensorMismatchError
from ._wire import _Gone
from .errors import StagingCapacityError

ALIGN = 256  # each tensor's offset in a slot (any dtype's alignment, and the GPU's)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str):
    t = torch()
    d = getattr(t, name, None) if isinstance(name, str) else None
    if not isinstance(d, t.dtype):
        raise TensorMismatchError(f"unknown dtype {name!r}")
    return d


def _view(buf, dtype: str, shape, offset: int):
    """The tensor of ``dtype`` and ``shape`` at byte ``offset`` of the uint8 tensor ``buf``."""
    t = torch()
    d = _dtype(dtype)
    shape = tuple(int(x) for x in shape)
    numel = 1
    for x in shape:
        numel *= x
    n = numel * t.empty((), dtype=d).element_size()
    if offset < 0 or offset % ALIGN or offset + n > buf.numel():
        raise _Gone(f"tensor of {n} bytes at offset {offset} does not fit the {buf.numel()}-byte staging buffer")
    return buf[offset:offset + n].view(d).view(shape)


class _Layout:
    """Where each published tensor lives in the staging buffer: bins in table order, bin b in
    slot b % slots, tensors ALIGN-aligned in their slot. Fixed for a published table, so a
    tensor's view is at the same address every update and the subscriber registers it once."""

    def __init__(self, tensors, slot_bytes: int, slots: int, capacity: int):
        self.bins: List[List[Tuple[object, int]]] = []  # per bin: (TensorInfo, offset in the buffer)
        cur: List[Tuple[object, int]] = []
        used = 0
        for info in tensors:
            if info.nbytes > slot_bytes:
                raise StagingCapacityError(
                    f"tensor {info.name!r} ({info.dtype}{list(info.shape)}, {info.nbytes} bytes) is larger than a "
                    f"staging slot ({slot_bytes} bytes: the {capacity}-byte buffer in {slots} slot(s)); pass "
                    f"capacity >= {2 * _align(info.nbytes)} to StagingServer")
            off = _align(used)
            if cur and off + info.nbytes > slot_bytes:
                self.bins.append(cur)
                cur, off = [], 0
            cur.append((info, off))
            used = off + info.nbytes
        if cur:
            self.bins.append(cur)
        for b, items in enumerate(self.bins):
            base = (b % slots) * slot_bytes
            self.bins[b] = [(info, base + off) for info, off in items]
        self.slots = slots

    def slot(self, b: int) -> int:
        return b % self.slots
