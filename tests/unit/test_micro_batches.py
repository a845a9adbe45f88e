"""Grouping a mini-batch into micro-batches (``rl.learner.micro_batches``): by a token budget,
every sample lands in exactly one micro-batch, longest first, each within the budget of
padded tokens, in as few micro-batches as sorted packing allows; splitting to the count of
the rank with the most keeps all of that. The learner's use of them, on spawned ranks:
tests/integration/test_learner.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.learner.micro_batches import by_token_budget, fixed_size, padded_slots, split_to


def _check(groups, lengths, budget):
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(len(lengths)))  # every sample exactly once
    assert all(len(g) for g in groups)
    # sorted: longest first over the whole sweep, ties in index order
    assert np.all(np.diff(lengths[flat]) <= 0)
    for g in groups:
        assert len(g) * lengths[g].max() <= budget  # the padded size _pack allocates
    return flat


def test_packs_sorted_within_the_budget_by_hand():
    lengths = np.array([5, 40, 12, 40, 7, 30, 12, 3])
    groups = by_token_budget(lengths, 80)
    # 40, 40 (80) | 30, 12, 12 would be 90: 30, 12 (60) | 12, 7, 5, 3 (48)
    assert [g.tolist() for g in groups] == [[1, 3], [5, 2], [6, 4, 0, 7]]
    assert padded_slots(groups, lengths) == 80 + 60 + 48
    # a budget that holds everything: one micro-batch
    assert [g.tolist() for g in by_token_budget(lengths, 320)] == [[1, 3, 5, 2, 6, 4, 0, 7]]
    # the smallest budget allowed (the longest sample): the long ones alone, the short ones together
    assert [g.tolist() for g in by_token_budget(lengths, 40)] == [[1], [3], [5], [2, 6, 4], [0, 7]]


def test_a_sample_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="exceeds algo.max_tokens_per_micro_batch=10"):
        by_token_budget(np.array([3, 11]), 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=64), st.integers(512, 4096))
def test_budget_respected_every_sample_once_sorted(lengths, budget):
    lengths = np.asarray(lengths)
    groups = by_token_budget(lengths, budget)
    _check(groups, lengths, budget)
    # as few as the sweep allows: no micro-batch could take the next one's first sample
    for g, nxt in zip(groups, groups[1:]):
        assert (len(g) + 1) * lengths[g].max() > budget
        assert lengths[nxt[0]] <= lengths[g].min()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=64), st.integers(512, 4096), st.data())
def test_split_to_a_larger_count_keeps_every_property(lengths, budget, data):
    lengths = np.asarray(lengths)
    groups = by_token_budget(lengths, budget)
    count = data.draw(st.integers(len(groups), len(lengths)))
    split = split_to(groups, lengths, count)
    assert len(split) == count
    _check(split, lengths, budget)
    assert padded_slots(split, lengths) <= padded_slots(groups, lengths)  # splitting never adds padding


def test_split_halves_the_largest_micro_batch_first():
    lengths = np.array([10, 10, 10, 10, 2, 2, 2, 2])
    groups = by_token_budget(lengths, 40)  # [0..3] (40), [4..7] (8)
    assert [g.tolist() for g in split_to(groups, lengths, 3)] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert len(split_to(groups, lengths, 8)) == 8


def test_fixed_size_is_in_order():
    assert [g.tolist() for g in fixed_size(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
