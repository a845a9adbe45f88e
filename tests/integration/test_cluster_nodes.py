"""On a real one-node Ray, ``cluster=two_node`` is refused before any worker starts; the
driver's watchdog interrupts a driver that blocked SIGINT, and a loopback hostname exported on
a node is read there and refused (drivers run in processes of their own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


from tests.support.env import REPO
from tests.support.procs import pids_with
from tests.support.runs import assert_nothing_left


def test_two_node_on_a_one_node_ray_is_refused_before_workers_start(tmp_path):
    """A real local Ray (one node): the run stops at the node check, starts no engine and
    leaves no Ray process."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "train.py", "cluster=two_node", "cluster.address=null",
                           "logger=console", f"output_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "cluster=two_node needs 2 Ray nodes but the Ray cluster has 1" in out, \
        out[-3000:]
    assert "rl.rollout.fleet: starting" not in out and time.monotonic() - t0 < 60
    assert pids_with(str(tmp_path)) == []
    assert_nothing_left([])  # Ray's idle workers exit after their raylet, on their own time


_BLOCKED_DRIVER = """
import signal, socket, sys, threading, time
sys.path.insert(0, {repo!r})
from rl.driver.watchdog import Watchdog

srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]
dog = Watchdog(period_s=0.2)
dog.watch_port("the master", "127.0.0.1", port)
dog.start()
srv.close()  # the watched process dies
t0 = time.monotonic()
try:
    threading.Event().wait(30)  # a driver blocked in a call, as in ray.get
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    dog.stop()
    print(f"interrupted after {{time.monotonic() - t0:.1f}}s: {{dog.failure}}", flush=True)
"""


def test_watchdog_interrupts_a_driver_started_with_sigint_blocked(tmp_path):
    """`ray job submit` starts the driver with SIGINT blocked, as Ray does every process it
    starts: the watchdog's interrupt must still reach the main thread."""
    from tests.support.env import REPO

    script = tmp_path / "driver.py"
    script.write_text(_BLOCKED_DRIVER.format(repo=REPO))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}))
    assert "interrupted after" in out.stdout and "the master died" in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - t0 < 10


_NODE_ENV_DRIVER = """
import sys
sys.path.insert(0, {repo!r})
import ray
from rl.backends import data_path
from rl.config.transfer import MooncakeTransferConfig
from rl.driver.nodes import node_environments

ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING",
         runtime_env={{"env_vars": {{"MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}}}})
envs = node_environments(data_path(MooncakeTransferConfig()).node_env)
print("read", envs, flush=True)
for node, env in envs.items():
    pinned = data_path(MooncakeTransferConfig(local_hostname="10.0.0.5"))
    pinned.check_node_env(node, env, num_nodes=2)  # the field wins
    try:
        data_path(MooncakeTransferConfig()).check_node_env(node, env, num_nodes=2)
    except ValueError as e:
        print("refused:", e, flush=True)
ray.shutdown()
"""


def test_a_loopback_hostname_exported_on_a_node_is_read_there_and_refused(tmp_path):
    """The quickstart exports MOONCAKE_LOCAL_HOSTNAME on each node before `ray start`: the
    driver cannot see another node's value in its own environment, so it reads each node's
    through a task pinned there (here: the one node of a local Ray, whose workers have it)."""
    from tests.support.env import REPO

    script = tmp_path / "driver.py"
    script.write_text(_NODE_ENV_DRIVER.format(repo=REPO))
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_LOCAL_HOSTNAME"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert "'MOONCAKE_LOCAL_HOSTNAME': '127.0.0.1'" in out.stdout, out.stdout + out.stderr[-2000:]
    assert ("refused: MOONCAKE_LOCAL_HOSTNAME on node 127.0.0.1 is '127.0.0.1', a loopback address, "
            "but the Ray cluster has 2 nodes") in out.stdout, out.stdout + out.stderr[-2000:]
