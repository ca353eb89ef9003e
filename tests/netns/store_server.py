"""A real directory server (redis-server or etcd) in a topology's hub namespace, reachable by
every host at netns.HUB_IP (its ports are free there whatever runs on the machine).

    srv = StoreServer("etcd", topo.hub); srv.start()
    srv.url("netns")      # the engines' directory URL, prefix "netns"
    srv.keys("netns")     # names registered under the prefix (sorted "netns/<name>")
    srv.kill(); srv.start(wipe=True)   # a restart that lost every entry
"""
from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
import tempfile
import time
from typing import List, Optional

import pytest

import netns
from driver import WorkerError, now

KINDS = ["redis", "etcd"]
_BINARY = {"redis": "redis-server", "etcd": "etcd"}
_CLIENT = {"redis": "redis-cli", "etcd": "etcdctl"}


class StoreServer:
    def __init__(self, kind: str, hub: str):
        self.kind, self.hub = kind, hub
        self.binary = shutil.which(_BINARY[kind])
        self.client = shutil.which(_CLIENT[kind])
        if self.binary is None or self.client is None:
            pytest.skip(f"{_BINARY[kind]} or {_CLIENT[kind]} not installed "
                        "(scripts/install-deps.sh --tests installs them)")
        # Clients come from other hosts' addresses: Redis's protected mode refuses them
        # without a password.
        self.password = secrets.token_hex(8)
        self.data = tempfile.mkdtemp(prefix=f"slnet-{kind}-")
        self.proc: Optional[subprocess.Popen] = None

    def url(self, prefix: str) -> str:
        if self.kind == "etcd":
            return f"etcd://{netns.HUB_IP}:2379/{prefix}"
        return f"redis://:{self.password}@{netns.HUB_IP}:6379/0?prefix={prefix}"

    def _in_hub(self, *args: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hub, *args], capture_output=True, text=True,
                              timeout=timeout)

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        if self.kind == "etcd":
            return self._in_hub(self.client, "--endpoints", f"http://{netns.HUB_IP}:2379", *args)
        return self._in_hub(self.client, "-h", netns.HUB_IP, "--no-auth-warning", "-a", self.password, *args)

    def start(self, wipe: bool = False) -> None:
        if wipe:
            shutil.rmtree(self.data, ignore_errors=True)
            self.data = tempfile.mkdtemp(prefix=f"slnet-{self.kind}-")
        if self.kind == "etcd":
            c, p = f"http://{netns.HUB_IP}:2379", "http://127.0.0.1:2380"
            cmd = [self.binary, "--name", "hub", "--data-dir", f"{self.data}/etcd", "--listen-client-urls", c,
                   "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                   "--initial-cluster", f"hub={p}", "--logger", "zap", "--log-level", "warn"]
        else:  # no persistence: a restart loses everything
            cmd = [self.binary, "--port", "6379", "--bind", netns.HUB_IP, "--save", "", "--appendonly", "no",
                   "--dir", self.data, "--requirepass", self.password]
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.hub, *cmd], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = now() + 30
        while True:
            if self.kind == "etcd":
                r = self._cli("endpoint", "health")
                ok = r.returncode == 0 and "is healthy" in (r.stdout + r.stderr)
            else:
                ok = self._cli("ping").stdout.strip() == "PONG"
            if ok:
                return
            if now() > deadline or self.proc.poll() is not None:
                self.kill()
                raise WorkerError(f"{self.kind} did not start in the hub namespace")
            time.sleep(0.05)

    def keys(self, prefix: str) -> List[str]:
        if self.kind == "etcd":
            r = self._cli("get", "--prefix", f"{prefix}/", "--keys-only", "-w", "json")
            try:
                kvs = json.loads(r.stdout or "{}").get("kvs", [])
            except json.JSONDecodeError:
                return []
            return sorted(base64.b64decode(kv["key"]).decode() for kv in kvs)
        return sorted(self._cli("--scan", "--pattern", f"{prefix}/*").stdout.split())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.data, ignore_errors=True)
