"""Engines hold exactly the learner's weights after every sync, on a real cluster: each
registered data path with each weight path keeps the engines bit-identical to the learner
(half of the pairs here, the other half in tests/e2e/test_async.py), and bfloat16 engines
hold the float32 master weights rounded, bit for bit. Without a cluster:
tests/unit/test_weights.py; an engine dying during a sync: tests/integration/test_weights.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from rl.driver.cluster import Cluster
from rl.config.transfer import BACKENDS
from rl.driver.run import prepare_run
from tests.support.cluster_checks import (assert_each_sample_on_one_rank, assert_engines_hold, bits,
                                          learner_state)
from tests.support.env import compose
from tests.support.helpers import combination_halves


@pytest.fixture(scope="module")
def ray_module(ray_local):
    return ray_local


@pytest.mark.parametrize("transfer,weights", combination_halves(BACKENDS)[0],
                         ids=[f"{t}-{w}" for t, w in combination_halves(BACKENDS)[0]])
def test_each_data_path_and_weight_path_keep_engines_bit_identical(ray_module, transfer, weights, tmp_path):
    """Half of the (data path, weight path) pairs; tests/e2e/test_async.py runs the other half."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcd"))
    cfg = compose(*BACKENDS[transfer], f"weights={weights}", "weights.bucket_bytes=64kb",
                  "rollout.prompts_per_step=4", "rollout.max_new_tokens=40", "logger=console",
                  "task=jsonl", f"task.path={data}",
                  "task.reward._target_=tests.support.helpers.length_reward", f"output_dir={tmp_path}")
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
                  "task.reward._target_=tests.support.helpers.length_reward", f"output_dir={tmp_path}")
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
