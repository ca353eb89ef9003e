"""The region a :class:`~sluice.weights.WeightSink` exposes to the trainer that pushes to it.

One engine-allocated region per sink, ``sluice.weights.sink/<publisher>``. The sink writes the
table (what it wants, where, and what it already holds); the trainer READs it, then WRITEs the
control block and the tensors into the sink's registered targets with write-with-immediate,
so the sink learns of every landed bucket from an imm, with no request or acknowledgement.

Layout (little endian); ``n`` entries::

    0   magic        8s  b"SLWSINK1"
    8   format       u32 1
    12  flags        u32 0
    16  arm          u64 how many receive() calls armed this sink; the trainer pushes when it
                         differs from the control block's arm (the last one it served)
    24  instance     u64 the publisher instance the entries were made against
    32  n            u64 entries
    40  bucket_bytes u64 bytes per write-with-imm batch (both sides plan the same buckets)
    48  rank         i64 the sink's label in the trainer's report (-1: none)
    56  token        u64 random per sink: the hello it sent on its endpoint carries it
    64  crc          u32 zlib.crc32 of bytes 16..64 and the entries
    68  pad          u32
    72  entries      n x (index u64: the tensor's index in the publisher's table,
                          region u64: the sink's region id of the target,
                          nbytes u64,
                          held u64: version + 1 of the bytes the target holds, 0: unknown)
    72+32n control   written by the trainer (64 bytes):
                     magic 8s b"SLWPUSH1", format u32, status u32, arm u64 (the arm it
                     answers), seq u64, version u64, instance u64, count u64, pad u64
    136+32n manifest count x (entry u64, version u64): the entries pushed, in order

Immediates: ``(arm & 0xff) << 24 | code``; code ``BEGIN`` after the control block and the
manifest landed, ``k`` after bucket k landed, ``DONE`` after the last (the control block is
written again with the final status first).

Hello: when a sink connects it sends (two-sided) 16 bytes on its endpoint, ``b"SLWHELO1"``
and its token. Immediates reach only the endpoint they were written on, and a sink's engine
may have other endpoints to the trainer (a WeightSubscriber of its own): when it has, the
trainer receives the hellos on them to find the one whose token the table names.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

MAGIC = b"SLWSINK1"
PUSH_MAGIC = b"SLWPUSH1"
FORMAT = 1
HEADER = struct.Struct("<8sIIQQQQqQII")
ENTRY = struct.Struct("<QQQQ")
CONTROL = struct.Struct("<8sIIQQQQQQ")
PUSHED = struct.Struct("<QQ")
HELLO = struct.Struct("<8sQ")
HELLO_MAGIC = b"SLWHELO1"
_CRC_FIELDS = slice(16, 64)
assert HEADER.size == 72 and CONTROL.size == 64

IMM_BEGIN = 0xFFFFFE
IMM_DONE = 0xFFFFFF
MAX_BUCKETS = IMM_BEGIN  # bucket codes are 0 .. MAX_BUCKETS - 1
MIN_BUCKET_BYTES = 4096  # a sink cannot make the trainer plan a bucket per byte

# Control block status: why the trainer did not push (the sink raises with the reason).
OK, STALE, BAD_TABLE, ABORTED = 0, 1, 2, 3
STATUS_TEXT = {
    STALE: "the trainer's tensor table changed (it restarted or registered anew) since this sink "
           "armed; receive again",
    BAD_TABLE: "the trainer refused this sink's table (a size or region did not match its tensors)",
    ABORTED: "the trainer aborted the push (see its log)",
}


class BadSink(Exception):
    """A sink region that is torn (read while the sink wrote it) or not a sink's."""


def region_name(publisher: str) -> str:
    return f"sluice.weights.sink/{publisher}"


def control_offset(n: int) -> int:
    return HEADER.size + n * ENTRY.size


def region_size(n: int) -> int:
    return control_offset(n) + CONTROL.size + n * PUSHED.size


def imm(arm: int, code: int) -> int:
    return ((arm & 0xFF) << 24) | code


def split_imm(value: int) -> Tuple[int, int]:
    return value >> 24, value & 0xFFFFFF


@dataclass(frozen=True)
class Entry:
    index: int
    region: int
    nbytes: int
    held: int  # version + 1, 0: unknown


@dataclass(frozen=True)
class Table:
    arm: int
    instance: int
    bucket_bytes: int
    rank: int
    token: int
    entries: Tuple[Entry, ...]


@dataclass(frozen=True)
class Control:
    status: int
    arm: int
    seq: int
    version: int
    instance: int
    pushed: Tuple[Tuple[int, int], ...]  # (entry, version)


def write_table(buf, *, arm: int, instance: int, bucket_bytes: int, rank: int, token: int,
                entries: Sequence[Entry]) -> None:
    """Write the table into the sink's own region buffer (a numpy uint8 array)."""
    body = b"".join(ENTRY.pack(e.index, e.region, e.nbytes, e.held) for e in entries)
    head = bytearray(HEADER.pack(MAGIC, FORMAT, 0, arm, instance, len(entries), bucket_bytes, rank, token, 0, 0))
    crc = zlib.crc32(body, zlib.crc32(bytes(head[_CRC_FIELDS])))
    struct.pack_into("<I", head, 64, crc)
    end = HEADER.size + len(body)
    buf[HEADER.size:end] = memoryview(body)
    buf[:HEADER.size] = memoryview(bytes(head))


def read_table(raw: bytes) -> Tuple[Table, int]:
    """The table and the arm the trainer last answered (its control block's). Raises BadSink."""
    if len(raw) < HEADER.size:
        raise BadSink(f"sink region of {len(raw)} bytes is shorter than its header")
    magic, fmt, _, arm, instance, n, bucket_bytes, rank, token, crc, _ = HEADER.unpack_from(raw, 0)
    if magic != MAGIC or fmt != FORMAT:
        raise BadSink(f"not a sink region (magic {magic!r}, format {fmt})")
    if n > (len(raw) - HEADER.size) // (ENTRY.size + PUSHED.size) or len(raw) < region_size(n):
        raise BadSink(f"sink table of {n} entries does not fit its {len(raw)}-byte region")
    body = raw[HEADER.size:control_offset(n)]
    if zlib.crc32(body, zlib.crc32(raw[_CRC_FIELDS])) != crc:
        raise BadSink("sink table read while the sink wrote it (crc mismatch)")
    entries = tuple(Entry(*ENTRY.unpack_from(body, i * ENTRY.size)) for i in range(n))
    served = read_control_arm(raw, n)
    return Table(arm, instance, bucket_bytes, rank, token, entries), served


def read_control_arm(raw: bytes, n: int) -> int:
    magic, _, _, arm = CONTROL.unpack_from(raw, control_offset(n))[:4]
    return arm if magic == PUSH_MAGIC else 0


def encode_control(*, status: int, arm: int, seq: int, version: int, instance: int,
                   pushed: Sequence[Tuple[int, int]]) -> bytes:
    return (CONTROL.pack(PUSH_MAGIC, FORMAT, status, arm, seq, version, instance, len(pushed), 0) +
            b"".join(PUSHED.pack(e, v) for e, v in pushed))


def read_control(raw, n: int) -> Control:
    """The control block in the sink's own region (landed before the imm that announced it)."""
    off = control_offset(n)
    magic, fmt, status, arm, seq, version, instance, count, _ = CONTROL.unpack_from(raw, off)
    if magic != PUSH_MAGIC or fmt != FORMAT:
        raise BadSink(f"the trainer's control block is not one (magic {bytes(magic)!r}, format {fmt})")
    if count > n:
        raise BadSink(f"the trainer's control block lists {count} pushed entries of {n}")
    base = off + CONTROL.size
    pushed: List[Tuple[int, int]] = [PUSHED.unpack_from(raw, base + i * PUSHED.size) for i in range(count)]
    if any(e >= n for e, _ in pushed) or len({e for e, _ in pushed}) != len(pushed):
        raise BadSink("the trainer's manifest names an entry twice or one the sink does not have")
    return Control(status, arm, seq, version, instance, tuple(pushed))


def encode_hello(token: int) -> bytes:
    return HELLO.pack(HELLO_MAGIC, token)


def read_hello(raw) -> int:
    """The token of a hello, or -1 if these bytes are not one."""
    magic, token = HELLO.unpack_from(raw, 0)
    return token if bytes(magic) == HELLO_MAGIC else -1
