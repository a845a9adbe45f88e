"""train.py over Mooncake with an external master: no key left (checked through the master),
and every bad input on the command line refused early with an actionable message (the checks
in-process: tests/unit/test_mooncake.py; a local master stopped with the run, and one killed
mid-run: tests/e2e/test_mooncake.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support.env import REPO
from tests.support.procs import own_ray_env, pids_with
from tests.support.runs import REQUIRED, assert_nothing_left, engine_ports, read_metrics, train
from transfer.data.mooncake.master import MooncakeMaster

SMALL = ["rollout.prompts_per_step=8", "logger=console"]

pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs connect to one `ray start --head`


def test_train_py_with_an_external_master_leaves_no_key(tmp_path):
    master = MooncakeMaster("127.0.0.1", log_path=str(tmp_path / "master.log")).start()
    try:
        proc = train("transfer=mooncake_tcp", "weights=p2p", "num_steps=3", *SMALL,
                     f"output_dir={tmp_path}",
                     f"transfer.master_server_address={master.address}",
                     f"transfer.metadata_server={master.metadata_server}")
        assert "started a local master" not in proc.stdout
        assert "rl.driver.weights: p2p plan: learner 0 -> engine-0" in proc.stdout
        rows = read_metrics(tmp_path)
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            for k in REQUIRED + ["transfer/encode_ms", "transfer/decode_ms"]:
                assert k in r, k
            assert r["transfer/bytes"] > 0 and r["transfer/get_ms"] > 0
        assert master.keys() == []  # every step's keys were removed, seen by the store itself
        assert master.proc.poll() is None  # an external master is left running
        assert_nothing_left(engine_ports(proc.stdout))
    finally:
        master.stop()


def _cli(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "train.py", *args, "logger=console"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**own_ray_env(), **(env or {})})  # errors before a Ray of its own
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("args,fragment", [
    (["transfer.init_kwargs='{\"tenant_id\": '"], "transfer.init_kwargs is not valid JSON"),
    (["transfer.init_kwargs={colour: blue}"], "unknown Mooncake setup keys ['colour']"),
    (["transfer.init_kwargs={client_http_port: abc}"], "client_http_port='abc' must be an integer"),
    (["transfer.replica_num=two"], "replica_num"),
    (["transfer.protocl=tcp"], "transfer.protocl"),
    (["transfer.global_segment_size='2 gigs'"], "transfer.global_segment_size='2 gigs' is not a size"),
    (["transfer.global_segment_size=1mb"], "below Mooncake's minimum of 16mb"),
    (["transfer.protocol=udp"], "transfer.protocol='udp': use tcp or rdma"),
])
def test_config_errors_before_anything_starts(args, fragment):
    proc, seconds = _cli("transfer=mooncake_tcp", *args)
    assert proc.returncode != 0 and fragment in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "rl.driver.cluster:" not in proc.stdout and seconds < 10


@pytest.mark.parametrize("args,env,fragment", [
    (["transfer=mooncake_rdma"], {"MOONCAKE_DEVICE": ""}, "protocol rdma needs a device"),
    (["transfer=mooncake_rdma", "transfer.device_name=mlx5_0"], {}, "has no RDMA device"),
    (["transfer=mooncake_tcp", "transfer.master_server_address=127.0.0.1:9"], {}, "unreachable"),
    (["transfer=mooncake_tcp", "transfer.global_segment_size=16mb",
      "rollout.max_prompt_tokens=100000"], {}, "set transfer.global_segment_size="),
])
def test_environment_errors_before_workers_start(args, env, fragment, tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live in it
    try:
        proc, seconds = _cli(*args, f"output_dir={tmp_path}", env={**env, "RAY_TMPDIR": ray_dir})
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and fragment in out, out[-3000:]
        assert "engines up" not in out and seconds < 30
        assert os.listdir(ray_dir) == []  # said before the run's own Ray started: no session
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert pids_with(str(tmp_path)) == []


def test_bootstrap_takes_plain_values_and_imports_nothing_from_rl():
    """The bootstrap sits in the transfer layer: plain values in, no ``rl`` module loaded."""
    code = ("import sys\n"
            "from transfer.data.mooncake import bootstrap as b, client\n"
            "b.check_capacity(global_segment_size=16 << 20, partition_bytes=8 << 20, batches_held=1,"
            " replica_num=2)\n"
            "try:\n"
            "    b.check_capacity(global_segment_size=16 << 20, partition_bytes=8 << 20,"
            " batches_held=1, replica_num=3)\n"
            "except ValueError as e:\n"
            "    print(e)\n"
            "print(client.parse_init_kwargs('{\"local_buffer_size\": \"2mb\"}'))\n"
            "print(sorted(m for m in sys.modules if m == 'rl' or m.startswith('rl.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert "set transfer.global_segment_size=48mb or more" in out[0], out
    assert out[1:] == ["{'local_buffer_size': 2097152}", "[]"], out
