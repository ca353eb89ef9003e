"""One Sluice engine in one process, driven over stdin/stdout by the netns tests.

Started as ``ip netns exec NS python -m netns_worker '<json config>'`` (PYTHONPATH=tests/netns).
It prints one JSON line when its engine is up, then answers each JSON command line on stdin
with one JSON line. Times are ``time.monotonic()``: CLOCK_MONOTONIC is one clock for every
process on the machine (no time namespaces here), so the driver compares them with its own.

Patterns: the bytes engine ``a`` sends to (or serves for) engine ``b`` in round ``r`` come
from a generator seeded by (kind, a, b, r), so every pair, direction and round differs and
stale or misplaced bytes never pass a check.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np

import sluice

_KIND = {"write": 1, "read": 2, "stream": 3}


def pattern(kind: str, a: int, b: int, rnd: int, n: int) -> np.ndarray:
    return np.random.default_rng([_KIND[kind], a, b, rnd]).integers(0, 256, n, dtype=np.uint8)


class HangError(Exception):
    pass


def _finish(f: "sluice.Future", wait: float, what: str) -> None:
    if not f.wait(wait):  # wait() raises the operation's own error when it failed
        raise HangError(f"{what} still pending after {wait} s (op_timeout should have ended it)")


def _err(e: BaseException) -> Dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e)}


class Worker:
    def __init__(self, cfg: Dict[str, Any]):
        self.cfg = cfg
        self.index: int = cfg["index"]
        self.n: int = cfg["engines"]  # slots: one per engine of the run
        self.slot: int = cfg["slot"]
        opts: Dict[str, Any] = dict(cfg.get("options", {}))
        if cfg.get("directory"):
            opts["directory"] = cfg["directory"]
            opts["name"] = cfg["name"]
        kw = dict(transports=cfg.get("transports", "tcp,shm"), channels=cfg.get("channels", 1),
                  listen=f"{cfg['addr']}:0", connect_timeout=cfg.get("connect_timeout", 5.0),
                  op_timeout=cfg.get("op_timeout", 10.0), **opts)
        deadline = time.monotonic() + cfg.get("register_within", 0.0)
        while True:  # a restarted engine waits for its dead predecessor's entry to expire
            try:
                self.engine = sluice.Engine(**kw)
                break
            except sluice.InvalidArgumentError as e:
                if "already registered" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.t_up = time.monotonic()
        # A program joins the directory when its engine starts and registers its memory later;
        # peers that reach it in between see no regions yet (the restart scenario widens this).
        time.sleep(cfg.get("regions_after", 0.0))
        size = self.n * self.slot
        # wsrc: what we write (slot j -> engine j); src: what peers read (slot j is for engine j);
        # dst: where peers write (slot j from engine j); rd: where our reads land (slot j from j).
        self.buf = {k: np.zeros(size, np.uint8) for k in ("wsrc", "src", "dst", "rd")}
        self.h = {k: self.engine.register(v, name=k) for k, v in self.buf.items()}
        self.peers: Dict[int, sluice.Endpoint] = {}
        self.stream_thread: Optional[threading.Thread] = None
        self.stream_stop = threading.Event()
        self.stream_log: List[Dict[str, Any]] = []

    def hello(self) -> Dict[str, Any]:
        return {"ready": True, "pid": os.getpid(), "listen": self.engine.listen_address, "t_up": self.t_up,
                "info": json.loads(self.engine.local_info())}

    # -- all-to-all ------------------------------------------------------------------------
    def connect(self, targets: Dict[str, str]) -> Dict[str, Any]:
        out = {}
        for j, addr in targets.items():
            ep = self.engine.connect(addr, timeout=self.cfg.get("connect_timeout", 5.0))
            self.peers[int(j)] = ep
            out[j] = ep.transport
        return {"transports": out}

    def prepare(self, rnd: int) -> Dict[str, Any]:
        s = self.slot
        for k in ("dst", "rd"):
            self.buf[k][:] = 0
        for j in range(self.n):
            self.buf["wsrc"][j * s:(j + 1) * s] = pattern("write", self.index, j, rnd, s)
            self.buf["src"][j * s:(j + 1) * s] = pattern("read", self.index, j, rnd, s)
        return {}

    def _batch(self, local: int, local_slot: int, remote: int, remote_slot: int, pieces: int) -> List[tuple]:
        # Pieces of one slot in reverse order: a batch whose items are not one contiguous run.
        s, step = self.slot, self.slot // pieces
        return [(local, local_slot * s + p * step, remote, remote_slot * s + p * step, step)
                for p in reversed(range(pieces))]

    def alltoall(self, pieces: int, timeout: float) -> Dict[str, Any]:
        futs = []
        for j, ep in self.peers.items():
            dst, src = ep.remote_region("dst"), ep.remote_region("src")
            futs.append((j, "write", ep.write(self._batch(self.h["wsrc"], j, dst, self.index, pieces))))
            futs.append((j, "read", ep.read(self._batch(self.h["rd"], j, src, self.index, pieces))))
        errors = []
        for j, kind, f in futs:
            try:
                f.result(timeout)
            except Exception as e:  # noqa: BLE001 (reported to the driver, which fails the test)
                errors.append({"peer": j, "op": kind, **_err(e)})
        return {"errors": errors, "ops": len(futs)}

    def verify(self, rnd: int, peers: List[int]) -> Dict[str, Any]:
        s, bad = self.slot, []
        for j in peers:
            if not np.array_equal(self.buf["dst"][j * s:(j + 1) * s], pattern("write", j, self.index, rnd, s)):
                bad.append({"peer": j, "what": "write landed here"})
            if not np.array_equal(self.buf["rd"][j * s:(j + 1) * s], pattern("read", j, self.index, rnd, s)):
                bad.append({"peer": j, "what": "read into here"})
        # Slots no peer touched stay zero: nothing landed in the wrong place.
        for j in set(range(self.n)) - set(peers):
            for k in ("dst", "rd"):
                if self.buf[k][j * s:(j + 1) * s].any():
                    bad.append({"peer": j, "what": f"{k} slot of a non-peer is not zero"})
        return {"mismatches": bad}

    # -- a stream of checked writes to one target (link flap, killed peer) -----------------
    def _checked_op(self, ep: sluice.Endpoint, seq: int, lslot: int, rslot: int, wait: float) -> None:
        """Writes a fresh pattern into the peer's dst slot `rslot`, reads it back into our rd
        slot `lslot`, compares. Raises the op's error, or HangError if it is still pending
        after `wait` (longer than op_timeout: the engine must have ended it by then)."""
        s = self.slot
        mine = self.buf["wsrc"][lslot * s:(lslot + 1) * s]
        back = self.buf["rd"][lslot * s:(lslot + 1) * s]
        mine[:] = pattern("stream", self.index, rslot, seq, s)
        # As a caller would: the cached table first, fetched again only when it lacks the name.
        # After a reconnection the table is the new incarnation's at its handshake, which can
        # come before that process registered "dst" (it joins the directory first).
        dst = ep.remote_region("dst")
        _finish(ep.write(self._batch(self.h["wsrc"], lslot, dst, rslot, 4)), wait, "write")
        back[:] = 0
        _finish(ep.read(self._batch(self.h["rd"], lslot, dst, rslot, 4)), wait, "read")
        if not np.array_equal(back, mine):
            raise AssertionError(f"read back of seq {seq} differs from what was written")

    def stream_start(self, target: int, addr: str, wait: float) -> Dict[str, Any]:
        ep = self.engine.connect(addr, timeout=self.cfg.get("connect_timeout", 5.0))
        self.peers[target] = ep

        def loop() -> None:
            seq = 0
            while not self.stream_stop.is_set():
                t0 = time.monotonic()
                rec: Dict[str, Any] = {"seq": seq, "t0": t0}
                try:
                    self._checked_op(ep, seq, target, self.index, wait)
                    rec["ok"] = True
                except Exception as e:  # noqa: BLE001 (each outcome is judged by the driver)
                    rec.update(ok=False, **_err(e))
                rec["t1"] = time.monotonic()
                self.stream_log.append(rec)
                seq += 1
                if not rec["ok"]:
                    # The endpoint failed (the next op would connect again: `again` measures
                    # that): stop, as a caller would. A checker error ends the stream too.
                    if not ep.connected or rec["type"] in ("AssertionError", "HangError"):
                        return

        self.stream_stop.clear()
        self.stream_thread = threading.Thread(target=loop, daemon=True)
        self.stream_thread.start()
        return {"transport": ep.transport}

    def stream_stop_(self, join: float) -> Dict[str, Any]:
        self.stream_stop.set()
        if self.stream_thread:
            self.stream_thread.join(join)
        alive = bool(self.stream_thread and self.stream_thread.is_alive())
        return {"log": self.stream_log, "still_running": alive}

    def stream_status(self) -> Dict[str, Any]:
        done = bool(self.stream_thread and not self.stream_thread.is_alive())
        oks = [r["t1"] for r in self.stream_log if r["ok"]]
        return {"ops": len(self.stream_log), "oks": len(oks), "last_ok_t1": max(oks, default=None), "ended": done}

    def again(self, target: int, lslot: int, rslot: int, until: float, op_wait: float) -> Dict[str, Any]:
        """Runs checked ops on the stream's own endpoint (after its failure: each op first
        connects again, docs/cluster.md "Reconnection"), retrying until one succeeds or `until`."""
        ep = self.peers[target]
        tries, last = 0, None
        seq = 1 << 21
        while time.monotonic() < until:
            tries += 1
            t0 = time.monotonic()
            try:
                self._checked_op(ep, seq, lslot, rslot, op_wait)
                return {"success": True, "t_ok": time.monotonic(), "t_try": t0, "tries": tries,
                        "peer_engine_id": ep.peer_engine_id, "reconnects": ep.metrics()["reconnects"],
                        "last_error": last}
            except Exception as e:  # noqa: BLE001
                last = _err(e)
                seq += 1
                time.sleep(0.01)
        return {"success": False, "tries": tries, "last_error": last}

    def fresh(self, addr: str, lslot: int, rslot: int, until: float, op_wait: float) -> Dict[str, Any]:
        """Connects anew and runs one checked op, retrying until one succeeds or `until`.
        Its slots differ from the stream's, which may still be running."""
        tries, last = 0, None
        seq = 1 << 20
        while time.monotonic() < until:
            tries += 1
            t0 = time.monotonic()
            try:
                ep = self.engine.connect(addr, timeout=max(0.1, min(2.0, until - t0)))
                self._checked_op(ep, seq, lslot, rslot, op_wait)
                return {"success": True, "t_ok": time.monotonic(), "t_try": t0, "tries": tries, "transport": ep.transport,
                        "peer_engine_id": ep.peer_engine_id, "last_error": last}
            except Exception as e:  # noqa: BLE001
                last = _err(e)
                seq += 1
                time.sleep(0.01)
        return {"success": False, "tries": tries, "last_error": last}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out_lock = threading.Lock()

    def reply(obj: Dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    try:
        w = Worker(cfg)
    except Exception as e:  # noqa: BLE001
        reply({"ready": False, **_err(e)})
        return
    reply(w.hello())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("cmd")
        try:
            if op == "quit":
                break
            fn = {"connect": w.connect, "prepare": w.prepare, "alltoall": w.alltoall, "verify": w.verify,
                  "stream_start": w.stream_start, "stream_stop": w.stream_stop_, "stream_status": w.stream_status,
                  "fresh": w.fresh, "again": w.again}[op]
            reply({"ok": True, **fn(**cmd)})
        except Exception as e:  # noqa: BLE001
            reply({"ok": False, **_err(e), "trace": traceback.format_exc()})
    w.engine.close()


if __name__ == "__main__":
    main()
