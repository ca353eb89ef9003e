"""Per-call overhead of a trivial bound call: pybind11 vs nanobind.

Build:  cmake -S python/binding_bench -B build-bindbench -G Ninja -DCMAKE_BUILD_TYPE=Release
        cmake --build build-bindbench
Run:    PYTHONPATH=build-bindbench python3 python/binding_bench/measure.py
"""
import timeit

import nb_trivial
import pb_trivial


def best(stmt, g, n=2_000_000, repeat=5):
    return min(timeit.repeat(stmt, globals=g, number=n, repeat=repeat)) / n * 1e9


def main():
    base = best("f()", {"f": lambda: None})
    print(f"{'call':24} {'pybind11 ns':>12} {'nanobind ns':>12}")
    print(f"{'(python lambda)':24} {base:12.1f} {base:12.1f}")
    for label, stmt in [("noop()", "m.noop()"), ("add(1, 2)", "m.add(1, 2)"),
                        ("obj.done()", "o.done()"), ("obj.value", "o.value")]:
        row = []
        for mod in (pb_trivial, nb_trivial):
            row.append(best(stmt, {"m": mod, "o": mod.Obj()}))
        print(f"{label:24} {row[0]:12.1f} {row[1]:12.1f}")


if __name__ == "__main__":
    main()
