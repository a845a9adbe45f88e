"""A learner rank killed mid-run: the run stops naming that rank and prints the command that
resumes from the newest checkpoint; that command continues the run (step, data position,
weights, optimizer) to the end, and its reward curve continues the first run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.env import REPO, compose
from tests.support.procs import read_until, running
from tests.support.runs import assert_nothing_left, engine_ports, read_metrics

STEPS, PROMPTS, SAMPLES = 40, 8, 8

pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs connect to one `ray start --head`


def complete_checkpoints(root) -> list[int]:
    return sorted(int(d.removeprefix("step_")) for d in os.listdir(root)
                  if os.path.exists(os.path.join(root, d, "trainer_state.json")))


def test_killed_learner_is_named_and_the_printed_command_resumes_the_run(tmp_path):
    t0 = time.monotonic()
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    out = tmp_path / "run"
    # finished_reward: about 0.15 at the start, about 0.6 by step 14 and near 1 by step 30
    # (measured), so a run that started again from scratch cannot pass for one that resumed
    args = (f"num_steps={STEPS}", f"rollout.prompts_per_step={PROMPTS}", "checkpoint.every=2",
            "logger=console", "task=jsonl", f"task.path={data}",
            "task.reward._target_=tests.support.helpers.finished_reward", f"output_dir={out}")
    with running("train.py", *args) as proc:
        head = read_until(proc, "step 16/", timeout_s=120)
        pids = dict(re.findall(r"(\d+) \(pid (\d+) on ", re.search(r"learner ranks: (.*)", head).group(1)))
        os.kill(int(pids["1"]), signal.SIGKILL)  # not rank 0: the first error is rank 0's broken collective
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - killed
    first_out = head + rest
    assert proc.returncode != 0
    assert stopped_s < 30, stopped_s
    named = rf"the run stopped: learner rank 1 \(pid {pids['1']} on [\d.]+\) died: its process is gone"
    assert re.search(named, first_out), first_out[-3000:]
    assert_nothing_left(engine_ports(first_out))

    printed = re.findall(r"rl\.driver\.cluster: resume with: (.*)$", first_out, re.M)
    assert len(printed) == 1, first_out[-3000:]
    command = printed[0]
    newest = complete_checkpoints(out / "checkpoints")[-1]  # what the run left behind
    ckpt = out / "checkpoints" / f"step_{newest:06d}"
    # the same overrides, output_dir moved to the end (this run's directory), the checkpoint
    assert command == (f"cd {REPO} && {sys.executable} train.py {' '.join(args[:-1])} "
                       f"output_dir={out} checkpoint.resume={ckpt}")
    first = read_metrics(out)
    assert 14 <= newest <= len(first), (newest, len(first))

    resumed_run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert resumed_run.returncode == 0, resumed_run.stdout[-3000:] + resumed_run.stderr[-3000:]
    assert f"resumed from {ckpt} at step {newest}" in resumed_run.stdout
    assert_nothing_left(engine_ports(resumed_run.stdout))

    rows = read_metrics(out)  # appended: the first run's rows, then the resumed run's
    assert rows[:len(first)] == first
    resumed = rows[len(first):]
    assert [r["step"] for r in resumed] == list(range(newest, STEPS))  # every remaining step
    with open(out / "checkpoints" / f"step_{STEPS:06d}" / "trainer_state.json") as f:
        state = json.load(f)
    assert state["step"] == STEPS
    assert state["rollout"]["task"]["position"] == STEPS * PROMPTS  # the data position carried over
    assert state["rollout"]["next_sample_id"] == STEPS * PROMPTS * SAMPLES

    # the reward curve goes on where it was: the resumed run's first steps score like the
    # first run's last steps before the checkpoint, well above where training started
    reward = {r["step"]: r["rollout/reward_mean"] for r in first}
    start = np.mean([reward[s] for s in range(4)])
    before = np.mean([reward[s] for s in range(newest - 4, newest)])
    after = np.mean([r["rollout/reward_mean"] for r in resumed[:4]])
    assert before - start > 0.25, (start, before)  # the checkpoint holds learning
    assert before - 0.12 < after < before + 0.25, (start, before, after)
    print(f"learner death: reward {start:.2f} at the start, {before:.2f} before step {newest}, "
          f"{after:.2f} after the resume; killed run stopped in {stopped_s:.1f}s; "
          f"test {time.monotonic() - t0:.0f}s")


def test_ranks_not_set_up_are_killed_without_being_asked_to_close(shared_ray, ray_local, tmp_path):
    """``LearnerGroup`` sets its ranks up in the background while the engines start
    (rl/driver/cluster.py). A run stopped before a rank is set up, or whose setup failed, does not ask
    it to close: it would answer only once set up, or fail on what it never opened; the
    shutdown kills it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rl.driver.learners import LearnerGroup
    from rl.runtime import Runtime

    cfg = compose("logger=console", f"output_dir={tmp_path}")
    pg = placement_group([{"CPU": 0.01}] * cfg.cluster.num_learners)
    ray_local.get(pg.ready())
    empty = tmp_path / "not-a-checkpoint"  # every rank's setup fails loading the model
    empty.mkdir()
    group = LearnerGroup(cfg, Runtime("t", str(tmp_path), str(empty)), pg)
    try:
        assert group.start_close() == []  # the ranks are still starting
        with pytest.raises(ray_local.exceptions.RayTaskError, match="Unrecognized model in .*not-a-chec"):
            group.wait_set_up()
        assert group.start_close() == []  # their setup failed: nothing to close
    finally:
        for actor in group.actors:
            ray_local.kill(actor)
        remove_placement_group(pg)
    assert_nothing_left([])
