"""Rollout fault tolerance: engine servers killed by PID (during generation, during a weight
sync) or stopped with SIGSTOP are replaced and the run goes on, losing no sample; the
replacement holds the learner's weights bit for bit; past ``rollout.max_engine_restarts`` the
run ends with a named error. Each axis is covered: ``train.py`` and ``train_async.py
rollout.fully_async=true``, transfer ray and mooncake_tcp, weights broadcast and p2p."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from rl.driver.cluster import Cluster
from rl.config.transfer import BACKENDS
from rl.driver.run import prepare_run
from tests.support.cluster_checks import assert_each_sample_on_one_rank, assert_engines_hold, learner_state
from tests.support.env import REPO, compose
from tests.support.procs import pids_with
from tests.support.runs import assert_nothing_left, check_ledger, engine_ports, read_ledger, read_metrics
from transfer.data.mooncake.master import MooncakeMaster

LENGTH_TASK = ("task=jsonl", "task.reward._target_=tests.support.helpers.length_reward")

FAST_CHECKS = ("rollout.health_check_interval_s=0.5", "rollout.health_check_timeout_s=3",
               "rollout.health_check_first_wait_s=0")

pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs connect to one `ray start --head`


@pytest.fixture
def prompts(tmp_path) -> str:
    data = tmp_path / "prompts.jsonl"  # a reward a random model earns: the weights move
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcdefgh"))
    return f"task.path={data}"


def engine_state(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=5).json()["internal_states"][0]


class KillWhen(threading.Thread):
    """Sends ``sig`` to the engine server ``pid`` (serving ``url``) as soon as its
    ``/server_info`` shows ``what``: requests on the model, or a weight-update session open.
    Polled every few milliseconds from the test: the engine's real state, no hook in it."""

    def __init__(self, url: str, pid: int, what: str, sig: int = signal.SIGKILL,
                 timeout_s: float = 120) -> None:
        super().__init__(daemon=True)
        self.url, self.pid, self.what, self.sig, self.timeout_s = url, pid, what, sig, timeout_s
        self.sent_at: float | None = None
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                state = engine_state(self.url)
            except (requests.RequestException, ValueError):
                time.sleep(0.01)
                continue
            if (self.what == "generating" and state["running_requests"] > 0) or \
                    (self.what == "syncing" and state["weight_update_session"]):
                os.kill(self.pid, self.sig)
                self.sent_at = time.monotonic()
                return
            time.sleep(0.003)

    def sent(self) -> float:
        self.join(self.timeout_s)
        assert self.sent_at is not None, f"the engine at {self.url} was never {self.what}"
        return self.sent_at


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run(script: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, "logger=console", "checkpoint.every=0", *overrides],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HYDRA_FULL_ERROR": "1"})


def engines_of(proc: subprocess.Popen) -> tuple[list[str], list[int], str]:
    """The run's engine URLs and server PIDs, from its output (read until the engines are up)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"engines up: (.*)", line)
        if m:
            urls = m.group(1).strip().split(", ")
            pids = [pids_with(f"--port {u.rsplit(':', 1)[1]}")[0] for u in urls]
            return urls, pids, "".join(lines)
    raise AssertionError("the run ended before its engines were up:\n" + "".join(lines[-40:]))


def read_to(proc: subprocess.Popen, prefix: str) -> str:
    """The run's output up to the first line starting with ``prefix``."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return "".join(lines)
    raise AssertionError(f"no line {prefix!r}:\n" + "".join(lines[-40:]))


def finish(proc: subprocess.Popen, head: str, timeout_s: float = 300) -> str:
    """The rest of the run's output once it ended (killed, and the test failed, past
    ``timeout_s``)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        tail = (head + out)[-4000:]
        raise AssertionError(f"the run did not end within {timeout_s:.0f}s:\n{tail}") from None
    return head + out


@pytest.fixture
def master(tmp_path):
    """A Mooncake master of the test's own, to read its keys after the run."""
    m = MooncakeMaster("127.0.0.1", log_path=str(tmp_path / "master.log")).start()
    try:
        yield m, (*BACKENDS["mooncake-packed"], f"transfer.master_server_address={m.address}",
                  f"transfer.metadata_server={m.metadata_server}")
    finally:
        m.stop()


def test_train_py_survives_an_engine_killed_during_generation(master, prompts, tmp_path):
    """train.py, mooncake_tcp x p2p: every step runs, the dead engine's requests were sent
    again, one replacement, no key or process left."""
    master, transfer = master
    proc = run("train.py", *transfer, "weights=p2p", "num_steps=4", "rollout.prompts_per_step=8",
               "rollout.max_new_tokens=40", *LENGTH_TASK, prompts, f"output_dir={tmp_path}")
    urls, pids, head = engines_of(proc)
    KillWhen(urls[1], pids[1], "generating").sent()
    out = finish(proc, head)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["rollout/retried_requests"] for r in rows) >= 1
    assert rows[-1]["rollout/engine_restarts"] == 1
    assert sum(r["rollout/engine_restart_s"] > 0 for r in rows) == 1
    assert "rl.rollout.fleet: engine-1 died" in out and "back in service" in out
    assert master.keys() == []
    assert_nothing_left(engine_ports(out) + re.findall(r"engine-1 \(http://[\d.]+:(\d+)\) started", out))


def test_fully_async_survives_an_engine_killed_during_a_sync(prompts, tmp_path):
    """train_async.py rollout.fully_async=true, ray x broadcast: the engine dies while the
    paused engines receive weights; the push is made again with its replacement and the
    sample ledger still balances (each sample trained once or counted as dropped)."""
    proc = run("train_async.py", "rollout.fully_async=true", "weights=broadcast", "num_steps=5",
               "rollout.prompts_per_step=8", "rollout.max_new_tokens=40", "algo.max_staleness=1",
               *LENGTH_TASK, prompts, f"output_dir={tmp_path}")
    urls, pids, head = engines_of(proc)
    head += read_to(proc, "step 1/")  # the paused engines' sync after a step, not the first push
    KillWhen(urls[0], pids[0], "syncing").sent()
    out = finish(proc, head)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(5))
    # engine 1 may be left waiting in the broadcast engine 0's death cut short: replaced
    # too, and meanwhile no engine is in service (the stream's requests wait for the sync)
    assert rows[-1]["rollout/engine_restarts"] in (1, 2)
    assert re.search(r"WARNING rl.driver.weights: the weight update to version \d+ failed", out), out[-3000:]
    check_ledger(read_ledger(tmp_path), rows, out, max_staleness=1)
    assert_nothing_left(engine_ports(out) + re.findall(r"engine-0 \(http://[\d.]+:(\d+)\) started", out))


def test_a_hung_engine_is_found_by_the_health_check_and_replaced(prompts, tmp_path):
    """SIGSTOP (not killed: its port still accepts connections) while it generates:
    ``/health_generate`` goes unanswered, its requests go to the other engine, and it is
    replaced (and killed) at the next sync."""
    proc = run("train.py", "num_steps=4", "rollout.prompts_per_step=8", "rollout.max_new_tokens=40",
               *FAST_CHECKS, *LENGTH_TASK, prompts, f"output_dir={tmp_path}")
    urls, pids, head = engines_of(proc)
    head += read_to(proc, "step 1/")  # a step in: past the start-up's weight-group rendezvous
    stopped = KillWhen(urls[1], pids[1], "generating", sig=signal.SIGSTOP)
    try:
        stopped.sent()
        out = finish(proc, head)
    finally:
        if alive(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "no answer to /health_generate within 3s" in out, out[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["rollout/retried_requests"] for r in rows) >= 1
    assert rows[-1]["rollout/engine_restarts"] == 1
    assert not alive(pids[1])  # the replacement stopped it for good
    assert_nothing_left(engine_ports(out) + re.findall(r"engine-1 \(http://[\d.]+:(\d+)\) started", out))


def test_past_the_restart_bound_the_run_ends_naming_the_engine(master, tmp_path):
    """``rollout.max_engine_restarts=0``: the first engine death ends the run within about
    10 s with an error naming the engine and its last log lines; no key or process is left."""
    master, transfer = master
    proc = run("train.py", *transfer, "num_steps=10000", "rollout.prompts_per_step=8",
               "rollout.max_engine_restarts=0", f"output_dir={tmp_path}")
    urls, pids, head = engines_of(proc)
    head += read_to(proc, "step 2/")
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    out = finish(proc, head, timeout_s=60)
    took = time.monotonic() - killed
    print(f"restart bound: the run ended {took:.1f}s after the kill")
    assert proc.returncode != 0
    assert took < 12, f"{took:.1f}s from the kill to the end of the run"
    assert "rollout.max_engine_restarts=0" in out and "engine-1 died" in out, out[-3000:]
    assert "last lines of" in out and "engine_1.log" in out
    assert master.keys() == []
    assert_nothing_left(engine_ports(out))


# In-process clusters last: their actors, while they live, would count as processes left
# behind by the runs above. The test process connects to the same head.
@pytest.fixture(scope="module")
def ray_module(shared_ray, ray_local):
    return ray_local


@pytest.mark.parametrize("transfer,weights", [("ray-pickle", "broadcast"), ("mooncake-packed", "p2p")])
def test_killed_engines_are_replaced_and_hold_the_learners_weights(ray_module, transfer, weights,
                                                                   prompts, tmp_path):
    """Engine 1 killed with requests on its model, engine 0 killed inside a weight-update
    session: each step still has every sample, once; each replacement serves the pushed
    version and holds the learners' weights bit for bit, and then takes requests."""
    cfg = compose(*BACKENDS[transfer], f"weights={weights}", "weights.bucket_bytes=64kb",
                  "rollout.prompts_per_step=8", "rollout.max_new_tokens=40", *LENGTH_TASK, prompts,
                  "rollout.health_check_interval_s=1000",  # no probe among the requests counted
                  "logger=console", f"output_dir={tmp_path}")
    cluster = Cluster(cfg, prepare_run(cfg)).start()
    try:
        cluster.push_weights(version=0)
        pids = cluster.rollout.engine_pids()

        pending = cluster.rollout.generate_async(0)  # engine 1 dies mid-generation
        killer = KillWhen(cluster.engine_urls[1], pids[1], "generating")
        ref = cluster.rollout.wait(pending)
        killer.sent()
        assert ref.stats["rollout/retried_requests"] >= 1
        assert_each_sample_on_one_rank(cluster, ref, expected=8 * 8)
        assert cluster.learners.train(ref)["train/grad_norm"] > 0
        cluster.store.remove(ref.partitions)
        m = cluster.push_weights(version=1)  # the replacement joins here
        assert m["rollout/engine_restarts"] == 1 and m["rollout/engine_restart_s"] > 0
        print(f"{transfer} x {weights}: engine 1 replaced in {m['rollout/engine_restart_s']:.1f}s")
        assert not alive(pids[1])
        assert_engines_hold(cluster, learner_state(cluster), 1)

        ref = cluster.rollout.generate(1)
        assert ref.stats["rollout/retried_requests"] == 0
        cluster.learners.train(ref)
        cluster.store.remove(ref.partitions)
        killer = KillWhen(cluster.engine_urls[0], pids[0], "syncing")  # engine 0 dies mid-push
        m = cluster.push_weights(version=2)
        killer.sent()
        print(f"{transfer} x {weights}: {m['rollout/engine_restarts'] - 1:.0f} engine(s) replaced "
              f"during the push in {m['rollout/engine_restart_s']:.1f}s")
        assert not alive(pids[0])
        # p2p: engine 1 has a group of its own and is untouched; broadcast: engine 1 may be
        # left waiting in the broadcast engine 0's death cut short, and is replaced too
        assert m["rollout/engine_restarts"] in ((2,) if weights == "p2p" else (2, 3))
        assert_engines_hold(cluster, learner_state(cluster), 2)
        new = cluster.rollout.engine_pids()
        assert set(new).isdisjoint(pids)

        # both replacements are in service: each gets requests of the next step
        seen = [engine_state(url)["requests_seen"] for url in cluster.engine_urls]
        ref = cluster.rollout.generate(2)
        assert all(engine_state(url)["requests_seen"] > n for url, n in zip(cluster.engine_urls, seen))
        assert ref.stats["rollout/retried_requests"] == 0
        assert {int(v) for v in ref.weight_versions} == {2}
        cluster.store.remove(ref.partitions)
        if "admin_url" in cluster.runtime.transfer:  # Mooncake: no key left on the master
            from transfer.data.mooncake.master import list_keys

            assert list_keys(cluster.runtime.transfer["admin_url"]) == []
    finally:
        cluster.shutdown()
    assert not [p for p in new if alive(p)]
