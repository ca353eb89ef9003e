"""Push fresh weights from a trainer to two inference processes with sluice.weights.

    python examples/python/weight_update.py [--relay | --push]

The trainer shares its model's tensors once (copies in shared host memory) and publishes a
version after each "training step"; each inference process pulls into its own parameter
tensors (on the GPU where there is one), bucket by bucket, with a load_weights-style callback per bucket, and only the tensors that changed.
With ``--relay`` the first inference process relays: the second pulls from it, bucket by
bucket, instead of from the trainer (docs/weights.md, "Relays"). With ``--push`` the trainer
pushes each version into both (WeightPublisher.push into WeightSink.receive: each bucket a
write-with-immediate that runs the callback; docs/weights.md, "Push").
Bytes are checked; the script exits 0 when both inference processes hold every version.
"""
from __future__ import annotations

import multiprocessing as mp
import sys


def make_model(torch):
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(8)}
    model["embed.weight"] = torch.randn(1000, 256, generator=g)
    model["norm.weight"] = torch.ones(256, dtype=torch.float16)
    return model


def checksum(t) -> int:
    """crc32 of a tensor's bytes, wherever it lives (float sums differ between CPU and GPU)."""
    import zlib

    import torch

    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def train_step(torch, model, step):
    """A stand-in optimizer step: change some tensors in place, return their names."""
    changed = [n for i, n in enumerate(sorted(model)) if (i + step) % 3 == 0]
    for n in changed:
        model[n].add_(1)
    return changed


def push_all(pub, step):
    """Write version ``step`` into both inference processes' parameters (they armed with receive())."""
    report = pub.push(expect=2, timeout=60)
    if not report.ok:
        raise RuntimeError(f"push of version {step} failed: {[(s.rank, s.error) for s in report.failed]}")


def trainer(conn, steps, push=False):
    import torch

    import sluice
    from sluice.weights import WeightPublisher

    engine = sluice.Engine()
    pub = WeightPublisher(engine, "policy")
    # Once: the tensors are copied into shared host memory (pub.register(model) would register
    # them where they are). Receivers on this host map it: their CPU targets fill with a memcpy,
    # their GPU targets with the copy engine. The trainer updates the copies from now on.
    model = pub.share(make_model(torch))
    pub.publish(0)
    conn.send((engine.listen_address, {n: checksum(model[n]) for n in model}))
    if push:
        push_all(pub, 0)
    for step in range(1, steps + 1):
        conn.recv()  # the inference side finished the previous version
        pub.begin_update()  # receivers never keep half-written tensors
        changed = train_step(torch, model, step)
        pub.publish(step, names=changed)  # only these changed: receivers get only them
        if push:
            push_all(pub, step)
        conn.send(("published", step, {n: checksum(model[n]) for n in model}))
    conn.recv()
    pub.close()
    engine.close()


def inference(conn, rank, trainer_ref, steps, relay=False, source=None, push=False):
    import torch

    import sluice
    from sluice.weights import WeightSink, WeightSubscriber

    # The inference engine's own parameters: on the GPU where there is one.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {n: torch.zeros_like(t, device=device) for n, t in make_model(torch).items()}
    loaded = []

    def load_weights(pairs):  # runs while the next bucket is in flight
        loaded.extend(n for n, _ in pairs)

    # A relay listens: the processes that pull from it connect to its engine.
    with sluice.Engine(listen="127.0.0.1:0" if relay else None) as engine:
        if push:  # the trainer writes; receive() arms and returns once the push ended
            sub = WeightSink(engine, trainer_ref, rank=rank, bucket_bytes=256 << 10)
        else:
            sub = WeightSubscriber(engine, trainer_ref, bucket_bytes=256 << 10, relay=relay, source=source)
        conn.send(engine.listen_address)
        for step in range(steps + 1):
            loaded.clear()
            if push:
                res = sub.receive(params, on_bucket=load_weights, timeout=60)
                version = res.version
            else:
                version = sub.wait_for_version(step, timeout=30)
                res = sub.update(params, on_bucket=load_weights)
            sums = {n: checksum(t) for n, t in params.items()}
            conn.send((rank, version, len(res.updated), res.nbytes, res.from_source,
                       sorted(loaded) == sorted(res.updated), sums))
            conn.recv()
        sub.close()


def main() -> int:
    relay = "--relay" in sys.argv[1:]
    push = "--push" in sys.argv[1:]
    if relay and push:
        print("--relay and --push: one or the other")
        return 2
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skipped: torch is not installed (pip install torch==2.13.0)")
        return 0
    steps = 3
    ctx = mp.get_context("spawn")
    tconn, tchild = ctx.Pipe()
    tp = ctx.Process(target=trainer, args=(tchild, steps, push))
    tp.start()
    ref, want = tconn.recv()
    conns, procs, refs = [], [], []
    for rank in range(2):
        c, child = ctx.Pipe()
        # --relay: inference 0 relays, inference 1 pulls from it
        source = refs[0] if relay and rank == 1 else None
        p = ctx.Process(target=inference, args=(child, rank, ref, steps, relay and rank == 0, source, push))
        p.start()
        refs.append(c.recv())
        conns.append(c)
        procs.append(p)
    ok = True
    for step in range(steps + 1):
        for c in conns:
            rank, version, n, nbytes, from_relay, callbacks_ok, sums = c.recv()
            right = sums == want
            ok &= right and callbacks_ok
            via = f", {from_relay} of them from inference 0" if from_relay else ""
            print(f"inference {rank}: version {version}, {'got' if push else 'pulled'} {n} tensors ({nbytes} bytes{via})"
                  f"{'' if right else ' WRONG BYTES'}")
        for c in conns:  # first: with --push they must arm before the trainer's push can end
            c.send("next")
        if step < steps:
            tconn.send("next")
            _, _, want = tconn.recv()
    tconn.send("stop")
    for p in procs + [tp]:
        p.join(30)
        ok &= p.exitcode == 0
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
