"""tools/sluice-timeline: the recording library and the views it feeds (docs/performance.md,
"Tracing a message through the threads")."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "sluice-timeline", "timeline.py")

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler to build the recording library")

# A ping-pong between the main thread and a thread named "pong" over a socketpair; mark 3 before
# the N timed round trips. Exit 1 if a reply is wrong: the library must not change what calls do.
PROGRAM = r"""
import ctypes, os, socket, sys, threading
N = int(sys.argv[1])
a, b = socket.socketpair()
def pong():
    ctypes.CDLL(None).prctl(15, b"pong", 0, 0, 0)
    for i in range(N + 5):
        m = b.recv(64)
        b.send(m)
th = threading.Thread(target=pong)
th.start()
for i in range(5):
    a.send(b"warm!"); a.recv(64)
try:
    os.write(-1, b"xxx")
except OSError:
    pass
for i in range(N):
    msg = b"m%04d" % i
    a.send(msg)
    if a.recv(64) != msg:
        sys.exit(1)
th.join()
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("sluice_timeline_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))  # the library is built once, here
    return e


def run(env, out, n, extra_env=None):
    e = dict(env)
    e.update(extra_env or {})
    prog = out.parent / "prog.py"
    prog.write_text(PROGRAM)
    return subprocess.run([sys.executable, TOOL, "run", "--out", str(out), "--", sys.executable, str(prog), str(n)],
                          env=e, capture_output=True, text=True, timeout=120)


def test_a_two_thread_ping_pong_is_recorded_in_order(tmp_path, env):
    n = 50
    r = run(env, tmp_path / "out", n)
    assert r.returncode == 0, r.stderr
    tl = load_tool()
    t = tl.load(str(tmp_path / "out"))
    start = tl.view_start(t, 3)
    after = [e for e in t.events if e.ns >= start]
    pong = [tid for tid, name in t.names.items() if name == "pong"]
    assert len(pong) == 1, t.names
    main = {e.tid for e in after if e.call == "sendto"} - set(pong)
    assert len(main) == 1
    (main,), (pong,) = main, pong

    def calls(tid, call, exit_):
        return [e for e in after if e.tid == tid and e.call == call and e.exit == exit_]

    # Every call of the timed loop, and only those: n sends of 5 bytes and n receives each way.
    for tid in (main, pong):
        assert [e.value for e in calls(tid, "sendto", True)] == [5] * n
        assert [e.value for e in calls(tid, "recvfrom", True)] == [5] * n
    # Cause before effect, message by message, on the shared clock.
    for i in range(n):
        assert calls(main, "sendto", False)[i].ns <= calls(pong, "recvfrom", True)[i].ns
        assert calls(pong, "sendto", False)[i].ns <= calls(main, "recvfrom", True)[i].ns
        assert calls(main, "recvfrom", True)[i].ns <= calls(main, "sendto", False)[i + 1].ns if i + 1 < n else True
    assert t.dropped == 0

    s = subprocess.run([sys.executable, TOOL, "summary", str(tmp_path / "out"), "--mark", "3", "--markdown"],
                       capture_output=True, text=True, timeout=60)
    assert s.returncode == 0, s.stderr
    rows = [l.split("|")[1:-1] for l in s.stdout.splitlines() if "| pong |" in l]
    by_call = {c[3].strip(): int(c[4]) for c in rows}
    assert by_call["sendto"] == n and by_call["recvfrom"] == n and by_call["(bytes moved)"] == 10 * n
    v = subprocess.run([sys.executable, TOOL, "show", str(tmp_path / "out"), "--mark", "3", "--span-us", "1e9"],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and sum("pong" in l and "> sendto" in l for l in v.stdout.splitlines()) == n


def test_without_the_folder_nothing_is_written_and_calls_behave(tmp_path, env):
    tl = load_tool()
    e = dict(env)
    e["LD_PRELOAD"] = tl.build_library(env["XDG_CACHE_HOME"])
    e.pop("SLUICE_TIMELINE_DIR", None)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    r = subprocess.run([sys.executable, str(prog), "20"], env=e, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob("**/timeline.*"))


def test_events_past_the_cap_are_counted_as_dropped(tmp_path, env):
    r = run(env, tmp_path / "out", 20, {"SLUICE_TIMELINE_EVENTS": "40"})
    assert r.returncode == 0, r.stderr
    tl = load_tool()
    t = tl.load(str(tmp_path / "out"))
    assert len(t.events) <= 40 and t.dropped > 0
    s = subprocess.run([sys.executable, TOOL, "summary", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=60)
    assert s.returncode == 0 and f"# {t.dropped} events dropped" in s.stdout


def test_an_unknown_mark_and_an_empty_folder_say_so(tmp_path, env):
    r = run(env, tmp_path / "out", 5)
    assert r.returncode == 0, r.stderr
    s = subprocess.run([sys.executable, TOOL, "show", str(tmp_path / "out"), "--mark", "9"], capture_output=True,
                       text=True, timeout=60)
    assert s.returncode != 0 and "no mark 9" in s.stderr
    (tmp_path / "empty").mkdir()
    s = subprocess.run([sys.executable, TOOL, "summary", str(tmp_path / "empty")], capture_output=True, text=True,
                       timeout=60)
    assert s.returncode != 0 and "no timeline.* files" in s.stderr

