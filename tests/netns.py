"""Nodes on networks of their own: Linux network namespaces joined by a bridge, for the tests
of a federation that meets a bad network (tests/test_netns.py).

``Network(n)`` makes a bridge in this (the SuperLink's) namespace, ``SERVER`` on it, and one
namespace per node, each with its loopback up and one end of a veth pair at ``node_address(i)``
(the other end on the bridge). A node's link can be throttled (``tc ... tbf``: this kernel has
no ``netem``) in both directions or cut (``ip link set ... down``) and restored. Everything is
removed by :meth:`Network.close` (idempotent), also after a failure half way through setup.
Needs root and ``ip netns``: :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.231.{}"  # 10.231.<tag>.0/24: a private range, one /24 per Network


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaced networks cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"fflprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return None


def free_tag() -> int:
    """A third byte for 10.231.x.0/24 that no address here uses (two test processes side by
    side each get their own subnet)."""
    used = _ip("-4", "addr", check=False).stdout
    start = os.getpid() % 200
    for k in range(200):
        tag = 20 + (start + k) % 200
        if f"{SUBNET.format(tag)}." not in used:
            return tag
    raise RuntimeError("no free 10.231.x.0/24 subnet")


class Network:
    """A bridge with the SuperLink's address and ``n`` node namespaces (see the module docstring)."""

    def __init__(self, n: int, tag: int | None = None):
        self.n = n
        self.tag = free_tag() if tag is None else tag  # the subnet's third byte
        self.key = f"{os.getpid() % 100000}"
        self.bridge = f"fflbr{self.key}"
        self.server = f"{SUBNET.format(self.tag)}.1"
        self.made: list[tuple[str, str]] = []  # ("netns"|"link", name), in the order made

    def ns(self, i: int) -> str:
        return f"ffl{self.key}n{i}"

    def host_end(self, i: int) -> str:  # the veth end on the bridge (<= 15 characters)
        return f"fh{self.key}n{i}"

    def node_end(self, i: int) -> str:  # the veth end inside the node's namespace
        return f"fn{self.key}n{i}"

    def node_address(self, i: int) -> str:
        return f"{SUBNET.format(self.tag)}.{10 + i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on node ``i``'s network."""
        return ["ip", "netns", "exec", self.ns(i)]

    def open(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.server}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n):
                ns, host, node = self.ns(i), self.host_end(i), self.node_end(i)
                _ip("netns", "add", ns)
                self.made.append(("netns", ns))
                _ip("link", "add", host, "type", "veth", "peer", "name", node)
                self.made.append(("link", host))
                _ip("link", "set", node, "netns", ns)
                _ip("link", "set", host, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.node_address(i)}/24", "dev", node)
                _ip("-n", ns, "link", "set", node, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def throttle(self, i: int, rate: str = "256kbit") -> None:
        """Limit node ``i``'s link to ``rate`` both ways (a token bucket: queued bytes beyond
        400 ms are dropped, as on a slow uplink)."""
        tbf = ["root", "tbf", "rate", rate, "burst", "16kbit", "latency", "400ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.host_end(i), *tbf], check=True,
                       capture_output=True, timeout=30)
        subprocess.run([*self.prefix(i), "tc", "qdisc", "replace", "dev", self.node_end(i), *tbf],
                       check=True, capture_output=True, timeout=30)

    def unthrottle(self, i: int) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.host_end(i), "root"], capture_output=True,
                       check=False, timeout=30)
        subprocess.run([*self.prefix(i), "tc", "qdisc", "del", "dev", self.node_end(i), "root"],
                       capture_output=True, check=False, timeout=30)

    def cut(self, i: int) -> None:
        """Node ``i`` loses its link (its processes run on, unreachable)."""
        _ip("link", "set", self.host_end(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.host_end(i), "up")

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.made.clear()

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def opened(n: int):
    """A fixture's body: an open ``Network(n)``, closed afterwards; the test skipped, saying
    why, where namespaced networks cannot be made."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    net = Network(n).open()
    try:
        yield net
    finally:
        net.close()
