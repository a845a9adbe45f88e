"""How a learner rank groups a mini-batch into micro-batches, one forward (and backward) pass
each. A micro-batch is an index array into the mini-batch; the learner right-pads it to its
longest sample (``Learner._pack``), so it costs ``len(idx) x max(lengths[idx])`` token slots.

- ``fixed_size``: ``algo.micro_batch_size`` samples at a time, in order (the default);
- ``by_token_budget``: ``algo.max_tokens_per_micro_batch``: samples sorted by length, longest
  first, packed so that each micro-batch's padded size stays within the budget (slime's
  ``--use-dynamic-batch-size --max-tokens-per-gpu``, verl's dynamic batch size; here the
  budget bounds the padded size, since the learner pads rather than packs sequences);
- ``split_to``: split micro-batches until there are ``count`` of them, for the ranks that
  formed fewer than the rank with the most (FSDP: every rank runs as many passes).

Grouping never changes the loss: every ``algo.loss_agg`` mode sums per-sample terms over the
micro-batches and divides by a count of the whole mini-batch (``rl.algo.agg_sum``).
"""

from __future__ import annotations

import numpy as np


def fixed_size(n: int, size: int) -> list[np.ndarray]:
    """``[0, size), [size, 2 size), ...`` of ``n`` samples."""
    return [np.arange(start, min(start + size, n)) for start in range(0, n, size)]


def by_token_budget(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Samples sorted by length (longest first, ties in index order), swept into micro-batches
    whose padded size, samples x the longest of them, stays within ``budget`` tokens.

    In this order a micro-batch's longest sample is its first, so whether one more sample
    fits depends only on how many it holds: first-fit decreasing would never put a sample
    into an earlier micro-batch than the sweep does, and the sweep is what it reduces to."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > budget:
        raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds algo.max_tokens_per_micro_batch="
                         f"{budget}; raise it to at least rollout.max_prompt_tokens + "
                         f"rollout.max_new_tokens")
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    while start < len(order):
        fit = max(1, budget // int(lengths[order[start]]))  # samples of the first one's length
        groups.append(order[start:start + fit])
        start += fit
    return groups


def split_to(groups: list[np.ndarray], lengths: np.ndarray, count: int) -> list[np.ndarray]:
    """``groups`` with the one of the largest padded size split in two halves (in place, so a
    sorted order stays sorted) until there are ``count``; a half is never larger than its
    whole, so a budget the groups kept still holds."""
    assert count <= sum(len(g) for g in groups), (count, [len(g) for g in groups])
    groups = list(groups)
    while len(groups) < count:
        i = max((j for j, g in enumerate(groups) if len(g) > 1),
                key=lambda j: len(groups[j]) * int(lengths[groups[j]].max()))
        g, half = groups[i], (len(groups[i]) + 1) // 2
        groups[i:i + 1] = [g[:half], g[half:]]
    return groups


def padded_slots(groups: list[np.ndarray], lengths: np.ndarray) -> int:
    """Token slots the padded micro-batches hold (real tokens and padding)."""
    return sum(len(g) * int(lengths[g].max()) for g in groups)
