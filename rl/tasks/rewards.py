"""Reward functions for JSONL tasks, chosen with ``task.reward._target_``.

Signature: ``f(response: str, label: str, **kwargs) -> float``. A response that never
sampled an end-of-sequence token gets 0 before these are called (see ``JsonlTask``).
"""

from __future__ import annotations

import re


def exact_match(response: str, label: str) -> float:
    """1.0 when the stripped response equals the stripped label."""
    return float(response.strip() == label.strip())


def char_overlap(response: str, label: str) -> float:
    """Position-wise character matches over the longer of the two (partial credit)."""
    response, label = response.strip(), label.strip()
    if not response and not label:
        return 1.0
    hits = sum(a == b for a, b in zip(response, label))
    return hits / max(len(response), len(label))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def math_answer(response: str, label: str) -> float:
    """1.0 when the last number in the response (after '####' if present) equals the label's."""
    def last_number(text: str) -> str | None:
        text = text.split("####")[-1]
        found = _NUMBER.findall(text)
        return found[-1].replace(",", "").rstrip(".") if found else None

    got, want = last_number(response), last_number(label)
    if got is None or want is None:
        return 0.0
    try:
        return float(abs(float(got) - float(want)) < 1e-6)
    except ValueError:
        return 0.0
