"""Scenario 1 of issue 19's "many hosts on one machine": 16 engines in 8 namespaces (2 per
namespace, each a process), every engine writing to and reading from every other in batches,
two rounds of distinct patterns per pair, every byte checked."""
from __future__ import annotations

from typing import Dict, List

from driver import WorkerProc, stop_all

HOSTS, PER_HOST = 8, 2
SLOT = 64 << 10  # bytes per pair and direction, in 8 pieces per batch


def test_sixteen_engines_all_to_all(topology, report):
    topo = topology(HOSTS, tag="a2a")
    n = HOSTS * PER_HOST
    workers: List[WorkerProc] = []
    try:
        for k in range(n):
            workers.append(WorkerProc(topo.hosts[k // PER_HOST], k, n, slot=SLOT, transports="tcp,shm"))
        for w in workers:
            w.ready()
        addrs = {str(w.index): w.listen for w in workers}
        for w in workers:  # the listener must be on the namespace's own address
            assert w.listen.startswith(w.host.addr + ":"), (w.index, w.listen)

        for w in workers:
            w.send("connect", targets={j: a for j, a in addrs.items() if int(j) != w.index})
        used: Dict[int, Dict[str, str]] = {w.index: w.reply("connect", 120)["transports"] for w in workers}

        same_host_pairs, cross = [], []
        for i, row in used.items():
            for j, t in row.items():
                j = int(j)
                if i // PER_HOST == j // PER_HOST:
                    same_host_pairs.append((i, j, t))
                else:
                    cross.append((i, j, t))
        # Across namespaces no same-host shortcut may apply: the bytes cross the veths.
        assert {t for _, _, t in cross} == {"tcp"}, [c for c in cross if c[2] != "tcp"]
        # Inside one namespace (same host id, same kernel, same network namespace) shm is the
        # right choice, which shows the harness's host identities are what decides.
        assert {t for _, _, t in same_host_pairs} == {"shm"}, same_host_pairs

        for rnd in (1, 2):
            for w in workers:
                w.send("prepare", rnd=rnd)
            for w in workers:
                w.reply("prepare", 60)
            for w in workers:
                w.send("alltoall", pieces=8, timeout=60)
            results = {w.index: w.reply("alltoall", 120) for w in workers}
            errors = {i: r["errors"] for i, r in results.items() if r["errors"]}
            assert not errors, f"round {rnd}: failed operations: {errors}"
            assert all(r["ops"] == 2 * (n - 1) for r in results.values())
            for w in workers:
                w.send("verify", rnd=rnd, peers=[j for j in range(n) if j != w.index])
            bad = {w.index: w.reply("verify", 60)["mismatches"] for w in workers}
            bad = {i: m for i, m in bad.items() if m}
            assert not bad, f"round {rnd}: wrong bytes: {bad}"

        report("alltoall", engines=n, namespaces=HOSTS, rounds=2, bytes_per_pair_and_direction=SLOT,
               pairs_tcp=len(cross), pairs_shm=len(same_host_pairs),
               transports="tcp between namespaces, shm between the 2 engines of a namespace")
    finally:
        stop_all(workers)
