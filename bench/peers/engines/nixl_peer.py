"""NIXL (PyPI nixl 1.5.1) with its UCX backend; the driver picks UCX's transports with
UCX_TLS (tcp, sm, cma; rc inside the SoftRoCE guest, with UCX_NET_DEVICES=rxe0:1 and
UCX_IB_GID_INDEX). One transfer handle per batch (initialize_xfer, transfer,
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


def _api():
    """nixl._api as the meta package `nixl` picks it, without its last resort: with a CPU-only
    torch installed (for gloo) `import nixl` imports all of torch to learn that there is no CUDA
    (about 1 s here, 40-90 s under the SoftRoCE guest's emulation), then takes nixl_cu13, else
    nixl_cu12. Where torch's CUDA version is known from disk, the meta package decides."""
    try:
        from nixl_meta_utils import _torch_cuda_version_from_disk

        if _torch_cuda_version_from_disk() is None:
            import importlib

            for mod in ("nixl_cu13", "nixl_cu12"):
                try:
                    return importlib.import_module(f"{mod}._api")
                except ModuleNotFoundError as e:
                    if e.name != mod:
                        raise
    except ImportError:
        pass
    import nixl._api

    return nixl._api


def _verbs_devices(api) -> str:
    """How many RDMA devices the libibverbs bundled in the NIXL wheel lists (UCX's verbs
    transports go through it), and the system's: why UCX found no rc device."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(api.__file__)),
                                  api.__name__.split(".")[0] + ".libs", "libibverbs-*.so*"))
    out = []
    for label, path in [("NIXL's bundled libibverbs", p) for p in libs[:1]] + [("the system's", "libibverbs.so.1")]:
        try:
            lib = ctypes.CDLL(path)
            lib.ibv_get_device_list.restype = ctypes.c_void_p
            n = ctypes.c_int(0)
            lst = lib.ibv_get_device_list(ctypes.byref(n))
            if lst:
                lib.ibv_free_device_list(ctypes.c_void_p(lst))
            out.append(f"{label} lists {n.value} RDMA device(s)")
        except OSError as e:
            out.append(f"{label}: {e}")
    return ", ".join(out)


def _agent(name: str):
    api = _api()
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    except Exception as e:
        if "rc" not in os.environ.get("UCX_TLS", ""):
            raise
        # One line for the table: the UCX backend needs a verbs device for UCX_TLS=rc.
        raise RuntimeError(f"{_verbs_devices(api)}; the UCX backend failed ({e}) with UCX_TLS="
                           f"{os.environ.get('UCX_TLS')}, UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '')}") \
            from None


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
