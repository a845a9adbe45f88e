"""``transfer.process.start_child``: one way to start a child and wait until it is healthy,
used by the engines and the Mooncake master; whatever goes wrong, no child is left."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.support.procs import wait_until
from transfer.process import start_child


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose; stop() reaps, so this is belt and braces
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _sleeper(pid_file) -> list[str]:
    """A child that writes its pid, then never becomes ready."""
    return [sys.executable, "-c",
            f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"]


def _pid(pid_file) -> int | None:
    text = pid_file.read_text() if pid_file.exists() else ""
    return int(text) if text else None


def _started(pid_file) -> bool:
    """Wait until the child has written its pid (its Python may start slowly on a loaded
    machine), then say it is not ready."""
    wait_until(lambda: _pid(pid_file) is not None, timeout_s=30)
    return False


def test_a_child_that_becomes_ready_is_returned_running(tmp_path):
    marker = tmp_path / "ready"
    proc = start_child([sys.executable, "-c", f"open({str(marker)!r}, 'w'); import time; time.sleep(600)"],
                       name="demo", log_path=str(tmp_path / "demo.log"), ready=marker.exists,
                       timeout_s=30)
    try:
        assert proc.poll() is None
        assert (tmp_path / "demo.log").read_text().startswith("$ ")  # the command heads its log
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_exits_is_named_with_its_code_and_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"demo exited with code 7 while starting(.|\n)*bad flag"):
        start_child([sys.executable, "-c", "print('bad flag', flush=True); raise SystemExit(7)"],
                    name="demo", log_path=str(tmp_path / "demo.log"), ready=lambda: False, timeout_s=30)


def test_a_timeout_stops_the_child_and_names_the_setting(tmp_path):
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"demo did not answer /ping within 2s \(demo.timeout_s\)"):
        start_child(_sleeper(pid_file), name="demo", log_path=str(tmp_path / "demo.log"),
                    ready=lambda: _started(pid_file), timeout_s=2, waits_for="/ping",
                    timeout_hint="demo.timeout_s")
    assert time.monotonic() - t0 < 15
    assert _pid(pid_file) and not _alive(_pid(pid_file))


def test_a_failing_readiness_check_stops_the_child(tmp_path):
    pid_file = tmp_path / "pid"

    def ready() -> bool:
        if _pid(pid_file) is None:
            return False  # not started yet
        raise ConnectionError("probe crashed")

    with pytest.raises(ConnectionError):
        start_child(_sleeper(pid_file), name="demo", log_path=str(tmp_path / "demo.log"),
                    ready=ready, timeout_s=30)
    assert not _alive(_pid(pid_file))
