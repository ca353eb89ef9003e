"""SLUICE_TORCH_TRACE and tools/sluice-torch-bench/trace.py on CPU: two torchrun ranks ping-pong
1 MiB messages by rendezvous (RTS/CTS: ready-to-receive off), each rank writes its records, and
the tool pairs them, with the same run recorded by tools/sluice-timeline (ioctls per step). Checks
that every message is paired across the ranks in causal order and that each step has a row; no
timing is asserted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed")
st = pytest.importorskip("sluice.torch")
if not st.available():
    pytest.skip("sluice was built without the torch backend", allow_module_level=True)

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "sluice-torch-bench")
TIMELINE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "sluice-timeline", "timeline.py")
ITERS = 6


@pytest.mark.timeout(200)
def test_rendezvous_messages_are_paired_across_ranks(tmp_path) -> None:
    if not os.path.exists(os.path.join(TOOLS, "trace.py")):
        pytest.skip(f"{TOOLS} is not in this tree (tests run from an sdist?)")
    prefix = str(tmp_path / "tr")
    tl = tmp_path / "tl"
    cmd = [sys.executable, TIMELINE, "run", "--out", str(tl), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(TOOLS, "bench.py"), "--ops", "sendrecv", "--min-bytes", str(1 << 20),
           "--max-bytes", str(1 << 20), "--iters", str(ITERS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLUICE_TORCH_TRACE": prefix, "SLUICE_TORCH_RECV_READY": "0"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert sorted(os.listdir(tmp_path)) == ["tl", "tr.g0.rank0.csv", "tr.g0.rank1.csv"]

    sys.path.insert(0, TOOLS)
    try:
        import trace as tool  # tools/sluice-torch-bench/trace.py (the stdlib's trace is shadowed on purpose)
    finally:
        sys.path.pop(0)
    assert hasattr(tool, "messages"), "imported the stdlib's trace module, not the tool"
    msgs = tool.messages(tool.load(prefix, 0))
    # The warm-up ping-pong and ITERS timed ones, each way.
    for s, rcv in ((0, 1), (1, 0)):
        mine = [m for m in msgs if m["sender"] == s and m["receiver"] == rcv and m["proto"] == "RTS"]
        assert len(mine) == ITERS + 1, mine
        for m in mine:
            assert m["send_call"] <= m["rts_out"] < m["rts_in"] < m["cts_out"] < m["cts_in"], m
            assert m["cts_in"] < m["recv_done"] <= m["recv_wait_end"], m
    calls = tool.ioctls(str(tl))
    rank_pid = tool.pids(prefix, 0)
    assert set(rank_pid) == {0, 1} and set(rank_pid.values()) <= set(calls), (rank_pid, list(calls))
    rows = tool.summarize(msgs, 1, calls, rank_pid)
    steps = {(row["sender"], row["step"]) for row in rows}
    for s in (0, 1):
        for name, _, _ in tool.RTS_STEPS:
            assert (s, name) in steps, (s, name, rows)
    # Steps within one rank count that process's ioctls (none need be made on CPU); steps
    # across ranks do not.
    one_rank = [row for row in rows if row["step"].startswith("receiver:")]
    assert one_rank and all("ioctls" in row and row["ioctls"] >= 0 for row in one_rank), rows
    assert all("ioctls" not in row for row in rows if " -> in at " in row["step"]), rows

    printed = subprocess.run([sys.executable, os.path.join(TOOLS, "trace.py"), prefix, "--timeline", str(tl)],
                             capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert "RTS messages, rank 0 -> rank 1" in printed.stdout and "| one way:" in printed.stdout
    assert "in ioctls us" in printed.stdout
    missing = subprocess.run([sys.executable, os.path.join(TOOLS, "trace.py"), str(tmp_path / "nothing")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "SLUICE_TORCH_TRACE" in missing.stderr


@pytest.mark.timeout(200)
def test_ready_to_receive_and_eager_messages_are_paired(tmp_path) -> None:
    # The defaults: a 512 KiB recv posted first tells its sender (RTR; the payload then goes
    # with an RTR_DATA header), messages up to 4 KiB travel inside their header (EAGER_INLINE),
    # larger eager ones after it (EAGER); the barriers' messages are eager too.
    if not os.path.exists(os.path.join(TOOLS, "trace.py")):
        pytest.skip(f"{TOOLS} is not in this tree (tests run from an sdist?)")
    prefix = str(tmp_path / "tr")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(TOOLS, "bench.py"), "--ops", "sendrecv", "--min-bytes", "8", "--max-bytes", str(512 << 10),
           "--iters", str(ITERS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLUICE_TORCH_TRACE": prefix}
    env.pop("SLUICE_TORCH_RECV_READY", None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]

    sys.path.insert(0, TOOLS)
    try:
        import trace as tool
    finally:
        sys.path.pop(0)
    msgs = tool.messages(tool.load(prefix, 0))
    rtr_seen = 0
    for s, rcv in ((0, 1), (1, 0)):
        rtr = [m for m in msgs if m["proto"] == "RTR" and m["sender"] == s and m["receiver"] == rcv]
        rts = [m for m in msgs if m["proto"] == "RTS" and m["sender"] == s and m["receiver"] == rcv]
        # Every 512 KiB message is paired: by its RTR, or as an RTS where the sender's call came
        # before the RTR (which way each goes is timing, not asserted).
        assert len(rtr) + len(rts) == ITERS + 1, [m["proto"] for m in msgs]
        rtr_seen += len(rtr)
        for m in rtr:
            assert m["rtr_out"] < m["rtr_in"] and m["data_out"] < m["data_in"], m
            assert m["send_call"] is not None and m["send_call"] <= m["data_out"], m
            assert m["recv_done"] <= m["recv_wait_end"], m
        inline = [m for m in msgs if m["proto"] == "EAGER_INLINE" and m["sender"] == s and m["receiver"] == rcv
                  and m["send_call"] is not None]
        # 8 B to 2 KiB (5 sizes) fit in a header; each size's warm-up and timed ping-pongs.
        assert len(inline) >= 5 * (ITERS + 1), len(inline)
        for m in inline:
            assert m["send_call"] <= m["rts_out"] < m["rts_in"] <= m["recv_done"] <= m["recv_wait_end"], m
        assert any(m["proto"] == "EAGER" and m["sender"] == s for m in msgs)  # 8 KiB - 128 KiB
    assert rtr_seen > 0, "no 512 KiB message of 14 went by its RTR"
    rows = tool.summarize(msgs, 1)
    protos = {row["proto"] for row in rows}
    assert {"RTR", "EAGER_INLINE", "EAGER"} <= protos, protos
    printed = subprocess.run([sys.executable, os.path.join(TOOLS, "trace.py"), prefix], capture_output=True, text=True)
    assert printed.returncode == 0 and "RTR messages, rank" in printed.stdout, printed.stdout + printed.stderr
