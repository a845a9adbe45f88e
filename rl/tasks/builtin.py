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
CALCULATOR_RESULT_END = " "
"""Follows the tool's result in what the environment appends (``46 ``); the model answers after it.
Other layouts learnt no better (docs/rollout.md, "Over seeds")."""
CALCULATOR_MAX_CALLS = 1
"""Tool calls a calculator sample may make; the turn after the last one gets no stop string."""
_CALL = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """The calculator tool: ``a+b``, ``a-b`` or ``a*b`` of integers (the text of a call,
    before ``=``) -> the result's digits; anything else -> ``error``."""
    m = _CALL.match(expression)
    if m is None:
        return "error"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def calculator_transcript(calls: list[tuple[str, str]], answer: str) -> str:
    """A tool-use sample as text: each call's expression, ``=``, the tool's result and a space,
    then the answer: ``12+34=46 46``. What ``calculator_tool`` gives the reward to score."""
    end, sep = CALCULATOR_CALL_END, CALCULATOR_RESULT_END
    return "".join(f"{expr}{end}{result}{sep}" for expr, result in calls) + answer


def parse_calculator_transcript(text: str) -> tuple[list[tuple[str, str]], str]:
    """``calculator_transcript`` read back: the calls (expression, result) and the answer. A
    call's text holds no ``=`` (it is the stop string) and a result no space, so the reading is
    unambiguous."""
    calls, rest = [], text
    while len(calls) < CALCULATOR_MAX_CALLS and CALCULATOR_CALL_END in rest:
        expr, _, after = rest.partition(CALCULATOR_CALL_END)
        result, _, rest = after.partition(CALCULATOR_RESULT_END)
        calls.append((expr, result))
    return calls, rest


def calculator_dump_stats(samples: list[dict]) -> dict[str, float]:
    """What a step's dumped calculator samples (``rollout.dump_every``) show: the fraction
    whose transcript holds a call; of the calls' operands, the fraction right (the first two; a call
    without ``+`` has both wrong); of the finished answers after a call, the fraction that copy
    the tool's result and the fraction that repeat the call's second operand (the usual wrong
    copy); of the finished answers after a call that gave the sum, the fraction that copy it;
    and the fraction of groups (a step's prompt) with such a call, where
    ``task.copy_credit_fade`` turns the copy credit off. Read from the transcripts, so a group
    dropped from the loss counts like any other."""
    calls, operands, copied, second, sum_copied = 0, [], [], [], []
    groups: dict[tuple, bool] = {}
    for d in samples:
        key = (d.get("step"), d["prompt_index"])
        groups.setdefault(key, False)
        found, answer = parse_calculator_transcript(d["scored_text"])
        if not found:
            continue
        calls += 1
        (expr, result), want = found[0], d["label"].split("+")
        got = expr.split("+")
        operands += [x == y for x, y in zip(got, want)] if len(got) > 1 else [False, False]
        if d["finished"]:
            copied.append(answer.strip() == result)
            second.append(len(got) > 1 and answer.strip() == got[1])
            if result == calculator(d["label"]):
                sum_copied.append(answer.strip() == result)
                groups[key] = True

    def mean(xs: list[bool]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {"calls": calls / len(samples), "operands_right": mean(operands),
            "answers_copied": mean(copied), "answers_second_operand": mean(second),
            "sum_answers_copied": mean(sum_copied), "groups_with_sum": mean(list(groups.values()))}


class CalculatorTask(_StreamTask):
    """Tool use: ``12+34:`` -> the model calls the calculator (``12+34=``), reads its result
    (``46`` and a space, appended by the environment: ``rl.rollout.functions.calculator_tool``) and
    answers ``46``. The label is the call, ``12+34``. The reward scores the transcript
    (``calculator_transcript``), 0 without an end-of-sequence token or without a call: a call
    the calculator reads earns 0.2 and 0.15 for each right operand (one it cannot read, a
    fifth of its right characters), the answer half its right characters against the sum when
    the call's result was the sum (with ``copy_credit``, also ``copy_credit`` times its right
    characters against the tool's result after a sum with one right operand; with
    ``copy_credit_fade``, only in a group where no call gave the sum: ``group_reward``). 1 for the right
    call and answer; the partial credit is what lets a model that has never seen a call learn
    to make one (docs/rollout.md)."""

    def __init__(self, max_value: int = 4, seed: int = 0, copy_credit: float = 0.0,
                 copy_credit_fade: bool = False) -> None:
        super().__init__(seed)
        self.max_value = max_value
        self.copy_credit = copy_credit
        self.copy_credit_fade = copy_credit_fade

    def make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return f"{a}+{b}:", f"{a}+{b}"

    def reward(self, response: str, label: str, finished: bool) -> float:
        return self._reward(response, label, finished, self.copy_credit)

    def group_reward(self, responses: list[str], label: str, finished: list[bool]) -> list[float]:
        """The rewards of one prompt's samples: each its ``reward``, but with
        ``copy_credit_fade`` the copy credit counts only in a group where no sample's call
        gave the sum, so that within a group (all GRPO compares) a right call always
        outscores a call with one operand wrong."""
        if self.copy_credit_fade and any(self._right_call(r, label, f) for r, f in zip(responses, finished)):
            return [self._reward(r, label, f, 0.0) for r, f in zip(responses, finished)]
        return [self.reward(r, label, f) for r, f in zip(responses, finished)]

    @staticmethod
    def _right_call(response: str, label: str, finished: bool) -> bool:
        calls, _ = parse_calculator_transcript(response)
        return finished and bool(calls) and calls[0][1] == calculator(label)

    def turn_rewards(self, response: str, label: str, finished: bool, turns: int) -> list[float]:
        """One reward a model turn, for what that turn did (``algo.turn_credit``). A call and
        its answer (two turns): the call earns its credit as in ``reward`` (0.2, and 0.15 a
        right operand, whatever the operator: ``3-2`` for ``3+2`` earns 0.5, as the right call
        does; counting operands only in a sum learnt less, docs/rollout.md "Over seeds"); the
        answer 0.5 for ending (the end-of-sequence token) and half its right characters against
        the tool's result, whatever the call was: getting the sum is the call's part, copying the
        result the answer's. An answer alone (no call): its ``reward`` (0). A call left without
        room to answer: its credit alone. Unfinished: the answer turn earns 0. ``copy_credit``
        plays no part."""
        calls, answer = parse_calculator_transcript(response)
        if not calls and turns <= 1:
            return [self.reward(response, label, finished)][:turns]
        if not calls or turns > 2:
            raise ValueError(f"a calculator sample of {turns} model turn(s) with {len(calls)} call(s): "
                             f"{response!r}; a call and an answer, or an answer alone")
        (call, result), m = calls[0], _CALL.match(calls[0][0])
        call_credit = self._call_credit(call, label, m)  # the operator unchecked: docs/algo.md
        if turns == 1:  # the tool's result filled the budget
            return [call_credit]
        copied = 0.0 if m is None else char_credit(answer.strip(), result)
        return [call_credit, 0.5 + 0.5 * copied if finished else 0.0]

    @staticmethod
    def _call_credit(call: str, label: str, m: re.Match | None) -> float:
        """0.2 and 0.15 a right operand for a call the calculator reads (``m``, its match); a
        fifth of its right characters for one it cannot."""
        if m is None:
            return 0.2 * char_credit(call.strip(), label)
        a, b = label.split("+")
        return 0.2 + 0.15 * ((m.group(1) == a) + (m.group(3) == b))

    @staticmethod
    def _reward(response: str, label: str, finished: bool, copy_credit: float) -> float:
        if not finished:
            return 0.0
        calls, answer = parse_calculator_transcript(response)
        if not calls:
            return 0.0
        (call, result), want = calls[0], calculator(label)
        m, (a, b) = _CALL.match(call), label.split("+")
        call_credit = CalculatorTask._call_credit(call, label, m)
        if m is None:  # a call the calculator cannot read: credit for its right characters
            return call_credit
        right = (m.group(1) == a) + (m.group(3) == b)
        if result == want:
            return call_credit + 0.5 * char_credit(answer.strip(), want)
        if copy_credit and right == 1 and m.group(2) == "+":  # a sum with one operand right
            return call_credit + copy_credit * char_credit(answer.strip(), result)
        return call_credit
