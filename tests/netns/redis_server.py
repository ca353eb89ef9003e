"""A real redis-server in a topology's hub namespace, reachable by every host at
netns.HUB_IP:6379 (the port is free there whatever runs on the machine)."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest

import netns
from driver import WorkerError, now


def start_redis(hub: str, password: str) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (scripts/install-deps.sh --tests installs it)")
    # Its own network namespace: port 6379 is free there whatever runs on the machine. Clients
    # come from other hosts' addresses, which Redis's protected mode refuses without a password.
    proc = subprocess.Popen(["ip", "netns", "exec", hub, binary, "--port", "6379", "--bind", netns.HUB_IP, "--save", "",
                             "--appendonly", "no", "--dir", "/tmp", "--requirepass", password],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = now() + 20
    while True:
        r = subprocess.run(["ip", "netns", "exec", hub, "redis-cli", "-h", netns.HUB_IP, "--no-auth-warning",
                            "-a", password, "ping"], capture_output=True,
                           text=True, timeout=10) if shutil.which("redis-cli") else None
        if r is None or r.stdout.strip() == "PONG":
            return proc  # without redis-cli the engines' own registration waits (connect_timeout)
        if now() > deadline or proc.poll() is not None:
            proc.kill()
            raise WorkerError("redis-server did not start in the hub namespace")
        time.sleep(0.05)
