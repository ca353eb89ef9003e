"""torch.distributed backend ``sluice``.

``import sluice.torch`` registers the backend, then::

    dist.init_process_group("sluice")          # or "cpu:sluice", "cpu:sluice,cuda:nccl"

Bootstrap goes through the c10d Store torch hands the backend (env:// under torchrun,
tcp://, or a given Store). ``SLUICE_TORCH_TRANSPORT=shm|tcp`` forces the transport of every
endpoint; every ``SLUICE_*`` engine variable applies (docs/configuration.md). CPU and CUDA
tensors; CUDA tensors go through host copies, except large send/recv between the GPUs of a host
and all_gathers of up to SLUICE_TORCH_LL_ALLGATHER_BYTES (default 1 MiB) per rank there, which move over NVLink
("cpu:sluice,cuda:nccl" keeps NCCL for them). See docs/torch.md.

Without the compiled extension (a sluice built where torch was not importable) this module
still imports; creating a group then raises ImportError saying how to get the backend.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

BACKEND_NAME = "sluice"

_ext: Optional[Any]
_ext_error: Optional[BaseException]
try:
    from .. import _sluice_torch as _ext  # type: ignore[attr-defined]

    _ext_error = None
except ImportError as e:  # built without torch
    _ext = None
    _ext_error = e

_HOW_TO_GET = (
    "the sluice torch backend is not built into this sluice package ({err}). Rebuild sluice "
    "with torch installed in the Python that builds it (pip's isolated build cannot see it): "
    "pip install scikit-build-core pybind11 && "
    "SKBUILD_CMAKE_DEFINE=SLUICE_TORCH_PYTHON=$(which python) pip install --no-build-isolation . "
    "(docs/torch.md)"
)


def available() -> bool:
    """True when the compiled backend is present."""
    return _ext is not None


def _create(store: "dist.Store", rank: int, size: int, timeout: timedelta) -> "dist.Backend":
    if _ext is None:
        raise ImportError(_HOW_TO_GET.format(err=_ext_error))
    return _ext.create_backend(store, rank, size, timeout)


def backend_transport(group: Optional["dist.ProcessGroup"] = None) -> str:
    """The engine transport ("shm", "tcp", ...) that the sluice backend of ``group`` runs."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return backend.transport


def backend_cuda_path(group: Optional["dist.ProcessGroup"] = None) -> str:
    """How the sluice backend of ``group`` moves large CUDA tensors: "nvlink" (directly between
    the GPUs of a host, send/recv of tensors of at least SLUICE_TORCH_RNDV_BYTES) or "host"
    (through host memory; SLUICE_TORCH_CUDA_PATH=host forces it)."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return backend.cuda_path


def backend_ll_allgather(group: Optional["dist.ProcessGroup"] = None) -> "dict[str, Any]":
    """The low-latency all_gather of CUDA tensors of ``group`` (docs/torch.md): ``{"calls": n,
    "allreduce_calls": m, "state": s}``, where ``calls`` counts the all_gather /
    all_gather_into_tensor calls that ran as one NVLink kernel on the caller's stream,
    ``allreduce_calls`` the all_reduce calls that ran through that kernel (and a reduction on the
    same stream), and ``state`` is "on ..." or "off: <why>"."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return {"calls": backend.ll_allgather_calls, "allreduce_calls": backend.ll_allreduce_calls,
            "state": backend.ll_allgather_state}


def backend_stream_p2p(group: Optional["dist.ProcessGroup"] = None) -> "dict[str, Any]":
    """The stream-ordered CUDA send/recv of ``group`` (SLUICE_TORCH_CUDA_PATH=stream,
    docs/torch.md): ``{"calls": n, "state": s}``, where ``calls`` counts the sends and recvs that
    ran as kernels on streams (NCCL's contract) and ``state`` is "on ...", "not set up ...",
    "failed: <why>" (an earlier message went wrong; every later one is refused) or "off ..."."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return {"calls": backend.stream_p2p_calls, "state": backend.stream_p2p_state}


def backend_device_collectives(group: Optional["dist.ProcessGroup"] = None) -> int:
    """How many collective calls on CUDA tensors of ``group`` (all_gather_into_tensor,
    all_to_all_single, broadcast) went GPU to GPU over the device endpoints
    (``SLUICE_TORCH_DEVICE_COLLECTIVES``, on by default; ``0`` stages them through host memory;
    docs/torch.md)."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return int(backend.device_collective_calls)


def backend_recv_ready(group: Optional["dist.ProcessGroup"] = None) -> "dict[str, int]":
    """Ready-to-receive counts of this rank in ``group`` (docs/torch.md, "How messages travel"):
    ``offered``, recvs of at least SLUICE_TORCH_RNDV_BYTES that told their sender in advance that
    they were posted; ``used``, this rank's sends whose payload went at once into such a recv (no
    RTS / CTS round trip); ``voided``, those it could not use (another message came first)."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return dict(backend.recv_ready)


def _register() -> None:
    if getattr(dist.Backend, "SLUICE", None) is not None:
        return  # imported twice (e.g. reloaded): already registered
    # Registered for "cuda" too: the backend takes CUDA tensors. A name
    # mapped to both devices makes torch create one backend object, not two.
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


import torch  # noqa: E402  (after torch.distributed, which imports it)

_register()

__all__ = [
    "BACKEND_NAME",
    "available",
    "backend_cuda_path",
    "backend_device_collectives",
    "backend_ll_allgather",
    "backend_recv_ready",
    "backend_stream_p2p",
    "backend_transport",
]
