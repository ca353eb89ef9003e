"""The metadata region a :class:`~sluice.weights.WeightPublisher` exposes and a
:class:`~sluice.weights.WeightSubscriber` READs (one-sided; no trainer round trip).

Layout (little endian), registered as ``sluice.weights/<name>/meta``::

    0   magic      8s  b"SLWEIGHT"
    8   format     u32 1
    12  flags      u32 0
    16  seq        u64 even: stable; odd: the trainer is changing tensors (or has not published)
    24  version    u64 the version of the last publish()
    32  n          u64 number of tensors
    40  json_len   u64 bytes of the JSON table after the versions
    48  crc        u32 zlib.crc32 of (seq, version, n, json_len, instance) and the body
    52  pad        u32
    56  instance   u64 random per publisher: a restarted trainer has a new one
    64  versions   u64[n] the version at which each tensor last changed
    ..  json       {"name": ..., "tensors": [{"name", "dtype", "shape", "nbytes", "region", "offset"}]}

The JSON part is written once per register() call; publish() rewrites only the versions,
seq and version, so it costs microseconds whatever the model size. A reader checks magic,
an even seq and the crc: a read that raced a publish fails the crc (or sees an odd seq) and
is retried.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

MAGIC = b"SLWEIGHT"
FORMAT = 1
HEADER = struct.Struct("<8sIIQQQQIIQ")
HEADER_SIZE = HEADER.size  # 64
_CRC_FIELDS = struct.Struct("<QQQQQ")


def meta_region_name(name: str) -> str:
    return f"sluice.weights/{name}/meta"


def tensor_region_name(name: str, index: int) -> str:
    return f"sluice.weights/{name}/t{index}"


def parse_meta_region_name(region: str) -> Optional[str]:
    """The publisher name of a metadata region's name, else None."""
    if region.startswith("sluice.weights/") and region.endswith("/meta"):
        return region[len("sluice.weights/"):-len("/meta")]
    return None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # torch dtype without "torch.": "bfloat16", "float8_e4m3fn"
    shape: Tuple[int, ...]
    nbytes: int
    region: Optional[str]  # None for a 0-byte tensor (nothing to register)
    offset: int


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of the metadata region."""

    seq: int
    version: int
    instance: int
    publisher: str
    tensors: List[TensorInfo]
    versions: List[int]

    def index(self) -> dict:
        return {t.name: i for i, t in enumerate(self.tensors)}


class TornRead(Exception):
    """The bytes read raced a publish (odd seq or crc mismatch): read again."""


class BadMeta(Exception):
    """The region does not hold sluice.weights metadata of a format this reader knows."""


def encode_table(publisher: str, tensors: Sequence[TensorInfo]) -> bytes:
    table = {"name": publisher, "tensors": [
        {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
         "region": t.region, "offset": t.offset} for t in tensors]}
    return json.dumps(table, separators=(",", ":")).encode()


def region_size(n: int, json_len: int) -> int:
    return HEADER_SIZE + 8 * n + json_len


def _crc(seq: int, version: int, n: int, json_len: int, instance: int, body) -> int:
    return zlib.crc32(body, zlib.crc32(_CRC_FIELDS.pack(seq, version, n, json_len, instance))) & 0xFFFFFFFF


def write(buf, *, seq: int, version: int, instance: int, versions: Sequence[int], table: Optional[bytes]) -> None:
    """Write the region into ``buf`` (a writable uint8 numpy array). ``table`` None: the JSON
    part is already there (publish() rewrites only the versions). The header goes last, so a
    reader that sees the new seq with a matching crc saw the whole body."""
    import numpy as np

    n = len(versions)
    if table is None:
        json_len = HEADER.unpack_from(buf, 0)[6]
    else:
        json_len = len(table)
        buf[HEADER_SIZE + 8 * n:HEADER_SIZE + 8 * n + json_len] = np.frombuffer(table, dtype=np.uint8)
    buf[HEADER_SIZE:HEADER_SIZE + 8 * n] = np.asarray(versions, dtype="<u8").view(np.uint8)
    body = buf[HEADER_SIZE:HEADER_SIZE + 8 * n + json_len].tobytes()
    crc = _crc(seq, version, n, json_len, instance, body)
    buf[:HEADER_SIZE] = np.frombuffer(HEADER.pack(MAGIC, FORMAT, 0, seq, version, n, json_len, crc, 0, instance),
                                      dtype=np.uint8)


def set_seq(buf, seq: int) -> None:
    """Mark the region odd (changing) without touching the rest: readers then retry."""
    import numpy as np

    buf[16:24] = np.frombuffer(struct.pack("<Q", seq), dtype=np.uint8)


def header_seq(raw: bytes) -> int:
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise BadMeta("not a sluice.weights metadata region (bad magic)")
    return HEADER.unpack_from(raw, 0)[3]


def read(raw: bytes) -> Snapshot:
    """Parse a full read of the region. Raises TornRead (retry) or BadMeta."""
    if len(raw) < HEADER_SIZE:
        raise BadMeta(f"metadata region too small ({len(raw)} bytes)")
    magic, fmt, _flags, seq, version, n, json_len, crc, _pad, instance = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise BadMeta("not a sluice.weights metadata region (bad magic)")
    if fmt != FORMAT:
        raise BadMeta(f"metadata format {fmt} (this sluice reads format {FORMAT}): upgrade the receiver")
    if seq % 2:
        raise TornRead("the trainer is changing its tensors (or has not published yet)")
    end = region_size(n, json_len)
    if end > len(raw):
        raise TornRead(f"metadata of {end} bytes does not fit the {len(raw)} bytes read")
    body = raw[HEADER_SIZE:end]
    if _crc(seq, version, n, json_len, instance, body) != crc:
        raise TornRead("metadata checksum mismatch (read raced a publish)")
    versions = list(struct.unpack_from(f"<{n}Q", raw, HEADER_SIZE))
    try:
        table = json.loads(bytes(raw[HEADER_SIZE + 8 * n:end]))
        tensors = [TensorInfo(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]), int(t["nbytes"]),
                              t["region"], int(t["offset"])) for t in table["tensors"]]
        publisher = str(table["name"])
    except (ValueError, KeyError, TypeError) as e:
        raise BadMeta(f"metadata table does not parse: {e}") from None
    if len(tensors) != n:
        raise BadMeta(f"metadata lists {len(tensors)} tensors, header says {n}")
    return Snapshot(seq, version, instance, publisher, tensors, versions)
