"""Sizes in bytes written the way people write them (``"512mb"``, ``"2gb"``, ``1048576``).

In the transfer layer because both layers read sizes: the Mooncake bootstrap here, the
config schema in ``rl.config`` (which re-exports ``parse_size``).
"""

from __future__ import annotations

import re
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.I)
_UNITS = {None: 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: Any, field_name: str) -> int:
    """``"512mb"``/``"2gb"``/``1048576`` -> bytes (binary units). Raises a ValueError naming the field."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r} is not a size; use bytes or e.g. '512mb', '2gb'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(f"{field_name}={value!r} is not a size; use bytes or e.g. '512mb', '2gb'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None])
    if n < 0:
        raise ValueError(f"{field_name}={value!r} must not be negative")
    return n


def human_size(n: int) -> str:
    """Bytes -> the smallest whole ``gb``/``mb``/``kb`` count that holds them (rounded up)."""
    for unit, size in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= size:
            return f"{-(-n // size)}{unit}"
    return str(n)
