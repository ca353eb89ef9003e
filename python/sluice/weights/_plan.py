"""Bucket planning: which bytes each READ moves, and which tensors each bucket completes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Sequence, Tuple


class Item(NamedTuple):
    name: str
    nbytes: int
    local: int  # the receiver's handle of the target tensor (0 for 0 bytes)
    remote: int  # the trainer's region id
    remote_offset: int


@dataclass
class Bucket:
    entries: List[tuple] = field(default_factory=list)  # (local, local_off, remote, remote_off, length)
    parts: List[Tuple[str, int]] = field(default_factory=list)  # per entry: (tensor, offset in it)
    done: List[str] = field(default_factory=list)  # tensors whose last byte is in this bucket
    nbytes: int = 0


def plan(items: Sequence[Item], bucket_bytes: int) -> List[Bucket]:
    """Cut ``items`` (in order) into buckets of at most ``bucket_bytes``. A tensor larger than
    what is left of a bucket continues in the next one, so every bucket but the last is full
    and a huge tensor never needs a huge bucket; it counts as done in the bucket holding its
    end. 0-byte tensors are done in the bucket where they appear."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: List[Bucket] = []
    cur = Bucket()
    for it in items:
        off = 0
        while off < it.nbytes:
            if cur.nbytes == bucket_bytes:
                buckets.append(cur)
                cur = Bucket()
            n = min(it.nbytes - off, bucket_bytes - cur.nbytes)
            cur.entries.append((it.local, off, it.remote, it.remote_offset + off, n))
            cur.parts.append((it.name, off))
            cur.nbytes += n
            off += n
        cur.done.append(it.name)
    if cur.entries or cur.done:
        buckets.append(cur)
    return buckets
