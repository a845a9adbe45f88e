"""Summarise reward curves of 200-step runs as rows of the tables in docs/async.md and
docs/benchmarks.md.

Per run (steps counted from 1): the mean reward (`rollout/reward_mean`) over steps 1-10,
91-100 and 181-200 (and for a run of 400 steps or more, 281-300 and 381-400 too); the first
step at which the mean of the last 5 steps reaches 0.5; the
mean staleness of the trained samples (`async/staleness_mean`, 0 in train.py); the samples
dropped as too stale (`async/dropped_samples`, summed); and the partial rollouts, samples
whose tokens came from two weight versions, in percent of the samples generated (the mean
of `rollout/partial_frac`, every batch being the same size; "-" for runs logged before that
metric existed).

    python scripts/curve_summary.py docs/runs/repeat_count_sync_metrics.jsonl outputs/my_run

A path is a run's `output_dir` or its metrics.jsonl. `--json` prints every figure, and by
10 steps (steps 1-10, 11-20, ...) the mean reward, the share of loss tokens an importance
mask took out (`train/is_masked_frac`, in percent) and the share of partial rollouts, with
the steps that had any and the largest share of one step; the largest staleness, the mean
of `perf/wait_time_ratio`, and the training loop's seconds (`loop_s`: from the first step's
start to the last step's end).
"""

from __future__ import annotations

import os

import numpy as np

from rl.driver.metrics import read_metrics, summary_cli

WINDOWS = ((1, 10), (91, 100), (181, 200))
"""Steps (from 1, both ends included) whose mean reward is reported."""
LONG_WINDOWS = ((281, 300), (381, 400))
"""Reported too for a run of at least 400 steps."""


def windows(steps: int) -> tuple[tuple[int, int], ...]:
    return WINDOWS + LONG_WINDOWS if steps >= LONG_WINDOWS[-1][1] else WINDOWS


THRESHOLD, SMOOTH = 0.5, 5
"""The reward the mean of the last ``SMOOTH`` steps must first reach."""


def _mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the steps, or None when a step did not log it."""
    return float(np.mean([r[key] for r in rows])) if all(key in r for r in rows) else None


def _loop_s(rows: list[dict]) -> float | None:
    """Seconds from the first step's start to the last step's end, or None when not logged."""
    first, last = rows[0], rows[-1]
    if not all(k in r for r in (first, last) for k in ("perf/step_started_at", "perf/step_time")):
        return None
    return last["perf/step_started_at"] + last["perf/step_time"] - first["perf/step_started_at"]


def summarise(path: str) -> dict:
    rows = read_metrics(path)
    if len(rows) < WINDOWS[-1][1]:
        raise SystemExit(f"{path}: {len(rows)} steps logged, the summary reads {WINDOWS[-1][1]}")
    reward = np.array([r["rollout/reward_mean"] for r in rows])
    smooth = np.convolve(reward, np.ones(SMOOTH) / SMOOTH, mode="valid")  # smooth[i]: steps i+1 .. i+SMOOTH
    reached = np.flatnonzero(smooth >= THRESHOLD)
    partial = (100 * np.array([r["rollout/partial_frac"] for r in rows])
               if all("rollout/partial_frac" in r for r in rows) else None)
    masked = 100 * np.array([r.get("train/is_masked_frac", 0.0) for r in rows])
    by_10 = lambda x: [round(float(v), 4) for v in x[:len(x) // 10 * 10].reshape(-1, 10).mean(1)]  # noqa: E731
    return {"run": os.path.basename(path.rstrip("/")), "steps": len(rows),
            **{f"reward_{a}_{b}": float(reward[a - 1:b].mean()) for a, b in windows(len(rows))},
            "first_step_smoothed_at_threshold": int(reached[0]) + SMOOTH if len(reached) else None,
            "staleness_mean": float(np.mean([r.get("async/staleness_mean", 0.0) for r in rows])),
            "staleness_max": float(max(r.get("async/staleness_max", 0.0) for r in rows)),
            "wait_time_ratio_mean": _mean_of(rows, "perf/wait_time_ratio"),
            "loop_s": _loop_s(rows),
            "dropped": int(sum(r.get("async/dropped_samples", 0) for r in rows)),
            "trained": int(sum(r["train/samples"] for r in rows)),
            "partial_pct": None if partial is None else float(partial.mean()),
            "partial_steps": None if partial is None else int((partial > 0).sum()),
            "partial_max_pct": None if partial is None else float(partial.max()),
            "masked_pct": float(masked.mean()),
            "reward_by_10": by_10(reward), "masked_pct_by_10": by_10(masked),
            "partial_pct_by_10": None if partial is None else by_10(partial)}


def row(s: dict) -> str:
    rewards = " | ".join(f"{s[f'reward_{a}_{b}']:.3f}" for a, b in windows(s["steps"]))
    first = s["first_step_smoothed_at_threshold"]
    partial = "-" if s["partial_pct"] is None else f"{s['partial_pct']:.2f}"
    return (f"| {s['run']} | {rewards} | {f'step {first}' if first else '-'} | "
            f"{s['staleness_mean']:.2f} | {s['dropped']} | {partial} |")


if __name__ == "__main__":
    for line in summary_cli(__doc__, summarise, row):
        print(line)
