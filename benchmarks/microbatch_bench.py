"""Learner train time per step and padding: micro-batches of ``algo.micro_batch_size`` samples
against micro-batches by token budget (``algo.max_tokens_per_micro_batch``), on a batch of
uneven lengths.

Two ways to measure. Without ``--train``: the real ``Learner`` (FSDP2 over gloo) on
``--ranks`` spawned processes, no Ray and no engines: each step a synthetic rollout batch of
``--samples`` samples whose lengths (prompt + response) are uniform in
``--min-len``..``--max-len`` tokens, split over the ranks as the rollout manager splits it
(``split_balanced``), and ``train_batch`` on each rank's partition.
The modes take turns on the same batches, one step each in a rotating order, after one
warm-up step each; the tiny model is widened to ``max_len`` positions. Times are the slowest
rank's ``train_batch`` per step (what the step waits for), medians over the steps;
``train/pad_frac`` and ``train/micro_batches`` come from the learner's own metrics.

With ``--train``: the whole job, ``train.py`` as a user runs it (engines, store, weight
sync), once per mode, one after the other with the same seed, on a task of uneven answers
given after ``--``; the micro-batch size is the job's (``algo.micro_batch_size``) and the
budget, unless given, that many samples of the longest possible length
(``rollout.max_prompt_tokens + rollout.max_new_tokens``): the same peak of token slots per
pass. ``perf/train_time`` (the learners' step, what the driver waits for),
``train/pad_frac`` and ``train/micro_batches`` from ``metrics.jsonl``, medians over the
steps after ``--skip``; the reward over the last ten steps shows both runs learn alike.

    python benchmarks/microbatch_bench.py                  # 8 samples a pass vs a 4096-token budget
    python benchmarks/microbatch_bench.py --out benchmarks/results/microbatch.json   # the tracked results
    python benchmarks/microbatch_bench.py --micro-batch-size 64 --budget 8192 -- algo.steps_per_rollout=2
    python benchmarks/microbatch_bench.py --train --steps 40 -- task=repeat_count \
        rollout.max_new_tokens=41 rollout.max_prompt_tokens=8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from rl.config import compose  # noqa: E402
from rl.types import RolloutBatch  # noqa: E402


def synthetic_batch(n: int, min_len: int, max_len: int, prompt_len: int, vocab: int,
                    seed: int) -> RolloutBatch:
    """``n`` samples of uniform lengths in ``min_len..max_len``: a prompt of up to
    ``prompt_len`` tokens, the rest response, every response token trained on."""
    rng = np.random.default_rng(seed)
    total = rng.integers(min_len, max_len + 1, n)
    plen = np.minimum(rng.integers(2, prompt_len + 1, n), total - 1).astype(np.int32)
    rlen = (total - plen).astype(np.int32)
    return RolloutBatch(
        tokens=[rng.integers(3, vocab, t).astype(np.int32) for t in total],
        loss_mask=[np.ones(r, dtype=np.int8) for r in rlen],
        rollout_logprobs=[rng.normal(-3, 0.1, r).astype(np.float32) for r in rlen],
        prompt_len=plen, response_len=rlen, rewards=rng.random(n).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32), group_id=np.arange(n) // 8,
        sample_id=np.arange(n), weight_version=np.zeros(n, dtype=np.int64),
        finish_reason=["length"] * n, label=[""] * n)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, modes: dict, out_path: str) -> None:
    import torch.distributed as dist

    from rl.learner.learner import Learner
    from rl.model import resolve_model_path
    from rl.rollout.batch import split_balanced
    from rl.runtime import Runtime

    cfg = compose(*job_overrides(args))
    with tempfile.TemporaryDirectory() as out:
        learner = Learner(cfg, Runtime("bench", out, resolve_model_path(cfg.model)), rank, world)
        learner.setup("127.0.0.1", port)
        vocab = int(learner.model.config.vocab_size)
        rows = []
        for step in range(args.steps + 1):  # step 0: warm-up of each mode
            batch = synthetic_batch(args.samples, args.min_len, args.max_len, args.prompt_len, vocab,
                                    seed=step)
            part = batch.select(split_balanced(batch.tokens.lengths, world)[rank])
            names = list(modes)
            names = names[step % len(names):] + names[:step % len(names)]
            for name in names:
                learner.cfg.algo.micro_batch_size, learner.cfg.algo.max_tokens_per_micro_batch = modes[name]
                dist.barrier()
                t0 = time.perf_counter()
                metrics = learner.train_batch(part)
                [seconds] = learner._all_reduce([time.perf_counter() - t0], "max")
                rows.append({"mode": name, "step": step, "train_s": seconds,
                             "pad_frac": metrics["train/pad_frac"],
                             "micro_batches": metrics["train/micro_batches"],
                             "loss": metrics["train/loss"]})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        learner.close()


def train_run(args: argparse.Namespace, mode: list[str]) -> list[dict]:
    """``train.py`` with the job's overrides and the mode's; its metrics rows."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", *args.overrides, *mode, f"num_steps={args.steps}",
               "logger=console", "checkpoint.every=0", "eval.every=0", f"output_dir={out}"]
        print("[bench] " + " ".join(cmd[1:-1]), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"train.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def train_modes(args: argparse.Namespace) -> tuple[dict[str, list[str]], list[str]]:
    """``--train``'s two modes (name -> overrides) and the job they run."""
    cfg = compose(*args.overrides)
    mbs = args.micro_batch_size or cfg.algo.micro_batch_size
    budget = args.budget or mbs * (cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens)
    compose(*args.overrides, f"algo.max_tokens_per_micro_batch={budget}")  # bad values fail here
    return ({f"micro_batch_size={mbs}": [f"algo.micro_batch_size={mbs}"],
             f"max_tokens_per_micro_batch={budget}": [f"algo.micro_batch_size={mbs}",
                                                      f"algo.max_tokens_per_micro_batch={budget}"]},
            list(args.overrides))


def train_main(args: argparse.Namespace) -> dict:
    """``--train``: one ``train.py`` run per mode; the table and the results."""
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} must exceed --skip {args.skip}")
    modes, job = train_modes(args)
    results = {}
    for name, mode in modes.items():
        rows = train_run(args, mode)
        kept = rows[args.skip:]
        results[name] = {"train_s": statistics.median(r["perf/train_time"] for r in kept),
                         "step_s": statistics.median(r["perf/step_time"] for r in kept),
                         "pad_frac": statistics.median(r["train/pad_frac"] for r in kept),
                         "micro_batches": statistics.median(r["train/micro_batches"] for r in kept),
                         "response_len_mean": statistics.mean(r["rollout/response_len_mean"] for r in kept),
                         "reward_last10": statistics.mean(r["rollout/reward_mean"] for r in rows[-10:]),
                         "train_s_all": [round(r["perf/train_time"], 4) for r in kept]}
    print("| micro-batches | train s / step | step s | pad_frac | micro_batches / rank | "
          "response tokens (mean) | reward, last 10 steps |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| `algo.{name}` | {r['train_s']:.3f} | {r['step_s']:.3f} | {r['pad_frac']:.3f} | "
              f"{r['micro_batches']:.0f} | {r['response_len_mean']:.1f} | {r['reward_last10']:.3f} |")
    return {"job": job, "modes": modes, "results": results}


def job_overrides(args: argparse.Namespace) -> list[str]:
    return [f"cluster.num_learners={args.ranks}", "cluster.torch_threads=1",
            f"model.tiny.max_positions={args.max_len}", f"rollout.max_prompt_tokens={args.prompt_len}",
            f"rollout.max_new_tokens={args.max_len - args.prompt_len}",
            "rollout.prompts_per_step=1", f"rollout.n_samples_per_prompt={args.samples}",
            *args.overrides]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", action="store_true",
                   help="measure whole train.py runs (one per mode) instead of the learner alone")
    p.add_argument("--steps", type=int, default=5,
                   help="measured steps per mode (after one warm-up); with --train, the runs' num_steps")
    p.add_argument("--skip", type=int, default=5, help="with --train: first steps left out (start-up)")
    p.add_argument("--samples", type=int, default=128, help="samples per step, over all ranks")
    p.add_argument("--ranks", type=int, default=2, help="learner ranks (spawned processes)")
    p.add_argument("--min-len", type=int, default=8, help="shortest sample, prompt + response tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest sample, prompt + response tokens")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt in tokens")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per pass in the fixed mode (default 8: 8 x 512 = the budget's 4096; "
                        "with --train, the job's algo.micro_batch_size)")
    p.add_argument("--budget", type=int, default=None,
                   help="algo.max_tokens_per_micro_batch of the budget mode (default 4096; with "
                        "--train, the micro-batch size times the longest possible sample)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "rl-benchmarks", "microbatch.json"),
                   help="where the JSON goes (default: %(default)s; "
                        "benchmarks/results/microbatch.json updates the tracked results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both modes (after --)")
    return p.parse_args(argv)


def main() -> None:
    import torch.multiprocessing as mp

    from transfer.net import free_port

    args = parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()
    t0 = time.monotonic()
    if args.train:
        out = train_main(args)
        fixed, budget = (r["train_s"] for r in out["results"].values())
        print(f"\ntoken budget: {fixed / budget:.2f}x faster training per step")
        save(args, {**out, "started_utc": started.isoformat(timespec="seconds"),
                    "load_average_start": load[0], "load_average_end": os.getloadavg()[0],
                    "seconds": time.monotonic() - t0, "speedup": fixed / budget})
        return
    args.micro_batch_size = args.micro_batch_size or 8
    args.budget = args.budget or 4096
    compose(*job_overrides(args), f"algo.max_tokens_per_micro_batch={args.budget}")  # bad values fail here
    modes = {f"micro_batch_size={args.micro_batch_size}": (args.micro_batch_size, 0),
             f"max_tokens_per_micro_batch={args.budget}": (args.micro_batch_size, args.budget)}
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, (args.ranks, free_port(), args, modes, rows_path), nprocs=args.ranks,
                           start_method="spawn")
        with open(rows_path) as f:
            rows = [r for r in json.load(f) if r["step"] > 0]
    results = {}
    for name in modes:
        mine = [r for r in rows if r["mode"] == name]
        results[name] = {k: statistics.median(r[k] for r in mine)
                         for k in ("train_s", "pad_frac", "micro_batches")}
        results[name]["train_s_all"] = [round(r["train_s"], 4) for r in mine]
        results[name]["loss_mean"] = statistics.mean(r["loss"] for r in mine)
    fixed, budget = (results[n]["train_s"] for n in modes)
    print(f"# {platform.node()}: {os.cpu_count()} cores; {args.ranks} ranks, {args.samples} samples a "
          f"step of {args.min_len}-{args.max_len} tokens, {args.steps} steps per mode; load average "
          f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.monotonic() - t0:.0f} s")
    print("| micro-batches | train s / step | pad_frac | micro_batches / rank |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| `algo.{name}` | {r['train_s']:.3f} | {r['pad_frac']:.3f} | {r['micro_batches']:.0f} |")
    print(f"\ntoken budget: {fixed / budget:.2f}x faster per step")
    save(args, {"started_utc": started.isoformat(timespec="seconds"),
                "load_average_start": load[0], "load_average_end": os.getloadavg()[0],
                "job": job_overrides(args), "results": results, "speedup": fixed / budget})


def save(args: argparse.Namespace, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/microbatch_bench.py " + " ".join(sys.argv[1:]),
                   "machine": f"{os.cpu_count()} CPUs, {platform.platform()}", "steps": args.steps,
                   **result}, f, indent=2)
    print(f"[bench] saved {args.out}")


if __name__ == "__main__":
    main()
