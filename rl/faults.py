"""What the driver does when a process of the run dies (docs/fault-tolerance.md).

Engines (``rollout.fault_tolerance``): the rollout manager takes a dead engine out of service
(``rl.rollout.health``); ``EngineFaults`` replaces it at the next weight sync, and on a death
during the sync, and ends the run when replacements run out. Learners: a failed learner call
names the rank whose actor is gone (``LearnerDied``); ``Cluster.__exit__`` then prints the
command that resumes the run (``rl.run.resume_hint``).
"""

from __future__ import annotations

import logging
import os
import re
import time

import ray

from rl.rollout.health import restarts_used_up

logger = logging.getLogger(__name__)


class EngineFaults:
    """Engine replacement for one ``rl.cluster.Cluster`` (its engines, learners, manager)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.restarts = 0
        """Engines replaced so far, as the rollout manager counts them (``replace_engines``)."""

    def push_weights(self, version: int) -> dict[str, float]:
        """The learners' weights to every engine, as ``version``. Engines found dead since
        the last sync are replaced first (a new engine on the same bundle, joined to the
        weight path, given these weights, checked to serve ``version`` and only then put back
        into service); an engine that dies during the push is replaced the same way and the
        push made again."""
        restart_s = 0.0
        down = self.cluster.rollout.begin_sync()
        ok = False
        try:
            while True:
                try:
                    if down:
                        restart_s += self._replace(down)
                    metrics = self.cluster.learners.push_weights(version=version)
                    ok = True
                    break
                except EngineUpdateFailed as e:
                    down = self.cluster.rollout.check_engines(self._unanswered(e))
                    if not down:
                        raise  # not an engine's death: the run's error
                    logger.warning("the weight update to version %d failed (%s); replacing %s and "
                                   "pushing again", version, e, ", ".join(f"engine-{i}" for i in down))
        finally:
            self.cluster.rollout.end_sync(ok)
        return {**metrics, "rollout/engine_restarts": float(self.restarts),
                "rollout/engine_restart_s": restart_s}

    def probe(self):
        """Watchdog probe: the manager's word on whether the engines can still be replaced
        (a death past ``rollout.max_engine_restarts`` ends the run within a second, not at
        the next sync)."""
        actor = self.cluster.rollout.actor

        def probe() -> str | None:
            try:
                return ray.get(actor.engines_failed.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                return None  # busy: asked again in a second
            except ray.exceptions.RayActorError as e:
                return f"the rollout manager is gone ({first_line(e)})"

        return probe

    def _unanswered(self, error: EngineUpdateFailed) -> dict[int, str]:
        """The engines a failed push got no answer from."""
        urls = [u.rstrip("/") for u in error.unanswered]
        return {i: "no answer to its weight update after the push failed"
                for i, u in enumerate(self.cluster.engine_urls) if u.rstrip("/") in urls}

    def _replace(self, down: dict[int, str]) -> float:
        """Stop each dead engine for good and start a new one on its bundle; the learners
        form the update groups the new engines belong to again. Returns the seconds taken."""
        c = self.cluster
        rc = c.cfg.rollout
        if self.restarts + len(down) > rc.max_engine_restarts:
            raise RuntimeError(restarts_used_up(c.runtime.log_dir, down, rc.max_engine_restarts,
                                                self.restarts))
        t0 = time.perf_counter()
        new = {}
        for i, why in sorted(down.items()):
            logger.warning("engine-%d died (%s); starting a new one on its bundle", i, why)
            old = c.engines[i]
            try:
                ray.get(old.stop.remote(1.0), timeout=15)  # a hung server is killed, not waited for
            except Exception as e:  # its actor may be gone with it; the kill below is enough
                logger.warning("stopping engine-%d: %s", i, first_line(e))
            ray.kill(old)  # its server goes with it (PR_SET_PDEATHSIG)
            c.engines[i] = c.engine_actor(i)
            new[i] = c.engines[i].start.remote()
        for i, ref in new.items():
            c.engine_urls[i] = ray.get(ref, timeout=rc.engine_start_timeout_s + 60)
        clients = c.engine_clients()
        for i in new:
            clients[i].check_update_ranks()
        # joining (watched, not yet taking requests); the manager counts the replacements
        self.restarts = c.rollout.replace_engines({i: c.engine_urls[i] for i in new})
        c.learners.reconnect_engines(clients, sorted(new))
        took = time.perf_counter() - t0
        logger.info("%s started in %.1fs (replacement %d of at most %d); it takes requests once "
                    "it serves the pushed weights", ", ".join(clients[i].name for i in new), took,
                    self.restarts, rc.max_engine_restarts)
        return took


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


def first_line(e: BaseException) -> str:
    """The first line of an error's message (a Ray task error's: of the error it carries)."""
    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e).strip()
    return text.splitlines()[0] if text else type(e).__name__
