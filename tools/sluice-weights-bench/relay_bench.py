"""Fan-out of sluice.weights over rate-limited links: direct pulls against relay trees.

    python tools/sluice-weights-bench/relay_bench.py [--receivers 3] [--per-host 1]
        [--size-mib 64] [--tensors 200] [--link-mbit 1000] [--rounds 3]
        [--modes direct,chain,tree,hosts] [--fanout 2] [--bucket-mib 4] [--check] [--json out.json]

Each host is a network namespace on a bridge (tools/common/netns.py), its link's egress limited
to ``--link-mbit`` with a token bucket (``tc tbf``), as a NIC would: the trainer alone on one,
the receivers ``--per-host`` to a host (tcp between receivers of one host runs over its
loopback, unlimited, as shm or NVLink would within a node).
Receivers pull the trainer's whole model in every round (``update(force=True)``), all at
once, in one of these modes, the modes interleaved round by round:

- direct: every receiver reads the trainer, whose link carries the model once per receiver;
- chain: receiver i reads receiver i-1 (``relay_parent(i, 1)``), bucket by bucket;
- tree: receiver i reads ``relay_parent(i, fanout)``;
- hosts: ``relay_layout(hosts, fanout)``: one receiver per host pulls across hosts (a tree of
  those), the others from their own host.

A round's time is its slowest receiver's. The table gives medians and spread, the bytes the
trainer sent and the bytes that crossed host links per round, and the link-limited time of
each mode's critical path (the busiest host link, carrying one model per receiver on another
host that pulls from it) for comparison. Needs root and iproute2 (``tc``); elsewhere it says
why and exits 2. ``--check``: every receiver's crc32 per
tensor against the trainer's after the last round (exit 1 on a mismatch).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))  # netns.py
sys.path.insert(0, str(HERE))  # bench.py: the synthetic model

MODES = ("direct", "chain", "tree", "hosts")


# ------------------------------------------------------------ workers (one per namespace)

def _reply(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker(role: str, cfg: Dict[str, Any]) -> None:
    """Runs inside a namespace; reads one JSON command a line on stdin, answers on stdout."""
    import torch

    import sluice
    from bench import _POOL, crc, fill, synthetic_spec
    from sluice.weights import WeightPublisher, WeightSubscriber

    torch.set_num_threads(1)
    spec = synthetic_spec(cfg["size"], cfg["tensors"])
    engine = sluice.Engine(listen=f"{cfg['addr']}:0", transports="tcp")
    if role == "trainer":
        pool = torch.randint(0, 256, (2 * _POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        tensors = {}
        for i, (name, dt, shape) in enumerate(spec):
            tensors[name] = torch.empty(shape, dtype=dt)
            fill(tensors[name], pool, i)
        pub = WeightPublisher(engine, "bench")
        pub.register(tensors)
        pub.publish(1)
        _reply({"ready": True, "ref": engine.listen_address, "crc": {n: crc(t) for n, t in tensors.items()}})
        version = 1
        for line in sys.stdin:  # a new version for every round (the same bytes), until "stop"
            if json.loads(line)["cmd"] != "publish":
                break
            version += 1
            pub.publish(version)
            _reply({"version": version})
        pub.close()
        engine.close()
        return
    targets = {n: torch.zeros(s, dtype=d) for n, d, s in spec}
    sub = WeightSubscriber(engine, cfg["trainer"], bucket_bytes=cfg["bucket"], depth=cfg["depth"], timeout=300,
                           relay=True, relay_wait=cfg["relay_wait"])
    sub.published()  # connected, metadata read: not timed
    _reply({"ready": True, "ref": engine.listen_address})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "update":
            sub.source = cmd["source"]
            t0 = time.perf_counter()
            res = sub.update(targets, force=True)
            _reply({"secs": time.perf_counter() - t0, "nbytes": res.nbytes, "from_source": res.from_source,
                    "fallback": res.source_fallback})
        elif cmd["cmd"] == "crc":
            _reply({"crc": {n: crc(t) for n, t in targets.items()}})
        else:
            break
    sub.close()
    engine.close()


class Proc:
    """One worker process in a namespace, answering a line per command (with a deadline)."""

    def __init__(self, host, role: str, cfg: Dict[str, Any]):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen([*host.exec_prefix(), sys.executable, str(Path(__file__).resolve()), "--worker",
                                   role, json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)

    def send(self, obj: Dict[str, Any]) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float) -> Dict[str, Any]:
        import select

        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if r else ""
        if not line:
            raise RuntimeError(f"relay_bench: a worker did not answer within {timeout:g} s (exit {self.p.poll()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)


# ------------------------------------------------------------ driver

def parents(mode: str, hosts: List[int], fanout: int) -> List[Optional[int]]:
    """Each receiver's parent in ``mode`` (None: the trainer); ``hosts[i]``: receiver i's host."""
    from sluice.weights import relay_layout, relay_parent

    if mode == "direct":
        return [None] * len(hosts)
    if mode == "hosts":
        return relay_layout(hosts, fanout)
    k = 1 if mode == "chain" else fanout
    return [relay_parent(i, k) for i in range(len(hosts))]


def crossing(parent: List[Optional[int]], hosts: List[int]) -> Dict[int, int]:
    """Receivers whose source is on another host: receiver -> the source's host (-1: the
    trainer, alone on its host)."""
    out = {}
    for i, p in enumerate(parent):
        src = -1 if p is None else hosts[p]
        if src != hosts[i]:
            out[i] = src
    return out


def link_bound(parent: List[Optional[int]], hosts: List[int], model_bytes: int, bits_per_s: float) -> float:
    """Seconds the busiest host link needs: it carries one model per receiver on another host
    that pulls from the trainer or from a receiver on it."""
    load: Dict[int, int] = {}
    for src in crossing(parent, hosts).values():
        load[src] = load.get(src, 0) + 1
    return max(load.values(), default=0) * model_bytes * 8 / bits_per_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--per-host", type=int, default=1, help="receivers per host (namespace)")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--link-mbit", type=int, default=1000, help="each host's egress rate (tc tbf), Mbit/s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fanout", type=int, default=2, help="children per relay in the tree mode")
    ap.add_argument("--bucket-mib", type=float, default=4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--relay-wait", type=float, default=10.0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("ROLE", "CONFIG"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], json.loads(a.worker[1]))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in modes) or not modes:
        ap.error(f"--modes: a comma list of {', '.join(MODES)}")
    if min(a.receivers, a.per_host, a.size_mib, a.tensors, a.link_mbit, a.rounds, a.fanout, a.depth) <= 0 or \
            a.bucket_mib <= 0:
        ap.error("sizes, counts and rates must be > 0")

    import netns

    why = netns.unavailable_reason()
    if why is None and subprocess.run(["which", "tc"], capture_output=True).returncode != 0:
        why = "the 'tc' command (iproute2) is not installed"
    if why:
        print(f"relay_bench: cannot run here: {why}", file=sys.stderr)
        return 2
    netns.cleanup_stale()
    cfg = {"size": a.size_mib << 20, "tensors": a.tensors, "bucket": int(a.bucket_mib * (1 << 20)), "depth": a.depth,
           "relay_wait": a.relay_wait}
    t_start = time.perf_counter()
    procs: List[Proc] = []
    host_of = [i // a.per_host for i in range(a.receivers)]
    with netns.Topology(2 + host_of[-1], tag="wr") as topo:
        for h in topo.hosts:  # every host's uplink, as a NIC's line rate
            subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.dev, "root", "tbf", "rate",
                            f"{a.link_mbit}mbit", "burst", "256kb", "latency", "100ms"], check=True)
        try:
            trainer = Proc(topo.hosts[0], "trainer", dict(cfg, addr=topo.hosts[0].addr))
            procs.append(trainer)
            hello = trainer.recv(300)
            want, model = hello["crc"], None
            recv = [Proc(topo.hosts[1 + h], "receiver", dict(cfg, addr=topo.hosts[1 + h].addr, trainer=hello["ref"]))
                    for h in host_of]
            procs += recv
            refs = [r.recv(300)["ref"] for r in recv]
            print(f"relay_bench: {a.receivers} receivers ready after {time.perf_counter() - t_start:.1f} s",
                  file=sys.stderr, flush=True)
            samples: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
            for rnd in range(a.rounds):
                for m in modes:
                    par = parents(m, host_of, a.fanout)
                    src = [None if p is None else refs[p] for p in par]
                    # A new version each round, as a trainer's step makes: relays hold the last
                    # one until they have the new bytes, and children wait for those.
                    trainer.send({"cmd": "publish"})
                    trainer.recv(60)
                    t0 = time.perf_counter()
                    for r, s in zip(recv, src):
                        r.send({"cmd": "update", "source": s})
                    got = [r.recv(600) for r in recv]
                    wall = time.perf_counter() - t0
                    model = got[0]["nbytes"]
                    sent = sum(g["nbytes"] - g["from_source"] for g in got)
                    # bytes over host links: all from the trainer (alone on its host), and from a
                    # relay on another host
                    far = crossing(par, host_of)
                    cross = sent + sum(got[i]["from_source"] for i, src in far.items() if src != -1)
                    fallbacks = [g["fallback"] for g in got if g["fallback"]]
                    samples[m].append({"round_s": wall, "slowest_s": max(g["secs"] for g in got),
                                       "trainer_bytes": sent, "cross_host_bytes": cross, "fallbacks": fallbacks})
                    print(f"round {rnd + 1}/{a.rounds} {m:<7} {wall:8.3f} s  trainer sent "
                          f"{sent / (1 << 20):7.1f} MiB, across hosts {cross / (1 << 20):7.1f} MiB" +
                          (f"  fallbacks: {fallbacks}" if fallbacks else ""),
                          file=sys.stderr, flush=True)
            bad = []
            if a.check:
                for i, r in enumerate(recv):
                    r.send({"cmd": "crc"})
                    crcs = r.recv(300)["crc"]
                    bad += [f"receiver {i}: {n}" for n in want if crcs.get(n) != want[n]]
            trainer.send({"cmd": "stop"})
        finally:
            for p in procs:
                p.close()
    rate = a.link_mbit * 1e6
    print(f"relay_bench: {a.tensors} tensors, {model / (1 << 20):.1f} MiB, {a.receivers} receivers "
          f"({a.per_host} per host), links "
          f"{a.link_mbit} Mbit/s each (tc tbf), buckets {a.bucket_mib:g} MiB x{a.depth}, tree fanout {a.fanout}, "
          f"medians of {a.rounds} interleaved rounds")
    print(f"| mode | round s (min-max) | link-bound s | trainer sent MiB | across hosts MiB | vs direct |")
    print("|---|---:|---:|---:|---:|---:|")
    med = {m: statistics.median(s["round_s"] for s in samples[m]) for m in modes}
    for m in modes:
        r = [s["round_s"] for s in samples[m]]
        sent = statistics.median(s["trainer_bytes"] for s in samples[m]) / (1 << 20)
        cross = statistics.median(s["cross_host_bytes"] for s in samples[m]) / (1 << 20)
        vs = f"{med[m] / med['direct']:.2f}" if "direct" in med else "-"
        print(f"| {m} | {med[m]:.3f} ({min(r):.3f}-{max(r):.3f}) | "
              f"{link_bound(parents(m, host_of, a.fanout), host_of, model, rate):.3f} | {sent:.1f} | {cross:.1f} | {vs} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"receivers": a.receivers, "per_host": a.per_host, "bytes": model, "link_mbit": a.link_mbit, "fanout": a.fanout,
                       "bucket_bytes": cfg["bucket"], "samples": samples}, f, indent=1)
    if a.check:
        if bad:
            print(f"relay_bench: WRONG BYTES in {len(bad)} tensors: {bad[:5]}", file=sys.stderr)
            return 1
        print(f"check: every byte right at {a.receivers} receivers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
