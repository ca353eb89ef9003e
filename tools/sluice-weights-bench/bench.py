"""Time sluice.weights: a trainer process publishes a synthetic model, K receiver processes
pull all of it at once, for several rounds; prints medians and the one-copy ceiling (a plain
memcpy of the same bytes, measured in the same run).

    python tools/sluice-weights-bench/bench.py [--size-mib 256] [--tensors 1000] [--receivers 2]
        [--rounds 5] [--bucket-mib 64] [--depth 2] [--transport tcp] [--check] [--json out.json]
        [--trainer-memory cpu|pinned|shared|cuda] [--targets cpu|cuda] [--mode pull|push|both]

``--trainer-memory``: the trainer's tensors are plain CPU tensors (``register``), pinned CPU
tensors, copies in shareable host memory (``WeightPublisher.share``: receivers on this host
map it) or CUDA tensors on cuda:0. ``--targets cuda``: receiver i pulls into GPU
i % device_count; the pinned host-to-device copy of the same bytes (and, with a CUDA trainer,
the device-to-device copy) is then measured in the same run as the ceiling.

Every round each receiver runs ``update(force=True)`` (a full pull into its own tensors),
all receivers starting together; the round's time is the slowest receiver's. ``--mode push``:
the receivers are ``WeightSink`` s and each round is ``receive(force=True)`` at every receiver
and one ``WeightPublisher.push()`` at the trainer (write-with-immediate per bucket); ``both``
alternates pull and push rounds in one run (the same processes, tensors and buckets). ``--check``
verifies every tensor's bytes (crc32 against the trainer's) after the last round and exits 1
on a mismatch: CI runs it at 256 MiB. The model: ``--tensors`` tensors of mixed dtypes
(float32, bfloat16, float16, float8_e4m3fn when torch has it, int8) and sizes (a few large
ones, many small), deterministic bytes.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import zlib
from typing import Any, Dict, List, Tuple

# torch and sluice are imported inside the functions: main() starts the forkserver (which
# preloads them) first, so that the two imports of torch run side by side.

Spec = List[Tuple[str, Any, Tuple[int, ...]]]


def synthetic_spec(total_bytes: int, n: int) -> Spec:
    """``n`` tensors summing to about ``total_bytes``: sizes drawn from a skewed (Zipf-like)
    distribution, as real models mix big matrices with small norms and biases."""
    import torch

    dtypes = [torch.float32, torch.bfloat16, torch.float16, getattr(torch, "float8_e4m3fn", torch.int8), torch.int8]
    weights = [1.0 / (1 + (i * 7919) % n) ** 0.6 for i in range(n)]
    scale = total_bytes / sum(weights)
    spec: Spec = []
    for i, w in enumerate(weights):
        dt = dtypes[i % len(dtypes)]
        esz = torch.empty(0, dtype=dt).element_size()
        numel = max(1, int(w * scale) // esz)
        spec.append((f"layer{i // 8}.p{i % 8}", dt, (numel,)))
    return spec


def as_bytes(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


_POOL = 4 << 20


def fill(t, pool, index: int) -> None:
    """Random-looking bytes that differ per tensor, at memcpy speed: slices of a random pool
    starting at a per-tensor offset (random generation of the whole model would dominate)."""
    b = as_bytes(t)
    off, pos = (index * 7919) % _POOL, 0
    while pos < b.numel():
        n = min(b.numel() - pos, _POOL)
        b[pos:pos + n].copy_(pool[off:off + n])
        pos += n


def crc(t) -> int:
    return zlib.crc32(as_bytes(t).cpu().numpy())


def trainer(conn, spec: Spec, transports, memory: str) -> None:
    import torch

    import sluice
    from sluice.weights import WeightPublisher

    torch.set_num_threads(1)  # see receiver()
    engine = sluice.Engine(transports=transports)
    pub = WeightPublisher(engine, "bench")
    tensors: Dict[str, Any] = {}
    pool = torch.randint(0, 256, (2 * _POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1234))
    if memory == "cuda":
        pool = pool.cuda()
    for i, (name, dt, shape) in enumerate(spec):
        t = torch.empty(shape, dtype=dt, device="cuda" if memory == "cuda" else "cpu",
                        pin_memory=memory == "pinned")
        fill(t, pool, i)
        tensors[name] = t
    if memory == "shared":
        tensors = pub.share(tensors)  # the originals are dropped: the trainer keeps the copies
    else:
        pub.register(tensors)
    crcs = {n: crc(t) for n, t in tensors.items()}
    pub.publish(1)
    conn.send((engine.listen_address, crcs))
    while True:
        cmd = conn.recv()
        if cmd[0] != "push":
            break  # stop
        res = pub.push(expect=cmd[1], timeout=300)
        conn.send((res.seconds, [f"{s.rank}: {s.error}" for s in res.failed]))
    pub.close()
    engine.close()


def receiver(conn, ref: str, spec: Spec, transports, bucket_bytes: int, depth: int, rounds: int, check: bool,
             device: str, rank: int = 0) -> None:
    import torch

    import sluice
    from sluice.weights import WeightSink, WeightSubscriber

    # One torch thread: the engine moves the bytes; OpenMP workers forked from the server
    # and spinning on a busy 2-core host made allocating the targets take 20 s.
    torch.set_num_threads(1)
    with sluice.Engine(transports=transports) as engine:
        targets = {n: torch.zeros(s, dtype=d, device=device) for n, d, s in spec}
        sub = WeightSubscriber(engine, ref, bucket_bytes=bucket_bytes, depth=depth, timeout=120)
        sink = WeightSink(engine, ref, rank=rank, bucket_bytes=bucket_bytes, timeout=300)
        sub.published()  # connect and read the metadata before timing
        sink.published()
        conn.send("ready")
        times = []
        for _ in range(rounds):
            mode = conn.recv()  # go: "pull" or "push"
            t0 = time.perf_counter()
            if mode == "push":
                res = sink.receive(targets, force=True)
            else:
                res = sub.update(targets, force=True)
            times.append((mode, time.perf_counter() - t0))
            conn.send(("done", res.nbytes))
        crcs = {n: crc(t) for n, t in targets.items()} if check else {}
        conn.send((times, crcs, sub._ep.transport if sub._ep is not None else "?"))
        sub.close()
        sink.close()


def memcpy_ceiling(total_bytes: int, rounds: int) -> float:
    """Median seconds of one copy of ``total_bytes`` between two host buffers."""
    import torch

    src = torch.ones(total_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_ceilings(total_bytes: int, rounds: int, d2d: bool) -> Dict[str, float]:
    """Median seconds of one pinned host-to-device copy of ``total_bytes`` into cuda:0 (the
    ceiling of a GPU's ingest from host memory), and with ``d2d`` of one device-to-device copy
    from cuda:0 to the last GPU (the same GPU when there is one)."""
    import torch

    out = {}
    src = torch.ones(total_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:0")
    pairs = [("pinned H2D copy (one GPU)", src, dst)]
    if d2d:
        last = torch.cuda.device_count() - 1
        pairs.append((f"D2D copy cuda:0 -> cuda:{last}", dst, torch.empty_like(dst, device=f"cuda:{last}")))
    for what, a, b in pairs:
        b.copy_(a)
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            b.copy_(a, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[what] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mib", type=float, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--transport", default=None, help="force a transport (tcp, shm); default: the engine's choice")
    ap.add_argument("--trainer-memory", choices=["cpu", "pinned", "shared", "cuda"], default="cpu",
                    help="where the trainer's tensors are (see the module doc)")
    ap.add_argument("--targets", choices=["cpu", "cuda"], default="cpu",
                    help="receivers pull into CPU tensors or into GPU i %% device_count")
    ap.add_argument("--mode", choices=["pull", "push", "both"], default="pull",
                    help="receivers pull (WeightSubscriber), the trainer pushes (WeightSink), or both interleaved")
    ap.add_argument("--check", action="store_true", help="verify every byte after the last round; exit 1 if wrong")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--verbose", action="store_true", help="print when each phase ends (stderr)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    def phase(what: str) -> None:
        if a.verbose:
            print(f"[{time.perf_counter() - t_start:7.2f} s] {what}", file=sys.stderr, flush=True)

    if min(a.size_mib, a.tensors, a.receivers, a.rounds, a.depth) <= 0 or a.bucket_mib <= 0:
        ap.error("sizes and counts must be > 0")

    # forkserver: torch and sluice are imported once (in the server), every process forks
    # from it; spawned processes would each import torch again (seconds on a busy host).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sluice", "sluice.weights"])
    from multiprocessing import forkserver

    forkserver.ensure_running()  # starts importing torch there while we import it here
    import torch

    phase("torch imported")
    spec = synthetic_spec(a.size_mib << 20, a.tensors)
    total = sum(torch.empty(0, dtype=d).element_size() * s[0] for _, d, s in spec)
    tconn, tchild = ctx.Pipe()
    ngpu = torch.cuda.device_count() if (a.targets == "cuda" or a.trainer_memory in ("cuda", "pinned")) else 0
    if (a.targets == "cuda" or a.trainer_memory in ("cuda", "pinned")) and ngpu == 0:
        ap.error("--targets cuda / --trainer-memory cuda|pinned need a CUDA device, and torch sees none")
    modes = {"pull": ["pull"], "push": ["push"], "both": ["pull", "push"]}[a.mode] * a.rounds
    tp = ctx.Process(target=trainer, args=(tchild, spec, a.transport, a.trainer_memory), daemon=True)
    tp.start()
    kids = []
    try:
        if not tconn.poll(300):
            print("sluice-weights-bench: the trainer did not start", file=sys.stderr)
            return 1
        ref, want = tconn.recv()
        phase("trainer published")
        for i in range(a.receivers):
            conn, child = ctx.Pipe()
            device = f"cuda:{i % ngpu}" if a.targets == "cuda" else "cpu"
            p = ctx.Process(target=receiver, daemon=True,
                            args=(child, ref, spec, a.transport, int(a.bucket_mib * (1 << 20)), a.depth, len(modes),
                                  a.check, device, i))
            p.start()
            kids.append((conn, p))
        for conn, _ in kids:
            if not conn.poll(300) or conn.recv() != "ready":
                print("sluice-weights-bench: a receiver did not start", file=sys.stderr)
                return 1
        phase("receivers ready")
        rounds: Dict[str, List[float]] = {m: [] for m in dict.fromkeys(modes)}
        for mode in modes:
            t0 = time.perf_counter()
            for conn, _ in kids:
                conn.send(mode)
            if mode == "push":
                tconn.send(("push", len(kids)))
            for conn, _ in kids:
                if not conn.poll(300):
                    print("sluice-weights-bench: a receiver did not finish its round", file=sys.stderr)
                    return 1
                tag, nbytes = conn.recv()
                assert tag == "done" and nbytes == total, (tag, nbytes, total)
            if mode == "push":
                if not tconn.poll(300):
                    print("sluice-weights-bench: the trainer's push did not return", file=sys.stderr)
                    return 1
                _, failed = tconn.recv()
                if failed:
                    print(f"sluice-weights-bench: push failed at {failed}", file=sys.stderr)
                    return 1
            rounds[mode].append(time.perf_counter() - t0)
            phase(f"round {sum(map(len, rounds.values()))} ({mode})")
        per: Dict[str, List[float]] = {m: [] for m in rounds}
        bad = []
        used = set()
        for i, (conn, _) in enumerate(kids):
            times, crcs, transport = conn.recv()
            used.add(transport)
            for m in rounds:
                per[m].append(statistics.median(t for mm, t in times if mm == m))
            if a.check:
                bad += [f"receiver {i}: {n}" for n in want if crcs.get(n) != want[n]]
        tconn.send(("stop",))
        phase("receivers checked")
    finally:
        for _, p in kids:
            p.join(30)
            if p.is_alive():
                p.kill()
        tp.join(30)
        if tp.is_alive():
            tp.kill()
    phase("processes joined")
    ceiling = memcpy_ceiling(total, a.rounds)
    phase("memcpy measured")
    gpu = cuda_ceilings(total, a.rounds, a.trainer_memory == "cuda") if a.targets == "cuda" else {}
    if gpu:
        phase("GPU copies measured")
    gb = total / 1e9
    print(f"sluice-weights-bench: {len(spec)} tensors, {total / (1 << 20):.1f} MiB, {a.receivers} receivers, "
          f"bucket {a.bucket_mib:g} MiB x{a.depth}, transport {a.transport or 'auto'} (used: {', '.join(sorted(used))}), "
          f"trainer {a.trainer_memory} -> targets {a.targets}, medians of {a.rounds} rounds"
          f"{' per mode, interleaved' if a.mode == 'both' else ''}")
    print(f"{'what':<34}{'seconds':>10}{'GB/s':>10}")
    print(f"{'memcpy ceiling (one copy)':<34}{ceiling:>10.4f}{gb / ceiling:>10.2f}")
    for what, sec in gpu.items():
        print(f"{what + ' ceiling':<34}{sec:>10.4f}{gb / sec:>10.2f}")
    for m in rounds:
        rnd, rcv = statistics.median(rounds[m]), statistics.median(per[m])
        spread = f"  (rounds {min(rounds[m]):.4f}..{max(rounds[m]):.4f})"
        print(f"{m + ' per receiver':<34}{rcv:>10.4f}{gb / rcv:>10.2f}")
        print(f"{m + ' round (all receivers)':<34}{rnd:>10.4f}{gb * a.receivers / rnd:>10.2f}  aggregate{spread}")
    for m in rounds:
        rcv = statistics.median(per[m])
        print(f"{m}: per-receiver ingest / memcpy ceiling: {ceiling / rcv:.2f}")
        for what, sec in gpu.items():
            print(f"{m}: per-receiver ingest / {what}: {sec / rcv:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tensors": len(spec), "bytes": total, "receivers": a.receivers, "mode": a.mode, "rounds": rounds,
                       "per_receiver_s": per, "memcpy_s": ceiling, "gpu_ceilings_s": gpu, "transport": a.transport,
                       "transports_used": sorted(used), "trainer_memory": a.trainer_memory, "targets": a.targets},
                      f, indent=1)
    if a.check:
        if bad:
            print(f"sluice-weights-bench: WRONG BYTES in {len(bad)} tensors: {bad[:5]}", file=sys.stderr)
            return 1
        print(f"check: every byte of {len(spec)} tensors right at {a.receivers} receivers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
