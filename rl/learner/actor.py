"""The learner rank's Ray actor: the class the driver turns into an actor without loading torch.

``rl.learner.learner`` imports torch at the top (2.6 s of CPU, measured), and the driver,
which makes the actors, never uses torch: on a 2-core machine that import alone delayed every
run's start by 2 s. So the driver makes this class the actor, and the rank's own process
builds the ``Learner``. ``LearnerGroup`` (``rl.driver.learners``) calls the learner's methods
by name through ``call``, or runs a function on it through ``apply``.
"""

from __future__ import annotations

from typing import Any, Callable


class LearnerActor:
    def __init__(self, *args: Any) -> None:
        """``args``: ``Learner``'s (config, runtime, rank, world size)."""
        # start-up cost: torch loads in the learner's process only (see the module docstring)
        from rl.learner.learner import Learner

        self.learner = Learner(*args)

    def call(self, method: str, *args: Any) -> Any:
        """``learner.<method>(*args)``."""
        return getattr(self.learner, method)(*args)

    def apply(self, fn: Callable, *args: Any) -> Any:
        """``fn(learner, *args)``."""
        return fn(self.learner, *args)
