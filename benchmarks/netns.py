"""Hosts on one machine: Linux network namespaces (root only). Two hosts are joined by a veth
pair; three or more by a bridge in a namespace of its own (the switch), one veth per host,
so that nothing is added to the machine's own namespace and its firewall never sees the
traffic."""

from __future__ import annotations

import os
import signal
import subprocess
import time


class Netns:
    """Namespaces ``{prefix}A``, ``{prefix}B``, ... with addresses ``{subnet}.1``, ``.2``, ...
    and ``lo`` up; ``remove`` kills every process in them and deletes them (the veths and
    the bridge go with them)."""

    def __init__(self, prefix: str = "rlb", subnet: str = "10.231.7",
                 hosts: tuple[str, ...] = ("A", "B")) -> None:
        self.hosts = hosts
        """Host letters; Ray names each host's resource ``host<letter>``."""
        self.names = [f"{prefix}{h}" for h in hosts]
        self.ips = [f"{subnet}.{i + 1}" for i in range(len(hosts))]
        self.switch = f"{prefix}S" if len(hosts) > 2 else None
        """The namespace holding the bridge (None for two hosts: a veth pair joins them)."""
        self.bridge = f"{prefix}br"

    a = property(lambda self: self.names[0])
    b = property(lambda self: self.names[1])
    ip_a = property(lambda self: self.ips[0])
    ip_b = property(lambda self: self.ips[1])

    def sh(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True)

    def create(self) -> None:
        self.remove()
        for ns in self.names:
            self.sh("ip", "netns", "add", ns)
        if self.switch is None:
            self._pair()
        else:
            self._bridged()
        for ns, ip in zip(self.names, self.ips):
            self.sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", f"{ns}v")
            self.sh("ip", "-n", ns, "link", "set", f"{ns}v", "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _pair(self) -> None:
        self.sh("ip", "link", "add", f"{self.a}v", "type", "veth", "peer", "name", f"{self.b}v")
        for ns in self.names:
            self.sh("ip", "link", "set", f"{ns}v", "netns", ns)

    def _bridged(self) -> None:
        """One veth per host: ``<ns>v`` in the host, ``<ns>s`` on the switch's bridge."""
        sw = self.switch
        self.sh("ip", "netns", "add", sw)
        self.sh("ip", "-n", sw, "link", "add", self.bridge, "type", "bridge")
        self.sh("ip", "-n", sw, "link", "set", self.bridge, "up")
        for ns in self.names:
            self.sh("ip", "link", "add", f"{ns}v", "type", "veth", "peer", "name", f"{ns}s")
            self.sh("ip", "link", "set", f"{ns}v", "netns", ns)
            self.sh("ip", "link", "set", f"{ns}s", "netns", sw)
            self.sh("ip", "-n", sw, "link", "set", f"{ns}s", "master", self.bridge)
            self.sh("ip", "-n", sw, "link", "set", f"{ns}s", "up")

    def _namespaces(self) -> list[str]:
        return self.names + ([self.switch] if self.switch else [])

    def pids(self, ns: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def _all_pids(self) -> list[int]:
        return [p for ns in self._namespaces() for p in self.pids(ns)]

    def kill_all(self, grace_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self._all_pids():
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self._all_pids():
                time.sleep(0.2)

    def remove(self) -> None:
        for ns in self._namespaces():
            if os.path.exists(f"/var/run/netns/{ns}"):
                self.kill_all(grace_s=5.0)
                subprocess.run(["ip", "netns", "del", ns], check=False)
        for ns in self.names:  # a veth left in this namespace by a create that failed midway
            if os.path.exists(f"/sys/class/net/{ns}v"):
                subprocess.run(["ip", "link", "del", f"{ns}v"], check=False)
