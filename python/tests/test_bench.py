"""python -m sluice.bench: same flags and table as tools/sluice-bench."""
import importlib.util
import json
import subprocess
import sys

import pytest


def bench(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "sluice.bench", "--quiet", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("op", ["read", "write", "write_imm", "send"])
def test_ops_table(op):
    r = bench("--op", op, "--min-size", "4K", "--max-size", "8K", "--batch-size", "8", "--concurrency", "2",
              "--iterations", "20", "--check")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["Transport", "#Channels", "Message"]
    assert len(lines) == 3 and all("check ok" in l for l in lines[1:])


def test_json_and_csv_tcp():
    r = bench("--transport", "tcp", "--size", "64K", "--iterations", "10", "--json", "--channels", "1")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["transport"] == "tcp" and rows[0]["message_size"] == 65536 and rows[0]["errors"] == 0
    assert rows[0]["channels"] == 1 and rows[0]["bandwidth_mbps"] > 0
    r = bench("--size", "1K", "--iterations", "10", "--csv", "--memfd")
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.strip().splitlines()
    assert head == "transport,channels,message_size,batch_size,concurrency,avg_latency_ms,bandwidth_mbps"
    assert row.split(",")[2] == "1024"


def test_bad_flags():
    assert bench("--op", "teleport").returncode != 0
    assert bench("--min-size", "8M", "--max-size", "1K").returncode != 0
    assert bench("--batch-size", "0").returncode != 0


@pytest.mark.parametrize("engine,module", [("mooncake", "mooncake.engine"), ("nixl", "nixl._api")])
def test_other_engines(engine, module):
    try:
        usable = importlib.util.find_spec(module.split(".")[0]) is not None and bool(__import__(module))
    except Exception:
        usable = False
    r = bench("--engine", engine, "--op", "read", "--size", "64K", "--iterations", "10", "--check", timeout=120)
    if not usable:
        assert r.returncode != 0
        assert f"--engine {engine}" in r.stderr and "cannot be imported" in r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert "check ok" in r.stdout
