"""Engines found by name through a directory store from Python (docs/cluster.md):
``Engine(directory=..., name=...)`` and ``connect("name")``, against a real etcd and a real
redis-server, each started on free loopback ports in a temp dir."""
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

import sluice
from conftest import pattern


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etcd_ready(port: int) -> bool:
    # Ready = the v3 gateway answers a range (etcd has elected itself leader).
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/range", data=json.dumps({"key": "cHJvYmU="}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _redis_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _command(kind: str, binary: str, port: int, tmp: Path) -> List[str]:
    if kind == "redis":
        return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(tmp)]
    client, peer = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{_free_port()}"
    return [binary, "--name", "t", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"t={peer}", "--log-level", "warn"]


@pytest.fixture(params=["etcd", "redis"])
def store_url(request, tmp_path: Path) -> Iterator[str]:
    kind = request.param
    binary = shutil.which("etcd" if kind == "etcd" else "redis-server")
    if binary is None:
        pytest.skip(f"{kind} server not installed (scripts/install-deps.sh --tests installs etcd-server and redis-server)")
    port = _free_port()
    proc = subprocess.Popen(_command(kind, binary, port, tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ready = _etcd_ready if kind == "etcd" else _redis_ready
    try:
        deadline = time.monotonic() + 20
        while not ready(port):
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"{kind} did not start on port {port}")
            time.sleep(0.05)
        yield f"etcd://127.0.0.1:{port}/pytest" if kind == "etcd" else f"redis://127.0.0.1:{port}/0?prefix=pytest"
    finally:
        proc.terminate()
        proc.wait(10)


def _engine(url: str, name: str) -> sluice.Engine:
    try:
        return sluice.Engine(transports="tcp", channels=1, directory=url, name=name)
    except sluice.UnsupportedError as e:
        pytest.skip(f"this build has no {url.split(':')[0]} directory: {e}")


def test_connect_by_name_and_write(store_url):
    n = 1 << 16
    src, dst = pattern(n), np.zeros(n, np.uint8)
    with _engine(store_url, "py-a") as a, _engine(store_url, "py-b") as b:
        hs = a.register(src)
        b.register(dst, name="dst")
        ep = a.connect("py-b", timeout=5)
        ep.write([(hs, 0, ep.remote_region("dst"), 0, n)]).result(10)
        assert np.array_equal(src, dst)


def test_name_taken_and_unknown_name(store_url):
    with _engine(store_url, "py-dup"):
        with pytest.raises(sluice.InvalidArgumentError, match="already registered"):
            _engine(store_url, "py-dup")
        with _engine(store_url, "py-x") as x:
            with pytest.raises(sluice.SluiceTimeoutError, match="no engine named 'nobody'"):
                x.connect("nobody", timeout=4)


def test_bad_directory_url_is_refused():
    with pytest.raises(sluice.InvalidArgumentError, match="unknown scheme"):
        sluice.Engine(directory="zk://h:2181")


@pytest.mark.parametrize("scheme", ["etcd", "redis"])
def test_unreachable_store_names_the_url(scheme: str):
    url = f"{scheme}://127.0.0.1:{_free_port()}/0" if scheme == "redis" else f"etcd://127.0.0.1:{_free_port()}/p"
    try:
        with pytest.raises(sluice.SluiceTimeoutError, match="could not register") as e:
            sluice.Engine(transports="tcp", directory=url, name="orphan", connect_timeout=0.5)
    except sluice.UnsupportedError as missing:
        pytest.skip(f"this build has no {scheme} directory: {missing}")
    assert url in str(e.value)


def test_closed_engine_leaves_the_directory(store_url):
    with _engine(store_url, "py-seeker") as seeker:
        with _engine(store_url, "py-gone"):
            seeker.connect("py-gone", timeout=5)
        # Withdrawn on close, not after the TTL: the name is unknown at once.
        with pytest.raises(sluice.SluiceTimeoutError, match="no engine named 'py-gone'"):
            seeker.connect("py-gone", timeout=2)
