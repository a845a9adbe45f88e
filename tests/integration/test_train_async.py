"""``train_async.py`` as a user runs it, a few steps each: held-out evaluation in both loops
(one-step off-policy and fully async), and the fully async stale-drop safety net forced by a
group that finishes after later ones. The runs connect to the module's ``ray start --head``
(``shared_ray``). Overlap, resume and Ctrl-C over every data path: tests/e2e/test_async.py."""

from __future__ import annotations

import re

import pytest

from tests.support.helpers import LATE_PROMPT, OLD_PROMPT, eval_task
from tests.support.runs import (REQUIRED, assert_nothing_left, check_ledger, engine_ports, read_ledger,
                                read_metrics, train_async)

pytestmark = pytest.mark.usefixtures("shared_ray")

PER_STEP, N = 2, 2  # prompts a step, samples a prompt
EVAL_PROMPTS, EVAL_N = 3, 3  # other sizes than training's: an eval group in a batch would show


@pytest.mark.parametrize("fully_async", [False, True], ids=["one-step", "fully-async"])
def test_evaluation_runs_in_both_async_loops_and_leaves_training_data_alone(fully_async, tmp_path):
    """``eval.every=2`` over 3 steps: the held-out prompts are answered after steps 2 and 3
    (the last) with the weights just pushed and scored by the task's reward
    (``finished_reward``: the eval reward is the finished fraction; greedy answers of a prompt
    are alike, so pass@3 equals it). Evaluation takes no training prompt or sample id: every
    step trains a whole batch, and in fully async the ledger accounts for every sample, within
    the staleness bound, with only training-sized groups; the run ends cleanly."""
    out = tmp_path / "out"
    proc = train_async(*eval_task(tmp_path), "transfer=ray",
                       f"rollout.fully_async={str(fully_async).lower()}",
                       f"rollout.prompts_per_step={PER_STEP}", f"rollout.n_samples_per_prompt={N}",
                       "rollout.max_new_tokens=4", "num_steps=3",
                       "checkpoint.every=0", "algo.max_staleness=1", "eval.every=2",
                       f"eval.num_prompts={EVAL_PROMPTS}", f"eval.n_samples={EVAL_N}", "eval.greedy=true",
                       f"output_dir={out}")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ["eval/reward_mean" in r for r in rows] == [False, True, True]  # after steps 2 and 3
    for r in rows:
        evaluated = "eval/reward_mean" in r
        assert all((k in r) == evaluated for k in (f"eval/pass@{EVAL_N}", "eval/time",
                                                   "eval/response_len_mean", "eval/truncated_frac")), r
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["train/samples"] == PER_STEP * N  # a whole training batch, nothing else
        assert 0 <= r["async/staleness_max"] <= 1
        if evaluated:
            assert 0.0 <= r["eval/reward_mean"] <= 1.0 and r["eval/time"] > 0
            assert r["eval/reward_mean"] == pytest.approx(1.0 - r["eval/truncated_frac"])
            assert r[f"eval/pass@{EVAL_N}"] == pytest.approx(r["eval/reward_mean"])
            assert 0 < r["eval/response_len_mean"] <= 4
    assert "eval after step 2: reward" in proc.stdout and "eval after step 3: reward" in proc.stdout
    assert "eval after step 1" not in proc.stdout
    if fully_async:
        ledger = read_ledger(out)
        outcomes = check_ledger(ledger, rows, proc.stdout, max_staleness=1)
        assert outcomes["trained"] == 3 * PER_STEP * N
        for e in ledger:  # only training groups were stored: eval groups have other sizes
            assert len(e["prompts"]) == PER_STEP and len(e["outcome"]) == PER_STEP * N, e
        prompts = [p for e in ledger for p in e["prompts"]]
        assert len(set(prompts)) == len(prompts) and max(prompts) < len(prompts) + 2 * PER_STEP
    else:
        assert rows[0]["async/staleness_max"] == 0 and all(r["async/staleness_max"] == 1 for r in rows[1:])
    assert_nothing_left(engine_ports(proc.stdout))


@pytest.mark.parametrize("data_path", ["mooncake-packed"], indirect=True)
def test_an_overtaken_group_is_trained_within_its_bound_and_an_older_one_is_dropped(tmp_path, data_path):
    """Fully async, one group a batch, ``algo.max_staleness=1``
    (``tests.support.helpers.late_and_old_groups``, a rollout function as a user writes one):
    the first prompt's group, admitted under version 0, finishes only after the third
    prompt's, admitted under version 1; batch 1, its deadline, waits for it and leaves the
    third for later, so it is trained at step 1, not dropped (in finishing order, batch 1
    would take the third and the first would be too stale at step 2). The fifth prompt's
    group reports answers of version 0 whatever weights it ran under, which no admission can
    foresee: the safety net drops its batch whole (keys
    removed, ``async/dropped_samples``, ``stale`` in the ledger) and the same step trains the
    next batch; every other sample is trained within the bound or queued at the end, and no
    Mooncake key or process is left."""
    transfer, master = data_path
    proc = train_async(*transfer, "weights=broadcast", "rollout.fully_async=true",
                       "rollout.function=tests.support.helpers:late_and_old_groups",
                       "rollout.prompts_per_step=1", f"rollout.n_samples_per_prompt={N}",
                       "rollout.max_new_tokens=8", "rollout.max_inflight_batches=2", "algo.max_staleness=1",
                       "num_steps=6", "checkpoint.every=0", "eval.every=0", f"output_dir={tmp_path}")
    rows, ledger = read_metrics(tmp_path), read_ledger(tmp_path)
    outcomes = check_ledger(ledger, rows, proc.stdout, max_staleness=1)  # stale ones: past the bound
    [late] = [e for e in ledger if LATE_PROMPT in e["prompts"]]
    assert late == {**late, "batch": 1, "weight_version": [0] * N, "outcome": ["trained"] * N,
                    "trained_at_step": 1}
    assert outcomes["stale"] == N
    [old] = [e for e in ledger if OLD_PROMPT in e["prompts"]]
    assert old == {**old, "weight_version": [0] * N, "outcome": ["stale"] * N, "trained_at_step": None}
    dropped = [r["async/dropped_samples"] for r in rows]
    at = dropped.index(N)
    assert at >= 3 and dropped == [N if s == at else 0 for s in range(6)], dropped
    assert [r["async/dropped_total"] for r in rows] == [N if s >= at else 0 for s in range(6)]
    assert [r["train/samples"] for r in rows] == [N] * 6  # the dropping step trained the next batch
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert re.search(rf"step {at + 1}/6 \|.*dropped {N} ", proc.stdout), proc.stdout[-2000:]
    assert master.keys() == []  # the dropped batch's too: next_batch alone removes those
    assert_nothing_left(engine_ports(proc.stdout))
