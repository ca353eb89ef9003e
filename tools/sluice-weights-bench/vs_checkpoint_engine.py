"""Issue 15's comparison: checkpoint-engine's broadcast, checkpoint-engine's P2P (on the Sluice
Mooncake facade) and sluice.weights, the same synthetic model into every GPU, interleaved
rounds in one run, with the pinned host-to-device copy measured alongside as the ceiling.

    torchrun --nproc-per-node NGPU tools/sluice-weights-bench/vs_checkpoint_engine.py \
        [--size-gib 20] [--tensors 1000] [--rounds 3] [--paths ce-broadcast,ce-p2p,sluice] \
        [--bucket-mib 64] [--depth 2] [--json out.json] [--csv out.csv]

Layout, as checkpoint-engine is deployed next to an inference engine: torchrun starts one
"trainer" rank per GPU; rank r holds shard r of the model (tensors i with i % world == r) in
host memory, and starts one inference process on GPU r that owns the full model's parameter
tensors there. Every path fills every inference process's parameters with the whole model:

- ``ce-broadcast``: checkpoint-engine 0.4.2's ``ParameterServer.update(ranks=[])``: its shards
  in its own pinned buffers, H2D into a bucket, NCCL broadcast, CUDA IPC to the inference
  process, which copies each tensor into its parameter (``update_weights_from_ipc`` with a
  ``run`` that does ``param.copy_(w)``, as vLLM's ``load_weights`` does). The process group is
  made once (``auto_pg=False``), the best case for checkpoint-engine.
- ``ce-p2p``: ``update(ranks=all)``: every receiver reads the owners' pinned buffers with
  ``batch_transfer_sync_read`` on ``mooncake.engine.TransferEngine``, which is Sluice's facade
  here (``sluice.compat.mooncake``), then the same broadcast and IPC.
- ``sluice``: each rank publishes its shard with ``WeightPublisher.share``; each inference
  process pulls every shard (one ``WeightSubscriber`` per trainer rank, in parallel) straight
  into its parameters (``update(force=True)``).
- ``sluice-relay`` (2 ranks or more): ``sluice.weights.StripedSubscriber``, the shards striped
  over the GPUs, as checkpoint-engine shares its H2D work over NCCL: inference process r pulls
  shard r from trainer rank r and serves it as a relay; it pulls every other shard j from
  inference process j, bucket by bucket as j receives it, GPU to GPU. Each GPU then ingests
  1/world of the model from host memory.

Each round runs every path once, in a rotated order; before each path the parameters are
zeroed and after it every byte is compared with a reference copy of the model the inference
process made itself (exit 1 on a mismatch). A path's time is the slowest rank's wall time from
a common start to the end of the update. The ceiling: every rank copies ``--ceiling-gib`` of
pinned host memory into its GPU at once (and rank 0 alone), in every round. Medians and
spread over the rounds.

Without CUDA (CI): only ``sluice`` runs (into CPU parameters, ranks on gloo) and the ceiling is
a host memcpy; the checkpoint-engine paths are skipped with the reason printed.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import _POOL, as_bytes, fill, synthetic_spec  # noqa: E402  (the model of bench.py)

PATHS = ("ce-broadcast", "ce-p2p", "sluice", "sluice-relay")
NAME = "bench"


def log(rank: int, what: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def make_pool(device):
    import torch

    pool = torch.randint(0, 256, (2 * _POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1234))
    return pool.to(device)


# ------------------------------------------------------------------ inference process

def inference(conn, rank: int, world: int, device: str, spec, refs: List[str], device_uuid: str,
              bucket_bytes: int, depth: int, timeout: float, corrupt: bool) -> None:
    """One inference engine: owns the whole model's parameters on ``device``; serves the
    commands of its trainer rank over ``conn`` until "stop"."""
    import torch

    import sluice
    from sluice.weights import StripedSubscriber, WeightSubscriber

    try:
        torch.set_num_threads(1)
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(device)
        pool = make_pool(device)
        params: Dict[str, Any] = {}
        ref: Dict[str, Any] = {}
        for i, (name, dt, shape) in enumerate(spec):
            params[name] = torch.zeros(shape, dtype=dt, device=device)
            ref[name] = torch.empty(shape, dtype=dt, device=device)
            fill(ref[name], pool, i)  # the same bytes the trainer ranks made, made here
        del pool
        engine = sluice.Engine()  # listening: the sluice-relay path serves the other GPUs
        subs, shards = [], []
        for r, tref in enumerate(refs):
            sub = WeightSubscriber(engine, tref, NAME, bucket_bytes=bucket_bytes, depth=depth, timeout=timeout)
            sub.published()  # connect and read the metadata before any timing
            subs.append(sub)
            shards.append({n: params[n] for i, (n, _, _) in enumerate(spec) if i % world == r})
        if cuda:
            torch.cuda.synchronize()
        conn.send(("ready", engine.listen_address))
        _, relays = conn.recv()  # every inference process's address, by rank
        # sluice-relay: shard r from inference process r, ours from our trainer rank (which we
        # relay); subscribers of its own, so that neither path's endpoints are dropped and
        # made again when the paths alternate.
        striped = StripedSubscriber(engine, refs, relays, rank, NAME, bucket_bytes=bucket_bytes, depth=depth,
                                    timeout=timeout) if world > 1 else None
        for sub in striped.subscribers if striped else []:
            sub.published()
    except BaseException as e:  # noqa: BLE001 - reported to the rank, which stops the run
        conn.send(("error", f"inference process {rank} did not start: {e!r}"))
        raise

    zmq_ctx = None
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                break
            if cmd == "zero":
                for sub in subs + ([striped] if striped else []):  # a relay must not serve what we overwrite
                    sub.forget()
                for t in params.values():
                    t.zero_()
                if cuda:
                    torch.cuda.synchronize()
                conn.send(("ok", None))
            elif cmd == "check":
                bad = [n for n in params if not torch.equal(as_bytes(params[n]), as_bytes(ref[n]))]
                conn.send(("ok", bad))
            elif cmd == "ce":
                import zmq
                from checkpoint_engine.worker import update_weights_from_ipc

                zmq_ctx = zmq_ctx or zmq.Context()

                def load(weights):
                    for n, w in weights:
                        params[n].copy_(w)

                update_weights_from_ipc(zmq_ctx, dict(arg)[device_uuid], device_id=torch.cuda.current_device(),
                                        run=load, post_hook=torch.cuda.synchronize)
                conn.send(("ok", None))
            elif cmd == "sluice-relay":
                moved = striped.update(params, force=True).nbytes
                if corrupt:
                    as_bytes(params[spec[-1][0]])[-1] += 1
                conn.send(("ok", moved))
            elif cmd == "sluice":
                errors: List[BaseException] = []
                moved = [0] * len(subs)

                def pull(i: int) -> None:
                    try:
                        moved[i] = subs[i].update(shards[i], force=True).nbytes
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)

                threads = [threading.Thread(target=pull, args=(i,)) for i in range(len(subs))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
                if corrupt:  # --inject-corruption: proves that the check catches a wrong byte
                    as_bytes(params[spec[-1][0]])[-1] += 1
                conn.send(("ok", sum(moved)))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"inference process {rank}, {cmd}: {e!r}"))
    for sub in subs + ([striped] if striped else []):
        sub.close()
    engine.close()


# ------------------------------------------------------------------ trainer rank

class Rank:
    def __init__(self, a):
        import torch
        import torch.distributed as dist

        self.a = a
        self.torch, self.dist = torch, dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.cuda = torch.cuda.is_available() and not a.cpu
        shared = self.cuda and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if shared and not a.share_gpus:
            raise SystemExit(f"vs_checkpoint_engine: {os.environ.get('LOCAL_WORLD_SIZE')} ranks on this host but "
                             f"{torch.cuda.device_count()} GPUs: one rank per GPU (--share-gpus: sluice paths only)")
        if shared:
            a.paths = [p for p in a.paths if p.startswith("sluice")]  # NCCL refuses two ranks on one GPU
            local %= torch.cuda.device_count()
        self.device = f"cuda:{local}" if self.cuda else "cpu"
        if self.cuda:
            torch.cuda.set_device(local)
        # checkpoint-engine broadcasts over the default group (NCCL); our own barriers and
        # reductions of timings go over gloo, off the GPUs' streams.
        nccl = self.cuda and any(p.startswith("ce-") for p in a.paths)
        dist.init_process_group("nccl" if nccl else "gloo", timeout=timedelta(seconds=a.timeout),
                                device_id=torch.device(self.device) if nccl else None)
        self.coord = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.timeout))
        self.paths = [p for p in a.paths if (p.startswith("sluice") or self.cuda) and (p != "sluice-relay" or self.world > 1)]
        skipped = [p for p in a.paths if p not in self.paths]
        if [p for p in skipped if p.startswith("ce-")]:
            log(self.rank, f"skipped {', '.join(p for p in skipped if p.startswith('ce-'))}: checkpoint-engine needs "
                           f"CUDA GPUs, this run has none")
        if "sluice-relay" in skipped:
            log(self.rank, "skipped sluice-relay: it needs 2 ranks or more (with one it is the sluice path)")
        self.spec = synthetic_spec(int(a.size_gib * (1 << 30)), a.tensors)
        self.total = sum(torch.empty(0, dtype=d).element_size() * s[0] for _, d, s in self.spec)

    def barrier(self) -> None:
        self.dist.barrier(group=self.coord)

    def slowest(self, seconds: float) -> float:
        t = self.torch.tensor([seconds], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.coord)
        return float(t.item())

    def shard(self) -> Dict[str, Any]:
        torch = self.torch
        pool = make_pool("cpu")
        out = {}
        for i, (name, dt, shape) in enumerate(self.spec):
            if i % self.world == self.rank:
                t = torch.empty(shape, dtype=dt)
                fill(t, pool, i)
                out[name] = t
        return out

    def setup(self) -> None:
        torch, a = self.torch, self.a
        log(self.rank, f"model: {len(self.spec)} tensors, {self.total / (1 << 30):.2f} GiB; {self.world} ranks, "
                       f"paths {', '.join(self.paths)}")
        shard = self.shard()
        self.ps = None
        if any(p.startswith("ce-") for p in self.paths):
            if "ce-p2p" in self.paths:
                os.environ.setdefault("PS_P2P_STORE_RDMA_DEVICES",
                                      ",".join(f"sl{i}" for i in range(torch.cuda.device_count())))
                from sluice.compat import _hook
                _hook.install()  # checkpoint-engine's `from mooncake.engine import TransferEngine` gets Sluice's
            from checkpoint_engine.ps import ParameterServer, _get_physical_gpu_id

            self.ps = ParameterServer(auto_pg=False)
            if "ce-p2p" in self.paths and self.ps._p2p_store is None:
                raise SystemExit("vs_checkpoint_engine: checkpoint-engine made no P2P store (mooncake.engine did "
                                 "not import): ce-p2p cannot run")
            self.ps.register_checkpoint(NAME, named_tensors=shard)
            self.ps.gather_metas(NAME)
            self.uuid = _get_physical_gpu_id(self.ps.device_manager, torch.cuda.current_device())
            log(self.rank, "checkpoint-engine: checkpoint registered and metas gathered")
        else:
            self.uuid = ""
        import sluice
        from sluice.weights import WeightPublisher

        self.engine = sluice.Engine()
        self.pub = WeightPublisher(self.engine, NAME)
        self.shared = self.pub.share(shard)  # memfd host memory, mapped by receivers on this host
        self.pub.publish(1)
        del shard
        refs: List[Any] = [None] * self.world
        self.dist.all_gather_object(refs, self.engine.listen_address, group=self.coord)
        log(self.rank, "sluice.weights: shards shared and published")

        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.child = ctx.Process(target=inference, daemon=True,
                                 args=(child, self.rank, self.world, self.device, self.spec, refs, self.uuid,
                                       int(a.bucket_mib * (1 << 20)), a.depth, a.timeout,
                                       a.inject_corruption and self.rank == self.world - 1))
        self.child.start()
        mine = self.expect("starting the inference process", timeout=max(600.0, a.timeout))
        relays: List[Any] = [None] * self.world
        self.dist.all_gather_object(relays, mine, group=self.coord)
        self.conn.send(("relays", relays))
        self.barrier()
        log(self.rank, "inference processes ready (parameters and reference copies made)")
        n = int(min(a.ceiling_gib * (1 << 30), self.total))
        self.h2d_src = torch.ones(n, dtype=torch.uint8, pin_memory=self.cuda)
        self.h2d_dst = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.h2d_dst.copy_(self.h2d_src)

    def expect(self, what: str, timeout: float):
        if not self.conn.poll(timeout):
            raise SystemExit(f"vs_checkpoint_engine: rank {self.rank}: the inference process did not answer "
                             f"({what}) within {timeout:.0f} s")
        tag, arg = self.conn.recv()
        if tag not in ("ok", "ready"):
            raise SystemExit(f"vs_checkpoint_engine: rank {self.rank}: {arg}")
        return arg

    def ceiling(self, alone: bool) -> float:
        """Seconds per byte-count of one host-to-device (CPU: host) copy; ``alone``: rank 0
        only, the others wait."""
        torch = self.torch
        self.barrier()
        t = 0.0
        if not alone or self.rank == 0:
            t0 = time.perf_counter()
            self.h2d_dst.copy_(self.h2d_src, non_blocking=True)
            if self.cuda:
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
        return self.slowest(t)

    def run_path(self, path: str) -> float:
        self.conn.send(("zero", None))
        self.expect("zeroing", self.a.timeout)
        self.barrier()
        t0 = time.perf_counter()
        if path.startswith("sluice"):
            self.conn.send((path, None))
            moved = self.expect("sluice.weights update", self.a.timeout)
            if moved != self.total:
                raise SystemExit(f"vs_checkpoint_engine: rank {self.rank}: {path} moved {moved} bytes, not {self.total}")
        else:
            ranks = [] if path == "ce-broadcast" else list(range(self.world))
            self.ps.update(NAME, lambda paths: self.conn.send(("ce", paths)), ranks=ranks,
                           timeout=timedelta(seconds=self.a.timeout))
            self.expect(f"{path} update", self.a.timeout)
        dt = time.perf_counter() - t0
        self.conn.send(("check", None))
        bad = self.expect("checking the bytes", self.a.timeout)
        if bad:
            raise SystemExit(f"vs_checkpoint_engine: rank {self.rank}: {path} left WRONG BYTES in {len(bad)} "
                             f"tensors, e.g. {bad[:3]}")
        return self.slowest(dt)

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.child.join(60)
        if self.child.is_alive():
            self.child.kill()
        self.pub.close()
        self.engine.close()
        if self.ps is not None:
            self.ps.unregister_checkpoint(NAME)
        self.dist.destroy_process_group()


def stats(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def report(r: Rank, times: Dict[str, List[float]], a) -> int:
    gib = r.total / (1 << 30)
    gb = r.total / 1e9
    cb = r.h2d_src.numel() / 1e9
    what = "pinned H2D" if r.cuda else "host memcpy"
    rows = []
    for key in ("ceiling-all", "ceiling-one"):
        s = stats(times[key])
        label = f"{what}, every rank at once" if key == "ceiling-all" else f"{what}, rank 0 alone"
        rows.append((label, None, cb / s["median"], s, r.h2d_src.numel(), times[key][0]))
    for p in r.paths:
        s = stats(times[p])
        rows.append((p, s["median"], gb / s["median"], s, r.total, times[p][0]))
    base = statistics.median(times["ce-broadcast"]) if "ce-broadcast" in times else None
    ceil_bw = cb / statistics.median(times["ceiling-all"])
    print(f"\nvs_checkpoint_engine: {len(r.spec)} tensors, {gib:.2f} GiB into each of {r.world} "
          f"{'GPUs' if r.cuda else 'CPU processes'}; sluice buckets {a.bucket_mib:g} MiB x{a.depth}; "
          f"medians of {a.rounds} rounds (min..max; round 1 pays one-time set-up)")
    print(f"{'path':<34}{'seconds':>10}{'min..max':>18}{'round 1':>10}{'GB/s each':>12}{'/ ce-bcast':>12}"
          f"{'/ ceiling':>11}")
    out_rows = []
    for label, sec, bw, s, nbytes, first in rows:
        spread = f"{s['min']:.3f}..{s['max']:.3f}"
        rel = f"{sec / base:.2f}" if (sec is not None and base) else "-"
        frac = f"{bw / ceil_bw:.2f}"
        print(f"{label:<34}{s['median']:>10.3f}{spread:>18}{first:>10.3f}{bw:>12.2f}{rel:>12}{frac:>11}")
        out_rows.append({"path": label, "bytes": nbytes, "seconds_median": s["median"], "seconds_min": s["min"],
                         "seconds_max": s["max"], "seconds_round1": first, "gbps_per_gpu": bw,
                         "vs_ce_broadcast": (sec / base) if (sec is not None and base) else None,
                         "vs_ceiling": bw / ceil_bw})
    best = [p for p in ("sluice", "sluice-relay") if p in times]
    if best:
        p = min(best, key=lambda k: statistics.median(times[k]))
        sl = statistics.median(times[p])
        print(f"sluice.weights: best path {p}")
        if base:
            print(f"bar 1: sluice.weights / checkpoint-engine broadcast = {sl / base:.2f} (bar <= 0.75: "
                  f"{'met' if sl / base <= 0.75 else 'NOT met'})")
        print(f"bar 2: sluice.weights per-GPU ingest / {what} (every rank at once) = {gb / sl / ceil_bw:.2f} "
              f"(bar >= 0.8: {'met' if gb / sl / ceil_bw >= 0.8 else 'NOT met'})")
    print(f"check: every byte of {len(r.spec)} tensors right in every process after every path of every round")
    meta = {"tensors": len(r.spec), "bytes": r.total, "ranks": r.world, "cuda": r.cuda, "rounds": a.rounds,
            "bucket_mib": a.bucket_mib, "depth": a.depth, "times_s": times, "rows": out_rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(meta, f, indent=1)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
            w.writeheader()
            w.writerows(out_rows)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=20.0)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ", ".join(PATHS))
    ap.add_argument("--bucket-mib", type=float, default=64, help="sluice.weights' bucket (checkpoint-engine sizes its own)")
    ap.add_argument("--depth", type=int, default=2, help="sluice.weights' buckets in flight")
    ap.add_argument("--ceiling-gib", type=float, default=4.0, help="bytes of the pinned H2D copy (at most the model)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds any one step may take")
    ap.add_argument("--cpu", action="store_true", help="ignore GPUs: sluice only, into CPU parameters")
    ap.add_argument("--share-gpus", action="store_true",
                    help="allow more ranks than GPUs (sluice paths only; a functional check, not a measurement)")
    ap.add_argument("--inject-corruption", action="store_true",
                    help="testing the check: the last rank's inference process changes a byte after each sluice update")
    ap.add_argument("--json", default=None)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args(argv)
    a.paths = [p for p in a.paths.split(",") if p]
    unknown = [p for p in a.paths if p not in PATHS]
    if unknown or not a.paths:
        ap.error(f"--paths: unknown {unknown}; choose from {', '.join(PATHS)}")
    if min(a.size_gib, a.tensors, a.rounds, a.depth, a.bucket_mib, a.ceiling_gib, a.timeout) <= 0:
        ap.error("sizes, counts and times must be > 0")
    if "RANK" not in os.environ:
        ap.error("run it under torchrun (one rank per GPU): torchrun --nproc-per-node N " + sys.argv[0])
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    r = Rank(a)
    r.setup()
    times: Dict[str, List[float]] = {k: [] for k in ["ceiling-all", "ceiling-one", *r.paths]}
    for rnd in range(a.rounds):
        order = r.paths[rnd % len(r.paths):] + r.paths[:rnd % len(r.paths)]
        times["ceiling-all"].append(r.ceiling(alone=False))
        times["ceiling-one"].append(r.ceiling(alone=True))
        for p in order:
            times[p].append(r.run_path(p))
            log(r.rank, f"round {rnd + 1}/{a.rounds}: {p} {times[p][-1]:.3f} s (bytes checked)")
    rc = report(r, times, a) if r.rank == 0 else 0
    r.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
