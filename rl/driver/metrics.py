"""One metrics dict per step: appended to ``metrics.jsonl``, sent to W&B, printed compactly."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
from typing import Callable, Iterator

from rl.config import Config
from rl.runtime import Runtime

logger = logging.getLogger(__name__)


def read_metrics(path: str) -> list[dict]:
    """The rows a run logged, one per step: ``path`` is its ``output_dir`` or a metrics.jsonl."""
    metrics = path if path.endswith(".jsonl") else os.path.join(path, "metrics.jsonl")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    if not rows:
        raise SystemExit(f"{metrics}: no steps logged")
    return rows


def summary_cli(doc: str, summarise: Callable[[str], dict], row: Callable[[dict], str],
                mean: Callable[[list[dict]], dict] | None = None) -> Iterator[str]:
    """The command line of the scripts that print a table row per run (scripts/*_summary.py):
    paths of runs (an ``output_dir`` or a metrics.jsonl) -> the lines to print,
    ``row(summarise(path))`` each, or with ``--json`` every figure as a JSON object; where the
    script gives ``mean``, ``--mean`` adds one more line, ``row(mean(summaries))``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="a run's output_dir, or its metrics.jsonl")
    parser.add_argument("--json", action="store_true", help="every figure, one JSON object per run")
    if mean is not None:
        parser.add_argument("--mean", action="store_true", help="one more row: the runs' mean")
    args = parser.parse_args()
    summaries = [summarise(path) for path in args.paths]
    if mean is not None and args.mean:
        summaries.append(mean(summaries))
    for s in summaries:
        yield json.dumps(s) if args.json else row(s)


class MetricsLogger:
    def __init__(self, cfg: Config, runtime: Runtime) -> None:
        self.cfg = cfg
        self.path = os.path.join(runtime.output_dir, "metrics.jsonl")
        os.makedirs(runtime.output_dir, exist_ok=True)
        self.wandb = None
        if cfg.logger.wandb:
            self.wandb = _init_wandb(cfg, runtime)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if step % self.cfg.logger.console_every == 0 or step == self.cfg.num_steps - 1:
            print(format_line(step, self.cfg.num_steps, metrics), flush=True)
        if "eval/reward_mean" in metrics:  # every evaluation, whatever console_every says
            print(format_eval(step, metrics), flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _init_wandb(cfg: Config, runtime: Runtime):
    try:
        import wandb  # start-up cost: only logger=wandb needs it (an install may also leave it out)
    except ImportError as e:
        raise ImportError("logger=wandb needs the wandb package: pip install wandb "
                          "(or use logger=console)") from e
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    tags = [f"{g}={getattr(cfg, g).name}" for g in ("model", "rollout", "transfer", "weights",
                                                     "task", "cluster")]
    run = wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, name=runtime.run_id,
                     dir=runtime.output_dir, mode=mode, tags=tags,
                     config=dataclasses.asdict(cfg))
    logger.info("W&B %s run %s in %s", mode, runtime.run_id, run.dir)
    return run


def _plain(v):
    v = float(v)
    return v if math.isfinite(v) else str(v)


def format_line(step: int, num_steps: int, m: dict[str, float]) -> str:
    def g(k: str, fmt: str) -> str:
        return format(m[k], fmt) if k in m else "-"

    return (f"step {step + 1}/{num_steps} | reward {g('rollout/reward_mean', '.3f')} "
            f"| len {g('rollout/response_len_mean', '.1f')} | loss {g('train/loss', '+.4f')} "
            f"| grad {g('train/grad_norm', '.2f')} | {g('perf/step_time', '.2f')}s "
            f"(rollout {g('perf/rollout_time', '.2f')}, train {g('perf/train_time', '.2f')}, "
            f"sync {g('perf/update_weights_time', '.2f')}) "
            f"| put {g('transfer/put_ms', '.1f')}ms get {g('transfer/get_ms', '.1f')}ms"
            + (f" | stale<={g('async/staleness_max', '.0f')} dropped {g('async/dropped_samples', '.0f')} "
               f"queued {g('async/queue_depth', '.0f')}" if "async/queue_depth" in m else ""))


def format_eval(step: int, m: dict[str, float]) -> str:
    passes = " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(m.items())
                      if k.startswith("eval/pass@"))
    return (f"eval after step {step + 1}: reward {m['eval/reward_mean']:.3f} {passes} "
            f"| len {m['eval/response_len_mean']:.1f} | {m['eval/time']:.2f}s")
