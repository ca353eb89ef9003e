"""docs/wire-protocol.md defines the two header checks and gives test vectors (computed by
the engine's own code, see tests/fuzz/wire_vectors.cpp). Recompute every vector from the
algorithm as the document states it, so that the document cannot drift from the wire: a
third party must be able to implement a client from the document alone (issue 18, class 7)."""
import os
import re
import struct

import pytest

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "wire-protocol.md")
M64 = (1 << 64) - 1
# A table row with a hex column and a check column: | what | `hex` | `0x........` |
ROW = re.compile(r"^\|[^|]*\|\s*`([0-9a-f]+)`\s*\|\s*`0x([0-9a-f]{8})`\s*\|\s*$")


def doc_text():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def vectors(size):
    return [(bytes.fromhex(m.group(1)), int(m.group(2), 16))
            for m in map(ROW.match, doc_text().splitlines()) if m and len(m.group(1)) == 2 * size]


# The algorithms exactly as section 1.1 and 2.1 of the document state them.
def bootstrap_check(magic, version, kind, length):
    x = ((magic << 32) ^ (version << 16) ^ kind ^ (length << 24)) & M64
    return ((x * 0x9E3779B97F4A7C15) & M64) >> 32


def frame_check(header52):
    (reserved,) = struct.unpack_from("<I", header52, 48)
    x = 0x243F6A8885A308D3 ^ reserved
    for (v,) in struct.iter_unpack("<Q", header52[:48]):
        x = ((x ^ v) * 0x9E3779B97F4A7C15) & M64
        x ^= x >> 29
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def test_the_document_states_the_constants():
    text = doc_text()
    for const in ("0x42434c53", "0x46434c53", "0x9e3779b97f4a7c15", "0x243f6a8885a308d3", "x >> 29",
                  "length << 24", "version << 16", "magic << 32", "x >> 32"):
        assert const in text, const


def test_bootstrap_vectors():
    vs = vectors(16)
    assert len(vs) >= 4, "the bootstrap test vectors are missing from the document"
    for header, check in vs:
        magic, version, kind, length, carried = struct.unpack("<IHHII", header)
        assert magic == 0x42434C53 and version == 2 and 1 <= kind <= 5
        assert carried == check, f"{header.hex()}: bytes 12-15 hold {carried:#x}, the table says {check:#x}"
        assert bootstrap_check(magic, version, kind, length) == check, header.hex()
    # the vectors exercise a length that reaches the magic's bits (length << 24 >= 2**32)
    assert any(struct.unpack_from("<I", h, 8)[0] >= 256 for h, _ in vs)


def test_frame_vectors():
    vs = vectors(52)
    assert len(vs) >= 5, "the frame test vectors are missing from the document"
    for header, check in vs:
        magic, type_ = struct.unpack_from("<IB", header)
        assert magic == 0x46434C53 and 1 <= type_ <= 10
        assert frame_check(header) == check, header.hex()


@pytest.mark.parametrize("field,offset,size", [("type", 4, 1), ("flags", 5, 1), ("status", 6, 2), ("imm", 8, 4),
                                               ("aux", 12, 4), ("op_id", 16, 8), ("region", 24, 8),
                                               ("offset", 32, 8), ("length", 40, 8), ("reserved", 48, 4)])
def test_every_frame_field_is_covered_by_the_check(field, offset, size):
    # a flipped bit in any field of a documented vector changes the check
    header, check = vectors(52)[0]
    for bit in range(size * 8):
        b = bytearray(header)
        b[offset + bit // 8] ^= 1 << (bit % 8)
        assert frame_check(bytes(b)) != check, f"{field} bit {bit}"


def test_field_tables_match_the_vectors():
    # the table of section 2 and the struct layout used above agree: a WRITE vector decodes to
    # what its row says (op 7, region 1, offset 4096, 100 bytes, LANE_END)
    header, _ = vectors(52)[0]
    magic, type_, flags, status, imm, aux, op_id, region, offset, length, reserved = struct.unpack(
        "<IBBHIIQQQQI", header)
    assert (type_, flags, op_id, region, offset, length, reserved) == (1, 1, 7, 1, 4096, 100, 0)
