"""A Mooncake TransferEngine peer in its own process, driven over stdin/stdout (JSON lines).

    python peer.py sluice|mooncake SIZE

``sluice`` uses ``sluice.compat.mooncake.TransferEngine``, ``mooncake`` Mooncake's own wheel
(``mooncake.engine``), so that one test script checks both. The peer initialises with
P2PHANDSHAKE on 127.0.0.1, registers a zeroed buffer of SIZE bytes and prints
``{"port", "addr", "size", "pid"}``; then it answers one JSON reply per command line.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def engine_class(impl: str):
    if impl == "sluice":
        from sluice.compat.mooncake import TransferEngine
    elif impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        raise SystemExit(f"peer.py: unknown implementation {impl!r}")
    return TransferEngine


def main() -> int:
    impl, size = sys.argv[1], int(sys.argv[2])
    te = engine_class(impl)()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"peer.py: initialize returned {rc}")
    keep = {}  # addr -> array: the memory we registered stays alive
    buf = np.zeros(size, dtype=np.uint8)
    if te.register_memory(buf.ctypes.data, size) != 0:
        raise SystemExit("peer.py: register_memory failed")
    keep[buf.ctypes.data] = buf

    def view(addr: int, length: int) -> np.ndarray:
        for base, arr in keep.items():
            if base <= addr and addr + length <= base + arr.nbytes:
                return arr[addr - base:addr - base + length]
        raise KeyError(f"{addr:#x}+{length} is not in a buffer of this peer")

    print(json.dumps({"port": te.get_rpc_port(), "addr": buf.ctypes.data, "size": size}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "fill":
            view(req["addr"], req["length"])[:] = req["value"]
            reply = {}
        elif cmd == "sha":  # sha256 of each [addr, addr+length) in req["spans"]
            reply = {"sha": [hashlib.sha256(view(a, n).tobytes()).hexdigest() for a, n in req["spans"]]}
        elif cmd == "register":  # layers of one size, registered in one batch (vLLM's KV caches)
            arrs = [np.zeros(req["size"], dtype=np.uint8) for _ in range(req["count"])]
            addrs = [a.ctypes.data for a in arrs]
            rc = te.batch_register_memory(addrs, [req["size"]] * len(arrs))
            for a in arrs:
                keep[a.ctypes.data] = a
            reply = {"rc": rc, "addrs": addrs}
        elif cmd == "notifies":
            reply = {"notifies": [[n.name, n.msg] for n in te.get_notifies()]}
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
