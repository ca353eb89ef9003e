"""Many hosts on one machine: network namespaces joined through a bridge (docs/cluster.md).

Each "host" is a network namespace with one veth (``eth0``) whose other end sits on a bridge
in a hub namespace; host i has 10.77.0.(i+1)/24 and the hub's bridge 10.77.0.254. Nothing is
created in the caller's namespace: veths are made directly inside their namespaces, and
deleting a namespace deletes its veth end, so cleanup is deleting the namespaces.

Names carry the creating process's pid (``slnet-<pid>-...``): a later run deletes namespaces
whose creator is gone (a run killed with SIGKILL), never another live run's.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional

PREFIX = "slnet-"
SUBNET = "10.77.0"
HUB_IP = f"{SUBNET}.254"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def unavailable_reason() -> Optional[str]:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in the CI container)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' does not work here: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> List[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    # Processes still inside (workers of a dead or failed run) would keep nothing alive that
    # matters, but killing them first makes the delete final and frees their memory.
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", ns, check=False)


def cleanup_stale() -> List[str]:
    """Deletes namespaces left by runs whose process is gone; returns their names."""
    removed = []
    for ns in _namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue  # ours, or a live run's
        _kill_and_delete(ns)
        removed.append(ns)
    return removed


@dataclass
class Host:
    ns: str
    addr: str
    dev: str = "eth0"  # the veth end inside the host's namespace

    def exec_prefix(self) -> List[str]:
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        ip("-n", self.ns, "link", "set", self.dev, "up" if up else "down")


@dataclass
class Topology:
    """`n` hosts on one bridge. Use as a context manager; close() is idempotent."""

    n: int
    tag: str = "t"
    hub: str = ""
    hosts: List[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 200:
            raise ValueError(f"Topology: 1 to 200 hosts, got {self.n}")
        base = f"{PREFIX}{os.getpid()}-{self.tag}"
        self.hub = f"{base}-hub"
        try:
            ip("netns", "add", self.hub)
            ip("-n", self.hub, "link", "set", "lo", "up")
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.n):
                h = Host(ns=f"{base}-{i}", addr=f"{SUBNET}.{i + 1}")
                ip("netns", "add", h.ns)
                self.hosts.append(h)
                ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", h.dev, "netns", h.ns)
                ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0")
                ip("-n", self.hub, "link", "set", f"v{i}", "up")
                ip("-n", h.ns, "link", "set", "lo", "up")
                ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
                ip("-n", h.ns, "link", "set", h.dev, "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for h in self.hosts:
            _kill_and_delete(h.ns)
        if self.hub:
            _kill_and_delete(self.hub)
        self.hosts = []
        self.hub = ""

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
