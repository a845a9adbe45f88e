"""Weight paths: the p2p plan, each registered data path with each weight path keeps the
engines bit-identical to the learner after every sync (half of the pairs here, the other
half in tests/test_async.py), and faults end in bounded, named errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rl.cluster import Cluster
from rl.config.transfer import BACKENDS
from rl.run import prepare_run
from tests.cluster_checks import (assert_each_sample_on_one_rank, assert_engines_hold, bits,
                                  learner_state)
from tests.conftest import REPO, compose
from tests.helpers import combination_halves
from transfer.weights.broadcast import check_versions
from transfer.weights.p2p import plan_p2p


@dataclass
class _Engine:
    """Stands in for an engine's answers in plan and version checks (no process behind it)."""

    name: str
    num_ranks: int = 1
    version: str = "0"

    def get_weight_version(self) -> str:
        return self.version


@pytest.mark.parametrize("engines,senders,expected", [
    (4, 2, [[0, 2], [1, 3]]),
    (2, 2, [[0], [1]]),
    (1, 2, [[0], []]),
    (3, 1, [[0, 1, 2]]),
    (5, 2, [[0, 2, 4], [1, 3]]),
])
def test_p2p_plan_is_round_robin(engines, senders, expected):
    plan = plan_p2p(senders, [_Engine(f"e{i}") for i in range(engines)])
    assert plan == expected
    assert sorted(sum(plan, [])) == list(range(engines))  # every engine exactly once


def test_p2p_plan_balances_ranks_not_engines():
    # a tensor-parallel engine of 4 ranks receives 4 copies: it gets a sender of its own
    plan = plan_p2p(2, [_Engine("a", 4), _Engine("b"), _Engine("c"), _Engine("d")])
    assert plan == [[0], [1, 2, 3]]


def test_p2p_plan_needs_engines():
    with pytest.raises(ValueError, match="at least one engine"):
        plan_p2p(2, [])


def test_stale_engine_version_is_an_error_naming_it():
    engines = [_Engine("engine-0", version="4"), _Engine("engine-1", version="3")]
    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError) as e:
        check_versions(engines, 4, pool, timeout_s=5)
    assert "engine-1: reports version '3', expected 4" in str(e.value)
    assert "engine-0" not in str(e.value)


@pytest.fixture(scope="module")
def ray_module(ray_local):
    return ray_local


@pytest.mark.parametrize("transfer,weights", combination_halves(BACKENDS)[0],
                         ids=[f"{t}-{w}" for t, w in combination_halves(BACKENDS)[0]])
def test_each_data_path_and_weight_path_keep_engines_bit_identical(ray_module, transfer, weights, tmp_path):
    """Half of the (data path, weight path) pairs; tests/test_async.py runs the other half."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    cfg = compose(*BACKENDS[transfer], f"weights={weights}", "weights.bucket_bytes=64kb",
                  "rollout.prompts_per_step=4", "rollout.max_new_tokens=40", "logger=console",
                  "task=jsonl", f"task.path={data}", "task.reward._target_=tests.helpers.length_reward",
                  f"output_dir={tmp_path}")
    cluster = Cluster(cfg, prepare_run(cfg)).start()
    try:
        cluster.learners.push_weights(version=0)
        assert_engines_hold(cluster, cluster.learners.full_state(), 0)
        before = cluster.learners.full_state()
        for step in range(2):
            ref = cluster.rollout.generate(step)
            assert set(ref.stats) >= {"rollout/reward_mean", "transfer/put_ms"}
            assert_each_sample_on_one_rank(cluster, ref, expected=4 * 8)
            metrics = cluster.learners.train(ref)
            assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
            cluster.store.remove(ref.partitions)
            metrics = cluster.learners.push_weights(version=step + 1)
            assert metrics["weights/bytes"] > 0
            after = cluster.learners.full_state()
            assert_engines_hold(cluster, after, step + 1)
        assert any(not np.array_equal(before[n], after[n]) for n in before)  # training moved them
        if "admin_url" in cluster.runtime.transfer:  # Mooncake: no key left on the master
            from transfer.data.mooncake.master import list_keys

            assert list_keys(cluster.runtime.transfer["admin_url"]) == []
    finally:
        cluster.shutdown()


def test_bfloat16_engines_hold_the_float32_master_weights_rounded_bit_for_bit(ray_module, tmp_path):
    """``model.dtype=bfloat16``: the engines load the (float32) checkpoint in bfloat16, the
    learners keep float32 master weights (``model.master_dtype``) and compute in bfloat16,
    and after every sync the engines hold the master weights rounded to bfloat16, bit for bit."""
    from rl.model import load_model

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    cfg = compose("model.dtype=bfloat16", "rollout.prompts_per_step=4", "rollout.max_new_tokens=40",
                  "logger=console", "task=jsonl", f"task.path={data}",
                  "task.reward._target_=tests.helpers.length_reward", f"output_dir={tmp_path}")
    runtime = prepare_run(cfg)
    # the checkpoint has float32 values that bfloat16 cannot hold: an engine running float32
    # would hold those, not their rounding
    on_disk = dict(load_model(runtime.model_path, "float32").named_parameters())
    assert all(p.dtype == torch.float32 for p in on_disk.values())
    assert any((bits(p) & 0xFFFF).any() for p in on_disk.values())

    def rounded(state: dict) -> dict:
        return {n: t.to(torch.bfloat16) for n, t in state.items()}

    cluster = Cluster(cfg, runtime).start()
    try:
        start = learner_state(cluster)
        assert {t.dtype for t in start.values()} == {torch.float32}
        assert_engines_hold(cluster, rounded(start), version=None)  # before any push: loaded in bfloat16
        cluster.learners.push_weights(version=0)
        assert_engines_hold(cluster, rounded(learner_state(cluster)), 0)
        for step in range(2):
            ref = cluster.rollout.generate(step)
            assert cluster.learners.train(ref)["train/grad_norm"] > 0
            cluster.store.remove(ref.partitions)
            cluster.learners.push_weights(version=step + 1)
            after = learner_state(cluster)
            assert_engines_hold(cluster, rounded(after), step + 1)
        assert any(not np.array_equal(bits(start[n]), bits(after[n])) for n in start)  # trained
    finally:
        cluster.shutdown()


def test_engine_commands_carry_the_model_dtype():
    """model.dtype reaches both engines' command lines (SGLang 0.5.23 takes these spellings);
    SGLang's own --dtype in extra_args would undo it and is refused."""
    from rl.config import HFRolloutConfig, SGLangRolloutConfig

    for dtype in ("float32", "bfloat16", "float16"):
        for rc in (HFRolloutConfig(), SGLangRolloutConfig()):
            cmd = rc.server_command("/ckpt", "127.0.0.1", 30000, 0, 1, 1, dtype=dtype)
            assert cmd[cmd.index("--dtype") + 1] == dtype and cmd.count("--dtype") == 1
    for extra in (["--dtype", "half"], ["--dtype=half"]):
        with pytest.raises(ValueError, match="--dtype is set from model.dtype"):
            SGLangRolloutConfig(extra_args=extra)


def test_engine_dying_during_a_sync_fails_fast_naming_it(ray_module, tmp_path):
    # p2p: the engine dies in the group of learner rank 1 (broadcast shares the send code)
    cfg = compose("weights=p2p", "weights.timeout_s=15", "weights.bucket_bytes=64kb",
                  "rollout.prompts_per_step=4", "logger=console", f"output_dir={tmp_path}")
    cluster = Cluster(cfg, prepare_run(cfg)).start()
    try:
        cluster.learners.push_weights(version=0)
        pid = ray_module.get(cluster.engines[1].pid.remote())
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
    assert "[cluster]" not in proc.stdout and time.monotonic() - t0 < 15
