"""The ``stream=`` argument of read / write / write_with_imm and ``Endpoint.capabilities``,
checked on CPU: a malformed stream raises InvalidArgumentError (a ValueError) naming the
argument before anything is submitted; a well-formed one reaches the engine, which refuses it
on tcp and shm (UnsupportedError naming the missing capability), with or without a GPU."""
import numpy as np
import pytest

import sluice
from conftest import Pair

N = 4096


@pytest.fixture(params=["tcp", "shm"])
def ends(request):
    p = Pair(transport=request.param)
    src = np.arange(N, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(N, dtype=np.uint8)
    p.hs = p.a.register(src)
    p.hd = p.b.register(dst, name="dst")
    p.remote = p.ep.remote_region("dst")
    p.batch = [(p.hs, 0, p.remote, 0, N)]
    p.keep = (src, dst)
    yield p
    p.close()


def _ops(p):
    """Every one-sided entry point that takes stream=, sync and async, as f(stream)."""
    return [
        ("read", lambda s: p.ep.read(p.batch, stream=s)),
        ("write", lambda s: p.ep.write(p.batch, stream=s)),
        ("write_with_imm", lambda s: p.ep.write_with_imm(p.batch, 5, stream=s)),
        ("read", lambda s: p.ep.read_async(p.batch, stream=s)),
        ("write", lambda s: p.ep.write_async(p.batch, stream=s)),
        ("write_with_imm", lambda s: p.ep.write_with_imm_async(p.batch, 5, s)),
    ]


class TorchLikeStream:
    """What torch.cuda.Stream looks like to sluice: an int ``cuda_stream`` attribute."""

    def __init__(self, handle):
        self.cuda_stream = handle


class ProtocolStream:
    """The CUDA stream protocol: ``__cuda_stream__()`` returns (version, handle)."""

    def __init__(self, result):
        self.result = result

    def __cuda_stream__(self):
        return self.result


@pytest.mark.parametrize("stream", [
    "0", 1.0, 2.5, True, False, [1], object(), -1, 2 ** 64,
    TorchLikeStream(-3), TorchLikeStream("x"), TorchLikeStream(None),
    ProtocolStream((0, -1)), ProtocolStream(7), ProtocolStream((0, 1.5)),
])
def test_bad_stream_is_invalid_argument(ends, stream):
    for what, op in _ops(ends):
        with pytest.raises(sluice.InvalidArgumentError, match=f"{what}: stream"):
            op(stream)
        with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError
            op(stream)
    assert not ends.keep[1].any()  # nothing was submitted


@pytest.mark.parametrize("stream", [
    0, 1, 0x7F00_0000_1000, np.uint64(12345), TorchLikeStream(0), TorchLikeStream(99),
    ProtocolStream((0, 42)), ProtocolStream((0, 0)),
])
def test_stream_on_a_host_transport_is_unsupported(ends, stream):
    # Well-formed: the engine refuses it at submit because tcp / shm are not stream-ordered,
    # on a CPU-only build exactly as on a GPU build.
    for what, op in _ops(ends):
        with pytest.raises(sluice.UnsupportedError,
                           match=f"{what}: transport {ends.ep.transport} lacks the stream_ordered capability"):
            op(stream)
    assert not ends.keep[1].any()
    # The endpoint stays usable, and stream=None is the plain op.
    ends.ep.write(ends.batch, stream=None).result(10)
    assert (ends.keep[1] == ends.keep[0]).all()


def test_capabilities_of_host_transports(ends):
    caps = ends.ep.capabilities
    assert caps == ends.peer.capabilities
    assert caps["host_memory"] and caps["imm"]
    assert isinstance(caps["cuda_memory"], bool)  # true where a GPU stages cuda memory
    assert not caps["stream_ordered"] and not caps["stream_ordered_messages"]
    assert caps["signal"] and caps["rma_post"]  # the thin post path (test_post.py)
    assert set(caps) == {"host_memory", "cuda_memory", "stream_ordered", "stream_ordered_messages",
                         "imm", "signal", "rma_post"}
