"""python -m sluice.bench: the sluice-bench transfer benchmark, driven from Python.

Same flags and same table as the C++ tool (tools/sluice-bench), so the two can be compared
directly; ``--engine mooncake|nixl`` runs the same work through mooncake-transfer-engine or
NIXL (from PyPI) when they are installed and can run here.

  python -m sluice.bench [options]                       loopback (starts its own target process)
  python -m sluice.bench --role target [--listen H:P]    on host A (prints its address)
  python -m sluice.bench --role initiator --connect H:P  on host B
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

MAX_REGION = 256 << 20
REGION_NAME = "bench"


# ---------------------------------------------------------------- options


def parse_size(s: str) -> int:
    i = 0
    while i < len(s) and s[i].isdigit():
        i += 1
    if i == 0:
        raise argparse.ArgumentTypeError(f"bad size '{s}'")
    v, suf = int(s[:i]), s[i:]
    mult = {"": 1, "B": 1, "K": 1 << 10, "k": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "m": 1 << 20,
            "MiB": 1 << 20, "G": 1 << 30, "g": 1 << 30, "GiB": 1 << 30}
    if suf not in mult:
        raise argparse.ArgumentTypeError(f"bad size '{s}'")
    return v * mult[suf]


def size_text(b: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= (1 << shift) and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return f"{b}B"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sluice.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="sluice", choices=["sluice", "mooncake", "nixl"],
                   help="which engine moves the bytes (default sluice)")
    p.add_argument("--role", default="loopback", choices=["loopback", "target", "initiator", "loopback-target"],
                   help=argparse.SUPPRESS)
    p.add_argument("--transport", default="", help="force a transport (default: the fastest both sides have)")
    p.add_argument("--op", default="write", choices=["read", "write", "write_imm", "send"])
    p.add_argument("--min-size", type=parse_size, default=8)
    p.add_argument("--max-size", type=parse_size, default=64 << 20)
    p.add_argument("--size", type=parse_size, default=None, help="a single size (min = max)")
    p.add_argument("--batch-size", type=int, default=64, help="assignments per batch (default 64)")
    p.add_argument("--concurrency", type=int, default=8, help="outstanding batches (default 8)")
    p.add_argument("--iterations", type=int, default=0, help="batches per size (default: scaled to the size)")
    p.add_argument("--channels", type=int, default=2, help="channels per endpoint (default 2)")
    p.add_argument("--memfd", action="store_true", help="engine-allocated shareable memory on both sides")
    p.add_argument("--check", action="store_true", help="verify every byte after each size")
    p.add_argument("--json", action="store_true")
    p.add_argument("--csv", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--connect", default="", help="initiator: the target's host:port")
    p.add_argument("--listen", default="127.0.0.1:0", help="target: listener host:port")
    return p


def parse(argv) -> argparse.Namespace:
    p = build_parser()
    o = p.parse_args(argv)
    if o.size is not None:
        o.min_size = o.max_size = o.size
    if o.role == "initiator" and not o.connect:
        p.error("--role initiator needs --connect")
    if o.min_size == 0 or o.max_size < o.min_size:
        p.error("bad size range")
    if o.batch_size < 1 or o.concurrency < 1 or o.channels < 1:
        p.error("batch, concurrency, channels must be >= 1")
    return o


def region_length(o) -> int:
    return max(o.max_size, min(o.max_size * o.batch_size, MAX_REGION))


def pattern(n: int, seed: int = 0) -> np.ndarray:
    x = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(2654435761)
    return (x >> np.uint64(13)).astype(np.uint8)


def iterations_for(o, size: int) -> int:
    if o.iterations > 0:
        return o.iterations
    return int(min(max((512 << 20) // (size * o.batch_size), 16), 4000))


def offsets(o, size: int, region: int, count: int) -> np.ndarray:
    """(count, batch) offsets: unit i covers slots (i*batch + j) % slots, like make_batch()."""
    slots = max(1, region // size)
    cursor = np.arange(count, dtype=np.uint64)[:, None] * np.uint64(o.batch_size) + np.arange(
        o.batch_size, dtype=np.uint64)[None, :]
    return (cursor % np.uint64(slots)) * np.uint64(size)


class Row:
    def __init__(self, transport, channels, size, o, latency_ms, mbps, errors=0):
        self.transport, self.channels, self.size = transport, channels, size
        self.batch, self.concurrency = o.batch_size, o.concurrency
        self.latency_ms, self.mbps, self.errors, self.checked = latency_ms, mbps, errors, False


def print_header(o) -> None:
    if o.json:
        return
    if o.csv:
        print("transport,channels,message_size,batch_size,concurrency,avg_latency_ms,bandwidth_mbps")
        return
    print(f"{'Transport':<9} {'#Channels':>9} {'Message Size':>13} {'Batch Size':>10} {'Concurrency':>11} "
          f"{'Avg Latency (ms)':>16} {'Bandwidth (MB/s)':>17}")


def print_row(o, r: Row) -> None:
    if o.json:
        return
    if o.csv:
        print(f"{r.transport},{r.channels},{r.size},{r.batch},{r.concurrency},{r.latency_ms:.6f},{r.mbps:.1f}")
    else:
        line = (f"{r.transport:<9} {r.channels:>9d} {size_text(r.size):>13} {r.batch:>10d} {r.concurrency:>11d} "
                f"{r.latency_ms:>16.4f} {r.mbps:>17.1f}")
        if r.errors:
            line += f"   {r.errors} ERRORS"
        if o.check:
            line += "   check ok" if r.checked else "   CHECK FAILED"
        print(line)
    sys.stdout.flush()


def print_json(o, rows) -> None:
    out = []
    for r in rows:
        d = {"transport": r.transport, "op": o.op, "channels": r.channels, "message_size": r.size,
             "batch_size": r.batch, "concurrency": r.concurrency, "avg_latency_ms": round(r.latency_ms, 6),
             "bandwidth_mbps": round(r.mbps, 1), "errors": r.errors, "engine": o.engine}
        if o.check:
            d["checked"] = r.checked
        out.append(d)
    print(json.dumps(out, indent=2))


def progress(o, text: str) -> None:
    if not o.quiet:
        sys.stderr.write(text)
        sys.stderr.flush()


def run_sizes(o, measure, verify, transport, channels) -> int:
    sizes = []
    s = o.min_size
    while s <= o.max_size:
        sizes.append(s)
        s *= 2
    progress(o, f"sluice.bench[{o.engine}]: {o.op} over {transport}, {channels} channel(s), batch "
                f"{o.batch_size}, concurrency {o.concurrency}, {len(sizes)} sizes\n")
    print_header(o)
    rows, failed = [], False
    for i, size in enumerate(sizes):
        progress(o, f"[{i + 1}/{len(sizes)}] {size_text(size)} ...\r")
        r = measure(size)
        if o.check:
            r.checked = verify(size)
        failed |= r.errors > 0 or (o.check and not r.checked)
        print_row(o, r)
        rows.append(r)
    progress(o, "done." + " " * 30 + "\n")
    if o.json:
        print_json(o, rows)
    return 2 if failed else 0


def spawn_target(o, argv, marker: str):
    """Start this module as the loopback target; returns (process, the text after marker)."""
    args = [sys.executable, "-m", "sluice.bench"] + list(argv) + ["--role", "loopback-target"]
    child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.startswith(marker + " "):
            return child, line[len(marker) + 1:].strip()
    child.wait()
    raise SystemExit(f"sluice.bench: the target process did not start (exit {child.returncode})")


def wait_stdin_eof(stop: threading.Event) -> None:
    try:
        while sys.stdin.read(1):
            pass
    finally:
        stop.set()


# ---------------------------------------------------------------- sluice


def _sluice_engine(o, listen: bool):
    import sluice

    kw = dict(channels=o.channels, transports=[o.transport] if o.transport else None)
    if listen:
        kw["listen"] = o.listen
    return sluice.Engine(**kw)


class _Buf:
    def __init__(self, engine, length, memfd, name=""):
        if memfd:
            self.array, self.handle = engine.allocate(length, name=name or None)
        else:
            self.array = np.zeros(length, dtype=np.uint8)
            self.handle = engine.register(self.array, name=name or None)


def sluice_target(o) -> int:
    engine = _sluice_engine(o, True)
    buf = _Buf(engine, region_length(o), o.memfd, REGION_NAME)
    buf.array[:] = pattern(len(buf.array))
    stop = threading.Event()
    print(f"SLUICE_TARGET {engine.listen_address}", flush=True)
    if o.role == "target":
        sys.stderr.write(f"target listening on {engine.listen_address} (transports: {' '.join(engine.transports)});"
                         " Ctrl-C to stop\n")
    else:
        threading.Thread(target=wait_stdin_eof, args=(stop,), daemon=True).start()

    def serve(ep):
        try:
            if o.op == "send":
                window = collections.deque()
                depth = o.batch_size * o.concurrency * 2
                while not stop.is_set() and ep.connected:
                    while len(window) < depth:
                        window.append(ep.recv(buf.handle, 0, o.max_size))
                    if not window[0].wait(0.2):
                        continue
                    window.popleft()
            elif o.op == "write_imm":
                while not stop.is_set() and ep.connected:
                    f = ep.imm_recv()
                    while not f.wait(0.2) and not stop.is_set():
                        pass
        except Exception:
            pass

    servers = []
    try:
        while not stop.is_set():
            ep = engine.accept(0.2)
            if ep is not None:
                t = threading.Thread(target=serve, args=(ep,), daemon=True)
                t.start()
                servers.append(t)
    except KeyboardInterrupt:
        pass
    stop.set()
    engine.close()
    for t in servers:
        t.join(timeout=5)
    return 0


def sluice_initiator(o, address: str) -> int:
    import sluice

    engine = _sluice_engine(o, False)
    ep = engine.connect(address, transport=o.transport or None)
    remote = ep.remote_region(REGION_NAME)
    region = next(r["length"] for r in ep.remote_regions() if r["id"] == remote)
    region = min(region, region_length(o))
    local = _Buf(engine, region, o.memfd)
    check = _Buf(engine, region, False)
    local.array[:region] = pattern(region)
    L, R = int(local.handle), int(remote)
    submit = {"read": ep.read, "write": ep.write}.get(o.op)

    def unit(b, i):
        if o.op == "write_imm":
            return [ep.write_with_imm(b, i)]
        if o.op == "send":
            return [ep.send(L, int(a[1]), int(a[4])) for a in b]
        return [submit(b)]

    def batches(size, count):
        offs = offsets(o, size, region, count)
        arr = np.empty(offs.shape + (5,), dtype=np.uint64)
        arr[..., 0], arr[..., 1], arr[..., 2], arr[..., 3], arr[..., 4] = L, offs, R, offs, size
        return arr

    def measure(size):
        iters = iterations_for(o, size)
        warm = min(iters // 10 + 1, 8)
        arr = batches(size, warm + iters)
        inflight = collections.deque()
        stats = {"lat": 0.0, "errors": 0}

        def drain_one():
            worst = 0.0
            for f in inflight.popleft():
                try:
                    f.wait()
                except sluice.SluiceError as e:
                    if not stats["errors"]:
                        sys.stderr.write(f"operation failed: {e}\n")
                    stats["errors"] += 1
                worst = max(worst, f.elapsed * 1e3)
            stats["lat"] += worst

        for i in range(warm):
            inflight.append(unit(arr[i], i))
            if len(inflight) >= o.concurrency:
                drain_one()
        while inflight:
            drain_one()
        stats["lat"], stats["errors"] = 0.0, 0
        t0 = time.perf_counter()
        for i in range(iters):
            if len(inflight) >= o.concurrency:
                drain_one()
            inflight.append(unit(arr[warm + i], i))
        while inflight:
            drain_one()
        secs = time.perf_counter() - t0
        return Row(ep.transport, ep.channels, size, o, stats["lat"] / iters,
                   size * o.batch_size * iters / secs / 1e6, stats["errors"])

    def verify(size):
        n = min(o.batch_size, max(1, region // size))
        rb = [(int(check.handle), j * size, R, j * size, size) for j in range(n)]
        seed = 0
        if o.op == "send":
            return True  # messages overlap in the target's buffer
        if o.op != "read":
            seed = size * 7 + 1
            local.array[: n * size] = pattern(n * size, seed)
            ep.write([(L, j * size, R, j * size, size) for j in range(n)]).result()
        ep.read(rb).result()
        ok = np.array_equal(check.array[: n * size], pattern(n * size, seed))
        if not ok:
            sys.stderr.write(f"CHECK FAILED at size {size_text(size)}\n")
        if o.op != "read":
            local.array[: n * size] = pattern(n * size)
        return ok

    try:
        return run_sizes(o, measure, verify, ep.transport, ep.channels)
    finally:
        engine.close()


# ---------------------------------------------------------------- nixl


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a missing shared library
        raise SystemExit(f"sluice.bench: --engine nixl needs the 'nixl' package (pip install nixl), which "
                         f"cannot be imported here: {type(e).__name__}: {e}")
    return nixl_agent, nixl_agent_config


def _nixl_agent(o, name: str):
    nixl_agent, nixl_agent_config = _nixl()
    backend = (o.transport or "UCX").upper()
    try:
        return nixl_agent(name, nixl_agent_config(backends=[backend])), backend
    except Exception as e:
        raise SystemExit(f"sluice.bench: NIXL cannot create backend {backend} here: {type(e).__name__}: {e}")


def nixl_target(o) -> int:
    agent, _ = _nixl_agent(o, "sluice-bench-target")
    buf = pattern(region_length(o))
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    meta = base64.b64encode(agent.get_agent_metadata()).decode()
    print(f"NIXL_TARGET {buf.ctypes.data} {buf.nbytes} {meta}", flush=True)
    stop = threading.Event()
    wait_stdin_eof(stop) if o.role != "target" else stop.wait()
    return 0


def nixl_initiator(o, target: str) -> int:
    if o.op not in ("read", "write", "write_imm"):
        raise SystemExit(f"sluice.bench: --op {o.op} has no NIXL equivalent (NIXL moves data one-sided)")
    addr, length, meta = target.split(" ", 2)
    raddr, region = int(addr), int(length)
    agent, backend = _nixl_agent(o, "sluice-bench-initiator")
    peer = agent.add_remote_agent(base64.b64decode(meta))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    region = min(region, region_length(o))
    local = pattern(region)
    check = np.zeros(region, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, ""), (check.ctypes.data, check.nbytes, 0, "")], "DRAM")
    opname = "READ" if o.op == "read" else "WRITE"

    def xfer(op, lbase, offs, size, notif=b""):
        ld = np.stack([lbase + offs, np.full_like(offs, size), np.zeros_like(offs)], axis=1).astype(np.uint64)
        rd = np.stack([raddr + offs, np.full_like(offs, size), np.zeros_like(offs)], axis=1).astype(np.uint64)
        h = agent.initialize_xfer(op, agent.get_xfer_descs(ld, "DRAM"), agent.get_xfer_descs(rd, "DRAM"), peer, notif)
        state = agent.transfer(h)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed to post")
        return [h, time.perf_counter()]

    def poll(x):
        s = agent.check_xfer_state(x[0])
        if s == "ERR":
            raise RuntimeError("NIXL transfer failed")
        return s == "DONE"

    def measure(size):
        iters = iterations_for(o, size)
        warm = min(iters // 10 + 1, 8)
        offs = offsets(o, size, region, warm + iters).astype(np.uint64)
        notif = b"imm" if o.op == "write_imm" else b""
        lat, errors = 0.0, 0
        inflight = collections.deque()

        def drain_one():
            nonlocal lat, errors
            x = inflight.popleft()
            try:
                while not poll(x):
                    pass
            except RuntimeError:
                errors += 1
            lat += (time.perf_counter() - x[1]) * 1e3
            x[0].release()

        for i in range(warm):
            inflight.append(xfer(opname, local.ctypes.data, offs[i], size, notif))
            if len(inflight) >= o.concurrency:
                drain_one()
        while inflight:
            drain_one()
        lat, errors = 0.0, 0
        t0 = time.perf_counter()
        for i in range(iters):
            if len(inflight) >= o.concurrency:
                drain_one()
            inflight.append(xfer(opname, local.ctypes.data, offs[warm + i], size, notif))
        while inflight:
            drain_one()
        secs = time.perf_counter() - t0
        return Row(backend.lower(), 1, size, o, lat / iters, size * o.batch_size * iters / secs / 1e6, errors)

    def wait(x):
        while not poll(x):
            pass
        x[0].release()

    def verify(size):
        n = min(o.batch_size, max(1, region // size))
        offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
        seed = 0
        if o.op != "read":
            seed = size * 7 + 1
            local[: n * size] = pattern(n * size, seed)
            wait(xfer("WRITE", local.ctypes.data, offs, size))
        wait(xfer("READ", check.ctypes.data, offs, size))
        ok = np.array_equal(check[: n * size], pattern(n * size, seed))
        if o.op != "read":
            local[: n * size] = pattern(n * size)
        return ok

    return run_sizes(o, measure, verify, backend.lower(), 1)


# ---------------------------------------------------------------- mooncake


def _mooncake():
    try:
        from mooncake.engine import TransferEngine
    except Exception as e:
        raise SystemExit(
            "sluice.bench: --engine mooncake needs the 'mooncake-transfer-engine' package "
            f"(pip install mooncake-transfer-engine), which cannot be imported here: {type(e).__name__}: {e}"
            + (" (the PyPI wheel is built against CUDA and loads libcudart/libcuda at import, so it "
               "needs an NVIDIA driver)" if "cuda" in str(e).lower() else ""))
    return TransferEngine


def _mooncake_engine(o):
    te = _mooncake()()
    protocol = o.transport or "tcp"
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise SystemExit(f"sluice.bench: mooncake TransferEngine.initialize(protocol={protocol}) failed: {rc}")
    return te, protocol


def mooncake_target(o) -> int:
    te, _ = _mooncake_engine(o)
    buf = pattern(region_length(o))
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("sluice.bench: mooncake register_memory failed")
    print(f"MOONCAKE_TARGET 127.0.0.1:{te.get_rpc_port()} {buf.ctypes.data} {buf.nbytes}", flush=True)
    stop = threading.Event()
    wait_stdin_eof(stop) if o.role != "target" else stop.wait()
    return 0


def mooncake_initiator(o, target: str) -> int:
    if o.op not in ("read", "write"):
        raise SystemExit(f"sluice.bench: --op {o.op} has no mooncake equivalent (read and write only)")
    peer, addr, length = target.split()
    raddr, region = int(addr), min(int(length), region_length(o))
    te, protocol = _mooncake_engine(o)
    local, check = pattern(region), np.zeros(region, dtype=np.uint8)
    for b in (local, check):
        if te.register_memory(b.ctypes.data, b.nbytes) != 0:
            raise SystemExit("sluice.bench: mooncake register_memory failed")
    # Synchronous batch calls from `concurrency` threads (the engine's Python API releases
    # the GIL while it waits).
    fn = te.batch_transfer_sync_read if o.op == "read" else te.batch_transfer_sync_write

    def measure(size):
        iters = iterations_for(o, size)
        offs = offsets(o, size, region, iters)
        lat, errors = [0.0], [0]
        lock = threading.Lock()
        nxt = [0]

        def worker():
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= iters:
                    return
                o_ = [int(x) for x in offs[i]]
                t = time.perf_counter()
                rc = fn(peer, [local.ctypes.data + x for x in o_], [raddr + x for x in o_], [size] * len(o_))
                with lock:
                    lat[0] += (time.perf_counter() - t) * 1e3
                    errors[0] += rc != 0

        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker) for _ in range(o.concurrency)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = time.perf_counter() - t0
        return Row(protocol, 1, size, o, lat[0] / iters, size * o.batch_size * iters / secs / 1e6, errors[0])

    def verify(size):
        n = min(o.batch_size, max(1, region // size))
        offs = [j * size for j in range(n)]
        seed = 0
        if o.op != "read":
            seed = size * 7 + 1
            local[: n * size] = pattern(n * size, seed)
            te.batch_transfer_sync_write(peer, [local.ctypes.data + x for x in offs], [raddr + x for x in offs], [size] * n)
        te.batch_transfer_sync_read(peer, [check.ctypes.data + x for x in offs], [raddr + x for x in offs], [size] * n)
        ok = np.array_equal(check[: n * size], pattern(n * size, seed))
        if o.op != "read":
            local[: n * size] = pattern(n * size)
        return ok

    return run_sizes(o, measure, verify, protocol, 1)


# ---------------------------------------------------------------- main

ENGINES = {
    "sluice": ("SLUICE_TARGET", sluice_target, sluice_initiator, None),
    "nixl": ("NIXL_TARGET", nixl_target, nixl_initiator, _nixl),
    "mooncake": ("MOONCAKE_TARGET", mooncake_target, mooncake_initiator, _mooncake),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    o = parse(argv)
    marker, target, initiator, probe = ENGINES[o.engine]
    try:
        if o.role in ("target", "loopback-target"):
            return target(o)
        if o.role == "initiator":
            return initiator(o, o.connect)
        if probe is not None:
            probe()  # fail fast, with the reason, before starting a target process
        child, address = spawn_target(o, argv, marker)
        try:
            return initiator(o, address)
        finally:
            child.stdin.close()  # the target exits when its stdin closes
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as e:
        sys.stderr.write(f"sluice.bench: {type(e).__name__}: {e}\n")
        return 1


if __name__ == "__main__":
    rc = main()
    if "nixl" in sys.modules:
        # NIXL 1.5.1 dies with SIGSEGV in its own exit-time teardown (a bare agent that did
        # nothing does it too, here): leave without that teardown, output flushed, so the run's
        # exit status is its own.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
