"""torchrun-launched tests of the torch.distributed backend `sluice` (CPU): every operation
compared bit for bit with gloo in the same processes, over shm and tcp forced, at world sizes
2, 3 and 4; a rank killed mid-run; and a rank that hangs (SIGSTOP) under a short group timeout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
st = pytest.importorskip("sluice.torch")
if not st.available():
    if os.environ.get("SLUICE_REQUIRE_TORCH_BACKEND") == "1":  # run_tests.sh built it: a missing one is a failure
        raise ImportError("sluice.torch: the backend extension is missing although torch was installed for the build")
    pytest.skip("sluice was built without the torch backend", allow_module_level=True)

HERE = Path(__file__).parent


def torchrun(script: str, nproc: int, env_extra: dict, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_matches_gloo(world: int, transport: str) -> None:
    big = "1" if world == 2 else "0"  # the 64 MiB case once per transport
    p = torchrun("worker.py", world, {"SLUICE_TORCH_TRANSPORT": transport, "SLUICE_TORCH_TEST_BIG": big}, 300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert out.count("sluice-torch OK") == world, out[-6000:]
    assert f"transport={transport}" in out


@pytest.mark.timeout(200)
def test_killed_rank_raises_naming_the_peer() -> None:
    p = torchrun("killed_worker.py", 2, {"GROUP_TIMEOUT_S": "20"}, 120)
    out = p.stdout + p.stderr
    assert "killed-rank OK" in out, out[-6000:]
    assert "peer rank 1" in out


@pytest.mark.timeout(200)
def test_hung_rank_raises_naming_the_peer_and_nothing_hangs() -> None:
    # World 3, rank 2 stops itself; a 3 s group timeout. Every rank must print its OK line
    # and torchrun must exit 0 (rank 2 is woken at the end and must fail fast, then exit).
    p = torchrun("hung_worker.py", 3, {"GROUP_TIMEOUT_S": "3"}, 150)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(3):
        assert f"hung-rank OK rank={r}" in out, out[-6000:]
    assert out.count("peer rank 2") >= 4, out[-6000:]  # recv, send and both all_reduces name it
