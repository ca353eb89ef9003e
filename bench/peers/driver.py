"""Runs Sluice and every peer on the same cells, interleaved round by round (round r runs
every engine once before round r+1), and writes every sample. `python driver.py --help`.
bench/peers/run.sh sets up the environment and calls this."""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import FOOTPRINT, HUGEPAGES, Cell, cells_to_json, make_cells  # noqa: E402

ALL_OPS = ("read", "write", "send")


@dataclass
class Engine:
    name: str            # the column / legend name
    section: str         # tcp | shm | rdma
    module: str          # engines/<module>.py
    settings: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    ops: tuple = ("read", "write")
    local: bool = False  # one command runs both sides
    ceiling: bool = False
    not_run: str = ""    # why this row has no numbers


def engines(channels: int, qps: int = 1) -> list[Engine]:
    n = str(channels)
    return [
        # loopback TCP
        Engine("sluice tcp", "tcp", "sluice_peer", {"transport": "tcp", "channels": channels}, ops=ALL_OPS),
        # The same engine through its C++ API (no Python binding), as Open MPI's adapter is C.
        Engine("sluice c++ tcp", "tcp", "sluice_native_peer", {"transport": "tcp", "channels": channels},
               ops=ALL_OPS, local=True),
        # GLOG_minloglevel=1: Mooncake logs one INFO line per batch otherwise
        Engine("mooncake tcp", "tcp", "mooncake_peer", env={"GLOG_minloglevel": "1"}),
        Engine("mooncake tcp pool", "tcp", "mooncake_peer",
               env={"MC_TCP_ENABLE_CONNECTION_POOL": "1", "GLOG_minloglevel": "1"}),
        Engine("nixl ucx tcp", "tcp", "nixl_peer", env={"UCX_TLS": "tcp"}),
        Engine("dlslime tcp", "tcp", "dlslime_peer"),
        Engine("gloo", "tcp", "gloo_peer", ops=("send",)),
        Engine(f"ceiling: {n} tcp streams", "tcp", "ceiling_peer", {"mode": "tcp", "n": channels}, ops=ALL_OPS,
               local=True, ceiling=True),
        # same host
        Engine("sluice shm cma", "shm", "sluice_peer", {"transport": "shm", "channels": channels}, ops=ALL_OPS),
        Engine("sluice shm memfd", "shm", "sluice_peer", {"transport": "shm", "channels": channels, "memfd": True},
               ops=ALL_OPS),
        Engine("sluice c++ shm cma", "shm", "sluice_native_peer", {"transport": "shm", "channels": channels},
               ops=ALL_OPS, local=True),
        Engine("sluice c++ shm memfd", "shm", "sluice_native_peer",
               {"transport": "shm", "channels": channels, "memfd": True}, ops=ALL_OPS, local=True),
        # NIXL's UCX backend cannot create its agent with sm or cma alone (UCX endpoint
        # create fails in its intra-agent setup); tcp is there for the wire-up only.
        Engine("nixl ucx sm", "shm", "nixl_peer", env={"UCX_TLS": "sm,tcp"}),
        Engine("nixl ucx cma", "shm", "nixl_peer", env={"UCX_TLS": "cma,tcp,self"}),
        Engine("open mpi vader", "shm", "mpi_peer", {"btl": "vader,self"}, ops=ALL_OPS, local=True),
        Engine(f"ceiling: {n}-thread process_vm_readv", "shm", "ceiling_peer", {"mode": "cma", "n": channels},
               ops=ALL_OPS, local=True, ceiling=True),
        Engine(f"ceiling: {n}-thread memcpy", "shm", "ceiling_peer", {"mode": "memcpy", "n": channels},
               ops=ALL_OPS, local=True, ceiling=True),
        # Inside the SoftRoCE guest (run_guest): rxe0, its RoCE v2 GID, the same QP count for all.
        *rdma_engines(qps),
    ]


def rdma_engines(qps: int) -> list[Engine]:
    """The rdma section: one SoftRoCE device (rxe0 on a dummy netdev) in one QEMU guest, loopback
    RC QPs on it; every engine with `qps` queue pairs per connection and its documented RoCE
    settings. RXE_DEV, RXE_IP, RXE_GID_INDEX are the guest's (tests/rdma/rxe-guest.sh); the
    defaults are what that guest sets, for the rows the host writes."""
    dev, ip = os.environ.get("RXE_DEV", "rxe0"), os.environ.get("RXE_IP", "10.0.0.1")
    gid = os.environ.get("RXE_GID_INDEX", "1")
    return [
        # Sluice finds the port and its RoCE v2 GID by itself (docs/rdma.md, Device, port, address).
        Engine("sluice rdma", "rdma", "sluice_peer", {"transport": "rdma", "channels": qps, "host": ip}),
        Engine("mooncake rdma", "rdma", "mooncake_peer", {"protocol": "rdma", "device": dev, "host": ip},
               env={"MC_GID_INDEX": gid, "MC_NUM_QP_PER_EP": str(qps), "GLOG_minloglevel": "1"}),
        # UCX's rc transport alone (rc_verbs on rxe: there is no mlx5), on rxe0 port 1 with its
        # RoCE v2 GID; self for the agent's own loopback.
        Engine("nixl ucx rc", "rdma", "nixl_peer",
               env={"UCX_TLS": "rc,self", "UCX_NET_DEVICES": f"{dev}:1", "UCX_IB_GID_INDEX": gid,
                    "UCX_WARN_UNUSED_ENV_VARS": "n"}),
        Engine("dlslime rdma", "rdma", "dlslime_peer", {"endpoint": "rdma", "device": dev, "qps": qps},
               env={"SLIME_GID_INDEX": gid, "SLIME_QP_NUM": str(qps)}),
        Engine(f"ceiling: perftest ({qps} QP)", "rdma", "perftest_peer",
               {"device": dev, "gid_index": gid, "host": ip, "qps": qps}, local=True, ceiling=True),
    ]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a few sizes, one round: the CI check (no win/lose bar)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--sizes", default=None, help="comma-separated byte sizes, K/M/G suffixes allowed (default 4K..64M)")
    p.add_argument("--ops", default=None, help="comma-separated: read,write,send")
    p.add_argument("--shapes", default="1x1,64x8",
                   help="comma-separated BATCHxCONCURRENCY (default 1x1,64x8; all four: 1x1,1x8,64x1,64x8)")
    p.add_argument("--only", default="", help="comma-separated engine names to run (default all)")
    p.add_argument("--channels", type=int, default=2, help="Sluice channels; ceilings use as many streams/threads")
    p.add_argument("--budget", type=int, default=None, help="bytes per cell (default 64 MiB; --quick 16 MiB)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per engine and round; cells left then are rows saying so (default 180; quick 60)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    g = p.add_argument_group("the rdma section (one SoftRoCE guest, QEMU under TCG: about 1/30 of the host's speed)")
    g.add_argument("--rdma-sizes", default=None, help="comma-separated byte sizes (default 65536,1048576; "
                   "--quick 65536)")
    g.add_argument("--rdma-shapes", default=None, help="BATCHxCONCURRENCY (default 1x1,16x4; --quick 1x1)")
    g.add_argument("--rdma-qps", type=int, default=1, help="queue pairs per connection, every engine (default 1)")
    g.add_argument("--rdma-budget", type=int, default=None, help="bytes per cell (default 8 MiB; --quick 4 MiB)")
    g.add_argument("--guest-budget", type=float, default=None,
                   help="seconds for the whole guest section, boot included (default 540; --quick 120); what "
                        "is left then are rows saying so")
    g.add_argument("--guest-timeout", type=float, default=None,
                   help="seconds per engine and round in the guest (default 150; --quick 70)")
    g.add_argument("--no-guest", action="store_true", help="leave the rdma section out (its rows say so)")
    g.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)  # the driver run in the guest
    return p.parse_args(argv)


def parse_size(text: str) -> int:
    """4096, 4K, 1M, 2G (powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise SystemExit(f"--sizes: {text!r} is not a size (bytes, or with a K/M/G suffix)") from None
    if n <= 0:
        raise SystemExit(f"--sizes: {text!r} is not a positive size")
    return n


def default_cells(o) -> list[Cell]:
    sizes = [parse_size(s) for s in o.sizes.split(",")] if o.sizes else \
        ([4 << 10, 64 << 10] if o.quick else [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20])
    # SEND cells last, whatever --ops says: a target checks and restores a SEND cell's slots
    # after the initiator has moved on, so a READ cell after it read the target mid-restore
    # (`--ops send,read` failed READ checks on every engine with a receiver-side check).
    unknown = set(o.ops.split(",")) - set(ALL_OPS) if o.ops else set()
    if unknown:
        raise SystemExit(f"driver: --ops: unknown {', '.join(sorted(unknown))} (read, write, send)")
    ops = [op for op in ALL_OPS if op in o.ops.split(",")] if o.ops else list(ALL_OPS)
    # The lone operation and the deep batch by default: all four shapes of 14 engines x 3 rounds
    # take about 27 minutes on a loaded 2-core host, over the 20 the issue allows.
    shapes = [tuple(int(x) for x in s.split("x")) for s in o.shapes.split(",")]
    # 64 MiB a cell (one pass over the footprint) keeps 14 engines x 3 rounds within 20 minutes
    # on a 2-core host; every cell still runs >= 4 batches and >= 2 x concurrency.
    budget = o.budget or ((16 << 20) if o.quick else (64 << 20))
    return make_cells(ops, sizes, shapes, budget)


def _reader(stream, out: "queue.Queue"):
    for line in stream:
        out.put(line)
    out.put(None)


def run_engine(e: Engine, cells: list[Cell], timeout: float, log) -> tuple[list[dict], dict]:
    """One round of one engine: returns (RESULT dicts, {cell key: target's check})."""
    mine = [c for c in cells if c.op in e.ops]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(cells_to_json(mine))
    env = dict(os.environ, **e.env)
    base = [sys.executable, os.path.join(HERE, "worker.py"), e.module]
    settings = json.dumps(e.settings)
    results, checks, details, procs, errfiles = [], {}, {}, [], []
    deadline = time.monotonic() + timeout

    def errfile():
        ef = tempfile.TemporaryFile("w+")
        errfiles.append(ef)
        return ef

    def pump(p, q, sink_target=None):
        while True:
            try:
                line = q.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no progress within {timeout:.0f} s")
            if line is None:
                return
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            elif line.startswith("CHECK "):
                d = json.loads(line[6:])
                checks[d["key"]] = d["ok"]
                if d.get("detail"):
                    details[d["key"]] = d["detail"]
            elif line.startswith("PEERINFO ") and sink_target is not None:
                sink_target.stdin.write(line[9:])
                sink_target.stdin.flush()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no end within {timeout:.0f} s")

    error = ""
    try:
        if e.local:
            p = subprocess.Popen(base + ["local", settings, f.name], stdout=subprocess.PIPE, stderr=errfile(),
                                 text=True, env=env, stdin=subprocess.DEVNULL)
            procs.append(p)
            q: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(p.stdout, q), daemon=True).start()
            pump(p, q)
            p.wait(timeout=max(1, deadline - time.monotonic()))
        else:
            t = subprocess.Popen(base + ["target", settings, f.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=errfile(), text=True, env=env)
            procs.append(t)
            tq: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(t.stdout, tq), daemon=True).start()
            info = None
            while info is None:
                line = tq.get(timeout=max(0.05, deadline - time.monotonic()))
                if line is None:
                    raise RuntimeError(f"the target exited ({t.wait()}) before it was ready")
                if line.startswith("READY "):
                    info = line[6:].strip()
            i = subprocess.Popen(base + ["initiator", settings, f.name, info], stdout=subprocess.PIPE, stderr=errfile(),
                                 text=True, env=env, stdin=subprocess.DEVNULL)
            procs.append(i)
            iq: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(i.stdout, iq), daemon=True).start()
            pump(i, iq, sink_target=t)
            i.wait(timeout=max(1, deadline - time.monotonic()))
            t.stdin.close()  # the target exits when its stdin closes
            pump(t, tq)
            t.wait(timeout=max(1, deadline - time.monotonic()))
    except Exception as ex:  # a hang or crash is a row with its reason, never a stuck run
        error = f"{type(ex).__name__}: {ex}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.unlink(f.name)
    reason = ""
    for ef in errfiles:  # into the log; the last error line names why a row has no numbers
        ef.seek(0)
        text = ef.read()
        ef.close()
        log.write(text)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        lines = [ln for ln in lines if not (ln[0] in "IW" and ln[1:5].isdigit())]  # glog info/warnings
        hits = [ln for ln in lines if "rror" in ln or "failed" in ln]
        reason = reason or (hits or lines or [""])[-1][:240]
    log.flush()
    got = {(r["op"], r["size"], r["batch"], r["conc"]) for r in results}
    for c in mine:
        if (c.op, c.size, c.batch, c.conc) not in got:
            rc = procs[-1].returncode if procs else None
            results.append({"op": c.op, "size": c.size, "batch": c.batch, "conc": c.conc, "iters": c.iters,
                            "secs": None, "lat_ms": None, "checked": None,
                            "error": (f"{reason} ({error.split(': ', 1)[-1]})" if error and reason and
                                      "exited" in error else
                                      error or reason or f"no result (the engine's process exited with {rc})")})
    for k, v in details.items():
        checks[k] = (checks[k], v)
    return results, checks


def versions(es: list[Engine], log) -> dict:
    out = {}
    for e in es:
        if e.not_run or e.module in out:
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            f.write("[]")
            f.flush()
            r = subprocess.run([sys.executable, os.path.join(HERE, "worker.py"), e.module, "version", "{}", f.name],
                               capture_output=True, text=True, timeout=120)
        v = [ln[8:] for ln in r.stdout.splitlines() if ln.startswith("VERSION ")]
        out[e.module] = v[0] if v else f"unavailable: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return out


def collect(e: Engine, r: int, results: list[dict], checks: dict, vers: dict) -> list[dict]:
    """One engine's round: the receiver's verdicts folded in, the row's identity added."""
    out = []
    send_failed = ""  # a SEND cell that ended early leaves the receiver out of step
    for d in results:
        key = f"{d['op']}/{d['size']}/{d['batch']}/{d['conc']}"
        initiator_error = d["error"]  # an exception there: fewer messages went out
        if key in checks:  # the receiver's verdict on two-sided cells
            ok, detail = checks[key] if isinstance(checks[key], tuple) else (checks[key], "")
            d["checked"] = ok and d.get("checked") is not False
            if not ok and not d["error"] and send_failed:
                # its receives met the messages of a later cell: not a verdict on the bytes
                d["checked"] = None
                d["error"] = f"not checked: the receiver was out of step after {send_failed} failed"
            elif not ok and not d["error"]:
                d["error"] = "byte check failed at the receiver" + (f": {detail}" if detail else "")
        if d["op"] == "send" and initiator_error and not send_failed:
            send_failed = f"SEND {d['size']} B x {d['batch']} x {d['conc']}"
        d.update(engine=e.name, section=e.section, round=r + 1, ceiling=e.ceiling,
                 version=vers.get(e.module, ""), settings=e.settings, env=e.env)
        out.append(d)
    return out


def progress(r: int, rounds: int, e: Engine, results: list[dict], t0: float) -> None:
    bad = sum(1 for d in results if d["error"])
    print(f"round {r + 1}/{rounds}  {e.name:<34} {len(results):3d} cells  {bad:3d} failed  "
          f"{time.monotonic() - t0:6.1f} s", flush=True)


def missing_row(c: Cell, error: str) -> dict:
    return {"op": c.op, "size": c.size, "batch": c.batch, "conc": c.conc, "iters": c.iters, "secs": None,
            "lat_ms": None, "checked": None, "error": error}


# ---------------------------------------------------------------- the rdma section (SoftRoCE guest)
ROOT = os.path.dirname(os.path.dirname(HERE))
GUEST_FOOTPRINT = 16 << 20  # per side: numpy needs about 3 s per 64 MiB pattern under TCG
# The guest mounts fresh tmpfs over these: what lives there must be shared into it.
GUEST_MASKED = ("/root", "/tmp", "/run", "/var/tmp")


# --quick boots the guest for Sluice and perftest only (about 60 s): each peer's two processes
# start in 10-40 s under emulation (Python, numpy and the peer's libraries), which would double that.
QUICK_GUEST = ("sluice_peer", "perftest_peer")  # modules
QUICK_LEFT_OUT = ("not run: left out of --quick (its processes take 10-40 s to start under the guest's "
                  "emulation); the full run and --only run it")


def rdma_cells(o) -> list[Cell]:
    """Sizes and shapes that fit the emulated speed (about 100 MB/s and 1/30 of the host's CPU):
    64 KiB and 1 MiB; a lone operation and 16 x 4 (the 64 x 8 of the host sections moves 512 MiB
    per window, over 5 s per batch window here, and 1 MiB x 64 does not fit the 16 MiB footprint)."""
    sizes = [int(x) for x in o.rdma_sizes.split(",")] if o.rdma_sizes else \
        ([64 << 10] if o.quick else [64 << 10, 1 << 20])
    shapes = [tuple(int(x) for x in s.split("x")) for s in (o.rdma_shapes or ("1x1" if o.quick else "1x1,16x4"))
              .split(",")]
    ops = [op for op in ("read", "write") if not o.ops or op in o.ops.split(",")]
    budget = o.rdma_budget or ((4 << 20) if o.quick else (8 << 20))
    return make_cells(ops, sizes, shapes, budget, footprint=GUEST_FOOTPRINT)


def rdma_settings(o) -> dict:
    return {"qps": o.rdma_qps, "footprint": GUEST_FOOTPRINT, "budget": o.rdma_budget or
            ((4 << 20) if o.quick else (8 << 20)),
            "guest_budget_s": o.guest_budget or (120.0 if o.quick else 540.0),
            "engine_timeout_s": o.guest_timeout or (70.0 if o.quick else 150.0)}


def guest_main(o) -> int:
    """Inside the guest: the rdma engines, interleaved round by round, every engine-round's rows
    appended to OUT/samples.jsonl at once (a guest killed at its budget keeps what was done)."""
    t0 = time.monotonic()
    st = rdma_settings(o)
    deadline = t0 + st["guest_budget_s"]
    rounds = o.rounds or (1 if o.quick else 3)
    es = rdma_engines(o.rdma_qps)
    if o.only:
        keep = {x.strip() for x in o.only.split(",")}
        es = [e for e in es if e.name in keep]
    cells = rdma_cells(o)
    # An engine whose every cell failed in round 1, none by a timeout (it cannot run here: NIXL's
    # UCX finds no rc device), is not started again: 25 s a round under emulation.
    cannot: dict = {}
    os.makedirs(o.out, exist_ok=True)
    print(f"guest: {platform.release()}, {os.environ.get('RXE_DEV')} {os.environ.get('RXE_IP')} GID index "
          f"{os.environ.get('RXE_GID_INDEX')}, {os.cpu_count()} vCPUs, {len(cells)} cells per engine", flush=True)
    with open(os.path.join(o.out, "engines.log"), "a") as log, \
            open(os.path.join(o.out, "samples.jsonl"), "a") as sink:
        for r in range(rounds):
            for e in es:
                t1 = time.monotonic()
                left = deadline - t1
                log.write(f"\n===== guest round {r + 1} {e.name} ({left:.0f} s of the guest budget left)\n")
                log.flush()
                mine = [c for c in cells if c.op in e.ops]
                if e.name in cannot:  # every cell of an earlier round failed at once: no new attempt
                    results, checks = [missing_row(c, f"{cannot[e.name]} (in round 1; not tried again)")
                                       for c in mine], {}
                elif left < 20:
                    spent = f"TimeoutError: not run: the guest section's {st['guest_budget_s']:.0f} s budget was spent"
                    results, checks = [missing_row(c, spent) for c in mine], {}
                else:
                    results, checks = run_engine(e, mine, min(st["engine_timeout_s"], left - 10), log)
                if r == 0 and results and all(d["error"] and not d["error"].startswith("TimeoutError")
                                              for d in results):
                    cannot[e.name] = results[0]["error"][:300]
                for d in collect(e, r, results, checks, {}):
                    sink.write(json.dumps(d) + "\n")
                sink.flush()
                progress(r, rounds, e, results, t1)
    return 0


def guest_shares(gdir: str) -> list[str]:
    """Folders the guest must see read-write or at all: the results folder, and the checkout and
    the Python installation where the guest's tmpfs would hide them (a CI clone in /tmp, pyenv
    under /root)."""
    want = [gdir]
    for d in (ROOT, sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        d = os.path.realpath(d)
        if any(d == m or d.startswith(m + "/") for m in GUEST_MASKED):
            want.append(os.path.dirname(d) if d.endswith("/bin") else d)
    out = []
    for d in sorted(set(want), key=len):  # parents first; a folder inside a shared one needs no share
        if not any(d == x or d.startswith(x + "/") for x in out) or d == gdir:
            out.append(d)
    return out


def run_guest(o, es: list[Engine], rounds: int, log) -> list[dict]:
    """Boots one SoftRoCE guest (tests/rdma/rxe-guest.sh) and runs this driver in it on the rdma
    engines. Rows the guest did not write say why: it did not start, or its budget ran out."""
    st = rdma_settings(o)
    budget = st["guest_budget_s"]
    cells = rdma_cells(o)
    script = os.path.join(ROOT, "tests", "rdma", "rxe-guest.sh")
    gdir = os.path.join(os.path.realpath(o.out), "guest")
    import shutil

    shutil.rmtree(gdir, ignore_errors=True)
    os.makedirs(gdir)
    inner = [sys.executable, os.path.join(HERE, "driver.py"), "--in-guest", "--out", gdir, "--rounds", str(rounds),
             "--only", ",".join(e.name for e in es), "--rdma-qps", str(o.rdma_qps),
             "--rdma-sizes", ",".join(sorted({str(c.size) for c in cells}, key=int)) or "65536",
             "--rdma-shapes", o.rdma_shapes or ("1x1" if o.quick else "1x1,16x4"),
             "--rdma-budget", str(st["budget"]), "--guest-budget", str(budget - 20),
             "--guest-timeout", str(st["engine_timeout_s"])]
    if o.ops:
        inner += ["--ops", o.ops]
    cmd = [script, "-q", "-t", str(int(budget)), "-C", HERE]
    for d in guest_shares(gdir):
        cmd += ["-s", d]
    cmd += ["-e", f"PEERS_FOOTPRINT={GUEST_FOOTPRINT}", "-e", "SLUICE_LOG_LEVEL=error", "--"] + inner
    log.write("\n===== the SoftRoCE guest: " + " ".join(cmd) + "\n")
    log.flush()
    print(f"guest: booting one SoftRoCE guest for {', '.join(e.name for e in es)} (budget {budget:.0f} s)",
          flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        why = ""
        try:
            if not os.path.exists(script):
                raise FileNotFoundError(f"{script} is missing")
            rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=err, timeout=budget + 60).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        except OSError as ex:
            rc, why = 125, f"{type(ex).__name__}: {ex}"
        err.seek(0)
        text = err.read()
    log.write(text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = why or next((ln for ln in reversed(lines) if "rxe-guest.sh" in ln), "") or (lines or [f"exit {rc}"])[-1]
    samples = []
    path = os.path.join(gdir, "samples.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            samples = [json.loads(ln) for ln in f if ln.strip()]
    gl = os.path.join(gdir, "engines.log")
    if os.path.exists(gl):
        with open(gl) as f:
            log.write(f.read())
    log.flush()
    wall = time.monotonic() - t0
    print(f"guest: {len(samples)} rows, exit {rc}, {wall:.1f} s", flush=True)
    if not samples and rc != 124:
        for e in es:
            e.not_run = f"not run: the SoftRoCE guest did not start or its driver failed (exit {rc}): {why[:200]}"
        return []
    have = {(d["engine"], d["round"], d["op"], d["size"], d["batch"], d["conc"]) for d in samples}
    for r in range(rounds):
        for e in es:
            for c in cells:
                if c.op in e.ops and (e.name, r + 1, c.op, c.size, c.batch, c.conc) not in have:
                    d = missing_row(c, f"TimeoutError: the guest ran past its {budget:.0f} s budget and was killed"
                                    if rc == 124 else f"no result: the guest's driver exited with {rc}: {why[:200]}")
                    samples.extend(collect(e, r, [d], {}, {}))
    return samples


def main(argv=None) -> int:
    o = parse_args(sys.argv[1:] if argv is None else argv)
    if o.in_guest:
        return guest_main(o)
    rounds = o.rounds or (1 if o.quick else 3)
    timeout = o.timeout or (60.0 if o.quick else 180.0)
    cells = default_cells(o)
    es = engines(o.channels, o.rdma_qps)
    if o.only:
        keep = {s.strip() for s in o.only.split(",")}
        es = [e for e in es if e.name in keep]
    for e in es:
        if e.section != "rdma":
            continue
        if o.no_guest:
            e.not_run = "not run: --no-guest"
        elif os.environ.get("SLUICE_SKIP_RDMA") == "1":  # as scripts/test.sh skips its RDMA suite
            e.not_run = "not run: SLUICE_SKIP_RDMA=1"
        elif o.quick and e.module not in QUICK_GUEST and e.name not in {x.strip() for x in o.only.split(",")}:
            e.not_run = QUICK_LEFT_OUT
    os.makedirs(o.out, exist_ok=True)
    log_path = os.path.join(o.out, "engines.log")
    samples = []
    t_start = time.time()
    guest_wall = None
    with open(log_path, "w") as log:
        vers = versions(es, log)
        for r in range(rounds):
            for e in es:
                if e.not_run or e.section == "rdma":
                    continue
                t0 = time.monotonic()
                log.write(f"\n===== round {r + 1} {e.name}\n")
                log.flush()
                results, checks = run_engine(e, cells, timeout, log)
                samples += collect(e, r, results, checks, vers)
                progress(r, rounds, e, results, t0)
        guest = [e for e in es if e.section == "rdma" and not e.not_run]
        if guest:
            t0 = time.monotonic()
            for d in run_guest(o, guest, rounds, log):
                d["version"] = vers.get(next(e.module for e in guest if e.name == d["engine"]), "")
                samples.append(d)
            guest_wall = round(time.monotonic() - t0, 1)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "host": platform.node(),
            "cpus": os.cpu_count(), "load_before": os.getloadavg(), "rounds": rounds, "quick": o.quick,
            "footprint": FOOTPRINT, "hugepages": HUGEPAGES, "channels": o.channels, "wall_s": round(time.time() - t_start, 1),
            "not_run": {e.name: e.not_run for e in es if e.not_run}, "versions": vers,
            "engines": [{"name": e.name, "section": e.section, "ceiling": e.ceiling, "ops": list(e.ops)} for e in es]}
    if any(e.section == "rdma" for e in es):
        meta["rdma"] = dict(rdma_settings(o), wall_s=guest_wall)
    with open(os.path.join(o.out, "samples.json"), "w") as f:
        json.dump({"meta": meta, "samples": samples}, f, indent=1)
    import report

    report.write_all(o.out, meta, samples)
    failed = [d for d in samples if d["error"] and not d["error"].startswith("NotImplementedError")]
    print(f"peers: {len(samples)} samples, {len(failed)} failed, {meta['wall_s']} s; results in {o.out}")
    return exit_status(samples)


def exit_status(samples: list[dict]) -> int:
    """Non-zero when Sluice failed a cell or moved wrong bytes. A peer that cannot run here, or
    moves wrong bytes (DLSlime tcp does at 4 KiB x 64 x 8), is a row with its reason and a ✗ in
    the table, not a failure of this suite; --quick applies no win/lose bar."""
    bad = [d for d in samples if d["engine"].startswith("sluice") and (d["error"] or d["checked"] is False)]
    for d in samples:  # said, not failed
        if not d["engine"].startswith("sluice") and d["checked"] is False:
            print(f"note: {d['engine']} moved wrong bytes: {d['op']} size {d['size']} batch {d['batch']} "
                  f"conc {d['conc']}", file=sys.stderr)
    for d in bad[:20]:
        print(f"FAILED: {d['engine']} {d['op']} size {d['size']} batch {d['batch']} conc {d['conc']}: "
              f"{d['error'] or 'byte check failed'}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
