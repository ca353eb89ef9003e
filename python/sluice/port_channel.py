"""The GPU-initiated port channel from Python (docs/port-channel.md).

A :class:`ProxyService` owns request FIFOs and worker threads that turn producers' requests
(put / signal / flush) into the engine's thin post path. Producers are GPU threads (pass
``channel.handle_bytes()`` to a kernel, which takes it by value as a
``sluice::PortChannelDeviceHandle``) or, with ``producers="host"``, Python or C++ threads
calling the channel's methods::

    proxy = ProxyService(engine, fifo_depth=64)
    dst = proxy.add_remote_memory(ep, ep.remote_region("buf"))
    src = proxy.add_memory(local)
    ch = proxy.add_channel(ep, dst, src, remote_semaphore=(ep.remote_region("sem"), 0),
                           local_semaphore=(sem_handle, 0))
    proxy.start()
    ch.put(0, 0, 4096, signal=True); ch.flush()
"""

from __future__ import annotations

from typing import Optional, Tuple

from . import _sluice
from .errors import _from_code

__all__ = ["ProxyService", "PortChannel"]


class PortChannel:
    """One channel of a :class:`ProxyService` (an endpoint, default memories, a semaphore pair)."""

    __slots__ = ("_ch", "_proxy")

    def __init__(self, core, proxy: "ProxyService"):
        self._ch = core
        self._proxy = proxy  # keeps the proxy (and its FIFO) alive while the channel is used

    @property
    def id(self) -> int:
        return self._ch.id

    def error(self) -> Optional[Exception]:
        """None while the channel works, else the error that failed it (e.g. PeerLostError)."""
        code, message = self._ch.status()
        return None if code == 0 else _from_code(code, message)

    def handle_bytes(self) -> bytes:
        """The device handle, ``PortChannel.handle_size`` bytes, for a kernel argument."""
        return self._ch.handle_bytes()

    handle_size: int = _sluice.PortChannel.handle_size

    # Host producers only (producers="host"); each raises the channel's error on failure and
    # SluiceTimeoutError when its bound runs out.
    def put(self, dst_offset: int, src_offset: int, size: int, *, dst: Optional[int] = None,
            src: Optional[int] = None, signal: bool = False) -> None:
        self._ch.put(dst_offset, src_offset, size, dst, src, signal)

    def signal(self) -> None:
        self._ch.signal()

    def flush(self, timeout: float = 10.0) -> None:
        self._ch.flush(timeout)

    def wait(self, timeout: float = 10.0) -> None:
        self._ch.wait(timeout)

    def poll(self) -> bool:
        return self._ch.poll()

    def __repr__(self) -> str:
        return f"<sluice.PortChannel {self.id} error={self.error()!r}>"


class ProxyService:
    """Serves any number of channels with ``workers`` threads, each owning one FIFO of
    ``fifo_depth`` (a power of two) requests. ``producers``: "host" or "cuda"."""

    def __init__(self, engine, *, workers: int = 1, fifo_depth: int = 512, producers: str = "host",
                 cuda_device: int = 0, idle_spin: float = 200e-6, idle_sleep: float = 50e-6,
                 push_timeout: float = 10.0):
        self._engine = engine
        self._core = _sluice.ProxyService(engine._core, workers, fifo_depth, producers, cuda_device,
                                          idle_spin, idle_sleep, push_timeout)

    def add_memory(self, handle: int) -> int:
        """A local region (a handle from Engine.register / allocate) as a put source."""
        return self._core.add_memory(int(handle))

    def add_remote_memory(self, endpoint, remote: int) -> int:
        """A region of ``endpoint``'s peer as a put destination."""
        return self._core.add_remote_memory(endpoint._ep, int(remote))

    def add_channel(self, endpoint, dst: int, src: int, *, remote_semaphore: Tuple[int, int],
                    local_semaphore: Tuple[int, int], worker: int = -1) -> PortChannel:
        rsem, roff = remote_semaphore
        lsem, loff = local_semaphore
        core = self._core.add_channel(endpoint._ep, dst, src, int(rsem), roff, int(lsem), loff, worker)
        return PortChannel(core, self)

    def start(self) -> None:
        self._core.start()

    def stop(self) -> None:
        self._core.stop()

    def stats(self) -> dict:
        return self._core.stats()

    @property
    def channels(self) -> int:
        return self._core.channels

    def __enter__(self) -> "ProxyService":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
