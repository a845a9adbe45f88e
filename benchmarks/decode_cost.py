"""What one decode step of the CPU engine costs by the number of rows it carries, and what a
batch of uneven answers costs: the reason streaming gains little over batch-by-batch
generation on a CPU (docs/benchmarks.md, "Uneven answer lengths, with groups streamed").

The real engine (``HFEngine.generate``, sampling at temperature 1, no EOS) on the model of
``benchmarks/async_bench.py``'s job (the tiny Qwen2 widened to hidden 256, intermediate 1024)
on one torch thread, as that job's engine runs:

- per rows: a batch of ``rows`` requests of ``--tokens`` output tokens each; the step's
  cost is the batch's time over its tokens (the prefill of a short prompt included);
- uneven: ``--uneven`` requests whose answers run to 1..``--tokens`` tokens (evenly
  spread), decoded as one batch (finished requests leave it), against that batch decoded at
  its full width every step (``--tokens`` steps at the cost of a step of ``--uneven`` rows,
  what the engine paid before finished requests left the batch).

    python benchmarks/decode_cost.py
    python benchmarks/decode_cost.py --rows 1 8 64 256 512 --out /tmp/decode_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--tokens", type=int, default=40, help="output tokens per request")
    p.add_argument("--uneven", type=int, default=256, help="requests in the uneven batch")
    p.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "rl-benchmarks",
                                                  "decode_cost.json"),
                   help="where the JSON goes (default: %(default)s)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    import torch

    from rl.config.model import TinyModelConfig
    from rl.model import build_tiny_checkpoint, eos_token_ids, load_model, load_tokenizer
    from rl.rollout.engines.hf_engine import GenRequest, HFEngine

    torch.set_num_threads(1)
    path = build_tiny_checkpoint(TinyModelConfig(hidden_size=256, intermediate_size=1024))
    tok = load_tokenizer(path)
    engine = HFEngine(load_model(path), tok, eos_token_ids(path, tok), seed=0)
    prompt = tok.encode("c7:")

    def timed(reqs: list[GenRequest]) -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(reqs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def req(n: int) -> GenRequest:
        return GenRequest(prompt, max_new_tokens=n, ignore_eos=True)

    timed([req(2)])  # warm-up
    per_rows = {}
    print("| rows | ms per decode step | us per row |\n|---|---|---|")
    for rows in args.rows:
        step_s = timed([req(args.tokens)] * rows) / args.tokens
        per_rows[rows] = step_s
        print(f"| {rows} | {step_s * 1e3:.2f} | {step_s * 1e6 / rows:.1f} |", flush=True)

    lengths = [1 + i * (args.tokens - 1) // max(args.uneven - 1, 1) for i in range(args.uneven)]
    batch_s = timed([req(n) for n in lengths])
    if args.uneven not in per_rows:
        per_rows[args.uneven] = timed([req(args.tokens)] * args.uneven) / args.tokens
    full_s = max(lengths) * per_rows[args.uneven]
    print(f"\n{args.uneven} requests of 1..{args.tokens} tokens ({sum(lengths)} tokens) as one "
          f"batch: {batch_s:.3f} s; every step at the full width ({args.uneven} rows x "
          f"{max(lengths)} steps): {full_s:.3f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/decode_cost.py " + " ".join(sys.argv[1:]),
                   "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                   "step_s_by_rows": per_rows, "uneven": {"lengths": lengths, "batch_s": batch_s,
                                                          "full_width_s": full_s}}, f, indent=2)
    print(f"[bench] saved {args.out}")


if __name__ == "__main__":
    main()
