"""Which rank lives on which node, for the hierarchical AllGather (issue 14; python/sluice/hier_allgather.py reads it).

    from sluice.topology import from_env
    topo = from_env()            # torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    topo.node, topo.local_rank   # this process's place
    topo.ranks_of_node(0)        # [0, 1, ...]

The same rules as the C++ planner (src/collective/topology.hpp), so that both sides agree:
every node has the same number of ranks (the plan is rail-aligned: local rank i of each node
talks to local rank i of the others), at most 8 per node (one NVLink domain), and nodes are
numbered by their first rank, local ranks by ascending global rank.

The mode switch: ``ranks_per_node=1`` (or SLUICE_HIER_RANKS_PER_NODE=1 in the environment)
gives every rank its own node, so every byte takes the inter-node path even between GPUs of
one host; ``ranks_per_node=2`` on a 4-GPU host makes 2 "nodes" of 2. It must divide
LOCAL_WORLD_SIZE: a node cannot span hosts.

Pure Python (no extension, no torch), so it also runs where sluice is not built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

__all__ = ["MAX_RANKS_PER_NODE", "NodeTopology", "from_env", "from_node_ids"]

MAX_RANKS_PER_NODE = 8
ENV_RANKS_PER_NODE = "SLUICE_HIER_RANKS_PER_NODE"


@dataclass(frozen=True)
class NodeTopology:
    """Every rank's node, seen from `rank`."""

    rank: int
    node_of_rank: Tuple[int, ...]  # node number (0..nodes-1) of each global rank
    local_rank_of: Tuple[int, ...]  # local rank of each global rank

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def local_rank(self) -> int:
        return self.local_rank_of[self.rank]

    def ranks_of_node(self, node: int) -> List[int]:
        if not 0 <= node < self.nodes:
            raise ValueError(f"topology: node {node} outside {self.nodes} nodes")
        return [r for r, n in enumerate(self.node_of_rank) if n == node]


def from_node_ids(node_ids: Sequence[int], rank: int) -> NodeTopology:
    """node_ids[r] = any non-negative label of rank r's node (labels need not be contiguous)."""
    if not node_ids:
        raise ValueError("topology: no ranks (world size 0)")
    if not 0 <= rank < len(node_ids):
        raise ValueError(f"topology: rank {rank} outside world size {len(node_ids)}")
    number: dict = {}
    members: List[List[int]] = []
    nodes, locals_ = [], []
    for r, label in enumerate(node_ids):
        if label < 0:
            raise ValueError(f"topology: rank {r} has a negative node id {label}")
        if label not in number:
            number[label] = len(members)
            members.append([])
        n = number[label]
        nodes.append(n)
        locals_.append(len(members[n]))
        members[n].append(r)
    k = len(members[0])
    for n, m in enumerate(members):
        if len(m) > MAX_RANKS_PER_NODE:
            raise ValueError(f"topology: node {n} (id {node_ids[m[0]]}) has {len(m)} ranks; "
                             f"at most {MAX_RANKS_PER_NODE} per node (one NVLink domain)")
        if len(m) != k:
            raise ValueError(f"topology: uneven nodes: node 0 has {k} ranks, node {n} (id {node_ids[m[0]]}) "
                             f"has {len(m)}; the rail-aligned plan needs the same ranks per node")
    return NodeTopology(rank, tuple(nodes), tuple(locals_))


def _int_env(env: Mapping[str, str], name: str, default: Optional[str] = None) -> int:
    value = env.get(name, default)
    if value is None:
        raise ValueError(f"topology: {name} is not set (run under torchrun, or use from_node_ids)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"topology: {name}={value!r} is not an integer") from None


def from_env(env: Optional[Mapping[str, str]] = None, ranks_per_node: Optional[int] = None) -> NodeTopology:
    """From torchrun's environment (os.environ unless `env` is given).

    torchrun numbers ranks host by host (RANK = host * LOCAL_WORLD_SIZE + LOCAL_RANK); that is the
    only layout a process can infer without asking the others, and the values are checked
    against it. `ranks_per_node` (else SLUICE_HIER_RANKS_PER_NODE) splits each host into nodes
    of that many ranks; 1 forces the inter-node path everywhere.
    """
    env = os.environ if env is None else env
    rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    local, local_world = _int_env(env, "LOCAL_RANK"), _int_env(env, "LOCAL_WORLD_SIZE")
    text = f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} LOCAL_WORLD_SIZE={local_world}"
    if world <= 0 or local_world <= 0 or not 0 <= rank < world or not 0 <= local < local_world:
        raise ValueError(f"topology: inconsistent torchrun environment: {text}")
    if world % local_world:
        raise ValueError(f"topology: WORLD_SIZE is not a multiple of LOCAL_WORLD_SIZE "
                         f"(hosts with different GPU counts): {text}")
    if rank % local_world != local:
        raise ValueError("topology: ranks are not numbered host by host (RANK % LOCAL_WORLD_SIZE != "
                         f"LOCAL_RANK), so the other ranks' hosts cannot be inferred; use from_node_ids: {text}")
    k = ranks_per_node if ranks_per_node is not None else _int_env(env, ENV_RANKS_PER_NODE, "0")
    if k < 0:
        raise ValueError(f"topology: ranks per node override {k} is negative")
    if k == 0:
        k = local_world
    elif local_world % k:
        raise ValueError(f"topology: ranks per node override {k} does not divide LOCAL_WORLD_SIZE, "
                         f"so a node would span two hosts: {text}")
    return from_node_ids([r // k for r in range(world)], rank)
