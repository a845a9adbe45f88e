"""The policy-update options of ``algo``: every bad value is refused with a
ValueError that names the field, before any worker starts; every valid choice composes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, compose

# rollout.prompts_per_step=2 x rollout.n_samples_per_prompt=2 over 2 learners: 2 samples a rank
SMALL = ("rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "cluster.num_learners=2")


@pytest.mark.parametrize("overrides,fragment", [
    (("algo.steps_per_rollout=0",), "algo.steps_per_rollout=0 must be > 0"),
    (("algo.steps_per_rollout=-1",), "algo.steps_per_rollout=-1 must be > 0"),
    ((*SMALL, "algo.steps_per_rollout=3"),
     "algo.steps_per_rollout=3 exceeds the 2 samples each of the cluster.num_learners=2 ranks"),
    # the default job: 64 prompts x 8 samples over 2 learners = 256 a rank
    (("algo.steps_per_rollout=257",), "algo.steps_per_rollout=257 exceeds the 256 samples"),
    (("algo.loss_agg=foo",),
     "algo.loss_agg='foo': use one of token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"),
    (("algo.kl_estimator=k2",), "algo.kl_estimator='k2': use one of k1, k3"),
    (("algo.entropy_coef=-1",), "algo.entropy_coef=-1.0 must be >= 0"),
])
def test_bad_algo_values_name_the_field(overrides, fragment):
    with pytest.raises(ValueError) as e:
        compose(*overrides)
    assert fragment in str(e.value)


@pytest.mark.parametrize("overrides,field,value", [
    (("algo.steps_per_rollout=1",), "steps_per_rollout", 1),
    ((*SMALL, "algo.steps_per_rollout=2"), "steps_per_rollout", 2),  # one sample per mini-batch
    (("algo.steps_per_rollout=256",), "steps_per_rollout", 256),
    (("algo.loss_agg=token_mean",), "loss_agg", "token_mean"),
    (("algo.loss_agg=seq_mean_token_mean",), "loss_agg", "seq_mean_token_mean"),
    (("algo.loss_agg=seq_mean_token_sum_norm",), "loss_agg", "seq_mean_token_sum_norm"),
    (("algo.kl_estimator=k1", "algo.kl_coef=0.1"), "kl_estimator", "k1"),
    (("algo.kl_estimator=k3", "algo.kl_coef=0.1"), "kl_estimator", "k3"),
    (("algo.entropy_coef=0",), "entropy_coef", 0.0),
    (("algo.entropy_coef=0.01",), "entropy_coef", 0.01),
    (("algo.drop_zero_std_groups=true",), "drop_zero_std_groups", True),
    (("algo.drop_zero_std_groups=false",), "drop_zero_std_groups", False),
    (("algo.advantage_std_norm=false",), "advantage_std_norm", False),
])
def test_valid_algo_choices_compose(overrides, field, value):
    assert getattr(compose(*overrides).algo, field) == value


def test_algo_defaults_are_todays_behaviour():
    a = compose().algo
    assert (a.steps_per_rollout, a.loss_agg, a.kl_estimator, a.entropy_coef, a.drop_zero_std_groups) == (
        1, "token_mean", "k3", 0.0, False)


def _python() -> str:
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


@pytest.mark.parametrize("args,fragment", [
    (["algo.loss_agg=foo"], "algo.loss_agg='foo'"),
    (["algo.steps_per_rollout=0"], "algo.steps_per_rollout=0 must be > 0"),
])
def test_cli_refuses_bad_algo_before_any_worker(args, fragment):
    t0 = time.monotonic()
    proc = subprocess.run([_python(), "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert fragment in proc.stderr + proc.stdout
    assert "[cluster]" not in proc.stdout and "[run]" not in proc.stdout  # nothing was started
    assert seconds < 10, seconds


def test_validating_a_config_does_not_import_torch():
    """Bad input must fail fast: composing and validating (``algo`` included) stays torch-free."""
    code = ("import sys; from tests.conftest import compose; "
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
    code = ("import sys; from tests.conftest import compose\n"
            "from rl.run import prepare_run\n"
            "from rl.cluster import Cluster\n"
            "from rl.learner.learner import Learner\n"
            "from rl.rollout.manager import RolloutManager\n"
            "from rl.model import load_tokenizer\n"
            f"runtime = prepare_run(compose('output_dir={tmp_path}'))\n"
            "load_tokenizer(runtime.model_path)\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([_python(), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout
