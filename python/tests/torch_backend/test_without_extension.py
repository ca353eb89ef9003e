"""A sluice package without the compiled torch backend: `import sluice.torch` still works,
and creating a `sluice` group raises ImportError saying how to get the backend. Runs in a
child interpreter where the extension is hidden (the backend registration is process-wide)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["sluice._sluice_torch"] = None  # as if built without torch: import fails
    from datetime import timedelta
    import torch.distributed as dist
    import sluice.torch as st
    assert not st.available()
    try:
        dist.init_process_group("sluice", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=5))
    except ImportError as e:
        print("IMPORT-ERROR:", e)
    else:
        print("no error")
    """
)


def test_missing_extension_says_how_to_get_it() -> None:
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "IMPORT-ERROR:" in out, out[-4000:]
    assert "not built into this sluice package" in out
    assert "--no-build-isolation" in out
