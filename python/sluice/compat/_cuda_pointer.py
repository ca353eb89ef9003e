"""Where a raw pointer lives: host memory or CUDA device N.

Mooncake's ``register_memory(addr, capacity, location="*")`` takes bare integers and finds out
itself whether they point at GPU memory (checkpoint-engine registers its GPU bucket buffer that
way). Sluice must know, because a host transport would otherwise load and store through a
device pointer. The CUDA driver answers through ``cuPointerGetAttribute``; it is loaded with
ctypes so that a host without CUDA needs nothing (every pointer is then host memory).

``copy`` moves bytes between GPU and host pointers with ``cuMemcpy`` (the facade's transfers
to its own engine). Untested on a GPU in CI (no GPU there): checkpoint-engine's P2P update on
1xH200 (tools/sluice-weights-bench/vs_checkpoint_engine.py, every byte checked) covers both.
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


_contexts = {}  # device ordinal -> its primary context (retained for the process's lifetime)


def _fn(lib, name, argtypes):
    f = getattr(lib, name)
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return f


def copy(dst: int, src: int, n: int, device: int) -> None:
    """``n`` bytes from ``src`` to ``dst`` (host or device pointers, unified addressing) with
    ``cuMemcpy`` in ``device``'s primary context, done when this returns (the GIL is released
    meanwhile: ctypes). Raises RuntimeError naming the CUDA error."""
    lib = _load()
    if lib is None:
        raise RuntimeError("copy: no usable CUDA driver here")
    with _lock:
        ctx = _contexts.get(device)
        if ctx is None:
            dev = ctypes.c_int(0)
            ctx = ctypes.c_void_p()
            rc = _fn(lib, "cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int])(ctypes.byref(dev), device)
            if rc == 0:
                rc = _fn(lib, "cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int])(
                    ctypes.byref(ctx), dev.value)
            if rc != 0:
                raise RuntimeError(f"copy: no context for CUDA device {device} (CUDA error {rc})")
            _contexts[device] = ctx
    push = _fn(lib, "cuCtxPushCurrent_v2", [ctypes.c_void_p])
    pop = _fn(lib, "cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)])
    memcpy = _fn(lib, "cuMemcpy", [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t])
    sync = _fn(lib, "cuStreamSynchronize", [ctypes.c_void_p])
    rc = push(ctx)
    if rc != 0:
        raise RuntimeError(f"copy: cuCtxPushCurrent failed with CUDA error {rc}")
    try:
        rc = memcpy(dst, src, n)
        # cuMemcpy returns before a device-to-device copy (or a pageable upload's DMA) is done;
        # it runs on the legacy stream, so waiting for that stream waits for the copy.
        rc = rc or sync(None)
    finally:
        pop(ctypes.byref(ctypes.c_void_p()))
    if rc != 0:
        raise RuntimeError(f"copy: cuMemcpy of {n} bytes {src:#x} -> {dst:#x} failed with CUDA error {rc}")
