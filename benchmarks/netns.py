"""Two hosts on one machine: Linux network namespaces joined by a veth pair (root only)."""

from __future__ import annotations

import os
import subprocess
import time


class Netns:
    """Two namespaces A and B joined by a veth pair (root only); removed on exit."""

    def __init__(self, prefix: str = "rlb", subnet: str = "10.231.7") -> None:
        self.a, self.b = f"{prefix}A", f"{prefix}B"
        self.ip_a, self.ip_b = f"{subnet}.1", f"{subnet}.2"

    def sh(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True)

    def create(self) -> None:
        self.remove()
        self.sh("ip", "netns", "add", self.a)
        self.sh("ip", "netns", "add", self.b)
        self.sh("ip", "link", "add", f"{self.a}v", "type", "veth", "peer", "name", f"{self.b}v")
        for ns, ip in ((self.a, self.ip_a), (self.b, self.ip_b)):
            self.sh("ip", "link", "set", f"{ns}v", "netns", ns)
            self.sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", f"{ns}v")
            self.sh("ip", "-n", ns, "link", "set", f"{ns}v", "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")

    def pids(self, ns: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def kill_all(self, grace_s: float = 10.0) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids(self.a) + self.pids(self.b)
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.pids(self.a) + self.pids(self.b):
                time.sleep(0.2)

    def remove(self) -> None:
        for ns in (self.a, self.b):
            if os.path.exists(f"/var/run/netns/{ns}"):
                self.kill_all(grace_s=5.0)
                subprocess.run(["ip", "netns", "del", ns], check=False)
