"""What the tests report when a run they start does not end (tests/support/runs.py): where
it waits, from its own stack, or which process it started holds its output open."""

from __future__ import annotations

import time

import pytest

from tests.support.procs import pids_with
from tests.support.runs import run_script

SLEEPER = "import time\ndef waits_here():\n    time.sleep(300)\nwaits_here()\n"
LEAVER = ("import subprocess, sys\n"  # a child that keeps the parent's stdout and stderr
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {tag}'])\n"
          "print('parent done', flush=True)\n")


def test_a_run_that_hangs_is_reported_with_its_stack(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with pytest.raises(AssertionError) as err:
        run_script(str(script), env={}, timeout=3)
    assert "still running after 3s" in str(err.value)
    assert "waits_here" in str(err.value)  # py-spy's view of the main thread
    assert not pids_with(str(script))


def test_output_held_open_after_the_run_exited_names_the_holder(tmp_path):
    tag = f"held-{time.monotonic_ns()}"
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER.format(tag=tag))
    with pytest.raises(AssertionError) as err:
        run_script(str(script), env={}, timeout=3)
    report = str(err.value)
    assert "exited (0), but after 3s its output is still held open by pid" in report
    assert tag in report and "parent done" in report
    assert not pids_with(tag)  # the holder was stopped
