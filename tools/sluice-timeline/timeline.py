#!/usr/bin/env python3
"""Where a message's time goes across the threads of the processes that move it.

    timeline.py run [--out DIR] -- COMMAND [ARG ...]   run COMMAND (and every process it starts)
                                                       with the recording library preloaded
    timeline.py show DIR [--mark K] [--skip-us X] [--span-us Y] [--all]
                                                       the merged timeline, one line per call
    timeline.py summary DIR [--mark K] [--markdown]    per process and thread: calls, bytes,
                                                       time inside each call kind, long waits

The recording library (timeline_preload.cpp, built here with the host's C++ compiler on first
use, into ~/.cache/sluice-timeline) logs when each socket, pipe/eventfd, epoll/poll, ioctl (the GPU driver),
process_vm_* and condition-variable call of every thread starts and ends (docs/performance.md,
"Tracing a message through the threads"). perf and strace are not on every machine we measure on;
this needs a compiler only. A program marks where the interesting part starts with
os.write(-1, b"x" * K) (it fails with EBADF; the library records mark K); --mark K starts the
views at the last mark K (default: the last mark of any number, else the first event).
Time is CLOCK_MONOTONIC, shared by the processes of a host; `show` prints µs from the start of
the view, the process (A, B, ... in order of pid) and the thread's name.
"""
from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "timeline_preload.cpp")
WAITS = {"epoll_wait", "epoll_pwait", "poll", "cond_wait", "cond_timedwait", "cond_clockwait"}
SIGNALS = {"cond_signal", "cond_broadcast"}


def build_library(cache_home: Optional[str] = None) -> str:
    """The preload library, compiled from SOURCE into a cache folder keyed by its contents
    (under cache_home, default $XDG_CACHE_HOME or ~/.cache)."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    home = cache_home or os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    cache = os.path.join(home, "sluice-timeline")
    lib = os.path.join(cache, f"libsluice_timeline-{digest}.so")
    if not os.path.exists(lib):
        os.makedirs(cache, exist_ok=True)
        cxx = os.environ.get("CXX", "c++")
        tmp = f"{lib}.{os.getpid()}.tmp"
        cmd = [cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE, "-ldl", "-lpthread"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"timeline.py: building the recording library failed ({' '.join(cmd)}):\n{r.stderr}")
        os.replace(tmp, lib)
    return lib


@dataclass
class Event:
    ns: int
    tid: int
    pid: int
    call: str
    exit: bool
    value: int
    fd: int


@dataclass
class Trace:
    events: List[Event] = field(default_factory=list)
    names: Dict[int, str] = field(default_factory=dict)
    pids: List[int] = field(default_factory=list)
    dropped: int = 0


def load(folder: str) -> Trace:
    files = sorted(glob.glob(os.path.join(folder, "timeline.*")))
    if not files:
        raise SystemExit(f"timeline.py: no timeline.* files in {folder} (was the command run with `timeline.py run`?)")
    t = Trace()
    for path in files:
        pid = int(path.rsplit(".", 1)[1])
        events = 0
        with open(path) as f:
            for line in f:
                p = line.split()
                if not p:
                    continue
                if p[0] == "#":
                    if "dropped" in p:
                        t.dropped += int(p[p.index("dropped") + 1])
                    continue
                if p[0] == "T":
                    if len(p) >= 3:
                        t.names[int(p[1])] = " ".join(p[2:])
                    continue
                t.events.append(Event(int(p[0]), int(p[1]), pid, p[2], p[3] == "1", int(p[4]), int(p[5])))
                events += 1
        if events:
            t.pids.append(pid)
    t.events.sort(key=lambda e: e.ns)
    t.pids.sort()
    return t


def view_start(t: Trace, mark: Optional[int]) -> int:
    marks = [e for e in t.events if e.call == "write" and e.fd == -1 and not e.exit]
    if mark is not None:
        marks = [e for e in marks if e.value == mark]
        if not marks:
            raise SystemExit(f"timeline.py: no mark {mark} in the trace")
    return marks[-1].ns if marks else (t.events[0].ns if t.events else 0)


def label(t: Trace, pid: int) -> str:
    i = t.pids.index(pid) if pid in t.pids else -1
    return chr(ord("A") + i) if 0 <= i < 26 else str(pid)


def show(t: Trace, start: int, skip_us: float, span_us: float, everything: bool) -> None:
    lo = start + int(skip_us * 1000)
    hi = lo + int(span_us * 1000)
    for e in t.events:
        if e.ns < lo:
            continue
        if e.ns > hi:
            break
        if not everything and e.call in SIGNALS:
            continue
        if e.call in SIGNALS:
            what = f"  {e.call}"
        elif not e.exit:
            what = f"  ...{e.call}" if e.call in WAITS else f"> {e.call}(fd {e.fd}{', ' + str(e.value) if e.value else ''})"
        else:
            what = f"< {e.call} = {e.value}"
        print(f"{(e.ns - lo) / 1000:10.1f}  {label(t, e.pid)} {t.names.get(e.tid, str(e.tid))[:16]:<16} {what}")


def summary(t: Trace, start: int, markdown: bool) -> None:
    """Per (process, thread): the calls of each kind that end after `start`, their total time, bytes moved,
    and waits (epoll, poll, condition variables) that lasted over 5 µs."""
    open_calls: Dict[Tuple[int, str], int] = {}
    stats: Dict[Tuple[int, int], Dict[str, List[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    moved: Dict[Tuple[int, int], int] = collections.Counter()
    sleeps: Dict[Tuple[int, int], int] = collections.Counter()
    for e in t.events:
        if e.call in SIGNALS:
            continue
        key = (e.tid, e.call)
        if not e.exit:
            open_calls[key] = e.ns
            continue
        t0 = open_calls.pop(key, None)
        if t0 is None or e.ns < start:  # counted: the calls that end in the view
            continue
        d = e.ns - t0
        stats[(e.pid, e.tid)][e.call].append(d)
        if e.call in WAITS and d > 5000:
            sleeps[(e.pid, e.tid)] += 1
        if e.call not in WAITS and e.value > 0 and e.fd != -1:
            moved[(e.pid, e.tid)] += e.value
    rows = []
    for (pid, tid), calls in sorted(stats.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        for call, ds in sorted(calls.items()):
            rows.append((label(t, pid), t.names.get(tid, str(tid)), tid, call, len(ds), sum(ds) / 1000,
                         statistics.median(ds) / 1000))
        rows.append((label(t, pid), t.names.get(tid, str(tid)), tid, "(waits over 5 us)", sleeps[(pid, tid)], 0.0, 0.0))
        rows.append((label(t, pid), t.names.get(tid, str(tid)), tid, "(bytes moved)", moved[(pid, tid)], 0.0, 0.0))
    head = ("proc", "thread", "tid", "call", "count", "total us", "median us")
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.1f} |")
    else:
        print(f"{head[0]:<5}{head[1]:<17}{head[2]:>8}  {head[3]:<20}{head[4]:>10}{head[5]:>12}{head[6]:>11}")
        for r in rows:
            print(f"{r[0]:<5}{r[1][:16]:<17}{r[2]:>8}  {r[3]:<20}{r[4]:>10}{r[5]:>12.1f}{r[6]:>11.1f}")
    if t.dropped:
        print(f"# {t.dropped} events dropped (SLUICE_TIMELINE_EVENTS)")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command with the recording library preloaded")
    r.add_argument("--out", default="timeline-out", help="folder for the timeline.<pid> files (made if missing)")
    r.add_argument("command", nargs=argparse.REMAINDER)
    s = sub.add_parser("show", help="print the merged timeline")
    s.add_argument("dir")
    s.add_argument("--mark", type=int)
    s.add_argument("--skip-us", type=float, default=0.0)
    s.add_argument("--span-us", type=float, default=1000.0)
    s.add_argument("--all", action="store_true", help="also condition-variable signals")
    m = sub.add_parser("summary", help="per-thread counts and times")
    m.add_argument("dir")
    m.add_argument("--mark", type=int)
    m.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not cmd:
            ap.error("run: give the command after --")
        os.makedirs(a.out, exist_ok=True)
        for old in glob.glob(os.path.join(a.out, "timeline.*")):
            os.remove(old)
        env = dict(os.environ)
        lib = build_library()
        env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        env["SLUICE_TIMELINE_DIR"] = os.path.abspath(a.out)
        rc = subprocess.call(cmd, env=env)
        print(f"timeline.py: {len(glob.glob(os.path.join(a.out, 'timeline.*')))} process(es) recorded in {a.out}",
              file=sys.stderr)
        return rc
    t = load(a.dir)
    start = view_start(t, a.mark)
    if a.cmd == "show":
        show(t, start, a.skip_us, a.span_us, a.all)
    else:
        summary(t, start, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
