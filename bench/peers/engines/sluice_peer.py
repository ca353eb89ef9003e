"""Sluice through its Python API (the wheel built from this checkout): tcp, shm (CMA on the
caller's memory), shm on engine-allocated memfd memory, and rdma inside the SoftRoCE guest
(settings "host": the address to listen on, the guest's RXE_IP; the rdma transport finds rxe0
and its RoCE v2 GID by itself)."""

from __future__ import annotations

import collections
import json

import numpy as np

from common import FOOTPRINT, Cell, check_seed, pattern, ready, run_cells, slot_offsets, timed_loop, \
    wait_stdin_eof, warmup_batches

NAME = "peers"
STASH_BYTES = 16 * FOOTPRINT  # a bound, not an allocation: memory follows the bytes that wait


def version() -> str:
    import sluice

    return sluice.__version__


def _engine(settings: dict, listen: bool):
    import sluice

    kw = {"transports": [settings["transport"]], "channels": settings.get("channels", 2)}
    if listen:
        kw["listen"] = f"{settings.get('host', '127.0.0.1')}:0"
        # The target posts the SEND cells' receives while the READ/WRITE cells run first:
        # a receive waits until the endpoint closes, not the default 30 s.
        kw["recv_timeout_ms"] = 0
        # An eager SEND completes once the receiver has stashed it, so at a cell's start
        # (the target still checking the last cell) the initiator's conc x batch messages,
        # up to 512 MiB, can all arrive before their receives: room for them, or the default
        # 256 MiB bound refuses one (RemoteError rows seen on a loaded host).
        kw["max_unexpected_bytes"] = STASH_BYTES
    return sluice.Engine(**kw)


def _buffer(engine, memfd: bool, name=None):
    if memfd:
        return engine.allocate(FOOTPRINT, name=name)
    a = np.zeros(FOOTPRINT, dtype=np.uint8)
    return a, engine.register(a, name=name)


def recv_checks(ep, buf, handle, sync_handle, cells: list[Cell]) -> None:
    """Receives every SEND cell's messages in order (the k-th send meets the k-th recv),
    then the check batch, and prints one CHECK line per cell."""
    for i, c in enumerate(cells):
        if c.op != "send":
            continue
        warm = warmup_batches(c)
        offs = slot_offsets(c.size, c.batch, warm + c.iters)
        for f in [ep.recv(handle, int(off), c.size) for row in offs[:warm] for off in row]:
            f.wait()
        # A window of receives kept posted ahead (the oldest waited for, then the next one
        # posted), so that few messages arrive before their receive; the first window is
        # posted before the initiator is told to start.
        depth, pending = c.batch * c.conc * 2, collections.deque()
        timed = [int(off) for row in offs[warm:] for off in row]
        for off in timed[:depth]:
            pending.append(ep.recv(handle, off, c.size))
        # The warm-up arrived: the initiator starts its clock (timed_loop's sync; the engine's
        # own SEND, as native/mpi_peer.c's MPI_Barrier and native/sluice_peer.cpp's pipe).
        ep.send(sync_handle, 0, 1).wait()
        for off in timed[depth:]:
            pending.popleft().wait()
            pending.append(ep.recv(handle, off, c.size))
        for f in pending:
            f.wait()
        n = min(c.batch, max(1, FOOTPRINT // c.size))
        futs = [ep.recv(handle, j * c.size, c.size) for j in range(n)]
        for f in futs:
            f.wait()
        # Between cells the target does no more than gloo's: the initiator's next cell is
        # already running, and on 2 cores every extra pass over 64 MiB here (a flatnonzero,
        # a restore) was time taken from that cell's few messages (16 MiB: 4 timed sends).
        want = pattern(n * c.size, check_seed(c))
        ok = bool(np.array_equal(buf[: n * c.size], want))
        detail = ""
        if not ok:  # what was there instead: an older message (the base pattern) or other bytes
            bad = np.flatnonzero(buf[: n * c.size] != want)
            stale = int(np.count_nonzero(buf[bad] == pattern(n * c.size)[bad]))
            detail = (f"{len(bad)} of {n * c.size} bytes differ, first at offset {int(bad[0])}, last at "
                      f"{int(bad[-1])}; {stale} of them hold the earlier messages' pattern")
        if any(d.op != "send" for d in cells[i + 1:]):
            buf[: n * c.size] = pattern(n * c.size)  # the target's pattern again, for later reads
        print("CHECK " + json.dumps({"key": c.key(), "ok": ok, "detail": detail}), flush=True)


def target(settings: dict, cells: list[Cell]) -> int:
    engine = _engine(settings, True)
    buf, handle = _buffer(engine, settings.get("memfd", False), NAME)
    buf[:] = pattern(FOOTPRINT)
    ready({"address": engine.listen_address})
    ep = engine.accept(60)
    if ep is None:
        raise SystemExit("sluice target: no initiator connected within 60 s")
    sync = np.zeros(64, dtype=np.uint8)
    recv_checks(ep, buf, handle, engine.register(sync), cells)
    wait_stdin_eof()
    engine.close()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    engine = _engine(settings, False)
    ep = engine.connect(info["address"], transport=settings["transport"])
    remote = int(ep.remote_region(NAME))
    local, lh = _buffer(engine, settings.get("memfd", False))
    check = np.zeros(FOOTPRINT, dtype=np.uint8)
    ch = engine.register(check)
    local[:] = pattern(FOOTPRINT)
    L = int(lh)

    def batch_of(offs, size, lhandle=L):
        # A short batch as a list of tuples (the API's fast path: building a numpy array costs
        # about 2 us, a third of a lone 4 KiB read); a long one as an (N, 5) uint64 array.
        if len(offs) <= 8:
            return [(lhandle, o, remote, o, size) for o in offs.tolist()]
        arr = np.empty((len(offs), 5), dtype=np.uint64)
        arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4] = lhandle, offs, remote, offs, size
        return arr

    def run_one(c: Cell):
        if c.op == "send":
            submit = lambda offs: [ep.send(L, int(o), c.size) for o in offs]
            wait = lambda fs: [f.result() for f in fs]
        else:
            fn = ep.read if c.op == "read" else ep.write
            submit = lambda offs: fn(batch_of(offs, c.size))
            wait = lambda f: f.result()
        # SEND cells: the target's one-byte SEND says it took the warm-up (recv_checks).
        sync = (lambda: ep.recv(ch, 0, 1).result()) if c.op == "send" else None
        secs, lat = timed_loop(c, submit, wait, sync=sync)
        n = min(c.batch, max(1, FOOTPRINT // c.size))
        offs = np.arange(n, dtype=np.uint64) * np.uint64(c.size)
        seed = check_seed(c)
        if c.op == "read":  # the target's region holds pattern(FOOTPRINT)
            ep.read(batch_of(offs, c.size, int(ch))).result()
            ok = bool(np.array_equal(check[: n * c.size], pattern(n * c.size)))
        else:
            local[: n * c.size] = pattern(n * c.size, seed)
            if c.op == "send":
                for f in [ep.send(L, int(o), c.size) for o in offs]:
                    f.result()
                ok = True  # the receiver checks and prints CHECK
            else:
                ep.write(batch_of(offs, c.size)).result()
                ep.read(batch_of(offs, c.size, int(ch))).result()
                ok = bool(np.array_equal(check[: n * c.size], local[: n * c.size]))
            local[: n * c.size] = pattern(n * c.size)
            if c.op == "write":  # restore the target's pattern for later READ checks
                ep.write(batch_of(offs, c.size)).result()
        return secs, lat, ok

    try:
        return run_cells(cells, run_one)
    finally:
        engine.close()
