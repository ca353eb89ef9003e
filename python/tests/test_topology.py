"""sluice.topology: the node grouping from torchrun's environment (no GPU, no torch needed)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

try:
    from sluice import topology
except ImportError:  # sluice not built here: the module is pure Python, load it from the tree
    _path = os.path.join(os.path.dirname(__file__), "..", "sluice", "topology.py")
    _spec = importlib.util.spec_from_file_location("sluice_topology", _path)
    topology = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = topology  # dataclasses look their module up there
    _spec.loader.exec_module(topology)


def torchrun(rank, world, local, local_world, **extra):
    env = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(local_world))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_two_hosts_of_four() -> None:
    t = topology.from_env(torchrun(6, 8, 2, 4))
    assert (t.world_size, t.nodes, t.ranks_per_node) == (8, 2, 4)
    assert (t.node, t.local_rank) == (1, 2)
    assert t.ranks_of_node(1) == [4, 5, 6, 7]


def test_single_process() -> None:
    t = topology.from_env(torchrun(0, 1, 0, 1))
    assert (t.nodes, t.ranks_per_node, t.node, t.local_rank) == (1, 1, 0, 0)


@pytest.mark.parametrize("k,nodes", [(1, 4), (2, 2), (4, 1)])
def test_mode_switch_splits_one_host(k, nodes) -> None:
    # One 4-GPU host: 1 = every rank its own node (force the inter-node path), 2 = 2 nodes x 2.
    by_arg = topology.from_env(torchrun(3, 4, 3, 4), ranks_per_node=k)
    by_env = topology.from_env(torchrun(3, 4, 3, 4, SLUICE_HIER_RANKS_PER_NODE=k))
    assert by_arg == by_env
    assert (by_arg.nodes, by_arg.ranks_per_node) == (nodes, k)
    assert by_arg.node == 3 // k and by_arg.local_rank == 3 % k


def test_argument_wins_over_environment() -> None:
    t = topology.from_env(torchrun(0, 4, 0, 4, SLUICE_HIER_RANKS_PER_NODE=1), ranks_per_node=2)
    assert t.nodes == 2


def test_node_ids_are_labels_and_may_interleave() -> None:
    t = topology.from_node_ids([42, 7, 42, 7, 9, 9], rank=2)
    assert t.node_of_rank == (0, 1, 0, 1, 2, 2)
    assert t.local_rank_of == (0, 0, 1, 1, 0, 1)
    assert (t.node, t.local_rank) == (0, 1)


@pytest.mark.parametrize("env,needle", [
    (torchrun(8, 8, 0, 4), "inconsistent torchrun environment: RANK=8"),
    (torchrun(1, 8, 4, 4), "LOCAL_RANK=4"),
    (torchrun(1, 6, 1, 4), "WORLD_SIZE is not a multiple of LOCAL_WORLD_SIZE"),
    (torchrun(5, 8, 0, 4), "use from_node_ids"),
    (torchrun(0, 8, 0, 4, SLUICE_HIER_RANKS_PER_NODE=3), "would span two hosts"),
    (torchrun(0, 8, 0, 4, SLUICE_HIER_RANKS_PER_NODE=-1), "is negative"),
    (torchrun(0, 8, 0, 4, SLUICE_HIER_RANKS_PER_NODE="x"), "SLUICE_HIER_RANKS_PER_NODE='x' is not an integer"),
    (torchrun(0, 32, 0, 16), "at most 8 per node"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK is not set"),
])
def test_bad_environment_is_refused(env, needle) -> None:
    with pytest.raises(ValueError) as e:
        topology.from_env(env)
    assert needle in str(e.value)


@pytest.mark.parametrize("ids,rank,needle", [
    ([], 0, "no ranks"),
    ([0, 0], 2, "rank 2 outside world size 2"),
    ([0, -1], 0, "rank 1 has a negative node id -1"),
    ([0, 0, 1], 0, "uneven nodes: node 0 has 2 ranks, node 1 (id 1) has 1"),
    ([3] * 9, 0, "node 0 (id 3) has 9 ranks; at most 8 per node"),
])
def test_bad_node_ids_are_refused(ids, rank, needle) -> None:
    with pytest.raises(ValueError) as e:
        topology.from_node_ids(ids, rank)
    assert needle in str(e.value)
