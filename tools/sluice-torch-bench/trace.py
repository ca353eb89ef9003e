"""Where a torch send/recv's time goes between the ranks: reads the per-rank records that
SLUICE_TORCH_TRACE=<prefix> makes the sluice backend write (<prefix>.g<n>.rank<r>.csv, one file
per rank and traced group, src/torch/trace.hpp) and prints, per rendezvous message, the median
time of each step from the sender's call to both sides' return, over every message of a size
class. Timestamps are CLOCK_MONOTONIC, which the processes of one host share, so steps across
ranks are comparable there (not across hosts).

    SLUICE_TORCH_TRACE=/tmp/tr torchrun --nproc_per_node=2 tools/sluice-torch-bench/bench.py --device cuda --ops sendrecv
    python3 tools/sluice-torch-bench/trace.py /tmp/tr [--group 0] [--json] [--timeline DIR]

--timeline DIR: the same run recorded by tools/sluice-timeline (timeline.py run --out DIR -- ...):
each step on one rank also gets the median number of ioctl calls (the GPU driver's calls into
the kernel) its process made inside the step, and the median time spent in them.

Messages are paired across ranks by protocol: rendezvous (RTS: host payloads, CTS from the
receiver; RTS_READ: CUDA payloads the receiver reads, FIN back) by (sender, id); ready-to-receive
(RTR from the receiver whose recv was posted first, RTR_DATA from the sender) by (receiver, RTR
id); eager messages (EAGER, EAGER_INLINE: no id) by order, the k-th a rank sent to a peer being
the k-th that peer took from it (one control endpoint per pair, in order). Collectives' messages
appear too, without send/recv calls.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import sys
from bisect import bisect_right
from typing import Dict, List, Optional, Tuple

KINDS = {0: "EAGER", 1: "RTS", 2: "CTS", 3: "NACK", 4: "RTS_READ", 5: "FIN", 6: "EAGER_INLINE", 7: "RTR", 8: "RTR_DATA"}

# Steps of a CUDA message (RTS_READ): (name, side, from event, to event). side s = sender, r = receiver.
READ_STEPS = [
    ("sender: call -> stream synced", "send_call", "send_synced"),
    ("sender: synced -> RTS_READ out", "send_synced", "rts_out"),
    ("RTS_READ out -> in at receiver", "rts_out", "rts_in"),
    ("receiver: RTS_READ in -> read call", "rts_in", "read_call"),
    ("receiver: read call -> posted (the engine's submit)", "read_call", "read_posted"),
    ("receiver: read posted -> done (copy + completion)", "read_posted", "read_done"),
    ("receiver: read done -> recv done", "read_done", "recv_done"),
    ("receiver: recv done -> wait returns", "recv_done", "recv_wait_end"),
    ("receiver: recv done -> FIN out", "recv_done", "fin_out"),
    ("FIN out -> in at sender", "fin_out", "fin_in"),
    ("sender: FIN in -> send done", "fin_in", "send_done"),
    ("sender: send done -> wait returns", "send_done", "send_wait_end"),
    ("one way: sender's call -> receiver's wait returns", "send_call", "recv_wait_end"),
    ("sender's call -> its wait returns", "send_call", "send_wait_end"),
]
RTR_STEPS = [
    ("RTR out -> in at the sender (its recv posted first)", "rtr_out", "rtr_in"),
    ("sender: call -> RTR_DATA out (payload already sent)", "send_call", "data_out"),
    ("RTR_DATA out -> in at receiver", "data_out", "data_in"),
    ("sender's call -> receiver's recv done", "send_call", "recv_done"),
    ("receiver: recv done -> wait returns", "recv_done", "recv_wait_end"),
    ("one way: sender's call -> receiver's wait returns", "send_call", "recv_wait_end"),
]
EAGER_STEPS = [
    ("sender: call -> header out", "send_call", "rts_out"),
    ("header out -> in at receiver", "rts_out", "rts_in"),
    ("receiver: header in -> recv done", "rts_in", "recv_done"),
    ("receiver: recv done -> wait returns", "recv_done", "recv_wait_end"),
    ("one way: sender's call -> receiver's wait returns", "send_call", "recv_wait_end"),
]
RTS_STEPS = [
    ("sender: call -> RTS out", "send_call", "rts_out"),
    ("RTS out -> in at receiver", "rts_out", "rts_in"),
    ("receiver: RTS in -> CTS out", "rts_in", "cts_out"),
    ("CTS out -> in at sender", "cts_out", "cts_in"),
    ("CTS in -> receiver's recv done", "cts_in", "recv_done"),
    ("receiver: recv done -> wait returns", "recv_done", "recv_wait_end"),
    ("one way: sender's call -> receiver's wait returns", "send_call", "recv_wait_end"),
]

STEPS = {"RTS_READ": READ_STEPS, "RTS": RTS_STEPS, "RTR": RTR_STEPS, "EAGER": EAGER_STEPS, "EAGER_INLINE": EAGER_STEPS}
Event = Tuple[int, int, str, int, int, int]  # t_ns, rank, event, peer, id, kind
SENDER_SIDE = {"send_call", "send_synced", "rts_out", "fin_in", "cts_in", "send_done", "send_wait_end", "rtr_in",
               "data_out"}
RECEIVER_SIDE = {"rts_in", "read_call", "read_posted", "read_done", "recv_done", "recv_wait_end", "fin_out", "cts_out",
                 "rtr_out", "data_in"}


def pids(prefix: str, group: int) -> Dict[int, int]:
    """rank -> the pid that wrote its file."""
    out: Dict[int, int] = {}
    for f in sorted(glob.glob(f"{prefix}.g{group}.rank*.csv")):
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                out[int(row["rank"])] = int(row["pid"])
                break
    return out


def ioctls(folder: str) -> Dict[int, List[Tuple[int, int]]]:
    """pid -> sorted (start, end) ns of every ioctl call in a tools/sluice-timeline recording."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for path in glob.glob(os.path.join(folder, "timeline.*")):
        pid = int(path.rsplit(".", 1)[1])
        open_: Dict[int, int] = {}
        calls: List[Tuple[int, int]] = []
        with open(path) as fh:
            for line in fh:
                p = line.split()
                if len(p) != 6 or p[2] != "ioctl" or not p[0].isdigit():
                    continue
                ns, tid = int(p[0]), int(p[1])
                if p[3] == "0":
                    open_[tid] = ns
                elif tid in open_:
                    calls.append((open_.pop(tid), ns))
        out[pid] = sorted(calls)
    return out


def in_step(calls: List[Tuple[int, int]], a: int, b: int) -> Tuple[int, float]:
    """How many calls start in [a, b), and the us they spend inside it."""
    i = bisect_right(calls, (a, -1))
    n, t = 0, 0
    while i < len(calls) and calls[i][0] < b:
        n += 1
        t += min(calls[i][1], b) - calls[i][0]
        i += 1
    return n, t / 1e3


def load(prefix: str, group: int) -> List[Event]:
    files = sorted(glob.glob(f"{prefix}.g{group}.rank*.csv"))
    if not files:
        raise SystemExit(f"trace.py: no {prefix}.g{group}.rank*.csv (was SLUICE_TORCH_TRACE={prefix} set, and the "
                         f"group destroyed?)")
    out: List[Event] = []
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                out.append((int(row["t_ns"]), int(row["rank"]), row["event"], int(row["peer"]), int(row["id"]),
                            int(row["kind"])))
    out.sort()
    return out


class Index:
    """Per (rank, event, peer): sorted times, for 'the last X before t' / 'the first X after t'."""

    def __init__(self, events: List[Event]) -> None:
        self.t: Dict[Tuple[int, str, int], List[int]] = {}
        for t, rank, ev, peer, _id, _kind in events:
            self.t.setdefault((rank, ev, peer), []).append(t)

    def last_before(self, rank: int, ev: str, peer: int, t: int) -> Optional[int]:
        v = self.t.get((rank, ev, peer), [])
        i = bisect_right(v, t)
        return v[i - 1] if i else None

    def first_after(self, rank: int, ev: str, peer: int, t: int) -> Optional[int]:
        v = self.t.get((rank, ev, peer), [])
        i = bisect_right(v, t)
        return v[i] if i < len(v) else None

    def call_of(self, rank: int, peer: int, header_out: int) -> Optional[int]:
        """The send() call whose message left as the header sent at `header_out`: the last call
        to that peer before it, if no other header to that peer left in between (a
        collective's message has no call of its own)."""
        call = self.last_before(rank, "send_call", peer, header_out)
        if call is None or self.first_after(rank, "header_out", peer, call - 1) != header_out:
            return None
        return call


def messages(events: List[Event]) -> List[Dict]:
    """One dict per paired message: its protocol, sender, receiver and the times of its steps."""
    idx = Index(events)
    by_key: Dict[Tuple[int, int, int], Dict] = {}  # (sender, receiver, id)
    rtr: Dict[Tuple[int, int, int], Dict] = {}  # (receiver, sender, RTR id)
    eager_out: Dict[Tuple[int, int], List[Dict]] = {}  # (sender, receiver): in order
    eager_in: Dict[Tuple[int, int], List[int]] = {}
    for t, rank, ev, peer, mid, kind in events:
        k = KINDS.get(kind, "?")
        if ev == "header_out" and k in ("EAGER", "EAGER_INLINE"):
            sent = eager_out.setdefault((rank, peer), [])
            sent.append({"proto": k, "sender": rank, "receiver": peer, "id": len(sent), "rts_out": t})
        elif ev == "header_in" and k in ("EAGER", "EAGER_INLINE"):
            eager_in.setdefault((peer, rank), []).append(t)
        elif ev == "header_out" and k == "RTR":
            rtr[(rank, peer, mid)] = {"proto": "RTR", "sender": peer, "receiver": rank, "id": mid, "rtr_out": t}
        elif k in ("RTR", "RTR_DATA"):
            name = {("header_in", "RTR"): "rtr_in", ("header_out", "RTR_DATA"): "data_out",
                    ("header_in", "RTR_DATA"): "data_in"}.get((ev, k))
            receiver_side = name == "data_in"
            m = rtr.get((rank, peer, mid) if receiver_side else (peer, rank, mid))
            if name and m is not None:
                m.setdefault(name, t)
        elif ev == "header_out" and k in ("RTS", "RTS_READ"):
            by_key[(rank, peer, mid)] = {"proto": k, "sender": rank, "receiver": peer, "id": mid, "rts_out": t}
        elif ev == "header_in" and k in ("RTS", "RTS_READ"):
            m = by_key.get((peer, rank, mid))
            if m is not None and "rts_in" not in m:
                m["rts_in"] = t
        elif ev in ("read_call", "read_posted", "read_done"):
            m = by_key.get((peer, rank, mid))
            if m is not None:
                m.setdefault(ev, t)
        elif ev == "header_out" and k in ("FIN", "CTS"):
            m = by_key.get((peer, rank, mid))
            if m is not None:
                m.setdefault("fin_out" if k == "FIN" else "cts_out", t)
        elif ev == "header_in" and k in ("FIN", "CTS"):
            m = by_key.get((rank, peer, mid))
            if m is not None:
                m.setdefault("fin_in" if k == "FIN" else "cts_in", t)
    out = []
    for (s, r, _), m in by_key.items():
        if "rts_in" not in m:
            continue
        m["send_call"] = idx.call_of(s, r, m["rts_out"])
        m["send_synced"] = idx.last_before(s, "send_synced", r, m["rts_out"]) if m["send_call"] is not None else None
        after = m.get("read_done") or m.get("cts_in") or m["rts_in"]
        m["recv_done"] = idx.first_after(r, "done", s, after)
        if m["recv_done"] is not None:
            m["recv_wait_end"] = idx.first_after(r, "wait_end", s, m["recv_done"] - 1)
        fin = m.get("fin_in")
        if fin is not None:
            m["send_done"] = idx.first_after(s, "done", r, fin)
            if m["send_done"] is not None:
                m["send_wait_end"] = idx.first_after(s, "wait_end", r, m["send_done"] - 1)
        out.append(m)
    for (r, s, _), m in rtr.items():
        if "data_out" not in m or "data_in" not in m:
            continue  # voided, or its payload went another way
        m["send_call"] = idx.call_of(s, r, m["data_out"])
        # The payload may land before its header: the recv is done after the send began.
        m["recv_done"] = idx.first_after(r, "done", s, m["send_call"] if m["send_call"] is not None else m["rtr_out"])
        if m["recv_done"] is not None:
            m["recv_wait_end"] = idx.first_after(r, "wait_end", s, m["recv_done"] - 1)
        out.append(m)
    for (s, r), sent in eager_out.items():
        taken = eager_in.get((s, r), [])
        for m, t_in in zip(sent, taken):
            m["rts_in"] = t_in
            m["send_call"] = idx.call_of(s, r, m["rts_out"])
            m["recv_done"] = idx.first_after(r, "done", s, t_in)
            # A collective's message (no call) is waited for by its collective, not by a Work.
            if m["recv_done"] is not None and m["send_call"] is not None:
                m["recv_wait_end"] = idx.first_after(r, "wait_end", s, m["recv_done"] - 1)
            out.append(m)
    return out


def summarize(msgs: List[Dict], skip: int, calls: Optional[Dict[int, List[Tuple[int, int]]]] = None,
              rank_pid: Optional[Dict[int, int]] = None) -> List[Dict]:
    """Median and spread (us) of every step, per protocol and sender -> receiver, the first
    `skip` messages of each pair left out (warm-up: registrations, descriptors). With `calls`
    (ioctls per pid) and `rank_pid`, a step on one rank also gets its ioctls' median count and
    time."""
    groups: Dict[Tuple[str, int, int], List[Dict]] = {}
    for m in sorted(msgs, key=lambda m: m.get("rts_out", m.get("rtr_out", 0))):
        groups.setdefault((m["proto"], m["sender"], m["receiver"]), []).append(m)
    rows = []
    for (proto, s, r), ms in sorted(groups.items()):
        ms = ms[skip:] if len(ms) > skip else ms
        steps = STEPS[proto]
        for name, a, b in steps:
            d = [(m[b] - m[a]) / 1e3 for m in ms if m.get(a) is not None and m.get(b) is not None]
            if not d:
                continue
            d.sort()
            row = {"proto": proto, "sender": s, "receiver": r, "step": name, "messages": len(d),
                   "median_us": statistics.median(d), "p10_us": d[int(0.1 * (len(d) - 1))],
                   "p90_us": d[int(0.9 * (len(d) - 1))]}
            side = s if {a, b} <= SENDER_SIDE else r if {a, b} <= RECEIVER_SIDE else None
            if calls is not None and rank_pid is not None and side is not None and rank_pid.get(side) in calls:
                c = [in_step(calls[rank_pid[side]], m[a], m[b]) for m in ms
                     if m.get(a) is not None and m.get(b) is not None]
                row["ioctls"] = statistics.median(n for n, _ in c)
                row["ioctl_us"] = statistics.median(t for _, t in c)
            rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefix", help="the SLUICE_TORCH_TRACE prefix the ranks wrote")
    ap.add_argument("--group", type=int, default=0, help="the n-th traced group of each process (default 0)")
    ap.add_argument("--skip", type=int, default=3, help="leave out the first messages of each pair (warm-up)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--timeline", metavar="DIR", help="a tools/sluice-timeline recording of the same run: ioctls per step")
    args = ap.parse_args(argv)
    msgs = messages(load(args.prefix, args.group))
    calls = ioctls(args.timeline) if args.timeline else None
    if args.timeline and not calls:
        print(f"trace.py: no timeline.<pid> files in {args.timeline}", file=sys.stderr)
        return 1
    if not msgs:
        print("trace.py: no message could be paired across the ranks (one rank's file missing?)", file=sys.stderr)
        return 1
    rows = summarize(msgs, args.skip, calls, pids(args.prefix, args.group) if calls else None)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    last = None
    for row in rows:
        key = (row["proto"], row["sender"], row["receiver"])
        if key != last:
            print(f"\n{row['proto']} messages, rank {row['sender']} -> rank {row['receiver']}")
            print("| step | messages | median us | p10-p90 us |" + (" ioctls | in ioctls us |" if calls else ""))
            print("|---|---:|---:|---:|" + ("---:|---:|" if calls else ""))
            last = key
        extra = ""
        if calls:
            extra = f" {row['ioctls']:.0f} | {row['ioctl_us']:.1f} |" if "ioctls" in row else " | |"
        print(f"| {row['step']} | {row['messages']} | {row['median_us']:.1f} | {row['p10_us']:.1f}-{row['p90_us']:.1f} |"
              + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
