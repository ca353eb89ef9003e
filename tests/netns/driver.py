"""Test-side handle on one netns_worker process: start it inside a namespace, send commands,
read replies with a deadline (a worker that stops answering fails the test, never hangs it)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from netns import Host

HERE = Path(__file__).resolve().parent


class WorkerError(AssertionError):
    pass


class WorkerProc:
    def __init__(self, host: Host, index: int, engines: int, *, slot: int = 64 << 10,
                 env: Optional[Dict[str, str]] = None, **cfg: Any):
        self.host, self.index = host, index
        self.cfg = {"index": index, "engines": engines, "slot": slot, "addr": host.addr, **cfg}
        e = dict(os.environ)
        # Ours first, then the caller's (a sluice package built but not installed, for example).
        e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        # Each namespace is its own host: without this every engine would claim the machine's
        # hostname and boot id (see docs/cluster.md, "Many hosts on one machine").
        e["SLUICE_HOST_ID"] = f"netns-{host.ns}"
        e.update(env or {})
        self.stderr_path = Path(f"/tmp/{host.ns}-w{index}-{os.getpid()}.log")
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([*host.exec_prefix(), sys.executable, "-m", "netns_worker", json.dumps(self.cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     cwd=str(HERE), env=e, text=True, bufsize=1)
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello: Dict[str, Any] = {}

    def ready(self, timeout: float = 60.0) -> "WorkerProc":
        """Waits for the engine to be up (workers start in parallel, then each is awaited)."""
        if not self.hello:
            self.hello = self._read(timeout, "start")
            if not self.hello.get("ready"):
                raise WorkerError(f"worker {self.index} in {self.host.ns} could not start its engine: "
                                  f"{self.hello.get('type')}: {self.hello.get('message')}")
        return self

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float, what: str) -> Dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"worker {self.index} in {self.host.ns}: no answer to {what} within {timeout} s"
                              f"{self._tail()}") from None
        if line is None:
            raise WorkerError(f"worker {self.index} in {self.host.ns} exited (rc {self.proc.poll()}) during {what}"
                              f"{self._tail()}")
        return json.loads(line)

    def _tail(self) -> str:
        try:
            t = self.stderr_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""
        return f"; its stderr ends with:\n{t}" if t else ""

    @property
    def listen(self) -> str:
        return self.hello["listen"]

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, what: str, timeout: float) -> Dict[str, Any]:
        r = self._read(timeout, what)
        if not r.get("ok"):
            raise WorkerError(f"worker {self.index} in {self.host.ns}: {what} raised {r.get('type')}: "
                              f"{r.get('message')}\n{r.get('trace', '')}")
        return r

    def call(self, cmd: str, timeout: float = 60.0, **args: Any) -> Dict[str, Any]:
        self.send(cmd, **args)
        return self.reply(cmd, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._stderr.close()
        if os.environ.get("NETNS_KEEP_LOGS"):  # the engines' log lines (SLUICE_LOG_LEVEL=info)
            return
        try:
            self.stderr_path.unlink()
        except OSError:
            pass


def stop_all(workers: List[WorkerProc]) -> None:
    for w in workers:
        try:
            w.stop()
        except Exception:  # noqa: BLE001 (cleanup goes on; the namespaces are deleted next)
            w.kill()


def now() -> float:
    return time.monotonic()
