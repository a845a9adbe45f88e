"""Whole-run checks made by two tiers on different paths: the integration tier runs one
variant of each (a few steps, the common path), the end-to-end tier the others, so
``make test`` stays within its time and every variant still runs in CI."""

from __future__ import annotations

import ast
import json
import re

import pytest

from rl.tasks.builtin import CalculatorTask
from tests.support.batches import assert_turn_advantages
from tests.support.env import compose
from tests.support.helpers import eval_task
from tests.support.runs import (REQUIRED, assert_nothing_left, check_ledger, engine_ports, read_ledger,
                                read_metrics, train, train_async)


def chat_checkpoint_run(chat_model_path: str, weights: str, tmp_path) -> None:
    """``model=hf`` on an instruction-style checkpoint with ``model.chat_template=true``: the
    engines receive each prompt as a user turn of the checkpoint's template, and the run
    trains and syncs (every push checks each engine's weight version) to the end."""
    args = ("model=hf", f"model.path={chat_model_path}", "model.chat_template=true", f"weights={weights}",
            "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2")
    proc = train(*args, "num_steps=2", "logger=console", f"output_dir={tmp_path}")
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert "step 2/2 | reward" in proc.stdout
    m = re.search(r"rl\.rollout\.manager: first prompt as sent \((\d+) tokens\): (.*)",
                  proc.stdout + proc.stderr)
    assert m, proc.stdout[-3000:]
    from rl.model import load_tokenizer
    from rl.tasks.build import build_task

    tokenizer = load_tokenizer(chat_model_path)
    first = build_task(compose(*args).task).next_prompts(1)[0].text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": first}],
                                             add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|system|>answer briefly.<|end|><|user|>")
    assert ast.literal_eval(m.group(2)) == rendered  # decoded from the ids sent to the engines
    assert int(m.group(1)) == len(re.sub(r"<\|\w+\|>", "#", rendered))  # a token per character or role tag
    assert_nothing_left(engine_ports(proc.stdout))


CALCULATOR = ("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool",
              "rollout.max_new_tokens=16", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
              "logger=console", "checkpoint.every=0", "eval.every=2", "eval.num_prompts=3",
              "eval.n_samples=2")


def calculator_run(entry: str, tmp_path) -> None:
    """``task=calculator`` with ``rollout.function=rl.rollout.functions:calculator_tool``: each
    group goes through the tool loop, step by step (``train.py``, over Mooncake and the p2p
    weight path) and fully async (``train_async.py rollout.fully_async=true``, a group at a
    time, over Ray and broadcast); the run trains, logs every step and ends cleanly; with
    ``task.copy_credit_fade`` each group is scored as a whole (the task's ``group_reward``). The
    loss mask of a sample, token by token: tests/unit/test_rollout_functions.py."""
    fading = (*(o for o in CALCULATOR if not o.startswith("rollout.function=")),
              "rollout.function=tests.support.helpers:calculator_with_a_right_call",
              "task.copy_credit=0.25", "task.copy_credit_fade=true", "rollout.dump_every=1")
    if entry == "train.py":
        proc = train(*fading, "transfer=mooncake_tcp", "weights=p2p", "num_steps=2",
                     f"output_dir={tmp_path}")
    else:
        proc = train_async(*fading, "transfer=ray", "weights=broadcast",
                           "rollout.fully_async=true", "num_steps=2", f"output_dir={tmp_path}")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert 0 < r["rollout/response_len_mean"] <= 16
    assert "step 2/2 | reward" in proc.stdout
    assert "eval/reward_mean" not in rows[0]  # evaluated once, after the last step, through the tool loop
    assert 0 < rows[1]["eval/response_len_mean"] <= 16
    assert_nothing_left(engine_ports(proc.stdout))
    # each group scored as a whole: its right call took the copy credit off the other sample
    groups = {}
    for path in sorted(tmp_path.glob("rollouts/step_*.jsonl")):
        for d in map(json.loads, open(path)):
            groups.setdefault((d["step"], d["prompt_index"]), []).append(d["reward"])
    # (fully async: a dump's step is the batch's number; batches formed ahead are dumped too)
    assert sorted(step for step, _ in groups)[:4] == [0, 0, 1, 1]
    assert all(g == pytest.approx([1.0, 0.35]) for g in groups.values()), groups
    assert rows[1]["eval/reward_mean"] == pytest.approx((1.0 + 0.35) / 2)  # evaluation alike


def turn_credit_run(entry: str, tmp_path) -> None:
    """``algo.turn_credit=true`` on the calculator (step by step over Mooncake, whose buffers
    make room for the per-token column, and fully async over Ray): every dumped sample's
    per-token advantages are the task's turn rewards through ``turn_advantages`` over its
    group, 0 on the tool's tokens, and the run trains and ends cleanly."""
    run = (train, "transfer=mooncake_tcp") if entry == "train.py" else (
        train_async, "transfer=ray", "rollout.fully_async=true")
    proc = run[0](*CALCULATOR, *run[1:], "algo.turn_credit=true", "rollout.dump_every=1", "num_steps=2",
                  f"output_dir={tmp_path}")
    assert "step 2/2 | reward" in proc.stdout
    assert_nothing_left(engine_ports(proc.stdout))
    dumped = [json.loads(line) for p in sorted(tmp_path.glob("rollouts/step_*.jsonl")) for line in open(p)]
    assert assert_turn_advantages(dumped, CalculatorTask()) >= 4


PER_STEP, N = 2, 2  # prompts a step, samples a prompt
EVAL_PROMPTS, EVAL_N = 3, 3  # other sizes than training's: an eval group in a batch would show


def async_eval_run(fully_async: bool, tmp_path) -> None:
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
