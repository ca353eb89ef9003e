"""A pure-Python module of python/sluice, loaded by its path.

The GPU examples and benchmarks run where the sluice package may not be installed (a build
tree with SLUICE_LIBRARY pointing at libsluice.so): `import sluice` would need the compiled
binding, but cuda_allgather, hier_allgather and ag_gemm only need ctypes and torch. Each is
registered as sys.modules["sluice_<name>"], the key hier_allgather's own sibling loader uses,
so a module is loaded once however it is reached (and dataclasses can find their module).
"""
import importlib.util
import os
import sys

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "sluice")


def load(name: str):
    key = "sluice_" + name
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, os.path.join(PKG, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    return mod
