"""READ with asyncio: many reads awaited concurrently, completions drive the event loop
(no thread per operation). Mirrors DLSlime's coroutine example.

Run: python examples/python/rc_read_coroutine.py
"""
import asyncio
import sys

import numpy as np

import sluice


async def fetch(ep, local, remote, offset, length):
    f = await ep.read_async([(local, offset, remote, offset, length)])
    return f.bytes


async def main() -> int:
    with sluice.Engine() as target, sluice.Engine() as initiator:
        src = np.arange(4 << 20, dtype=np.uint32).view(np.uint8)
        dst = np.zeros_like(src)
        target.register(src, name="weights")
        local = initiator.register(dst)
        ep = initiator.connect(target.listen_address)
        remote = ep.remote_region("weights")

        chunk = 256 << 10
        tasks = [fetch(ep, local, remote, off, chunk) for off in range(0, src.nbytes, chunk)]
        moved = sum(await asyncio.gather(*tasks))
        print(f"{len(tasks)} concurrent reads, {moved} bytes")

        # A Future is awaitable too.
        f = await ep.read([(local, 0, remote, 0, 4096)])
        assert f.bytes == 4096

        if moved != src.nbytes or not np.array_equal(src, dst):
            print("FAILED: data mismatch", file=sys.stderr)
            return 1
    print("rc_read_coroutine OK")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
