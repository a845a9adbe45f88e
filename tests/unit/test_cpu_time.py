"""The CPU table that ``make test`` prints (tests/support/cpu_time.py), from a pytest run of its own."""

from __future__ import annotations

import os

import pytest

from tests.support.cpu_time import read_cpu

pytest_plugins = ["pytester"]


@pytest.mark.skipif(read_cpu() is None, reason="no /proc/stat (not Linux)")
def test_the_table_counts_each_files_tests_and_the_cpu_they_used(pytester):
    pytester.makepyfile(
        test_spin="""
            import time
            def test_spin():  # about 0.4 CPU seconds of this process alone
                t0 = time.process_time()
                while time.process_time() - t0 < 0.4:
                    pass
            def test_wait():
                time.sleep(0.3)
        """,
        test_other="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "tests.support.cpu_time")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "CPU time by test file" in out
    rows = {line.split()[-1]: line.split() for line in out.splitlines()
            if line.endswith(("test_spin.py", "test_other.py", " all"))}
    wall, busy, idle, _, tests = rows["test_spin.py"][:5]
    assert int(tests) == 2 and float(wall) >= 0.7
    assert float(busy) >= 0.35  # machine-wide: at least what the spinning test used
    assert float(idle) >= 0.0
    assert int(rows["test_other.py"][4]) == 1
    assert int(rows["all"][4]) == 3
    assert f"busy CPU / {os.cpu_count()} cores" in out


def test_without_proc_stat_there_is_nothing_to_read(tmp_path):
    assert read_cpu(str(tmp_path / "stat")) is None
    (tmp_path / "stat").write_text("cpu  100 0 50 800 20 0 0 0 0 0\ncpu0 100 0 50 800 20 0 0 0 0 0\n")
    busy, idle = read_cpu(str(tmp_path / "stat"))
    tick = os.sysconf("SC_CLK_TCK")
    assert busy == pytest.approx(150 / tick) and idle == pytest.approx(820 / tick)
