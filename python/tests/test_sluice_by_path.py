"""tools/common/sluice_by_path.py: the one loader the GPU examples and benchmarks use for
python/sluice's pure-Python modules when the compiled package is not importable."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "common"))
import sluice_by_path  # noqa: E402


def test_a_module_is_loaded_once_under_the_key_its_siblings_use():
    hier = sluice_by_path.load("hier_allgather")
    assert sluice_by_path.load("hier_allgather") is hier
    assert sys.modules["sluice_hier_allgather"] is hier
    # hier_allgather reaches topology through its own sibling loader: the same registry.
    assert hier.node_ids_from_env(ranks_per_node=2, env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) == [0, 0, 1, 1]
    assert sluice_by_path.load("topology") is sys.modules["sluice_topology"]


def test_the_package_is_not_imported():
    before = "sluice" in sys.modules
    sluice_by_path.load("ag_gemm")
    assert ("sluice" in sys.modules) == before


def test_a_missing_module_fails_and_leaves_nothing_behind():
    with pytest.raises(FileNotFoundError):
        sluice_by_path.load("no_such_module")
    assert "sluice_no_such_module" not in sys.modules
