"""train_async.py as a user runs it, over each registered data path and each weight path
(the pairs tests/e2e/test_weights.py does not run).

One-step off-policy and fully async: generation of batch N+1 overlaps training of N, no
trained sample is staler than allowed, every generated sample is trained exactly once or
counted as dropped, no store key or process is left, Ctrl-C cleans up, resume continues
the data where the checkpoint left it; held-out evaluation in the one-step loop. The reward
rising: tests/e2e/test_learning.py."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rl.config.transfer import BACKENDS
from rl.rollout.stream import OUTCOMES
from tests.support.helpers import combination_halves
from tests.support.procs import pids_with, read_until, running
from tests.support.runs import (REQUIRED, assert_nothing_left, check_ledger, engine_ports, read_ledger,
                                read_metrics, train_async)
from tests.support.two_tiers import async_eval_run

COMBOS = combination_halves(BACKENDS)[1]  # tests/e2e/test_weights.py runs the other half

pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs connect to one `ray start --head`

ASYNC_METRICS = ["perf/wait_time_ratio", "async/staleness_mean", "async/staleness_max",
                 "async/dropped_samples", "async/queue_depth", "train/samples"]


def check_overlap(rows: list[dict], every_step: bool = True) -> None:
    """The batch trained at step N+1 was being generated while step N trained: at every step
    (one-step off-policy), or, in fully async mode, where its groups still ran when the step
    began (a stream that ran ahead may have finished the whole batch before)."""
    pairs = list(zip(rows, rows[1:]))
    for prev, cur in pairs:
        assert cur["rollout/started_at"] < prev["train/finished_at"]
    ran_during = [cur["rollout/finished_at"] > prev["train/started_at"] for prev, cur in pairs]
    assert all(ran_during) if every_step else any(ran_during), ran_during


def check_wait(rows: list[dict], clock_s: float = 0.01) -> None:
    """Fully async: the step's wait for its batch is the time from the step asking for it to
    the batch being ready, from the run's own clocks (one machine, one wall clock). It starts
    no earlier than the step (``perf/step_started_at``), cannot end before the batch's
    generation finished (``rollout/finished_at``), and ends before the learners start
    training on it (``train/started_at``)."""
    for r in rows:
        wait, start = r["perf/wait_rollout_time"], r["perf/step_started_at"]
        ready = max(0.0, r["rollout/finished_at"] - start)  # 0: queued before the step began
        assert ready - clock_s <= wait <= r["train/started_at"] - start + clock_s, r
        assert r["perf/wait_time_ratio"] == pytest.approx(wait / r["perf/step_time"], rel=1e-9)
    # the first batch is generated from scratch while the learners wait
    assert rows[0]["perf/wait_rollout_time"] >= 0.5 * rows[0]["rollout/generate_time"]


@pytest.mark.parametrize("data_path,weights", COMBOS, indirect=["data_path"],
                         ids=[f"{t}-{w}" for t, w in COMBOS])
def test_fully_async_overlaps_bounds_staleness_and_accounts_for_every_sample(tmp_path, data_path, weights):
    transfer, master = data_path
    steps, bound = 4, 2
    proc = train_async(*transfer, f"weights={weights}", "rollout.fully_async=true",
                       f"rollout.max_inflight_batches={bound}", "algo.max_staleness=1",
                       f"num_steps={steps}", "rollout.prompts_per_step=8", "checkpoint.every=0",
                       f"output_dir={tmp_path}")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        missing = [k for k in REQUIRED + ASYNC_METRICS if k not in r]
        assert not missing, missing
        assert r["async/queue_depth"] + 1 <= bound  # queued + the one in training
    check_overlap(rows, every_step=False)
    check_wait(rows)
    assert rows[0]["async/staleness_max"] == 0  # the first batch comes from the start weights
    outcomes = check_ledger(read_ledger(tmp_path), rows, proc.stdout, max_staleness=1)
    assert outcomes["stale"] == 0  # a queue of 2 batches keeps every sample within 1 version
    if master is not None:
        assert master.keys() == []
    assert_nothing_left(engine_ports(proc.stdout))


@pytest.mark.parametrize("data_path", ["mooncake-packed"], indirect=True)
def test_fully_async_admits_only_what_it_can_train_and_resumes_where_it_left(tmp_path, data_path):
    """A store deep enough for 3 batches but a staleness bound of 0: groups are admitted only
    when they can be trained within the bound, so none is dropped and every trained sample
    is fresh; a checkpoint resumes at the oldest prompt not yet taken, and no prompt is
    trained twice across the two runs."""
    transfer, master = data_path
    common = [*transfer, "weights=p2p", "rollout.fully_async=true", "rollout.max_inflight_batches=3",
              "algo.max_staleness=0", "rollout.prompts_per_step=8", "checkpoint.every=3", "num_steps=5"]
    out = tmp_path / "a"
    proc = train_async(*common, f"output_dir={out}")
    rows, ledger = read_metrics(out), read_ledger(out)
    outcomes = check_ledger(ledger, rows, proc.stdout, max_staleness=0)
    assert outcomes["stale"] == 0 and all(r["async/staleness_max"] == 0 for r in rows)
    assert master.keys() == []

    ckpt = out / "checkpoints" / "step_000003"
    with open(ckpt / "trainer_state.json") as f:
        saved = json.load(f)["rollout"]
    resume_id = saved["next_sample_id"]
    # the checkpoint's data position is that of the first batch not taken before step 3
    taken_before = [e for e in ledger if e["first_sample_id"] < resume_id]
    assert all(e["trained_at_step"] is not None and e["trained_at_step"] < 3 for e in taken_before)
    assert all(e["trained_at_step"] is None or e["trained_at_step"] >= 3
               for e in ledger if e["first_sample_id"] >= resume_id)
    done_before = {p for e in taken_before for p in e["prompts"]}

    out2 = tmp_path / "b"
    proc = train_async(*common, f"checkpoint.resume={ckpt}", f"output_dir={out2}")
    rows2, ledger2 = read_metrics(out2), read_ledger(out2)
    assert "resumed from" in proc.stdout
    assert ledger2[0]["first_sample_id"] == resume_id
    check_ledger(ledger2, rows2, proc.stdout, max_staleness=0, first_step=3)
    again = {p for e in ledger2 for p in e["prompts"]}
    assert not again & done_before  # none twice
    # none lost: every prompt below the last one drawn was taken in one run or the other,
    # but for groups still generating when the second run ended (at most the store's bound)
    missing = set(range(max(again))) - done_before - again
    assert len(missing) <= 3 * 8, sorted(missing)
    assert master.keys() == []
    assert_nothing_left(engine_ports(proc.stdout))


@pytest.mark.parametrize("data_path", ["mooncake-packed"], indirect=True)
def test_one_step_off_policy_overlaps_and_trains_every_batch(tmp_path, data_path):
    transfer, master = data_path
    steps = 3
    proc = train_async(*transfer, "weights=p2p", f"num_steps={steps}", "rollout.prompts_per_step=8",
                       "checkpoint.every=0", f"output_dir={tmp_path}")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert all(k in r for k in REQUIRED + ["perf/wait_time_ratio", "async/staleness_max"])
    check_overlap(rows)
    assert rows[0]["async/staleness_max"] == 0  # the first batch comes from the start weights
    assert all(r["async/staleness_max"] == 1 for r in rows[1:])  # then one version behind
    assert [r["train/samples"] for r in rows] == [8 * 8] * steps  # every batch trained whole
    assert master.keys() == []
    assert_nothing_left(engine_ports(proc.stdout))


@pytest.mark.parametrize("data_path", ["mooncake-packed"], indirect=True)
def test_ctrl_c_in_fully_async_removes_queued_batches_and_stops_every_process(tmp_path, data_path):
    transfer, master = data_path
    with running("train_async.py", *transfer, "rollout.fully_async=true", "rollout.max_inflight_batches=3",
                 "num_steps=10000", "logger=console", "rollout.prompts_per_step=8",
                 f"output_dir={tmp_path}") as proc:
        out = read_until(proc, "step 3/")
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode != 0
    assert "rl.driver.run: samples:" in rest  # the ledger was written on the way out
    # every sample has a documented outcome (the batch in training when Ctrl-C came:
    # "interrupted")
    assert {o for e in read_ledger(tmp_path) for o in e["outcome"]} <= set(OUTCOMES)
    assert master.keys() == []
    assert_nothing_left(engine_ports(out))


@pytest.mark.parametrize("data_path", ["mooncake-packed"], indirect=True)
def test_engine_death_in_fully_async_fails_the_run_cleanly(tmp_path, data_path):
    """Without fault tolerance, an engine killed mid-run fails the run naming it, and still
    leaves no key and no process behind (tests/e2e/test_fault_tolerance.py: with it)."""
    transfer, master = data_path
    with running("train_async.py", *transfer, "rollout.fully_async=true", "weights=p2p",
                 "rollout.fault_tolerance=false",
                 "num_steps=10000", "logger=console", "rollout.prompts_per_step=8",
                 "rollout.request_timeout_s=30", f"output_dir={tmp_path}") as proc:
        out = read_until(proc, "step 2/")
        port = engine_ports(out)[1]
        for pid in pids_with(f"--port {port}"):
            os.kill(pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert f"engine-1 (http://127.0.0.1:{port})" in rest, rest[-3000:]
    assert "rl.driver.run: samples:" in rest
    assert master.keys() == []
    assert_nothing_left(engine_ports(out))


def test_evaluation_runs_in_the_one_step_loop_and_leaves_training_data_alone(tmp_path):
    """The one-step variant of tests/integration/test_train_async.py's evaluation run."""
    async_eval_run(False, tmp_path)
