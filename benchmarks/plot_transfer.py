"""Plot transfer benchmark results (PUT and GET medians per backend and batch size).

    python benchmarks/plot_transfer.py benchmarks/results/transfer_same_host.json \
        benchmarks/results/transfer_two_hosts.json docs/transfer_bench.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"ray": "tab:blue", "mooncake-packed": "tab:green", "mooncake-bundle": "tab:orange",
          "raw-tcp": "tab:gray"}


def main() -> None:
    *inputs, out = sys.argv[1:]
    results = [json.load(open(p)) for p in inputs]
    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.4 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        sizes = sorted({r["n"] for r in res["rows"]})
        backends = [b for b in COLORS if any(r["backend"] == b for r in res["rows"])]
        width = 0.8 / len(backends)
        for col, (ax, what) in enumerate(zip(row, ("put_ms", "get_ms"))):
            for i, b in enumerate(backends):
                vals = [next((r[what] for r in res["rows"] if r["backend"] == b and r["n"] == n), None)
                        for n in sizes]
                xs = [k + i * width for k, v in enumerate(vals) if v is not None]
                ax.bar(xs, [v for v in vals if v is not None], width, label=b, color=COLORS[b])
            ax.set_xticks([k + width * (len(backends) - 1) / 2 for k in range(len(sizes))])
            mb = {r["n"]: r["mb"] for r in res["rows"]}
            ax.set_xticklabels([f"N={n}\n{mb[n]:.0f} MB" for n in sizes])
            ax.set_ylabel("ms (median)")
            ax.set_title(f"{'PUT' if col == 0 else 'GET'}: {res['title']}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        row[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
