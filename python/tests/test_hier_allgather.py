"""sluice.hier_allgather without a GPU: the topology switch it reads, and a clear refusal from
the library (no torch needed; the GPU runs are tools/sluice-gpu-bench/hier_allgather_bench.py)."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import pytest

_path = os.path.join(os.path.dirname(__file__), "..", "sluice", "hier_allgather.py")
_spec = importlib.util.spec_from_file_location("sluice_hier_allgather_test", _path)
hier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hier)


def env(rank, world, local, local_world, **extra):
    e = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(local_world))
    e.update({k: str(v) for k, v in extra.items()})
    return e


def test_node_ids_follow_the_mode_switch():
    assert hier.node_ids_from_env(env=env(1, 4, 1, 4)) == [0, 0, 0, 0]
    assert hier.node_ids_from_env(env=env(1, 4, 1, 4, SLUICE_HIER_RANKS_PER_NODE=1)) == [0, 1, 2, 3]
    assert hier.node_ids_from_env(env=env(1, 4, 1, 4, SLUICE_HIER_RANKS_PER_NODE=2)) == [0, 0, 1, 1]
    assert hier.node_ids_from_env(ranks_per_node=1, env=env(3, 8, 3, 4)) == list(range(8))
    assert hier.node_ids_from_env(env=env(5, 8, 1, 4)) == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="does not divide"):
        hier.node_ids_from_env(env=env(1, 4, 1, 4, SLUICE_HIER_RANKS_PER_NODE=3))


def _installed_package_dir():
    """Where the installed sluice package is (the test suite's venv), without importing it."""
    spec = importlib.util.find_spec("sluice")
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def _library():
    pkg = _installed_package_dir()
    cands = [os.environ.get("SLUICE_LIBRARY")] + glob.glob(
        os.path.join(os.path.dirname(__file__), "..", "sluice", "libsluice*.so"))
    if pkg:  # the wheel puts libsluice beside the package
        cands += glob.glob(os.path.join(pkg, "libsluice*.so"))
    for c in cands:
        if c and os.path.exists(c):
            try:
                return hier.load_library(c)
            except OSError:
                pass
    pytest.skip("no libsluice with sluice_hag_create here (set SLUICE_LIBRARY)")


def test_without_a_gpu_creation_is_refused_clearly():
    lib = _library()
    err = ctypes.create_string_buffer(1024)
    nodes = (ctypes.c_int * 2)(0, 1)
    h = lib.sluice_hag_create(1024, 2, 0, 0, nodes, b"tcp", 1000, err, 1024)
    if h:
        lib.sluice_hag_destroy(h)
        pytest.skip("a GPU is present")
    msg = err.value.decode()
    assert "HierAllGather" in msg and ("CUDA" in msg or "device" in msg), msg
