"""What the tests report when a run they start does not end (tests/support/runs.py): where
it waits, from its own stack, or which process it started holds its output open; a run's
limit ends before the test's own."""

from __future__ import annotations

import re
import time

import pytest

from tests.support.procs import pids_with
from tests.support.runs import REPORT_S, TEST_DEADLINE, run_script

SLEEPER = "import time\ndef waits_here():\n    time.sleep(300)\nwaits_here()\n"
LEAVER = ("import subprocess, sys\n"  # a child that keeps the parent's stdout and stderr
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {tag}'])\n"
          "print('parent done', flush=True)\n")


def test_a_run_that_hangs_is_reported_with_its_stack_before_the_tests_limit(tmp_path, monkeypatch):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    # the test's own limit falls in REPORT_S + 6 s: the run's 30 s are cut to 3
    monkeypatch.setitem(TEST_DEADLINE, "at", time.monotonic() + REPORT_S + 3)
    with pytest.raises(AssertionError) as err:
        run_script(str(script), env={}, timeout=30)
    report = str(err.value)
    assert re.search(r"still running after [23]s \(its 30s cut to end before the test's limit\)", report), \
        report[:500]
    assert not pids_with(str(script))
    if "Permission denied" in report or "Operation not permitted" in report:
        pytest.skip("py-spy may not read another process here (ptrace: root, or kernel.yama.ptrace_scope=0)")
    assert "waits_here" in report  # py-spy's view of the main thread


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


@pytest.mark.timeout(timeout=123)
def test_the_runs_limit_follows_the_tests_own():
    assert TEST_DEADLINE["at"] - time.monotonic() == pytest.approx(123, abs=10)
