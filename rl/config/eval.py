"""``eval``: evaluation on a fixed set of prompts during training (a plain field of the root
config, not a group: there is one kind)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 20
    """Evaluate every this many steps and after the last one (0 = never)."""
    num_prompts: int = 32
    """Held-out prompts per evaluation (the same ones every time)."""
    n_samples: int = 4
    """Answers per prompt; ``eval/pass@<n_samples>`` counts a prompt solved when one of them
    earns full reward."""
    greedy: bool = False
    """Temperature 0 (every answer of a prompt the same) instead of the rollout's sampling."""
    path: Optional[str] = None
    """A JSONL file of held-out ``{"prompt": ..., "label": ...}`` lines, scored by the task's
    reward; unset = the task's own prompt stream under another seed (a built-in task draws
    prompts of the kind it trains on, not held out: the small built-in tasks have few
    prompts, which training sees too, and a JSONL task draws from its own file; set this to
    hold prompts out)."""
    seed_offset: int = 1_000_003
    """Added to ``task.seed`` for the evaluation's stream when ``path`` is unset."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every={self.every} must be >= 0 (0 = no evaluation)")
        if self.num_prompts < 1 or self.n_samples < 1:
            raise ValueError(f"eval.num_prompts={self.num_prompts} and eval.n_samples={self.n_samples} "
                             "must be >= 1")
        if self.path is not None and not os.path.isfile(os.path.expanduser(self.path)):
            raise ValueError(f"eval.path={self.path!r} does not exist (a JSONL file of "
                             '{"prompt": ..., "label": ...} lines)')


def eval_due(cfg, step: int) -> bool:
    """Evaluate after ``step`` steps: every ``eval.every`` and after the last step."""
    every = cfg.eval.every
    return bool(every) and (step % every == 0 or step == cfg.num_steps)
