"""Where a process sits: its host, its GPU, its NUMA node and the RDMA NIC(s) nearest to it; and
a plan, made from those placements, of which receiver pulls which trainer shard across hosts
(docs/weights.md, "Placement: pullers chosen by NIC and GPU affinity").

:func:`probe` reads sysfs as the engine's own affinity does (``src/transport/rdma/affinity.cpp``):
for a GPU process the PCIe hops between the GPU and each NIC (the common ancestor of their
resolved ``/sys/bus/pci/devices/<id>`` and ``/sys/class/infiniband/<dev>/device`` paths; a NIC
under the GPU's switch is 2-4 hops away, one on another root complex many more), else the NUMA
(SLIT) distance between the process's node and the NIC's. Pure Python: torch is imported only
to ask a CUDA device's bus id.

:func:`plan_pulls` takes one :class:`Placement` per trainer rank (an owner of a shard) and one
per receiver, and decides, for every receiving host, which of its receivers pulls each owner's
shard across hosts (the puller) and in which round, so that:

- every receiver gets every shard exactly once; the model crosses into each receiving host once;
- a host's shards are spread over its NICs (receivers grouped by their nearest NIC; in a group,
  the receivers nearest to it pull, in turn), balanced by bytes, a shard preferring the NIC of
  the owner's NIC's name (rail-optimised fabrics);
- in each round no owner NIC serves two pullers and no puller pulls two shards (checkpoint-
  engine's round robin of owner NICs), in as few rounds as that allows;
- receivers on an owner's host read it themselves (shm, NVLink), and the others of a receiving
  host take each shard from its puller (shm or NVLink, not the uplink).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Placement", "PullPlan", "probe", "plan_pulls", "parse_hca"]

_BUS_ID = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


@dataclass(frozen=True)
class Placement:
    """Where one process sits. ``host``: its host label (``SLUICE_HOST_ID`` or the hostname);
    ``gpu``: its GPU's PCI bus id ("0000:05:00.0"), None for a CPU-only process; ``numa``: the
    NUMA node of its GPU or of its CPUs, None when unknown; ``nics``: its nearest RDMA NICs
    (every NIC as near as the nearest, by name), None when the host has none; ``distance``: how
    far they are (PCIe hops from the GPU, else the SLIT distance, 10 = same node), None when
    nothing tells the NICs apart.

    Plain data: pickles, and ``to_dict()`` / ``from_dict()`` go through JSON (e.g. with
    ``torch.distributed.all_gather_object``)."""

    host: str
    gpu: Optional[str] = None
    numa: Optional[int] = None
    nics: Optional[Tuple[str, ...]] = None
    distance: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"Placement: host must be a non-empty str, got {self.host!r}")
        if self.nics is not None:
            nics = tuple(self.nics)
            if not nics or not all(isinstance(n, str) and n for n in nics):
                raise ValueError(f"Placement: nics must be None or NIC names, got {self.nics!r}")
            object.__setattr__(self, "nics", nics)

    @property
    def nic(self) -> Optional[str]:
        """The nearest NIC (the first by name when several are as near), or None."""
        return self.nics[0] if self.nics else None

    def hca(self) -> Optional[str]:
        """The nearest NICs as an ``rdma.hca`` / ``SLUICE_IB_HCA`` value ("=mlx5_0"), for an
        engine that should use only them (``sluice.Engine(**{"rdma.hca": p.hca()})``); None
        when there is no NIC."""
        return "=" + ",".join(self.nics) if self.nics else None

    def to_dict(self) -> dict:
        return {"host": self.host, "gpu": self.gpu, "numa": self.numa,
                "nics": list(self.nics) if self.nics is not None else None, "distance": self.distance}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Placement":
        nics = d.get("nics")
        return cls(d["host"], d.get("gpu"), d.get("numa"), tuple(nics) if nics is not None else None,
                   d.get("distance"))


# ------------------------------------------------------------------------------------------ probe

def host_label() -> str:
    """``SLUICE_HOST_ID`` when set, else the hostname."""
    return os.environ.get("SLUICE_HOST_ID") or socket.gethostname()


def parse_hca(text: str) -> Tuple[bool, bool, List[Tuple[str, Optional[int]]]]:
    """NCCL_IB_HCA syntax, as the engine's ``rdma.hca``: "mlx5" (prefix), "=mlx5_0,mlx5_1"
    (exact names), "^mlx5_3" (all but), each entry optionally ":port". Returns (exclude,
    exact, [(name, port or None)]); an empty text selects everything. Raises ValueError."""
    t = text.strip()
    exclude = t.startswith("^")
    t = t[1:] if exclude else t
    exact = t.startswith("=")
    t = t[1:] if exact else t
    if not t.strip():
        if exclude or exact:
            raise ValueError(f"HCA filter {text!r} names no device")
        return False, False, []
    entries: List[Tuple[str, Optional[int]]] = []
    for item in t.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"HCA filter {text!r} has an empty entry")
        name, port = item, None
        if ":" in item:
            name, p = (s.strip() for s in item.split(":", 1))
            if not p.isdigit() or len(p) > 3 or int(p) < 1:
                raise ValueError(f"HCA filter {text!r}: bad port {p!r} in {item!r}")
            port = int(p)
        if not name:
            raise ValueError(f"HCA filter {text!r}: entry {item!r} has no device name")
        entries.append((name, port))
    return exclude, exact, entries


def _hca_matches(flt, device: str, port: Optional[int]) -> bool:
    exclude, exact, entries = flt
    if not entries:
        return True
    hit = any((device == n if exact else device.startswith(n)) and (p is None or port is None or p == port)
              for n, p in entries)
    return not hit if exclude else hit


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _numa_of(dir_: str) -> Optional[int]:
    s = _read(os.path.join(dir_, "numa_node")).split()
    try:
        n = int(s[0]) if s else -1
    except ValueError:
        return None
    return n if n >= 0 else None


def _locality(dir_: str) -> Tuple[Optional[int], Optional[str]]:
    """(NUMA node, resolved PCI path or None) of a sysfs device directory."""
    if not os.path.exists(dir_):
        return None, None
    real = os.path.realpath(dir_)
    return _numa_of(real), (real if "/pci" in real else None)


def _norm_bus_id(bus_id: str) -> str:
    i = bus_id.strip().lower()
    if i.count(":") == 1:
        i = "0000:" + i
    if len(i) > 12 and i.find(":") == 8:  # CUDA's 8-digit domain
        i = i[4:]
    return i


def _pci_hops(a: str, b: str) -> int:
    ca, cb = [c for c in a.split("/") if c], [c for c in b.split("/") if c]
    common = 0
    while common < len(ca) and common < len(cb) and ca[common] == cb[common]:
        common += 1
    return (len(ca) - common) + (len(cb) - common)


def _slit(sysfs: str, a: int, b: int) -> int:
    row = _read(os.path.join(sysfs, "devices", "system", "node", f"node{a}", "distance")).split()
    try:
        return int(row[b])
    except (IndexError, ValueError):
        return 10 if a == b else 20


def _cpu_numa(sysfs: str) -> Optional[int]:
    """The NUMA node holding every CPU this process may run on; None when they span several
    (or nothing says)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    base = os.path.join(sysfs, "devices", "system", "node")
    try:
        names = os.listdir(base)
    except OSError:
        return None
    nodes = set()
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        have = set()
        for part in _read(os.path.join(base, name, "cpulist")).strip().split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            try:
                have.update(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                continue
        if have & cpus:
            nodes.add(int(m.group(1)))
    return nodes.pop() if len(nodes) == 1 else None


def _nic_selected(sysfs: str, dev: str, flt) -> bool:
    """Selected by the filter on some port, and (where sysfs says) that port is ACTIVE."""
    ports_dir = os.path.join(sysfs, "class", "infiniband", dev, "ports")
    try:
        ports = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit())
    except OSError:
        ports = []
    if not ports:
        return _hca_matches(flt, dev, None)
    for p in ports:
        if not _hca_matches(flt, dev, p):
            continue
        state = _read(os.path.join(ports_dir, str(p), "state"))
        if not state or "ACTIVE" in state.upper():
            return True
    return False


def _cuda_bus_id(device) -> str:
    import torch  # only here: probe() of a CPU process needs no torch

    d = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if d.type != "cuda":
        raise ValueError(f"probe: {device!r} is not a CUDA device")
    index = d.index if d.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    dom, bus, dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is not None and dev is not None:
        return f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0"
    import ctypes  # older torch: ask the driver (same ordinals: both honour CUDA_VISIBLE_DEVICES)

    cuda = ctypes.CDLL("libcuda.so.1")
    h, buf = ctypes.c_int(), ctypes.create_string_buffer(32)
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(h), index) or cuda.cuDeviceGetPCIBusId(buf, 32, h):
        raise RuntimeError(f"probe: the CUDA driver gave no PCI bus id for device {index}")
    return buf.value.decode()


def probe(device=None, *, sysfs: str = "/sys", nics: Union[None, str, Iterable[str]] = None,
          host: Optional[str] = None) -> Placement:
    """This process's :class:`Placement`.

    ``device``: None or "cpu" for a CPU-only process (its NUMA node from its CPU affinity); a
    CUDA device (an ordinal, "cuda:1", a ``torch.device``), whose bus id torch gives; or a PCI
    bus id ("0000:3b:00.0", CUDA's 8-digit domain form too). ``nics``: which RDMA devices count,
    in NCCL_IB_HCA syntax (default ``SLUICE_IB_HCA``, as the engine) or a list of names; a
    device whose ports are all down does not. ``host``: the label (default ``SLUICE_HOST_ID``,
    else the hostname). ``sysfs``: the sysfs root (tests pass a fake tree). A host without NIC
    gives ``nics=None``; nothing here raises for missing sysfs entries."""
    label = host if host is not None else host_label()
    gpu: Optional[str] = None
    if device is not None and not (isinstance(device, str) and device == "cpu"):
        if isinstance(device, str) and _BUS_ID.match(device.strip()):
            gpu = _norm_bus_id(device)
        elif getattr(device, "type", None) == "cpu":
            gpu = None
        else:
            gpu = _norm_bus_id(_cuda_bus_id(device))
    gpu_path: Optional[str] = None
    if gpu is not None:
        numa, gpu_path = _locality(os.path.join(sysfs, "bus", "pci", "devices", gpu))
    else:
        numa = _cpu_numa(sysfs)

    if nics is None:
        flt = parse_hca(os.environ.get("SLUICE_IB_HCA", ""))
    elif isinstance(nics, str):
        flt = parse_hca(nics)
    else:
        flt = (False, True, [(n, None) for n in nics])
    ib = os.path.join(sysfs, "class", "infiniband")
    try:
        devs = sorted(os.listdir(ib))
    except OSError:
        devs = []
    devs = [d for d in devs if _nic_selected(sysfs, d, flt)]
    if not devs:
        return Placement(label, gpu, numa, None, None)
    scores: Dict[str, int] = {}
    for d in devs:
        n_numa, n_path = _locality(os.path.join(ib, d, "device"))
        if gpu_path is not None and n_path is not None:
            scores[d] = _pci_hops(gpu_path, n_path)
        elif numa is not None and n_numa is not None:
            scores[d] = _slit(sysfs, numa, n_numa)
    if not scores:  # nothing tells them apart: every one is as near
        return Placement(label, gpu, numa, tuple(devs), None)
    best = min(scores.values())
    return Placement(label, gpu, numa, tuple(d for d in devs if scores.get(d) == best), best)


# ------------------------------------------------------------------------------------------ plan

@dataclass(frozen=True)
class PullPlan:
    """Who pulls what (:func:`plan_pulls`). For receiver ``i`` and owner (trainer rank) ``o``:

    - ``sources[i][o]``: None = read owner ``o`` itself (the receiver is its host's puller of
      that shard, or on the owner's host); an int ``j`` = take it from receiver ``j`` (a
      receiver of the same host, which relays it). What ``StripedSubscriber(sources=...)``
      takes, or, per owner, ``WeightSubscriber(owner_ref[o], source=...)``.
    - ``rounds[i]``: owner indices in rounds, the same for every receiver of a host: the
      shards a host pulls in one round come from different owner NICs and go to different
      pullers (what ``StripedSubscriber(rounds=...)`` takes). Shards local to the host are in
      the first round.
    - ``pulls``: every pull across hosts, as (receiver, owner, round); a round number is global:
      in one round, no owner NIC serves two pullers and no puller pulls two shards.
    """

    sources: Tuple[Tuple[Optional[int], ...], ...]
    rounds: Tuple[Tuple[Tuple[int, ...], ...], ...]
    pulls: Tuple[Tuple[int, int, int], ...] = field(default=())

    def relays(self, receiver: int) -> Tuple[int, ...]:
        """The owners whose shard other receivers take from ``receiver`` (it must relay them:
        ``WeightSubscriber(relay=True)``)."""
        return tuple(sorted({o for src in self.sources for o, s in enumerate(src) if s == receiver}))

    def to_dict(self) -> dict:
        return {"sources": [list(s) for s in self.sources],
                "rounds": [[list(r) for r in rs] for rs in self.rounds],
                "pulls": [list(p) for p in self.pulls]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PullPlan":
        return cls(tuple(tuple(s) for s in d["sources"]), tuple(tuple(tuple(r) for r in rs) for rs in d["rounds"]),
                   tuple(tuple(p) for p in d.get("pulls", ())))


def _as_placement(p, what: str) -> Placement:
    if isinstance(p, Placement):
        return p
    if isinstance(p, str) and p:
        return Placement(p)
    raise ValueError(f"plan_pulls: each of {what} must be a Placement or a host label, got {p!r}")


def _key(p: Placement) -> Tuple[int, int]:
    """Nearness of a placement to its NIC, for ordering (unknown last)."""
    return (0, p.distance) if p.distance is not None else (1, 0)


def _colour_edges(edges: Sequence[Tuple[Hashable, Hashable]]) -> List[int]:
    """A proper edge colouring of a bipartite multigraph with as many colours as its largest
    degree (König): edges sharing an end get different colours. Deterministic in edge order."""
    at_u: Dict[Hashable, Dict[int, int]] = {}
    at_v: Dict[Hashable, Dict[int, int]] = {}
    colour: List[int] = [-1] * len(edges)

    def free(tbl: Dict[int, int]) -> int:
        c = 0
        while c in tbl:
            c += 1
        return c

    deg: Dict[Tuple[int, Hashable], int] = {}
    for u, v in edges:
        deg[(0, u)] = deg.get((0, u), 0) + 1
        deg[(1, v)] = deg.get((1, v), 0) + 1
    most = max(deg.values(), default=0)
    for e, (u, v) in enumerate(edges):
        cu, cv = at_u.setdefault(u, {}), at_v.setdefault(v, {})
        both = next((c for c in range(most) if c not in cu and c not in cv), None)
        a, b = (both, both) if both is not None else (free(cu), free(cv))
        if a in cv:
            # Swap a and b along the path from v that alternates a, b. It never reaches u (it
            # enters u's side by a-edges only, and u has none), and afterwards a is free at v.
            path, node, on_v, col = [], v, True, a
            while True:
                tbl = at_v[node] if on_v else at_u[node]
                if col not in tbl:
                    break
                ei = tbl[col]
                path.append(ei)
                node = edges[ei][0] if on_v else edges[ei][1]
                on_v, col = not on_v, (b if col == a else a)
            for ei in path:
                del at_u[edges[ei][0]][colour[ei]]
                del at_v[edges[ei][1]][colour[ei]]
            for ei in path:
                colour[ei] = b if colour[ei] == a else a
                at_u[edges[ei][0]][colour[ei]] = ei
                at_v[edges[ei][1]][colour[ei]] = ei
        colour[e] = a
        cu[a] = e
        cv[a] = e
    return colour


def plan_pulls(owners: Sequence[Union[Placement, str]], receivers: Sequence[Union[Placement, str]], *,
               sizes: Optional[Sequence[int]] = None) -> PullPlan:
    """Which receiver pulls each owner's shard across hosts, and from whom the others take it.

    ``owners[o]``: trainer rank ``o``'s placement (the process that publishes shard ``o``);
    ``receivers[i]``: receiver ``i``'s. A plain host label stands for a placement with nothing
    else known. ``sizes``: the shards' bytes, for balancing (default: all equal). Every process
    that calls this with the same arguments gets the same plan (ties go to the lower index).

    Per receiving host: shards whose owner is on that host are read by each of its receivers
    itself. Each other shard gets one puller: its NIC group (the host's receivers grouped by
    their nearest NIC) is the least loaded one so far, by bytes (ties: the group of the owner's
    NIC's name, then by NIC name), and in that group the least loaded of the receivers nearest
    to the NIC. The others of the host take the shard from the puller. Rounds: pulls are
    coloured so that no owner NIC (the owner's host and nearest NIC) and no puller has two
    pulls in one round, in as few rounds as the busiest NIC or puller needs."""
    own = [_as_placement(p, "owners") for p in owners]
    rec = [_as_placement(p, "receivers") for p in receivers]
    if sizes is None:
        size = [1] * len(own)
    else:
        size = list(sizes)
        if len(size) != len(own) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
            raise ValueError(f"plan_pulls: sizes must be one int >= 0 per owner ({len(own)}), got {sizes!r}")
    hosts: Dict[str, List[int]] = {}
    for i, p in enumerate(rec):
        hosts.setdefault(p.host, []).append(i)
    sources: List[List[Optional[int]]] = [[None] * len(own) for _ in rec]
    cross: List[Tuple[int, int]] = []  # (puller, owner), in a fixed order
    for host, members in hosts.items():
        remote = [o for o in range(len(own)) if own[o].host != host]
        if not remote:
            continue
        # NIC groups: receivers with one nearest NIC first, then those with several join the
        # smallest of their groups; receivers without NIC form the group None.
        groups: Dict[Optional[str], List[int]] = {}
        for i in members:
            if rec[i].nics is not None and len(rec[i].nics) == 1:
                groups.setdefault(rec[i].nics[0], []).append(i)
        for i in members:
            nics = rec[i].nics
            if nics is None:
                groups.setdefault(None, []).append(i)
            elif len(nics) > 1:
                best = min(nics, key=lambda n: (len(groups.get(n, ())), n))
                groups.setdefault(best, []).append(i)
        order = sorted(groups, key=lambda n: (n is None, n or ""))
        candidates: Dict[Optional[str], List[int]] = {}
        for n in order:
            g = sorted(groups[n])
            near = min(_key(rec[i]) for i in g)
            candidates[n] = [i for i in g if _key(rec[i]) == near]
        group_load = {n: 0 for n in order}
        load = {i: 0 for i in members}
        puller: Dict[int, int] = {}
        for o in sorted(remote, key=lambda o: (-size[o], o)):
            onic = own[o].nic
            n = min(order, key=lambda n: (group_load[n], onic is None or n != onic, order.index(n)))
            i = min(candidates[n], key=lambda i: (load[i], i))
            group_load[n] += size[o]
            load[i] += size[o]
            puller[o] = i
        for o in remote:
            cross.append((puller[o], o))
            for i in members:
                sources[i][o] = None if i == puller[o] else puller[o]
    colours = _colour_edges([(i, (own[o].host, own[o].nic if own[o].nic is not None else "")) for i, o in cross])
    rnd = {(i, o): c for (i, o), c in zip(cross, colours)}
    rounds: List[Tuple[Tuple[int, ...], ...]] = [()] * len(rec)
    for host, members in hosts.items():
        by_round: Dict[int, List[int]] = {}
        for (i, o), c in rnd.items():
            if rec[i].host == host:
                by_round.setdefault(c, []).append(o)
        rs = [sorted(by_round[c]) for c in sorted(by_round)]
        local = [o for o in range(len(own)) if own[o].host == host]
        if local:
            rs = [sorted(local + rs[0])] + rs[1:] if rs else [local]
        for i in members:
            rounds[i] = tuple(tuple(r) for r in rs)
    pulls = tuple(sorted((i, o, c) for (i, o), c in rnd.items()))
    return PullPlan(tuple(tuple(s) for s in sources), tuple(rounds), pulls)
