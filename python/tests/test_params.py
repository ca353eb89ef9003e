"""The parameter table from Python: sluice.list_params() and Engine(**options) pass-through
(values parsed by the C++ table, unknown names and namespaces refused naming the key)."""
import pytest

import sluice


def _names():
    return {p["name"] for p in sluice.list_params()}


def test_list_params_is_the_table():
    params = sluice.list_params()
    assert isinstance(params, list) and params
    for p in params:
        assert set(p) == {"name", "env", "default", "doc", "scope"}, p
        assert p["env"].startswith("SLUICE_"), p
        assert p["doc"], p
        assert p["scope"] in ("engine", "process", "test"), p
    names = [p["name"] for p in params]
    assert names == sorted(names) and len(set(names)) == len(names)
    by_name = {p["name"]: p for p in params}
    for name, env, default in (("channels", "SLUICE_CHANNELS", "2"), ("chunk_size", "SLUICE_CHUNK_SIZE", "4194304"),
                               ("busy_wait_us", "SLUICE_BUSY_WAIT_US", "-1"),
                               ("recv_timeout_ms", "SLUICE_RECV_TIMEOUT_MS", "30000"),
                               ("log_level", "SLUICE_LOG_LEVEL", "warn")):
        assert by_name[name]["env"] == env and by_name[name]["default"] == default, by_name[name]


def test_options_pass_through_to_the_table():
    # Parameters without a named argument (busy_wait_us and recv_timeout_ms were unreachable
    # from Python before the table) are keyword options, parsed by the C++ parser; the engine
    # runs with them.
    with sluice.Engine(transports="tcp", busy_wait_us=0, recv_timeout_ms="1500", max_unexpected_messages="64K",
                       max_queued_responses=128) as a, \
            sluice.Engine(transports="tcp") as b:
        ep = a.connect(b.listen_address)
        assert b.accept(timeout=10) is not None
        src = bytearray(b"x" * 64)
        dst = bytearray(64)
        hs = a.register(src)
        b.register(dst, name="dst")
        ep.write([(hs, 0, ep.remote_region("dst"), 0, 64)]).result(10)
        assert dst == src


def test_recv_timeout_option():
    # recv_timeout_ms=200 reaches the engine: a recv nothing matches completes with kTimeout
    # (the default would hold it for 30 s).
    with sluice.Engine(transports="tcp", recv_timeout_ms=200) as a, sluice.Engine(transports="tcp") as b:
        ep = a.connect(b.listen_address)
        assert b.accept(timeout=10) is not None
        f = ep.recv(a.register(bytearray(64)))
        # wait() raises the op's error; a wait that ran out would return False instead
        with pytest.raises(sluice.SluiceTimeoutError, match="200 ms"):
            f.wait(10)


@pytest.mark.parametrize("kw,name", [
    ({"chanels": 2}, "chanels"),                       # unknown parameter
    ({"warp.drive": "9"}, "warp.drive"),               # namespace no transport owns
    ({"busy_wait_us": "-2"}, "busy_wait_us"),          # out of range, parsed in C++
    ({"recv_timeout_ms": "1.5"}, "recv_timeout_ms"),   # strict: no fractions
    ({"recv_timeout_ms": 1.5}, "recv_timeout_ms"),     # floats are not passed as text
    ({"max_unexpected_messages": None}, "max_unexpected_messages"),
    ({"log_level": "loud"}, "log_level"),
    ({"max_pending_accepts": True}, "max_pending_accepts"),  # a bool is not a count
])
def test_bad_options_name_the_key(kw, name):
    with pytest.raises(sluice.InvalidArgumentError, match=name.replace(".", r"\.")):
        sluice.Engine(transports="tcp", **kw)


def test_namespaced_options_reach_their_transport():
    names = _names()
    if "rdma.hca" not in names:
        pytest.skip("the rdma transport is not in this build")
    with pytest.raises(sluice.InvalidArgumentError, match=r"rdma\.nosuch"):
        sluice.Engine(transports="tcp", **{"rdma.nosuch": "1"})
    with pytest.raises(sluice.InvalidArgumentError, match=r"rdma\.gid_index"):
        sluice.Engine(transports="tcp", **{"rdma.gid_index": "x"})
    # A valid rdma option on an engine that does not start rdma is checked, then ignored.
    with sluice.Engine(transports="tcp", **{"rdma.hca": "=mlx5_0", "rdma.gid_index": 3}):
        pass


def test_environment_overrides_options(monkeypatch):
    monkeypatch.setenv("SLUICE_RECV_TIMEOUT_MS", "nope")
    with pytest.raises(sluice.InvalidArgumentError, match="SLUICE_RECV_TIMEOUT_MS"):
        sluice.Engine(transports="tcp", recv_timeout_ms=100)


def test_given_twice():
    with pytest.raises(sluice.InvalidArgumentError, match="op_timeout_ms"):
        sluice.Engine(transports="tcp", op_timeout=1.0, op_timeout_ms=1000)
