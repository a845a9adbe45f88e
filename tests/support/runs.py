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


def run_script(script: str, *overrides: str, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``python script overrides``, which must succeed within ``timeout`` (below the test's own
    limit, so that a run that hangs is reported with where it hangs: every thread's stack of
    the driver and of the run's actors, by py-spy, and what it printed, instead of
    pytest-timeout's view of the test waiting)."""
    proc = subprocess.Popen([sys.executable, script, *overrides], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if proc.poll() is None:
            what = f"still running after {timeout:.0f}s; its stacks:\n{py_spy_dump(proc.pid)}"
        else:  # its output can only be held open by a process it started that outlives it
            holders = pipe_holders(proc.stdout, proc.stderr)
            what = (f"exited ({proc.returncode}), but after {timeout:.0f}s its output is still held open by "
                    + "; ".join(f"pid {pid}: {cmd}\n{py_spy_dump(pid)}" for pid, cmd in holders))
        what += "".join(f"\n{name} (pid {pid}):\n{py_spy_dump(pid)}" for name in RUN_ACTORS
                        for pid in pids_with(name))
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, _ in pipe_holders(proc.stdout, proc.stderr):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{script} {what}\nstdout:\n{stdout[-3000:]}\n"
                             f"stderr:\n{stderr[-5000:]}") from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return done


def pipe_holders(*pipes) -> list[tuple[int, str]]:
    """The processes (pid, command line) that hold the other end of these pipes open."""
    inodes = {f"pipe:[{os.fstat(p.fileno()).st_ino}]" for p in pipes}
    found = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()):
        with suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:300]))
    return found


def py_spy_dump(pid: int) -> str:
    """Every thread's Python stack (and native frames) of a live process, for a hang's report."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=60)
        return out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy dump failed: {e})"


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
