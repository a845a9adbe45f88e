"""``task`` group: where prompts come from and how responses are scored. The task itself is
built from its schema by ``rl.tasks.build.build_task``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from omegaconf import MISSING, DictConfig

from rl.config.checks import positive
from rl.config.rollout import DEFAULT_ROLLOUT_FUNCTION

if TYPE_CHECKING:
    from rl.config.algo import AlgoConfig
    from rl.config.rollout import RolloutConfig


@dataclass(kw_only=True)
class TaskConfig:
    _group = "task"
    name: str = MISSING
    """Task label."""
    seed: int = 0
    """Seed of the prompt stream."""

    scores_turns: ClassVar[bool] = False
    """Whether the task's reward scores each model turn (``turn_rewards``, ``algo.turn_credit``)."""

    def check_rollout(self, rollout: "RolloutConfig") -> None:
        """Cross-check with the sampling settings (called by the root config): what this
        task's answers need of ``rollout.max_new_tokens``."""

    def max_label_bytes(self) -> int:
        """An upper bound of a label's UTF-8 bytes, for the stores' capacity estimate (a JSONL
        task's is read from its file: ``rl.tasks.build.max_label_bytes``)."""
        return 256

    def check_algo(self, algo: "AlgoConfig") -> None:
        """Cross-check with the algorithm (called by the root config)."""
        if algo.turn_credit and not self.scores_turns:
            raise ValueError(f"algo.turn_credit=true needs a task that scores each model turn; "
                             f"task={self.name} scores the answer as a whole (task=calculator scores turns)")


@dataclass(kw_only=True)
class RepeatLetterTaskConfig(TaskConfig):
    name: str = "repeat_letter"
    repeat: int = 4
    """How many times the letter must be repeated (``c:`` -> ``cccc``)."""

    def __post_init__(self) -> None:
        positive(self, "repeat")

    def max_label_bytes(self) -> int:
        return self.repeat


@dataclass(kw_only=True)
class RepeatCountTaskConfig(TaskConfig):
    name: str = "repeat_count"
    min_repeat: int = 1
    """Shortest answer, in letters (``c1:`` -> ``c``)."""
    max_repeat: int = 40
    """Longest answer, in letters (``c40:`` -> 40 c's); lengths are drawn uniformly in between.
    ``rollout.max_new_tokens`` must hold it plus the end-of-sequence token."""

    def __post_init__(self) -> None:
        positive(self, "min_repeat")
        if self.max_repeat < self.min_repeat:
            raise ValueError(f"task.max_repeat={self.max_repeat} is below task.min_repeat="
                             f"{self.min_repeat}; raise it or lower task.min_repeat")

    def max_label_bytes(self) -> int:
        return self.max_repeat

    def check_rollout(self, rollout: "RolloutConfig") -> None:
        # One token per letter with the tiny model's tokenizer (more letters per token with
        # a BPE one, so this bound is safe there too), plus the end-of-sequence token that
        # earns any reward: a shorter budget leaves the longest answers unfinished, reward 0.
        need = self.max_repeat + 1
        if rollout.max_new_tokens < need:
            raise ValueError(f"task=repeat_count answers reach task.max_repeat={self.max_repeat} "
                             f"letters plus the end-of-sequence token; rollout.max_new_tokens="
                             f"{rollout.max_new_tokens} is too short: set rollout.max_new_tokens="
                             f"{need} (or more), or lower task.max_repeat")


@dataclass(kw_only=True)
class AdditionTaskConfig(TaskConfig):
    name: str = "addition"
    max_value: int = 99
    """Largest operand."""

    def __post_init__(self) -> None:
        positive(self, "max_value")

    def max_label_bytes(self) -> int:
        return len(str(2 * self.max_value))  # the sum


@dataclass(kw_only=True)
class CalculatorTaskConfig(TaskConfig):
    scores_turns: ClassVar[bool] = True
    name: str = "calculator"
    max_value: int = 4
    """Largest operand of the sum (4: sums of one digit; within 250 steps the tiny model on CPU
    learns to call the tool with most operands right and to copy the tool's result into its
    answer, reliably with ``algo.turn_credit=true``: docs/rollout.md, "Over seeds")."""
    copy_credit: float = 0.0
    """Reward for an answer that copies the tool's result after a sum with one right operand,
    times its right characters (0: none, the default; the answer of a right call earns 0.5).
    At 0.15 or more, such a call with a copied result outscores a right call with a wrong
    answer. Tried at 0.25 and 0.1, not adopted: docs/rollout.md, "Over seeds"."""
    copy_credit_fade: bool = False
    """Count ``copy_credit`` only in a prompt's group where no sample's call gave the sum
    (not adopted: docs/rollout.md, "Over seeds")."""

    def __post_init__(self) -> None:
        positive(self, "max_value")
        if not 0.0 <= self.copy_credit <= 0.5:
            raise ValueError(f"task.copy_credit={self.copy_credit} must be within [0, 0.5] (the answer "
                             f"of a right call earns 0.5)")
        if self.copy_credit_fade and not self.copy_credit:
            raise ValueError("task.copy_credit_fade=true fades task.copy_credit, which is 0: "
                             "set task.copy_credit as well (e.g. 0.25)")

    def max_label_bytes(self) -> int:
        return 2 * len(str(self.max_value)) + 1  # the call, ``a+b``

    def check_rollout(self, rollout: "RolloutConfig") -> None:
        # a call (``99+99=``), the tool's result and a space (``198 ``) and the answer
        # (``198``, EOS): 6 + 4 + 4 tokens with the tiny model's tokenizer
        if rollout.function == DEFAULT_ROLLOUT_FUNCTION:
            raise ValueError("task=calculator answers through a tool: set rollout.function="
                             "rl.rollout.functions:calculator_tool (or a tool-calling function of yours)")
        if rollout.max_new_tokens < 16:
            raise ValueError(f"task=calculator: rollout.max_new_tokens={rollout.max_new_tokens} bounds "
                             f"the call, the tool's result and the answer together; set "
                             f"rollout.max_new_tokens=16 (or more)")


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


SCHEMAS: dict[str, type] = {"repeat_letter": RepeatLetterTaskConfig, "repeat_count": RepeatCountTaskConfig,
                            "addition": AdditionTaskConfig, "calculator": CalculatorTaskConfig,
                            "jsonl": JsonlTaskConfig}
"""Schema of each task (``schema/task/<key>``)."""
