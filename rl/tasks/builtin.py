"""Built-in verifiable tasks: prompts and graded rewards produced in code.

All give 0 reward when no end-of-sequence token was sampled: with partial credit for
unfinished answers the policy never learns to stop (measured on the tiny model: stuck at
0.5-0.8 reward).
"""

from __future__ import annotations

import random
import re
import string

from rl.tasks import Prompt


class _StreamTask:
    """A stream of prompts where prompt ``i`` depends only on (seed, i): resumable by position."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.position = 0

    def make(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def next_prompts(self, n: int) -> list[Prompt]:
        out = []
        for i in range(self.position, self.position + n):
            text, label = self.make(random.Random(self.seed * 1_000_003 + i))
            out.append(Prompt(text=text, label=label, index=i))
        self.position += n
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class RepeatLetterTask(_StreamTask):
    """``c:`` -> ``cccc``. Reward: right characters over the longer of answer and target."""

    def __init__(self, repeat: int = 4, seed: int = 0) -> None:
        super().__init__(seed)
        self.repeat = repeat

    def make(self, rng: random.Random) -> tuple[str, str]:
        letter = rng.choice(string.ascii_lowercase)
        return f"{letter}:", letter * self.repeat

    def reward(self, response: str, label: str, finished: bool) -> float:
        return char_credit(response, label) if finished else 0.0


class RepeatCountTask(_StreamTask):
    """``c7:`` -> ``ccccccc``: the prompt names the letter and how many, from ``min_repeat`` to
    ``max_repeat`` (uniform), so answer lengths vary from prompt to prompt (one token per
    letter with the tiny model's tokenizer). Reward: as ``RepeatLetterTask``."""

    def __init__(self, min_repeat: int = 1, max_repeat: int = 40, seed: int = 0) -> None:
        super().__init__(seed)
        self.min_repeat, self.max_repeat = min_repeat, max_repeat

    def make(self, rng: random.Random) -> tuple[str, str]:
        letter = rng.choice(string.ascii_lowercase)
        count = rng.randint(self.min_repeat, self.max_repeat)
        return f"{letter}{count}:", letter * count

    def reward(self, response: str, label: str, finished: bool) -> float:
        return char_credit(response, label) if finished else 0.0


def char_credit(response: str, label: str) -> float:
    """Right characters (position by position) over the longer of answer and target: a
    response too short or too long loses credit for every missing or extra character."""
    hits = sum(a == b for a, b in zip(response, label))
    return hits / max(len(response), len(label), 1)


class AdditionTask(_StreamTask):
    """``12+34=`` -> ``46``. Reward: right digits (aligned from the right) over the longer length."""

    def __init__(self, max_value: int = 99, seed: int = 0) -> None:
        super().__init__(seed)
        self.max_value = max_value

    def make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return f"{a}+{b}=", str(a + b)

    def reward(self, response: str, label: str, finished: bool) -> float:
        if not finished:
            return 0.0
        hits = sum(a == b for a, b in zip(reversed(response), reversed(label)))
        return hits / max(len(response), len(label))


CALCULATOR_CALL_END = "="
"""Ends a calculator call: the model writes ``12+34=`` and the environment appends ``46 ``."""
_CALL = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """The calculator tool: ``a+b``, ``a-b`` or ``a*b`` of integers (the text of a call,
    before ``=``) -> the result's digits; anything else -> ``error``."""
    m = _CALL.match(expression)
    if m is None:
        return "error"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


class CalculatorTask(_StreamTask):
    """Tool use: ``sum 12 34:`` -> the model calls the calculator (``12+34=``), reads its
    result (``46 ``, appended by the environment: ``rl.rollout.functions.calculator_tool``)
    and answers ``46``. Reward: 1 when the final answer (the text after the last tool result)
    is the sum and ended with an end-of-sequence token, else 0."""

    def __init__(self, max_value: int = 99, seed: int = 0) -> None:
        super().__init__(seed)
        self.max_value = max_value

    def make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return f"sum {a} {b}:", str(a + b)

    def reward(self, response: str, label: str, finished: bool) -> float:
        return float(finished and response.strip() == label)
