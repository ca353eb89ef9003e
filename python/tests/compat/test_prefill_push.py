"""A vLLM-MooncakeConnector-style prefill push between two processes, bytes checked.

The decode side (a peer process) registers one KV-cache tensor per layer with
``batch_register_memory`` and hands out their addresses; the prefill side (this process)
registers its own, then, per request, turns (prefill block ids -> decode block ids) into runs of
contiguous blocks per layer and sends them with ONE ``batch_transfer_sync_write`` per request,
from several threads at once (vLLM's sender pool). Runs against the facade and against
Mooncake's wheel.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from mc_helpers import TE, engine, impl, make_peer, peer  # noqa: F401 (fixtures)

LAYERS, BLOCKS, BLOCK = 4, 64, 16 << 10
REQUESTS, BLOCKS_PER_REQUEST = 4, 12


def runs(src_ids, dst_ids):
    """Group (src, dst) block pairs into runs where both sides are contiguous, as the
    connector does to send fewer, larger pieces: [(src_first, dst_first, count)]."""
    out = []
    for s, d in zip(src_ids, dst_ids):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return out


def test_prefill_push_many_blocks(engine, peer):
    got = peer.cmd(cmd="register", size=BLOCKS * BLOCK, count=LAYERS)
    assert got["rc"] == 0
    remote_layers = got["addrs"]

    rng = np.random.default_rng(11)
    local_layers = [rng.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8) for _ in range(LAYERS)]
    assert engine.batch_register_memory([a.ctypes.data for a in local_layers], [a.nbytes for a in local_layers]) == 0

    # Disjoint decode blocks per request; prefill blocks partly contiguous so that runs form.
    dst_all = rng.permutation(BLOCKS)[:REQUESTS * BLOCKS_PER_REQUEST]
    requests = []
    for r in range(REQUESTS):
        dst = sorted(int(x) for x in dst_all[r * BLOCKS_PER_REQUEST:(r + 1) * BLOCKS_PER_REQUEST])
        start = int(rng.integers(0, BLOCKS - BLOCKS_PER_REQUEST))
        src = list(range(start, start + BLOCKS_PER_REQUEST))
        requests.append((src, dst))

    results = [None] * REQUESTS

    def send(r):
        src, dst = requests[r]
        bufs, peers, lens = [], [], []
        for layer in range(LAYERS):
            for s, d, n in runs(src, dst):
                bufs.append(local_layers[layer].ctypes.data + s * BLOCK)
                peers.append(remote_layers[layer] + d * BLOCK)
                lens.append(n * BLOCK)
        results[r] = engine.batch_transfer_sync_write(peer.target, bufs, peers, lens)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [0] * REQUESTS

    expect = {}
    for src, dst in requests:
        for s, d in zip(src, dst):
            expect[d] = s
    zero = hashlib.sha256(bytes(BLOCK)).hexdigest()
    for layer in range(LAYERS):
        spans = [(remote_layers[layer] + b * BLOCK, BLOCK) for b in range(BLOCKS)]
        shas = peer.sha(spans)
        for b in range(BLOCKS):
            if b in expect:
                s = expect[b]
                want = hashlib.sha256(local_layers[layer][s * BLOCK:(s + 1) * BLOCK].tobytes()).hexdigest()
            else:
                want = zero  # never written: untouched
            assert shas[b] == want, f"layer {layer} block {b}"
    assert engine.batch_unregister_memory([a.ctypes.data for a in local_layers]) == 0
