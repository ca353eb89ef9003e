"""Address-range tables for the Mooncake facade.

Mooncake names memory by raw virtual address; Sluice by (region handle, offset). These tables
turn one into the other: the local one holds what ``register_memory`` registered, the remote
one a peer's advertised regions (``Endpoint.remote_regions()``, whose ``addr`` is the owner's
virtual address). A range must lie inside ONE region: Mooncake's transports slice within a
registered buffer too, and a range that no region covers must touch nothing.
"""

from __future__ import annotations

import bisect
from typing import Iterable, List, NamedTuple, Optional, Tuple


class Region(NamedTuple):
    base: int
    length: int
    handle: int  # local MemoryHandle or the peer's region id
    location: str


class RangeTable:
    """Non-overlapping regions sorted by base address. Not thread safe: the caller locks."""

    __slots__ = ("_bases", "_regions")

    def __init__(self, regions: Iterable[Region] = ()):
        self._regions: List[Region] = sorted(regions, key=lambda r: r.base)
        self._bases: List[int] = [r.base for r in self._regions]

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self):
        return iter(self._regions)

    def find(self, addr: int, length: int) -> Optional[Tuple[Region, int]]:
        """The region holding all of [addr, addr + length) and the offset of addr in it."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        r = self._regions[i]
        off = addr - r.base
        if off + length > r.length or (length == 0 and off >= r.length):
            return None
        return r, off

    def overlaps(self, addr: int, length: int) -> Optional[Region]:
        """A region sharing at least one byte with [addr, addr + length), if any."""
        i = bisect.bisect_left(self._bases, addr + length) - 1
        if i >= 0:
            r = self._regions[i]
            if r.base + r.length > addr:
                return r
        return None

    def at(self, base: int) -> Optional[Region]:
        """The region registered at exactly ``base``."""
        i = bisect.bisect_left(self._bases, base)
        if i < len(self._bases) and self._bases[i] == base:
            return self._regions[i]
        return None

    def add(self, region: Region) -> None:
        i = bisect.bisect_left(self._bases, region.base)
        self._bases.insert(i, region.base)
        self._regions.insert(i, region)

    def remove(self, base: int) -> Optional[Region]:
        i = bisect.bisect_left(self._bases, base)
        if i < len(self._bases) and self._bases[i] == base:
            del self._bases[i]
            return self._regions.pop(i)
        return None

    def describe(self, limit: int = 4) -> str:
        """A short listing for error messages."""
        if not self._regions:
            return "no registered regions"
        shown = ", ".join(f"[{r.base:#x}, {r.base + r.length:#x})" for r in self._regions[:limit])
        more = len(self._regions) - limit
        return f"{len(self._regions)} region(s): {shown}" + (f", ... {more} more" if more > 0 else "")


def remote_table(infos: Iterable[dict]) -> RangeTable:
    """A peer's region table from ``Endpoint.remote_regions()``. Regions a peer advertises
    never overlap in its own address space; a lying peer can only make our lookups fail, since
    its engine checks every range against its real registry again."""
    return RangeTable(Region(int(d["addr"]), int(d["length"]), int(d["id"]), str(d["location"])) for d in infos)
