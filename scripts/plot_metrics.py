"""Plot a run's reward curve, its evaluation (when the run logged one) and reward
against time, from its metrics.jsonl.

    python scripts/plot_metrics.py outputs/<date>/<time>/metrics.jsonl docs/reward_curve.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics")
    parser.add_argument("out")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f]
    steps = [r["step"] + 1 for r in rows]
    reward = [r["rollout/reward_mean"] for r in rows]
    elapsed, t = [], 0.0
    for r in rows:
        t += r["perf/step_time"]
        elapsed.append(t)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, reward, lw=1.2, label="training batches")
    evals = [(s, r) for s, r in zip(steps, rows) if "eval/reward_mean" in r]
    if evals:  # the evaluation prompts (eval.every), after the step's weight sync
        pass_key = next(k for k in evals[0][1] if k.startswith("eval/pass@"))
        ax1.plot([s for s, _ in evals], [r["eval/reward_mean"] for _, r in evals], "o-", ms=3,
                 lw=1.2, color="tab:orange", label="eval")
        ax1.plot([s for s, _ in evals], [r[pass_key] for _, r in evals], "s--", ms=3, lw=1,
                 color="tab:red", label=f"eval {pass_key.removeprefix('eval/')}")
        ax1.legend(loc="lower right", fontsize=8)
    ax1.set(xlabel="step", ylabel="mean reward", ylim=(-0.02, 1.02), title="reward per step")
    ax1.grid(alpha=0.3)
    ax2.plot([e / 60 for e in elapsed], reward, lw=1.2, color="tab:green")
    ax2.set(xlabel="training-loop wall time (min)", ylabel="mean reward", ylim=(-0.02, 1.02),
            title="reward vs. time")
    ax2.grid(alpha=0.3)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    last_eval = next((r for r in reversed(rows) if "eval/reward_mean" in r), None)
    print(f"wrote {args.out}: {len(rows)} steps, final reward "
          f"{sum(reward[-10:]) / min(10, len(reward)):.3f}, loop time {elapsed[-1]:.0f}s"
          + (f", last eval reward {last_eval['eval/reward_mean']:.3f}" if last_eval else ""))


if __name__ == "__main__":
    main()
