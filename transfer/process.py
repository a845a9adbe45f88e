"""Child processes (engine servers, the Mooncake master): die with the parent, stop by PID,
show the tail of their log in errors."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from collections import deque


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: stop() still ends the child


def stop(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; a no-op for a process that already ended."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return "(no log)"
