"""Where a raw pointer lives: host memory or CUDA device N.

Mooncake's ``register_memory(addr, capacity, location="*")`` takes bare integers and finds out
itself whether they point at GPU memory (checkpoint-engine registers its GPU bucket buffer that
way). Sluice must know, because a host transport would otherwise load and store through a
device pointer. The CUDA driver answers through ``cuPointerGetAttribute``; it is loaded with
ctypes so that a host without CUDA needs nothing (every pointer is then host memory).

Untested on a GPU in CI (no GPU there): the lead's GPU run covers the device branch.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2

_lock = threading.Lock()
_driver: Optional[ctypes.CDLL] = None
_loaded = False


def _load() -> Optional[ctypes.CDLL]:
    global _driver, _loaded
    with _lock:
        if _loaded:
            return _driver
        _loaded = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuInit.restype = ctypes.c_int
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuPointerGetAttribute.restype = ctypes.c_int
        if lib.cuInit(0) != 0:  # a driver without a usable GPU
            return None
        _driver = lib
        return lib


def location_of(addr: int) -> str:
    """``"cuda:N"`` for device memory of GPU N, else ``"host"`` (pageable or pinned host
    memory, and every pointer on a host without a CUDA driver)."""
    lib = _load()
    if lib is None:
        return "host"
    mem_type = ctypes.c_uint(0)
    # Host memory CUDA never saw answers CUDA_ERROR_INVALID_VALUE: that is host memory.
    if lib.cuPointerGetAttribute(ctypes.byref(mem_type), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0:
        return "host"
    if mem_type.value != _CU_MEMORYTYPE_DEVICE:
        return "host"
    ordinal = ctypes.c_int(-1)
    rc = lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
    if rc != 0:  # device memory of an unknown GPU: never guess "host" for it
        raise RuntimeError(f"cuPointerGetAttribute(DEVICE_ORDINAL, {addr:#x}) failed with CUDA error {rc}")
    return f"cuda:{ordinal.value}"
