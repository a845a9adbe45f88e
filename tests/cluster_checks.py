"""Helpers shared by the integration tests that drive a ``Cluster`` (real Ray, CPU engines
over HTTP, FSDP2 learners on gloo); the tests themselves are in ``test_weights.py``."""

from __future__ import annotations

import numpy as np


def assert_engines_hold(cluster, state: dict[str, np.ndarray], version: int) -> None:
    """Every engine serves ``version`` and holds exactly ``state`` (bit for bit)."""
    for client in cluster.engine_clients():
        assert client.get_weight_version() == str(version)
        for name, want in state.items():
            got = np.asarray(client.get_weights_by_name(name), dtype=want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"{client.name}: {name}")


def assert_each_sample_on_one_rank(cluster, ref, expected: int) -> None:
    """The partitions cover the step's samples exactly once, evenly, as the engines sampled them."""
    from rl.types import RolloutBatch

    store = cluster.cfg.transfer.build(cluster.runtime, role="driver")
    try:
        parts = [RolloutBatch.from_columns(store.get(p)) for p in ref.partitions]
        ids = np.concatenate([p.sample_id for p in parts])
        assert len(ids) == ref.num_samples == expected and len(set(ids.tolist())) == len(ids)
        assert len({len(p) for p in parts}) == 1
        assert sum(p.num_loss_tokens for p in parts) == ref.num_loss_tokens
        version = {int(cluster.engine_clients()[0].get_weight_version())}
        for p in parts:
            for tok, plen, rlen, lp in zip(p.tokens, p.prompt_len, p.response_len, p.rollout_logprobs):
                assert len(tok) == plen + rlen and len(lp) == rlen
            assert set(p.weight_version.tolist()) == version
        del parts
    finally:
        store.close()
