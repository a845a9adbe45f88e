"""Leaf checks shared by the group schemas; each error names the field as the user sets it."""

from __future__ import annotations

from typing import Any

from transfer.units import parse_size

__all__ = ["parse_size", "positive"]


def positive(obj: Any, *names: str) -> None:
    """Every named field of ``obj`` is > 0 (the message names ``<group>.<field>``)."""
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{_prefix(obj)}{name}={value} must be > 0")


def _prefix(obj: Any) -> str:
    return getattr(obj, "_group", "") and f"{obj._group}."
