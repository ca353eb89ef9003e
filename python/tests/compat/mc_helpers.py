"""Helpers of the Mooncake facade tests (python/tests/compat): the peer process, the wheel check.

(A module of its own, not conftest.py: python/tests has a conftest.py too.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
IMPLS = ["sluice", "mooncake"]


def _mooncake_wheel_problem() -> Optional[str]:
    """Why Mooncake's own wheel cannot serve here (None when it can). Checked in a child so
    that a broken wheel cannot take the test process down, and so that it is Mooncake's module
    that is checked even if the compat hook were active here."""
    code = ("import sys, mooncake.engine as m; "
            "sys.exit(3 if getattr(m, '__sluice_compat__', False) else 0)")
    env = dict(os.environ)
    env.pop("SLUICE_MOONCAKE_COMPAT", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    tail = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"Mooncake's wheel (mooncake-transfer-engine-non-cuda) cannot be imported here: {tail}"


_problem_cache: dict = {}


def mooncake_problem() -> Optional[str]:
    if "p" not in _problem_cache:
        _problem_cache["p"] = _mooncake_wheel_problem()
    return _problem_cache["p"]


def engine_class(impl: str):
    if impl == "sluice":
        from sluice.compat.mooncake import TransferEngine
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


class Peer:
    """A TransferEngine in a child process (peer.py)."""

    def __init__(self, impl: str, size: int, env: Optional[dict] = None):
        e = dict(os.environ)
        e.pop("SLUICE_MOONCAKE_COMPAT", None)
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, PEER, impl, str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=e)
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError(f"peer.py ({impl}) exited with {self.proc.wait()} before it was ready")
        info = json.loads(first)
        self.port, self.addr, self.size = info["port"], info["addr"], info["size"]
        self.target = f"127.0.0.1:{self.port}"

    def cmd(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("peer.py exited")
        return json.loads(line)

    def fill(self, value: int, addr: Optional[int] = None, length: Optional[int] = None):
        self.cmd(cmd="fill", addr=self.addr if addr is None else addr,
                 length=self.size if length is None else length, value=value)

    def sha(self, spans):
        return self.cmd(cmd="sha", spans=[list(s) for s in spans])["sha"]

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


def registered(te, nbytes: int, fill=None) -> np.ndarray:
    """A numpy buffer registered with ``te`` (the caller keeps it alive)."""
    buf = np.zeros(nbytes, dtype=np.uint8) if fill is None else fill
    assert te.register_memory(buf.ctypes.data, buf.nbytes) == 0
    return buf


# ---- fixtures (imported by the test modules: a conftest.py here would shadow python/tests/conftest.py)

# Mooncake logs every connection at INFO through glog; keep warnings and errors (children
# inherit this).
os.environ.setdefault("GLOG_minloglevel", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_compat_env():
    # The facade tests choose their implementation themselves.
    if os.environ.get("SLUICE_MOONCAKE_COMPAT"):
        pytest.exit("unset SLUICE_MOONCAKE_COMPAT to run python/tests/compat", returncode=2)


@pytest.fixture(scope="module", params=IMPLS)
def impl(request) -> str:
    if request.param == "mooncake":
        why = mooncake_problem()
        if why:
            pytest.skip(why)
    return request.param


@pytest.fixture(scope="module")
def TE(impl):
    return engine_class(impl)


@pytest.fixture
def engine(TE):
    te = TE()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield te
    if hasattr(te, "close"):  # the facade; Mooncake's engine goes with the object
        te.close()


@pytest.fixture
def make_peer(impl):
    peers = []

    def make(size: int = 1 << 20, env: Optional[dict] = None) -> Peer:
        p = Peer(impl, size, env)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


@pytest.fixture(scope="module")
def peer(impl):
    """One peer per implementation and test module (a process start costs seconds on a busy
    2-core CI host); tests that kill or stop a peer make their own with make_peer."""
    p = Peer(impl, 1 << 20)
    yield p
    p.close()
