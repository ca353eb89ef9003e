"""Relays: a receiver that serves the tensors it holds to other receivers, so that a trainer
sends its bytes once per relay tree instead of once per receiver (docs/weights.md, "Relays").

A relaying :class:`~sluice.weights.WeightSubscriber` keeps a small engine-allocated region,
``sluice.weights.relay/<publisher>/<instance>`` (the trainer publisher's name and instance in
hex: one process can relay shards of several trainers that use one name), that says which version of each of the trainer's
tensors its targets hold and where (little endian)::

    0   magic      8s  b"SLRELAY1"
    8   format     u32 1
    12  pad        u32
    16  instance   u64 the trainer publisher's instance the entries refer to (0: none yet)
    24  n          u64 number of entries (the trainer's tensors, in its table's order)
    32  reserved   u64[4]
    64  entries    n x (held u64, region u64, landed u64): held = the trainer's tensor version
                   + 1, 0 = not held; region = the relay's region id of the target (the tensor
                   at offset 0); landed = how many of its leading bytes have landed

The relay clears an entry before its update writes into that target, and raises `landed` as
each of its buckets lands (a tensor's bytes arrive in order, bucket after bucket), so a child
reads settled bytes only, and a tensor larger than a bucket is relayed while it arrives. A child re-reads the entries of what it pulled afterwards: an entry that
moved meanwhile (the relay began writing again) means those bytes may be torn, and the child
pulls them again from the trainer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

MAGIC = b"SLRELAY1"
FORMAT = 1
HEADER = struct.Struct("<8sIIQQ32x")
HEADER_SIZE = HEADER.size  # 64
ENTRY = struct.Struct("<QQQ")


def region_name(publisher: str, instance: int) -> str:
    return f"sluice.weights.relay/{publisher}/{instance:016x}"


def region_size(n: int) -> int:
    return HEADER_SIZE + ENTRY.size * n


class BadRelay(Exception):
    """The region does not hold relay entries this reader knows."""


@dataclass(frozen=True)
class Holdings:
    """One read of a relay's region: per trainer tensor, (version, region id, bytes landed)
    or None."""

    instance: int
    entries: List[Optional[Tuple[int, int, int]]]

    def holds(self, index: int, instance: int, version: int, end: int) -> Optional[int]:
        """The relay's region id of tensor ``index`` if its first ``end`` bytes of ``version``
        (of the trainer publisher ``instance``) have landed, else None."""
        if self.instance != instance or index >= len(self.entries):
            return None
        e = self.entries[index]
        return e[1] if e is not None and e[0] == version and e[2] >= end else None

    def landed(self) -> int:
        """Bytes landed over every entry: grows while the relay receives (progress)."""
        return sum(e[2] for e in self.entries if e is not None)


def write_header(buf, instance: int, n: int) -> None:
    import numpy as np

    buf[:HEADER_SIZE] = np.frombuffer(HEADER.pack(MAGIC, FORMAT, 0, instance, n), dtype=np.uint8)


def clear(buf, index: int) -> None:
    """Mark tensor ``index`` not held (before its target is written)."""
    import numpy as np

    off = HEADER_SIZE + ENTRY.size * index
    buf[off:off + 8] = np.zeros(8, dtype=np.uint8)


def set_held(buf, index: int, version: int, region: int, landed: int) -> None:
    """The first ``landed`` bytes of ``version`` of tensor ``index`` are in region ``region``:
    the region and the count first, then the held word (a reader that sees the word sees
    them; the count only grows while the word stays)."""
    import numpy as np

    off = HEADER_SIZE + ENTRY.size * index
    buf[off + 8:off + 24] = np.frombuffer(struct.pack("<QQ", region, landed), dtype=np.uint8)
    buf[off:off + 8] = np.frombuffer(struct.pack("<Q", version + 1), dtype=np.uint8)


def read(raw: bytes) -> Holdings:
    if len(raw) < HEADER_SIZE:
        raise BadRelay(f"relay region too small ({len(raw)} bytes)")
    magic, fmt, _pad, instance, n = HEADER.unpack_from(raw, 0)
    if magic == bytes(len(MAGIC)):
        # The relay has allocated its region (its name is visible from then on) but not yet
        # written the header: it holds nothing yet, as before it had a region at all.
        return Holdings(0, [])
    if magic != MAGIC:
        raise BadRelay("not a sluice.weights relay region (bad magic)")
    if fmt != FORMAT:
        raise BadRelay(f"relay format {fmt} (this sluice reads format {FORMAT})")
    if region_size(n) > len(raw):
        raise BadRelay(f"relay region lists {n} entries, more than its {len(raw)} bytes hold")
    entries: List[Optional[Tuple[int, int, int]]] = []
    for i in range(n):
        held, region, landed = ENTRY.unpack_from(raw, HEADER_SIZE + ENTRY.size * i)
        entries.append((held - 1, region, landed) if held else None)
    return Holdings(instance, entries)


def tree_parent(index: int, fanout: int = 2) -> Optional[int]:
    """In a relay tree over receivers 0..N-1 (receiver 0 pulls from the trainer), the
    receiver that ``index`` pulls from: a complete ``fanout``-ary tree in index order
    (fanout 1 is a chain). None for the root."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"tree_parent: index must be an int >= 0, got {index!r}")
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"tree_parent: fanout must be an int >= 1, got {fanout!r}")
    return None if index == 0 else (index - 1) // fanout


def tree_depth(count: int, fanout: int = 2) -> int:
    """Hops from the trainer to the deepest of ``count`` receivers in that tree."""
    depth, i = 0, count - 1
    while i > 0:
        i = (i - 1) // fanout
        depth += 1
    return depth + 1 if count > 0 else 0


def host_layout(hosts: Sequence[Hashable], fanout: int = 2, trainer_host: Optional[Hashable] = None
                ) -> List[Optional[int]]:
    """A relay tree laid out by host: per receiver (``hosts[i]`` is receiver i's host, any
    label: a host name, ``SLUICE_HOST_ID``, a rack), the receiver it pulls from, None for the
    trainer.

    Bytes cross between hosts once per host: the first receiver of each host (its leader)
    pulls from the trainer or from another host's leader, in a ``fanout``-ary tree of leaders
    in order of first appearance; the others pull from receivers of their own host, in a
    ``fanout``-ary tree under their leader (shm or NVLink there, not the host's uplink).
    Receivers on ``trainer_host`` pull from the trainer itself or from each other, in a tree
    under the trainer, and lead no other host. A leader serves at most ``fanout`` receivers
    over its uplink and ``fanout`` of its own host.

    ``hosts[i]`` may be a :class:`~sluice.weights.placement.Placement` (``probe()``): its
    ``host`` is the label, and a host's leader is then its receiver nearest to a NIC (PCIe hops
    from its GPU, else NUMA distance; ties and unknowns: the first), the others following in
    index order. ``trainer_host`` may be one too."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"host_layout: fanout must be an int >= 1, got {fanout!r}")
    from .placement import Placement

    hosts = list(hosts)
    placed = [isinstance(h, Placement) for h in hosts]
    if isinstance(trainer_host, Placement):
        trainer_host = trainer_host.host
    groups: Dict[Hashable, List[int]] = {}
    for i, h in enumerate(hosts):
        groups.setdefault(h.host if placed[i] else h, []).append(i)
    for h, g in groups.items():  # the receiver nearest to a NIC leads its host
        near = [(0, hosts[i].distance) if placed[i] and hosts[i].distance is not None else (1, 0) for i in g]
        lead = min(range(len(g)), key=lambda k: (near[k], k))
        g.insert(0, g.pop(lead))
    parent: List[Optional[int]] = [None] * len(hosts)
    for i, p in enumerate(groups.get(trainer_host, []) if trainer_host is not None else []):
        up = tree_parent(i + 1, fanout)  # position 0 of this tree is the trainer
        parent[p] = None if up == 0 else groups[trainer_host][up - 1]
    leaders = [g[0] for h, g in groups.items() if trainer_host is None or h != trainer_host]
    for j, leader in enumerate(leaders):
        up = tree_parent(j, fanout)
        parent[leader] = None if up is None else leaders[up]
    for h, g in groups.items():
        if trainer_host is not None and h == trainer_host:
            continue
        for pos in range(1, len(g)):
            parent[g[pos]] = g[tree_parent(pos, fanout)]
    return parent
