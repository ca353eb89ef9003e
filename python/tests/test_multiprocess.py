"""Engines in separate processes, connected through the handshake listener."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import sluice
from conftest import pattern

N = 1 << 20


def _target(conn, transport):
    """Child: register a patterned buffer, send our address, serve until told to stop."""
    with sluice.Engine(channels=1, transports=transport) as e:
        buf = pattern(N, 9)
        e.register(buf, name="buf")
        conn.send(e.listen_address)
        ep = e.accept(timeout=20)
        if ep is None:
            conn.send("no peer")
            return
        f = ep.imm_recv()
        f.result(20)
        conn.send(("imm", f.imm, int(buf[: N // 2].sum())))
        conn.recv()  # wait for "stop"


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_two_processes(transport):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_target, args=(child, transport))
    p.start()
    try:
        assert parent.poll(30)
        address = parent.recv()
        with sluice.Engine(channels=1) as e:
            dst = np.zeros(N, np.uint8)
            ones = np.ones(N // 2, np.uint8)
            hd, ho = e.register(dst), e.register(ones)
            ep = e.connect(address, transport=transport)
            r = ep.remote_region("buf")
            ep.read([(hd, 0, r, 0, N)]).result(20)
            assert np.array_equal(dst, pattern(N, 9))
            ep.write_with_imm([(ho, 0, r, 0, N // 2)], 42).result(20)
            assert parent.poll(20)
            assert parent.recv() == ("imm", 42, N // 2)
            parent.send("stop")
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


CHILD = r"""
import sys, numpy as np, sluice
e = sluice.Engine(channels=1, transports=sys.argv[1])
e.register(np.zeros(4096, np.uint8), name="buf")
print(e.listen_address, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_process_killed(transport):
    """A peer that dies with operations pending fails them with PeerLostError, no hang."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, transport], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        with sluice.Engine(channels=1) as e:
            h = e.register(np.zeros(4096, np.uint8))
            ep = e.connect(address, transport=transport)
            pending = ep.recv(h)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            with pytest.raises((sluice.PeerLostError, sluice.RemoteError)):
                pending.result(20)
            with pytest.raises((sluice.PeerLostError, sluice.RemoteError)):
                ep.read([(h, 0, ep.remote_region("buf", refresh=False), 0, 8)]).result(20)
    finally:
        if child.poll() is None:
            child.kill()
