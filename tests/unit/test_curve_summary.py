"""scripts/curve_summary.py on metrics written by hand: the windows, the first step whose
5-step mean reaches 0.5, and the share of partial rollouts from ``rollout/partial_frac``. Its
rows against the runs kept in docs/runs: tests/integration/test_docs_commands.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("curve_summary",
                                                  os.path.join(REPO, "scripts", "curve_summary.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, rewards, partial=None, **extra):
    with open(path, "w") as f:
        for i, r in enumerate(rewards):
            row = {"step": i, "rollout/reward_mean": r, "train/samples": 100.0,
                   "perf/wait_time_ratio": 0.1 if i % 2 else 0.3, "perf/step_started_at": 1000.0 + 2 * i,
                   "perf/step_time": 1.5, **extra}
            if partial is not None:
                row["rollout/partial_frac"] = partial(i)
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_windows_first_step_and_partial_samples(summary, tmp_path):
    # steps 1-100 at 0, then 0.7: the mean of steps 100-104 is the first >= 0.5 (4 x 0.7 / 5)
    rewards = [0.0] * 100 + [0.7] * 100
    path = _write(tmp_path / "m.jsonl", rewards, partial=lambda i: 0.05 if i in (3, 150) else 0.0,
                  **{"async/staleness_mean": 1.0, "async/dropped_samples": 2.0})
    s = summary.summarise(path)
    assert s["reward_1_10"] == 0.0 == s["reward_91_100"] and s["reward_181_200"] == pytest.approx(0.7)
    assert s["first_step_smoothed_at_threshold"] == 104
    assert (s["staleness_mean"], s["dropped"], s["trained"]) == (1.0, 400, 20000)
    assert s["staleness_max"] == 0.0  # not logged: 0, as in train.py
    assert s["wait_time_ratio_mean"] == pytest.approx(0.2)
    assert s["loop_s"] == pytest.approx(2 * 199 + 1.5)  # the last step starts at 398 s, lasts 1.5
    assert s["partial_pct"] == pytest.approx(0.05)  # 2 steps of 200 at 5 %
    assert (s["partial_steps"], s["partial_max_pct"]) == (2, pytest.approx(5.0))
    assert s["reward_by_10"] == [0.0] * 10 + [pytest.approx(0.7)] * 10
    assert s["partial_pct_by_10"] == [0.5] + [0.0] * 14 + [0.5] + [0.0] * 4  # steps 4 and 151
    assert s["masked_pct"] == 0.0 and s["masked_pct_by_10"] == [0.0] * 20  # no mask logged
    assert summary.row(s) == "| m.jsonl | 0.000 | 0.000 | 0.700 | step 104 | 1.00 | 400 | 0.05 |"


def test_a_run_of_400_steps_has_two_windows_more(summary, tmp_path):
    rewards = [0.0] * 280 + [0.5] * 20 + [0.0] * 80 + [0.9] * 20
    s = summary.summarise(_write(tmp_path / "long.jsonl", rewards))
    assert (s["reward_281_300"], s["reward_381_400"]) == (pytest.approx(0.5), pytest.approx(0.9))
    assert summary.row(s) == ("| long.jsonl | 0.000 | 0.000 | 0.000 | 0.500 | 0.900 | step 285 | 0.00 "
                              "| 0 | - |")
    assert "reward_281_300" not in summary.summarise(_write(tmp_path / "m.jsonl", [0.0] * 399))


def test_runs_before_the_partial_metric_and_short_runs(summary, tmp_path):
    s = summary.summarise(_write(tmp_path / "old.jsonl", [0.2] * 200))
    assert s["partial_pct"] is None and s["partial_pct_by_10"] is None
    assert s["first_step_smoothed_at_threshold"] is None
    assert summary.row(s).endswith("| - | 0.00 | 0 | - |")
    with pytest.raises(SystemExit, match="150 steps logged, the summary reads 200"):
        summary.summarise(_write(tmp_path / "short.jsonl", [0.2] * 150))


def test_calculator_summary_mean_row():
    """scripts/calculator_summary.py --mean: each figure every run has, averaged; the first
    right answer the latest run's ("by step N"), none if a run had none; no last column unless
    every run kept its dump."""
    spec = importlib.util.spec_from_file_location("calculator_summary",
                                                  os.path.join(REPO, "scripts", "calculator_summary.py"))
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    base = {"steps": 250, "entropy_last10": 0.1, "eval_step": 250, "eval_reward": 0.5, "eval_pass": 0.25}
    a = {"run": "a", **base, "reward_last20": 0.4, "right_last20": 0.1, "first_right_step": 80,
         "calls": 1.0, "operands_right": 0.8, "answers_copied": 0.5}
    b = {"run": "b", **base, "reward_last20": 0.6, "right_last20": 0.3, "first_right_step": 95}
    m = calc.mean([a, b])
    assert m["reward_last20"] == pytest.approx(0.5) and m["right_last20"] == pytest.approx(0.2)
    assert "calls" not in m  # b kept no dump
    assert calc.row(m) == "| mean of 2 runs | 0.50 | 0.200 | by step 95 | 0.10 | 0.50 / 0.25 | - |"
    assert calc.row(calc.mean([a, {**b, "first_right_step": None}])).split(" | ")[3] == "none"
