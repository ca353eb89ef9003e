"""tcp.rto_max_ms (docs/cluster.md, "Measured recovery"): every tcp channel's socket, on both
sides of an endpoint, carries the cap on TCP's retransmission back-off (TCP_RTO_MAX_MS), so
that a connection that survives a link outage resumes within the cap once the link is back,
and a TCP_USER_TIMEOUT that keeps the kernel's give-up time what it was without the cap (the
kernel models it on the back-off); 0 leaves both at the kernel's defaults. Checked on the
sockets themselves, not by timing."""
import os
import socket

import pytest

import sluice

TCP_RTO_MAX_MS = 44  # Linux >= 6.15


def _sysctl(name, fallback):
    try:
        with open("/proc/sys/net/ipv4/" + name) as f:
            return int(f.read()) or fallback
    except (OSError, ValueError):
        return fallback


def _model_ms(retries, cap):
    # The kernel's tcp_model_timeout: `retries` back-offs from 200 ms up to `cap`.
    thresh = (cap // 200).bit_length() - 1
    if retries <= thresh:
        return ((2 << retries) - 1) * 200
    return ((2 << thresh) - 1) * 200 + (retries - thresh) * cap


def _uncapped_give_up_ms():
    return _model_ms(_sysctl("tcp_retries2", 15), _sysctl("tcp_rto_max_ms", 120000))


def _auto_cap_ms(op_timeout_ms):
    # tcp.rto_max_ms -1: the smallest cap whose tcp_retries2 window probes last 1.5 x op_timeout.
    return next(c for c in range(1000, 120000, 100) if _model_ms(_sysctl("tcp_retries2", 15), c) >= op_timeout_ms * 3 // 2)


def _kernel_cap_ms():
    s = socket.socket()
    try:
        return s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS)
    except OSError:
        return None
    finally:
        s.close()


pytestmark = pytest.mark.skipif(_kernel_cap_ms() is None, reason="kernel without TCP_RTO_MAX_MS (Linux < 6.15)")


def _channel_caps(port):
    """(TCP_RTO_MAX_MS, TCP_USER_TIMEOUT) of this process's connected tcp sockets with `port` at either end: an
    engine's channels to (or accepted by) the listener on `port`."""
    caps = []
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # not a socket (or gone)
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue  # a listener
            if port in (peer[1], s.getsockname()[1]):
                caps.append((s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS),
                             s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)))
    return caps


@pytest.mark.parametrize("kw,want", [
    ({}, _auto_cap_ms(30000)),                  # auto, the default op_timeout: 3600 with the default sysctls
    ({"op_timeout": 5}, 1000),                  # auto: the kernel's floor
    ({"op_timeout": 10}, _auto_cap_ms(10000)),  # auto: just above it (1100)
    ({"tcp.rto_max_ms": 3000}, 3000),
    ({"tcp.rto_max_ms": 0}, "kernel"),
])
def test_every_channel_socket_carries_the_cap(kw, want):
    kernel_default = _kernel_cap_ms()  # a fresh socket: the sysctl net.ipv4.tcp_rto_max_ms
    with sluice.Engine(transports="tcp", channels=3, **kw) as a, sluice.Engine(transports="tcp", channels=3, **kw) as b:
        a.connect(b.listen_address)
        assert b.accept(timeout=10) is not None
        port = int(b.listen_address.rsplit(":", 1)[1])
        caps = _channel_caps(port)
        assert len(caps) == 6, caps  # 3 channels, each seen from both ends
        if want == "kernel":
            assert caps == [(kernel_default, 0)] * 6
        else:
            assert caps == [(want, _uncapped_give_up_ms())] * 6


@pytest.mark.parametrize("bad", [500, 999, 120001, -2])
def test_out_of_the_kernels_range_is_refused(bad):
    with pytest.raises(sluice.InvalidArgumentError, match="tcp.rto_max_ms"):
        sluice.Engine(transports="tcp", **{"tcp.rto_max_ms": bad})
