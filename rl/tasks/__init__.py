"""Tasks: a deterministic, resumable stream of prompts plus a reward for each response.

Call order (the rollout manager)::

    prompts = task.next_prompts(n)                      # advances the data position
    r = task.reward(response_text, prompt.label, finished)   # finished = EOS was sampled
    state = task.state_dict(); task.load_state_dict(state)  # checkpoint / resume

A task whose reward scores each model turn of a multi-turn sample may define
``turn_rewards(response, label, finished, turns) -> list[float]`` (``turns`` its model turns,
a reward each), used for the advantages with ``algo.turn_credit`` (``CalculatorTask``).

A task whose reward compares one prompt's samples may also define
``group_reward(responses, label, finished) -> list[float]`` (``finished`` one flag a
response); the manager then scores each group with it instead of ``reward`` (``CalculatorTask``
with ``copy_credit_fade``).

A task is built from its ``task`` config by ``rl.tasks.build.build_task(cfg.task)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class Prompt:
    text: str
    """Prompt text as the model sees it (before any chat template)."""
    label: str
    """What the reward compares the response with."""
    index: int
    """Position of the prompt in the task's stream (its group id)."""


class Task(Protocol):
    def next_prompts(self, n: int) -> list[Prompt]: ...

    def reward(self, response: str, label: str, finished: bool) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


GroupReward = Callable[[list[str], str, list[bool]], list[float]]


def group_reward(task: Task) -> GroupReward | None:
    """The task's ``group_reward`` (it scores one prompt's samples together), or None for a
    task that scores each sample alone."""
    return getattr(task, "group_reward", None)


TurnRewards = Callable[[str, str, bool, int], list[float]]


def turn_rewards(task: Task) -> TurnRewards | None:
    """The task's ``turn_rewards(response, label, finished, turns)`` (one reward a model turn,
    for ``algo.turn_credit``), or None for a task that scores the answer as a whole."""
    return getattr(task, "turn_rewards", None)
