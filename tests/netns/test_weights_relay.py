"""sluice.weights relays across hosts: tools/sluice-weights-bench/relay_bench.py, small, with
every byte checked. Asserted: the bytes, and that the trainer sends the model once per receiver
directly but once per tree through relays (its link's load, which is what relays are for).
The times are reported, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "tools" / "sluice-weights-bench" / "relay_bench.py"


def test_relay_chain_and_tree_send_the_model_once(tmp_path, report):
    out = tmp_path / "relay.json"
    r = subprocess.run([sys.executable, str(BENCH), "--receivers", "3", "--size-mib", "8", "--tensors", "60",
                        "--rounds", "1", "--bucket-mib", "1", "--link-mbit", "2000", "--check", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "every byte right at 3 receivers" in r.stdout
    res = json.loads(out.read_text())
    model = res["bytes"]
    sent = {m: [s["trainer_bytes"] for s in res["samples"][m]] for m in ("direct", "chain", "tree")}
    fallbacks = {m: [f for s in res["samples"][m] for f in s["fallbacks"]] for m in sent}
    assert sent["direct"] == [3 * model]
    assert sent["chain"] == [model] and sent["tree"] == [model], (sent, fallbacks)
    report("weights relay (3 receivers, 8 MiB, 2 Gbit/s links)",
           **{m: round(res["samples"][m][0]["round_s"], 3) for m in sent})


def test_a_layout_by_host_crosses_each_host_link_once(tmp_path, report):
    """4 receivers, 2 per host: the index-order tree sends the model across host links 3 times
    (trainer -> 0, 0 -> 2, 1 -> 3), relay_layout by host twice (trainer -> host 1's leader,
    that leader -> host 2's leader); the rest stays inside the hosts."""
    out = tmp_path / "relay.json"
    r = subprocess.run([sys.executable, str(BENCH), "--receivers", "4", "--per-host", "2", "--size-mib", "8",
                        "--tensors", "60", "--rounds", "1", "--bucket-mib", "1", "--link-mbit", "2000",
                        "--modes", "tree,hosts", "--check", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "every byte right at 4 receivers" in r.stdout
    res = json.loads(out.read_text())
    model = res["bytes"]
    cross = {m: [s["cross_host_bytes"] for s in res["samples"][m]] for m in ("tree", "hosts")}
    fallbacks = {m: [f for s in res["samples"][m] for f in s["fallbacks"]] for m in cross}
    assert cross == {"tree": [3 * model], "hosts": [2 * model]}, (cross, fallbacks)
    report("weights relay by host (4 receivers, 2 per host, 8 MiB, 2 Gbit/s links)",
           **{m: round(res["samples"][m][0]["round_s"], 3) for m in cross})
