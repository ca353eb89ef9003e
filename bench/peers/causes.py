"""Measured causes of the cells Sluice loses or whose ceiling bar it misses (issue 16: "a loss
that remains is named in the doc with the reason measured").

Each entry names the cells it covers and says in one line what was measured about them; its
`anchor` is a section of docs/peers.md (an `<a id=...>` there) with the numbers and how they
were taken. The report puts the line beside every lost or missed cell an entry covers, and
"not explained" beside the others, so that a new loss cannot hide behind an old explanation.
An entry is a claim about this host's runs, not a waiver: when the engine changes what it
measured, the entry goes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    anchor: str  # docs/peers.md#<anchor>
    text: str  # one line: what was measured
    kind: str  # "loss" (against a peer) or "miss" (against a ceiling bar)
    sections: tuple[str, ...]
    ops: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]  # (batch, concurrency)
    min_size: int = 0
    max_size: int = 1 << 62
    engines: tuple[str, ...] = ()  # substrings of the Sluice engine's name; empty: any

    def covers(self, kind: str, d: dict) -> bool:
        return (kind == self.kind and d["section"] in self.sections and d["op"] in self.ops
                and (d["batch"], d["conc"]) in self.shapes and self.min_size <= d["size"] <= self.max_size
                and (not self.engines or any(e in d["sluice"] for e in self.engines)))


LONE = ((1, 1),)
MiB = 1 << 20

CAUSES: tuple[Cause, ...] = (
    Cause("cause-lone-small", "lone small operations on this 2-vCPU host run in one of two modes set by where the "
          "scheduler puts the threads (the same library: 366 or 2,010 MB/s for a lone 64 KiB tcp read); the cell "
          "flips between runs of the same code", "loss", ("tcp",), ("read", "write", "send"), LONE,
          max_size=64 << 10),
    Cause("cause-lone-small-shm", "lone 4 KiB shm operations run in one of two modes on this host (lone 4 KiB "
          "SENDs: 2,100-2,700 or 490-630 MB/s, in two libraries alike); the cell flips between runs",
          "loss", ("shm",), ("read", "write", "send"), LONE, max_size=4 << 10),
    Cause("eager-ring-lone-64k", "a near tie: over 100,000 lone 64 KiB SENDs (C++ adapter, right after the run), "
          "Sluice 8.3-8.5 us each over memfd and CMA alike (an eager SEND: two streaming copies through the "
          "receiver's ring, 0.5 context switches a message), vader 7.6-8.4 us (it polls: 0.03)", "loss", ("shm",),
          ("send",), LONE, min_size=64 << 10, max_size=64 << 10),
    Cause("rdma-64k-batch-spread", "inside the emulated guest; 5 interleaved rounds right after the run: Sluice "
          "78.8 MB/s (77.5-82.2), Mooncake 73.5 (52.4-75.8), perftest 78.8; the run's 3 rounds had one of Sluice's "
          "at 56.1", "loss", ("rdma",), ("read",), ((16, 4),), min_size=64 << 10, max_size=64 << 10),
    Cause("cause-vader-polls", "Open MPI's two processes poll (1.9 of the 2 vCPUs busy over 20,000 lone 1 MiB "
          "SENDs, 73 us each); Sluice's threads sleep between the SEND_RTS, the copy and the SEND_ACK (89-120 us, "
          "1.1-1.3 vCPUs); polling waiters (SLUICE_BUSY_WAIT_US) made the CMA SEND slower, not faster",
          "loss", ("shm",), ("send",), LONE, min_size=64 << 10),
    Cause("cause-lone-shm-read-64k", "over 100,000 lone 64 KiB READs (C++ adapter) memfd moves 15,165-15,392 MB/s "
          "against vader's 8,912-9,766 (1.55-1.70x), CMA 7,671-8,412 (7.81 against 7.66 us a READ); the cell's "
          "1,000 READs are the C++ adapter's first pass over a fresh mapping and, for the Python adapter, 1,000 "
          "Python calls",
          "loss", ("shm",), ("read",), LONE, min_size=64 << 10, max_size=64 << 10),
    Cause("cause-lone-shm-loss", "vader's processes poll; a lone Sluice op whose second lane a copy-pool thread "
          "took pays that thread's wake-up and then the waiter's (15-20 us of a 70-75 us copy of 1 MiB here; "
          "shm.take_back saves them only when the submitting thread gets there first)", "loss", ("shm",),
          ("read", "write"), LONE, min_size=MiB, max_size=MiB),
    Cause("cause-tcp-64k-batch", "varies between runs of the same code: Sluice's medians 1,956-3,587 MB/s, "
          "Mooncake's 1,378-2,321 (2026-11-28 10:44 against 2026-11-29 05:41); not profiled further",
          "loss", ("tcp",), ("read", "write"), ((64, 8),), min_size=64 << 10, max_size=64 << 10),
    Cause("cause-tcp-send-stream", "a pair's SENDs keep their order on one TCP stream: 0.91-0.97 of one stream's "
          "rate; gloo also runs one stream per pair: 0.92 and 1.00 of gloo in the runs of 2026-11-28 and -29",
          "loss", ("tcp",), ("send",), ((64, 8), (64, 1), (1, 8)), min_size=MiB),
    Cause("tcp-batch-python", "the Python adapter's cell: the same engine through the C++ adapter in the same run "
          "met the bar (read 4,687 MB/s, 0.93; SEND 4,679, 0.94), and the Python row's range (read 3,908-5,250) "
          "spans the ceiling's (4,971-5,041); its SENDs are 64 Python calls a batch on each side",
          "miss", ("tcp",), ("read", "send"), ((64, 8),), min_size=MiB, max_size=MiB, engines=("sluice tcp",)),
    Cause("tcp-send-64m-spread", "one 64 MiB SEND a sample (the 64 MiB budget); 7 interleaved rounds of 8 right "
          "after (512 MiB budget): Sluice 4,686 MB/s (C++ adapter 4,588) against gloo's 4,065, 1.13-1.15",
          "loss", ("tcp",), ("send",), LONE, min_size=64 * MiB, max_size=64 * MiB),
    Cause("shm-lone-16m-read-spread", "the run's three samples (16 ops each) ranged 12,951-17,201 MB/s; sluice_peer "
          "alone right after, 5 runs of 64 lone 16 MiB memfd reads alternating with the ceiling's 1-thread streaming "
          "copy: 17,998-24,550 against 20,023-23,000 (0.87-1.07)", "miss", ("shm",), ("read",), LONE,
          min_size=16 * MiB, max_size=16 * MiB, engines=("c++ shm memfd",)),
    Cause("cause-lone-tcp-lanes", "a lone op is split into one lane per channel; on 2 vCPUs the two lanes' four "
          "threads share two cores (one lane: 0.85-0.95 of the ping-pong); on a 16-core host the split "
          "is as fast or faster (1 MiB: read 5,801 MB/s split, 5,083 on one channel; write 5,036 and 5,248)",
          "miss", ("tcp",), ("read", "write", "send"), LONE, min_size=MiB, max_size=MiB),
    Cause("cause-lone-cma-write", "a peer's memory is never written by address (docs/security.md): the target "
          "pulls the bytes, a request's round trip and a wake-up before the copy (lone 1 MiB: 178 us against "
          "105 us for the READ in the same run)", "miss", ("shm",), ("write",), LONE, min_size=MiB,
          max_size=MiB, engines=("cma",)),
    Cause("pool-wait", "a lone 1 MiB memfd op's second lane waits for a copy-pool thread to wake (its waiter now "
          "polls meanwhile, shm.pool_wait_us); sluice_peer alone, 5 runs of 1,000 lone reads each beside the "
          "ceiling's 1-thread streaming copy: 14,844-16,940 MB/s against 17,474-20,474 (0.79-0.88)",
          "miss", ("shm",), ("read", "write"), LONE, min_size=MiB, max_size=MiB, engines=("memfd",)),
    Cause("cause-lone-shm-send", "a SEND_RTS frame wakes the receiver before the copy and a SEND_ACK wakes the "
          "sender after it: two wake-ups around a 50-75 us copy", "miss", ("shm",), ("send",), LONE,
          min_size=MiB, max_size=MiB, engines=("cma",)),
    Cause("offered-send-modes", "the sender copies into the recv its peer offered, alone (one thread, the ceiling's "
          "own copy) and then sends a frame; when it outruns the receiver's next offer the SEND goes as SEND_RTS "
          "(uprobes, 6 runs of 265 lone 1 MiB SENDs: no SEND_RTS in 3, at 16,300-17,000 MB/s; 5-15 in the others, "
          "at 6,400-12,300)", "miss", ("shm",), ("send",), LONE, min_size=MiB, max_size=MiB, engines=("memfd",)),
    Cause("shm-send-batch-stream", "the receiving process's copies (reactor and copy pool, streaming stores) are "
          "46 % of the 2 vCPUs' samples; the sender's loop, the receiver's recv loop and wake-ups take the rest "
          "(sluice_peer alone: 19,309 MB/s against the 2-thread streaming copy's 23,700-26,800)", "miss", ("shm",),
          ("send",), ((64, 8),), min_size=MiB, max_size=MiB, engines=("memfd",)),
    Cause("shm-send-batch-cma", "the receiving process's process_vm_readv copies (reactor and copy pool) are 56 % "
          "of the 2 vCPUs' samples (perf); sluice_peer alone 12,773 MB/s against the 2-thread CMA ceiling's "
          "15,100 run right after (0.85); the run's ceiling ranged 17,125-28,055", "miss", ("shm",), ("send",),
          ((64, 8),), min_size=MiB, max_size=MiB, engines=("cma",)),
)


def cause_for(kind: str, d: dict) -> Cause | None:
    """The measured cause that covers a lost ("loss") or missed ("miss") cell, if any."""
    return next((c for c in CAUSES if c.covers(kind, d)), None)
