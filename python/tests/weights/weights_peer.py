"""Processes for the sluice.weights tests: a trainer that publishes a synthetic model and
obeys commands from a pipe, and a receiver that updates and checks bytes."""

from __future__ import annotations

import os
import zlib

import torch

import sluice
from sluice.weights import WeightPublisher, WeightSink, WeightSubscriber

FP8 = getattr(torch, "float8_e4m3fn", None)


def model_spec(n_layers: int = 30, width: int = 64):
    """(name, dtype, shape): mixed dtypes, fp8 when torch has it, a scalar and 0-size tensors."""
    spec = [("embed", torch.bfloat16, (257, width)), ("scalar", torch.float32, ()),
            ("empty", torch.float16, (0, 4)), ("flags", torch.bool, (13,)), ("ids", torch.int64, (33,))]
    for i in range(n_layers):
        spec += [(f"l{i}.w", torch.float32, (width, width + i)), (f"l{i}.b", torch.float16, (width + i,)),
                 (f"l{i}.q", FP8 or torch.int8, (width, 3 + i)), (f"l{i}.s", torch.int8, (7 * i,))]
    return spec


def big_spec(mib: int):
    """One model of about ``mib`` MiB in 8 tensors (trainer-killed tests)."""
    per = (mib << 20) // 8 // 4
    return [(f"big{i}", torch.float32, (per,)) for i in range(8)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill(t: torch.Tensor, name: str, version: int) -> None:
    """Deterministic bytes for (name, version), on whatever device ``t`` is."""
    b = as_bytes(t)
    if b.numel() == 0:
        return
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ version)
    v = torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g)
    if t.dtype == torch.bool:
        v.bitwise_and_(1)
    b.copy_(v)


def expected(name: str, dtype, shape, version: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    fill(t, name, version)
    return as_bytes(t)


def empty_targets(spec, device="cpu"):
    return {n: torch.zeros(s, dtype=d, device=device) for n, d, s in spec}


def trainer(conn, spec, listen=None, transports=None, name="model", mode="register"):
    """Publish ``spec`` at version 1, send our address, then obey commands. ``mode``:
    "register" (CPU tensors), "share" (CPU tensors copied into shared memory, updated there
    from then on) or "cuda" (CUDA tensors registered)."""
    torch.set_num_threads(1)  # forked OpenMP workers spinning on a busy host cost seconds
    engine = sluice.Engine(listen=listen, transports=transports)
    device = "cuda" if mode == "cuda" else "cpu"
    tensors = {n: torch.empty(s, dtype=d, device=device) for n, d, s in spec}
    for n, t in tensors.items():
        fill(t, n, 1)
    pub = WeightPublisher(engine, name)
    if mode == "share":
        tensors = pub.share(tensors)
    else:
        pub.register(tensors)
    pub.publish(1)
    conn.send(engine.listen_address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "publish":
            version, names = cmd[1], cmd[2]
            with pub.updating(version, names):
                for n in names or tensors:
                    fill(tensors[n], n, version)
            conn.send("ok")
        elif cmd[0] == "begin":
            pub.begin_update()
            conn.send("ok")
        elif cmd[0] == "push":  # ("push", keywords): answers the report as plain tuples
            res = pub.push(**cmd[1])
            conn.send((res.version, [(s.rank, s.tensors, s.nbytes, s.error) for s in res.sinks]))
        elif cmd[0] == "stop":
            break
    pub.close()
    engine.close()
    conn.send("stopped")


def receiver(conn, ref, spec, version, bucket_bytes, die_after_buckets=None):
    """Update everything from ``ref`` and report whether every byte is right. With
    ``die_after_buckets``: exit hard from inside the callback (a receiver that dies)."""
    torch.set_num_threads(1)
    with sluice.Engine() as engine:
        targets = empty_targets(spec)
        seen = []

        def on_bucket(pairs):
            seen.extend(n for n, _ in pairs)
            if die_after_buckets is not None and len(seen) >= die_after_buckets:
                os._exit(3)

        sub = WeightSubscriber(engine, ref, bucket_bytes=bucket_bytes, timeout=30)
        conn.send("ready")
        conn.recv()  # go
        res = sub.update(targets, on_bucket=on_bucket)
        bad = [n for n, d, s in spec if not torch.equal(as_bytes(targets[n]), expected(n, d, s, version))]
        conn.send((res.version, sorted(res.updated), bad, sorted(seen)))
        sub.close()


def sink(conn, ref, spec, version, bucket_bytes, rank, die_after_buckets=None):
    """A WeightSink that arms once and reports whether every byte is right; with
    ``die_after_buckets`` it exits hard from inside its callback (a receiver that dies)."""
    torch.set_num_threads(1)
    with sluice.Engine() as engine:
        targets = empty_targets(spec)
        seen = []

        def on_bucket(pairs):
            seen.extend(n for n, _ in pairs)
            if die_after_buckets is not None and len(seen) >= die_after_buckets:
                os._exit(3)

        s = WeightSink(engine, ref, rank=rank, bucket_bytes=bucket_bytes, timeout=30)
        s.published()  # connected: the trainer's accept thread holds our endpoint
        conn.send("ready")
        res = s.receive(targets, on_bucket=on_bucket)
        bad = [n for n, d, s_ in spec if not torch.equal(as_bytes(targets[n]), expected(n, d, s_, version))]
        conn.send((res.version, sorted(res.updated), bad, sorted(seen)))
        s.close()


def relay(conn, trainer_ref, spec, transports=None, source=None):
    """A receiver that relays (WeightSubscriber(relay=True), optionally pulling from another
    relay ``source``): sends its address, then obeys ("update", hold_at, die_at), where
    ``hold_at`` = n: after its n-th bucket it reports "held" and waits for "resume";
    ``die_at`` = n: it exits hard after its n-th bucket. Answers (res fields, bad names)."""
    torch.set_num_threads(1)
    engine = sluice.Engine(listen="127.0.0.1:0", transports=transports)
    targets = empty_targets(spec)
    sub = WeightSubscriber(engine, trainer_ref, bucket_bytes=64 << 10, timeout=60, relay=True, source=source,
                           relay_wait=2.0)
    conn.send(engine.listen_address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "update":
            hold_at, die_at = cmd[1], cmd[2]
            seen = [0]

            def on_bucket(pairs):
                seen[0] += 1
                if die_at is not None and seen[0] >= die_at:
                    os._exit(3)
                if hold_at is not None and seen[0] == hold_at:
                    conn.send("held")
                    assert conn.recv() == "resume"

            res = sub.update(targets, on_bucket=on_bucket, force=True)
            vers = sub.published().versions
            names = [t.name for t in sub.published().tensors]
            want = dict(zip(names, vers))
            bad = [n for n, d, s in spec if not torch.equal(as_bytes(targets[n]), expected(n, d, s, want[n]))]
            conn.send(((res.version, res.nbytes, res.from_source, res.source_fallback), bad))
        elif cmd[0] == "stop":
            break
    sub.close()
    engine.close()
    conn.send("stopped")
