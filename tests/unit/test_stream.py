"""Fully async batch formation (``rl.rollout.stream.batch_groups``): groups ordered by
deadline, a batch held for a running group it must take, and, in a simulated stream under
the admission rule with groups of very uneven durations, no group trained past its bound,
where forming batches in finishing order would train some too late."""

from __future__ import annotations

import random

import pytest

from rl.rollout.stream import admission_limit, batch_groups, deadline


def test_earliest_deadlines_first_and_a_batch_waits_for_a_group_due_in_it():
    assert batch_groups(0, [3, 1, 2], [], 2) == [1, 2]  # deadlines 1 and 2 first, in finishing order
    assert batch_groups(0, [1], [], 2) == []  # not a whole batch yet
    # a running group due in batch 1: batch 0 may go ahead, batch 1 waits for it
    assert batch_groups(0, [2, 2], [1], 2) == [0, 1]
    assert batch_groups(1, [2, 2], [1], 2) == []
    assert batch_groups(1, [2, 1], [], 2) == [0, 1]
    # two groups due in batch 1 and a batch of one each: batch 0 must take one of them
    assert batch_groups(0, [2], [1, 1], 1) == []
    # nothing running: waiting cannot help, the batch forms (the safety net drops the too old)
    assert batch_groups(3, [1, 5], [], 2) == [0, 1]


def _simulate(form, seed: int, per_batch: int = 4, staleness: int = 1, inflight: int = 2,
              steps: int = 60, old: float = 0.0) -> tuple[int, int]:
    """A stream and a driver in ticks, with the stream's own arithmetic (``admission_limit``,
    ``deadline``): groups admitted as ``Stream.may_admit`` admits them, each running 1-6
    ticks or, one in five, 10-40; a fraction ``old`` of them report answers too old to train
    (a batch of only those is dropped whole, and the step takes the next one); batches formed
    by ``form``; the driver trains one queued batch in 3 ticks, then the version moves on.
    (steps trained, groups trained past their bound)."""
    rng = random.Random(seed)
    version = released = admitted = skipped = 0
    running: list[tuple[int, int, int, bool]] = []  # (finishes at, deadline, admitted under, old)
    finished: list[tuple[int, int, bool]] = []  # (deadline, admitted under, old), in finishing order
    queued: list[list[tuple[int, int, bool]]] = []
    late = batch = training_until = 0
    training: list | None = None
    for tick in range(100_000):
        while admitted < admission_limit(version, released, skipped, staleness, inflight) * per_batch:
            long = rng.random() < 0.2
            running.append((tick + (rng.randint(10, 40) if long else rng.randint(1, 6)),
                            deadline(version, skipped, staleness), version, rng.random() < old))
            admitted += 1
        finished += [g[1:] for g in running if g[0] <= tick]
        running = [g for g in running if g[0] > tick]
        while take := form(batch, [g[0] for g in finished], [g[1] for g in running], per_batch):
            queued.append([finished[i] for i in take])
            finished = [g for i, g in enumerate(finished) if i not in take]
            batch += 1
        if training is not None and tick >= training_until:
            late += sum(not o and version - v > staleness for _, v, o in training)  # trained at `version`
            version += 1
            released += 1
            training = None
            if version == steps:
                return version, late
        while training is None and queued:
            training, training_until = queued.pop(0), tick + 3
            if all(o for _, _, o in training):  # the safety net: nothing fresh, dropped whole
                training, released, skipped = None, released + 1, skipped + 1
    raise AssertionError("the stream stalled")


def _finishing_order(step, finished, running, per_batch):
    return list(range(per_batch)) if len(finished) >= per_batch else []


@pytest.mark.parametrize("seed", range(5))
def test_no_group_is_trained_past_its_bound_under_uneven_durations(seed):
    assert _simulate(batch_groups, seed) == (60, 0)
    assert _simulate(batch_groups, seed, per_batch=2, staleness=0, inflight=2) == (60, 0)
    assert _simulate(batch_groups, seed, per_batch=8, staleness=2, inflight=3) == (60, 0)


@pytest.mark.parametrize("seed", range(5))
def test_batches_dropped_whole_neither_stall_the_stream_nor_make_others_late(seed):
    """Groups that report answers too old (one in three, one group a batch: many batches
    dropped whole, far more than ``max_staleness``): each dropped batch shifts admission and
    deadlines by one, so the run goes on and the other groups stay within the bound."""
    assert _simulate(batch_groups, seed, per_batch=1, staleness=1, inflight=2, old=0.3) == (60, 0)
    assert _simulate(batch_groups, seed, per_batch=1, staleness=0, inflight=2, old=0.3) == (60, 0)
    assert _simulate(batch_groups, seed, per_batch=4, staleness=1, inflight=2, old=0.5) == (60, 0)


def test_finishing_order_alone_trains_some_groups_too_late():
    """The same streams with batches in finishing order (as before deadlines): groups miss
    their bound, which is what the safety net used to drop."""
    assert sum(_simulate(_finishing_order, seed)[1] for seed in range(5)) > 0
