"""Fully async rollout (``train_async.py rollout.fully_async=true``): groups streamed one by
one on a thread of the rollout manager, batches formed from the first groups that finish,
queued as store refs.

A group (one prompt, its ``n_samples_per_prompt`` samples from one call of the rollout
function: one request with the default) is **admitted** only when

* it fits the store: groups admitted and not yet handed out stay within
  ``rollout.max_inflight_batches`` batches, so the store never holds more than that many;
* it can be trained within ``algo.max_staleness`` versions: batch ``b`` is trained by the
  weights of version ``b``, so under version ``V`` at most ``(V + max_staleness + 1) *
  prompts_per_step`` groups may have started (AReaL's admission rule). Staleness is bounded
  when a group starts, not by throwing its samples away once generated. A whole batch the
  safety net drops (below) shifts this by one: the step trains the next batch instead.

Admitted groups run concurrently on the engines (each request to the least-loaded live
engine), and batches are formed from the groups that have finished, so the slowest answers
of a batch no longer hold the engines idle. A group admitted under version ``V`` has a
**deadline**, ``V + max_staleness``: the last batch that may train it. Batch ``b`` takes the
``prompts_per_step`` finished groups of earliest deadline (in the order they finished among
equals), and is formed only when every group left, running or finished, can still be placed
before its deadline (for every deadline ``d``, at most ``(d - b) * prompts_per_step`` of
them have a deadline up to ``d``); otherwise it waits for the running groups it must hold.
So a group overtaken by those admitted after it is waited for by the batch of its deadline,
not dropped. Admission keeps that possible: at most ``(d + 1) * prompts_per_step`` groups
ever have a deadline up to ``d``. ``next_batch`` still drops samples older than the bound
(the safety net, counted in ``async/dropped_samples``): a rollout function may return
samples of older weights than those it started under (a cache of answers, say).

The driver takes batches with ``next_batch`` and calls ``release`` after the weight sync
that follows a batch's training step: the version moves on and the batch's place in the
store is free, which admits the next groups.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import numpy as np

from rl.rollout.client import EngineError
from rl.types import RolloutRef

logger = logging.getLogger(__name__)

OUTCOMES = ("trained", "stale", "end_of_run", "interrupted")
"""What became of a stored sample (``samples.jsonl``): trained at a step; dropped as older than
``algo.max_staleness``; still queued when the run ended; or in the batch being trained when
the run was stopped (Ctrl-C or an error), its step not finished."""


def admission_limit(version: int, released: int, skipped: int, max_staleness: int,
                    max_inflight: int) -> int:
    """Batches' worth of groups that may have been admitted: within the store's
    ``max_inflight`` batches beyond those ``released``, and trainable within
    ``max_staleness`` versions of ``version``. ``skipped`` whole batches were dropped (each
    moves every later batch one step ahead of the step that trains it, and gave back its
    groups' places)."""
    return min(released + max_inflight, version + max_staleness + 1 + skipped)


def deadline(version: int, skipped: int, max_staleness: int) -> int:
    """The last batch (by the stream's count) that may train a group admitted now."""
    return version + max_staleness + skipped


def batch_groups(step: int, finished: list[int], running: list[int], per_batch: int) -> list[int]:
    """Which finished groups form batch ``step``, given the deadlines of the groups finished
    (in the order they finished) and of those still running: the ``per_batch`` of earliest
    deadline, or none (wait) while a group left could then miss its deadline and a running
    one could still change that (see the module docstring). With none running, the batch is
    formed regardless: waiting could not help, and the safety net drops what is too old."""
    if len(finished) < per_batch:
        return []
    order = sorted(range(len(finished)), key=lambda i: finished[i])  # stable: first finished first
    take = order[:per_batch]
    if running:
        left = sorted([finished[i] for i in order[per_batch:]] + running)
        if any(k + 1 > (d - step) * per_batch for k, d in enumerate(left)):
            return []
    return sorted(take)


class Stream:
    """The group stream of fully async rollout (see the module docstring).

    The ledger has one entry per stored batch: its prompts, first sample id, each sample's
    weight version and outcome (``OUTCOMES``), and the step it was trained at. Groups still
    generating, or finished but not yet a whole batch, when the run ends are never stored and
    not in the ledger; a resumed run draws their prompts again (``resume_position``)."""

    def __init__(self, manager, first_step: int, max_inflight: int, max_staleness: int) -> None:
        self.manager = manager
        self.per_batch = manager.cfg.rollout.prompts_per_step
        self.max_inflight = max_inflight
        self.max_staleness = max_staleness
        self.version = first_step
        """The weights the engines hold (the driver pushed ``first_step`` before starting)."""
        self.released = first_step
        """Batches handed out and finished with (trained or dropped): their store place is free."""
        self.admitted = first_step * self.per_batch
        """Groups admitted, counted from the run's first step."""
        self.ready: collections.deque[RolloutRef] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.ledger: dict[int, dict] = {}  # batch index -> entry
        self.open_prompts: dict[int, dict] = {}
        """Prompt index -> data position before it, for prompts drawn and not yet handed out."""
        self.done_prompts: set[int] = set()
        """Prompts handed out (trained or dropped) ahead of the oldest open one."""
        self.dropped_total = 0
        self.skipped = 0
        """Whole batches dropped by the safety net (``admission_limit``, ``deadline``)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._freed: asyncio.Event | None = None
        """Set from the driver's thread when a place frees (``_wake``): the generation loop
        admits at once instead of at its next poll."""
        self.thread = threading.Thread(target=self._produce, args=(first_step,),
                                       name="rollout-stream", daemon=True)
        self.thread.start()

    # -- the generation thread ---------------------------------------------------------
    def may_admit(self) -> bool:
        with self.cond:
            limit = admission_limit(self.version, self.released, self.skipped, self.max_staleness,
                                    self.max_inflight)
            return self.admitted < limit * self.per_batch

    def _produce(self, step: int) -> None:
        try:
            asyncio.run(self._generate(step))
        except Exception as e:  # handed to the driver by next_batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    async def _generate(self, step: int) -> None:
        import aiohttp  # start-up cost: only the manager's process generates

        m = self.manager
        self._loop, self._freed = asyncio.get_running_loop(), asyncio.Event()
        pending: dict[asyncio.Future, tuple] = {}  # request -> (prompt, ids, started at, deadline)
        finished: list[tuple] = []  # groups answered, not yet a whole batch
        retried = m.pool.retried
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            ctx = m.context(session)
            try:
                while not self.stopping.is_set():
                    while self.may_admit():
                        prompt, position = m.draw_prompt()
                        [ids] = m.encode([prompt])
                        with self.cond:
                            self.open_prompts[prompt.index] = position
                            self.admitted += 1
                        with self.cond:
                            due = deadline(self.version, self.skipped, self.max_staleness)
                        request = asyncio.ensure_future(m.rollout_fn.group(ctx, prompt, ids))
                        pending[request] = (prompt, ids, time.time(), due)
                    # a request finishing or a place freeing (the poll: for `stopping`); cleared
                    # before admission is checked again, so no release between the two is missed
                    freed = asyncio.ensure_future(self._freed.wait())
                    done, _ = await asyncio.wait([*pending, freed], timeout=0.1,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    freed.cancel()
                    self._freed.clear()
                    for request in done - {freed}:
                        prompt, ids, started, due = pending.pop(request)
                        try:
                            finished.append((prompt, ids, request.result(), started, due))
                        except EngineError:
                            m.raise_if_all_down()
                            raise
                    while (take := batch_groups(step, [g[4] for g in finished],
                                                [p[3] for p in pending.values()], self.per_batch)):
                        groups = [finished[i] for i in take]
                        finished = [g for i, g in enumerate(finished) if i not in take]
                        started = min(g[3] for g in groups)
                        ref = m.store_batch(step, [g[0] for g in groups], [g[2] for g in groups],
                                            started=started, gen_s=time.time() - started,
                                            retried=m.pool.retried - retried)
                        retried = m.pool.retried
                        with self.cond:
                            self.ledger[step] = {"batch": step, "prompts": ref.prompt_indices,
                                                 "first_sample_id": ref.first_sample_id,
                                                 "weight_version": ref.weight_versions,
                                                 "outcome": [None] * ref.num_samples,
                                                 "trained_at_step": None}
                            self.ready.append(ref)
                            self.cond.notify_all()
                        step += 1
            finally:  # stopping, or a request failed: no request outlives the stream
                for request in pending:
                    request.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    # -- the driver's side ---------------------------------------------------------------
    def next_batch(self, step: int, max_staleness: int) -> RolloutRef:
        """The oldest queued batch with a sample fresh enough for ``step``; batches with none
        are dropped on the way (removed from the store, their place given back)."""
        min_version = step - max_staleness
        dropped = 0
        while True:
            with self.cond:
                while not self.ready:
                    if self.error is not None:
                        raise RuntimeError(f"rollout generation failed: {self.error!r}") from self.error
                    if self.stopping.is_set():
                        raise RuntimeError("the rollout stream was stopped")
                    self.cond.wait(timeout=1.0)
                ref = self.ready.popleft()
                depth = len(self.ready)
                for index in ref.prompt_indices:
                    self.open_prompts.pop(index, None)
                    self.done_prompts.add(index)
                oldest = min(self.open_prompts, default=None)
                self.done_prompts = {i for i in self.done_prompts if oldest is not None and i > oldest}
            ref.min_version = min_version
            kept = ref.kept()
            entry = self.ledger[ref.step]
            for i in np.flatnonzero(~kept):
                entry["outcome"][i] = "stale"
            dropped += int((~kept).sum())
            if kept.any():
                break
            self.manager.store.remove(ref.partitions)
            with self.cond:
                self.released += 1
                self.skipped += 1  # this step trains the next batch: admit and date by one more
            self._wake()
        self.dropped_total += dropped
        lag = step - np.asarray(ref.weight_versions)[kept]
        ref.stats.update({"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
                          "async/dropped_samples": float(dropped),
                          "async/dropped_total": float(self.dropped_total),
                          "async/queue_depth": float(depth)})
        return ref

    def release(self, ref: RolloutRef, step: int) -> None:
        """``ref`` was trained on at ``step`` and the weights of ``step + 1`` are on the
        engines: record it, move the version on, free its place (admits the next groups)."""
        with self.cond:
            entry = self.ledger[ref.step]
            entry["trained_at_step"] = step
            entry["outcome"] = [o or "trained" for o in entry["outcome"]]
            self.released += 1
            self.version = max(self.version, step + 1)
        self._wake()

    def _wake(self) -> None:
        """From the driver's thread: a place freed, admit now."""
        loop, freed = self._loop, self._freed
        if loop is not None and freed is not None:
            try:
                loop.call_soon_threadsafe(freed.set)
            except RuntimeError:  # the generation loop has ended
                pass

    def resume_position(self) -> dict:
        """The manager's state for a checkpoint taken now: the data position before the
        oldest prompt not yet handed out, the prompts after it that were (so a resumed run
        draws each of them never again), and the first sample id not yet handed out."""
        m = self.manager
        with self.cond:
            state = m.state_dict()
            if self.open_prompts:
                oldest = min(self.open_prompts)
                state["task"] = self.open_prompts[oldest]
            else:
                oldest = None
            if oldest is not None:  # done prompts below the oldest open one need no entry
                state["skip"] = sorted(i for i in set(state["skip"]) | self.done_prompts if i > oldest)
            if self.ready:
                state["next_sample_id"] = self.ready[0].first_sample_id
        return state

    def stop(self) -> list[dict]:
        self.stopping.set()
        self.thread.join(timeout=self.manager.cfg.rollout.request_timeout_s + 30)
        if self.thread.is_alive():
            logger.warning("the generation thread did not stop; a batch it still stores would be "
                           "left behind")
        with self.cond:
            leftover = list(self.ready)
            self.ready.clear()
        for ref in leftover:
            entry = self.ledger[ref.step]
            entry["outcome"] = [o or "end_of_run" for o in entry["outcome"]]
            self.manager.store.remove(ref.partitions)
        for entry in self.ledger.values():  # handed out, its step cut short
            entry["outcome"] = [o or "interrupted" for o in entry["outcome"]]
        return [self.ledger[k] for k in sorted(self.ledger)]
