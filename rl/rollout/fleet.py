"""The rollout side's engines: started on the placement the driver gives, watched, replaced.

``EngineFleet`` lives in the rollout manager's process and is the one place that knows the
engines. Each engine is an ``EngineProcess`` actor (its server a child process) on its own
bundle of the engines' placement group; the manager owns those actors, so they die with it.
An engine is ``live`` (takes requests), ``down`` (dead, not yet replaced) or ``joining``
(replaced; takes requests once it serves the pushed weights): ``EngineSet``.

With ``rollout.fault_tolerance``, the requests themselves (``rl.rollout.fanout``) and a
``HealthMonitor`` (``rl.rollout.health``) take a dead engine out of service. A weight sync
(``rl.driver.weights.WeightPusher.push``) is framed by two calls: ``prepare_sync``
replaces the dead engines and says which are new, so the learners connect them before the
push (and is asked again, with the engines a failed push got no answer from, to replace
those); ``end_sync`` puts the replacements in service once the push reached them.
``rollout.max_engine_restarts`` bounds the replacements of a run; it is checked here only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.config import Config
from rl.log import first_line
from rl.rollout.client import EngineClient, EngineError
from rl.rollout.engines.launcher import EngineProcess
from rl.rollout.health import HealthMonitor, refused
from rl.runtime import Runtime
from transfer.process import log_tail

logger = logging.getLogger(__name__)


class EngineSet:
    """Which engine is in service: one client per engine and its state."""

    def __init__(self, clients: list[EngineClient]) -> None:
        if not clients:
            raise ValueError("no engines to send requests to")
        self.clients = clients
        self.state = ["live"] * len(clients)
        """``live``, ``down`` or ``joining`` (see the module's docstring)."""
        self.down_reason: dict[int, str] = {}
        self._changing = threading.Lock()
        """Makes each state change one step: the health monitor's thread, the fully async
        stream's and the actor's own (an evaluation) may each find the same engine dead."""
        self.holding = False
        """A weight sync is replacing engines: with none live, requests wait for its end
        instead of failing (a death during a sync can leave every engine out of service
        for a moment)."""

    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == "live"]

    def watched(self) -> list[int]:
        """Engines whose death matters: those in service and replacements joining."""
        return [i for i, s in enumerate(self.state) if s != "down"]

    def mark_down(self, i: int, reason: str) -> bool:
        """Take engine ``i`` out of service (or out of joining); False when it already was."""
        with self._changing:
            if self.state[i] == "down":
                return False
            self.state[i] = "down"
            self.down_reason[i] = reason
        logger.warning("%s is down (%s); its requests go to the other engines", self.clients[i].name,
                       reason)
        return True

    def replace(self, i: int, client: EngineClient) -> None:
        """Engine ``i`` was started again; it takes requests after ``join``."""
        with self._changing:
            self.clients[i] = client
            self.state[i] = "joining"
            self.down_reason.pop(i, None)

    def join(self) -> list[int]:
        """Replaced engines serve the current weights now: back in service."""
        with self._changing:
            joined = [i for i, s in enumerate(self.state) if s == "joining"]
            for i in joined:
                self.state[i] = "live"
        return joined


@dataclasses.dataclass
class SyncPlan:
    """What a weight sync pushes to (``EngineFleet.prepare_sync``)."""

    receivers: list[EngineClient]
    """Every engine, as the weight path addresses it."""
    replaced: list[int]
    """Engines started again for this sync: the learners connect them before pushing."""
    restarts: int
    """Replacements made in the run so far."""
    restart_s: float
    """Seconds this call spent replacing engines."""


class EngineFleet:
    def __init__(self, cfg: Config, runtime: Runtime, placement, env: dict[str, str]) -> None:
        """``placement``: the engines' placement group (engine ``i`` on bundle ``i``);
        ``env``: the environment of each engine's server."""
        self.cfg = cfg
        self.runtime = runtime
        self.placement = placement
        self.env = env
        self.actors: list = []
        self.urls: list[str] = []
        self.engines: EngineSet | None = None
        self.monitor: HealthMonitor | None = None
        self.restarts = 0
        self._synced = False

    # -- start and stop ------------------------------------------------------------------
    def start(self) -> list[str]:
        """Start every engine and wait until each answers; returns their URLs."""
        c, rc = self.cfg.cluster, self.cfg.rollout
        logger.info("starting %d %s engine(s); logs in %s", c.num_engines, rc.name, self.runtime.log_dir)
        self.actors = [self._actor(i) for i in range(c.num_engines)]
        self.urls = ray.get([a.start.remote() for a in self.actors], timeout=rc.engine_start_timeout_s + 60)
        for receiver in self.receivers():  # before any learner plans a weight-update group
            receiver.check_update_ranks()
        self.engines = EngineSet([self._client(i, u) for i, u in enumerate(self.urls)])
        if rc.fault_tolerance:
            self.monitor = HealthMonitor(self.engines, rc.health_check_interval_s,
                                         rc.health_check_timeout_s, rc.health_check_first_wait_s).start()
        return self.urls

    def _actor(self, i: int):
        """Engine ``i``'s actor (not yet started), on bundle ``i``."""
        c = self.cfg.cluster
        where = PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                 placement_group_bundle_index=i)
        return ray.remote(EngineProcess).options(
            num_cpus=0, num_gpus=c.gpus_per_engine or None, scheduling_strategy=where).remote(
                i, self.cfg.rollout, self.runtime.model_path, self.cfg.seed, self.runtime.log_dir,
                None, self.env, c.gpus_per_engine, self.cfg.model.dtype)

    def _client(self, i: int, url: str) -> EngineClient:
        """The manager's client of engine ``i`` (requests and control calls)."""
        rc = self.cfg.rollout
        # control calls (pause, continue): with fault tolerance a hung engine is given the
        # health check's bound, not a whole request's, before it counts as dead
        control_s = rc.health_check_timeout_s if rc.fault_tolerance else rc.request_timeout_s
        return EngineClient(url, f"engine-{i}", timeout_s=control_s)

    def receivers(self) -> list[EngineClient]:
        """Every engine as the weight path addresses it (the learners' clients)."""
        rc = self.cfg.rollout
        # Engines paused in place keep their running batch, and SGLang refuses any flush
        # while it holds requests: no flush after a sync then (docs/sglang.md).
        in_place = rc.fully_async and rc.pause_mode == "in_place"
        return [EngineClient(u, f"engine-{i}", num_ranks=max(1, self.cfg.cluster.gpus_per_engine),
                             timeout_s=self.cfg.weights.timeout_s, flush_after_update=not in_place)
                for i, u in enumerate(self.urls)]

    def pids(self) -> list[int | None]:
        """Each engine server's PID."""
        return ray.get([a.pid.remote() for a in self.actors])

    def stop_watching(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    # -- generation pauses ----------------------------------------------------------------
    def pause(self, mode: str) -> None:
        """Every engine in service stops scheduling forward passes (requests in flight are
        kept); no ``/health_generate`` until ``resume``."""
        if self.monitor is not None:
            self.monitor.suspend()
        self._on_live("pause_generation", mode)

    def resume(self) -> None:
        self._on_live("continue_generation")
        if self.monitor is not None:
            self.monitor.resume()

    def _on_live(self, method: str, *args) -> None:
        """Call every engine in service; with fault tolerance, one that does not answer is
        taken out of service (replaced at the next sync) instead of failing the call."""
        for i in self.engines.live():
            try:
                getattr(self.engines.clients[i], method)(*args)
            except EngineError as e:
                if self.monitor is None or e.status is not None:
                    raise
                self.engines.mark_down(i, str(e))

    # -- weight syncs and failures ----------------------------------------------------------
    def prepare_sync(self, unanswered: list[str] | None = None) -> SyncPlan:
        """Before a push: no ``/health_generate`` until ``end_sync``, and the engines out of
        service are replaced. Asked again after a push failed, with the URLs of the engines it
        got no answer from (``unanswered``, possibly empty): those are taken out of service,
        every engine probed, and the dead replaced. Without fault tolerance nothing is
        replaced (``replaced`` is empty)."""
        if not self.engines.holding:
            self.engines.holding = True
            if self.monitor is not None:
                self.monitor.suspend()
        if self.monitor is None:
            return SyncPlan(self.receivers(), [], self.restarts, 0.0)
        if unanswered is not None:  # after a failed push
            stuck = {u.rstrip("/") for u in unanswered}
            for i, client in enumerate(self.engines.clients):
                if client.url in stuck:
                    self.engines.mark_down(i, "no answer to its weight update after the push failed")
            self.monitor.check_now()
        t0 = time.perf_counter()
        replaced = self._replace(dict(self.engines.down_reason))
        took = time.perf_counter() - t0 if replaced else 0.0
        return SyncPlan(self.receivers(), replaced, self.restarts, took)

    def end_sync(self, ok: bool) -> list[int]:
        """The sync is over; when it succeeded, replaced engines serve the current weights
        (the sender checked their version) and go back into service. Returns those."""
        joined = self.engines.join() if ok else []
        self.engines.holding = False
        if self.monitor is not None:
            self.monitor.resume(joined)
            if ok and not self._synced:  # the start-up's suspension (HealthMonitor) ends too
                self._synced = True
                self.monitor.resume()
        if joined:
            logger.info("%s back in service", ", ".join(self.engines.clients[i].name for i in joined))
        return joined

    def failure(self) -> str | None:
        """Why the run cannot go on (the driver's watchdog asks once a second): more engines
        dead than replacements left, or every engine dead outside a sync; without fault
        tolerance, any engine whose server is gone (its port refuses connections). Else None."""
        if self.monitor is None:
            gone = {i: why for i, c in enumerate(self.engines.clients) if (why := refused(c.url))}
            return self.describe(gone) if gone else None
        if self.engines.holding:
            return None
        rc, down = self.cfg.rollout, dict(self.engines.down_reason)
        if len(down) > rc.max_engine_restarts - self.restarts:
            return self._used_up(down)
        if down and not self.engines.watched():
            return "every engine is down:\n" + self.describe(down)
        return None

    def describe(self, down: dict[int, str] | None = None, lines: int = 5) -> str:
        """Each dead engine (all out of service by default), why, and the last lines of its
        log (``engine_<i>.log``)."""
        parts = []
        for i, why in sorted((self.engines.down_reason if down is None else down).items()):
            path = os.path.join(self.runtime.log_dir, f"engine_{i}.log")
            tail = log_tail(path, lines) if os.path.exists(path) else "(not on this node)"
            parts.append(f"engine-{i} died ({why}); last lines of {path}:\n{tail}")
        return "\n".join(parts)

    def _used_up(self, down: dict[int, str]) -> str:
        limit = self.cfg.rollout.max_engine_restarts
        return (f"{self.describe(down)}\nrollout.max_engine_restarts={limit} replacements "
                f"(this run made {self.restarts}) are used up")

    def _replace(self, down: dict[int, str]) -> list[int]:
        """Stop each dead engine for good and start a new one on its bundle, joining (watched,
        not yet taking requests). Returns the engines replaced."""
        if not down:
            return []
        rc = self.cfg.rollout
        if self.restarts + len(down) > rc.max_engine_restarts:
            raise RuntimeError(self._used_up(down))
        t0 = time.perf_counter()
        started = {}
        for i, why in sorted(down.items()):
            logger.warning("engine-%d died (%s); starting a new one on its bundle", i, why)
            try:
                ray.get(self.actors[i].stop.remote(1.0), timeout=15)  # a hung server is killed
            except Exception as e:  # its actor may be gone with it; the kill below is enough
                logger.warning("stopping engine-%d: %s", i, first_line(e))
            ray.kill(self.actors[i])  # its server goes with it (PR_SET_PDEATHSIG)
            self.actors[i] = self._actor(i)
            started[i] = self.actors[i].start.remote()
        for i, ref in started.items():
            self.urls[i] = ray.get(ref, timeout=rc.engine_start_timeout_s + 60)
        receivers = self.receivers()
        for i in started:
            receivers[i].check_update_ranks()
            self.engines.replace(i, self._client(i, self.urls[i]))
        self.restarts += len(started)
        logger.info("%s started in %.1fs (replacement %d of at most %d); it takes requests once "
                    "it serves the pushed weights", ", ".join(receivers[i].name for i in started),
                    time.perf_counter() - t0, self.restarts, rc.max_engine_restarts)
        return sorted(started)
