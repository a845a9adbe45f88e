"""``task`` group: where prompts come from and how responses are scored. The task itself is
built from its schema by ``rl.tasks.build.build_task``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig

from rl.config.checks import positive


@dataclass(kw_only=True)
class TaskConfig:
    _group = "task"
    name: str = MISSING
    """Task label."""
    seed: int = 0
    """Seed of the prompt stream."""


@dataclass(kw_only=True)
class RepeatLetterTaskConfig(TaskConfig):
    name: str = "repeat_letter"
    repeat: int = 4
    """How many times the letter must be repeated (``c:`` -> ``cccc``)."""

    def __post_init__(self) -> None:
        positive(self, "repeat")


@dataclass(kw_only=True)
class AdditionTaskConfig(TaskConfig):
    name: str = "addition"
    max_value: int = 99
    """Largest operand."""

    def __post_init__(self) -> None:
        positive(self, "max_value")


@dataclass(kw_only=True)
class JsonlTaskConfig(TaskConfig):
    name: str = "jsonl"
    path: str = MISSING
    """JSONL file of ``{"prompt": ..., "label": ...}`` lines."""
    reward: Any = field(default_factory=lambda: {"_target_": "rl.tasks.rewards.exact_match"})
    """Reward function: ``{_target_: module.function, **kwargs}``, called as f(response, label, **kwargs)."""

    def __post_init__(self) -> None:
        # the file and the function are checked by rl.tasks.build.check_task, before anything starts
        reward = dict(self.reward) if isinstance(self.reward, (dict, DictConfig)) else None
        if not reward or "_target_" not in reward:
            raise ValueError("task.reward needs a '_target_' naming a function, e.g. "
                             "{_target_: rl.tasks.rewards.exact_match}")
        self.reward = reward


SCHEMAS: dict[str, type] = {"repeat_letter": RepeatLetterTaskConfig, "addition": AdditionTaskConfig,
                            "jsonl": JsonlTaskConfig}
"""Schema of each task (``schema/task/<key>``)."""
