"""The reward rises on the default task ("repeat the letter" on the tiny model):
``train.py`` as ``make train`` runs it, with bfloat16 engines and compute over float32 master
weights, under ``train_async.py`` one version stale, and with several optimizer steps per
rollout (the clip works, and the reward still rises)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.support.batches import assert_turn_advantages
from tests.support.runs import read_metrics, train, train_async

pytestmark = [pytest.mark.usefixtures("shared_ray"),  # the runs connect to one `ray start --head`
              pytest.mark.timeout(1200)]  # a learning run may take up to 900 s (its own limit)
CALCULATOR = ("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool",
              "rollout.max_new_tokens=16")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("model.dtype=bfloat16",)],
                         ids=["float32", "bfloat16-compute-float32-master"])
def test_reward_rises_on_the_default_task(overrides, tmp_path):
    """The default job, as `make train` runs it (console logger to keep the test offline);
    and with bfloat16 engines and compute over float32 master weights (mixed precision)."""
    t0 = time.monotonic()
    train("logger=console", f"output_dir={tmp_path}", *overrides, timeout=900, own_ray=True)
    rows = read_metrics(tmp_path)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert np.mean(rewards[:5]) < 0.1
    assert np.mean(rewards[-10:]) > 0.9, rewards[-20:]
    # the evaluation (eval.every=20 by default) follows: measured 0.008 after step 20, 0.990 after 200
    evals = {r["step"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}
    assert sorted(evals) == list(range(19, 200, 20)), evals
    assert evals[19] < 0.2 and evals[199] > 0.8, evals
    print(f"default job {overrides}: {len(rewards)} steps in {time.monotonic() - t0:.0f}s, "
          f"final reward {np.mean(rewards[-10:]):.3f}")


@pytest.mark.slow
def test_reward_rises_with_train_async_on_the_default_task(tmp_path):
    """``python train_async.py`` on its defaults (one-step off-policy; console logger to
    keep the test offline): the same job as train.py's slow test, one version stale."""
    t0 = time.monotonic()
    train_async(f"output_dir={tmp_path}", timeout=900)
    rows = read_metrics(tmp_path)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert np.mean(rewards[:5]) < 0.1
    assert np.mean(rewards[-10:]) > 0.9, rewards[-20:]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    print(f"train_async.py default job: {len(rewards)} steps in {time.monotonic() - t0:.0f}s, "
          f"final reward {np.mean(rewards[-10:]):.3f}")


@pytest.mark.slow
def test_four_steps_per_rollout_clip_and_still_learn(tmp_path):
    """The default job with algo.steps_per_rollout=4 (docs/algo.md)."""
    t0 = time.monotonic()
    # Runs differ (engines batch by timing). Measured: 0.896-0.969 over steps 70-79 in five runs
    # (one CI run failed at 80 steps), 0.981-0.990 over steps 90-99 in three (seeds 1, 1, 2).
    train("logger=console", "algo.steps_per_rollout=4", "num_steps=100", f"output_dir={tmp_path}",
          timeout=900)
    rows = read_metrics(tmp_path)
    rewards = [r["rollout/reward_mean"] for r in rows]
    clipfrac = np.array([r["train/clipfrac"] for r in rows])
    assert np.mean(clipfrac > 0) > 0.5, clipfrac.tolist()  # the clip does work on most steps
    assert all(r["train/optimizer_steps"] <= 4 for r in rows)
    assert np.mean([r["train/optimizer_steps"] == 4 for r in rows]) > 0.9
    assert all(r["perf/old_logp_time"] > 0 for r in rows)
    assert np.mean(rewards[:5]) < 0.1
    assert np.mean(rewards[-10:]) > 0.9, rewards[-20:]
    print(f"steps_per_rollout=4: {len(rows)} steps in {time.monotonic() - t0:.0f}s, final reward "
          f"{np.mean(rewards[-10:]):.3f}, clipfrac > 0 on {np.mean(clipfrac > 0):.0%} of steps")


@pytest.mark.slow
def test_reward_rises_on_the_multi_turn_calculator_task(tmp_path):
    """``task=calculator`` through its tool loop (``rl.rollout.functions:calculator_tool``)
    with an advantage per model turn (``algo.turn_credit=true``), the example's command: from
    a random model to right calls whose result the answer copies (docs/rollout.md's curve and
    its "Over seeds"). The last step's samples, as trained (``rollout.dump_every``), token by
    token: the tool's result is exactly what the environment appended, out of the loss; the
    model's tokens are in it, with the engine's log-probs and their turn's advantage; the
    reward is the task's on the transcript."""
    t0, steps, out = time.monotonic(), 250, tmp_path
    train(*CALCULATOR, "algo.turn_credit=true", "logger=console", "checkpoint.every=0",
          f"eval.every={steps // 2}", f"num_steps={steps}", f"rollout.dump_every={steps}", "seed=1",
          f"output_dir={out}", timeout=900)
    rows = read_metrics(out)
    rewards = [r["rollout/reward_mean"] for r in rows]
    solved = [r["rollout/solved_frac"] for r in rows]
    evals = [{k: r[k] for k in ("eval/reward_mean", "eval/pass@4")} for r in rows if "eval/reward_mean" in r]
    last = _check_calculator_samples(out / "rollouts" / f"step_{steps - 1:06d}.jsonl")
    print(f"calculator: {len(rows)} steps in {time.monotonic() - t0:.0f}s, reward "
          f"{np.mean(rewards[-20:]):.3f} and right answers {np.mean(solved[-20:]):.3f} over the last 20, "
          f"eval {evals}, last step {last}")
    assert np.mean(rewards[:10]) < 0.02 and max(solved[:10]) == 0.0
    assert len(evals) == 2, evals  # the evaluation through the tool loop, at step 125 and the end
    # measured with this setting in nine runs, seeds 1-9 (docs/rollout.md, "Over seeds"), steps
    # 231-250: reward 0.59-0.79, right answers (reward 1) 0.30-0.59 of the samples, the first at
    # steps 64-98; the evaluation's reward after step 250 0.62-0.80; at step 250 calls 1.00,
    # operands 0.75-1.00 right, answers 0.60-0.76 copied from the tool's result (the checks
    # also hold for the nine runs that counted operands only in a sum: 0.53, 0.21, 0.50, 0.77
    # and 0.38 at worst). At one advantage a sample, three of thirteen runs settled on a few
    # calls, and copying varied from 0 to 0.74.
    assert np.mean(rewards[-20:]) > 0.4, rewards[-20:]
    assert np.mean(solved[-20:]) > 0.1, solved[-20:]
    assert evals[1]["eval/reward_mean"] > 0.4, evals
    assert last["calls"] > 0.9 and last["operands_right"] > 0.6 and last["answers_copied"] > 0.25, last


def _check_calculator_samples(path) -> dict[str, float]:
    """Every dumped calculator sample, token by token, and its per-token advantages
    (``algo.turn_credit``); then what the samples show (``calculator_dump_stats``: calls,
    operands right, answers copied from the tool's result)."""
    from rl.model import load_tokenizer, resolve_model_path
    from rl.tasks.builtin import (CALCULATOR_CALL_END, CALCULATOR_RESULT_END, CalculatorTask, calculator,
                                  calculator_dump_stats)
    from tests.support.env import compose

    cfg = compose(*CALCULATOR)
    tok, task = load_tokenizer(resolve_model_path(cfg.model)), CalculatorTask()
    samples = [json.loads(line) for line in open(path)]
    assert len(samples) == cfg.rollout.batch_size
    assert assert_turn_advantages(samples, task) == cfg.rollout.prompts_per_step  # each turn its own
    for d in samples:
        ids, mask, logps = d["response_ids"], d["loss_mask"], d["logprobs"]
        assert len(ids) == len(mask) == len(logps) <= 16
        assert d["reward"] == pytest.approx(task.reward(d["scored_text"], d["label"], d["finished"]))
        assert all((lp == 0.0) == (m == 0) for m, lp in zip(mask, logps)), d  # the engine's, on model tokens
        if 0 not in mask:  # no call: every token the model's
            text = tok.decode(ids, skip_special_tokens=True)
            assert CALCULATOR_CALL_END not in text or not d["finished"], d
            continue
        first, n_env = mask.index(0), mask.count(0)
        # the call, the tool's result, the answer
        assert mask == [1] * first + [0] * n_env + [1] * (len(mask) - first - n_env), d
        call = tok.decode(ids[:first], skip_special_tokens=True)  # as the engine gave it to the tool
        assert call.endswith(CALCULATOR_CALL_END), d  # the call's stop string, sampled and trained
        result = tok.decode(ids[first:first + n_env])
        tool = calculator(call[:-1]) + CALCULATOR_RESULT_END
        assert result == tool[:len(result)], d  # the tool's (cut if no room)
    return calculator_dump_stats(samples)


@pytest.mark.slow
def test_a_trained_policy_exported_to_hugging_face_serves_and_trains_as_model_hf(tmp_path):
    """``checkpoint.save_hf=true`` on the default job, then ``model=hf model.path=<export>``:
    the engines serve the trained policy (its greedy evaluation reward, not a random model's)
    and the learners train on it. The second run takes one step at a learning rate too small
    to move a greedy answer, so its evaluation after the step is the export's own."""
    first, second = tmp_path / "trained", tmp_path / "from_export"
    greedy = ("logger=console", "eval.greedy=true", "eval.n_samples=1", "eval.num_prompts=64")
    train(*greedy, "num_steps=100", "checkpoint.every=100", "checkpoint.save_hf=true", "eval.every=100",
          f"output_dir={first}", timeout=900)
    export = first / "checkpoints" / "step_000100" / "hf"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    trained = read_metrics(first)
    train(*greedy, "model=hf", f"model.path={export}", "model.dtype=float32", "num_steps=1",
          "checkpoint.every=0", "eval.every=1", "algo.lr=1e-12", f"output_dir={second}", timeout=600)
    [served] = read_metrics(second)
    want, got = trained[-1]["eval/reward_mean"], served["eval/reward_mean"]
    # measured: 0.49 after 100 steps (docs/reward_curve_metrics.jsonl); a random model: 0.0-0.01
    assert want > 0.2, want
    assert abs(got - want) <= 0.03, (got, want)  # greedy on the same weights (batching may flip a tie)
    # the export's samples at temperature 1, as the trained run's last steps drew them
    assert served["rollout/reward_mean"] > 0.5 * np.mean([r["rollout/reward_mean"] for r in trained[-5:]])
    assert served["train/grad_norm"] > 0  # the learners trained on it
