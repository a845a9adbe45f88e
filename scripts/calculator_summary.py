"""Summarise `task=calculator` runs as rows of the table in docs/rollout.md ("Over seeds").

Per run: the reward and the right answers (`rollout/solved_frac`) over the last 20 steps,
the first step with a right answer, the entropy over the last 10 steps, the last evaluation
(reward / pass@k), and, from the last samples the run dumped (`rollout.dump_every`), the
fraction that call the tool, of their calls' operands the fraction right, and of their
finished answers the fraction that copy the tool's result. Steps are counted from 1.

    python scripts/calculator_summary.py outputs/calc_s1 outputs/calc_s2
    python scripts/calculator_summary.py docs/runs/calculator_test_s5_metrics.jsonl

A path is a run's `output_dir` (its metrics.jsonl and rollouts/) or a metrics file; for
`<name>_metrics.jsonl` the dumped samples are read from `<name>_dump.jsonl` beside it (as
docs/runs keeps some runs' last dump), and without one the last column reads "-". `--json`
prints every figure, the share of answers equal to the call's second operand too (the usual
wrong copy), and of groups with a call that gave the sum (``task.copy_credit_fade``).
`--mean` adds a row of the runs' means (the first right answer: the latest run's, "by step N";
the last column only if every run kept its dump).

`--by-dump` prints instead one row per dumped step of each run (its `rollouts/`, or the
directory `<name>_dumps/` beside `<name>_metrics.jsonl`): the step, then that step's calls,
operands right and answers copied, the figures of the last column above (`--json`: every
figure of `calculator_dump_stats`):

    python scripts/calculator_summary.py --by-dump docs/runs/calculator_metrics.jsonl
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np

from rl.driver.metrics import read_metrics, summary_cli
from rl.tasks.builtin import calculator_dump_stats


def summarise(path: str) -> dict:
    rows = read_metrics(path)
    evals = [r for r in rows if "eval/reward_mean" in r]
    pass_key = next((k for k in (evals[-1] if evals else {}) if k.startswith("eval/pass@")), None)
    out = {"run": os.path.basename(path.rstrip("/")), "steps": len(rows),
           "reward_last20": float(np.mean([r["rollout/reward_mean"] for r in rows[-20:]])),
           "right_last20": float(np.mean([r["rollout/solved_frac"] for r in rows[-20:]])),
           "first_right_step": next((r["step"] + 1 for r in rows if r["rollout/solved_frac"] > 0), None),
           "entropy_last10": float(np.mean([r["train/entropy"] for r in rows[-10:]])),
           "eval_step": evals[-1]["step"] + 1 if evals else None,
           "eval_reward": evals[-1]["eval/reward_mean"] if evals else None,
           "eval_pass": evals[-1][pass_key] if pass_key else None}
    if path.endswith("_metrics.jsonl"):  # a run kept in docs/runs: its last dump beside it, if kept
        dumps = [p for p in [path.removesuffix("_metrics.jsonl") + "_dump.jsonl"] if os.path.exists(p)]
    else:
        dumps = sorted(glob.glob(os.path.join(path, "rollouts", "step_*.jsonl")))
    if dumps:
        with open(dumps[-1]) as f:
            samples = [json.loads(line) for line in f]
        out["dump_step"] = samples[0]["step"] + 1
        out.update(calculator_dump_stats(samples))
    return out


def dump_files(path: str) -> list[str]:
    """Every samples dump of a run, by step: an ``output_dir``'s ``rollouts/``, or for
    ``<name>_metrics.jsonl`` the directory ``<name>_dumps/`` beside it (docs/runs)."""
    where = (path.removesuffix("_metrics.jsonl") + "_dumps" if path.endswith("_metrics.jsonl")
             else os.path.join(path, "rollouts"))
    return sorted(glob.glob(os.path.join(where, "step_*.jsonl")))


def by_dump(path: str) -> list[dict]:
    """``--by-dump``: the figures of each dumped step of the run, in step order."""
    out = []
    for dump in dump_files(path):
        with open(dump) as f:
            samples = [json.loads(line) for line in f]
        out.append({"run": os.path.basename(path.rstrip("/")), "dump_step": samples[0]["step"] + 1,
                    **calculator_dump_stats(samples)})
    if not out:
        raise SystemExit(f"{path}: no dumped samples found (rollout.dump_every writes them)")
    return out


def dump_row(s: dict) -> str:
    return (f"| step {s['dump_step']} | {s['calls']:.2f} | {s['operands_right']:.2f} | "
            f"{s['answers_copied']:.2f} |")


def mean(runs: list[dict]) -> dict:
    """The runs' mean figure by figure (``--mean``), as one more row: each figure that every run
    has; the first right answer, the latest run's (none if a run had none)."""
    out: dict = {"run": f"mean of {len(runs)} runs", "by": True}
    for k, v in runs[0].items():
        values = [r.get(k) for r in runs]
        if isinstance(v, (int, float)) and all(isinstance(x, (int, float)) for x in values):
            out[k] = float(np.mean(values))
    firsts = [r["first_right_step"] for r in runs]
    out["first_right_step"] = None if None in firsts else max(firsts)
    for k in ("eval_reward", "eval_pass"):
        out.setdefault(k, None)
    return out


def row(s: dict) -> str:
    first = f"{'by ' if s.get('by') else ''}step {s['first_right_step']}" if s["first_right_step"] else "none"
    ev = f"{s['eval_reward']:.2f} / {s['eval_pass']:.2f}" if s["eval_reward"] is not None else "-"
    last = (f"{s['calls']:.2f} / {s['operands_right']:.2f} / {s['answers_copied']:.2f}" if "calls" in s
            else "-")
    return (f"| {s['run']} | {s['reward_last20']:.2f} | {s['right_last20']:.3f} | {first} | "
            f"{s['entropy_last10']:.2f} | {ev} | {last} |")


if __name__ == "__main__":
    if "--by-dump" in sys.argv[1:]:
        for path in (a for a in sys.argv[1:] if not a.startswith("--")):
            for s in by_dump(path):
                print(json.dumps(s) if "--json" in sys.argv else dump_row(s))
    else:
        for line in summary_cli(__doc__, summarise, row, mean):
            print(line)
