"""NIXL (PyPI nixl 1.5.1) with its UCX backend; the driver picks UCX's transports with
UCX_TLS (tcp, sm, cma). One transfer handle per batch (initialize_xfer, transfer,
check_xfer_state), `conc` handles in flight."""

from __future__ import annotations

import base64
import os
import time

import numpy as np

from common import FOOTPRINT, Cell, pattern, ready, run_cells, run_one_sided, wait_stdin_eof

# One transfer of <= 64 MiB that takes longer than this has hung (seen with UCX_TLS=tcp, sm and
# cma WRITEs here); the cell says so and the agent's later cells are not run, instead of the
# whole engine waiting for the driver's round timeout.
XFER_TIMEOUT_S = 10.0


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("nixl")


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target(settings: dict, cells: list[Cell]) -> int:
    agent = _agent("peers-target")
    buf = pattern(FOOTPRINT)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    ready({"addr": buf.ctypes.data, "meta": base64.b64encode(agent.get_agent_metadata()).decode()})
    wait_stdin_eof()
    return 0


def initiator(settings: dict, cells: list[Cell], info: dict) -> int:
    agent = _agent("peers-initiator")
    peer = agent.add_remote_agent(base64.b64decode(info["meta"]))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    raddr = int(info["addr"])
    local, check = pattern(FOOTPRINT), np.zeros(FOOTPRINT, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, ""), (check.ctypes.data, check.nbytes, 0, "")],
                          "DRAM")

    def xfer(op, base, offs, size):
        offs = np.asarray(offs, dtype=np.uint64)
        ln, dev = np.full_like(offs, size), np.zeros_like(offs)
        ld = np.stack([np.uint64(base) + offs, ln, dev], axis=1)
        rd = np.stack([np.uint64(raddr) + offs, ln, dev], axis=1)
        h = agent.initialize_xfer("READ" if op == "read" else "WRITE", agent.get_xfer_descs(ld, "DRAM"),
                                  agent.get_xfer_descs(rd, "DRAM"), peer)
        if agent.transfer(h) == "ERR":
            raise RuntimeError("NIXL transfer failed to post")
        return h

    stuck = []  # a transfer that never completed leaves the agent unusable for later cells

    def wait(h):
        deadline = time.monotonic() + XFER_TIMEOUT_S
        while True:
            s = agent.check_xfer_state(h)
            if s == "DONE":
                break
            if s == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if time.monotonic() > deadline:
                stuck.append(True)
                raise TimeoutError(f"NIXL transfer not DONE after {XFER_TIMEOUT_S:.0f} s "
                                   f"(UCX_TLS={os.environ.get('UCX_TLS', '')})")
        agent.release_xfer_handle(h)

    def run_one(c: Cell):
        if stuck:
            raise RuntimeError("not run: an earlier transfer of this agent never completed")
        return run_one_sided(c, local, check, xfer, wait, "NIXL")

    return run_cells(cells, run_one)
