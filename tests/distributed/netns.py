"""Hosts for the multi-host tests: Linux network namespaces on one machine.

Each host is a namespace with one veth into a bridge in the root namespace;
the bridge has an address too, so the test (in the root namespace) reaches
every host. Names and the /24 are unique per test run; everything is
removed afterwards. Needs root and iproute2 (CI has both).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def hosts(n: int):
    """Yields (namespaces, addresses, the root namespace's address on the bridge)."""
    tag = f"{os.getpid() % 10000:04d}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    bridge = f"vmb{tag}"
    names = [f"vmh{tag}{i}" for i in range(n)]
    addresses = [f"{subnet}.{i + 1}" for i in range(n)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (name, address) in enumerate(zip(names, addresses)):
            _ip("netns", "add", name)
            _ip("link", "add", f"vmv{tag}{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", f"vmv{tag}{i}", "master", bridge, "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names, addresses, f"{subnet}.254"
    finally:
        for name in names:
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def pids_in(name: str, marker: str) -> list[int]:
    """Processes in namespace `name` whose command line contains `marker`."""
    out = []
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out
