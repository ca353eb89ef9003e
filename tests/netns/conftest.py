"""Fixtures of the netns suite: skip with the reason where namespaces cannot be made, stale
cleanup once per session, topologies that are always deleted, and a measured-numbers summary
printed at the end of the run (and written to $NETNS_REPORT as JSON when set)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# netns.py (the topology) is shared with tools/sluice-weights-bench/relay_bench.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "common"))

import netns  # noqa: E402

_REPORT: List[Dict[str, Any]] = []


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a CI job cancelled, `timeout`) becomes KeyboardInterrupt so that every fixture's
    # finally block runs and deletes its namespaces. SIGKILL cannot be caught: the next run's
    # cleanup_stale() deletes what such a run left.
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)


@pytest.fixture(scope="session", autouse=True)
def _netns_available() -> Iterator[None]:
    why = netns.unavailable_reason()
    if why:
        pytest.skip(f"netns suite skipped: {why}")
    removed = netns.cleanup_stale()
    if removed:
        print(f"netns: removed {len(removed)} namespaces left by an earlier run: {removed}")
    yield


@pytest.fixture
def topology() -> Iterator[Callable[..., netns.Topology]]:
    made: List[netns.Topology] = []

    def make(n: int, tag: str = "t") -> netns.Topology:
        t = netns.Topology(n, tag=tag)
        made.append(t)
        return t

    try:
        yield make
    finally:
        for t in made:
            t.close()


@pytest.fixture
def report() -> Callable[..., None]:
    def add(scenario: str, **values: Any) -> None:
        _REPORT.append({"scenario": scenario, **values})

    return add


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _REPORT:
        return
    terminalreporter.section("netns: measured (reported, never asserted)")
    for r in _REPORT:
        terminalreporter.write_line(json.dumps(r, sort_keys=False))
    out = os.environ.get("NETNS_REPORT")
    if out:
        Path(out).write_text(json.dumps(_REPORT, indent=1) + "\n")
