"""AllGather (python/sluice/cuda_allgather.py) against NCCL's all_gather_into_tensor.

Runs tools/sluice-gpu-bench/allgather_bench.py at small sizes (it exits non-zero if any size
differs from NCCL). Skips without torch, 2 GPUs or a CUDA build of libsluice (SLUICE_LIBRARY).
    SLUICE_LIBRARY=build-cuda/libsluice.so python3 -m pytest tests/cuda/test_allgather_nccl.py
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_allgather_matches_nccl(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    if not os.environ.get("SLUICE_LIBRARY"):
        pytest.skip("set SLUICE_LIBRARY to a CUDA build of libsluice.so")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    out = tmp_path / "ag.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sluice-gpu-bench", "allgather_bench.py"),
                        "--max-mib", "4", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "equal to NCCL" in out.read_text()
