"""In a fresh interpreter: ``python train.py`` refuses a bad ``algo`` value before any
worker starts, and composing a config, or what the driver and the rollout manager load,
leaves torch unimported. The ``algo`` rules themselves: tests/unit/test_config_algo.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.env import REPO


def _python() -> str:
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


@pytest.mark.parametrize("args,fragment", [
    (["algo.loss_agg=foo"], "algo.loss_agg='foo'"),
    (["algo.steps_per_rollout=0"], "algo.steps_per_rollout=0 must be > 0"),
    (["algo.is_mask=token", "algo.is_mask_high=0.5"], "need 0 <= is_mask_low <= 1 <= is_mask_high"),
])
def test_cli_refuses_bad_algo_before_any_worker(args, fragment):
    t0 = time.monotonic()
    proc = subprocess.run([_python(), "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert fragment in proc.stderr + proc.stdout
    assert "rl.driver.cluster:" not in proc.stdout and "rl.driver.run:" not in proc.stdout  # nothing started
    assert seconds < 10, seconds


def test_validating_a_config_does_not_import_torch():
    """Bad input must fail fast: composing and validating (``algo`` included) stays torch-free."""
    code = ("import sys; from tests.support.env import compose; "
            "compose('algo.loss_agg=seq_mean_token_mean', 'algo.kl_estimator=k1'); "
            "print(sorted(m for m in ('torch', 'numpy', 'ray') if m in sys.modules))")
    proc = subprocess.run([_python(), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "torch" not in proc.stdout.strip().splitlines()[-1], proc.stdout


def test_the_driver_and_the_rollout_manager_load_no_torch(tiny_path, tmp_path):
    """What the driver runs before and while it starts the actors (the run directory, the
    actor classes) and what the rollout manager loads (the advantages, the tiny model's
    tokenizer) leave torch to the learners and engines, which import it anyway.
    (``tiny_path``: the tiny checkpoint is built beforehand, which does need torch.)"""
    code = ("import sys; from tests.support.env import compose\n"
            "from rl.driver.run import prepare_run\n"
            "from rl.driver.cluster import Cluster\n"
            "from rl.driver.learners import LearnerGroup\n"
            "from rl.rollout.manager import RolloutManager\n"
            "from rl.model import load_tokenizer\n"
            f"runtime = prepare_run(compose('output_dir={tmp_path}'))\n"
            "load_tokenizer(runtime.model_path)\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([_python(), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout
