"""Placement (sluice.weights.placement): probing NICs and GPUs against fake sysfs trees, the
pull planner (who pulls which trainer shard across hosts, by NIC affinity, in rounds that never
double-book an owner NIC), host_layout by affinity, and StripedSubscriber driven by a plan
through real engines (bytes checked)."""

import json
import os
import pickle
import random
import subprocess
import sys
import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from sluice.weights import _relay
from sluice.weights import placement as pl
from sluice.weights.placement import Placement, PullPlan, plan_pulls, probe

# ----------------------------------------------------------------------------- fake sysfs trees


class FakeSys:
    """A sysfs tree in a tmp dir, shaped like the C++ affinity test's (tests/transport/rdma/
    affinity_test.cpp): socket 0 has a PCIe switch with NIC mlx5_0 and GPU 05:00.0 below it and
    NIC mlx5_1 on another root port; socket 1 has NIC mlx5_2 and GPU 85:00.0; GPU 45:00.0 sits
    alone on root complex pci0000:40 (no NIC there)."""

    def __init__(self, root):
        self.root = str(root)
        self.node(0, "10 21", "0-7")
        self.node(1, "21 10", "8-15")
        self.pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0)
        self.pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0", 0)
        self.pci("pci0000:00/0000:00:03.0/0000:07:00.0", 0)
        self.pci("pci0000:80/0000:80:01.0/0000:81:00.0", 1)
        self.pci("pci0000:80/0000:80:02.0/0000:85:00.0", 1)
        self.pci("pci0000:40/0000:40:01.0/0000:45:00.0", 0)
        self.bus("0000:05:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0")
        self.bus("0000:85:00.0", "pci0000:80/0000:80:02.0/0000:85:00.0")
        self.bus("0000:45:00.0", "pci0000:40/0000:40:01.0/0000:45:00.0")

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def node(self, n, dist, cpus):
        d = self.path("devices", "system", "node", f"node{n}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "distance"), "w") as f:
            f.write(dist + "\n")
        with open(os.path.join(d, "cpulist"), "w") as f:
            f.write(cpus + "\n")

    def pci(self, path, numa):
        d = self.path("devices", path)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "numa_node"), "w") as f:
            f.write(f"{numa}\n")

    def bus(self, bus_id, path):
        os.makedirs(self.path("bus", "pci", "devices"), exist_ok=True)
        os.symlink(self.path("devices", path), self.path("bus", "pci", "devices", bus_id))

    def ib(self, name, path, ports=None):
        """NIC ``name`` at PCI ``path`` (a virtual device when path starts with "virtual");
        ``ports``: {port: "ACTIVE"/"DOWN"} written as sysfs does ("4: ACTIVE")."""
        d = self.path("class", "infiniband", name)
        os.makedirs(d, exist_ok=True)
        target = self.path("devices", path)
        os.makedirs(target, exist_ok=True)
        os.symlink(target, os.path.join(d, "device"))
        for p, state in (ports or {}).items():
            os.makedirs(os.path.join(d, "ports", str(p)), exist_ok=True)
            with open(os.path.join(d, "ports", str(p), "state"), "w") as f:
                f.write({"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN"}[state] + "\n")

    def three_nics(self):
        self.ib("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", {1: "ACTIVE"})
        self.ib("mlx5_1", "pci0000:00/0000:00:03.0/0000:07:00.0", {1: "ACTIVE"})
        self.ib("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0", {1: "ACTIVE"})
        return self


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.delenv("SLUICE_IB_HCA", raising=False)
    return FakeSys(tmp_path / "sys")


def test_gpu_under_a_pcie_switch_with_a_nic(fake):
    fake.three_nics()
    p = probe("00000000:05:00.0", sysfs=fake.root, host="h")  # CUDA's 8-digit domain form
    assert p == Placement("h", "0000:05:00.0", 0, ("mlx5_0",), 4)  # up to the switch and down: 2 + 2
    assert p.nic == "mlx5_0" and p.hca() == "=mlx5_0"
    q = probe("0000:85:00.0", sysfs=fake.root, host="h")
    assert (q.numa, q.nics, q.distance) == (1, ("mlx5_2",), 4)


def test_nic_on_another_root_complex(fake):
    fake.ib("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0")
    p = probe("45:00.0", sysfs=fake.root, host="h")
    assert p.gpu == "0000:45:00.0" and p.nics == ("mlx5_2",) and p.distance == 6  # 3 up, 3 down
    # Two NICs elsewhere: the nearer by hops; as near: both, by name.
    fake.ib("mlx5_1", "pci0000:00/0000:00:03.0/0000:07:00.0")
    assert probe("0000:45:00.0", sysfs=fake.root, host="h").nics == ("mlx5_1", "mlx5_2")
    fake.ib("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0")
    assert probe("0000:45:00.0", sysfs=fake.root, host="h").nics == ("mlx5_1", "mlx5_2")


def test_two_nics_under_the_gpus_switch_tie(fake):
    fake.three_nics()
    fake.pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:04:00.0", 0)
    fake.ib("mlx5_9", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:04:00.0")
    p = probe("0000:05:00.0", sysfs=fake.root, host="h")
    assert p.nics == ("mlx5_0", "mlx5_9") and p.distance == 4 and p.hca() == "=mlx5_0,mlx5_9"


def test_no_nic_is_no_error(fake, tmp_path):
    p = probe("0000:05:00.0", sysfs=fake.root, host="h")
    assert p == Placement("h", "0000:05:00.0", 0, None, None)
    bare = probe(sysfs=str(tmp_path / "nothing"), host="h")
    assert bare == Placement("h") and bare.nic is None and bare.hca() is None
    # A GPU that sysfs does not know: no position, every NIC as near.
    fake.three_nics()
    assert probe("0000:99:00.0", sysfs=fake.root, host="h").nics == ("mlx5_0", "mlx5_1", "mlx5_2")


def test_cpu_only_process_uses_its_numa_node(fake, monkeypatch):
    fake.three_nics()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8, 16)))
    p = probe(sysfs=fake.root, host="h")
    assert p == Placement("h", None, 1, ("mlx5_2",), 10)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})
    assert probe("cpu", sysfs=fake.root, host="h").nics == ("mlx5_0", "mlx5_1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 9})  # spans both: nothing to prefer
    p = probe(sysfs=fake.root, host="h")
    assert p.numa is None and p.nics == ("mlx5_0", "mlx5_1", "mlx5_2") and p.distance is None
    # No SLIT table: same node 10, another 20.
    os.remove(fake.path("devices", "system", "node", "node1", "distance"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8})
    assert probe(sysfs=fake.root, host="h").distance == 10


def test_filters_down_ports_and_virtual_devices(fake, monkeypatch):
    fake.three_nics()
    assert probe("0000:05:00.0", sysfs=fake.root, host="h", nics="^mlx5_0").nics == ("mlx5_1",)
    assert probe("0000:05:00.0", sysfs=fake.root, host="h", nics=["mlx5_2"]).nics == ("mlx5_2",)
    assert probe("0000:05:00.0", sysfs=fake.root, host="h", nics="=mlx5_0:2").nics is None  # no port 2
    monkeypatch.setenv("SLUICE_IB_HCA", "mlx5_1,mlx5_2")  # what the engine honours
    assert probe("0000:05:00.0", sysfs=fake.root, host="h").nics == ("mlx5_1",)
    monkeypatch.delenv("SLUICE_IB_HCA")
    with open(fake.path("class", "infiniband", "mlx5_0", "ports", "1", "state"), "w") as f:
        f.write("1: DOWN\n")
    assert probe("0000:05:00.0", sysfs=fake.root, host="h").nics == ("mlx5_1",)  # a down NIC does not count
    # SoftRoCE: no PCI parent, no NUMA node: there, but nothing says how near.
    fake.ib("rxe0", "virtual/net/dummy0")
    assert probe("0000:05:00.0", sysfs=fake.root, host="h", nics="rxe").nics == ("rxe0",)
    assert probe("0000:05:00.0", sysfs=fake.root, host="h", nics="rxe").distance is None
    for bad in ("^", "=", "a,,b", "mlx5_0:x", ":1"):
        with pytest.raises(ValueError):
            pl.parse_hca(bad)


def test_host_label_gpu_from_torch_and_plain_data(fake, monkeypatch):
    monkeypatch.setenv("SLUICE_HOST_ID", "rack3-node7")
    fake.three_nics()
    seen = []

    def bus_id(device):
        seen.append(device)
        return "00000000:05:00.0"

    monkeypatch.setattr(pl, "_cuda_bus_id", bus_id)
    p = probe(1, sysfs=fake.root)
    assert seen == [1] and p == Placement("rack3-node7", "0000:05:00.0", 0, ("mlx5_0",), 4)
    assert Placement.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(Placement.from_dict(p.to_dict()))
    monkeypatch.delenv("SLUICE_HOST_ID")
    assert probe(sysfs=fake.root).host == __import__("socket").gethostname()
    with pytest.raises(ValueError):
        Placement("")
    with pytest.raises(ValueError):
        Placement("h", nics=())


def test_bus_id_from_torch_device_properties(monkeypatch):
    torch = pytest.importorskip("torch")
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 2 else None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert pl._cuda_bus_id("cuda:2") == "0000:3b:00.0"
    assert pl._cuda_bus_id(2) == "0000:3b:00.0"
    assert pl._cuda_bus_id("cuda") == "0000:3b:00.0"
    with pytest.raises(ValueError):
        pl._cuda_bus_id(torch.device("meta"))


def test_placement_imports_without_torch():
    path = pl.__file__
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('p', %r); "
            "m = sys.modules['p'] = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "m.probe(sysfs='/nonexistent', host='h'); print('torch' in sys.modules)") % path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out


# ----------------------------------------------------------------------------------- the planner


def owner_nic_key(p):
    return (p.host, p.nic or "")


def check_plan(plan, owners, receivers, sizes=None):
    """The planner's promises, for any input."""
    n, m = len(owners), len(receivers)
    sizes = sizes or [1] * n
    assert len(plan.sources) == m and len(plan.rounds) == m
    hosts = {}
    for i, r in enumerate(receivers):
        hosts.setdefault(r.host, []).append(i)
    for i, r in enumerate(receivers):
        assert len(plan.sources[i]) == n
        # every shard exactly once: from its owner, or from one receiver of our host that has it from the owner
        for o in range(n):
            s = plan.sources[i][o]
            if owners[o].host == r.host:
                assert s is None, "a receiver on the owner's host reads it itself"
            elif s is not None:
                assert s != i and receivers[s].host == r.host and plan.sources[s][o] is None
        flat = [o for rnd in plan.rounds[i] for o in rnd]
        assert sorted(flat) == list(range(n)) and all(plan.rounds[i])
        assert plan.rounds[i] == plan.rounds[hosts[r.host][0]], "a host's receivers share its rounds"
    # cross-host bytes: one model per receiving host (less the shards it holds)
    per = Counter((receivers[i].host, o) for i, o, _ in plan.pulls)
    assert all(c == 1 for c in per.values())
    want = {(h, o) for h in hosts for o in range(n) if owners[o].host != h}
    assert set(per) == want
    for i, o, _ in plan.pulls:
        assert plan.sources[i][o] is None
    crossing = sum(sizes[o] for _, o, _ in plan.pulls)
    assert crossing == sum(sizes[o] for h in hosts for o in range(n) if owners[o].host != h)
    # rounds: no owner NIC and no puller twice in one; as few as the busiest of them needs
    by_round = {}
    for i, o, c in plan.pulls:
        by_round.setdefault(c, []).append((i, o))
    for c, pulls in by_round.items():
        nics = [owner_nic_key(owners[o]) for _, o in pulls]
        assert len(set(nics)) == len(nics), f"round {c}: an owner NIC serves two pullers {pulls}"
        assert len({i for i, _ in pulls}) == len(pulls), f"round {c}: a puller pulls twice {pulls}"
    deg = Counter(i for i, _, _ in plan.pulls) + Counter(owner_nic_key(owners[o]) for _, o, _ in plan.pulls)
    assert len(by_round) == (max(deg.values()) if deg else 0)
    assert sorted(by_round) == list(range(len(by_round)))
    # a host's pulls follow its rounds
    for i, o, c in plan.pulls:
        host_rounds = sorted({c2 for i2, _, c2 in plan.pulls if receivers[i2].host == receivers[i].host})
        assert o in plan.rounds[i][host_rounds.index(c)]
    # relays are what others take from us
    for i in range(m):
        assert set(plan.relays(i)) == {o for j in range(m) for o in range(n) if plan.sources[j][o] == i}


def scenario(rng):
    """Owners on 1-2 trainer hosts (1-4 NICs each, a rank per GPU near one of them), receivers on
    1-4 hosts (some may share a trainer host), 1-4 NICs, GPUs at various PCIe distances."""
    owners = []
    for t in range(rng.randint(1, 2)):
        nics = rng.randint(1, 4)
        for g in range(rng.choice([1, 2, 4, 8])):
            owners.append(Placement(f"t{t}", f"0000:{g:02x}:00.0", 0, (f"mlx5_{g % nics}",), 4))
    receivers = []
    for h in range(rng.randint(1, 4)):
        host = f"t{h}" if rng.random() < 0.2 else f"r{h}"
        kind = rng.choice(["nic", "tie", "none"])
        nics = rng.randint(1, 4)
        for g in range(rng.randint(1, 8)):
            if kind == "none":
                receivers.append(Placement(host))
            elif kind == "tie":
                receivers.append(Placement(host, None, None, tuple(f"mlx5_{k}" for k in range(nics)), None))
            else:
                receivers.append(Placement(host, f"0000:{g:02x}:00.0", 0, (f"mlx5_{g % nics}",), rng.choice([2, 4, 8])))
    rng.shuffle(receivers)
    return owners, receivers


@pytest.mark.parametrize("seed", range(40))
def test_planner_properties_over_shuffled_hosts(seed):
    rng = random.Random(seed)
    owners, receivers = scenario(rng)
    sizes = [rng.randint(1, 100) for _ in owners] if seed % 2 else None
    plan = plan_pulls(owners, receivers, sizes=sizes)
    check_plan(plan, owners, receivers, sizes)
    assert plan_pulls(owners, receivers, sizes=sizes) == plan  # deterministic
    assert PullPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # each puller is among the nearest of its NIC group
    for i, o, _ in plan.pulls:
        r = receivers[i]
        if r.nics is not None and len(r.nics) == 1 and r.distance is not None:
            group = [p for p in receivers if p.host == r.host and p.nics == r.nics]
            assert r.distance == min(p.distance for p in group if p.distance is not None)


def test_planner_spreads_shards_over_a_hosts_nics_matching_rails():
    # 8 trainer ranks, one per NIC; receiving hosts with 8 GPUs, GPU g nearest mlx5_{g // 2} (4 NICs),
    # the even GPU 2 hops from it, the odd one 4.
    owners = [Placement("trainer", f"0000:{g:02x}:00.0", 0, (f"mlx5_{g}",), 2) for g in range(8)]
    receivers = [Placement(h, f"0000:{g:02x}:00.0", 0, (f"mlx5_{g // 2}",), 2 if g % 2 == 0 else 4)
                 for h in ("a", "b") for g in range(8)]
    plan = plan_pulls(owners, receivers)
    check_plan(plan, owners, receivers)
    pullers = {o: i for i, o, _ in plan.pulls if receivers[i].host == "a"}
    # two shards per NIC, the same-named NIC's shard among them, pulled by the GPU nearest it
    assert pullers == {0: 0, 1: 2, 2: 4, 3: 6, 4: 0, 5: 2, 6: 4, 7: 6}
    assert all(plan.sources[1][o] == pullers[o] for o in range(8))
    # 16 pulls, each owner NIC serves 2 hosts, each puller pulls 2 shards: 2 rounds of 8
    assert len({c for _, _, c in plan.pulls}) == 2
    assert [len(r) for r in plan.rounds[0]] == [4, 4]


def test_planner_round_robins_owner_nics():
    """Two owners on one trainer NIC, two on another, two receiving hosts with one NIC and one
    receiver each: each round the hosts read different owner NICs (checkpoint-engine's round
    robin), in the 4 rounds the busiest owner NIC needs."""
    owners = [Placement("t", nics=("mlx5_0",)), Placement("t", nics=("mlx5_0",)),
              Placement("t", nics=("mlx5_1",)), Placement("t", nics=("mlx5_1",))]
    receivers = [Placement("a", nics=("mlx5_0",)), Placement("b", nics=("mlx5_0",))]
    plan = plan_pulls(owners, receivers)
    check_plan(plan, owners, receivers)
    assert len(plan.rounds[0]) == 4 and len({c for *_, c in plan.pulls}) == 4
    for c in range(4):
        nics = [owners[o].nic for i, o, c2 in plan.pulls if c2 == c]
        assert len(nics) == len(set(nics)) == 2


def test_planner_local_shards_labels_and_ties():
    # Host labels only: one group per host, every receiver a candidate, shards in turn by index;
    # both owners share the trainer host's one (unknown) NIC, so one round each.
    plan = plan_pulls(["t", "t"], ["a", "a", "t", "a"])
    assert plan.sources == ((None, 1), (0, None), (None, None), (0, 1))
    assert plan.rounds == (((0,), (1,)), ((0,), (1,)), ((0, 1),), ((0,), (1,)))
    assert plan.pulls == ((0, 0, 0), (1, 1, 1)) and plan.relays(0) == (0,) and plan.relays(2) == ()
    # A receiving host's local shard is read by each of its receivers, in the first round.
    plan = plan_pulls(["a", "b"], ["a", "a"])
    assert plan.sources == ((None, None), (None, 0)) and plan.rounds[1] == ((0, 1),)
    assert plan_pulls([], ["a"]).sources == ((),) and plan_pulls(["a"], []).sources == ()
    with pytest.raises(ValueError):
        plan_pulls(["a"], ["b"], sizes=[1, 2])
    with pytest.raises(ValueError):
        plan_pulls([3], ["b"])


def test_ties_go_to_the_lower_index_and_inputs_order_is_kept():
    owners = [Placement("t", nics=("x",))] * 3
    receivers = [Placement("a", nics=("y",), distance=4)] * 3
    plan = plan_pulls(owners, receivers)
    assert [i for i, o, _ in sorted(plan.pulls, key=lambda p: p[1])] == [0, 1, 2]  # in turn, lowest first
    # by bytes: the largest shard first, to the least loaded
    plan = plan_pulls(owners, receivers[:2], sizes=[10, 30, 15])
    assert {o: i for i, o, _ in plan.pulls} == {1: 0, 2: 1, 0: 1}


# -------------------------------------------------------------------------- host_layout by NIC


def test_host_layout_leads_each_host_with_the_receiver_nearest_a_nic():
    hosts = [Placement("a", distance=8, nics=("m0",)), Placement("a", distance=2, nics=("m1",)),
             Placement("b", distance=4, nics=("m0",)), Placement("a", distance=4, nics=("m0",)),
             Placement("b", distance=2, nics=("m0",))]
    parents = _relay.host_layout(hosts, fanout=2)
    assert parents[1] is None and parents[4] == 1  # the leaders: nearest of a, nearest of b
    assert parents[0] == 1 and parents[3] == 1 and parents[2] == 4
    # Nothing known: as by labels (existing behaviour).
    for labels in (list("aaabbb"), list("ababc"), list("ttaat")):
        for fanout in (1, 2, 3):
            for th in (None, "t"):
                assert _relay.host_layout([Placement(h) for h in labels], fanout, th) == \
                    _relay.host_layout(labels, fanout, th)
    # trainer_host may be a placement
    assert _relay.host_layout([Placement("t"), Placement("a")], trainer_host=Placement("t")) == [None, None]


@pytest.mark.parametrize("seed", range(10))
def test_host_layout_by_affinity_still_crosses_each_host_once(seed):
    rng = random.Random(seed)
    hosts = [Placement(rng.choice("abcd"), distance=rng.choice([None, 2, 4, 8])) for _ in range(rng.randint(1, 12))]
    for fanout in (1, 2):
        parents = _relay.host_layout(hosts, fanout)
        crossing = [i for i, p in enumerate(parents) if p is None or hosts[p].host != hosts[i].host]
        assert sorted(hosts[i].host for i in crossing) == sorted({h.host for h in hosts})
        for i in crossing:  # the one that crosses is its host's nearest
            near = [h.distance for h in hosts if h.host == hosts[i].host and h.distance is not None]
            assert hosts[i].distance == (min(near) if near else None)
        for i in range(len(hosts)):  # every receiver reaches the trainer
            seen, j = set(), i
            while parents[j] is not None:
                assert j not in seen
                seen.add(j)
                j = parents[j]


# ------------------------------------------------------- end to end: StripedSubscriber by a plan

torch = pytest.importorskip("torch")

import sluice  # noqa: E402
from sluice.weights import StripedSubscriber  # noqa: E402

import weights_peer as wp  # noqa: E402
from test_weights_update import CTX, SPEC, Trainer, check  # noqa: E402

HALF = len(SPEC) // 2
SHARD_BYTES = [sum(wp.as_bytes(torch.empty(s, dtype=d)).numel() for _, d, s in part)
               for part in (SPEC[:HALF], SPEC[HALF:])]


class NamedTrainer(Trainer):
    """test_weights_update's trainer process, publishing under ``name``."""

    def __init__(self, spec, name):
        self.conn, child = CTX.Pipe()
        self.p = CTX.Process(target=wp.trainer, args=(child, spec, None, None, name, "register"), daemon=True)
        self.p.start()
        assert self.conn.poll(60), "trainer did not start"
        self.ref = self.conn.recv()
        self.versions = {n: 1 for n, _, _ in spec}


@pytest.fixture(scope="module")
def sharded():
    """Two trainer ranks (owners), each publishing half of the model under one name, as
    checkpoint-engine's ranks do (a member relaying both shards tells them apart by the
    trainer's instance, in its relay regions' names)."""
    ts = [NamedTrainer(SPEC[:HALF], "policy"), NamedTrainer(SPEC[HALF:], "policy")]
    yield ts
    for t in ts:
        t.stop()


def run_plan(trainers, receivers, plan):
    """One engine and StripedSubscriber per receiver (threads here), as the plan says; their
    results, every byte checked."""
    engines = [sluice.Engine(listen="127.0.0.1:0") for _ in receivers]
    try:
        addrs = [e.listen_address for e in engines]
        refs = [t.ref for t in trainers]
        subs = [StripedSubscriber(e, refs, addrs, i, sources=plan.sources[i], serve=plan.relays(i),
                                  rounds=plan.rounds[i], bucket_bytes=64 << 10, relay_wait=30.0)
                for i, e in enumerate(engines)]
        targets = [wp.empty_targets(SPEC) for _ in receivers]
        out, errs = [None] * len(subs), []

        def go(i):
            try:
                out[i] = subs[i].update(targets[i], force=True)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(subs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        if errs:
            raise errs[0]
        for i in range(len(subs)):
            check(targets[i], SPEC, lambda n: 1)
        for s in subs:
            s.close()
        return out
    finally:
        for e in engines:
            e.close()


def test_end_to_end_two_nics(sharded):
    """Owners on host "t" (rank 0 near mlx5_0, rank 1 near mlx5_1); host "r" has two receivers near
    mlx5_0 (2 and 8 hops) and one near mlx5_1; one more receiver is on "t". The engines are all
    on this machine: the labels and NICs are the plan's, the bytes move for real."""
    owners = [Placement("t", nics=("mlx5_0",), distance=2), Placement("t", nics=("mlx5_1",), distance=2)]
    receivers = [Placement("r", nics=("mlx5_1",), distance=4), Placement("r", nics=("mlx5_0",), distance=8),
                 Placement("r", nics=("mlx5_0",), distance=2), Placement("t", nics=("mlx5_0",), distance=2)]
    plan = plan_pulls(owners, receivers, sizes=SHARD_BYTES)
    check_plan(plan, owners, receivers, SHARD_BYTES)
    # shard 0 by the receiver nearest mlx5_0, shard 1 by the one on mlx5_1, in one round
    assert plan.sources == ((2, None), (2, 0), (None, 0), (None, None))
    assert plan.rounds[0] == ((0, 1),)
    res = run_plan(sharded, receivers, plan)
    total = sum(SHARD_BYTES)
    assert all(r.nbytes == total and r.source_fallback == "" for r in res), res
    assert [r.from_source for r in res] == [SHARD_BYTES[0], total, SHARD_BYTES[1], 0]


def test_end_to_end_one_nic_in_rounds(sharded):
    """One receiving NIC: its nearest receiver pulls both shards, one round each; the others
    take them from it round by round."""
    owners = [Placement("t", nics=("mlx5_0",)), Placement("t", nics=("mlx5_1",))]
    receivers = [Placement("r", nics=("mlx5_0",), distance=6), Placement("r", nics=("mlx5_0",), distance=2),
                 Placement("r", nics=("mlx5_0",), distance=6)]
    plan = plan_pulls(owners, receivers)
    check_plan(plan, owners, receivers)
    assert plan.sources == ((1, 1), (None, None), (1, 1)) and plan.rounds[0] == ((0,), (1,))
    res = run_plan(sharded, receivers, plan)
    total = sum(SHARD_BYTES)
    assert [r.from_source for r in res] == [total, 0, total] and all(r.source_fallback == "" for r in res), res


def test_serving_one_trainer_twice_is_refused(sharded):
    """One trainer given for two stripes that this member would both serve: it says so before
    any byte moves (two trainers publishing under one name are fine: the other tests)."""
    with sluice.Engine(listen="127.0.0.1:0") as a:
        ref = sharded[0].ref
        m = StripedSubscriber(a, [ref, ref], [a.listen_address, "127.0.0.1:1"], 0, sources=[None, None])
        targets = wp.empty_targets(SPEC[:HALF])
        with pytest.raises(sluice.InvalidArgumentError, match="same publisher"):
            m.update(targets)
        assert not any(t.any() for t in targets.values() if t.numel())
        m.close()
        # serving one of them is fine
        m = StripedSubscriber(a, [ref, ref], [a.listen_address, "127.0.0.1:1"], 0, sources=[None, None], serve=[1])
        assert m.update(targets).nbytes == SHARD_BYTES[0] * 2
        check(targets, SPEC[:HALF], lambda n: 1)
        m.close()


def test_striped_arguments_with_a_plan():
    with sluice.Engine(listen="127.0.0.1:0") as a:
        me = a.listen_address
        members = [me, "127.0.0.1:1", "127.0.0.1:2"]
        ok = StripedSubscriber(a, ["x:1", "x:2"], members, 0, sources=[None, 2], rounds=[[1], [0]])
        assert ok.sources == [None, 2] and ok.rounds == [[1], [0]]
        assert [s.source for s in ok.subscribers] == [None, "127.0.0.1:2"]
        assert [s.relay for s in ok.subscribers] == [True, False]
        ok.close()
        one = StripedSubscriber(a, "x:1", members, 1, sources=[None, 0, 2, None], serve=[3])  # one trainer, 4 stripes
        subs = one.subscribers
        assert len(subs) == 4 and one.rounds == [[0, 1, 2, 3]]
        assert subs[0] is subs[3] and len({id(s) for s in subs}) == 3  # from one place: one subscriber
        assert [s.relay for s in subs] == [True, False, False, True]
        one.close()
        quiet = StripedSubscriber(a, ["x:1", "x:2"], members, 0, sources=[None, None], serve=[])
        assert [s.relay for s in quiet.subscribers] == [False, False]
        quiet.close()
        for refs, rank, sources, rounds in [(["x:1", "x:2"], 0, [None, 0], None),  # ourselves
                                            (["x:1", "x:2"], 0, [None, 3], None),  # no such member
                                            (["x:1", "x:2", "x:3"], 0, [None, 1], None),  # refs != stripes
                                            (["x:1", "x:2"], 0, [], None),
                                            (["x:1", "x:2"], 0, [None, True], None),
                                            (["x:1", "x:2"], 0, [None, 1], [[0]]),  # a stripe in no round
                                            (["x:1", "x:2"], 0, [None, 1], [[0, 1], [1]]),  # twice
                                            (["x:1", "x:2"], 0, [None, 1], [[0, None]])]:
            with pytest.raises(sluice.InvalidArgumentError):
                StripedSubscriber(a, refs, members, rank, sources=sources, rounds=rounds)
        for serve in ([1], [0, 0.5], "0", [2]):  # stripe 1 comes from member 1: not ours to serve
            with pytest.raises(sluice.InvalidArgumentError):
                StripedSubscriber(a, ["x:1", "x:2"], members, 0, sources=[None, 1], serve=serve)
