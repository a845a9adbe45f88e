"""A run's end is bounded (``rl.driver.bounds``): a process stuck in its stop
(``exit_if_longer``, around ``Cluster.__exit__`` and the logger's close) or in its exit
(``exit_after``, armed by ``exit_on_interrupt`` once ``main`` returns: ``atexit`` handlers,
joins of non-daemon threads) exits with status 1 and every thread's stack; one that leaves
the stop in time runs on, past the bound, untouched, and one that exits in time exits with
its own status."""

from __future__ import annotations

import subprocess
import sys

from tests.support.env import REPO

STOP = """
import sys, time
from rl.driver.bounds import exit_if_longer
bound = float(sys.argv[1])

def stuck_in_stop():
    time.sleep(60)

with exit_if_longer(bound):
    with exit_if_longer(100):  # nested: the outer bound holds
        if sys.argv[2] == "stuck":
            stuck_in_stop()
print("left the block", flush=True)
time.sleep(bound + 1)  # past the bound: it was cancelled
print("done", flush=True)
"""

EXIT = """
import atexit, sys, threading, time
from rl.driver.run import exit_on_interrupt
bound, how = float(sys.argv[1]), sys.argv[2]

def stuck_at_exit():
    time.sleep(60)

def main():
    if how == "atexit":
        atexit.register(stuck_at_exit)
    elif how == "thread":  # a non-daemon thread: interpreter exit joins it
        threading.Thread(target=stuck_at_exit, name="left-behind").start()
    elif how == "interrupt":
        raise KeyboardInterrupt
    print("main returned", flush=True)

exit_on_interrupt(main, exit_bound_s=bound)
"""


def _run(script: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, "1", how], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_a_stop_stuck_past_its_bound_exits_with_every_threads_stack():
    stuck = _run(STOP, "stuck")
    assert stuck.returncode == 1, stuck.stderr[-2000:]
    assert "Timeout (0:00:01)!" in stuck.stderr and "stuck_in_stop" in stuck.stderr
    assert "left the block" not in stuck.stdout


def test_a_stop_done_in_time_leaves_the_process_running():
    quick = _run(STOP, "quick")
    assert quick.returncode == 0, quick.stderr[-2000:]
    assert quick.stdout.split() == ["left", "the", "block", "done"]


def test_an_exit_stuck_past_its_bound_ends_with_every_threads_stack():
    for how in ("atexit", "thread"):
        stuck = _run(EXIT, how)
        assert stuck.returncode == 1, (how, stuck.stderr[-2000:])
        assert stuck.stdout.split() == ["main", "returned"]
        assert "Timeout (0:00:01)!" in stuck.stderr and "stuck_at_exit" in stuck.stderr, how


def test_an_exit_in_time_keeps_its_status():
    assert _run(EXIT, "quick").returncode == 0
    interrupted = _run(EXIT, "interrupt")
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]
    assert "Timeout" not in interrupted.stderr
