"""The learner's batch handling in this process: packing keeps sampled ids and masks
everything outside the response, the split over ranks is even and balanced, and flat groups
are counted and masked. Gradients and steps on spawned ranks: tests/integration/test_learner.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.runtime import Runtime
from tests.support.batches import grouped_batch, make_batch
from tests.support.env import compose


def test_pack_keeps_sampled_ids_and_masks_outside_the_response(tiny_path):
    from rl.learner.learner import Learner

    learner = Learner(compose(), Runtime("t", "/tmp", tiny_path), 0, 1)
    learner.pad_id, learner.device = 0, torch.device("cpu")
    batch = make_batch(6, seed=1)
    mb = learner._pack(batch)
    for i in range(len(batch)):
        p, r, n = int(batch.prompt_len[i]), int(batch.response_len[i]), len(batch.tokens[i])
        assert mb["ids"][i, :n].tolist() == batch.tokens[i].tolist()  # exactly as sampled
        assert mb["ids"][i, n:].eq(0).all() and mb["attn"][i, n:].eq(0).all()
        expect = np.zeros(mb["mask"].shape[1], dtype=np.float32)
        expect[p - 1:p - 1 + r] = batch.loss_mask[i]
        np.testing.assert_array_equal(mb["mask"][i].numpy(), expect)
        # position p-1+j predicts response token j
        np.testing.assert_array_equal(mb["rollout_logp"][i, p - 1:p - 1 + r].numpy(),
                                      batch.rollout_logprobs[i])
    assert mb["mask"][0].sum() == batch.response_len[0] - 1  # its last token was masked
    assert mb["adv"].shape == (len(batch),)  # one advantage a sample
    # with a per-token advantage (algo.turn_credit) it sits where the response's log-probs do
    rng = np.random.default_rng(0)
    batch.token_advantages = [rng.normal(size=int(r)).astype(np.float32) for r in batch.response_len]
    batch.__post_init__()
    mb = learner._pack(batch)
    assert mb["adv"].shape == mb["mask"].shape
    for i in range(len(batch)):
        p, r = int(batch.prompt_len[i]), int(batch.response_len[i])
        expect = np.zeros(mb["adv"].shape[1], dtype=np.float32)
        expect[p - 1:p - 1 + r] = batch.token_advantages[i]
        np.testing.assert_array_equal(mb["adv"][i].numpy(), expect)


def test_split_balanced_is_even_and_balanced():
    from rl.rollout.batch import split_balanced

    lengths = np.array([10, 1, 9, 2, 8, 3, 7, 4])
    parts = split_balanced(lengths, 2)
    assert sorted(sum(parts, [])) == list(range(8)) and all(len(p) == 4 for p in parts)
    loads = [int(lengths[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= 2
    with pytest.raises(AssertionError):
        split_balanced(lengths[:7], 2)


# -- drop_zero_std_groups ---------------------------------------------------------------------
def test_zero_std_groups_counts_and_masks_only_flat_groups():
    from rl.rollout.batch import zero_std_groups

    b = grouped_batch()
    before = [m.copy() for m in b.loss_mask]
    assert zero_std_groups(b, 4, drop=False) == 2
    assert all(np.array_equal(m, m0) for m, m0 in zip(b.loss_mask, before))  # counted only
    assert zero_std_groups(b, 4, drop=True) == 2
    for i in range(16):
        if 4 <= i < 8 or 12 <= i < 16:
            assert b.loss_mask[i].dtype == before[i].dtype and not b.loss_mask[i].any(), i
            assert len(b.loss_mask[i]) == len(before[i])
        else:
            assert np.array_equal(b.loss_mask[i], before[i]), i
    # nearly equal is not equal; groups of 2; no flat group at all
    b2 = grouped_batch()
    b2.rewards = np.array([0.5, 0.5000001] + [1.0, 1.0] + [0.0, 1.0] * 6, dtype=np.float32)
    assert zero_std_groups(b2, 2, drop=True) == 1
    assert [bool(m.any()) for m in b2.loss_mask[:6]] == [True, True, False, False, True, True]
    b3 = grouped_batch()
    b3.rewards = np.tile(np.array([0, 1], dtype=np.float32), 8)
    assert zero_std_groups(b3, 4, drop=True) == 0
    assert all(np.array_equal(m, m0) for m, m0 in zip(b3.loss_mask, before))
