"""``train.py`` as a user runs it, a few steps each: an engine that fails to start stops the
run and the learners setting up, a chat checkpoint (broadcast), every flat group dropped
(kept: tests/integration/test_learner.py), held-out evaluation, the multi-turn calculator task
through its rollout function and with turn credit (step by step), a rollout function that
cannot be imported; the other variants (p2p, fully async) in tests/e2e/test_train.py. The runs
connect to the module's ``ray start --head`` (``shared_ray``), as on a multi-node cluster.
Resume and Ctrl-C: tests/e2e/test_train.py; the reward rising: tests/e2e/test_learning.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.support.env import REPO
from tests.support.helpers import eval_task
from tests.support.runs import REQUIRED, assert_nothing_left, engine_ports, read_metrics, train
from tests.support.two_tiers import calculator_run, chat_checkpoint_run, turn_credit_run

pytestmark = pytest.mark.usefixtures("shared_ray")


def test_an_engine_that_fails_to_start_stops_the_run_and_the_learners_setting_up(tmp_path):
    """The learner ranks set up while the engines start (rl/driver/cluster.py): when an engine fails
    to start, the run fails naming it with its log, and the ranks, set up or not, go too."""
    proc = subprocess.run([sys.executable, "train.py", "num_steps=3", "rollout.prompts_per_step=8",
                           "logger=console", "rollout.device=cuda:99",  # no such device anywhere
                           f"output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    failed = r"engine-\d exited with code \d+ while starting; last lines of .*engine_\d\.log"
    assert re.search(failed, out), out[-3000:]
    assert not re.search(r"rl\.driver\.weights: \w+ plan:", out)  # stopped before any weight plan
    assert_nothing_left([])  # no rank on the shared head


def test_chat_checkpoint_gets_templated_prompts(chat_model_path, tmp_path):
    """A chat checkpoint's prompts go to the engines templated, over broadcast (p2p:
    tests/e2e/test_train.py; ``chat_checkpoint_run`` says what is checked)."""
    chat_checkpoint_run(chat_model_path, "broadcast", tmp_path)


FLAT_PROMPTS = 2


def _flat_reward_run(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """A tiny ``train.py`` run whose every reward is 0: ``exact_match`` against labels no
    response can equal (a character outside the tokenizer's alphabet, longer than
    ``rollout.max_new_tokens``), so every group's rewards are all equal."""
    data = tmp_path / "prompts.jsonl"
    label = "\\u2603" * 20  # JSON for 20 snowmen
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{label}"}}\n' for c in "abcd"))
    out = tmp_path / "out"
    proc = train("task=jsonl", f"task.path={data}", "task.reward._target_=rl.tasks.rewards.exact_match",
                 "transfer=ray", "logger=console", f"rollout.prompts_per_step={FLAT_PROMPTS}",
                 "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
                 f"output_dir={out}", "checkpoint.every=0", *overrides)
    return proc, read_metrics(out)


def test_dropping_every_flat_group_skips_the_update_and_still_logs(tmp_path):
    """``algo.drop_zero_std_groups=true`` when every group is flat: each step counts all its
    groups, takes no optimizer step, logs its full metrics row, and the run ends cleanly
    (the step's data is removed and nothing is left running)."""
    proc, rows = _flat_reward_run(tmp_path, "num_steps=3", "algo.drop_zero_std_groups=true")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(isinstance(r[k], float) and np.isfinite(r[k]) for k in REQUIRED), r
        assert r["rollout/reward_mean"] == 0.0 and r["rollout/reward_std"] == 0.0 == r["rollout/solved_frac"]
        assert r["rollout/zero_std_groups"] == FLAT_PROMPTS, r
        assert r["rollout/partial_frac"] == 0.0, r  # train.py syncs only between rollouts
        assert r["train/optimizer_steps"] == 0, r
        assert r["train/loss"] == 0.0 and r["train/grad_norm"] == 0.0, r
        assert r["transfer/bytes"] > 0 and r["weights/bytes"] > 0  # stored and synced as ever
    assert "step 3/3 | reward" in proc.stdout
    assert "leaked" not in proc.stdout + proc.stderr  # no nanobind dump at exit (rl.log.block_triton)
    assert "lr_scheduler.step()" not in proc.stdout + proc.stderr  # no step taken is no error to warn of
    assert_nothing_left(engine_ports(proc.stdout))


def test_evaluation_scores_held_out_prompts_with_the_task_reward(tmp_path):
    """``eval``: after every ``eval.every`` steps and after the last, the engines answer the
    held-out file's prompts with the weights just pushed and the task's reward scores them.
    ``finished_reward`` pays 1 exactly for an answer that ends, so the eval reward is the
    finished fraction; greedy answers of a prompt are all alike, so pass@2 equals it too."""
    out = tmp_path / "out"
    proc = train(*eval_task(tmp_path), "logger=console",
                 "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                 "rollout.max_new_tokens=4", "num_steps=3", "checkpoint.every=0", "eval.every=2",
                 "eval.num_prompts=5", "eval.n_samples=2", "eval.greedy=true",
                 "rollout.dump_every=2", f"output_dir={out}")
    rows = read_metrics(out)
    # rollout.dump_every=2: step 1's samples (the second step's), as trained and scored
    assert sorted(os.listdir(out / "rollouts")) == ["step_000001.jsonl"]
    dumped = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert [d["sample_id"] for d in dumped] == [4, 5, 6, 7] and {d["step"] for d in dumped} == {1}
    prompts = [d["prompt"] for d in dumped]  # two groups of two, from the training file
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and set(prompts) <= {"a:", "b:", "c:", "d:"}
    for d in dumped:
        assert d["reward"] == float(d["finished"]) and d["loss_mask"] == [1] * len(d["response_ids"])
        assert len(d["logprobs"]) == len(d["response_ids"]) and all(lp <= 0 for lp in d["logprobs"])
        assert d["scored_text"] == d["response"]  # single turn: the reward scores the answer
    assert np.mean([d["reward"] for d in dumped]) == pytest.approx(rows[1]["rollout/reward_mean"])
    assert ["eval/reward_mean" in r for r in rows] == [False, True, True]  # after steps 2 and 3
    # a reward of 0 or 1: every sample that earns one is solved
    assert all(r["rollout/solved_frac"] == pytest.approx(r["rollout/reward_mean"]) for r in rows)
    for r in rows[1:]:
        assert r["eval/reward_mean"] == pytest.approx(1.0 - r["eval/truncated_frac"])
        assert r["eval/pass@2"] == pytest.approx(r["eval/reward_mean"])
        assert 0.0 <= r["eval/reward_mean"] <= 1.0 and r["eval/time"] > 0
        assert 0 < r["eval/response_len_mean"] <= 4
    assert "eval after step 2: reward" in proc.stdout and "eval after step 3: reward" in proc.stdout
    assert_nothing_left(engine_ports(proc.stdout))


def test_calculator_task_trains_through_its_multi_turn_rollout_function(tmp_path):
    """The calculator's tool loop in a ``train.py`` run (fully async: tests/e2e/test_train.py;
    ``calculator_run`` says what is checked)."""
    calculator_run("train.py", tmp_path)


def test_turn_credit_gives_each_model_turn_its_advantage(tmp_path):
    """``algo.turn_credit=true`` in a ``train.py`` run (fully async: tests/e2e/test_train.py;
    ``turn_credit_run`` says what is checked)."""
    turn_credit_run("train.py", tmp_path)


def test_a_rollout_function_that_cannot_be_imported_stops_the_run_before_it_starts(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "rollout.function=rl.rollout.functions:nope",
                           f"output_dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    message = "rollout.function='rl.rollout.functions:nope' cannot be imported"
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
