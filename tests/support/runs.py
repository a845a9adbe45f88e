"""Whole runs of ``train.py`` and ``train_async.py`` as a user starts them, and what the
tests read back from them: the metrics rows, the engines' ports, the sample ledger, and that
nothing was left running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

from tests.support.env import REPO
from tests.support.procs import own_ray_env, pids_with, ray_left

REQUIRED = ["perf/step_time", "perf/rollout_time", "perf/train_time", "perf/update_weights_time",
            "transfer/put_ms", "transfer/get_ms", "transfer/bytes", "transfer/get_gbps",
            "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/kl",
            "train/clipfrac", "train/grad_norm", "train/tokens_per_s", "weights/bytes",
            "train/approx_kl", "train/entropy", "train/optimizer_steps", "perf/old_logp_time",
            "rollout/zero_std_groups", "rollout/solved_frac", "rollout/partial_frac"]


def train(*overrides: str, timeout: float = 600, own_ray: bool = False) -> subprocess.CompletedProcess:
    """``python train.py overrides``, which must succeed; ``own_ray``: with a Ray of its own."""
    env = {**(own_ray_env() if own_ray else os.environ), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def train_async(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python train_async.py logger=console overrides``, which must succeed."""
    proc = subprocess.run([sys.executable, "train_async.py", "logger=console", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


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
