"""Bounds on a run's end: a process that did its work must not then hang where nobody
watches it. Ray's disconnect joins its log threads and waits on the raylet without a bound,
a Mooncake client's close has none, and interpreter exit joins every non-daemon thread and
runs every ``atexit`` handler (Ray's and W&B's among them) without one either. Past a bound,
the process prints every thread's stack to stderr and exits with status 1 (``faulthandler``:
its own thread, so a C call that holds the interpreter cannot stop it). A process forked
(without exec) while a bound is armed must leave by ``os._exit``: ``faulthandler`` has no
reset after a fork, and the child's own cancel at exit would wait for a thread it lacks."""

from __future__ import annotations

import faulthandler
import logging
import sys
from contextlib import contextmanager

logger = logging.getLogger(__name__)

STOP_BOUND_S = 600.0
"""The entry points' bound on a run's stop (``Cluster.__exit__``), and, separately, on the
logger's close after it. The graceful closes have bounds of their own (the probes about 50 s, the
manager's and the learners' closes 60 s each, the engines' 30 s, Ray's removal of each
placement group 60 s); this one is for what has none (a Mooncake client's close, Ray's
disconnect, W&B's upload at ``finish``)."""
EXIT_BOUND_S = 120.0
"""The most an entry point's process may take to exit once its ``main`` has returned."""

_bounds = [0]  # exit_if_longer blocks open (one faulthandler timer per process)
_exiting = [False]  # exit_after armed: the exit's bound stays, blocks after it bound nothing


@contextmanager
def exit_if_longer(seconds: float | None):
    """Inside the block, a process that takes ``seconds`` exits with every thread's stack.
    Nested blocks share the outermost one's bound; None, no stderr to write to, or the
    exit's bound armed (``exit_after``), bounds nothing."""
    out = sys.__stderr__  # fd 2 itself: a replaced sys.stderr may have no file descriptor
    if seconds is None or out is None or _exiting[0]:
        yield
        return
    if _bounds[0] == 0 and not _arm(seconds, out, "a stop of the run"):
        yield
        return
    _bounds[0] += 1
    try:
        yield
    finally:
        _bounds[0] -= 1
        if _bounds[0] == 0 and not _exiting[0]:  # the exit's bound, once armed, stays
            faulthandler.cancel_dump_traceback_later()


def exit_after(seconds: float) -> None:
    """From here to the process's end: past ``seconds``, exit with every thread's stack. For
    the interpreter's exit (``atexit`` handlers, joins of non-daemon threads), which
    ``faulthandler`` outlives. Replaces any bound still open. Called in a ``finally``: a
    bound that cannot be armed (its thread not started) is logged, not raised over the
    outcome; with no stderr there is nothing to write the stacks to, and nothing is armed."""
    out = sys.__stderr__
    if out is not None and _arm(seconds, out, "the process's exit"):
        _exiting[0] = True


def _arm(seconds: float, out, what: str) -> bool:
    """Start the one timer; False, logged, when it cannot start (around a run's end: never
    raised over the run's own outcome)."""
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=out)
        return True
    except Exception as e:
        logger.warning("%s is not bounded: %s", what, e)
        return False
