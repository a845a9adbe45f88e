"""What the distributed pipeline costs per step: the default job against a single-process
GRPO loop on the same model, task and batch, run one after the other in one invocation.

The reference loop has no Ray, no HTTP, no store and no weight sync: one process draws the
prompts, samples them with the CPU engine's own batched sampler (``HFEngine``, called
directly, every sample of the step in one batch), scores them with the task, computes GRPO
advantages (``rl.algo``) and takes one optimizer step with the learner's loss
(``policy_loss_bt``, ``agg_sum``) over micro-batches of ``algo.micro_batch_size``; the
policy it trains is the one it samples from. The distributed job is ``train.py`` as a user
runs it (a subprocess with the same overrides); its parts come from ``metrics.jsonl``.
Medians over the steps after the first ``--skip``.

    python benchmarks/step_bench.py                       # default job, 30 steps each
    python benchmarks/step_bench.py --steps 40 -- rollout.max_new_tokens=16
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
sys.path.insert(0, REPO)
from rl.config import compose  # noqa: E402  (train.py composes the same way)

# What the table shows: (label, reference key, distributed key). None: the part does not exist.
PARTS = [
    ("generation", "generate", "rollout/generate_time"),
    ("score, advantages, split, put (manager)", "score", "rollout_other"),
    ("  of which store put", None, "transfer/put_ms"),
    ("train (learners, incl. get)", "train", "perf/train_time"),
    ("  of which store get", None, "transfer/get_ms"),
    ("  of which old-logprob pass", None, "perf/old_logp_time"),
    ("weight sync", None, "perf/update_weights_time"),
    ("step", "step", "perf/step_time"),
]


def reference(overrides: list[str], steps: int, threads: int) -> list[dict[str, float]]:
    """The single-process loop; per step, seconds of each part."""
    import numpy as np
    import torch

    from rl.algo import agg_count, agg_sum, policy_loss_bt, token_logprobs
    from rl.model import eos_token_ids, load_model, load_tokenizer, resolve_model_path
    from rl.rollout.engines.hf_engine import HFEngine
    from rl.rollout.engines.sampling import GenRequest, parse_sampling_params
    from rl.rollout.batch import encode_prompt, grpo_advantages
    from rl.tasks.build import build_task

    cfg = compose(*overrides)
    rc, a = cfg.rollout, cfg.algo
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, cfg.model.dtype, "cpu")
    model.train()
    engine = HFEngine(model, tokenizer, eos_token_ids(path, tokenizer), seed=cfg.seed)
    task = build_task(cfg.task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.adam_beta1, a.adam_beta2),
                                  weight_decay=a.weight_decay)
    kwargs = parse_sampling_params(rc.sampling_params())[0]
    pad_id = tokenizer.pad_token_id or 0
    n, T = rc.n_samples_per_prompt, rc.temperature
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        prompts = task.next_prompts(rc.prompts_per_step)
        ids = [encode_prompt(tokenizer, p.text, cfg.model.chat_template) for p in prompts]
        results = engine.generate([GenRequest(input_ids=p, **kwargs) for p in ids for _ in range(n)])
        t1 = time.perf_counter()
        rewards = np.asarray([task.reward(r.text, prompts[i // n].label,
                                          r.finish_reason["type"] == "stop")
                              for i, r in enumerate(results)], dtype=np.float32)
        adv = grpo_advantages(rewards, n, a.advantage_std_norm)
        t2 = time.perf_counter()
        seqs = [(ids[i // n], r.output_ids) for i, r in enumerate(results)]
        mbs = a.micro_batch_size
        packed = []
        for s in range(0, len(seqs), mbs):
            part = seqs[s:s + mbs]
            L = max(len(p) + len(o) for p, o in part)
            tok = np.full((len(part), L), pad_id, dtype=np.int64)
            attn = np.zeros((len(part), L), dtype=np.int64)
            mask = np.zeros((len(part), L - 1), dtype=np.float32)
            for j, (p, o) in enumerate(part):
                tok[j, :len(p) + len(o)] = p + o
                attn[j, :len(p) + len(o)] = 1
                mask[j, len(p) - 1:len(p) - 1 + len(o)] = 1
            packed.append((torch.from_numpy(tok), torch.from_numpy(attn), torch.from_numpy(mask),
                           torch.from_numpy(adv[s:s + mbs])))
        count = max(sum(agg_count(m, a.loss_agg) for _, _, m, _ in packed), 1.0)
        optimizer.zero_grad(set_to_none=True)
        for tok, attn, mask, adv_b in packed:
            logits = model(input_ids=tok, attention_mask=attn).logits
            logp_bt = token_logprobs(logits[:, :-1], tok[:, 1:], T)
            loss_bt, _, _ = policy_loss_bt(logp_bt, logp_bt.detach(), adv_b, a.clip_eps,
                                           a.clip_eps_high if a.clip_eps_high is not None else a.clip_eps)
            (agg_sum(loss_bt, mask, a.loss_agg, rc.max_new_tokens) / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        t3 = time.perf_counter()
        rows.append({"generate": t1 - t0, "score": t2 - t1, "train": t3 - t2, "step": t3 - t0,
                     "reward": float(rewards.mean())})
    return rows


def distributed(overrides: list[str], steps: int) -> tuple[list[dict[str, float]], float]:
    """``train.py`` as a user runs it; per step, its metrics (seconds, store ms)."""
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "train.py", *overrides, f"num_steps={steps}",
                               "logger=console", "checkpoint.every=0", f"output_dir={out}"],
                              cwd=REPO, capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"train.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    for r in rows:
        r["rollout_other"] = r["perf/rollout_time"] - r["rollout/generate_time"]
        r["reward"] = r["rollout/reward_mean"]
    return rows, wall


def median(rows: list[dict], key: str | None) -> float | None:
    if key is None or key not in rows[0]:
        return None
    scale = 1e-3 if key.endswith("_ms") else 1.0
    return statistics.median(r[key] for r in rows) * scale


def table(ref: list[dict], dist: list[dict]) -> str:
    lines = ["| part | single process (s) | distributed (s) | ratio |", "|---|---|---|---|"]
    for label, rk, dk in PARTS:
        r, d = median(ref, rk), median(dist, dk)
        # no ratio to a part the single process barely has (under 1 ms): it would only be noise
        ratio = f"{d / r:.1f}x" if r is not None and r >= 1e-3 and d is not None else ""
        lines.append(f"| {label} | {'' if r is None else f'{r:.3f}'} | "
                     f"{'' if d is None else f'{d:.3f}'} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the reference loop (default 1, as each process of "
                             "the distributed job; on the 2-core machine 1 was faster than 2)")
    parser.add_argument("--json", default=None, help="also write the medians here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both (after --)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} must exceed --skip {args.skip}")

    ref = reference(args.overrides, args.steps, args.threads)[args.skip:]
    dist_rows, wall = distributed(args.overrides, args.steps)
    dist = dist_rows[args.skip:]
    ratio = median(dist, "perf/step_time") / median(ref, "step")
    print(f"# {platform.node()}: {os.cpu_count()} cores, python {platform.python_version()}; "
          f"{args.steps} steps each, medians of the last {args.steps - args.skip}; "
          f"overrides: {' '.join(args.overrides) or '(none)'}; train.py took {wall:.1f} s")
    print(table(ref, dist))
    print(f"\ndistributed step / single-process step: {ratio:.2f}x "
          f"(mean reward over the measured steps: single {statistics.mean(r['reward'] for r in ref):.3f}, "
          f"distributed {statistics.mean(r['reward'] for r in dist):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "skip": args.skip, "overrides": args.overrides,
                       "ratio": ratio,
                       "parts": {label: {"single": median(ref, rk), "distributed": median(dist, dk)}
                                 for label, rk, dk in PARTS}}, f, indent=1)


if __name__ == "__main__":
    main()
