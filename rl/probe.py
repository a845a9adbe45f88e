"""The one TCP probe every watcher uses (the driver's ``rl.driver.watchdog``, the rollout side's
``rl.rollout.health``).

A connect, not a request: the kernel accepts a connection even while the server is busy,
so a refusal means the process is gone, while a timeout or another network error may be a
moment's trouble that only repeated misses turn into a death.
"""

from __future__ import annotations

import socket
from typing import Literal, Optional
from urllib.parse import urlsplit

Outcome = Literal["up", "refused", "miss"]


def probe_port(host: str, port: int, timeout_s: float = 2.0) -> tuple[Outcome, Optional[str]]:
    """``("up", None)``, ``("refused", why)`` (nothing listens: gone), or ``("miss", why)``
    (no answer in time, unreachable, out of sockets: not yet a death)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return "up", None
    except socket.timeout:
        return "miss", f"no answer on {host}:{port}"
    except ConnectionRefusedError:
        return "refused", f"{host}:{port} refuses connections"
    except OSError as e:
        return "miss", f"{host}:{port} unreachable ({e.strerror or e})"


def host_port(url: str) -> tuple[str, int]:
    """The host and port of an ``http://host:port`` URL."""
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80
