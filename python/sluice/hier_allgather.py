"""Hierarchical AllGather across nodes, for PyTorch tensors (include/sluice/hier_allgather.hpp).

    import torch.distributed as dist
    from sluice.hier_allgather import HierAllGather
    hag = HierAllGather(max_bytes=64 << 20)      # topology from torchrun's environment
    hag.all_gather(x, out=buf)                   # rank-major, like all_gather_into_tensor
    hag.check()                                  # raises the error of a failed (e.g. captured) call

Inside a node the NVLink LL AllGather; between nodes each GPU pushes its shard through port
channels (a host proxy posting over rdma or tcp) to the same local rank of every other node,
and the local ranks forward what arrived. Construction allocates everything; calls allocate
nothing (given `out`), run on the current stream and can be captured in CUDA graphs.

Topology: python/sluice/topology.py from torchrun's RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE; `ranks_per_node=` (else SLUICE_HIER_RANKS_PER_NODE) is the mode switch:
1 gives every rank its own node, so every byte takes the inter-node path even on one host.
Handles are exchanged with torch.distributed.all_gather_object (any backend).

A failure (a rail peer lost, a wait past `timeout_ms`) never hangs the inter-node steps: the
kernels record it and return, the next call (or check()) raises HierAllGatherError with the
sluice error code. Across real nodes, set SLUICE_LISTEN=<this host's address>:0 so that peers
can reach this rank's engine (the default listens on 127.0.0.1).

The library is libsluice built with CUDA; set SLUICE_LIBRARY to its path if it is not beside
this file or on the loader's path. This module needs neither the sluice binding nor the rest
of the package (the benchmarks load it by path).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

__all__ = ["HierAllGather", "HierAllGatherError", "load_library", "node_ids_from_env"]

_lib = None

# sluice::ErrorCode values (include/sluice/error.hpp) that callers test for.
PEER_LOST, TIMEOUT, CLOSED, NO_DEVICE = 6, 7, 14, 12


class HierAllGatherError(RuntimeError):
    """A sluice error from the hierarchical AllGather; `code` is the sluice::ErrorCode value."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


def load_library(path: Optional[str] = None):
    """Load libsluice (SLUICE_LIBRARY, this package's folder, then the loader's path)."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = _sibling("cuda_allgather").open_library(path)
    vp, c_int, u64, i64, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_char_p
    if not hasattr(lib, "sluice_hag_create"):
        raise OSError("this libsluice has no hierarchical AllGather (sluice_hag_create): rebuild it")
    lib.sluice_hag_create.restype = vp
    lib.sluice_hag_create.argtypes = [u64, c_int, c_int, c_int, ctypes.POINTER(c_int), cp, i64, cp, c_int]
    if hasattr(lib, "sluice_hag_handle"):  # absent from a build without CUDA (create says why)
        lib.sluice_hag_handle.restype = i64
        lib.sluice_hag_handle.argtypes = [vp, cp, i64, cp, c_int]
        lib.sluice_hag_connect.restype = c_int
        lib.sluice_hag_connect.argtypes = [vp, ctypes.POINTER(cp), c_int, cp, c_int]
        lib.sluice_hag_run.restype = c_int
        lib.sluice_hag_run.argtypes = [vp, vp, vp, u64, vp, cp, c_int]
        lib.sluice_hag_status.restype = c_int
        lib.sluice_hag_status.argtypes = [vp, cp, c_int]
        lib.sluice_hag_transport.restype = cp
        lib.sluice_hag_transport.argtypes = [vp]
        lib.sluice_hag_destroy.restype = None
        lib.sluice_hag_destroy.argtypes = [vp]
    _lib = lib
    return lib


def _sibling(name: str):
    """A module of this package: imported, or loaded by path when this file was (outside the
    package, as the benchmarks load it)."""
    import importlib
    import sys
    if __package__:
        return importlib.import_module("." + name, __package__)
    key = "sluice_" + name
    if key in sys.modules:
        return sys.modules[key]
    import importlib.util
    p = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(key, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def node_ids_from_env(ranks_per_node: Optional[int] = None, env=None) -> Sequence[int]:
    """Every rank's node from torchrun's environment and the SLUICE_HIER_RANKS_PER_NODE switch."""
    topo = _sibling("topology").from_env(env, ranks_per_node=ranks_per_node)
    return list(topo.node_of_rank)


class HierAllGather:
    """One rank of the hierarchical AllGather; see the module docstring."""

    def __init__(self, max_bytes: int, group=None, device=None, node_of_rank: Optional[Sequence[int]] = None,
                 ranks_per_node: Optional[int] = None, transport: str = "", timeout_ms: int = 10000,
                 world_size: Optional[int] = None, rank: Optional[int] = None, handles=None):
        import torch
        import torch.distributed as dist

        self._lib = load_library()
        self.group = group
        self.world_size = world_size if world_size is not None else dist.get_world_size(group)
        self.rank = rank if rank is not None else dist.get_rank(group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if node_of_rank is None:
            node_of_rank = node_ids_from_env(ranks_per_node)
        if len(node_of_rank) != self.world_size:
            raise ValueError(f"node_of_rank has {len(node_of_rank)} entries for a world of {self.world_size}")
        self.node_of_rank = list(node_of_rank)
        self.max_bytes = int(max_bytes)
        self._err = ctypes.create_string_buffer(4096)
        nodes = (ctypes.c_int * self.world_size)(*self.node_of_rank)
        self._h = self._lib.sluice_hag_create(self.max_bytes, self.world_size, self.rank, self.device.index, nodes,
                                              transport.encode(), int(timeout_ms), self._err, 4096)
        if not self._h:
            msg = self._err.value.decode()
            raise HierAllGatherError("sluice HierAllGather: " + msg, NO_DEVICE if "without CUDA" in msg else -1)
        n = self._lib.sluice_hag_handle(self._h, None, 0, self._err, 4096)
        if n < 0:
            raise HierAllGatherError("sluice HierAllGather: " + self._err.value.decode())
        buf = ctypes.create_string_buffer(int(n) + 1)
        if self._lib.sluice_hag_handle(self._h, buf, int(n) + 1, self._err, 4096) < 0:
            raise HierAllGatherError("sluice HierAllGather: " + self._err.value.decode())
        mine = buf.value.decode()
        if handles is None:
            handles = [None] * self.world_size
            dist.all_gather_object(handles, mine, group=group)
        arr = (ctypes.c_char_p * self.world_size)(*[h.encode() for h in handles])
        if self._lib.sluice_hag_connect(self._h, arr, self.world_size, self._err, 4096) != 0:
            raise HierAllGatherError("sluice HierAllGather: " + self._err.value.decode())
        self.transport = self._lib.sluice_hag_transport(self._h).decode()
        self.nodes = len(set(self.node_of_rank))
        self.ranks_per_node = self.world_size // self.nodes

    def all_gather(self, tensor, out=None, stream=None):
        """out = concat over ranks of `tensor` along dim 0 (like all_gather_into_tensor)."""
        tensor, out, nbytes, s = _sibling("cuda_allgather").prepare_call(tensor, out, stream, self.world_size)
        rc = self._lib.sluice_hag_run(self._h, tensor.data_ptr(), out.data_ptr(), nbytes, s.cuda_stream, self._err, 4096)
        if rc != 0:
            raise HierAllGatherError("sluice HierAllGather: " + self._err.value.decode(), rc)
        return out

    def status(self):
        """(0, "") or (sluice error code, message) of the first failure seen."""
        code = self._lib.sluice_hag_status(self._h, self._err, 4096)
        return (code, self._err.value.decode() if code else "")

    def check(self):
        """Raise HierAllGatherError if a call failed (synchronize the stream first)."""
        code, msg = self.status()
        if code:
            raise HierAllGatherError("sluice HierAllGather: " + msg, code)

    def close(self):
        if getattr(self, "_h", None):
            self._lib.sluice_hag_destroy(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
