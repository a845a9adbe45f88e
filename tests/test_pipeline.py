"""Integration on a real local Ray: CPU engines over HTTP, FSDP2 learners on gloo, the Ray
store and broadcast weight sync, driven through the same ``Cluster`` as ``train.py``."""

from __future__ import annotations

import numpy as np
import pytest

from rl.cluster import Cluster
from rl.run import prepare_run
from tests.conftest import compose, pids_with


@pytest.fixture(scope="module")
def cluster(ray_local, tmp_path_factory):
    # A task whose rewards vary even for the untrained model, so that training moves weights.
    data = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "{c * 4}"}}\n' for c in "abcdefgh"))
    cfg = compose("rollout.prompts_per_step=8", "rollout.max_new_tokens=40", "logger=console",
                  "num_steps=2", "task=jsonl", f"task.path={data}",
                  "task.reward._target_=tests.helpers.length_reward",
                  f"output_dir={tmp_path_factory.mktemp('run')}")
    c = Cluster(cfg, prepare_run(cfg)).start()
    yield c
    ports = [u.rsplit(":", 1)[1] for u in c.engine_urls]
    c.shutdown()
    for port in ports:  # the engine servers are gone with their actors
        assert pids_with(f"--port {port}") == []


def assert_engines_hold(cluster, state: dict[str, np.ndarray], version: int) -> None:
    for client in cluster.engine_clients():
        assert client.get_weight_version() == str(version)
        for name, want in state.items():
            got = np.asarray(client.get_weights_by_name(name), dtype=want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"{client.name}: {name}")


def test_engines_hold_the_learner_weights_bit_for_bit_after_every_sync(cluster):
    cluster.learners.push_weights(version=0)
    before = cluster.learners.full_state()
    assert_engines_hold(cluster, before, 0)
    for step in range(2):
        ref = cluster.rollout.generate(step)
        metrics = cluster.learners.train(ref)
        cluster.store.remove(ref.partitions)
        assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        cluster.learners.push_weights(version=step + 1)
        after = cluster.learners.full_state()
        assert_engines_hold(cluster, after, step + 1)
    assert any(not np.array_equal(before[n], after[n]) for n in before)  # training moved them


def test_every_sample_lands_on_exactly_one_rank(cluster):
    from rl.types import RolloutBatch
    from transfer.data.ray_store import RayStore

    ref = cluster.rollout.generate(5)
    store = RayStore()
    parts = [RolloutBatch.from_columns(store.get(p)) for p in ref.partitions]
    ids = np.concatenate([p.sample_id for p in parts])
    assert len(ids) == ref.num_samples == 8 * 8 and len(set(ids.tolist())) == len(ids)
    assert [len(p) for p in parts] == [32, 32]
    assert sum(p.num_loss_tokens for p in parts) == ref.num_loss_tokens
    for p in parts:  # what the learner trains on is what the engine sampled
        for tok, plen, rlen, lp in zip(p.tokens, p.prompt_len, p.response_len, p.rollout_logprobs):
            assert len(tok) == plen + rlen and len(lp) == rlen
        assert set(p.weight_version.tolist()) == {int(cluster.engine_clients()[0].get_weight_version())}
    cluster.store.remove(ref.partitions)
    cluster.store.remove(ref.partitions)  # idempotent
