"""User prompts from a JSONL file (``{"prompt": ..., "label": ...}`` per line), reshuffled
every epoch, scored by a reward function named with ``_target_``."""

from __future__ import annotations

import json
import random
from typing import Any

from hydra.utils import get_method

from rl.tasks import Prompt


class JsonlTask:
    def __init__(self, path: str, reward: dict[str, Any], seed: int = 0) -> None:
        self.rows = read_rows(path)
        kwargs = {k: v for k, v in reward.items() if k != "_target_"}
        fn = get_method(reward["_target_"])
        self._reward = lambda response, label: float(fn(response, label, **kwargs))
        self.seed = seed
        self.position = 0

    def next_prompts(self, n: int) -> list[Prompt]:
        out = []
        size = len(self.rows)
        for i in range(self.position, self.position + n):
            epoch, offset = divmod(i, size)
            order = list(range(size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            prompt, label = self.rows[order[offset]]
            out.append(Prompt(text=prompt, label=label, index=i))
        self.position += n
        return out

    def reward(self, response: str, label: str, finished: bool) -> float:
        return self._reward(response, label) if finished else 0.0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def read_rows(path: str) -> list[tuple[str, str]]:
    """Every ``(prompt, label)`` of a JSONL file, blank lines skipped. The one parser of the
    format: the driver runs it to check the file before any worker starts (``task.path``),
    the rollout manager to load it. A ValueError names the file, the line and what is wrong."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e})") from None
            if line.strip():
                rows.append(_parse_row(line, where))
    if not rows:
        raise ValueError(f"{path} holds no prompts (the file is empty or blank); write one "
                         f"{_SHAPE} per line")
    return rows


_SHAPE = '{"prompt": "...", "label": "..."}'


def _parse_row(line: str, where: str) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); expected {_SHAPE}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object {_SHAPE}, got a {type(row).__name__}")
    for key in ("prompt", "label"):
        if key not in row:
            raise ValueError(f"{where}: missing {key!r}; expected {_SHAPE}")
    prompt, label = row["prompt"], row["label"]
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__} {prompt!r}")
    if not prompt:
        raise ValueError(f"{where}: 'prompt' is empty")
    # A number is a fine label (an answer such as 42): rewards compare text, so it becomes one.
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ValueError(f"{where}: 'label' must be a string or a number, got "
                         f"{type(label).__name__} {label!r}")
    return prompt, str(label)
