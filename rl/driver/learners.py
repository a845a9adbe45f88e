"""The learner ranks as one object (``LearnerGroup``), and what the driver says when one dies.

Each call fans out to every rank and returns rank 0's answer. When a call fails and some
rank's actor is gone, it raises ``LearnerDied`` naming that rank (the first error to arrive
is often a surviving rank's broken collective); ``Cluster.__exit__`` then prints the command
that resumes the run (``rl.driver.run.resume_hint``). A push that fails on an engine raises
``EngineUpdateFailed`` naming the engines that gave no answer.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import ray

from rl.config import Config
from rl.driver.placement import in_bundle
from rl.learner.actor import LearnerActor
from rl.log import first_line
from rl.runtime import Runtime

logger = logging.getLogger(__name__)


class LearnerGroup:
    """All learner ranks as one object: each call fans out and returns rank 0's answer.
    When a call fails and some rank's actor is gone, it raises ``LearnerDied`` naming that
    rank (the first error to arrive is often a surviving rank's broken collective)."""

    def __init__(self, cfg: Config, runtime: Runtime, pg) -> None:
        n = cfg.cluster.num_learners
        cls = ray.remote(LearnerActor)
        self.actors = [cls.options(num_cpus=0, num_gpus=cfg.cluster.gpus_per_learner or None,
                                   scheduling_strategy=in_bundle(pg, r)).remote(cfg, runtime, r, n)
                       for r in range(n)]
        self._ray = ray
        self.dead: dict[int, str] = {}
        """Ranks found dead, with why (filled when a call fails)."""
        # Each rank sets up (process group, model, store client) from here on, while the
        # caller goes on; ``wait_set_up`` waits. A rank runs its calls in order, and Ray
        # hands every rank rank 0's rendezvous address once rank 0 has answered.
        self._where = [a.apply.remote(pid_and_node) for a in self.actors]
        rendezvous = self.actors[0].call.remote("address")
        self._setting_up = [a.apply.remote(_set_up, rendezvous) for a in self.actors]
        self.where: list[tuple[int, str]] = [(0, "?")] * n
        """(pid, node IP) of each rank, to name a dead one (known after ``wait_set_up``)."""

    def wait_set_up(self) -> list[str | None]:
        """Wait for every rank's setup; returns each rank's store ``location`` (where its
        partitions are put)."""
        self.where = self._ray.get(self._where)
        logger.info("learner ranks: %s", ", ".join(f"{r} (pid {pid} on {node})"
                                                   for r, (pid, node) in enumerate(self.where)))
        return self._gather(self._setting_up)

    def _all(self, method: str, *args, timeout: float | None = None) -> list:
        return self._gather([a.call.remote(method, *args) for a in self.actors], timeout)

    def _gather(self, refs: list, timeout: float | None = None) -> list:
        # ray.get of a list raises as soon as any call fails, without waiting for the rest
        try:
            return self._ray.get(refs, timeout=timeout)
        except self._ray.exceptions.RayError as e:
            if self.find_dead():
                raise LearnerDied(self.describe_dead()) from e
            raise

    def find_dead(self, timeout_s: float = 5.0) -> dict[int, str]:
        """Ping every rank (bounded): those whose actor is gone join ``self.dead``. A rank
        still busy after ``timeout_s`` (e.g. blocked in a collective) counts as alive."""
        ray = self._ray
        pings = [a.__ray_ready__.remote() for a in self.actors]
        ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=0)
            except ray.exceptions.ActorDiedError as e:
                self.dead.setdefault(rank, death_reason(e))
            except ray.exceptions.GetTimeoutError:
                pass
        return self.dead

    def describe_dead(self) -> str:
        return "; ".join(f"learner rank {r} (pid {self.where[r][0]} on {self.where[r][1]}) died: {why}"
                         for r, why in sorted(self.dead.items()))

    def train(self, ref) -> dict[str, float]:
        return self._all("train", ref)[0]

    def run(self, fn, *args, rank0_only: bool = False) -> Any:
        """``fn(learner, *args)`` on every rank, in order with the ranks' other calls, and
        rank 0's answer; ``rank0_only`` for a ``fn`` that runs no collective."""
        actors = self.actors[:1] if rank0_only else self.actors
        return self._gather([a.apply.remote(fn, *args) for a in actors])[0]

    def connect_engines(self, receivers: list) -> None:
        self._all("connect_engines", receivers)

    def push_weights(self, version: int) -> dict[str, float]:
        return self._on_engines("push_weights", version)[0]

    def reconnect_engines(self, receivers: list, replaced: list[int]) -> None:
        self._on_engines("reconnect_engines", receivers, replaced)

    def _on_engines(self, method: str, *args) -> list:
        """``_all`` for calls that talk to the engines: when one fails on an engine, the
        error names the engines that gave no answer on every rank (each p2p sender has its
        own), as ``EngineUpdateFailed``."""
        ray = self._ray
        refs = [a.call.remote(method, *args) for a in self.actors]
        try:
            return self._gather(refs)  # LearnerDied when a rank is gone
        except ray.exceptions.RayError as e:
            ray.wait(refs, num_returns=len(refs), timeout=60)  # every rank leaves a failed push
            unanswered = []
            for ref in refs:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError as err:
                    unanswered += getattr(getattr(err, "cause", None), "unanswered", None) or []
            raise EngineUpdateFailed(first_line(e), unanswered) from e

    def full_state(self) -> dict:
        return self._all("full_state")[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def start_close(self) -> list:
        """Ask each set-up rank to close its store and sync parts; returns the refs to wait on
        (``Cluster.shutdown``, which then kills every rank). Not asked: a rank found dead,
        which cannot answer, and one still setting up or whose setup failed (the run stopped
        while it started, e.g. an engine failed): it would answer only once set up, and has
        nothing open that the kill does not end."""
        refs = []
        for rank, (actor, setup) in enumerate(zip(self.actors, self._setting_up)):
            if rank in self.dead:
                continue
            try:
                self._ray.get(setup, timeout=0)  # GetTimeoutError while it sets up
            except self._ray.exceptions.RayError:
                continue
            refs.append(actor.call.remote("close"))
        return refs


def _set_up(learner, rendezvous: tuple[str, int]) -> str | None:
    """One rank's setup, run in its actor (``LearnerGroup``); the store client is open before
    the first put. Returns the client's ``location``."""
    learner.setup(*rendezvous)
    return learner.connect_store()


class LearnerDied(RuntimeError):
    """A learner rank's actor is gone; the message names each dead rank."""


class EngineUpdateFailed(RuntimeError):
    """A weight update or group formation failed on some learner rank; ``unanswered``: the
    URLs of the engines that gave no answer (``transfer.weights.broadcast.UpdateFailed``)."""

    def __init__(self, message: str, unanswered: list[str]) -> None:
        super().__init__(message)
        self.unanswered = unanswered


def pid_and_node(_actor) -> tuple[int, str]:
    return os.getpid(), ray.util.get_node_ip_address()


def death_reason(e: Exception) -> str:
    """Ray's long ActorDiedError, cut to what happened to the process."""
    text = str(e)
    detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text)
    return f"its process is gone (Ray: {detail.group(1)})" if detail else text.strip().splitlines()[0]


def learner_death(exc: BaseException, learners) -> str | None:
    """Which learner ranks are gone, when the run fails with a Ray error (None: none is)."""
    seen = exc
    while seen is not None:  # the LearnerDied may sit under another error raised while unwinding
        if isinstance(seen, LearnerDied):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    if learners is None or not isinstance(exc, ray.exceptions.RayError) or not learners.find_dead():
        return None
    return learners.describe_dead()
