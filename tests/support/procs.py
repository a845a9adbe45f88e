"""Processes as the tests see them: waiting for another process's state, finding processes by
command line, a training run in the background, and the one-node ``ray start --head`` that a
module's runs share."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress

from tests.support.env import AUTH_OFF_HERE, REPO

RUN_ACTORS = ("ray::Learner", "ray::EngineProcess", "ray::RolloutManager")
"""The command-line names of a run's Ray actors: none may outlive the run."""
RAY_HEAD_DIR = "RL_TEST_RAY_HEAD_DIR"
"""Set, to the head's temp dir, while a module's runs share ``ray_head()``."""


@contextmanager
def ray_head():
    """A one-node Ray started as ``ray start --head``, as a multi-node cluster's head is, for
    the runs of one test module: ``RAY_ADDRESS`` points each run at it, so a run connects
    (0.4 s) and disconnects instead of starting and stopping a Ray of its own (about 4 s), and
    its actors must go when its driver does, the way they must on a long-lived cluster.
    ``ray start --block`` stops every process it started on SIGTERM."""
    from transfer.net import free_port

    temp_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port("127.0.0.1")
    log_path = os.path.join(temp_dir, "ray_start.log")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
                                 "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                                 "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # killable as a group if it hangs
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", RAY_HEAD_DIR)}
    failed = True
    try:
        deadline = time.monotonic() + 60
        while "Ray runtime started" not in open(log_path).read():
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.1)
        os.environ.update({"RAY_ADDRESS": f"127.0.0.1:{port}", RAY_HEAD_DIR: temp_dir})
        yield os.environ["RAY_ADDRESS"]
        failed = False
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 20
        while (left := pids_with(temp_dir) + pids_with("ray::")) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:  # never left for the next module to trip over
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
        # a failure of the module (or of the start) is the error to see, not this one
        assert failed or not left, f"the test Ray left processes behind: {left}"


def own_ray_env() -> dict[str, str]:
    """``os.environ`` for a run that starts and stops a Ray of its own, as ``make train``
    does, even inside a module whose runs share ``ray_head()``."""
    drop = ("RAY_ADDRESS", RAY_HEAD_DIR) + (("RAY_AUTH_MODE",) if AUTH_OFF_HERE else ())
    return {k: v for k, v in os.environ.items() if k not in drop}


def ray_left() -> list[int]:
    """Ray processes a finished run may not leave behind: outside a shared head, any; with
    one, the run's own actors and any Ray other than the head."""
    head = os.environ.get(RAY_HEAD_DIR)
    if not head:
        return pids_with("ray::")
    heads = set(pids_with(head))
    actors = [p for name in RUN_ACTORS for p in pids_with(name)]
    return actors + [p for frag in ("/raylet ", "/gcs_server ") for p in pids_with(frag) if p not in heads]


def wait_until(check, timeout_s: float = 10.0, every_s: float = 0.05) -> bool:
    """Whether ``check()`` comes true within ``timeout_s``: for state that another process
    changes on its own time (a release, an exit, a name dropped)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def pids_with(fragment: str) -> list[int]:
    """PIDs of live processes whose command line contains ``fragment``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if fragment in cmd and state != "Z":
            out.append(int(pid))
    return out


@contextmanager
def running(script: str, *overrides: str, env: dict[str, str] | None = None):
    """A training run in the background, in a process group of its own as a terminal's
    foreground job (``os.killpg(proc.pid, SIGINT)`` is a terminal's Ctrl-C); killed if the
    test leaves it running."""
    proc = subprocess.Popen([sys.executable, script, *overrides], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_until(proc: subprocess.Popen, prefix: str, timeout_s: float = 240) -> str:
    """The run's output up to and including the first line starting with ``prefix``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith(prefix):
            return "".join(lines)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no line {prefix!r} in the output:\n" + "".join(lines[-50:]))
