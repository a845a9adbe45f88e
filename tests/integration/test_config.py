"""``python train.py`` and ``python train_async.py`` refuse bad input before any worker
starts, naming the field (a bad task file before Ray starts); ``--help`` answers quickly.
The same rules composed in-process: tests/unit/test_config.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.env import REPO


def _run_train(*args: str, timeout: float = 30, script: str = "train.py", env: dict | None = None
               ) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=None if env is None else {**os.environ, **env})
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("args,fragment", [
    (["cluster.num_enginez=2"], "cluster.num_enginez"),
    (["task=unknown_task"], "task/unknown_task"),
    (["rollout.prompts_per_step=-1"], "rollout.prompts_per_step=-1 must be > 0"),
    (["model.path=/does/not/exist"], "/does/not/exist"),
    (["model=hf"], "model=hf needs model.path"),
    (["rollout=sglang", "cluster.gpus_per_engine=1"], "rollout=sglang with model.dtype=float32"),
    (["task=repeat_count"], "rollout.max_new_tokens=8 is too short: set rollout.max_new_tokens=41"),
])
def test_cli_rejects_bad_input_before_workers_start(args, fragment):
    proc, seconds = _run_train(*args)
    assert proc.returncode != 0
    assert fragment in proc.stderr + proc.stdout
    assert "rl.driver.cluster:" not in proc.stdout  # nothing was started
    assert seconds < 20


@pytest.mark.parametrize("args,fragment", [
    (["algo.max_staleness=-1"], "algo.max_staleness=-1 must be >= 0"),
    (["rollout.fully_async=true", "rollout.max_inflight_batches=0"],
     "rollout.max_inflight_batches=0: the queue needs room for at least 1 batch"),
    (["rollout.fully_async=true", "cluster.colocate=true"],
     "cluster.colocate=true is supported by train.py only"),
    (["cluster.colocate=true"], "cluster.colocate=true is supported by train.py only"),
    (["algo.max_staleness=0"], "one-step off-policy trains every batch one version behind"),
])
def test_train_async_rejects_bad_input_before_workers_start(args, fragment):
    proc, seconds = _run_train(*args, script="train_async.py")
    assert proc.returncode != 0
    assert fragment in proc.stderr + proc.stdout
    assert "rl.driver.cluster:" not in proc.stdout and "rl.driver.run:" not in proc.stdout  # nothing started
    assert seconds < 20


@pytest.mark.parametrize("lines,fragment", [
    (['{"prompt": "a:", "label": "aaaa"}', '{"prompt": "b:", "label": "bbbb"'],
     "prompts.jsonl:2: not valid JSON"),
    (['{"prompt": "a:", "label": "aaaa"}'] * 3 + ['{"prompt": "d:"}'], "prompts.jsonl:4: missing 'label'"),
    (['{"prompt": 7, "label": "7"}'], "prompts.jsonl:1: 'prompt' must be a string"),
    ([], "prompts.jsonl holds no prompts"),
])
def test_cli_names_a_bad_jsonl_line_before_ray_starts(lines, fragment, tmp_path):
    """The whole task file is read in the driver: a bad line ends the run in about a second,
    naming the file and line, and no Ray (hence no engine, no learner) was started."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    ray_tmp = tmp_path / "ray"  # a started Ray would create its session directory here
    proc, seconds = _run_train("task=jsonl", f"task.path={data}", f"output_dir={tmp_path / 'out'}",
                               env={"RAY_TMPDIR": str(ray_tmp)})
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert f"task.path: {data}" in out and fragment in out, out[-2000:]
    assert "rl.driver.cluster:" not in proc.stdout and not ray_tmp.exists()
    assert seconds < 5, seconds


def test_cli_help_is_fast():
    proc, seconds = _run_train("--help")
    assert proc.returncode == 0 and "transfer" in proc.stdout
    assert seconds < 10
