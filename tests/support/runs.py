"""Whole runs of ``train.py`` and ``train_async.py`` as a user starts them, and what the
tests read back from them: the metrics rows, the engines' ports, the sample ledger, and that
nothing was left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import suppress

from tests.support.env import REPO
from tests.support.procs import RUN_ACTORS, own_ray_env, pids_with, ray_left

REQUIRED = ["perf/step_time", "perf/rollout_time", "perf/train_time", "perf/update_weights_time",
            "transfer/put_ms", "transfer/get_ms", "transfer/bytes", "transfer/get_gbps",
            "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/kl",
            "train/clipfrac", "train/grad_norm", "train/tokens_per_s", "weights/bytes",
            "train/approx_kl", "train/entropy", "train/optimizer_steps", "perf/old_logp_time",
            "rollout/zero_std_groups", "rollout/solved_frac", "rollout/partial_frac"]


def train(*overrides: str, timeout: float = 420, own_ray: bool = False) -> subprocess.CompletedProcess:
    """``python train.py overrides``, which must succeed; ``own_ray``: with a Ray of its own."""
    env = {**(own_ray_env() if own_ray else os.environ), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    return run_script("train.py", *overrides, env=env, timeout=timeout)


def train_async(*overrides: str, timeout: float = 420) -> subprocess.CompletedProcess:
    """``python train_async.py logger=console overrides``, which must succeed."""
    return run_script("train_async.py", "logger=console", *overrides,
                      env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=timeout)


TEST_DEADLINE: dict[str, float | None] = {"at": None}
"""When the running test's pytest-timeout limit falls (``time.monotonic()``), set by the
``test_deadline`` fixture of tests/support/fixtures.py; None outside a test."""
DUMP_S = 30.0
"""The most the stacks of a hung run may take (py-spy, every process at once)."""
REPORT_S = 120.0
"""Left before the test's limit for a hung run's report (``DUMP_S``), its stop (30 s at
most) and what the test's own clock started before the fixture's."""


def run_script(script: str, *overrides: str, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``python script overrides``, which must succeed within ``timeout`` (cut to end
    ``REPORT_S`` before the test's own limit): a run that does not end fails the test with
    where it waits, every thread's stack of the driver and of the run's actors (py-spy), or,
    when the driver exited, the processes still holding its output open, instead of
    pytest-timeout's view of the test waiting. A run is never left behind: whatever ends the
    wait (its limit, the test's, Ctrl-C) stops it."""
    asked = timeout
    if TEST_DEADLINE["at"] is not None:
        timeout = max(1.0, min(timeout, TEST_DEADLINE["at"] - REPORT_S - time.monotonic()))
    proc = subprocess.Popen([sys.executable, script, *overrides], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    stopped = False
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            limit = f"{timeout:.0f}s" + ("" if timeout == asked else
                                         f" (its {asked:.0f}s cut to end before the test's limit)")
            what = _hang_report(proc, limit)
            stdout, stderr = _stop(proc)
            stopped = True
            raise AssertionError(f"{script} {what}\nstdout:\n{stdout[-3000:]}\n"
                                 f"stderr:\n{stderr[-5000:]}") from None
    finally:  # also on pytest-timeout's own limit, or Ctrl-C (its own session: not reached)
        if not stopped and proc.poll() is None:
            _stop(proc)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return done


def _hang_report(proc: subprocess.Popen, limit: str) -> str:
    if proc.poll() is None:
        what = f"still running after {limit}; its stacks:"
        pids = [proc.pid]
    else:  # its output can only be held open by a process it started that outlives it
        holders = pipe_holders(proc.stdout, proc.stderr)
        what = (f"exited ({proc.returncode}), but after {limit} its output is still held open by "
                + ("; ".join(f"pid {pid}: {cmd}" for pid, cmd in holders) or "nothing found now"))
        pids = [pid for pid, _ in holders]
    pids += [pid for name in RUN_ACTORS for pid in pids_with(name)]
    return what + "".join(f"\n--- pid {pid}:\n{stack}" for pid, stack in zip(pids, py_spy_dumps(pids)))


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Kill a run (its session) and whatever still holds its output; what it printed."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid, _ in pipe_holders(proc.stdout, proc.stderr):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "(its output still held open)", ""


def pipe_holders(*pipes) -> list[tuple[int, str]]:
    """The processes (pid, command line) that hold the write end of these pipes (whose read
    ends the test holds) open."""
    inodes = {f"pipe:[{os.fstat(p.fileno()).st_ino}]" for p in pipes if not p.closed}
    found = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        with suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes and _writes(pid, fd):
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:300]))
                    break
    return found


def _writes(pid: int, fd: str) -> bool:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        flags = next(line.split()[1] for line in f if line.startswith("flags:"))
    return int(flags, 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def py_spy_dumps(pids: list[int]) -> list[str]:
    """Every thread's Python stack (with native frames where py-spy can read them) of each
    live process, all dumped at once, within ``DUMP_S`` in all."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    deadline = time.monotonic() + DUMP_S

    def start(pid: int, native: bool) -> subprocess.Popen:
        return subprocess.Popen([spy, "dump", *(["--native"] if native else []), "--pid", str(pid)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(proc: subprocess.Popen) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return -1, f"(py-spy dump not done within {DUMP_S:.0f}s)"

    try:
        results = [finish(p) for p in [start(pid, True) for pid in pids]]
        retry = [i for i, (rc, _) in enumerate(results) if rc > 0]  # native frames unreadable here?
        for i, p in zip(retry, [start(pids[i], False) for i in retry]):
            results[i] = finish(p)
    except OSError as e:
        return [f"(py-spy dump failed: {e})"] * len(pids)
    return [out for _, out in results]


def read_metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def engine_ports(stdout: str) -> list[str]:
    m = re.search(r"engines up: (.*)", stdout)
    assert m, stdout
    return [u.rsplit(":", 1)[1] for u in m.group(1).split(", ")]


def assert_nothing_left(ports: list[str]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for port in ports for p in pids_with(f"--port {port}")] + ray_left()
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes left behind: {left}")


def read_ledger(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_ledger(ledger: list[dict], rows: list[dict], stdout: str, max_staleness: int,
                 first_step: int = 0) -> Counter:
    """Every generated sample has exactly one outcome, trained ones within the bound, and
    the learners trained exactly the samples the ledger says (their own count)."""
    first = ledger[0]["first_sample_id"]
    ids = [e["first_sample_id"] + i for e in ledger for i in range(len(e["outcome"]))]
    assert ids == list(range(first, first + len(ids)))  # each sample once, none missing
    outcomes = Counter(o for e in ledger for o in e["outcome"])
    assert set(outcomes) <= {"trained", "stale", "end_of_run"}, outcomes  # a whole run: none interrupted
    prompts = [p for e in ledger for p in e.get("prompts", [])]
    assert len(prompts) == len(set(prompts))  # no prompt generated into two stored batches
    trained_per_step = Counter()
    for e in ledger:
        for v, o in zip(e["weight_version"], e["outcome"]):
            if o == "trained":
                assert 0 <= e["trained_at_step"] - v <= max_staleness, e
                trained_per_step[e["trained_at_step"]] += 1
            elif o == "stale":  # dropped: it was older than the bound for every step it could join
                assert e["trained_at_step"] is None or e["trained_at_step"] - v > max_staleness
    steps = [r["step"] for r in rows]
    assert sorted(trained_per_step) == steps == list(range(first_step, first_step + len(rows)))
    assert [trained_per_step[r["step"]] for r in rows] == [r["train/samples"] for r in rows]
    assert sum(r["async/dropped_samples"] for r in rows) == outcomes["stale"]
    m = re.search(r"rl\.driver\.run: samples: (\d+) generated = (\d+) trained", stdout)
    assert m and (int(m[1]), int(m[2])) == (len(ids), outcomes["trained"]), stdout[-2000:]
    return outcomes
