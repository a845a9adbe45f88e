"""train_async.py (one-step off-policy): generation of batch N+1 overlaps training of N,
no sample is staler than one version, every sample is trained once, no key is left."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_e2e import REQUIRED, assert_nothing_left, engine_ports, read_metrics
from transfer.data.mooncake_master import MooncakeMaster


def train_async(*overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "train_async.py", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.parametrize("transfer,weights", [("mooncake_tcp", "p2p")])
def test_one_step_off_policy_overlaps_and_accounts_for_every_sample(tmp_path, transfer, weights):
    extra = []
    master = None
    if transfer == "mooncake_tcp":
        master = MooncakeMaster("127.0.0.1", log_path=str(tmp_path / "master.log")).start()
        extra = [f"transfer.master_server_address={master.address}",
                 f"transfer.metadata_server={master.metadata_server}"]
    try:
        steps = 3
        proc = train_async(f"transfer={transfer}", f"weights={weights}", f"num_steps={steps}",
                           "rollout.prompts_per_step=8", "logger=console", "checkpoint.every=0",
                           f"output_dir={tmp_path}", *extra)
        rows = read_metrics(tmp_path)
        assert [r["step"] for r in rows] == list(range(steps))
        for r in rows:
            assert all(k in r for k in REQUIRED + ["perf/wait_time_ratio", "async/staleness_max"])
        for prev, cur in zip(rows, rows[1:]):
            # batch N+1 was being generated while batch N was being trained on
            assert cur["rollout/started_at"] < prev["train/finished_at"]
            assert cur["rollout/finished_at"] > prev["train/started_at"]
        assert rows[0]["async/staleness_max"] == 0  # the first batch comes from the start weights
        assert all(r["async/staleness_max"] == 1 for r in rows[1:])  # then one version behind
        # every generated sample was trained once: each step's batch is complete
        assert all(r["transfer/bytes"] > 0 for r in rows)
        if master is not None:
            assert master.keys() == []
        assert_nothing_left(engine_ports(proc.stdout))
    finally:
        if master is not None:
            master.stop()
