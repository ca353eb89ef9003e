import gc

import numpy as np
import pytest

import sluice


class Pair:
    """Two engines and one endpoint, seen from both sides (ep: a -> b, peer: b's side)."""

    def __init__(self, transport=None, **kw):
        self.a = sluice.Engine(channels=1, **kw)
        self.b = sluice.Engine(channels=1, **kw)
        self.ep = self.a.connect(self.b.listen_address, transport=transport)
        self.peer = self.b.accept(timeout=10)
        assert self.peer is not None

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request):
    p = Pair(transport=request.param)
    yield p
    p.close()


@pytest.fixture
def tcp_pair():
    p = Pair(transport="tcp")
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


def pattern(n, seed=0):
    return ((np.arange(n, dtype=np.uint64) + seed) * 2654435761 >> 13).astype(np.uint8)
