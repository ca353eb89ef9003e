"""torch.distributed with the gloo backend (CPU, loopback TCP): isend/irecv only. Rank 0 is
the initiator (sender), rank 1 the target (receiver, which checks the bytes). A batch is
`batch` isend calls; `conc` batches in flight."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import numpy as np

from common import FOOTPRINT, Cell, check_seed, pattern, ready, run_cells, slot_offsets, timed_loop, \
    wait_stdin_eof, warmup_batches


def version() -> str:
    import torch

    return torch.__version__


def _group(port: int, rank: int):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 1, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    return torch, dist, store


def target(settings: dict, cells: list[Cell]) -> int:
    import socket

    with socket.socket() as s:  # a free port for the store (rank 1 hosts it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready({"port": port})
    torch, dist, _store = _group(port, 1)
    buf = np.zeros(FOOTPRINT, dtype=np.uint8)
    t = torch.from_numpy(buf)
    for c in cells:
        if c.op != "send":
            continue
        warm = warmup_batches(c)
        offs = slot_offsets(c.size, c.batch, warm + c.iters)
        for w in [dist.irecv(t[int(o): int(o) + c.size], src=0) for row in offs[:warm] for o in row]:
            w.wait()
        post = lambda row: [dist.irecv(t[int(o): int(o) + c.size], src=0) for o in row]
        pending = [post(row) for row in offs[warm: warm + c.conc]]  # posted before the start
        dist.barrier()  # the warm-up arrived: the initiator starts its clock (timed_loop's sync)
        for row in offs[warm + c.conc:]:
            for w in pending.pop(0):
                w.wait()
            pending.append(post(row))
        for ws in pending:
            for w in ws:
                w.wait()
        n = min(c.batch, max(1, FOOTPRINT // c.size))
        for w in [dist.irecv(t[j * c.size: (j + 1) * c.size], src=0) for j in range(n)]:
            w.wait()
        ok = bool(np.array_equal(buf[: n * c.size], pattern(n * c.size, check_seed(c))))
        print("CHECK " + json.dumps({"key": c.key(), "ok": ok}), flush=True)
    wait_stdin_eof()
    dist.destroy_process_group()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    torch, dist, _store = _group(int(info["port"]), 0)
    local = pattern(FOOTPRINT)
    t = torch.from_numpy(local)

    def submit(offs, size):
        return [dist.isend(t[int(o): int(o) + size], dst=1) for o in offs]

    def wait(ws):
        for w in ws:
            w.wait()

    def run_one(c: Cell):
        if c.op != "send":
            raise NotImplementedError("gloo has two-sided send/recv only")
        secs, lat = timed_loop(c, lambda offs: submit(offs, c.size), wait, sync=dist.barrier)
        n = min(c.batch, max(1, FOOTPRINT // c.size))
        local[: n * c.size] = pattern(n * c.size, check_seed(c))
        wait(submit(np.arange(n) * c.size, c.size))
        local[: n * c.size] = pattern(FOOTPRINT)[: n * c.size]
        return secs, lat, True  # the receiver checks and prints CHECK

    rc = run_cells([c for c in cells if c.op == "send"], run_one)
    dist.destroy_process_group()
    return rc
