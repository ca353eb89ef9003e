"""What the Sluice facade promises beyond (or instead of) Mooncake's behaviour.

These differ from Mooncake 0.3.13 on purpose (docs/mooncake-compat.md, "Differences"):
a batch with one bad range moves nothing; a local buffer must be registered (Mooncake's TCP
transport reads unregistered memory); a bad argument or an unknown batch id returns an error
code instead of crashing the process.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from mc_helpers import Peer, registered
from sluice.compat import _cuda_pointer
from sluice.compat.mooncake import TransferEngine


@pytest.fixture(scope="module")
def speer():
    p = Peer("sluice", 1 << 20)
    yield p
    p.close()


@pytest.fixture
def te():
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    yield t
    t.close()


def test_batch_with_one_bad_range_moves_nothing(te, speer):
    speer.fill(0, speer.addr, 8192)
    src = registered(te, 8192, np.full(8192, 7, np.uint8))
    rc = te.batch_transfer_sync_write(speer.target, [src.ctypes.data, src.ctypes.data + 4096],
                                      [speer.addr, speer.addr + speer.size - 16], [4096, 4096])
    assert rc == -1
    assert speer.sha([(speer.addr, 8192)]) == [hashlib.sha256(bytes(8192)).hexdigest()]


def test_unregistered_local_buffer_fails(te, speer, caplog):
    loose = np.ones(4096, np.uint8)
    with caplog.at_level(logging.ERROR, logger="sluice.compat.mooncake"):
        assert te.transfer_sync_write(speer.target, loose.ctypes.data, speer.addr, 16) == -1
    assert "not inside one region registered" in caplog.text


def test_remote_miss_is_logged_with_the_peers_regions(te, speer, caplog):
    src = registered(te, 64)
    with caplog.at_level(logging.ERROR, logger="sluice.compat.mooncake"):
        assert te.transfer_sync_read(speer.target, src.ctypes.data, 0x1000, 16) == -1
    assert f"no region registered by {speer.target} covers [0x1000, 0x1010)" in caplog.text


@pytest.mark.parametrize("call", [
    lambda t: t.transfer_sync_write("127.0.0.1:1", "not an address", 0, 16),
    lambda t: t.batch_transfer_sync_write("127.0.0.1:1", None, [1], [1]),
    lambda t: t.batch_transfer_sync_read("127.0.0.1:1", [1], [1], [-5]),
    lambda t: t.register_memory(-1, 16),
    lambda t: t.unregister_memory("x"),
    lambda t: t.batch_register_memory([1, 2], [3]),
    lambda t: t.get_batch_transfer_status([123456789]),
    lambda t: t.transfer_check_status(987654321),
    lambda t: t.transfer_sync(  # an opcode that is neither Read nor Write
        "127.0.0.1:1", 0, 0, 16, 7),
])
def test_bad_arguments_return_an_error_code(te, call):
    rc = call(te)
    assert isinstance(rc, int) and rc < 0


def test_calls_before_initialize_fail_cleanly():
    t = TransferEngine()
    buf = np.zeros(64, np.uint8)
    assert t.get_rpc_port() == -1
    assert t.register_memory(buf.ctypes.data, 64) == -1
    assert t.transfer_sync_write("127.0.0.1:1", buf.ctypes.data, 0, 16) == -1
    assert t.batch_transfer_async_read("127.0.0.1:1", [buf.ctypes.data], [0], [16]) == 0
    assert t.send_probe("127.0.0.1:1") == -1


def test_initialize_rules(caplog):
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1  # no metadata servers
    with caplog.at_level(logging.INFO, logger="sluice.compat.mooncake"):
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert "runs " in caplog.text and "tcp otherwise" in caplog.text  # the choice is logged
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # only once
    t.close()


def test_a_restarted_peer_is_reached_again(te):
    # The endpoint to a dead peer is dropped, so a new process at a new port works at once
    # and the dead target keeps failing (Mooncake forgets a failed segment the same way).
    first = Peer("sluice", 1 << 16)
    src = registered(te, 4096, np.full(4096, 3, np.uint8))
    assert te.transfer_sync_write(first.target, src.ctypes.data, first.addr, 4096) == 0
    first.kill()
    first.proc.wait(timeout=10)
    assert te.transfer_sync_write(first.target, src.ctypes.data, first.addr, 4096) == -1
    second = Peer("sluice", 1 << 16)
    try:
        assert te.transfer_sync_write(second.target, src.ctypes.data, second.addr, 4096) == 0
        assert second.sha([(second.addr, 4096)]) == [hashlib.sha256(src.tobytes()).hexdigest()]
    finally:
        second.close()
        first.close()


def test_managed_buffer(te, speer):
    addr = te.allocate_managed_buffer(8192)
    assert addr != 0
    assert te.write_bytes_to_buffer(addr, b"hello mooncake", 14) == 0
    assert te.read_bytes_from_buffer(addr, 14) == b"hello mooncake"
    assert te.transfer_sync_write(speer.target, addr, speer.addr, 14) == 0
    assert speer.sha([(speer.addr, 14)]) == [hashlib.sha256(b"hello mooncake").hexdigest()]
    assert te.free_managed_buffer(addr, 8192) == 0
    assert te.free_managed_buffer(addr, 8192) == -1


def test_host_pointer_is_host():
    assert _cuda_pointer.location_of(np.zeros(16, np.uint8).ctypes.data) == "host"


def test_get_engine_says_why_it_cannot():
    with pytest.raises(NotImplementedError, match="Mooncake Store and EP"):
        TransferEngine().get_engine()


def test_dropping_the_object_closes_its_engine():
    # Mooncake's users never close an engine; they drop it. The facade's accept thread must
    # not keep it alive.
    import gc

    t = TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    inner = t._engine
    del t
    gc.collect()
    assert inner.closed
