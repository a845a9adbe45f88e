"""Rollout data for the tests: a random ``RolloutBatch`` of tiny-model token ids, and the
batch of groups some of whose rewards are all equal, the exact comparison of two decoded
column dicts (dtype, shape and every value), and the check of dumped per-token advantages."""

from __future__ import annotations

import numpy as np

from rl.rollout.batch import grpo_advantages, model_turns, turn_advantages
from rl.types import RolloutBatch
from transfer.data.base import Ragged


def make_batch(n: int, seed: int = 0, vocab: int = 49, response: tuple[int, int] = (1, 6)) -> RolloutBatch:
    """``n`` samples: prompts of 2-4 tokens, responses of ``response`` (inclusive) tokens."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(2, 5, n).astype(np.int32)
    rlen = rng.integers(response[0], response[1] + 1, n).astype(np.int32)
    tokens = [rng.integers(3, vocab, p + r).astype(np.int32) for p, r in zip(plen, rlen)]
    masks = [np.ones(r, dtype=np.int8) for r in rlen]
    masks[0][-1] = 0  # a masked response token must not count
    return RolloutBatch(
        tokens=tokens, loss_mask=masks,
        rollout_logprobs=[rng.normal(-3, 0.1, r).astype(np.float32) for r in rlen],
        prompt_len=plen, response_len=rlen, rewards=rng.random(n).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32), group_id=np.arange(n) // 4,
        sample_id=np.arange(n), weight_version=np.zeros(n, dtype=np.int64),
        finish_reason=["stop"] * n, label=["x"] * n)


FLAT_REWARDS = np.array([1, 0, 1, 0,  1, 1, 1, 1,  0.5, 0, 0, 1,  0, 0, 0, 0], dtype=np.float32)
"""Four groups of 4: the second and fourth have all-equal rewards."""


def grouped_batch() -> RolloutBatch:
    """``make_batch(16)`` in four groups of 4 with ``FLAT_REWARDS`` and their advantages."""
    b = make_batch(16, seed=2)
    b.rewards = FLAT_REWARDS.copy()
    b.advantages = grpo_advantages(b.rewards, 4)
    b.group_id = np.arange(16) // 4
    return b


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)  # names and order
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, Ragged):  # flat stays flat: values and offsets, dtype and shape
            assert isinstance(y, Ragged), (name, type(y))
            for u, v in ((x.values, y.values), (x.offsets, y.offsets)):
                assert v.dtype == u.dtype and v.shape == u.shape, name
                np.testing.assert_array_equal(v, u)
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape, name
            np.testing.assert_array_equal(y, x)
        elif isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(y) == len(x)
            for u, v in zip(x, y):
                assert v.dtype == u.dtype and v.shape == u.shape, name
                np.testing.assert_array_equal(v, u)
        else:
            assert y == x and [type(v) for v in (y or [])] == [type(v) for v in (x or [])] \
                if isinstance(x, list) else y == x, name


def assert_turn_advantages(samples: list[dict], task) -> int:
    """Dumped samples (``rollout.dump_every``) of a run with ``algo.turn_credit=true`` and the
    default ``algo.advantage_std_norm``: each sample's per-token advantages are its group's
    turn rewards (``task.turn_rewards``) through ``turn_advantages``, one value a model turn,
    0 on the environment's tokens. Returns the number of groups."""
    import pytest

    groups: dict[tuple, list[dict]] = {}
    for d in samples:
        groups.setdefault((d["step"], d["prompt_index"]), []).append(d)
    for g in groups.values():
        turns = [model_turns(d["loss_mask"]) for d in g]
        rewards = [task.turn_rewards(d["scored_text"], d["label"], d["finished"], len(t))
                   for d, t in zip(g, turns)]
        for d, t, adv in zip(g, turns, turn_advantages(rewards)):
            want = np.zeros(len(d["loss_mask"]))
            for (start, end), v in zip(t, adv):
                want[start:end] = v
            assert d["token_advantages"] == pytest.approx(want.tolist(), abs=1e-5), d
    return len(groups)
