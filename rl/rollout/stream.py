"""Fully async rollout (``train_async.py rollout.fully_async=true``): batches generated one
after another on a thread of the rollout manager, queued as store refs.

The driver takes them with ``RolloutManager.next_batch`` (too-stale samples dropped and
counted) and gives each slot back with ``release`` after the weight sync, so the next batch
starts on the new weights.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np

from rl.rollout.fanout import Stopped
from rl.types import RolloutRef

logger = logging.getLogger(__name__)


class Stream:
    """Fully async rollout: batches are generated one after another on a thread and queued
    as store refs. A slot of ``max_inflight`` is taken before a batch starts and given back
    by ``release`` (after the weight sync that follows its training step) or when it is
    dropped, so the store never holds more than ``max_inflight`` batches and a sample is at
    most ``max_inflight - 1`` versions older than the weights it is trained against.

    The ledger has one entry per stored batch: each sample's outcome is ``trained`` (with
    the step), ``stale`` (older than ``algo.max_staleness`` allows) or ``end_of_run`` (still
    queued when the run ended); a generation abandoned at the end stores nothing."""

    def __init__(self, manager, first_step: int, max_inflight: int) -> None:
        self.manager = manager
        self.slots = threading.Semaphore(max_inflight)
        self.ready: collections.deque[RolloutRef] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.ledger: dict[int, dict] = {}  # batch index -> entry
        self.positions: dict[int, dict] = {}  # batch index -> data position before its prompts
        self.dropped_total = 0
        self.thread = threading.Thread(target=self._produce, args=(first_step,),
                                       name="rollout-stream", daemon=True)
        self.thread.start()

    def _produce(self, step: int) -> None:
        try:
            while not self.stopping.is_set():
                if not self.slots.acquire(timeout=0.2):
                    continue
                with self.cond:
                    self.positions[step] = self.manager.state_dict()
                ref = self.manager.generate(step, stop=self.stopping)
                with self.cond:
                    self.ledger[step] = {"batch": step, "first_sample_id": ref.first_sample_id,
                                         "weight_version": ref.weight_versions,
                                         "outcome": [None] * ref.num_samples, "trained_at_step": None}
                    self.ready.append(ref)
                    self.cond.notify_all()
                step += 1
        except Stopped:
            pass
        except Exception as e:  # handed to the driver by next_batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def next_batch(self, step: int, max_staleness: int) -> RolloutRef:
        """The oldest queued batch with a sample fresh enough for ``step``; batches with none
        are dropped on the way (removed from the store, their slot given back)."""
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
                self.positions.pop(ref.step)
            ref.min_version = min_version
            kept = ref.kept()
            entry = self.ledger[ref.step]
            for i in np.flatnonzero(~kept):
                entry["outcome"][i] = "stale"
            dropped += int((~kept).sum())
            if kept.any():
                break
            self.manager.store.remove(ref.partitions)
            self.slots.release()
        self.dropped_total += dropped
        lag = step - np.asarray(ref.weight_versions)[kept]
        ref.stats.update({"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
                          "async/dropped_samples": float(dropped),
                          "async/dropped_total": float(self.dropped_total),
                          "async/queue_depth": float(depth)})
        return ref

    def resume_position(self) -> dict:
        """The data position a resumed run starts from: before the oldest batch not yet
        handed out (queued batches are generated again after a resume)."""
        with self.cond:
            return self.positions[min(self.positions)] if self.positions else self.manager.state_dict()

    def release(self, ref: RolloutRef, step: int) -> None:
        """``ref`` was trained on at ``step`` (its data is already removed): record it, free
        its slot."""
        with self.cond:
            entry = self.ledger[ref.step]
            entry["trained_at_step"] = step
            entry["outcome"] = [o or "trained" for o in entry["outcome"]]
        self.slots.release()

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
        return [self.ledger[k] for k in sorted(self.ledger)]
