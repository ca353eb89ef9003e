"""Intra-node low-latency AllGather over NVLink, for PyTorch tensors.

    import torch.distributed as dist
    from sluice.cuda_allgather import AllGather
    ag = AllGather(max_tokens=4096, hidden=7168, dtype=torch.bfloat16)  # uses the default group
    out = ag.all_gather(x)            # x: [tokens, hidden] on this rank's GPU
    ag.all_gather(x, out=buf)         # no allocation at all; capturable in torch.cuda.graph

Each rank builds one object with the largest per-rank message; construction exchanges CUDA IPC
handles through torch.distributed (any backend). Calls run on the current CUDA stream,
allocate nothing (given `out`) and can be captured in CUDA graphs. The library is libsluice
built with CUDA (include/sluice/allgather.hpp); set SLUICE_LIBRARY to its path if it is not
beside this file or on the loader's path.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

__all__ = ["AllGather", "load_library", "open_library", "prepare_call"]

_lib = None


def open_library(path: Optional[str] = None) -> ctypes.CDLL:
    """libsluice, the first that loads of: `path`, SLUICE_LIBRARY, this package's folder, the
    loader's path. Also used by hier_allgather.py, which sets up its own functions."""
    candidates = [path, os.environ.get("SLUICE_LIBRARY"),
                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "libsluice.so"), "libsluice.so"]
    err = None
    for c in candidates:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError as e:  # try the next one
            err = e
    raise OSError(f"cannot load libsluice with CUDA support (set SLUICE_LIBRARY): {err}")


def load_library(path: Optional[str] = None):
    """Load libsluice (SLUICE_LIBRARY, this package's folder, then the loader's path)."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = open_library(path)
    vp, c_int, u64, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p
    lib.sluice_ag_create.restype = vp
    lib.sluice_ag_create.argtypes = [u64, c_int, c_int, c_int, cp, c_int]
    lib.sluice_ag_handle.restype = c_int
    lib.sluice_ag_handle.argtypes = [vp, cp, c_int, cp, c_int]
    lib.sluice_ag_connect.restype = c_int
    lib.sluice_ag_connect.argtypes = [vp, ctypes.POINTER(cp), c_int, cp, c_int]
    lib.sluice_ag_run.restype = c_int
    lib.sluice_ag_run.argtypes = [vp, vp, vp, u64, vp, cp, c_int]
    lib.sluice_ag_destroy.restype = None
    lib.sluice_ag_destroy.argtypes = [vp]
    _lib = lib
    return lib


def prepare_call(tensor, out, stream, world_size: int):
    """What an all_gather call hands the library: a contiguous input, the output (allocated
    when not given; checked when given), the input's byte count and the stream (the current
    one unless given). Shared with hier_allgather.py, whose calls take the same arguments."""
    import torch

    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if out is None:
        out = torch.empty((world_size * tensor.shape[0],) + tuple(tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
    if out.numel() * out.element_size() != nbytes * world_size or not out.is_contiguous():
        raise ValueError("out must be contiguous and world_size times the input's size")
    s = stream if stream is not None else torch.cuda.current_stream(tensor.device)
    return tensor, out, nbytes, s


class AllGather:
    """One rank's AllGather buffer; see the module docstring."""

    def __init__(self, max_tokens: int, hidden: int = 1, dtype=None, group=None, device=None,
                 world_size: Optional[int] = None, rank: Optional[int] = None, handles=None):
        import torch
        import torch.distributed as dist

        self._lib = load_library()
        dtype = dtype or torch.bfloat16
        self.dtype = dtype
        self.hidden = hidden
        self.group = group
        self.world_size = world_size if world_size is not None else dist.get_world_size(group)
        self.rank = rank if rank is not None else dist.get_rank(group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = int(max_tokens) * int(hidden) * torch.empty((), dtype=dtype).element_size()
        self._err = ctypes.create_string_buffer(1024)
        self._h = self._lib.sluice_ag_create(self.max_bytes, self.world_size, self.rank, self.device.index,
                                             self._err, 1024)
        if not self._h:
            raise RuntimeError("sluice AllGather: " + self._err.value.decode())
        buf = ctypes.create_string_buffer(4096)
        n = self._lib.sluice_ag_handle(self._h, buf, 4096, self._err, 1024)
        if n < 0:
            raise RuntimeError("sluice AllGather: " + self._err.value.decode())
        mine = buf.value.decode()
        if handles is None:
            handles = [None] * self.world_size
            dist.all_gather_object(handles, mine, group=group)
        arr = (ctypes.c_char_p * self.world_size)(*[h.encode() for h in handles])
        if self._lib.sluice_ag_connect(self._h, arr, self.world_size, self._err, 1024) != 0:
            raise RuntimeError("sluice AllGather: " + self._err.value.decode())
        self._run = self._lib.sluice_ag_run

    def all_gather(self, tensor, out=None, stream=None):
        """out = concat over ranks of `tensor` along dim 0 (like all_gather_into_tensor)."""
        tensor, out, nbytes, s = prepare_call(tensor, out, stream, self.world_size)
        if self._run(self._h, tensor.data_ptr(), out.data_ptr(), nbytes, s.cuda_stream, self._err, 1024) != 0:
            raise RuntimeError("sluice AllGather: " + self._err.value.decode())
        return out

    def close(self):
        if getattr(self, "_h", None):
            self._lib.sluice_ag_destroy(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
