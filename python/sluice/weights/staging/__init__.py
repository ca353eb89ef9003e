"""A staging buffer shared with an inference engine through CUDA IPC.

For inference engines that cannot run a sluice engine themselves and only expose a hook like
vLLM's ``update_weights_from_ipc``: a sidecar process (:class:`StagingServer`) pulls the
published weights with a :class:`~sluice.weights.WeightSubscriber` into one staging tensor on
the inference GPU, split in two slots (a double buffer), and hands the inference process the
buffer once (a CUDA IPC handle; for CPU staging a memfd). Then, per bin of tensors, it sends a
list of ``{name, dtype, shape, offset}``; the inference process (:class:`StagingClient`,
:func:`receive_from_staging`; torch only, no sluice engine) copies each tensor out (or calls
its ``load_weights``-style ``run(pairs)``) and acks. A slot is reused only after its ack; an
error string in an ack aborts the update. While the consumer copies bin i out of one slot, the
sidecar pulls bin i+1 into the other.

Protocol (a local unix socket; every message is a u64 little-endian length and a JSON
object, except the buffer handle)::

    server -> client  {"type": "challenge", "protocol": 1, "nonce": hex}
    client -> server  {"type": "auth", "mac": hmac(key, "client" + nonce), "nonce": hex}
    server -> client  {"type": "hello", "mac": hmac(key, "server" + client nonce), "kind": "cuda"|"cpu",
                       "device", "uuid", "capacity", "slots", "slot_bytes"}
    server -> client  the buffer: a pickled torch reduce_tensor() (cuda) or a memfd (SCM_RIGHTS, cpu)
    client -> server  {"type": "ready", "error": ""}
    per update:
    server -> client  {"type": "begin", "update": u, "version", "bins", "tensors", "nbytes"}
    server -> client  {"type": "bin", "update": u, "bin": k, "bins": n, "slot": s,
                       "tensors": [{"name", "dtype", "shape", "offset"}, ...]}      (offset: in the buffer)
    client -> server  {"type": "ack", "update": u, "bin": k, "error": ""}
                      or, when a copy or run() raised, {..., "error": "ValueError: ...", "where", "traceback"}
    server -> client  {"type": "end", "update": u, "version", ...}  or  {"type": "abort", "update": u, "error"}

The key (random, 32 bytes) travels in :attr:`StagingServer.address`; both sides prove they
hold it (HMAC) before anything else, and the client unpickles the CUDA handle only after.
See docs/weights.md, "A staging buffer shared through CUDA IPC".

The package: ``errors`` (the staging errors), ``_results`` (what an update delivered and what a
receive took in), ``_wire`` (the socket channel, framing, the address, HMAC, fd passing),
``_layout`` (where tensors lie in the buffer), ``server`` (:class:`StagingServer`) and
``client`` (:class:`StagingClient`, :func:`receive_from_staging`).
"""

from __future__ import annotations

from ._layout import ALIGN
from ._results import ReceiveResult, StagingResult
from ._wire import PROTOCOL
from .client import RunCallback, StagingClient, receive_from_staging
from .errors import (ConsumerError, ConsumerLostError, StagingAbortedError, StagingCapacityError, StagingError,
                     StagingServerLostError)
from .server import StagingServer

__all__ = [
    "ALIGN",
    "PROTOCOL",
    "ConsumerError",
    "ConsumerLostError",
    "ReceiveResult",
    "RunCallback",
    "StagingAbortedError",
    "StagingCapacityError",
    "StagingClient",
    "StagingError",
    "StagingResult",
    "StagingServer",
    "StagingServerLostError",
    "receive_from_staging",
]
