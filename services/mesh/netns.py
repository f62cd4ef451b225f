"""Emulated hosts, for the data-plane benchmark and for a mesh on network-namespace hosts (the
launcher's `MeshConfig.netns`): network namespaces behind one switch, with a rate-limited
(tc tbf) uplink each, so that the network and not the CPU is the bottleneck.

Topology for `n` hosts (names unique per run: `<prefix>-sw`, `<prefix>-h0` ...)::

    <prefix>-h0  bm0 10.77.0.1/24 ──veth── p0 ┐
    <prefix>-h1  bm0 10.77.0.2/24 ──veth── p1 ├─ br0 (a bridge in the namespace <prefix>-sw)
    ...                                       ┘

Every host's `bm0` has `tbf rate <rate>mbit` as its root qdisc: its egress (uplink) is
shaped, as a NIC's line rate would be. The switch side (a host's downlink) is not shaped, so a
host receiving from g sources at once can take g uplinks' worth of bytes (sharded transfer).
The addresses exist only inside these namespaces, unless the plan has a `root_address`: then
the root namespace joins the switch too (a veth `<prefix>-r`, unshaped), so processes left there (a
mesh's manager and gateway, its clients) reach the hosts and are reached by them. `plan()` is
pure (it only builds the command lines); `ShapedNetwork` runs them and always deletes the
namespaces again (also on Ctrl-C); deleting the switch takes the root link with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

DEVICE = "bm0"  # the host side of every host's veth (same name in every namespace)
BRIDGE = "br0"
ROOT_PORT = "proot"  # the switch side of the root namespace's veth


@dataclass(frozen=True, slots=True)
class NetnsHost:
    index: int
    netns: str  # namespace name (as in /var/run/netns)
    address: str  # IPv4 address of `device` inside the namespace
    device: str = DEVICE


@dataclass(frozen=True, slots=True)
class NetnsPlan:
    """What to create: the switch namespace, the hosts, and the shaping of each uplink."""

    prefix: str
    switch: str
    hosts: tuple[NetnsHost, ...]
    rate_mbit: float
    burst_kbit: int
    latency_ms: int
    prefix_len: int = 24
    root_address: str | None = None  # the root namespace's address on the switch (None: not joined)

    @property
    def root_device(self) -> str:
        """The root namespace's end of its veth (unique per plan: the root namespace is shared)."""
        return f"{self.prefix[-12:]}-r"

    @property
    def link_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def tbf_args(self) -> list[str]:
        return [
            "tbf",
            "rate",
            f"{self.rate_mbit:g}mbit",
            "burst",
            f"{self.burst_kbit}kbit",
            "latency",
            f"{self.latency_ms}ms",
        ]

    def setup_commands(self) -> list[list[str]]:
        sw = self.switch
        cmds = [
            ["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
        ]
        for h in self.hosts:
            port = f"p{h.index}"
            cmds += [
                ["ip", "netns", "add", h.netns],
                ["ip", "-n", h.netns, "link", "set", "lo", "up"],
                # Created inside the host namespace, its peer straight in the switch namespace:
                # nothing ever appears in the root namespace.
                ["ip", "-n", h.netns, "link", "add", h.device, "type", "veth", "peer", "name", port, "netns", sw],
                ["ip", "-n", h.netns, "addr", "add", f"{h.address}/{self.prefix_len}", "dev", h.device],
                ["ip", "-n", h.netns, "link", "set", h.device, "up"],
                ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
                ["ip", "-n", sw, "link", "set", port, "up"],
                ["tc", "-n", h.netns, "qdisc", "add", "dev", h.device, "root", *self.tbf_args()],
            ]
        if self.root_address is not None:
            root = self.root_device
            cmds += [
                ["ip", "link", "add", root, "type", "veth", "peer", "name", ROOT_PORT, "netns", sw],
                ["ip", "addr", "add", f"{self.root_address}/{self.prefix_len}", "dev", root],
                ["ip", "link", "set", root, "up"],
                ["ip", "-n", sw, "link", "set", ROOT_PORT, "master", BRIDGE],
                ["ip", "-n", sw, "link", "set", ROOT_PORT, "up"],
            ]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        # Deleting a namespace destroys the veth ends in it (and with them their peers).
        return [["ip", "netns", "del", h.netns] for h in self.hosts] + [["ip", "netns", "del", self.switch]]


def plan(
    n_hosts: int,
    *,
    prefix: str | None = None,
    subnet: str = "10.77.0",
    rate_mbit: float = 800,
    burst_kbit: int = 2048,
    latency_ms: int = 50,
    join_root: bool = False,
) -> NetnsPlan:
    """The plan for `n_hosts` hosts named `<prefix>-h<i>` at `<subnet>.<i+1>`; with `join_root`,
    the root namespace joins the switch at `<subnet>.254`."""
    if not 1 <= n_hosts <= 250:
        raise ValueError(f"n_hosts must be in [1, 250], got {n_hosts}")
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit!r}")
    octets = subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
        raise ValueError(f"subnet must be three octets like '10.77.0', got {subnet!r}")
    prefix = prefix or f"bmdp-{os.getpid()}"
    if len(prefix) > 40 or not all(c.isalnum() or c in "-_" for c in prefix):
        raise ValueError(f"bad namespace prefix {prefix!r}")
    hosts = tuple(NetnsHost(i, f"{prefix}-h{i}", f"{subnet}.{i + 1}") for i in range(n_hosts))
    root = f"{subnet}.254" if join_root else None
    return NetnsPlan(prefix, f"{prefix}-sw", hosts, rate_mbit, burst_kbit, latency_ms, root_address=root)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`/`tc`), or None if they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


class ShapedNetwork:
    """Context manager: creates the namespaces of `plan`, deletes them on exit (whatever happens)."""

    def __init__(self, netplan: NetnsPlan) -> None:
        self.plan = netplan
        self._created = False

    @property
    def hosts(self) -> tuple[NetnsHost, ...]:
        return self.plan.hosts

    def __enter__(self) -> ShapedNetwork:
        self._created = True  # set first: a half-made topology is torn down too
        try:
            for cmd in self.plan.setup_commands():
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._created:
            return
        self._created = False
        existing = set(_list_netns())
        for cmd in self.plan.teardown_commands():
            if cmd[-1] in existing:
                subprocess.run(cmd, capture_output=True, text=True)

    def qdisc(self, host: NetnsHost) -> str:
        """`tc qdisc show` of a host's device (to record the shaping in the results)."""
        done = subprocess.run(
            ["tc", "-n", host.netns, "qdisc", "show", "dev", host.device], capture_output=True, text=True
        )
        return done.stdout.strip()

    def tx_bytes(self, host: NetnsHost) -> int:
        """Bytes sent by a host's device so far (from the namespace's sysfs view via `ip -s`)."""
        done = subprocess.run(
            ["ip", "-n", host.netns, "-s", "-j", "link", "show", host.device], capture_output=True, text=True
        )
        try:
            return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, KeyError, IndexError, TypeError):
            return -1


def remove_stale(prefix: str = "bmdp-") -> list[str]:
    """Delete namespaces `<prefix><pid>-...` left by a run whose process no longer exists (one
    killed with SIGKILL cannot clean up); returns the names deleted."""
    removed = []
    for name in _list_netns():
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        if subprocess.run(["ip", "netns", "del", name], capture_output=True).returncode == 0:
            removed.append(name)
    return removed


def _list_netns() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
