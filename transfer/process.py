"""Child processes (engine servers, the Mooncake master): start one and wait until it is
healthy, die with the parent, stop by PID, show the tail of the log in errors."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from typing import Callable


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


def start_child(cmd: list[str], *, name: str, log_path: str, ready: Callable[[], bool],
                timeout_s: float, waits_for: str = "its readiness check", timeout_hint: str = "",
                env: dict[str, str] | None = None, tie_to_parent: bool = True,
                poll_s: float = 0.1) -> subprocess.Popen:
    """Start ``cmd`` with its output appended to ``log_path`` and poll ``ready()`` until it
    answers true (``waits_for`` names that check in errors). A child that exits first, or is
    not ready within ``timeout_s`` (then it is stopped), raises a RuntimeError naming it, with
    the last lines of its log. ``timeout_hint``: the setting that bounds the wait."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        # A session of its own: a terminal's Ctrl-C (SIGINT to its foreground process group)
        # reaches the run's driver, which stops its children in order, and not the children
        # themselves, whose deaths would then read as failures of the run.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None,
                                preexec_fn=die_with_parent if tie_to_parent else None,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} while starting; "
                                   f"last lines of {log_path}:\n{log_tail(log_path)}")
            if ready():
                return proc
            time.sleep(poll_s)
        hint = f" ({timeout_hint})" if timeout_hint else ""
        raise RuntimeError(f"{name} did not answer {waits_for} within {timeout_s:.0f}s{hint}; "
                           f"last lines of {log_path}:\n{log_tail(log_path)}")
    except BaseException:
        stop(proc)  # a failed check, a timeout or Ctrl-C: no child is left behind
        raise
