"""A module imported on first use.

The driver imports the role classes (``Learner``, ``RolloutManager``) only to make them Ray
actors, and the rollout manager needs the GRPO advantages but none of the loss math: with
torch loaded where it is used, neither process pays for importing it
(``tests/integration/test_config_algo.py`` checks that they do not).
A function that needs a heavy module once imports it in its body (``rl.learner.checkpoint``);
a module that uses torch throughout binds it here, once.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module ``name``; the first attribute read imports it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr == "_name":  # pickle's and copy's probes import nothing
            raise AttributeError(attr)
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads are plain attribute reads
        return value

    def __reduce__(self) -> tuple:
        return LazyModule, (self._name,)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
