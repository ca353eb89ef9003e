"""Fixtures for the Mooncake facade tests.

Every test that takes ``impl`` runs twice: against ``sluice.compat.mooncake`` and against
Mooncake's own ``mooncake-transfer-engine-non-cuda`` wheel (``mooncake.engine``), the same
script both times, to show that the facade behaves as the original. The wheel parameter skips,
saying why, only where the wheel cannot be imported (python/run_tests.sh installs it).
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

from mc_helpers import IMPLS, Peer, engine_class, mooncake_problem

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
