"""tools/sluice-weights-bench end to end at 256 MiB (what CI runs to keep the benchmark's
path exercised): a trainer and two receivers as processes, every byte checked. No timing
is asserted."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "sluice-weights-bench", "bench.py")


@pytest.mark.timeout(240)
def test_bench_check_256_mib(tmp_path):
    if not os.path.exists(BENCH):
        pytest.skip(f"{BENCH} is not in this tree (tests run from an sdist?)")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--size-mib", "256", "--tensors", "1000", "--receivers", "2",
                        "--rounds", "2", "--mode", "both", "--check", "--json", str(out)],
                       capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: every byte of 1000 tensors right at 2 receivers" in r.stdout, r.stdout
    assert "memcpy ceiling" in r.stdout and out.exists()
    assert "push round (all receivers)" in r.stdout and "pull round (all receivers)" in r.stdout, r.stdout
    print(r.stdout)
