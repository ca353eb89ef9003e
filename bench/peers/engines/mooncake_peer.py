"""Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda), TCP transport,
P2PHANDSHAKE metadata (no server). Default settings, or with MC_TCP_ENABLE_CONNECTION_POOL=1
(the driver sets the variable). Batches go through batch_transfer_async_read/write, and
get_batch_transfer_status waits for one batch, so `conc` batches are in flight."""

from __future__ import annotations

import numpy as np

from common import FOOTPRINT, Cell, pattern, ready, run_cells, run_one_sided, wait_stdin_eof


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("mooncake-transfer-engine-non-cuda")


def _engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake TransferEngine.initialize(tcp) returned {rc}")
    return te


def _register(te, a: np.ndarray) -> None:
    if te.register_memory(a.ctypes.data, a.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")


def target(settings: dict, cells: list[Cell]) -> int:
    te = _engine()
    buf = pattern(FOOTPRINT)
    _register(te, buf)
    ready({"peer": f"127.0.0.1:{te.get_rpc_port()}", "addr": buf.ctypes.data})
    wait_stdin_eof()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    te = _engine()
    peer, raddr = info["peer"], int(info["addr"])
    local, check = pattern(FOOTPRINT), np.zeros(FOOTPRINT, dtype=np.uint8)
    _register(te, local)
    _register(te, check)

    def xfer(op, base, offs, size):
        fn = te.batch_transfer_async_read if op == "read" else te.batch_transfer_async_write
        o = [int(x) for x in offs]
        bid = fn(peer, [base + x for x in o], [raddr + x for x in o], [size] * len(o))
        if bid == 0 or bid < 0:
            raise RuntimeError(f"mooncake batch_transfer_async_{op} failed ({bid})")
        return bid

    def wait(bid):
        rc = te.get_batch_transfer_status([bid])
        if rc != 0:
            raise RuntimeError(f"mooncake transfer failed ({rc})")

    def run_one(c: Cell):
        return run_one_sided(c, local, check, xfer, wait, "mooncake")

    return run_cells(cells, run_one)
