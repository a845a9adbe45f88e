"""The CPU engine's real scheduler with its running batch held at a chosen step boundary."""

from __future__ import annotations

import threading

from rl.rollout.engines.scheduler import BatchScheduler


class Gated(BatchScheduler):
    """The real scheduler, whose running batch stops at its ``at``-th step boundary until
    the test lets it go (``go``): paused meanwhile, the pause lands after ``at`` tokens."""

    def __init__(self, *args, at: int, **kwargs) -> None:
        self.at, self.boundaries = at, 0
        self.reached, self.go = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def pause_mode(self):
        self.boundaries += 1
        if self.boundaries == self.at:
            self.reached.set()
            assert self.go.wait(30)
        return super().pause_mode()
