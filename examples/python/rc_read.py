"""One-sided READ between two engines on this host: blocking, then several in flight.

Mirrors DLSlime's rc_read example. Run: python examples/python/rc_read.py
"""
import sys

import numpy as np

import sluice


def main() -> int:
    with sluice.Engine() as target, sluice.Engine() as initiator:
        src = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        target.register(src, name="kv-cache")
        local = initiator.register(dst)

        ep = initiator.connect(target.listen_address)
        remote = ep.remote_region("kv-cache")
        print(f"connected over {ep.transport} with {ep.channels} channel(s)")

        # Synchronous: submit one batch and wait for it.
        half = src.nbytes // 2
        f = ep.read([(local, 0, remote, 0, half)])
        f.wait()
        print(f"sync read: {f.bytes} bytes in {f.elapsed * 1e6:.0f} us")

        # Asynchronous: several batches in flight, each of 16 pieces, then wait for all.
        piece = half // 64
        futures = []
        for k in range(4):
            batch = [(local, half + (k * 16 + j) * piece, remote, half + (k * 16 + j) * piece, piece)
                     for j in range(16)]
            futures.append(ep.read(batch))
        sluice.wait_all(futures)
        print(f"async reads: {sum(f.bytes for f in futures)} bytes in {len(futures)} batches")

        if not np.array_equal(src, dst):
            print("FAILED: data mismatch", file=sys.stderr)
            return 1
    print("rc_read OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
