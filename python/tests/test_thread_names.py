"""The engine's threads carry names ("sluice-..."), so that top -H, perf, gdb and
/proc/<pid>/task tell them apart (they all showed the process's name before)."""

import os
import sys

import pytest

import sluice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return names


def test_engine_threads_are_named():
    with sluice.Engine() as a, sluice.Engine() as b:
        ep = a.connect(b.listen_address)
        names = thread_names()
        assert "sluice-listen" in names and "sluice-watchdog" in names, names
        assert any(n.startswith("sluice-") and n not in ("sluice-listen", "sluice-watchdog") for n in names), names
        ep.close()
