"""Caller errors in arguments raise the documented sluice error naming the argument, never
the binding's bare TypeError (issue 18, class 6): offsets past the end with length=None,
negative or non-integer offsets, lengths and handles, imm values outside 32 bits, and
mistyped names, timeouts and config values."""
import numpy as np
import pytest

import sluice
from conftest import Pair

N = 4096


@pytest.fixture
def ends():
    p = Pair(transport="tcp")
    src = np.zeros(N, dtype=np.uint8)
    dst = np.zeros(N, dtype=np.uint8)
    p.hs = p.a.register(src)
    p.hd = p.b.register(dst, name="dst")
    p.remote = p.ep.remote_region("dst")
    p.keep = (src, dst)
    yield p
    p.close()


def _send_recv(p):
    # every two-sided entry point, sync and async, on the initiator's side
    return [("send", p.ep.send), ("recv", p.ep.recv), ("send", p.ep.send_async), ("recv", p.ep.recv_async)]


@pytest.mark.parametrize("offset", [N + 1, 2 ** 40, 2 ** 64 - 1])
def test_two_sided_offset_past_the_end_is_out_of_range(ends, offset):
    for what, fn in _send_recv(ends):
        with pytest.raises(sluice.OutOfRangeError, match=f"{what}: offset {offset} is past the end"):
            fn(ends.hs, offset)
        with pytest.raises(sluice.OutOfRangeError, match="offset"):
            fn(ends.hs, offset=offset, length=None)


def test_two_sided_offset_at_the_end_is_an_empty_message(ends):
    ends.peer.recv(ends.hd)
    assert ends.ep.send(ends.hs, N).result(10).bytes == 0


@pytest.mark.parametrize("kw,name", [
    ({"offset": -1}, "offset"), ({"offset": 1.5}, "offset"), ({"offset": "0"}, "offset"),
    ({"offset": 2 ** 64}, "offset"), ({"length": -1}, "length"), ({"length": 2.0}, "length"),
    ({"length": 2 ** 64}, "length"),
])
def test_two_sided_bad_offset_or_length_is_invalid_argument(ends, kw, name):
    for what, fn in _send_recv(ends):
        with pytest.raises(sluice.InvalidArgumentError, match=f"{what}: {name}"):
            fn(ends.hs, **kw)


@pytest.mark.parametrize("local", [None, -1, 1.0, "1", 2 ** 64])
def test_two_sided_bad_handle_is_invalid_argument(ends, local):
    for what, fn in _send_recv(ends):
        with pytest.raises(sluice.InvalidArgumentError, match=f"{what}: local handle"):
            fn(local)


def test_two_sided_accepts_numpy_integers(ends):
    ends.peer.recv(ends.hd, np.int64(0), np.uint32(16))
    assert ends.ep.send(ends.hs, np.uint64(8), np.int32(16)).result(10).bytes == 16


def test_two_sided_unknown_handle_with_length_none(ends):
    with pytest.raises(sluice.UnknownHandleError):
        ends.ep.send(9999)


@pytest.mark.parametrize("imm", [-1, 2 ** 32, 2 ** 64, 1.5, "7", None])
def test_write_with_imm_bad_imm_is_invalid_argument(ends, imm):
    batch = [(ends.hs, 0, ends.remote, 0, 8)]
    for fn in (ends.ep.write_with_imm, ends.ep.write_with_imm_async):
        with pytest.raises(sluice.InvalidArgumentError, match="write_with_imm: imm"):
            fn(batch, imm)


@pytest.mark.parametrize("imm", [0, 2 ** 32 - 1, np.uint32(5)])
def test_write_with_imm_edge_values_arrive(ends, imm):
    got = ends.peer.imm_recv()
    ends.ep.write_with_imm([(ends.hs, 0, ends.remote, 0, 8)], imm).result(10)
    assert got.result(10).imm == int(imm)


@pytest.mark.parametrize("op", ["read", "write", "read_async", "write_async"])
def test_batch_tuple_errors(ends, op):
    fn = getattr(ends.ep, op)
    hs, r = ends.hs, ends.remote
    # past the end of either region: out of range, nothing moves
    with pytest.raises(sluice.OutOfRangeError):
        fn([(hs, N, r, 0, 1)])
    with pytest.raises(sluice.OutOfRangeError):
        fn([(hs, 0, r, N - 4, 8)])
    for i, field, bad in [(0, "local handle", -1), (1, "local_offset", -1), (2, "remote handle", 1.5),
                          (3, "remote_offset", None), (4, "length", None), (4, "length", 2 ** 64)]:
        item = [hs, 0, r, 0, 8]
        item[i] = bad
        with pytest.raises(sluice.InvalidArgumentError, match=field):
            fn([tuple(item)])


@pytest.mark.parametrize("op", ["read", "write"])
def test_numpy_batch_errors(ends, op):
    fn = getattr(ends.ep, op)
    hs, r = int(ends.hs), int(ends.remote)
    ok = [hs, 0, r, 0, 8]
    with pytest.raises(sluice.InvalidArgumentError, match="negative"):
        fn(np.array([[hs, -1, r, 0, 8]], dtype=np.int64))
    with pytest.raises(sluice.InvalidArgumentError, match="integers"):
        fn(np.array([ok], dtype=np.float64))
    with pytest.raises(sluice.InvalidArgumentError, match="integers"):
        fn(np.array([ok], dtype=object))
    with pytest.raises(sluice.InvalidArgumentError, match="shape"):
        fn(np.array([ok[:4]], dtype=np.uint64))
    with pytest.raises(sluice.OutOfRangeError):
        fn(np.array([[hs, N, r, 0, 8]], dtype=np.uint64))
    # Any integer dtype that holds the values (region handles are 64-bit: they start at a
    # random point per engine, beyond int32).
    fn(np.array([ok], dtype=np.int64)).result(10)


@pytest.mark.parametrize("op", ["read", "write"])
def test_structured_batch_errors(ends, op):
    fn = getattr(ends.ep, op)
    hs, r = int(ends.hs), int(ends.remote)
    # fields that a cast to uint64 would silently wrap (-1 -> 2**64-1) or truncate (1.5 -> 1)
    signed = np.array([(hs, -8, r, 0, 8)], dtype=[("l", "<i8"), ("lo", "<i8"), ("r", "<i8"), ("ro", "<i8"), ("n", "<i8")])
    with pytest.raises(sluice.InvalidArgumentError, match="batch field 'lo'.*negative"):
        fn(signed)
    floats = np.array([(hs, 0, r, 0, 1.5)], dtype=[("l", "<u8"), ("lo", "<u8"), ("r", "<u8"), ("ro", "<u8"), ("n", "<f8")])
    with pytest.raises(sluice.InvalidArgumentError, match="batch field 'n'"):
        fn(floats)
    past = np.zeros(1, dtype=sluice.BATCH_DTYPE)
    past[0] = (hs, 0, r, N, 8)
    with pytest.raises(sluice.OutOfRangeError):
        fn(past)


def test_remote_region_name_must_be_str(ends):
    with pytest.raises(sluice.InvalidArgumentError, match="remote_region: name"):
        ends.ep.remote_region(5)


def test_future_wait_timeout(ends):
    f = ends.peer.imm_recv()
    with pytest.raises(sluice.InvalidArgumentError, match="wait: timeout"):
        f.wait("1")
    with pytest.raises(sluice.InvalidArgumentError, match="wait: timeout"):
        f.wait(float("nan"))
    assert f.wait(-1) is False and f.wait(0.01) is False
    with pytest.raises(sluice.InvalidArgumentError, match="wait: timeout"):
        f.result([1])
    ends.ep.write_with_imm([(ends.hs, 0, ends.remote, 0, 8)], 3).result(10)
    assert f.wait(float("inf")) is True


@pytest.mark.parametrize("kw,name", [
    ({"channels": "2"}, "channels"), ({"channels": -1}, "channels"), ({"channels": 1.0}, "channels"),
    ({"op_timeout": -1}, "op_timeout"), ({"op_timeout": float("inf")}, "op_timeout"),
    ({"connect_timeout": float("nan")}, "connect_timeout"), ({"connect_timeout": "5"}, "connect_timeout"),
    ({"connect_timeout": 1e300}, "connect_timeout"), ({"chunk_size": -1}, "chunk_size"),
    ({"stripe_threshold": 1.5}, "stripe_threshold"), ({"max_unexpected_bytes": 2 ** 64}, "max_unexpected_bytes"),
    ({"listen": 7000}, "listen"), ({"host_id": 1}, "host_id"), ({"log_level": 3}, "log_level"),
    ({"rdma.hca": ["mlx5"]}, "rdma.hca"), ({"transports": 5}, "transports"),
    ({"transports": ["tcp", 5]}, "transports"),
])
def test_engine_config_types(kw, name):
    with pytest.raises(sluice.InvalidArgumentError, match=name):
        sluice.Engine(**kw)


def test_engine_memory_arguments():
    with sluice.Engine(transports="tcp") as e:
        with pytest.raises(sluice.InvalidArgumentError, match="register: name"):
            e.register(bytearray(8), name=5)
        with pytest.raises(sluice.InvalidArgumentError, match="register: location"):
            e.register(bytearray(8), location=0)
        with pytest.raises(sluice.InvalidArgumentError, match="pointer"):
            e.register((-1, 8))
        with pytest.raises(sluice.InvalidArgumentError, match="length"):
            e.register((4096, -8))
        for bad in (None, -1, 1.0, "1"):
            with pytest.raises(sluice.InvalidArgumentError, match="unregister: handle"):
                e.unregister(bad)
        with pytest.raises(sluice.UnknownHandleError):
            e.unregister(12345)
        with pytest.raises(sluice.InvalidArgumentError, match="allocate: length"):
            e.allocate(-1)
        with pytest.raises(sluice.InvalidArgumentError, match="allocate: length"):
            e.allocate(4.0)
        with pytest.raises(sluice.InvalidArgumentError, match="allocate: name"):
            e.allocate(64, name=1)


def test_engine_peer_arguments():
    with sluice.Engine(transports="tcp") as a, sluice.Engine(transports="tcp") as b:
        with pytest.raises(sluice.InvalidArgumentError, match="connect"):
            a.connect(None)
        with pytest.raises(sluice.InvalidArgumentError, match="connect: transport"):
            a.connect(b.listen_address, transport=1)
        with pytest.raises(sluice.InvalidArgumentError, match="connect: timeout"):
            a.connect(b.listen_address, timeout=-1)
        with pytest.raises(sluice.InvalidArgumentError, match="accept: timeout"):
            b.accept(timeout="1")
        assert b.accept(timeout=-1) is None
        ep = a.connect(b.listen_address, timeout=np.float64(10))
        assert b.accept(timeout=float("inf")) is not None
        ep.close()
