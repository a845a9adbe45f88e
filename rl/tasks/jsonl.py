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
        self.rows = _read_rows(path)
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


def _read_rows(path: str) -> list[tuple[str, str]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((str(row["prompt"]), str(row["label"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"label\": ...}} "
                                 f"({e})") from None
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows
