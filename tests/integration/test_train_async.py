"""``train_async.py`` as a user runs it, a few steps each: held-out evaluation in the fully
async loop (the one-step loop's: tests/e2e/test_async.py), and the fully async stale-drop
safety net forced by a group that finishes after later ones. The runs connect to the module's
``ray start --head`` (``shared_ray``). Overlap, resume and Ctrl-C over every data path:
tests/e2e/test_async.py."""

from __future__ import annotations

import re

import pytest

from tests.support.helpers import LATE_PROMPT, OLD_PROMPT
from tests.support.runs import (assert_nothing_left, check_ledger, engine_ports, read_ledger,
                                read_metrics, train_async)
from tests.support.two_tiers import async_eval_run

pytestmark = pytest.mark.usefixtures("shared_ray")

N = 2  # samples a prompt


def test_evaluation_runs_in_fully_async_and_leaves_training_data_alone(tmp_path):
    """Held-out evaluation in the fully async loop (one-step: tests/e2e/test_async.py;
    ``async_eval_run`` says what is checked)."""
    async_eval_run(True, tmp_path)


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
