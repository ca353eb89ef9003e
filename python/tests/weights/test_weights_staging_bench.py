"""tools/sluice-weights-bench/staging_bench.py end to end on CPU, small: a trainer, the direct
consumer, the staging sidecar and the staging consumer as processes, rounds of both paths
interleaved, every byte checked after the last round of each path. No timing is asserted."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "sluice-weights-bench", "staging_bench.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("capacity_mib", [None, 8], ids=["default-sizing", "two-slots-of-4-mib"])
def test_staging_bench_check_cpu(tmp_path, capacity_mib):
    if not os.path.exists(BENCH):
        pytest.skip(f"{BENCH} is not in this tree (tests run from an sdist?)")
    out = tmp_path / "staging.json"
    cmd = [sys.executable, BENCH, "--device", "cpu", "--size-mib", "32", "--tensors", "200", "--rounds", "2",
           "--check", "--json", str(out), "--timeout", "60"]
    if capacity_mib is not None:
        cmd += ["--capacity-mib", str(capacity_mib)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: every byte of 200 tensors right on both paths (direct, staging)" in r.stdout, r.stdout
    assert "memcpy (one copy) ceiling" in r.stdout and "staging / direct (median time):" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    for key in ("tensors", "bytes", "device", "trainer_memory", "rounds", "direct", "staging",
                "ratio_staging_over_direct", "ceilings_s", "ceiling", "check"):
        assert key in res, key
    assert res["tensors"] == 200 and res["device"] == "cpu" and res["check"] is True
    assert res["ceiling"] in res["ceilings_s"]
    for path in ("direct", "staging"):
        for key in ("median_s", "min_s", "max_s", "gbps", "rounds_s", "of_ceiling"):
            assert key in res[path], (path, key)
        assert len(res[path]["rounds_s"]) == 2
    st = res["staging"]
    assert len(st["server_s"]) == len(st["client_s"]) == 2
    if capacity_mib is None:
        assert st["default_sizing"] and st["slots"] == 1 and st["bins"] == [1, 1]  # the model fits one slot
    else:
        assert st["slots"] == 2 and st["capacity"] == capacity_mib << 20 and min(st["bins"]) > 2
    print(r.stdout)
