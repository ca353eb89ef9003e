"""Two-sided SEND/RECV: the k-th send is received by the k-th posted recv.

Run: python examples/python/rc_send_recv.py
"""
import sys

import numpy as np

import sluice


def main() -> int:
    with sluice.Engine() as a, sluice.Engine() as b:
        out = np.frombuffer(b"".join(b"message %03d|" % i for i in range(8)), dtype=np.uint8).copy()
        inbox = np.zeros(4096, dtype=np.uint8)
        hout = a.register(out)
        hin = b.register(inbox)

        ep_a = a.connect(b.listen_address)
        ep_b = b.accept(timeout=5)
        assert ep_b is not None

        msg = 12  # each message is 12 bytes
        recvs = [ep_b.recv(hin, i * 64, 64) for i in range(8)]  # post receives (64-byte slots)
        sends = [ep_a.send(hout, i * msg, msg) for i in range(8)]
        sluice.wait_all(sends + recvs, timeout=10)

        ok = True
        for i, r in enumerate(recvs):
            got = inbox[i * 64: i * 64 + r.bytes].tobytes()
            ok &= got == b"message %03d|" % i
        print("received:", [inbox[i * 64: i * 64 + r.bytes].tobytes().decode() for i, r in enumerate(recvs)][:3], "...")

        # And back the other way, with asyncio-free blocking calls.
        reply = np.frombuffer(b"ack", dtype=np.uint8).copy()
        hreply, hback = b.register(reply), a.register(np.zeros(16, dtype=np.uint8))
        r = ep_a.recv(hback)  # whole region
        ep_b.send(hreply).wait()
        ok &= r.result(timeout=10).bytes == 3
        if not ok:
            print("FAILED", file=sys.stderr)
            return 1
    print("rc_send_recv OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
