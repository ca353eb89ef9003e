"""SEND/RECV byte-check stress through the Python API, in two processes as bench/peers runs it
(issue 16: one 64 MiB SEND cell, concurrency 8 over tcp, failed its byte check once).

Unlike the bench's cells, every message carries its own pattern, so a wrong byte says whose
message it is (an older one: stale; a later one: misordered; none: torn). The receiver
checks every byte of every message and the guard bytes after it.

  python send_stress.py [--transport tcp|shm] [--memfd] [--conc 8] [--order first|after]
                        [--messages 48] [--sizes 1M,16M,64M] [--repeat 1]

Exit status 0 when every message was right, 1 when one was not (each wrong one is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import pattern  # noqa: E402

MIB = 1 << 20
GUARD = 4096
GUARD_BYTE = 0xA5


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": MIB, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def seed_of(k: int) -> int:
    """Distinct below 2 MiB for k < 264, so no two messages share a pattern (see pattern())."""
    return k * 7919 + 13


def sizes_of(o) -> list[int]:
    base = [parse_size(s) for s in o.sizes.split(",")]
    # odd lengths too: not a multiple of any chunk, frame or page
    return [s if k % 3 else s - 4093 * (k % 2) + 7 for k, s in enumerate(base * 4)][: max(1, len(base) * 4)]


def size_of(o, k: int) -> int:
    sizes = sizes_of(o)
    return sizes[k % len(sizes)]


def slot_bytes(o) -> int:
    return max(sizes_of(o)) + GUARD


def engine(o, listen: bool):
    import sluice

    kw = {"transports": [o.transport], "channels": o.channels}
    if listen:
        kw["listen"] = "127.0.0.1:0"
    return sluice.Engine(**kw)


def buffer(eng, o, n: int, name=None):
    if o.memfd:
        return eng.allocate(n, name=name)
    a = np.zeros(n, dtype=np.uint8)
    return a, eng.register(a, name=name)


def diagnose(o, got: np.ndarray, k: int) -> str:
    n = len(got)
    bad = np.flatnonzero(got != pattern(n, seed_of(k)))
    first, last = int(bad[0]), int(bad[-1])
    text = f"message {k} ({n} bytes): {len(bad)} bytes differ, first at {first}, last at {last}"
    probe = slice(first, min(n, first + 64))
    for j in range(max(0, k - 16), k + 16):
        if j != k and size_of(o, j) >= probe.stop and np.array_equal(got[probe], pattern(probe.stop, seed_of(j))[probe]):
            return text + f"; from offset {first} it holds message {j}'s bytes"
    return text + "; the first wrong bytes belong to no message of this run at that offset"


def target(o) -> int:
    eng = engine(o, True)
    slots = o.conc
    buf, h = buffer(eng, o, slots * slot_bytes(o), "dst")
    print("READY " + json.dumps({"address": eng.listen_address}), flush=True)
    ep = eng.accept(60)
    if ep is None:
        raise SystemExit("send_stress target: no initiator within 60 s")
    bad, pending = 0, []

    def check_one() -> None:
        nonlocal bad
        k, f = pending.pop(0)
        n, off = size_of(o, k), (k % slots) * slot_bytes(o)
        try:
            f.result()
        except Exception as e:  # a failed recv is a wrong message too
            bad += 1
            print(f"BAD recv {k} failed: {type(e).__name__}: {e}", flush=True)
            return
        got = buf[off: off + n]
        if f.bytes != n or not np.array_equal(got, pattern(n, seed_of(k))):
            bad += 1
            print(f"BAD {diagnose(o, got, k)} (future says {f.bytes} bytes)", flush=True)
        if np.any(buf[off + n: off + n + GUARD] != GUARD_BYTE):
            bad += 1
            print(f"BAD recv {k} wrote past its {n} bytes", flush=True)

    for k in range(o.messages):
        if len(pending) >= slots:
            check_one()
        if o.order == "after":
            time.sleep(0.002)  # the message (and the ones behind it) arrive unexpected
        off = (k % slots) * slot_bytes(o)
        buf[off + size_of(o, k): off + size_of(o, k) + GUARD] = GUARD_BYTE
        pending.append((k, ep.recv(h, off, size_of(o, k))))
    while pending:
        check_one()
    print("DONE " + json.dumps({"bad": bad}), flush=True)
    sys.stdin.read()
    eng.close()
    return 1 if bad else 0


def initiator(o, address: str) -> int:
    eng = engine(o, False)
    ep = eng.connect(address, transport=o.transport)
    slots = o.conc
    buf, h = buffer(eng, o, slots * slot_bytes(o))
    inflight: list = []
    for k in range(o.messages):
        if len(inflight) >= o.conc:
            inflight.pop(0).result()  # frees slot k % slots
        n, off = size_of(o, k), (k % slots) * slot_bytes(o)
        buf[off: off + n] = pattern(n, seed_of(k))
        inflight.append(ep.send(h, off, n))
    for f in inflight:
        f.result()
    eng.close()
    return 0


def run_once(o, argv: list[str]) -> int:
    env = dict(os.environ)
    # The receiver lags on purpose (--order after) and an eager send completes once stashed:
    # room for every message of the run, so that the bound does not refuse one by design.
    env.setdefault("SLUICE_MAX_UNEXPECTED_BYTES", str(o.messages * slot_bytes(o)))
    env.setdefault("SLUICE_RECV_TIMEOUT_MS", "60000")
    t = subprocess.Popen([sys.executable, __file__, "--role", "target"] + argv, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    line = t.stdout.readline()
    if not line.startswith("READY "):
        t.kill()
        raise SystemExit(f"send_stress: the target did not start: {line!r}")
    rc = initiator(o, json.loads(line[6:])["address"])
    bad = None
    for line in t.stdout:
        if line.startswith("BAD "):
            print(line.rstrip(), flush=True)
        elif line.startswith("DONE "):
            bad = json.loads(line[5:])["bad"]
            break
    t.stdin.close()
    t.wait(60)
    return 1 if rc or bad is None or bad else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="driver", choices=["driver", "target"], help=argparse.SUPPRESS)
    p.add_argument("--transport", default="tcp")
    p.add_argument("--memfd", action="store_true", help="engine-allocated memory on both sides")
    p.add_argument("--channels", type=int, default=2)
    p.add_argument("--conc", type=int, default=8, help="sends in flight and recvs posted ahead")
    p.add_argument("--order", default="first", choices=["first", "after"], help="recv posted before or after its message")
    p.add_argument("--messages", type=int, default=48)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--repeat", type=int, default=1)
    o = p.parse_args(argv)
    if o.role == "target":
        return target(o)
    worst = 0
    for i in range(o.repeat):
        rc = run_once(o, argv)
        print(f"send_stress {o.transport}{' memfd' if o.memfd else ''} conc {o.conc} recv {o.order}: "
              f"run {i + 1}/{o.repeat} {'ok' if rc == 0 else 'FAILED'}", flush=True)
        worst = max(worst, rc)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
