"""``train.py`` runs that resume or are interrupted: metrics, a W&B offline run and
checkpoints (with their Hugging Face export), then a colocated run resumed from a checkpoint
continues the steps, the data and the KL to the initial weights; Ctrl-C as a terminal sends
it, in a run with a Ray of its own (``make train``), on the ray and mooncake_tcp data paths:
reported as the user's, exit status 130, every process gone, its Ray and Mooncake master too;
and the variants of tests/integration/test_train.py's runs that tier leaves here (a chat
checkpoint over p2p, the calculator task and turn credit fully async)."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest

from tests.support.procs import own_ray_env, read_until, running
from tests.support.runs import REQUIRED, assert_nothing_left, engine_ports, read_metrics, train
from tests.support.two_tiers import calculator_run, chat_checkpoint_run, turn_credit_run

pytestmark = pytest.mark.usefixtures("shared_ray")


def test_train_py_logs_metrics_wandb_and_checkpoints_then_resumes(tmp_path):
    data = tmp_path / "prompts.jsonl"  # a reward that a random model earns: the weights move
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    task = ("task=jsonl", f"task.path={data}", "task.reward._target_=tests.support.helpers.length_reward")
    out = tmp_path / "a"
    proc = train("num_steps=3", "rollout.prompts_per_step=8", "checkpoint.every=2", *task,
                 "checkpoint.save_hf=true", f"output_dir={out}")
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
    for ckpt in ckpts:  # beside each: the Hugging Face model, and what the converter reads
        hf = set(os.listdir(out / "checkpoints" / ckpt / "hf"))
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= hf, hf
        with open(out / "checkpoints" / ckpt / "trainer_state.json") as f:
            model = json.load(f)["model"]
        assert model["dtype"] == "float32" and os.path.exists(os.path.join(model["path"], "config.json"))
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
    assert "rl.driver.cluster: interrupted: stopping the run's processes" in rest, rest[-3000:]
    assert "interrupted by the user (Ctrl-C)" in rest and "died" not in rest and "Traceback" not in rest
    assert_nothing_left(engine_ports(out))
    master = re.search(r"local master \(pid (\d+)\)", out)
    assert (master is not None) == (transfer == "mooncake_tcp"), out
    if master:
        assert not os.path.exists(f"/proc/{master.group(1)}"), "the Mooncake master outlived the run"


# The variants of tests/integration/test_train.py's runs that the integration tier leaves here.
def test_chat_checkpoint_gets_templated_prompts_over_p2p(chat_model_path, tmp_path):
    chat_checkpoint_run(chat_model_path, "p2p", tmp_path)


def test_calculator_task_trains_through_its_rollout_function_fully_async(tmp_path):
    calculator_run("train_async.py", tmp_path)


def test_turn_credit_gives_each_model_turn_its_advantage_fully_async(tmp_path):
    turn_credit_run("train_async.py", tmp_path)
