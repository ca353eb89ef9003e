"""sluice.ag_gemm without a GPU: the chunk plan, checked exhaustively, and the whole pipeline run
on CPU tensors with a fake AllGather, against torch.cat + matmul, bit for bit. The GPU runs are
examples/python/all_gather_gemm_overlap.py and tools/sluice-gpu-bench/ag_gemm_bench.py."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_path = os.path.join(os.path.dirname(__file__), "..", "sluice", "ag_gemm.py")
_spec = importlib.util.spec_from_file_location("sluice_ag_gemm_test", _path)
agg = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agg  # dataclasses look their module up there
_spec.loader.exec_module(agg)


# ---------------------------------------------------------------- the plan, no torch needed

@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("local_first", [True, False])
def test_plan_covers_every_output_row_once(world, local_first):
    """For every rank, m, chunks and slots: the chunks tile [0, m) in order, sizes differ by at
    most one, slots rotate, a slot is waited for exactly when reused, and the GEMM pieces plus
    the local GEMM (local_first) write every row of Y exactly once."""
    for rank in range(world):
        for m in range(1, 14):
            for chunks in range(1, m + 1):
                for slots in (1, 2, 3):
                    p = agg.plan(m, chunks, world, rank, slots, local_first)
                    assert len(p) == chunks
                    assert p[0].row_lo == 0 and p[-1].row_hi == m
                    sizes = [c.rows for c in p]
                    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
                    assert max(sizes) == agg.chunk_rows(m, chunks)
                    assert sizes == sorted(sizes, reverse=True)  # the longer ones first
                    written = [0] * (world * m)
                    if local_first:
                        for i in range(rank * m, (rank + 1) * m):
                            written[i] += 1
                    for i, c in enumerate(p):
                        assert c.index == i and c.slot == i % slots and c.wait_slot_free == (i >= slots)
                        if i:
                            assert c.row_lo == p[i - 1].row_hi
                        for piece in c.pieces:
                            assert 0 <= piece.rank_lo < piece.rank_hi <= world
                            for r in range(piece.rank_lo, piece.rank_hi):
                                lo, hi = c.out_rows(r, m)
                                assert (lo, hi) == (r * m + c.row_lo, r * m + c.row_hi)
                                for j in range(lo, hi):
                                    written[j] += 1
                        assert len(c.pieces) <= 2
                    assert written == [1] * (world * m), (world, rank, m, chunks, slots, local_first)


def test_plan_examples():
    assert agg.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert agg.chunk_bounds(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # no empty chunk
    assert agg.chunk_bounds(8192, 8) == [(i * 1024, (i + 1) * 1024) for i in range(8)]
    p = agg.plan(8, 4, world=4, rank=2, slots=2)
    assert [c.pieces for c in p] == [(agg.GemmPiece(0, 2), agg.GemmPiece(3, 4))] * 4
    assert agg.plan(8, 4, world=4, rank=0)[0].pieces == (agg.GemmPiece(1, 4),)
    assert agg.plan(8, 4, world=4, rank=3)[0].pieces == (agg.GemmPiece(0, 3),)
    assert agg.plan(8, 2, world=1, rank=0)[0].pieces == ()  # alone: the local GEMM is all of Y
    assert agg.plan(8, 2, world=3, rank=1, local_first=False)[1].pieces == (agg.GemmPiece(0, 3),)


@pytest.mark.parametrize("args,msg", [
    ((3, 4, 2, 0), r"chunks \(4\) > rows of the shard \(3\)"),
    ((0, 1, 2, 0), "at least one row"),
    ((4, 0, 2, 0), "chunks must be >= 1"),
    ((4, 2, 2, 2), "rank 2 is not in a world of 2"),
    ((4, 2, 0, 0), "not in a world of 0"),
    ((4, 2, 2, -1), "rank -1"),
])
def test_plan_refuses_clearly(args, msg):
    with pytest.raises(ValueError, match=msg):
        agg.plan(*args)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        agg.plan(4, 2, 2, 0, slots=0)
    with pytest.raises(TypeError):
        agg.plan(4.0, 2, 2, 0)


# ---------------------------------------------------------------- the pipeline on CPU tensors

try:  # the plan tests above run without torch; these need it
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class FakeAllGather:
    """Rank `rank` of a world whose shards are all in `shards` (one process): all_gather of a
    row range of this rank's shard writes the same row range of every shard, rank-major, as a
    real AllGather would. It finds the row range from the view's offset into the shard, so a
    pipeline that gathered the wrong rows, or a copy instead of a view, is caught. Also checks
    what the real objects require: contiguous input and output of world times the input."""

    def __init__(self, shards, rank, swap_ranks=False):
        self.shards, self.rank, self.world_size = shards, rank, len(shards)
        self.device = shards[0].device
        self.calls = []
        self.swap_ranks = swap_ranks  # a broken AllGather, to show the check can fail

    def all_gather(self, tensor, out=None, stream=None):
        mine = self.shards[self.rank]
        assert tensor.is_contiguous() and out.is_contiguous()
        assert out.numel() == self.world_size * tensor.numel()
        assert stream is None  # CPU: no stream
        elt = mine.element_size()
        off = tensor.data_ptr() - mine.data_ptr()
        assert off % (mine.stride(0) * elt) == 0 and tensor.shape[1:] == mine.shape[1:]
        lo = off // (mine.stride(0) * elt)
        hi = lo + tensor.shape[0]
        assert 0 <= lo < hi <= mine.shape[0]
        order = list(range(self.world_size))
        if self.swap_ranks and self.world_size > 1:
            order[0], order[1] = order[1], order[0]
        out.view(self.world_size, hi - lo, -1).copy_(torch.stack([self.shards[r][lo:hi] for r in order]))
        self.calls.append((lo, hi))
        return out


def _shards(world, m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Small integers: every product and sum is exact in bf16, fp16 and fp32, so the pipeline's
    # pieces must equal the one big matmul bit for bit whatever order the CPU kernels add in.
    return [torch.randint(-2, 3, (m, k), generator=g).to(dtype) for _ in range(world)]


def _weight(k, n, dtype, seed):
    return torch.randint(-2, 3, (k, n), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


@needs_torch
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("out_mode", ["direct", "copy"])
@pytest.mark.parametrize("local_first", [True, False])
@pytest.mark.parametrize("world,m,chunks,slots", [
    (1, 4, 2, 2), (2, 8, 4, 2), (3, 7, 3, 2), (4, 10, 4, 2), (5, 5, 5, 1), (8, 9, 4, 3), (2, 1, 1, 2),
])
def test_pipeline_equals_cat_then_matmul(dtype_name, out_mode, local_first, world, m, chunks, slots):
    dtype = getattr(torch, DTYPES[dtype_name])
    k, n = 16, 12
    shards = _shards(world, m, k, dtype, seed=world * 100 + m)
    w = _weight(k, n, dtype, seed=m)
    ref = agg.reference(shards, w)
    for rank in range(world):
        fake = FakeAllGather(shards, rank)
        p = agg.AllGatherMatmul(fake, max_rows=m, k=k, n=n, dtype=dtype, chunks=chunks, slots=slots,
                                local_first=local_first, out_mode=out_mode)
        out = torch.full((world * m, n), 777, dtype=dtype)  # no row may be left as it was
        y = p(shards[rank], w, out=out)
        assert y is out
        assert torch.equal(y, ref), (rank, (y != ref).nonzero()[:5])
        assert fake.calls == agg.chunk_bounds(m, chunks)  # in chunk order, one call each
        fake.calls.clear()
        assert torch.equal(p(shards[rank], w), ref)  # again, allocating the output; slots reused


@needs_torch
def test_smaller_shard_than_max_rows_and_repeated_calls():
    """One object, calls with m from 3 to max_rows: the plan and the slot views follow m."""
    world, k, n, dtype = 3, 8, 4, torch.bfloat16
    w = _weight(k, n, dtype, seed=5)
    p = None
    for m in (12, 3, 7, 12, 5):
        shards = _shards(world, m, k, dtype, seed=m)
        fake = FakeAllGather(shards, 1)
        if p is None:
            p = agg.AllGatherMatmul(fake, max_rows=12, k=k, n=n, dtype=dtype, chunks=3)
        p.ag = fake
        assert torch.equal(p(shards[1], w), agg.reference(shards, w)), m


@needs_torch
def test_a_broken_allgather_is_caught():
    """The comparison is sensitive: an AllGather that swaps ranks 0 and 1 makes it fail (with
    local_first off, so every row goes through the gathered data)."""
    shards = _shards(3, 6, 8, torch.float32, seed=1)
    w = _weight(8, 4, torch.float32, seed=1)
    p = agg.AllGatherMatmul(FakeAllGather(shards, 2, swap_ranks=True), max_rows=6, k=8, n=4,
                            dtype=torch.float32, chunks=2, local_first=False)
    assert not torch.equal(p(shards[2], w), agg.reference(shards, w))


@needs_torch
def test_bad_arguments_are_refused():
    shards = _shards(2, 4, 8, torch.bfloat16, seed=2)
    w = _weight(8, 4, torch.bfloat16, seed=2)
    p = agg.AllGatherMatmul(FakeAllGather(shards, 0), max_rows=4, k=8, n=4, dtype=torch.bfloat16, chunks=2)
    with pytest.raises(ValueError, match="max_rows"):
        p(torch.zeros(6, 8, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"chunks \(2\) > rows"):
        p(shards[0][:1], w)
    with pytest.raises(ValueError, match="x_shard must be"):
        p(torch.zeros(4, 7, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="w must be"):
        p(shards[0], w.t())
    with pytest.raises(ValueError, match="must be torch.bfloat16"):
        p(shards[0].half(), w)
    with pytest.raises(ValueError, match="contiguous"):
        p(torch.zeros(8, 4, dtype=torch.bfloat16).t(), w)
    with pytest.raises(ValueError, match="out must be"):
        p(shards[0], w, out=torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_mode"):
        agg.AllGatherMatmul(FakeAllGather(shards, 0), max_rows=4, k=8, n=4, out_mode="fused")
    with pytest.raises(ValueError, match=r"chunks \(8\) > rows"):
        agg.AllGatherMatmul(FakeAllGather(shards, 0), max_rows=4, k=8, n=4, chunks=8)
    small = FakeAllGather(shards, 0)
    small.max_bytes = 2 * 8 * 2 - 1  # one byte short of a chunk of 2 rows of 8 bf16
    with pytest.raises(ValueError, match="at most 31 bytes per rank, a chunk has 32"):
        agg.AllGatherMatmul(small, max_rows=4, k=8, n=4, dtype=torch.bfloat16, chunks=2)
    small.max_bytes = 32
    agg.AllGatherMatmul(small, max_rows=4, k=8, n=4, dtype=torch.bfloat16, chunks=2)


@needs_torch
@pytest.mark.parametrize("script", ["examples/python/all_gather_gemm_overlap.py",
                                    "tools/sluice-gpu-bench/ag_gemm_bench.py"])
def test_gpu_scripts_skip_clearly_without_gpus(script):
    """The example and the benchmark exit 0 with a message saying why when there is no GPU."""
    import subprocess
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the scripts run for real (scripts/gpu-matrix.sh aggemm)")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    r = subprocess.run([sys.executable, os.path.join(root, script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stdout and "GPU" in r.stdout, r.stdout


# ---------------------------------------------------------------- the stream ordering, simulated

class Sim:
    """What a GPU enforces between streams, as a graph: an op depends on the previous op of its
    stream and, for a wait, on the op that recorded the event last at the time of the wait
    (CUDA's semantics for cudaStreamWaitEvent). hb(a, b): a happens before b."""

    def __init__(self):
        self.ops = []  # (stream name, kind, tag)
        self.anc = []  # every op's ancestors

    def op(self, stream, kind, tag=None, deps=()):
        d = set(deps)
        if stream.last is not None:
            d.add(stream.last)
        anc = set(d)
        for i in d:
            anc |= self.anc[i]
        self.ops.append((stream.name, kind, tag))
        self.anc.append(anc)
        stream.last = len(self.ops) - 1
        return stream.last

    def hb(self, a, b):
        return a in self.anc[b]

    def find(self, kind, pred=lambda tag: True):
        return [i for i, (_, k, t) in enumerate(self.ops) if k == kind and pred(t)]


class SimStream:
    def __init__(self, sim, name):
        self.sim, self.name, self.last = sim, name, None

    def wait_event(self, ev):
        self.sim.op(self, "wait", deps=[] if ev.marker is None else [ev.marker])

    def wait_stream(self, other):
        ev = SimEvent(self.sim)
        ev.record(other)
        self.wait_event(ev)


class SimEvent:
    def __init__(self, sim):
        self.sim, self.marker = sim, None

    def record(self, stream=None):
        assert stream is not None  # the pipeline names the stream of every record
        self.marker = self.sim.op(stream, "record")


def _sim_pipeline(sim, cur, fake, **kw):
    """An AllGatherMatmul whose streams and events are the simulation's, logging its GEMMs."""

    class SimPipeline(agg.AllGatherMatmul):
        call = 0

        def _make_stream(self):
            return SimStream(sim, "comm")

        def _make_event(self):
            return SimEvent(sim)

        def _current_stream(self):
            return cur

        def _ag_stream(self, comm):
            return comm

        def _local_gemm(self, x, w, y3):
            sim.op(cur, "local", self.call)
            super()._local_gemm(x, w, y3)

        def _gemm(self, g3, w, y3, ch):
            slot = [s.data_ptr() for s in self._gather].index(g3.data_ptr())
            sim.op(cur, "gemm", (self.call, ch.row_lo, slot))
            super()._gemm(g3, w, y3, ch)

    return SimPipeline(fake, **kw)


class SimAllGather(FakeAllGather):
    """The fake AllGather, logging each call as an op on the stream it is given."""

    def __init__(self, shards, rank, sim, pipe_ref):
        super().__init__(shards, rank)
        self.sim, self.pipe_ref = sim, pipe_ref

    def all_gather(self, tensor, out=None, stream=None):
        assert isinstance(stream, SimStream) and stream.name == "comm"
        p = self.pipe_ref[0]
        slot = [s.data_ptr() for s in p._gather].index(out.data_ptr())
        lo = (tensor.data_ptr() - self.shards[self.rank].data_ptr()) // (self.shards[self.rank].stride(0) *
                                                                          tensor.element_size())
        self.sim.op(stream, "ag", (p.call, lo, slot))
        return super().all_gather(tensor, out=out, stream=None)


@needs_torch
@pytest.mark.parametrize("local_first", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_stream_ordering_a_gpu_would_enforce(chunks, slots, local_first):
    """Over three back-to-back calls, with the caller writing x before and reading Y after each:
    every AllGather starts after the caller's x is written (fork); every chunk GEMM after its
    chunk's AllGather; no AllGather overwrites a slot before every earlier GEMM reading it is
    done (within a call and across calls); the caller's read of Y comes after all of the call's
    work (join). And the overlap is really possible: the local GEMM does not precede the first
    AllGather, and with two slots or more a chunk's AllGather does not wait for the previous
    chunk's GEMM."""
    world, m, k, n, dtype = 3, 10, 8, 4, torch.float32
    shards = _shards(world, m, k, dtype, seed=3)
    w = _weight(k, n, dtype, seed=3)
    sim = Sim()
    cur = SimStream(sim, "compute")
    ref = []
    fake = SimAllGather(shards, 1, sim, ref)
    p = _sim_pipeline(sim, cur, fake, max_rows=m, k=k, n=n, dtype=dtype, chunks=chunks, slots=slots,
                      local_first=local_first)
    ref.append(p)
    calls = 3
    for call in range(calls):
        p.call = call
        sim.op(cur, "caller_writes_x", call)
        assert torch.equal(p(shards[1], w), agg.reference(shards, w))
        sim.op(cur, "caller_reads_y", call)

    bounds = agg.chunk_bounds(m, chunks)
    for call in range(calls):
        x_written = sim.find("caller_writes_x", lambda t: t == call)[0]
        y_read = sim.find("caller_reads_y", lambda t: t == call)[0]
        ags = [sim.find("ag", lambda t: t[:2] == (call, lo))[0] for lo, _ in bounds]
        gemms = [sim.find("gemm", lambda t: t[:2] == (call, lo))[0] for lo, _ in bounds]
        for a in ags:
            assert sim.hb(x_written, a), "an AllGather may read x before the caller wrote it"
        for a, g in zip(ags, gemms):
            assert sim.hb(a, g), "a GEMM may read its slot before the AllGather filled it"
        for op in ags + gemms + sim.find("local", lambda t: t == call):
            assert sim.hb(op, y_read), "the caller may read Y before the call's work is done"
        comm_before = [i for i, (st, _, _) in enumerate(sim.ops) if st == "comm" and i < y_read]
        assert sim.hb(comm_before[-1], y_read), "the communication stream is not joined"
        if local_first:
            local = sim.find("local", lambda t: t == call)[0]
            assert not sim.hb(local, ags[0]), "the local GEMM would delay the first AllGather"
        if slots >= 2:
            for c in range(1, chunks):
                assert not sim.hb(gemms[c - 1], ags[c]), "chunk c's AllGather waits for chunk c-1's GEMM"
    # Write-after-read on the slots, across calls too: host order is the order of reuse.
    ags = sim.find("ag")
    for a in ags:
        slot = sim.ops[a][2][2]
        for g in sim.find("gemm", lambda t: t[2] == slot):
            if g < a:
                assert sim.hb(g, a), f"slot {slot} may be overwritten while a GEMM reads it"
