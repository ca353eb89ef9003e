"""The RDMA ceiling inside the SoftRoCE guest: perftest's ib_write_bw / ib_read_bw (Debian's
perftest, raw verbs, no engine) on the same device, GID, QP count and cells: SIZE-byte
messages, BATCH x ITERS of them (-n, spread over the QPs), at most BATCH x CONCURRENCY
outstanding (-t; ib_read_bw also -o, capped by the device's max_qp_rd_atom). A lone operation
(batch 1, concurrency 1) is -t 1: one operation at a time. The server runs in the background,
the client connects to it on RXE_IP (retried while the server starts). No bytes to check:
`checked` is null. Settings: device, gid_index, host, qps."""

from __future__ import annotations

import math
import shutil
import subprocess
import time

from common import Cell, emit

TOOL_TIMEOUT_S = 60.0


def version() -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "perftest"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except Exception:
        out = ""
    return f"perftest {out}" if out else "perftest"


def _max_rd_atom(dev: str) -> int:
    try:
        out = subprocess.run(["ibv_devinfo", "-v", "-d", dev], capture_output=True, text=True, timeout=20).stdout
        for ln in out.splitlines():
            if ln.strip().startswith("max_qp_rd_atom:"):
                return int(ln.split(":")[1])
    except Exception:
        pass
    return 16


def _run_pair(tool: str, base: list[str], host: str) -> str:
    """Server in the background, then the client (retried until the server listens)."""
    srv = subprocess.Popen([tool] + base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + TOOL_TIMEOUT_S
    out, last = "", ""
    try:
        while time.monotonic() < deadline:
            time.sleep(0.3)
            left = max(1.0, deadline - time.monotonic())
            r = subprocess.run([tool] + base + [host], capture_output=True, text=True, timeout=left)
            if r.returncode == 0:
                out = r.stdout
                break
            last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            last = last[0]
            if srv.poll() is not None:  # the server gave up: nothing to retry against
                break
        if not out:
            raise RuntimeError(f"{tool} client failed: {last or 'timeout'}")
        return out
    finally:
        if srv.poll() is None:
            try:
                srv.wait(timeout=5)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()


def local(settings: dict, cells: list[Cell]) -> int:
    dev, gidx, host = settings.get("device", "rxe0"), str(settings.get("gid_index", 1)), settings["host"]
    qps = int(settings.get("qps", 1))
    rd_atom = _max_rd_atom(dev)
    bad = 0
    for c in cells:
        try:
            tool = {"read": "ib_read_bw", "write": "ib_write_bw"}.get(c.op)
            if tool is None:
                raise NotImplementedError("perftest: READ and WRITE only here")
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found (Debian package perftest)")
            msgs = c.batch * c.iters
            depth = max(1, c.batch * c.conc // qps)
            n = max(math.ceil(msgs / qps), depth)
            args = ["-d", dev, "-x", gidx, "-F", "-s", str(c.size), "-n", str(n), "-q", str(qps), "-t", str(depth),
                    "--report_gbits"]
            if c.op == "read":
                args += ["-o", str(min(depth, rd_atom))]
            out = _run_pair(tool, args, host)
            gbps = None
            for ln in out.splitlines():
                f = ln.split()
                if len(f) >= 4 and f[0] == str(c.size):
                    gbps = float(f[3])
            if not gbps:
                raise RuntimeError(f"{tool}: no result line in its output: {out.strip().splitlines()[-1:]}")
            bps = gbps * 1e9 / 8
            secs = c.size * c.batch * c.iters / bps
            emit(c, secs, secs / c.iters * 1e3, None, qps=qps, depth=depth, tool=tool)
        except Exception as e:
            emit(c, None, None, None, f"{type(e).__name__}: {e}"[:300])
            bad += 1
    return 1 if bad else 0
