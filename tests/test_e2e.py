"""``train.py`` as a user runs it: metrics, W&B offline run, checkpoint and resume, Ctrl-C,
a chat checkpoint on both weight paths, and (slow) the reward going up on the default task.

The runs connect to the module's ``ray start --head`` (``shared_ray``), as on a multi-node
cluster; Ctrl-C and the default job start a Ray of their own, as ``make train`` does."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, compose, own_ray_env, pids_with, ray_left, read_until, running

REQUIRED = ["perf/step_time", "perf/rollout_time", "perf/train_time", "perf/update_weights_time",
            "transfer/put_ms", "transfer/get_ms", "transfer/bytes", "transfer/get_gbps",
            "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/kl",
            "train/clipfrac", "train/grad_norm", "train/tokens_per_s", "weights/bytes",
            "train/approx_kl", "train/entropy", "train/optimizer_steps", "perf/old_logp_time",
            "rollout/zero_std_groups"]


pytestmark = pytest.mark.usefixtures("shared_ray")


def train(*overrides: str, timeout: float = 600, own_ray: bool = False) -> subprocess.CompletedProcess:
    """``python train.py overrides``, which must succeed; ``own_ray``: with a Ray of its own."""
    env = {**(own_ray_env() if own_ray else os.environ), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
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


def test_train_py_logs_metrics_wandb_and_checkpoints_then_resumes(tmp_path):
    data = tmp_path / "prompts.jsonl"  # a reward that a random model earns: the weights move
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    task = ("task=jsonl", f"task.path={data}", "task.reward._target_=tests.helpers.length_reward")
    out = tmp_path / "a"
    proc = train("num_steps=3", "rollout.prompts_per_step=8", "checkpoint.every=2", *task,
                 f"output_dir={out}")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(isinstance(r[k], float) and np.isfinite(r[k]) for k in REQUIRED)
        assert r["transfer/bytes"] > 0 and r["weights/bytes"] > 0
        # one optimizer step per rollout: the behaviour policy is the one being trained, so
        # the ratio is exactly 1, no token is clipped and the KL to it is exactly 0
        assert r["train/clipfrac"] == 0.0 and r["train/kl"] == 0.0, r
    moved = [r["train/grad_norm"] > 0 for r in rows]
    assert moved[0] or moved[1]  # the checkpoint below is not the initial (reference) policy
    assert "step 3/3 | reward" in proc.stdout  # the console line
    assert any(d.startswith("offline-run-") for d in os.listdir(out / "wandb"))
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts == ["step_000002", "step_000003"]
    assert_nothing_left(engine_ports(proc.stdout))

    out2 = tmp_path / "b"
    proc = train("num_steps=4", "rollout.prompts_per_step=8", "checkpoint.every=2", "logger=console",
                 f"checkpoint.resume={out / 'checkpoints' / 'step_000002'}", f"output_dir={out2}",
                 "cluster.colocate=true",  # the resumed run shares bundles between the pools
                 "algo.kl_coef=0.05", *task)  # train/kl: now the KL to the initial weights
    assert "resumed from" in proc.stdout and "colocated: engine i and learner rank i" in proc.stdout
    rows2 = read_metrics(out2)
    assert [r["step"] for r in rows2] == [2, 3]
    moved = moved[:2]  # the checkpoint holds steps 0 and 1; this run trains 2 and 3 from it
    for r in rows2:
        assert r["train/clipfrac"] == 0.0
        # positive exactly when some earlier step moved the weights away from the reference
        assert (r["train/kl"] > 0) == any(moved) and r["train/kl"] >= 0, (r, moved)
        moved.append(r["train/grad_norm"] > 0)
    with open(out2 / "checkpoints" / "step_000004" / "trainer_state.json") as f:
        state = json.load(f)
    assert state["step"] == 4
    assert state["rollout"]["task"]["position"] == 4 * 8  # the data position carried over
    assert state["rollout"]["next_sample_id"] == 4 * 8 * 8


def test_an_engine_that_fails_to_start_stops_the_run_and_the_learners_setting_up(tmp_path):
    """The learner ranks set up while the engines start (rl/cluster.py): when an engine fails
    to start, the run fails naming it with its log, and the ranks, set up or not, go too."""
    proc = subprocess.run([sys.executable, "train.py", "num_steps=3", "rollout.prompts_per_step=8",
                           "logger=console", "rollout.device=cuda:99",  # no such device anywhere
                           f"output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    failed = r"engine-\d exited with code \d+ while starting; last lines of .*engine_\d\.log"
    assert re.search(failed, out), out[-3000:]
    assert "[weights]" not in out  # the run stopped before planning any weight update
    assert_nothing_left([])  # no rank on the shared head


@pytest.mark.parametrize("transfer", ["ray", "mooncake_tcp"])
def test_ctrl_c_is_reported_as_the_users_and_stops_every_process(transfer, tmp_path):
    """Ctrl-C as a terminal sends it, SIGINT to the run's whole process group, in a run with
    a Ray of its own (``make train``): the run says it was interrupted (not that a part of it
    died, though the signal reached them all), stops its parts, and exits with 130; its Ray,
    engines and Mooncake master go too."""
    with running("train.py", "num_steps=10000", "logger=console", "weights=p2p", f"transfer={transfer}",
                 "rollout.prompts_per_step=8", f"output_dir={tmp_path}", env=own_ray_env()) as proc:
        out = read_until(proc, "step 2/")
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, rest[-3000:]
    assert "[run] interrupted: stopping the run's processes" in rest, rest[-3000:]
    assert "interrupted by the user (Ctrl-C)" in rest and "died" not in rest and "Traceback" not in rest
    assert_nothing_left(engine_ports(out))
    master = re.search(r"local master \(pid (\d+)\)", out)
    assert (master is not None) == (transfer == "mooncake_tcp"), out
    if master:
        assert not os.path.exists(f"/proc/{master.group(1)}"), "the Mooncake master outlived the run"


@pytest.mark.parametrize("weights", ["broadcast", "p2p"])
def test_chat_checkpoint_gets_templated_prompts_on_both_weight_paths(chat_model_path, weights, tmp_path):
    """``model=hf`` on an instruction-style checkpoint with ``model.chat_template=true``: the
    engines receive each prompt as a user turn of the checkpoint's template, and the run
    trains and syncs (every push checks each engine's weight version) to the end."""
    args = ("model=hf", f"model.path={chat_model_path}", "model.chat_template=true", f"weights={weights}",
            "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2")
    proc = train(*args, "num_steps=2", "logger=console", f"output_dir={tmp_path}")
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert "step 2/2 | reward" in proc.stdout
    m = re.search(r"\[rollout\] first prompt as sent \((\d+) tokens\): (.*)", proc.stdout + proc.stderr)
    assert m, proc.stdout[-3000:]
    from rl.model import load_tokenizer

    tokenizer = load_tokenizer(chat_model_path)
    first = compose(*args).task.build().next_prompts(1)[0].text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": first}],
                                             add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|system|>answer briefly.<|end|><|user|>")
    assert ast.literal_eval(m.group(2)) == rendered  # decoded from the ids sent to the engines
    assert int(m.group(1)) == len(re.sub(r"<\|\w+\|>", "#", rendered))  # a token per character or role tag
    assert_nothing_left(engine_ports(proc.stdout))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("model.dtype=bfloat16",)],
                         ids=["float32", "bfloat16-compute-float32-master"])
def test_reward_rises_on_the_default_task(overrides, tmp_path):
    """The default job, as `make train` runs it (console logger to keep the test offline);
    and with bfloat16 engines and compute over float32 master weights (mixed precision)."""
    t0 = time.monotonic()
    train("logger=console", f"output_dir={tmp_path}", *overrides, timeout=900, own_ray=True)
    rewards = [r["rollout/reward_mean"] for r in read_metrics(tmp_path)]
    assert np.mean(rewards[:5]) < 0.1
    assert np.mean(rewards[-10:]) > 0.9, rewards[-20:]
    print(f"default job {overrides}: {len(rewards)} steps in {time.monotonic() - t0:.0f}s, "
          f"final reward {np.mean(rewards[-10:]):.3f}")


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
        assert r["rollout/reward_mean"] == 0.0 and r["rollout/reward_std"] == 0.0
        assert r["rollout/zero_std_groups"] == FLAT_PROMPTS, r
        assert r["train/optimizer_steps"] == 0, r
        assert r["train/loss"] == 0.0 and r["train/grad_norm"] == 0.0, r
        assert r["transfer/bytes"] > 0 and r["weights/bytes"] > 0  # stored and synced as ever
    assert "step 3/3 | reward" in proc.stdout
    assert_nothing_left(engine_ports(proc.stdout))


def test_flat_groups_kept_still_take_an_optimizer_step(tmp_path):
    """The same run with ``algo.drop_zero_std_groups=false``: the flat groups are counted but
    stay in the loss, so the step is taken (with zero advantages its gradient is exactly 0)."""
    proc, rows = _flat_reward_run(tmp_path, "num_steps=1", "algo.drop_zero_std_groups=false")
    (r,) = rows
    assert r["step"] == 0 and r["rollout/zero_std_groups"] == FLAT_PROMPTS, r
    assert r["train/optimizer_steps"] == 1, r
    assert r["train/grad_norm"] == 0.0 and r["train/loss"] == 0.0, r
    assert_nothing_left(engine_ports(proc.stdout))
