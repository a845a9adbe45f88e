"""Helpers shared by the integration tests that drive a ``Cluster`` (real Ray, CPU engines
over HTTP, FSDP2 learners on gloo); the tests themselves are in ``test_weights.py``."""

from __future__ import annotations

import numpy as np
import torch

from rl.backends import data_path


def _tensor(x) -> torch.Tensor:
    """A tensor as is; a numpy array (maybe read-only, as Ray returns them) as a copy."""
    return torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x


def bits(t) -> np.ndarray:
    """The bit patterns of a float tensor or array (any dtype, bfloat16 too) as integers of
    its width: equal bits is bit-for-bit equality (-0.0 differs from 0.0, NaNs compare)."""
    t = _tensor(t).detach().cpu().contiguous()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints).numpy()


def engine_bits(values, dtype: torch.dtype, what: str = "") -> np.ndarray:
    """Bit patterns, in ``dtype``, of an engine's ``get_weights_by_name`` answer (its parameter
    as float32 values). Fails when a value has no exact ``dtype`` form: the engine then holds
    its weights in a wider dtype than ``dtype``."""
    wide = torch.from_numpy(np.asarray(values, dtype=np.float32))
    narrow = wide.to(dtype)
    back = bits(narrow.to(torch.float32))
    exact = back == bits(wide)
    assert exact.all(), (f"{what}: {int((~exact).sum())} of {exact.size} values are not "
                         f"{dtype} values (first {wide.flatten()[np.flatnonzero(~exact.ravel())[0]]!r}): "
                         f"the engine does not hold its weights in {dtype}")
    return bits(narrow)


def learner_state(cluster) -> dict[str, torch.Tensor]:
    """Every learner parameter as a whole tensor in the learners' own dtype (bfloat16 too,
    which ``Learner.full_state``'s numpy arrays cannot hold). A collective: all ranks run it."""
    import ray

    def gather(learner):
        from transfer.weights.base import full_tensor

        return {n: full_tensor(p).detach().cpu().clone() for n, p in learner.model.named_parameters()}

    return ray.get([a.apply.remote(gather) for a in cluster.learners.actors])[0]


def assert_engines_hold(cluster, state: dict, version: int | str | None) -> None:
    """Every engine serves ``version`` (None: not checked) and holds exactly ``state`` (numpy
    arrays or tensors, in the learners' dtype), bit for bit, in that dtype."""
    for client in cluster.engine_clients():
        if version is not None:
            assert client.get_weight_version() == str(version)
        for name, want in state.items():
            want = _tensor(want)
            what = f"{client.name}: {name}"
            got = engine_bits(client.get_weights_by_name(name), want.dtype, what)
            np.testing.assert_array_equal(got, bits(want).reshape(got.shape), err_msg=what)


def assert_each_sample_on_one_rank(cluster, ref, expected: int) -> None:
    """The partitions cover the step's samples exactly once, evenly, as the engines sampled them."""
    from rl.types import RolloutBatch

    store = data_path(cluster.cfg.transfer).build(cluster.runtime)
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
