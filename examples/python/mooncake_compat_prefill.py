"""A Mooncake program, unchanged, on Sluice: a prefill process pushes KV-cache blocks into a
decode process the way vLLM's MooncakeConnector does (one ``batch_transfer_sync_write`` of
many blocks, remote memory named by the decode side's raw addresses).

    SLUICE_MOONCAKE_COMPAT=1 python examples/python/mooncake_compat_prefill.py

The variable makes ``import mooncake.engine`` resolve to ``sluice.compat.mooncake`` in this
process and in the decode process it spawns (the hook the sluice wheel installs). Without the
variable this script sets it and starts itself again, so that it also runs as a plain example.
Everything below the first block is ordinary Mooncake code.
"""

import os
import sys

if __name__ == "__main__" and os.environ.get("SLUICE_MOONCAKE_COMPAT") != "1":
    os.environ["SLUICE_MOONCAKE_COMPAT"] = "1"
    os.execv(sys.executable, [sys.executable] + sys.argv)

# ---------------------------------------------------------------- Mooncake code from here on

import multiprocessing as mp  # noqa: E402

import numpy as np  # noqa: E402
from mooncake.engine import TransferEngine  # noqa: E402

LAYERS, BLOCKS, BLOCK_BYTES = 8, 128, 32 << 10   # 32 MiB of KV cache per side


def kv_cache(seed=None):
    if seed is None:
        return [np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(LAYERS)]


def decode(to_prefill, from_prefill):
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    layers = kv_cache()
    assert engine.batch_register_memory([t.ctypes.data for t in layers], [t.nbytes for t in layers]) == 0
    # The connector's side channel: where to write (session "ip:port", layer base addresses).
    to_prefill.put((f"127.0.0.1:{engine.get_rpc_port()}", [t.ctypes.data for t in layers]))
    block_map, seed = from_prefill.get(timeout=60)   # "done": which blocks went where
    expect = kv_cache(seed)
    ok = all(np.array_equal(layers[layer][d * BLOCK_BYTES:(d + 1) * BLOCK_BYTES],
                            expect[layer][s * BLOCK_BYTES:(s + 1) * BLOCK_BYTES])
             for layer in range(LAYERS) for s, d in block_map)
    to_prefill.put(ok)


def main():
    import mooncake.engine

    backend = "Sluice facade" if getattr(mooncake.engine, "__sluice_compat__", False) else "Mooncake"
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=decode, args=(to_prefill, from_prefill))
    peer.start()

    engine = TransferEngine()
    # protocol/device are hints for the facade: a host without an RDMA NIC still initialises.
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    seed = 1234
    layers = kv_cache(seed)
    assert engine.batch_register_memory([t.ctypes.data for t in layers], [t.nbytes for t in layers]) == 0
    session, remote_layers = to_prefill.get(timeout=60)

    # A request's prefill blocks 10..73 go to scattered decode blocks; contiguous runs on both
    # sides become one piece each, as the connector groups them.
    rng = np.random.default_rng(7)
    src_blocks = list(range(10, 74))
    dst_blocks = sorted(int(b) for b in rng.choice(BLOCKS, len(src_blocks), replace=False))
    runs = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    src, dst, lengths = [], [], []
    for layer in range(LAYERS):
        for s, d, n in runs:
            src.append(layers[layer].ctypes.data + s * BLOCK_BYTES)
            dst.append(remote_layers[layer] + d * BLOCK_BYTES)
            lengths.append(n * BLOCK_BYTES)
    rc = engine.batch_transfer_sync_write(session, src, dst, lengths)
    assert rc == 0, f"batch_transfer_sync_write returned {rc}"
    from_prefill.put((list(zip(src_blocks, dst_blocks)), seed))
    verified = to_prefill.get(timeout=60)
    peer.join(timeout=30)
    print(f"{backend}: pushed {len(src_blocks)} blocks x {LAYERS} layers "
          f"({sum(lengths) >> 20} MiB in {len(lengths)} pieces) to {session}; "
          f"decode checked the bytes: {'ok' if verified else 'MISMATCH'}")
    return 0 if verified and peer.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
