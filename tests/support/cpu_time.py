"""A pytest plugin (``-p tests.support.cpu_time``, on in ``make test`` and ``make test-e2e``):
where the suite's time goes in CPU, next to pytest's durations table.

For each test file it sums, over its tests (setup, call and teardown), the wall time and the
machine's busy and idle CPU time read from ``/proc/stat``. The CPU counters are machine-wide:
they count every process a test starts (engines, learner ranks, Ray) and anything else the
machine runs meanwhile. The closing line divides the suite's busy CPU time by the cores: the
wall time that work needs even if no core ever waits, so it tells whether waiting or
computing is what makes the suite long. Without ``/proc/stat`` (not Linux) it prints nothing.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

PROC_STAT = "/proc/stat"


def read_cpu(path: str = PROC_STAT) -> tuple[float, float] | None:
    """(busy, idle) CPU seconds since boot, all cores together; None without ``path``."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick


class CpuTime:
    def __init__(self) -> None:
        self.files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        """file -> [tests, wall s, busy CPU s, idle CPU s]"""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, t0 = read_cpu(), time.monotonic()
        yield
        after, wall = read_cpu(), time.monotonic() - t0
        if before is None or after is None:
            return
        row = self.files[item.nodeid.split("::")[0]]
        row[0] += 1
        row[1] += wall
        row[2] += after[0] - before[0]
        row[3] += after[1] - before[1]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.files:
            return
        tr = terminalreporter
        tr.write_sep("=", "CPU time by test file (machine-wide, /proc/stat)")
        tr.write_line(f"{'wall s':>8} {'busy CPU s':>11} {'idle CPU s':>11} {'idle':>5} {'tests':>5}  file")
        for name, (n, wall, busy, idle) in sorted(self.files.items(), key=lambda kv: -kv[1][1]):
            tr.write_line(f"{wall:8.1f} {busy:11.1f} {idle:11.1f} {_share(idle, busy):>5} {n:5d}  {name}")
        n, wall, busy, idle = (sum(row[i] for row in self.files.values()) for i in range(4))
        tr.write_line(f"{wall:8.1f} {busy:11.1f} {idle:11.1f} {_share(idle, busy):>5} {n:5d}  all")
        cores = os.cpu_count() or 1
        tr.write_line(f"busy CPU / {cores} cores = {busy / cores:.0f} s: the least wall time this "
                      f"work needs with every core always busy ({wall:.0f} s taken)")


def _share(idle: float, busy: float) -> str:
    return f"{idle / (idle + busy):.0%}" if idle + busy > 0 else "-"


def pytest_configure(config):
    config.pluginmanager.register(CpuTime(), "cpu_time_table")
