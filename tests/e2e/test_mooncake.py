"""A local Mooncake master (``transfer=mooncake_tcp`` without an address) stopped with the
run, and one killed mid-run: the driver's watchdog stops the run within 30 s with an error
naming the store, and nothing is left running."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.support.procs import pids_with, read_until, running
from tests.support.runs import assert_nothing_left, engine_ports, read_metrics, train

SMALL = ["rollout.prompts_per_step=8", "logger=console"]

pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs connect to one `ray start --head`


def test_killed_master_stops_the_run_with_an_error_naming_the_store(tmp_path):
    with running("train.py", "transfer=mooncake_tcp", "num_steps=10000", *SMALL,
                 f"output_dir={tmp_path}") as proc:
        out = read_until(proc, "step 2/")
        pid = int(re.search(r"local master \(pid (\d+)\)", out).group(1))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest, _ = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    # the driver's watchdog names the master (a client's RPC alone gave up after 26.5 s)
    assert "the run stopped: the Mooncake store's master at 127.0.0.1:" in rest, rest[-3000:]
    assert elapsed < 30
    assert_nothing_left(engine_ports(out))


def test_train_py_with_a_local_master(tmp_path):
    proc = train("transfer=mooncake_tcp", "num_steps=2", *SMALL,
                 f"output_dir={tmp_path}")
    m = re.search(r"started a local master \(pid (\d+)\) at ([\d.]+):(\d+)", proc.stdout)
    assert m, proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    # a healthy run says nothing at error level: no logger's ERROR, no glog E-line (Mooncake's)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if re.search(r"\d\d:\d\d:\d\d ERROR |(^|\s)E\d{4} \d\d:\d\d", line)]
    assert errors == [], errors
    assert pids_with(f"-rpc_port={m.group(3)}") == []  # stopped with the run
    assert_nothing_left(engine_ports(proc.stdout))
