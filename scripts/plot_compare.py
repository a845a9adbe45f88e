"""Plot several runs' reward and clip fraction per step on shared axes.

    python scripts/plot_compare.py docs/addition.png \
        runs/a/metrics.jsonl:"steps_per_rollout=1" runs/b/metrics.jsonl:"steps_per_rollout=4"
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+", help="METRICS_JSONL:LABEL")
    parser.add_argument("--title", default=None)
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window (steps)")
    args = parser.parse_args()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for spec in args.runs:
        path, _, label = spec.partition(":")
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        steps = [r["step"] + 1 for r in rows]
        reward = smooth([r["rollout/reward_mean"] for r in rows], args.smooth)
        ax1.plot(steps, reward, lw=1.2, label=label or path)
        ax2.plot(steps, [r.get("train/clipfrac", 0.0) for r in rows], lw=1.0, label=label or path)
        raw = [r["rollout/reward_mean"] for r in rows]  # the printed means are of the raw rewards
        print(f"{label or path}: {len(rows)} steps, reward first 10 {mean(raw[:10]):.3f}, "
              f"last 10 {mean(raw[-10:]):.3f}")
    ax1.set(xlabel="step", ylabel=f"mean reward ({args.smooth}-step average)", ylim=(-0.02, 1.02))
    ax2.set(xlabel="step", ylabel="train/clipfrac")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


def smooth(xs: list[float], k: int) -> list[float]:
    return [mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


if __name__ == "__main__":
    main()
