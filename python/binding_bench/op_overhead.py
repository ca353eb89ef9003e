"""Per-call cost of the sluice binding next to the same calls in C++ (op_overhead.cpp).

  cmake -S . -B build-py -G Ninja -DSLUICE_BUILD_PYTHON=ON -DSLUICE_PY_OVERHEAD_BENCH=ON
  cmake --build build-py && build-py/python/sluice-op-overhead
  python3 python/binding_bench/op_overhead.py        # with sluice importable
"""
import time

import numpy as np

import sluice


def ns_per(n, f, repeat=5):
    best = 1e30
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for i in range(n):
            f(i)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main():
    with sluice.Engine(channels=1) as a, sluice.Engine(channels=1) as b:
        src, dst = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        b.register(src, name="src")
        hd = a.register(dst)
        ep = a.connect(b.listen_address)
        r = ep.remote_region("src")
        done = ep.read([(hd, 0, r, 0, 8)])
        done.wait()
        print(f"{'future.done() (completed)':40} {ns_per(500000, lambda i: done.done()):10.1f} ns")
        print(f"{'future.bytes':40} {ns_per(500000, lambda i: done.bytes):10.1f} ns")
        for transport in ("shm", "tcp"):
            e2 = a.connect(b.listen_address, transport=transport)
            one = [(hd, 0, r, 0, 8)]
            fs = []
            submit = ns_per(2000, lambda i: fs.append(e2.read(one)))
            sluice.wait_all(fs)
            fs.clear()
            b64 = [(hd, j * 8, r, j * 8, 8) for j in range(64)]
            arr64 = np.array(b64, dtype=np.uint64)
            submit64 = ns_per(1000, lambda i: fs.append(e2.read(b64)))
            sluice.wait_all(fs)
            fs.clear()
            submit64a = ns_per(1000, lambda i: fs.append(e2.read(arr64)))
            sluice.wait_all(fs)
            fs.clear()
            raw = e2._ep
            submit_raw = ns_per(2000, lambda i: fs.append(raw.read(one)))
            sluice.wait_all(fs)
            rt = ns_per(2000, lambda i: e2.read(one).wait())
            print(f"{transport + ': submit read, 1 x 8 B':40} {submit:10.1f} ns   (raw extension call {submit_raw:.1f} ns)")
            print(f"{transport + ': submit read, 64 x 8 B (list)':40} {submit64:10.1f} ns")
            print(f"{transport + ': submit read, 64 x 8 B (ndarray)':40} {submit64a:10.1f} ns")
            print(f"{transport + ': read 8 B + wait (round trip)':40} {rt:10.1f} ns")


if __name__ == "__main__":
    main()
