"""Time sluice.weights.staging against a direct pull, in one run: a trainer process publishes a
synthetic model; each round, either a consumer process pulls all of it into its parameters
itself (``direct``), or a sidecar process (``StagingServer``) pulls it into a staging buffer on
the same device while a torch-only consumer process (``StagingClient``) copies it out into its
parameters (``staging``). Rounds of the two paths alternate; prints median, min and max per
path, GB/s, the ratio staging/direct and the one-copy ceiling measured in the same run.

    python tools/sluice-weights-bench/staging_bench.py [--device cpu|cuda] [--size-mib 256]
        [--tensors 1000] [--rounds 5] [--warmup 1] [--capacity-mib N] [--bucket-mib 64] [--depth 2]
        [--trainer-memory shared|pinned|cpu] [--transport tcp] [--check] [--json out.json] [--verbose]

``direct``: ``WeightSubscriber.update(params, force=True)`` in a consumer process with its own
sluice engine, into its parameter tensors (on cuda:0 with ``--device cuda``). ``staging``: a
sidecar process with its own engine runs ``StagingServer.update(force=True)`` (buffer on the
same device; ``--capacity-mib``: its size, split in two slots; default: the server's own
sizing) and a consumer process without an engine runs ``StagingClient.receive(params)``; the
round ends when both returned. Every round is timed here, from telling the process(es) to go
until all of them answered; ``--warmup`` rounds per path (first registrations, page faults)
come first and are not counted. ``--trainer-memory`` is bench.py's (default here ``shared``:
``WeightPublisher.share()``, the fast path into a GPU).

The ceiling, measured after the rounds (medians of at least 5 copies): ``--device cpu``, a
memcpy of the same bytes; ``--device cuda``, one pinned host-to-device copy of them into
cuda:0 (and, for reference, one device-to-device copy within cuda:0: what the staging path
adds). ``--check``: before the last round of each path the consumer's parameters (and the
staging buffer) are overwritten with 0xA5; after it every tensor's crc32 is compared with the
trainer's; exit 1 on a mismatch. The model, the trainer and the ceilings are bench.py's
(imported from this folder).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as wb  # noqa: E402  (this folder's bench.py: synthetic_spec, fill, crc, trainer, ceilings)

# torch and sluice are imported inside the functions: main() starts the forkserver (which
# preloads them) first, as bench.py does.

PATHS = ("direct", "staging")
POISON = 0xA5  # what --check writes over the parameters and the staging buffer before the last round


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- the processes

def _proc(conn, role: str, *args) -> None:
    """Every child but the trainer: run ``role``; on an exception, send ("error", traceback)
    and exit 1 (the parent prints it)."""
    import torch

    torch.set_num_threads(1)  # as in bench.py: the engine moves the bytes
    try:
        _ROLES[role](conn, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)


def _params(spec, device: str) -> Dict[str, Any]:
    import torch

    return {n: torch.zeros(s, dtype=d, device=device) for n, d, s in spec}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _poison(tensors, device: str) -> None:
    for t in tensors:
        wb.as_bytes(t).fill_(POISON)
    _sync(device)


def _consumer_commands(conn, params, device: str, go) -> None:
    """The command loop the consumers share: ("go",) runs ``go()`` (-> seconds, nbytes, bins),
    ("poison",), ("check",) (-> crc32 per tensor), ("stop",)."""
    while True:
        cmd = conn.recv()
        if cmd[0] == "go":
            conn.send(("done",) + go())
        elif cmd[0] == "poison":
            _poison(params.values(), device)
            conn.send(("ok",))
        elif cmd[0] == "check":
            conn.send(("crcs", {n: wb.crc(t) for n, t in params.items()}))
        else:
            return


def direct_consumer(conn, ref: str, spec, transports, bucket_bytes: int, depth: int, device: str,
                    timeout: float) -> None:
    """Path ``direct``: its own engine and WeightSubscriber, straight into its parameters."""
    import sluice
    from sluice.weights import WeightSubscriber

    with sluice.Engine(transports=transports) as engine:
        params = _params(spec, device)
        sub = WeightSubscriber(engine, ref, bucket_bytes=bucket_bytes, depth=depth, timeout=timeout)
        sub.published()  # connect and read the metadata before timing
        conn.send(("ready", getattr(getattr(sub, "_ep", None), "transport", "?")))

        def go():
            t0 = time.perf_counter()
            res = sub.update(params, force=True, timeout=timeout)
            _sync(device)
            return time.perf_counter() - t0, res.nbytes, res.buckets

        try:
            _consumer_commands(conn, params, device, go)
        finally:
            sub.close()


def staging_server(conn, ref: str, transports, bucket_bytes: int, depth: int, device: str,
                   capacity: Optional[int], timeout: float) -> None:
    """Path ``staging``, the sidecar: its own engine and a StagingServer on ``device``."""
    import sluice
    from sluice.weights.staging import StagingServer

    with sluice.Engine(transports=transports) as engine:
        server = StagingServer(engine=engine, trainer_ref=ref, device=device, capacity=capacity, timeout=timeout,
                               bucket_bytes=bucket_bytes, depth=depth)
        try:
            conn.send(("address", server.address))
            server.subscriber.published(timeout=timeout)  # connect to the trainer (accept() may not need to)
            server.accept(timeout=timeout)  # the client connects meanwhile; allocates the buffer if needed
            transport = getattr(getattr(server.subscriber, "_ep", None), "transport", "?")
            conn.send(("accepted", server.capacity, server.slots, server.slot_bytes, transport))
            while True:
                cmd = conn.recv()
                if cmd[0] == "go":
                    t0 = time.perf_counter()
                    res = server.update(force=True, timeout=timeout)
                    conn.send(("done", time.perf_counter() - t0, res.nbytes, res.bins))
                elif cmd[0] == "poison":
                    _poison([server.buffer], device)
                    conn.send(("ok",))
                else:
                    return
        finally:
            server.close()


def staging_client(conn, address: str, spec, device: str, timeout: float) -> None:
    """Path ``staging``, the inference side: torch and a StagingClient, no engine."""
    from sluice.weights.staging import StagingClient

    params = _params(spec, device)
    client = StagingClient(address, timeout=timeout)
    try:
        client.connect(timeout=timeout)  # maps the buffer (the server accepts meanwhile)
        conn.send(("ready", client.slot_bytes))

        def go():
            t0 = time.perf_counter()
            res = client.receive(params, timeout=timeout)  # synchronizes the device before each ack
            return time.perf_counter() - t0, res.nbytes, res.bins

        _consumer_commands(conn, params, device, go)
    finally:
        client.close()


_ROLES = {"direct": direct_consumer, "server": staging_server, "client": staging_client}


# ---------------------------------------------------------------- the parent's side

class Kids:
    """The child processes and their pipes; every wait bounded, a dead child noticed at once."""

    def __init__(self, ctx, timeout: float):
        self.ctx, self.timeout = ctx, timeout
        self.procs: Dict[str, Any] = {}
        self.conns: Dict[str, Any] = {}

    def start(self, name: str, target, *args) -> None:
        conn, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child,) + args, name=f"staging-bench-{name}", daemon=True)
        p.start()
        child.close()
        self.procs[name], self.conns[name] = p, conn

    def send(self, name: str, msg) -> None:
        try:
            self.conns[name].send(msg)
        except OSError as e:
            raise BenchError(f"the {name} process is gone ({e}; exit code {self.procs[name].exitcode})") from None

    def recv(self, names, what: str, timeout: Optional[float] = None) -> Dict[str, tuple]:
        """One message from each of ``names``, in any order, within ``timeout``; raises on an
        error message, on a child that exited, or at the timeout."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        want = {self.conns[n]: n for n in names}
        got: Dict[str, tuple] = {}
        while want:
            for c in mpc.wait(list(want), timeout=0.2):
                n = want.pop(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    raise BenchError(f"the {n} process died {what} (exit code {self._exitcode(n)})") from None
                if msg[0] == "error":
                    raise BenchError(f"the {n} process failed {what}:\n{msg[1]}")
                got[n] = msg
            for n, p in self.procs.items():
                if p.exitcode is not None and not (n in want.values() and self.conns[n].poll(0)):
                    raise BenchError(f"the {n} process exited (code {p.exitcode}) {what}")
            if want and time.monotonic() > deadline:
                raise BenchError(f"timed out ({self.timeout:g} s) {what}: no answer from {', '.join(want.values())}")
        return got

    def _exitcode(self, name: str):
        self.procs[name].join(2)
        return self.procs[name].exitcode

    def stop(self, order, grace: float = 20.0) -> None:
        """Ask each to stop (in ``order``), then join them all within ``grace`` s; kill the rest."""
        for n in order:
            if n in self.conns:
                try:
                    self.conns[n].send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for n in order:
            p = self.procs.get(n)
            if p is None:
                continue
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                print(f"sluice-staging-bench: killing the {n} process (did not stop)", file=sys.stderr)
                p.kill()
                p.join(5)


def d2d_ceiling(total_bytes: int, rounds: int) -> float:
    """Median seconds of one device-to-device copy of ``total_bytes`` within cuda:0 (what the
    staging consumer adds: staging buffer to parameter)."""
    import torch

    a = torch.ones(total_bytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summary(times: List[float], gb: float) -> Dict[str, float]:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "gbps": gb / med}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the parameters and the staging buffer are (cuda: cuda:0)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per path (interleaved)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per path first")
    ap.add_argument("--capacity-mib", type=float, default=None,
                    help="the staging buffer's size (two slots); default: the server's own sizing")
    ap.add_argument("--bucket-mib", type=float, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--transport", default=None, help="force a transport (tcp, shm); default: the engine's choice")
    ap.add_argument("--trainer-memory", choices=["shared", "pinned", "cpu"], default="shared",
                    help="the trainer's tensors: WeightPublisher.share() copies (default), pinned or plain CPU "
                         "tensors registered (see bench.py)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds any one wait may take")
    ap.add_argument("--check", action="store_true",
                    help="verify every byte after the last round of each path; exit 1 if wrong")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--verbose", action="store_true", help="print when each phase ends (stderr)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    def phase(what: str) -> None:
        if a.verbose:
            print(f"[{time.perf_counter() - t_start:7.2f} s] {what}", file=sys.stderr, flush=True)

    if min(a.size_mib, a.tensors, a.rounds, a.depth) <= 0 or a.bucket_mib <= 0 or a.warmup < 0 or a.timeout <= 0:
        ap.error("sizes, counts and the timeout must be > 0 (--warmup >= 0)")
    if a.capacity_mib is not None and a.capacity_mib <= 0:
        ap.error("--capacity-mib must be > 0")

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sluice", "sluice.weights", "sluice.weights.staging"])
    from multiprocessing import forkserver

    forkserver.ensure_running()  # starts importing torch there while we import it here
    import torch

    phase("torch imported")
    if (a.device == "cuda" or a.trainer_memory == "pinned") and not torch.cuda.is_available():
        ap.error("--device cuda / --trainer-memory pinned need a CUDA device, and torch sees none")
    device = "cuda:0" if a.device == "cuda" else "cpu"
    spec = wb.synthetic_spec(a.size_mib << 20, a.tensors)
    total = sum(torch.empty(0, dtype=d).element_size() * s[0] for _, d, s in spec)
    bucket = int(a.bucket_mib * (1 << 20))
    capacity = None if a.capacity_mib is None else int(a.capacity_mib * (1 << 20))
    n_rounds = a.warmup + a.rounds
    times: Dict[str, List[float]] = {p: [] for p in PATHS}  # timed rounds, seen from here
    warm: Dict[str, List[float]] = {p: [] for p in PATHS}
    inside: Dict[str, List[float]] = {"direct": [], "server": [], "client": []}  # each process's own timing
    bins: List[int] = []
    bad: List[str] = []
    used: Dict[str, str] = {}
    staging_info: Dict[str, Any] = {}
    kids = Kids(ctx, a.timeout + 10)  # the children's own timeouts (a.timeout) fire first: their errors say more
    try:
        kids.start("trainer", wb.trainer, spec, a.transport, a.trainer_memory)
        ref, want = kids.recv(["trainer"], "publishing the model")["trainer"]
        phase("trainer published")
        kids.start("direct", _proc, "direct", ref, spec, a.transport, bucket, a.depth, device, a.timeout)
        kids.start("server", _proc, "server", ref, a.transport, bucket, a.depth, device, capacity, a.timeout)
        address = kids.recv(["server"], "starting the staging server")["server"][1]
        kids.start("client", _proc, "client", address, spec, device, a.timeout)
        got = kids.recv(["direct", "server", "client"], "getting ready")
        used = {"direct": got["direct"][1], "staging": got["server"][4]}
        staging_info = {"capacity": got["server"][1], "slots": got["server"][2], "slot_bytes": got["server"][3],
                        "default_sizing": capacity is None}
        phase(f"consumers ready (staging: {staging_info['slots']} slot(s) of {staging_info['slot_bytes']} bytes; pids "
              + ", ".join(f"{n} {p.pid}" for n, p in kids.procs.items()) + ")")

        members = {"direct": ["direct"], "staging": ["server", "client"]}
        for r in range(n_rounds):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):  # alternate which path goes first
                last = r == n_rounds - 1
                if a.check and last:  # the last round must write every byte itself
                    for m in members[path]:
                        kids.send(m, ("poison",))
                    kids.recv(members[path], f"overwriting the {path} path's bytes")
                t0 = time.perf_counter()
                for m in members[path]:
                    kids.send(m, ("go",))
                got = kids.recv(members[path], f"in {path} round {r + 1}")
                sec = time.perf_counter() - t0
                for m, msg in got.items():
                    if msg[2] != total:
                        raise BenchError(f"the {m} process moved {msg[2]} bytes in {path} round {r + 1}, "
                                         f"expected {total}")
                if r < a.warmup:
                    warm[path].append(sec)
                else:
                    times[path].append(sec)
                    for m, msg in got.items():
                        inside[m].append(msg[1])
                    if path == "staging":
                        bins.append(got["server"][3])
                phase(f"{'warmup ' if r < a.warmup else ''}round {r + 1} {path}: {sec:.4f} s")
        if a.check:
            for path, m in (("direct", "direct"), ("staging", "client")):
                kids.send(m, ("check",))
                crcs = kids.recv([m], f"checking the {path} path's bytes")[m][1]
                bad += [f"{path}: {n}" for n in want if crcs.get(n) != want[n]]
            phase("bytes checked")
    except BenchError as e:
        print(f"sluice-staging-bench: {e}", file=sys.stderr)
        return 1
    finally:
        kids.stop(["direct", "client", "server", "trainer"])
        phase("processes joined")

    gb = total / 1e9
    n_copies = max(a.rounds, 5)  # medians of at least 5 copies: one copy is short and noisy on a busy host
    ceilings = {"memcpy (one copy)": wb.memcpy_ceiling(total, n_copies)}
    if a.device == "cuda":
        ceilings.update(wb.cuda_ceilings(total, n_copies, False))  # "pinned H2D copy (one GPU)"
        ceilings["D2D copy within cuda:0"] = d2d_ceiling(total, n_copies)
        ceiling = "pinned H2D copy (one GPU)"
    else:
        ceiling = "memcpy (one copy)"
    phase("ceilings measured")
    res = {p: summary(times[p], gb) for p in PATHS}
    for p in PATHS:
        res[p]["rounds_s"] = times[p]
        res[p]["warmup_s"] = warm[p]
        res[p]["of_ceiling"] = ceilings[ceiling] / res[p]["median_s"]
        res[p]["transport"] = used.get(p, "?")
    res["direct"]["consumer_s"] = inside["direct"]
    res["staging"].update(server_s=inside["server"], client_s=inside["client"], bins=bins, **staging_info)
    ratio = res["staging"]["median_s"] / res["direct"]["median_s"]

    cap = (f"{staging_info['slots']} slot(s) of {staging_info['slot_bytes'] / (1 << 20):.1f} MiB"
           f"{' (default sizing)' if capacity is None else ''}")
    print(f"sluice-staging-bench: {len(spec)} tensors, {total / (1 << 20):.1f} MiB, device {device}, trainer "
          f"{a.trainer_memory}, bucket {a.bucket_mib:g} MiB x{a.depth}, transport {a.transport or 'auto'} (used: "
          f"direct {used.get('direct')}, staging {used.get('staging')}), staging {cap}, {max(bins, default=0)} bins, "
          f"{a.rounds} rounds per path interleaved (+{a.warmup} warmup)")
    print(f"{'what':<40}{'median s':>10}{'min s':>10}{'max s':>10}{'GB/s':>9}{'/ceiling':>10}")
    for what, sec in ceilings.items():
        print(f"{what + ' ceiling':<40}{sec:>10.4f}{'':>10}{'':>10}{gb / sec:>9.2f}"
              f"{'(this)' if what == ceiling else '':>10}")
    rows = {"direct": "direct: update() into params", "staging": "staging: server update() + receive()"}
    for p in PATHS:
        s = res[p]
        print(f"{rows[p]:<40}{s['median_s']:>10.4f}{s['min_s']:>10.4f}{s['max_s']:>10.4f}{s['gbps']:>9.2f}"
              f"{s['of_ceiling']:>10.2f}")
    print(f"{'  staging: server update() alone':<40}{statistics.median(inside['server']):>10.4f}")
    print(f"{'  staging: client receive() alone':<40}{statistics.median(inside['client']):>10.4f}")
    print(f"staging / direct (median time): {ratio:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tensors": len(spec), "bytes": total, "device": device, "trainer_memory": a.trainer_memory,
                       "rounds": a.rounds, "warmup": a.warmup, "bucket_bytes": bucket, "depth": a.depth,
                       "transport": a.transport, "direct": res["direct"], "staging": res["staging"],
                       "ratio_staging_over_direct": ratio, "ceilings_s": ceilings, "ceiling": ceiling,
                       "check": (not bad) if a.check else None}, f, indent=1)
    if a.check:
        if bad:
            print(f"sluice-staging-bench: WRONG BYTES in {len(bad)} tensors: {bad[:5]}", file=sys.stderr)
            return 1
        print(f"check: every byte of {len(spec)} tensors right on both paths (direct, staging)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
