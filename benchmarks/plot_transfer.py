"""Plot transfer benchmark results: PUT, GET and PUT+GET medians per case and batch size.

    python benchmarks/plot_transfer.py benchmarks/results/transfer_two_hosts.json \
        benchmarks/results/transfer_same_host.json docs/transfer_bench.png

A case is a backend in a layout (``training``: the consumer lends the Mooncake segment, as
train.py; ``producer-lends``: the earlier benchmark layout; Ray has none). The PUT+GET panel
also shows the link's ceilings for the same bytes: the Python socket's time and the bytes
over iperf3's throughput.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (backend, layout) -> label, colour, hatch
CASES = {
    ("ray", "-"): ("ray", "tab:blue", ""),
    ("mooncake-packed", "training"): ("packed, training layout", "tab:green", ""),
    ("mooncake-bundle", "training"): ("bundle, training layout", "tab:orange", ""),
    ("mooncake-packed", "producer-lends"): ("packed, producer lends", "tab:green", "//"),
    ("mooncake-bundle", "producer-lends"): ("bundle, producer lends", "tab:orange", "//"),
    ("python-socket", "-"): ("Python socket (ceiling)", "tab:gray", ""),
    ("iperf3", "-"): ("iperf3 (ceiling)", "lightgray", ""),
}


def main() -> None:
    *inputs, out = sys.argv[1:]
    results = [json.load(open(p)) for p in inputs]
    fig, axes = plt.subplots(len(results), 3, figsize=(15, 3.8 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        rows = res["rows"]
        sizes = sorted({r["n"] for r in rows})
        mb = {r["n"]: r["mb"] for r in rows}
        for ax, what, title in zip(row, ("put_ms", "get_ms", "sum_ms"), ("PUT", "GET", "PUT+GET")):
            cases = [c for c in CASES if any((r["backend"], r["layout"]) == c and what in r
                                             for r in rows)]
            width = 0.8 / len(cases)
            for i, c in enumerate(cases):
                label, color, hatch = CASES[c]
                vals = [next((r[what] for r in rows if (r["backend"], r["layout"]) == c
                              and r["n"] == n), None) for n in sizes]
                xs = [k + i * width for k, v in enumerate(vals) if v is not None]
                ax.bar(xs, [v for v in vals if v is not None], width, label=label, color=color,
                       hatch=hatch, edgecolor="white" if hatch else None)
            ax.set_xticks([k + width * (len(cases) - 1) / 2 for k in range(len(sizes))])
            ax.set_xticklabels([f"N={n}\n{mb[n]:.0f} MB" for n in sizes])
            ax.set_ylabel("ms (median)")
            ax.set_title(f"{title}: {res['title']}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        row[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
