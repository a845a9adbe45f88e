"""A run's stop has a bound of its own (``rl.driver.watchdog.exit_if_longer``, around
``Cluster.__exit__``): a process stuck inside it exits with status 1 and every thread's
stack; one that leaves it in time runs on, past the bound, untouched."""

from __future__ import annotations

import subprocess
import sys

from tests.support.env import REPO

SCRIPT = """
import sys, time
from rl.driver.watchdog import exit_if_longer
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


def _run(how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, "1", how], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_a_stop_stuck_past_its_bound_exits_with_every_threads_stack():
    stuck = _run("stuck")
    assert stuck.returncode == 1, stuck.stderr[-2000:]
    assert "Timeout (0:00:01)!" in stuck.stderr and "stuck_in_stop" in stuck.stderr
    assert "left the block" not in stuck.stdout


def test_a_stop_done_in_time_leaves_the_process_running():
    quick = _run("quick")
    assert quick.returncode == 0, quick.stderr[-2000:]
    assert quick.stdout.split() == ["left", "the", "block", "done"]
