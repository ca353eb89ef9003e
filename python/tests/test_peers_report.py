"""bench/peers/report.py's verdicts: every lost or missed cell gets its measured cause from
bench/peers/causes.py, or says "not explained" (issue 16: a loss that remains is named)."""
import os
import re
import sys

import pytest

PEERS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "peers")
if not os.path.isfile(os.path.join(PEERS, "report.py")):
    pytest.skip("bench/peers is not in this tree (an sdist)", allow_module_level=True)
sys.path.insert(0, PEERS)
import causes  # noqa: E402
import report  # noqa: E402

MiB = 1 << 20


def cell(mbps):
    return {"rounds": 3, "ok": 3, "ceiling": False, "mbps": mbps, "mbps_min": mbps, "mbps_max": mbps,
            "lat_us": None, "lat_us_min": None, "lat_us_max": None, "checked": True, "error": ""}


def meta(*names):
    return {"engines": [{"name": n, "section": s} for s, n in names], "not_run": {}}


def test_a_covered_loss_names_its_cause_and_an_uncovered_one_says_so():
    m = meta(("tcp", "sluice tcp"), ("tcp", "gloo"), ("tcp", "ceiling: 2 tcp streams"))
    agg = {
        # a tcp SEND behind others: covered (one stream per pair)
        ("tcp", "sluice tcp", "send", MiB, 64, 8): cell(900),
        ("tcp", "gloo", "send", MiB, 64, 8): cell(1000),
        ("tcp", "ceiling: 2 tcp streams", "send", MiB, 64, 8): cell(950),
        # a lone 4 MiB SEND lost to gloo: no entry covers it
        ("tcp", "sluice tcp", "send", 4 * MiB, 1, 1): cell(500),
        ("tcp", "gloo", "send", 4 * MiB, 1, 1): cell(1000),
        ("tcp", "ceiling: 2 tcp streams", "send", 4 * MiB, 1, 1): cell(520),
        # won: not listed
        ("tcp", "sluice tcp", "send", 2 * MiB, 1, 1): cell(1100),
        ("tcp", "gloo", "send", 2 * MiB, 1, 1): cell(1000),
        ("tcp", "ceiling: 2 tcp streams", "send", 2 * MiB, 1, 1): cell(1100),
    }
    losses, misses = report.verdicts(m, agg)
    assert [(d["size"], d["batch"]) for d in losses] == [(4 * MiB, 1), (MiB, 64)]  # worst first
    assert losses[0]["cause"] is None
    assert losses[1]["cause"].anchor == "cause-tcp-send-stream"
    assert misses == []  # 900/950 and 500/520 are above their bars
    md = report.verdict_markdown(m, agg, "peers.md")
    assert "1 of 2 with a measured cause named" in md
    row_4m = next(l for l in md.splitlines() if l.startswith("| tcp | send | 4 MiB"))
    assert row_4m.endswith("| **not explained** |")
    row_1m = next(l for l in md.splitlines() if l.startswith("| tcp | send | 1 MiB"))
    assert "(peers.md#cause-tcp-send-stream)" in row_1m


def test_a_ceiling_miss_is_matched_by_engine_and_shape():
    m = meta(("shm", "sluice shm memfd"), ("shm", "ceiling: 2-thread memcpy"))
    agg = {
        ("shm", "sluice shm memfd", "send", MiB, 64, 8): cell(500),
        ("shm", "ceiling: 2-thread memcpy", "send", MiB, 64, 8): cell(1000),
        ("shm", "sluice shm memfd", "write", MiB, 64, 8): cell(500),  # no entry for batched writes
        ("shm", "ceiling: 2-thread memcpy", "write", MiB, 64, 8): cell(1000),
    }
    _, misses = report.verdicts(m, agg)
    got = {d["op"]: d["cause"] and d["cause"].anchor for d in misses}
    assert got == {"send": "shm-send-batch-stream", "write": None}


def test_every_cause_has_its_anchor_in_docs_peers_md():
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "peers.md")
    if not os.path.isfile(doc):
        pytest.skip("docs/ is not in this tree")
    ids = set(re.findall(r'<a id="([\w-]+)"></a>', open(doc, encoding="utf-8").read()))
    missing = [c.anchor for c in causes.CAUSES if c.anchor not in ids]
    assert not missing, f"docs/peers.md has no <a id> for {missing}"
    assert len({c.anchor for c in causes.CAUSES}) == len(causes.CAUSES)
