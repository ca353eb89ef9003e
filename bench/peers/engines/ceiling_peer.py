"""The physical ceilings, run by native/ceilings.c on the same cells (same messages, same
footprint): N loopback TCP streams, N threads of process_vm_readv (CMA) or memcpy, where N
is the engine's parallelism (its channels). A lone operation (batch 1, concurrency 1) is
matched to one operation at a time on one stream: a TCP round trip (SIZE bytes out, one
byte back), or one process_vm_readv / memcpy call. No bytes to check: `checked` is null."""

from __future__ import annotations

import json
import os
import subprocess

from common import FOOTPRINT, Cell, emit

HERE = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    return "native/ceilings.c"


def binary() -> str:
    return os.environ.get("PEERS_CEILINGS", os.path.join(HERE, "..", ".build", "ceilings"))


def local(settings: dict, cells: list[Cell]) -> int:
    mode, n = settings["mode"], int(settings.get("n", 2))
    bad = 0
    for c in cells:
        lone = c.batch == 1 and c.conc == 1
        if mode == "tcp":
            args = ["tcp-pingpong", str(c.size), str(c.iters), "1", str(FOOTPRINT)] if lone else \
                ["tcp", str(c.size), str(c.batch * c.iters), str(n), str(FOOTPRINT)]
        else:
            args = [mode, str(c.size), str(c.batch * c.iters), "1" if lone else str(n), str(FOOTPRINT)]
        try:
            out = subprocess.run([binary()] + args, capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(out.stderr.strip()[-200:] or f"exit {out.returncode}")
            d = json.loads(out.stdout.strip().splitlines()[-1])
            emit(c, d["secs"], d["lat_ms"] if lone else d["secs"] / c.iters * 1e3, None,
                 threads=1 if lone else n)
        except Exception as e:
            emit(c, None, None, None, f"{type(e).__name__}: {e}"[:300])
            bad += 1
    return 1 if bad else 0
