"""Sluice through its C++ API (native/sluice_peer.cpp, built by run.sh against the headers and
library the wheel ships): the same cells as engines/sluice_peer.py without the Python binding,
so that it compares with Open MPI's C adapter engine to engine. One command runs both sides
(the program forks the target)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from common import FOOTPRINT, Cell, emit

HERE = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    import sluice

    return sluice.__version__


def binary() -> str:
    return os.environ.get("PEERS_SLUICE_NATIVE", os.path.join(HERE, "..", ".build", "sluice_peer"))


def local(settings: dict, cells: list[Cell]) -> int:
    if not os.path.exists(binary()):
        for c in cells:
            emit(c, None, None, None, "the C++ adapter was not built (run.sh builds it with c++ against the wheel)")
        return 1
    with tempfile.NamedTemporaryFile("w", suffix=".cells", delete=False) as f:
        for c in cells:
            f.write(f"{c.op} {c.size} {c.batch} {c.conc} {c.iters}\n")
    cmd = [binary(), f.name, str(FOOTPRINT), settings["transport"], str(settings.get("channels", 2)),
           "1" if settings.get("memfd") else "0"]
    try:
        # RESULT and CHECK lines go straight to the driver
        return subprocess.run(cmd, stdout=sys.stdout, timeout=float(settings.get("timeout", 600))).returncode
    finally:
        os.unlink(f.name)
