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


def _uncapped_give_up_ms():
    # The kernel's tcp_model_timeout with rto_min 200 ms and its default cap.
    retries, rto_max = _sysctl("tcp_retries2", 15), _sysctl("tcp_rto_max_ms", 120000)
    thresh = (rto_max // 200).bit_length() - 1
    if retries <= thresh:
        return ((2 << retries) - 1) * 200
    return ((2 << thresh) - 1) * 200 + (retries - thresh) * rto_max


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


@pytest.mark.parametrize("option,want", [(None, 1000), (3000, 3000), (0, "kernel")])
def test_every_channel_socket_carries_the_cap(option, want):
    kw = {} if option is None else {"tcp.rto_max_ms": option}
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


@pytest.mark.parametrize("bad", [500, 999, 120001, -1])
def test_out_of_the_kernels_range_is_refused(bad):
    with pytest.raises(sluice.InvalidArgumentError, match="tcp.rto_max_ms"):
        sluice.Engine(transports="tcp", **{"tcp.rto_max_ms": bad})
