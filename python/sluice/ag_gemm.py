"""AllGather–GEMM overlap: Y = AllGather(X_shard) @ W, the GEMM starting on the rows that have
arrived while later rows are still in flight (issue 14).

    from sluice.cuda_allgather import AllGather
    from sluice.ag_gemm import AllGatherMatmul, chunk_rows
    ag = AllGather(max_tokens=chunk_rows(m_max, 4), hidden=k, dtype=torch.bfloat16)
    agmm = AllGatherMatmul(ag, max_rows=m_max, k=k, n=n, dtype=torch.bfloat16, chunks=4)
    y = agmm(x_shard, w)              # [world * m, n] == all_gather_into_tensor(x_shard) @ w
    agmm(x_shard, w, out=y)           # no allocation at all; capturable in torch.cuda.graph

The AllGather can be any object with `all_gather(tensor, out, stream)` that writes the
rank-major concatenation (the NVLink AllGather of cuda_allgather.py, the hierarchical one of
hier_allgather.py for several nodes); it must be sized for one chunk (`chunk_rows` rows of k).

How a call runs. X_shard [m, k] is cut into `chunks` row-chunks (`plan()`; sizes differ by at
most one row, the first m % chunks chunks being the longer ones; chunks > m is refused).
Chunk c is gathered on a communication stream into slot c % slots of a ring of preallocated
gather buffers ([world, rows_c, k], rank-major); an event marks it; the compute
stream (the caller's current stream) waits on that event and multiplies the chunk: the rows of
rank r land in Y rows r*m + chunk_start .. (Y viewed as [world, m, n]). So chunk c+1 is on the
wire while chunk c is multiplied. Before slot s is gathered into again, the communication stream
waits for the event recorded after the GEMM that read it. All AllGather calls are on the one
communication stream, in chunk order: the AllGather objects number their calls (epochs) and
need every rank's calls stream-ordered and in the same sequence.

With `local_first` (default) this rank's own rows need no communication: they are multiplied
first, straight from X_shard, while chunk 0 is in flight; the chunk GEMMs then skip this rank's
rows (up to two batched GEMMs per chunk, the ranks before and after this one).

Where a chunk's result goes (`out_mode`):
  "direct": torch.bmm(gathered[r0:r1], W expanded to a batch, out=Y3[r0:r1, rows]). That
            output view has strides (m*n, n, 1): a valid strided-batched cuBLAS output (ldc = n,
            batch stride m*n), and W expanded has batch stride 0, which torch's bmm passes to
            cuBLAS as is (read in torch's source, not yet seen on a GPU), so no copy is
            expected; the benchmark reports the allocator's peak during a call, which a hidden
            copy would raise.
  "copy":   per rank range, one torch.mm of its rows of the chunk (a [ranks * rows_c, k] view
            of the slot) into a contiguous scratch, then copy_ into the strided view: a plain
            GEMM with more rows, plus a device copy of the chunk's output. Kept as the fallback
            and for comparison.

CUDA graphs: the communication stream is forked from the current stream (it waits on an event
recorded there) and joined back at the end, the capturable fork-join pattern; nothing is
allocated in a call when `out` is given. On CPU tensors there are no streams or events and the
same code runs in order (the tests drive it with a fake AllGather on CPU).

Not yet run on a GPU (see docs/gpu.md, "AllGather–GEMM overlap"). The AllGather kernels wait on
their peers and compete with the GEMM for SMs, so how much of the AllGather hides behind the
GEMM has to be measured (tools/sluice-gpu-bench/ag_gemm_bench.py).

This module needs neither the sluice binding nor the rest of the package (the benchmark and
the example load it by path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

__all__ = ["AllGatherMatmul", "ChunkPlan", "GemmPiece", "chunk_bounds", "chunk_rows", "plan", "reference"]

OUT_MODES = ("direct", "copy")


@dataclass(frozen=True)
class GemmPiece:
    """One GEMM of a chunk: ranks [rank_lo, rank_hi) of the gathered chunk, batched."""

    rank_lo: int
    rank_hi: int


@dataclass(frozen=True)
class ChunkPlan:
    """One row-chunk: rows [row_lo, row_hi) of every rank's shard, gathered into `slot`.

    `wait_slot_free` says whether the communication stream must first wait for the GEMMs of the
    chunk that used the slot before (chunk index - slots); `pieces` are the GEMMs to run on it.
    Output rows of rank r: r * m + row_lo .. r * m + row_hi (out_rows gives them)."""

    index: int
    row_lo: int
    row_hi: int
    slot: int
    wait_slot_free: bool
    pieces: Tuple[GemmPiece, ...]

    @property
    def rows(self) -> int:
        return self.row_hi - self.row_lo

    def out_rows(self, rank: int, m: int) -> Tuple[int, int]:
        """Rows of Y [world * m, n] that rank `rank`'s part of this chunk produces."""
        return rank * m + self.row_lo, rank * m + self.row_hi


def chunk_rows(m: int, chunks: int) -> int:
    """Rows of the largest chunk: ceil(m / chunks). Size the AllGather (and its slots) for this."""
    _check_counts(m, chunks)
    return -(-m // chunks)


def _check_counts(m: int, chunks: int) -> None:
    if not isinstance(m, int) or not isinstance(chunks, int):
        raise TypeError("rows and chunks must be ints")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if m < 1:
        raise ValueError(f"the shard must have at least one row, got {m}")
    if chunks > m:
        raise ValueError(f"chunks ({chunks}) > rows of the shard ({m}): every chunk needs a row; "
                         "use fewer chunks")


def _pieces(world: int, rank: int, local_first: bool) -> Tuple[GemmPiece, ...]:
    """The ranks a chunk GEMM covers: all of them, or all but `rank` (at most two ranges)."""
    if not local_first:
        return (GemmPiece(0, world),)
    out = []
    if rank > 0:
        out.append(GemmPiece(0, rank))
    if rank + 1 < world:
        out.append(GemmPiece(rank + 1, world))
    return tuple(out)


def chunk_bounds(m: int, chunks: int) -> List[Tuple[int, int]]:
    """Row ranges of the chunks: as equal as can be, the first m % chunks one row longer, so no
    chunk is empty whatever m <= max_rows a call brings (rows [c*mc, (c+1)*mc) with a shorter
    last chunk would leave chunks empty for m=5, chunks=4)."""
    _check_counts(m, chunks)
    base, extra = divmod(m, chunks)
    out, lo = [], 0
    for c in range(chunks):
        hi = lo + base + (1 if c < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def plan(m: int, chunks: int, world: int, rank: int = 0, slots: int = 2,
         local_first: bool = True) -> List[ChunkPlan]:
    """The pipeline for a shard of m rows: `chunks` chunks (chunk_bounds), chunk c gathered into
    slot c % slots, which it may only overwrite after the GEMMs of chunk c - slots."""
    _check_counts(m, chunks)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    pieces = _pieces(world, rank, local_first)
    return [ChunkPlan(index=c, row_lo=lo, row_hi=hi, slot=c % slots, wait_slot_free=c >= slots, pieces=pieces)
            for c, (lo, hi) in enumerate(chunk_bounds(m, chunks))]


def reference(shards, w):
    """torch.cat(shards) @ w: what every rank's Y must equal (the tests' and docs' definition)."""
    import torch
    return torch.matmul(torch.cat(list(shards), dim=0), w)


class _NoStream:
    """Stands in for a stream and an event on CPU, where everything runs in order."""

    cuda_stream = 0

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class AllGatherMatmul:
    """Y = AllGather(x_shard) @ w with the GEMM overlapping the AllGather; see the module doc.

    Everything (gather slots, scratch, streams, events) is allocated here, for shards of up to
    `max_rows` rows of `k` and a W of [k, n]; a call with `out` allocates nothing."""

    def __init__(self, allgather: Any, max_rows: int, k: int, n: int, dtype=None, chunks: int = 4,
                 slots: int = 2, local_first: bool = True, out_mode: str = "direct", device=None,
                 world_size: Optional[int] = None, rank: Optional[int] = None):
        import torch

        if out_mode not in OUT_MODES:
            raise ValueError(f"out_mode must be one of {OUT_MODES}, got {out_mode!r}")
        self.ag = allgather
        self.world = int(world_size if world_size is not None else allgather.world_size)
        self.rank = int(rank if rank is not None else allgather.rank)
        self.max_rows, self.k, self.n = int(max_rows), int(k), int(n)
        self.chunks, self.slots = int(chunks), int(slots)
        self.local_first, self.out_mode = bool(local_first), out_mode
        self.dtype = dtype or torch.bfloat16
        if device is None:
            device = getattr(allgather, "device", None) or torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mc = chunk_rows(self.max_rows, self.chunks)
        plan(self.max_rows, self.chunks, self.world, self.rank, self.slots, self.local_first)  # validates
        need = self.mc * self.k * torch.empty((), dtype=self.dtype).element_size()
        have = getattr(allgather, "max_bytes", None)  # AllGather and HierAllGather say it
        if have is not None and have < need:
            raise ValueError(f"the AllGather takes at most {have} bytes per rank, a chunk has {need} "
                             f"({self.mc} rows of {self.k}): build it for chunk_rows(max_rows, chunks) rows")
        self.slots = min(self.slots, self.chunks)  # more slots than chunks would never be used
        self._plans = {}
        mk = dict(dtype=self.dtype, device=self.device)
        self._gather = [torch.empty(self.world * self.mc * self.k, **mk) for _ in range(self.slots)]
        self._scratch = (torch.empty(self.world * self.mc * self.n, **mk) if out_mode == "copy" else None)
        self._cuda = self.device.type == "cuda"
        self._comm = self._make_stream()
        self._gathered = [self._make_event() for _ in range(self.slots)]
        self._consumed = [self._make_event() for _ in range(self.slots)]

    # Streams and events: CUDA's, or no-ops on CPU. Methods, so that a test can put recording
    # fakes in and check the ordering a GPU would enforce (python/tests/test_ag_gemm.py).
    def _make_stream(self):
        import torch
        return torch.cuda.Stream(device=self.device) if self._cuda else _NoStream()

    def _make_event(self):
        import torch
        return torch.cuda.Event() if self._cuda else _NoStream()

    def _current_stream(self):
        import torch
        return torch.cuda.current_stream(self.device) if self._cuda else _NoStream()

    def _ag_stream(self, comm):
        """The `stream` argument of the AllGather calls (None on CPU)."""
        return comm if self._cuda else None

    def plan(self, m: int) -> List[ChunkPlan]:
        """This object's plan for a shard of m rows (cached per m)."""
        p = self._plans.get(m)
        if p is None:
            if m > self.max_rows:
                raise ValueError(f"shard of {m} rows > max_rows {self.max_rows}")
            p = plan(m, self.chunks, self.world, self.rank, self.slots, self.local_first)
            self._plans[m] = p
        return p

    def _check(self, x, w, out):
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x_shard must be [m, {self.k}], got {tuple(x.shape)}")
        if tuple(w.shape) != (self.k, self.n):
            raise ValueError(f"w must be [{self.k}, {self.n}], got {tuple(w.shape)}")
        if x.dtype != self.dtype or w.dtype != self.dtype:
            raise ValueError(f"x_shard and w must be {self.dtype}, got {x.dtype} and {w.dtype}")
        if x.device != self.device or w.device != self.device:
            raise ValueError(f"x_shard and w must be on {self.device}")
        if not x.is_contiguous():  # the AllGather would copy it (an allocation, each call)
            raise ValueError("x_shard must be contiguous")
        if out is not None:
            want = (self.world * x.shape[0], self.n)
            if tuple(out.shape) != want or not out.is_contiguous() or out.dtype != self.dtype \
                    or out.device != self.device:
                raise ValueError(f"out must be a contiguous {self.dtype} tensor of shape {want} on {self.device}")

    def __call__(self, x_shard, w, out=None):
        """Y [world * m, n] = AllGather(x_shard) @ w, on the current stream (see the module doc)."""
        import torch

        self._check(x_shard, w, out)
        m = x_shard.shape[0]
        chunks = self.plan(m)
        if out is None:
            out = torch.empty((self.world * m, self.n), dtype=self.dtype, device=self.device)
        y3 = out.view(self.world, m, self.n)
        cur = self._current_stream()
        comm = self._comm
        comm.wait_stream(cur)  # fork: x_shard, w and out are ready; earlier calls' GEMMs are done
        if self.local_first:  # needs nothing from the network: runs while chunk 0 is in flight
            self._local_gemm(x_shard, w, y3)
        for ch in chunks:
            g = self._gather[ch.slot][: self.world * ch.rows * self.k]
            if ch.wait_slot_free:
                comm.wait_event(self._consumed[ch.slot])
            self.ag.all_gather(x_shard[ch.row_lo:ch.row_hi], out=g, stream=self._ag_stream(comm))
            self._gathered[ch.slot].record(comm)
            cur.wait_event(self._gathered[ch.slot])
            self._gemm(g.view(self.world, ch.rows, self.k), w, y3, ch)
            self._consumed[ch.slot].record(cur)
        cur.wait_stream(comm)  # join (the wait on the last chunk already joins; explicit for captures)
        return out

    def _local_gemm(self, x_shard, w, y3) -> None:
        """This rank's own rows, straight from its shard, on the current stream."""
        import torch
        torch.mm(x_shard, w, out=y3[self.rank])

    def _gemm(self, g3, w, y3, ch: ChunkPlan) -> None:
        """The chunk's GEMMs, on the current stream, into Y's rows of this chunk."""
        import torch
        for p in ch.pieces:
            a = g3[p.rank_lo:p.rank_hi]
            dst = y3[p.rank_lo:p.rank_hi, ch.row_lo:ch.row_hi]
            if self.out_mode == "direct":
                torch.bmm(a, w.expand(p.rank_hi - p.rank_lo, self.k, self.n), out=dst)
            else:
                rows = (p.rank_hi - p.rank_lo) * ch.rows
                tmp = self._scratch[: rows * self.n].view(rows, self.n)
                torch.mm(a.reshape(rows, self.k), w, out=tmp)
                dst.copy_(tmp.view(p.rank_hi - p.rank_lo, ch.rows, self.n))

    def check(self) -> None:
        """The AllGather's own failure check (HierAllGather has one), after a synchronize."""
        chk = getattr(self.ag, "check", None)
        if chk is not None:
            chk()
