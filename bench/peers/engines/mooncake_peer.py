"""Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda), P2PHANDSHAKE metadata
(no server). TCP transport with default settings, or with MC_TCP_ENABLE_CONNECTION_POOL=1 (the
driver sets the variable); inside the SoftRoCE guest the RDMA transport (settings: protocol
"rdma", device "rxe0", host RXE_IP; the driver sets MC_GID_INDEX and MC_NUM_QP_PER_EP).
Batches go through batch_transfer_async_read/write, and get_batch_transfer_status waits for one
batch, so `conc` batches are in flight."""

from __future__ import annotations

import numpy as np

from common import FOOTPRINT, Cell, pattern, ready, run_cells, run_one_sided, wait_stdin_eof


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("mooncake-transfer-engine-non-cuda")


def _host(settings: dict) -> str:
    return settings.get("host", "127.0.0.1")


def _engine(settings: dict):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    proto, dev = settings.get("protocol", "tcp"), settings.get("device", "")
    rc = te.initialize(_host(settings), "P2PHANDSHAKE", proto, dev)
    if rc != 0:
        raise RuntimeError(f"mooncake TransferEngine.initialize({proto}{', ' + dev if dev else ''}) returned {rc}")
    return te


def _register(te, a: np.ndarray) -> None:
    if te.register_memory(a.ctypes.data, a.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")


def target(settings: dict, cells: list[Cell]) -> int:
    te = _engine(settings)
    buf = pattern(FOOTPRINT)
    _register(te, buf)
    ready({"peer": f"{_host(settings)}:{te.get_rpc_port()}", "addr": buf.ctypes.data})
    wait_stdin_eof()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    te = _engine(settings)
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
