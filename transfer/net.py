"""Ports and reachability, for both layers (engines, side groups, the Mooncake master)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
