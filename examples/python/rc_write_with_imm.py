"""WRITE with immediate data: the target learns that the bytes have landed through one
imm_recv completion carrying a 32-bit value.

Run: python examples/python/rc_write_with_imm.py
"""
import sys

import numpy as np

import sluice


def main() -> int:
    with sluice.Engine() as target, sluice.Engine() as initiator:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        target.register(buf, name="buf")
        data = np.full(1 << 20, 0xAB, dtype=np.uint8)
        local = initiator.register(data)

        ep = initiator.connect(target.listen_address)
        peer = target.accept(timeout=5)  # the target's side of the same endpoint
        assert peer is not None, "no endpoint accepted"
        imm_future = peer.imm_recv()  # post before or after: imms are queued in order

        w = ep.write_with_imm([(local, 0, ep.remote_region("buf"), 0, data.nbytes)], imm=0xC0FFEE)
        w.wait()
        imm_future.wait(timeout=10)
        print(f"target got imm {imm_future.imm:#x} after {w.bytes} bytes")

        if imm_future.imm != 0xC0FFEE or not np.array_equal(buf, data):
            print("FAILED", file=sys.stderr)
            return 1
    print("rc_write_with_imm OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
