"""Files go where the user said: Hydra's own files (``.hydra/``, the job log) follow
``output_dir``, a config error leaves no directory anywhere, and a Mooncake master started by
hand does not write its log into the directory it was started from. Each command runs from
an empty directory that stands for the repository a user starts it in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support.env import REPO
from transfer.net import free_port, port_open


def _train(cwd, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_hydra_files_follow_output_dir(tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    # passes the config checks, then stops in prepare_run (after Hydra wrote its files)
    proc = _train(cwd, f"output_dir={out}", "weights.bucket_bytes=1", "logger=console")
    assert proc.returncode != 0 and "is smaller than the model's largest tensor" in proc.stderr
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "train.log").is_file()
    assert os.listdir(cwd) == []  # no outputs/<date>/<time>/.hydra beside it


def test_config_error_leaves_no_directory(tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    for bad in ("weights.bucket_bytes=2 gigs", "num_steps=0", "cluster.num_enginez=2"):
        for where in ([], [f"output_dir={out}"]):
            proc = _train(cwd, *where, bad)
            assert proc.returncode == 1, proc.stderr
            assert os.listdir(cwd) == [] and not out.exists(), (bad, where)


def test_mooncake_master_by_hand_logs_outside_the_cwd(tmp_path):
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    rpc = free_port("127.0.0.1")
    ports = ["--rpc-port", str(rpc), "--http-port", str(free_port("127.0.0.1")),
             "--metrics-port", str(free_port("127.0.0.1"))]
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "transfer.data.mooncake.master", "--host", "127.0.0.1",
                             *ports], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", rpc) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_open("127.0.0.1", rpc), "the master did not start"
        assert os.listdir(cwd) == []
        assert (tmp / "mooncake_master.log").is_file()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
