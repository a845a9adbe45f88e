"""A weight sync on a real cluster whose engine dies mid-push fails within a bound, naming the
engine, and every rank leaves the push; bad weight settings are refused on the command line
before any worker starts. The bit-for-bit matrix of data and weight paths:
tests/e2e/test_weights.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rl.driver.cluster import Cluster
from rl.driver.run import prepare_run
from tests.support.env import REPO, compose


@pytest.fixture(scope="module")
def ray_module(ray_local):
    return ray_local


def test_engine_dying_during_a_sync_fails_fast_naming_it(ray_module, tmp_path):
    # p2p: the engine dies in the group of learner rank 1 (broadcast shares the send code)
    cfg = compose("weights=p2p", "weights.timeout_s=15", "weights.bucket_bytes=64kb",
                  "rollout.prompts_per_step=4", "logger=console", f"output_dir={tmp_path}")
    cluster = Cluster(cfg, prepare_run(cfg)).start()
    try:
        cluster.learners.push_weights(version=0)
        pid = cluster.rollout.engine_pids()[1]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            cluster.learners.push_weights(version=1)
        assert time.monotonic() - t0 < 60
        assert "engine-1" in str(e.value)
    finally:
        t0 = time.monotonic()
        cluster.shutdown()
        assert time.monotonic() - t0 < 30  # every rank left the push: nothing waits for a timeout


@pytest.mark.parametrize("args,fragment", [
    (["weights=p2p", "weights.bucket_bytes=1kb"],
     "weights.bucket_bytes=1024 is smaller than the model's largest tensor"),
    (["weights=p2p", "cluster.num_engines=0"], "cluster.num_engines=0 must be > 0"),
    (["weights=nope"], "weights/nope"),
])
def test_weight_misconfiguration_is_refused_before_workers_start(args, fragment):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "train.py", *args, "logger=console"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and fragment in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "rl.driver.cluster:" not in proc.stdout and time.monotonic() - t0 < 15
