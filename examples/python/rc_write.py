"""One-sided WRITE into a peer's engine-allocated (shareable) buffer.

Run: python examples/python/rc_write.py
"""
import sys

import numpy as np

import sluice


def main() -> int:
    with sluice.Engine() as target, sluice.Engine() as initiator:
        inbox = target.allocate(1 << 20, name="inbox")  # numpy uint8 view + handle
        data = np.resize(np.frombuffer(b"sluice!", dtype=np.uint8), 1 << 20)
        local = initiator.register(data)

        ep = initiator.connect(target.listen_address)
        remote = ep.remote_region("inbox")
        # Batch as a structured numpy array: one assignment per 64 KiB piece.
        n, piece = 16, 64 << 10
        batch = np.zeros(n, dtype=sluice.BATCH_DTYPE)
        batch["local"], batch["remote"], batch["length"] = local, remote, piece
        batch["local_offset"] = batch["remote_offset"] = np.arange(n) * piece
        f = ep.write(batch).result()
        print(f"wrote {f.bytes} bytes over {ep.transport} in {f.elapsed * 1e6:.0f} us")

        if not np.array_equal(inbox.buffer[: n * piece], data[: n * piece]):
            print("FAILED: data mismatch", file=sys.stderr)
            return 1
    print("rc_write OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
