"""What every engine adapter shares: the work (cells), the data pattern, the slot offsets,
the timed loop and the result lines, so that every engine moves the same bytes the same way.

A cell is (op, size, batch, concurrency, iterations): `iterations` batches of `batch`
messages of `size` bytes, at most `concurrency` batches outstanding, walking a
`footprint`-byte buffer slot by slot (message k of the cell uses slot k mod slots).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

import numpy as np

# Cells whose batch does not fit the footprint are not run: a batch of 64 x 16 MiB would need
# 1 GiB buffers per side and per engine, which says nothing a 64 MiB batch does not.
# PEERS_FOOTPRINT overrides it: the driver sets 16 MiB inside the SoftRoCE guest, where numpy
# builds a 64 MiB pattern in about 3 s under emulation (driver.py, rdma section).
FOOTPRINT = int(os.environ.get("PEERS_FOOTPRINT", 64 << 20))

# Every engine's buffers are the same kind of memory: numpy's arrays of 4 MiB and more ask for
# transparent huge pages (madvise), and native/peers_mem.h does the same for the C and C++
# adapters and the ceilings. PEERS_HUGEPAGES=0 turns it off for all of them.
HUGEPAGES = os.environ.get("PEERS_HUGEPAGES", "1") != "0"


def use_hugepages(on: bool = HUGEPAGES) -> None:
    """Makes numpy's large allocations ask for huge pages (or not), as peers_mem.h does."""
    try:
        from numpy._core import multiarray as ma  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core import multiarray as ma
    ma._set_madvise_hugepage(on)


@dataclass(frozen=True)
class Cell:
    op: str
    size: int
    batch: int
    conc: int
    iters: int

    def key(self) -> str:
        return f"{self.op}/{self.size}/{self.batch}/{self.conc}"


def iterations(size: int, batch: int, conc: int, budget: int) -> int:
    """Batches per cell: `budget` bytes, but at most 200 batches and 1024 messages (small
    messages are bound by the op rate, not by bytes: a peer at 1 ms per message would spend
    minutes on one cell), and at least two rounds of `conc` batches (and 4).

    A lone operation (batch 1, concurrency 1) runs up to 1,000 times, and at least 256 MiB's
    worth where `budget` is smaller: 200 lone 64 KiB operations took 4-20 ms, within the
    scheduler's transients on a 2-core host, and the same cell measured 650 or 2,100 MB/s from
    one run to the next (a TCP ping-pong of 64 KiB: 22 us per round trip over 200, 94 us over
    5,000; docs/peers.md)."""
    if batch == 1 and conc == 1:
        return int(max(min(1000, max(budget, 256 << 20) // size), 4))
    return int(max(min(budget // (size * batch), 200, 1024 // batch), 2 * conc, 4))


def make_cells(ops: Iterable[str], sizes: Iterable[int], shapes: Iterable[tuple[int, int]],
               budget: int, footprint: int = FOOTPRINT) -> list[Cell]:
    out = []
    for op in ops:
        for size in sizes:
            for batch, conc in shapes:
                if size * batch <= footprint:
                    out.append(Cell(op, size, batch, conc, iterations(size, batch, conc, budget)))
    return out


def cells_from_json(text: str) -> list[Cell]:
    return [Cell(**d) for d in json.loads(text)]


def cells_to_json(cells: list[Cell]) -> str:
    return json.dumps([asdict(c) for c in cells])


_PERIOD = 1 << 21  # ((j * 2654435761) >> 13) mod 256 repeats every 2^21 bytes


@functools.lru_cache(maxsize=1)
def _period() -> np.ndarray:
    x = np.arange(_PERIOD, dtype=np.uint64) * np.uint64(2654435761)
    return (x >> np.uint64(13)).astype(np.uint8)


def pattern(n: int, seed: int = 0) -> np.ndarray:
    """Bytes that differ between neighbouring slots and between seeds (a misplaced or stale
    copy fails the check): byte j (j = i + seed) is ((j * 2654435761) >> 13) + (j >> 21), mod
    256, as native/mpi_peer.c writes it. The first term repeats every 2 MiB, the second makes
    2 MiB blocks differ, so slots of >= 2 MiB differ too. Built by tiling one period (a
    64 MiB pattern costs a few memcpys, not seconds of 64-bit arithmetic per cell)."""
    s, b0 = seed % _PERIOD, seed // _PERIOD
    blocks = (s + n + _PERIOD - 1) // _PERIOD
    out = np.tile(_period(), blocks).reshape(blocks, _PERIOD)
    out += (np.arange(blocks, dtype=np.uint64) + np.uint64(b0)).astype(np.uint8)[:, None]
    return out.reshape(-1)[s: s + n]


def check_seed(cell: Cell) -> int:
    return cell.size * 7 + 1 + {"read": 0, "write": 1, "send": 2}[cell.op]


def slot_offsets(size: int, batch: int, count: int, footprint: int = FOOTPRINT) -> np.ndarray:
    """(count, batch) byte offsets: message j of batch i uses slot (i*batch + j) mod slots."""
    slots = max(1, footprint // size)
    k = np.arange(count, dtype=np.uint64)[:, None] * np.uint64(batch) + np.arange(batch, dtype=np.uint64)[None, :]
    return (k % np.uint64(slots)) * np.uint64(size)


def warmup_batches(cell: Cell) -> int:
    return min(cell.iters // 10 + 1, 8)


def timed_loop(cell: Cell, submit: Callable[[np.ndarray], object], wait: Callable[[object], None],
               footprint: int = FOOTPRINT, sync: Callable[[], None] | None = None) -> tuple[float, float]:
    """Runs warm-up then `cell.iters` batches with at most `cell.conc` outstanding.
    Returns (seconds, mean batch latency in ms: submit until its completion is seen).
    `sync`, called between the warm-up and the clock's start: a SEND adapter waits there until
    the target took the warm-up (native/mpi_peer.c's MPI_Barrier), so that the clock does not
    run while the target still checks the last cell's bytes (a send that completes once
    queued would otherwise find no receive posted)."""
    warm = warmup_batches(cell)
    offs = slot_offsets(cell.size, cell.batch, warm + cell.iters, footprint)
    inflight: collections.deque = collections.deque()
    lat = 0.0

    def drain_one() -> None:
        nonlocal lat
        token, t = inflight.popleft()
        wait(token)
        lat += time.perf_counter() - t

    def post(row) -> None:
        t = time.perf_counter()  # before submit: posting is part of an operation's latency
        inflight.append((submit(row), t))

    for i in range(warm):
        if len(inflight) >= cell.conc:
            drain_one()
        post(offs[i])
    while inflight:
        drain_one()
    if sync is not None:
        sync()
    lat = 0.0
    t0 = time.perf_counter()
    for i in range(cell.iters):
        if len(inflight) >= cell.conc:
            drain_one()
        post(offs[warm + i])
    while inflight:
        drain_one()
    return time.perf_counter() - t0, lat / cell.iters * 1e3


def run_one_sided(c: Cell, local: np.ndarray, check: np.ndarray,
                  xfer: Callable[[str, int, np.ndarray, int], object], wait: Callable[[object], None],
                  engine: str) -> tuple[float, float, bool]:
    """One READ or WRITE cell of an engine that moves data one-sided by address (Mooncake,
    NIXL): the timed loop, then the byte check of one batch's slots through the same engine
    (a READ into `check`; a WRITE of a fresh pattern read back), then the target restored."""
    if c.op not in ("read", "write"):
        raise NotImplementedError(f"{engine} moves data one-sided only (READ, WRITE)")
    secs, lat = timed_loop(c, lambda offs: xfer(c.op, local.ctypes.data, offs, c.size), wait)
    n = min(c.batch, max(1, FOOTPRINT // c.size))
    offs = np.arange(n, dtype=np.uint64) * np.uint64(c.size)
    if c.op == "read":
        wait(xfer("read", check.ctypes.data, offs, c.size))
        return secs, lat, bool(np.array_equal(check[: n * c.size], local[: n * c.size]))
    local[: n * c.size] = pattern(n * c.size, check_seed(c))
    wait(xfer("write", local.ctypes.data, offs, c.size))
    wait(xfer("read", check.ctypes.data, offs, c.size))
    ok = bool(np.array_equal(check[: n * c.size], local[: n * c.size]))
    local[: n * c.size] = pattern(n * c.size)  # = pattern(FOOTPRINT)[:n * size]
    wait(xfer("write", local.ctypes.data, offs, c.size))
    return secs, lat, ok


def emit(cell: Cell, secs: Optional[float], lat_ms: Optional[float], checked: Optional[bool],
         error: str = "", **extra) -> None:
    """One RESULT line on stdout for the driver."""
    d = {"op": cell.op, "size": cell.size, "batch": cell.batch, "conc": cell.conc, "iters": cell.iters,
         "secs": secs, "lat_ms": lat_ms, "checked": checked, "error": error}
    if secs:
        d["mbps"] = cell.size * cell.batch * cell.iters / secs / 1e6
    d.update(extra)
    print("RESULT " + json.dumps(d), flush=True)


def run_cells(cells: list[Cell], run_one: Callable[[Cell], tuple[float, float, bool]]) -> int:
    """Runs every cell, one RESULT line each; a failing cell is reported, not fatal."""
    bad = 0
    for c in cells:
        try:
            secs, lat, ok = run_one(c)
            emit(c, secs, lat, ok, "" if ok else "byte check failed")
            bad += not ok
        except Exception as e:  # the reason goes into the table
            emit(c, None, None, None, f"{type(e).__name__}: {e}"[:300])
            bad += 1
    return 1 if bad else 0


def ready(info: object) -> None:
    """The target's one line to the driver: everything the initiator needs to reach it."""
    print("READY " + json.dumps(info), flush=True)


def wait_stdin_eof() -> None:
    """Targets live until the driver closes their stdin."""
    try:
        while sys.stdin.read(4096):
            pass
    except Exception:
        pass
