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
  what the engine paid before finished requests left the batch);
- stream: ``--stream`` requests of uneven lengths (shuffled, seeded) through the engine's
  real scheduler with ``--in-flight`` of them kept in flight (a new one sent as each is
  answered, as fully async streams groups): requests joining the running batch (continuous
  batching) once an eighth of its rows' number wait (the engine as it is,
  ``BatchScheduler.join_share``), joining at every step (as SGLang admits), and batch by
  batch (a request that arrives while a batch decodes waits for it to end: admission off).

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
    p.add_argument("--stream", type=int, default=512, help="requests in the stream (0: skip)")
    p.add_argument("--in-flight", type=int, default=64, help="requests kept in flight in the stream")
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
    stream = streamed(engine, [req(n) for n in stream_lengths(args)], args) if args.stream else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/decode_cost.py " + " ".join(sys.argv[1:]),
                   "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                   "step_s_by_rows": per_rows, "uneven": {"lengths": lengths, "batch_s": batch_s,
                                                          "full_width_s": full_s},
                   "stream": stream}, f, indent=2)
    print(f"[bench] saved {args.out}")


def stream_lengths(args: argparse.Namespace) -> list[int]:
    """``--stream`` answer lengths spread evenly over 1..``--tokens``, in a seeded shuffle."""
    import random

    lengths = [1 + i * (args.tokens - 1) // max(args.stream - 1, 1) for i in range(args.stream)]
    random.Random(0).shuffle(lengths)
    return lengths


def streamed(engine, reqs: list, args: argparse.Namespace) -> dict:
    """``reqs`` through the real scheduler, ``--in-flight`` at a time, with requests joining
    the running batch and batch by batch: for each, the seconds of every repeat, their median
    and its output tokens per second, and the forward passes of one run: prefills (a prompt
    each row) and decode steps, how many and their mean milliseconds."""
    import asyncio

    from rl.config.rollout import HFRolloutConfig
    from rl.rollout.engines.scheduler import BatchScheduler

    class EveryStep(BatchScheduler):  # one request waiting is enough
        join_share = 1 << 30

    class BatchByBatch(BatchScheduler):  # admission off: arrivals wait for the batch to end
        def _admit(self, items, waiters, rows):
            return []

    wait_s = HFRolloutConfig().batch_wait_ms / 1e3

    async def send_all(scheduler) -> None:
        slots = asyncio.Semaphore(args.in_flight)

        async def one(r):
            async with slots:
                await scheduler.submit([r])

        await asyncio.gather(*(one(r) for r in reqs))

    passes: dict[str, list[float]] = {}
    started = [0.0]

    def before(module, a, kw):
        started[0] = time.perf_counter()

    def after(module, a, kw, output):
        kind = "prefill" if kw["input_ids"].shape[1] > 1 else "decode"
        passes.setdefault(kind, []).append(time.perf_counter() - started[0])

    engine.model.register_forward_pre_hook(before, with_kwargs=True)
    engine.model.register_forward_hook(after, with_kwargs=True)
    tokens, out = sum(r.max_new_tokens for r in reqs), {}
    print(f"\n{len(reqs)} requests of 1..{args.tokens} tokens ({tokens} tokens), "
          f"{args.in_flight} in flight:\n| scheduling | s | tokens/s | prefill passes (mean ms) "
          "| decode passes (mean ms) |\n|---|---|---|---|---|")
    for label, cls in ((f"joining once 1/{BatchScheduler.join_share} of the rows wait", BatchScheduler),
                       ("joining at every step", EveryStep), ("batch by batch", BatchByBatch)):
        scheduler, times = cls(engine, max_batch_size=256, batch_wait_s=wait_s), []
        for _ in range(args.repeats):
            passes.clear()
            t0 = time.perf_counter()
            asyncio.run(send_all(scheduler))
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        counts = {k: {"passes": len(v), "mean_ms": 1e3 * statistics.mean(v)} for k, v in passes.items()}
        out[label] = {"s": s, "tokens_per_s": tokens / s, "repeats_s": times, "last_run": counts}
        cells = [f"{counts[k]['passes']} ({counts[k]['mean_ms']:.1f})" for k in ("prefill", "decode")]
        print(f"| {label} | {s:.3f} | {tokens / s:.0f} | {' | '.join(cells)} |", flush=True)
    out.update(requests=len(reqs), in_flight=args.in_flight, tokens=tokens)
    return out


if __name__ == "__main__":
    main()
