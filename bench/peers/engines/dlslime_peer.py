"""DLSlime 0.1.23 (PyPI) TcpEndpoint, or inside the SoftRoCE guest RDMAEndpoint (settings
"endpoint": "rdma", "device": "rxe0", "qps": QPs; the driver sets SLIME_GID_INDEX): read/write
batches of (local mr, remote mr, remote offset, local offset, length), one future per batch,
`conc` futures in flight."""

from __future__ import annotations

import numpy as np

from common import FOOTPRINT, Cell, check_seed, pattern, ready, run_cells, timed_loop, wait_stdin_eof


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("dlslime")


def _endpoint(settings: dict):
    import dlslime

    if settings.get("endpoint") == "rdma":
        return dlslime.RDMAEndpoint(device_name=settings.get("device", ""), ib_port=1, link_type="RoCE",
                                    num_qp=int(settings.get("qps", 1)))
    return dlslime.TcpEndpoint("127.0.0.1", 0)


def target(settings: dict, cells: list[Cell]) -> int:
    import json
    import sys

    ep = _endpoint(settings)
    buf = pattern(FOOTPRINT)
    ep.register_memory_region("peers", buf.ctypes.data, 0, buf.nbytes)
    ready({"endpoint": ep.endpoint_info(), "mr": ep.mr_info()})
    # The initiator's endpoint info comes back on stdin (the endpoint pair connects both ways).
    line = sys.stdin.readline()
    if line.strip():
        ep.connect(json.loads(line))
    wait_stdin_eof()
    ep.shutdown()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    ep = _endpoint(settings)
    local, check = pattern(FOOTPRINT), np.zeros(FOOTPRINT, dtype=np.uint8)
    lh = ep.register_memory_region("local", local.ctypes.data, 0, local.nbytes)
    chh = ep.register_memory_region("check", check.ctypes.data, 0, check.nbytes)
    print("PEERINFO " + __import__("json").dumps(ep.endpoint_info()), flush=True)
    ep.connect(info["endpoint"])
    rh = ep.register_remote_memory_region("peers", info["mr"]["peers"])

    def xfer(op, handle, offs, size):
        assign = [(handle, rh, int(o), int(o), size) for o in offs]
        return (ep.read if op == "read" else ep.write)(assign)

    def wait(f):
        rc = f.wait()
        if rc != 0:
            raise RuntimeError(f"DLSlime transfer failed ({rc})")

    def run_one(c: Cell):
        if c.op not in ("read", "write"):
            raise NotImplementedError("DLSlime SEND is not wired in this slice")
        secs, lat = timed_loop(c, lambda offs: xfer(c.op, lh, offs, c.size), wait)
        n = min(c.batch, max(1, FOOTPRINT // c.size))
        offs = np.arange(n, dtype=np.uint64) * np.uint64(c.size)
        if c.op == "read":
            wait(xfer("read", chh, offs, c.size))
            return secs, lat, bool(np.array_equal(check[: n * c.size], local[: n * c.size]))
        local[: n * c.size] = pattern(n * c.size, check_seed(c))
        wait(xfer("write", lh, offs, c.size))
        wait(xfer("read", chh, offs, c.size))
        ok = bool(np.array_equal(check[: n * c.size], local[: n * c.size]))
        local[: n * c.size] = pattern(n * c.size)
        wait(xfer("write", lh, offs, c.size))
        return secs, lat, ok

    try:
        return run_cells(cells, run_one)
    finally:
        ep.shutdown()
