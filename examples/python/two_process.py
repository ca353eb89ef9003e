"""Two processes on one host, connected through the handshake listener.

The parent starts a target process, which registers a buffer, prints its listener address
and serves until told to stop. The parent connects to that address, reads the target's
buffer, writes a reply into it, and checks both.

Run: python examples/python/two_process.py
"""
import subprocess
import sys

import numpy as np

import sluice

N = 4 << 20


def pattern():
    return (np.arange(N, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def target() -> int:
    with sluice.Engine(listen="127.0.0.1:0") as engine:
        buf = pattern()
        engine.register(buf, name="shared")
        print(engine.listen_address, flush=True)
        ep = engine.accept(timeout=30)
        if ep is None:
            return 3
        imm = ep.imm_recv().result(timeout=30).imm  # the initiator's "done writing"
        ok = imm == 7 and bool(np.all(buf[: N // 2] == 0x5A))
        sys.stdin.readline()  # wait for the parent to finish reading our verdict
        print("TARGET OK" if ok else "TARGET FAILED", flush=True)
        return 0 if ok else 1


def initiator() -> int:
    child = subprocess.Popen([sys.executable, __file__, "--target"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        print(f"target listening on {address}")
        with sluice.Engine() as engine:
            dst = np.zeros(N, dtype=np.uint8)
            src = np.full(N // 2, 0x5A, dtype=np.uint8)
            hd, hs = engine.register(dst), engine.register(src)
            ep = engine.connect(address)
            remote = ep.remote_region("shared")
            ep.read([(hd, 0, remote, 0, N)]).result(timeout=30)
            read_ok = np.array_equal(dst, pattern())
            ep.write_with_imm([(hs, 0, remote, 0, N // 2)], 7).result(timeout=30)
            print(f"read {N} bytes over {ep.transport}: {'ok' if read_ok else 'MISMATCH'}")
            child.stdin.write("\n")
            child.stdin.flush()
            verdict = child.stdout.readline().strip()
        rc = child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    print(verdict)
    if not read_ok or verdict != "TARGET OK" or rc != 0:
        print("FAILED", file=sys.stderr)
        return 1
    print("two_process OK")
    return 0


if __name__ == "__main__":
    sys.exit(target() if "--target" in sys.argv else initiator())
