"""Throughput of the three training loops on the same job: ``train.py`` (synchronous),
``train_async.py`` (one-step off-policy) and ``train_async.py rollout.fully_async=true``.

Each mode runs as a user runs it (a subprocess with Hydra overrides); the numbers come from
its ``metrics.jsonl``. Throughput is trained samples over the summed step time of the steady
steps (the first ``--skip`` steps, with start-up effects, are left out).

The default job is sized for a 2-core machine: one engine and one learner rank, one thread
each, so that overlapping them can use both cores, and a wider tiny model so that one rollout
and one training step take about the same time (the case where overlap pays most; 2x is the
limit).

    python benchmarks/async_bench.py                        # default job, 20 steps per mode
    python benchmarks/async_bench.py --out benchmarks/results/async.json   # the tracked results
    python benchmarks/async_bench.py --steps 30 -- transfer=mooncake_tcp weights=p2p
    python benchmarks/async_bench.py -- task=repeat_count rollout.max_new_tokens=41   # uneven lengths

``engines idle`` is the share of the measured window in which an engine had no request in
flight (``rollout/engine_busy_s``, counted by the rollout manager).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = ["cluster.num_engines=1", "cluster.num_learners=1", "cluster.torch_threads=1",
       "model.tiny.hidden_size=256", "model.tiny.intermediate_size=1024",
       "logger=console", "checkpoint.every=0", "eval.every=0"]
MODES = {
    "train.py (synchronous)": ("train.py", []),
    "train_async.py (one-step off-policy)": ("train_async.py", []),
    "train_async.py rollout.fully_async=true": ("train_async.py", ["rollout.fully_async=true"]),
}


def run_mode(script: str, overrides: list[str], steps: int, skip: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, script, *overrides, f"num_steps={steps}",
                               f"output_dir={out}"], cwd=REPO, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{script} {' '.join(overrides)} failed:\n{proc.stdout[-3000:]}"
                             f"{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            all_rows = [json.loads(line) for line in f]
        rows = all_rows[skip:]
    step_s = sum(r["perf/step_time"] for r in rows)
    # engines idle: no request in flight on an engine (the rollout manager's count), over the
    # measured steps' generation window
    first, last = rows[0], rows[-1]
    window = (last["rollout/finished_at"] - first["rollout/finished_at"]) * last["rollout/engines"]
    busy = last["rollout/engine_busy_s"] - first["rollout/engine_busy_s"]
    return {
        "samples_per_s": sum(r["train/samples"] for r in rows) / step_s,
        "step_time_s": step_s / len(rows),
        "rollout_time_s": statistics.mean(r["perf/rollout_time"] for r in rows),
        "train_time_s": statistics.mean(r["perf/train_time"] for r in rows),
        "update_weights_time_s": statistics.mean(r["perf/update_weights_time"] for r in rows),
        "wait_time_ratio": statistics.mean(r["perf/wait_time_ratio"] for r in rows),
        "staleness_mean": statistics.mean(r["async/staleness_mean"] for r in rows),
        "dropped_samples": sum(r.get("async/dropped_samples", 0.0) for r in rows),
        "engine_idle_frac": 1.0 - busy / window if window > 0 else float("nan"),
        "reward_mean": statistics.mean(r["rollout/reward_mean"] for r in rows),
        "reward_by_step": [r["rollout/reward_mean"] for r in all_rows],
        "steps_measured": len(rows),
        "wall_s": time.monotonic() - t0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the averages")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "rl-benchmarks", "async.json"),
                   help="where the JSON goes (default: %(default)s; "
                        "benchmarks/results/async.json updates the tracked results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every mode (after --)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()

    job = JOB + args.overrides
    results = {}
    for label, (script, extra) in MODES.items():
        print(f"[bench] {label} ...", flush=True)
        results[label] = run_mode(script, job + extra, args.steps, args.skip)
        r = results[label]
        print(f"[bench]   {r['samples_per_s']:.1f} samples/s, step {r['step_time_s']:.2f}s, "
              f"wait ratio {r['wait_time_ratio']:.3f}", flush=True)
    base = results["train.py (synchronous)"]["samples_per_s"]
    print("\n| mode | samples/s | speed-up | step s | rollout s | train s | sync s | wait ratio "
          "| staleness | dropped | engines idle | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| `{label}` | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | "
              f"{r['step_time_s']:.2f} | {r['rollout_time_s']:.2f} | {r['train_time_s']:.2f} | "
              f"{r['update_weights_time_s']:.2f} | {r['wait_time_ratio']:.3f} | "
              f"{r['staleness_mean']:.2f} | {r['dropped_samples']:.0f} | "
              f"{r['engine_idle_frac']:.2f} | {r['reward_mean']:.3f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/async_bench.py " + " ".join(sys.argv[1:]),
                   "job": job, "steps": args.steps, "skip": args.skip,
                   "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                   "results": results}, f, indent=2)
    print(f"\n[bench] saved {args.out}")


if __name__ == "__main__":
    main()
