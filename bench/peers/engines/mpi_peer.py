"""Open MPI (Debian openmpi-bin), two ranks on this host, run by native/mpi_peer.c: btl vader
(shared memory; one-sided via MPI_Win_create, whose single copy is CMA) or btl tcp (with
osc pt2pt, since MPI_Win_create fails over tcp under the default osc)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from common import FOOTPRINT, Cell, emit

HERE = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0].split()[-1] if out.returncode == 0 and out.stdout else "unknown"


def binary() -> str:
    return os.environ.get("PEERS_MPI", os.path.join(HERE, "..", ".build", "mpi_peer"))


def local(settings: dict, cells: list[Cell]) -> int:
    if not shutil.which("mpirun") or not os.path.exists(binary()):
        for c in cells:
            emit(c, None, None, None, "Open MPI is not installed (apt-get install openmpi-bin libopenmpi-dev)")
        return 1
    with tempfile.NamedTemporaryFile("w", suffix=".cells", delete=False) as f:
        for c in cells:
            f.write(f"{c.op} {c.size} {c.batch} {c.conc} {c.iters}\n")
    mca = ["--mca", "btl", settings.get("btl", "vader,self")]
    if "tcp" in settings.get("btl", ""):
        mca += ["--mca", "osc", "pt2pt"]
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2"] + mca + [binary(), f.name, str(FOOTPRINT)]
    try:
        # RESULT and CHECK lines go straight to the driver
        return subprocess.run(cmd, stdout=sys.stdout, timeout=float(settings.get("timeout", 600))).returncode
    finally:
        os.unlink(f.name)
