"""Ray at the edge: start Ray, the placement, the rollout manager (which starts its engines)
and the learner ranks; drive the weight syncs; stop all of them (also on error and Ctrl-C).

The roles (``RolloutManager``, ``Learner``) are plain classes; the driver's handles
(``rl.driver.rollout``, ``rl.driver.learners``) turn them into Ray actors and hide the
fan-out: the entry points call ``cluster.rollout.generate(step)`` or
``cluster.learners.train(ref)`` and get one answer back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import ray
from ray._private.services import canonicalize_bootstrap_address

from rl.backends import data_path
from rl.config import Config
from rl.driver.bounds import exit_if_longer
from rl.driver.learners import LearnerGroup, learner_death
from rl.driver.nodes import check_nodes, node_environments
from rl.driver.placement import Placement, describe_placement
from rl.driver.rollout import RolloutHandle
from rl.driver.run import resume_hint
from rl.driver.watchdog import Watchdog, ray_nodes_probe
from rl.driver.weights import WeightPusher
from rl.log import LEVEL_ENV, WORKER_SETUP_HOOK, first_line
from rl.probe import probe_port
from rl.runtime import Runtime
from rl.tasks.build import max_label_bytes
from rl.types import RolloutBatch

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Cluster:
    """``batches_held``: rollout batches the store holds at once (1 for train.py; generation
    running ahead holds more), for the store's capacity check. ``stop_bound_s``: the most a
    stop may take before the process exits (``rl.driver.bounds.STOP_BOUND_S``), for a process
    of its own."""

    def __init__(self, cfg: Config, runtime: Runtime, batches_held: int = 1,
                 stop_bound_s: float | None = None) -> None:
        self.cfg = cfg
        self.stop_bound_s = stop_bound_s  # the entry points: STOP_BOUND_S; None: no bound
        self.runtime = runtime
        self.batches_held = batches_held
        self.rollout: RolloutHandle | None = None
        self.learners: LearnerGroup | None = None
        self.store: Any = None  # the driver's own store client (for remove)
        self.weights: WeightPusher | None = None
        self.placement = Placement(cfg)
        self._started_ray = False
        self._stop_services = None
        self.watchdog = None  # set by __enter__: the entry points' runs watch their dependencies

    # -- start -------------------------------------------------------------------------
    def start(self) -> "Cluster":
        cfg = self.cfg
        data = data_path(cfg.transfer)
        env = worker_env(cfg)
        partition_bytes = estimate_partition_bytes(cfg)  # reads a JSONL task's labels: once
        if not ray.is_initialized():
            if _starts_local_ray(cfg.cluster.address):  # a one-node Ray of our own: check first
                data.check_environment(1, partition_bytes, self.batches_held)
            ray.init(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus,
                     include_dashboard=False,  # the hook sets logging up in every worker (rl.log)
                     runtime_env={"env_vars": env, "worker_process_setup_hook": WORKER_SETUP_HOOK},
                     logging_level="WARNING")
            self._started_ray = True
        check_nodes(cfg.cluster, ray.nodes())  # a missing node or resource, named, before any worker
        num_nodes = len([n for n in ray.nodes() if n["Alive"]])
        if num_nodes > 1 and data.node_env:  # what each node exported before `ray start`
            for node, node_env in node_environments(data.node_env).items():
                data.check_node_env(node, node_env, num_nodes)
        services, self._stop_services = data.start_services(
            self.runtime, num_nodes, partition_bytes, self.batches_held)
        self.runtime = dataclasses.replace(self.runtime, transfer=services)
        logger.info("placement: %s", describe_placement(cfg))
        self.placement.reserve()
        self.store = data.build(self.runtime)
        self.rollout = RolloutHandle(cfg, self.runtime, self.placement.engines, env)
        engines_started = self.rollout.start_engines()
        # the learner ranks set up while the engines start: both load the model (on GPUs, each
        # takes tens of seconds), and neither needs the other until the weight plan below
        self.learners = LearnerGroup(cfg, self.runtime, self.placement.learners)
        urls = ray.get(engines_started)
        logger.info("engines up: %s", ", ".join(urls))
        self.rollout.set_readers(self.learners.wait_set_up())
        self.weights = WeightPusher(cfg, self.learners, self.rollout, self.runtime.output_dir)
        return self

    def push_weights(self, version: int) -> dict[str, float]:
        """The learners' weights to every engine, as ``version`` (``WeightPusher.push``)."""
        return self.weights.push(version)

    def engine_clients(self) -> list:
        """Every engine as the weight path addresses it, as of the last sync."""
        return list(self.weights.receivers)

    @property
    def engine_urls(self) -> list[str]:
        return [r.url for r in self.weights.receivers] if self.weights else []

    # -- stop --------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 60) -> None:
        """Stop everything this run started; safe to call after a partial start.
        ``timeout_s``: bound on each graceful close (short when something already died).
        Taking longer than ``stop_bound_s`` in all, the process exits with every thread's stack."""
        if not ray.is_initialized():
            return
        with exit_if_longer(self.stop_bound_s):
            self._shutdown(timeout_s)

    def _shutdown(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        engines = self._engine_actors()
        # The manager closes first, with the driver's store: it writes into the segments the
        # learners lend, and a put still in flight when they unmount them crashes Mooncake's
        # client (a Ctrl-C lands mid-step, and train_async.py generates ahead). The learners
        # close after. A Mooncake client's close waits out threads that sleep 1 s between
        # checks (1-2 s each), so the closes that may overlap do. With the Mooncake master
        # gone (killed, or its node lost) no client can close cleanly, and one closing may
        # crash its process: the actors are killed without it.
        if not self._master_gone():
            deadline = time.monotonic() + timeout_s
            closing = self.rollout.start_close() if self.rollout else []
            if self.store is not None:
                _reported(f"{type(self.store).__name__}.close", self.store.close)
            _reported("RolloutHandle.close", ray.get, closing, timeout=timeout_s)
            if self.learners is not None:
                _reported("LearnerGroup.close", ray.get, self.learners.start_close(),
                          timeout=max(0.0, deadline - time.monotonic()))
        _stop_engines(engines, timeout_s=min(30, timeout_s))
        for a in engines + (self.learners.actors if self.learners else []) + \
                ([self.rollout.actor] if self.rollout else []):
            ray.kill(a)  # an engine's server dies with its actor (PR_SET_PDEATHSIG)
        self.placement.release()
        if self._stop_services is not None:
            self._stop_services()
        if self._started_ray:
            ray.shutdown()
        logger.info("stopping the run's processes took %.1fs", time.monotonic() - t0)

    def _master_gone(self) -> bool:
        master = self.runtime.transfer.get("master_server_address")
        if not master:
            return False
        host, _, port = master.rpartition(":")
        return probe_port(host, int(port))[0] == "refused"

    def _engine_actors(self) -> list:
        """The engines' actors, asked of the manager before it closes: the driver stops them
        after the learners have left their weight-update groups. None when the manager is
        gone or busy; its engines then die with it (it owns them)."""
        if self.rollout is None:
            return []
        try:
            return self.rollout.engine_actors(timeout_s=5)
        except Exception as e:
            logger.warning("could not reach the rollout manager for its engines: %s", first_line(e))
            return []

    def __enter__(self) -> "Cluster":
        try:
            self.start()
            self.watchdog = self._watch()
            return self
        except BaseException:
            self.shutdown()
            raise

    def stop_watching(self) -> str | None:
        """No watchdog interrupt from here on, so that a death found meanwhile cannot cut
        short the cleanup that follows (``train_async.py``: the sample ledger); returns the
        death found by one more probe, if any. It is still named when the cluster exits."""
        if self.watchdog is None:
            return None
        self._stop_watchdog()
        return self.watchdog.check_now()

    def _stop_watchdog(self) -> None:
        try:
            self.watchdog.stop()
        except KeyboardInterrupt:  # its own interrupt, landing here: the failure is recorded
            if not self.watchdog.fired:
                raise

    def __exit__(self, exc_type, exc, tb) -> None:
        with exit_if_longer(self.stop_bound_s):  # the probes and the shutdown below: one bound
            self._exit(exc_type, exc)

    def _exit(self, exc_type, exc) -> None:
        failure = None
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not (
            self.watchdog is not None and self.watchdog.fired)
        if self.watchdog is not None:
            self._stop_watchdog()
            # an actor's or a store's error can arrive before the next probe, or before the
            # death shows: look a few more rounds. Not after the user's Ctrl-C: it reached
            # every process of the terminal's group, and what it stopped is no failure of the run's.
            failure = (self.watchdog.failure if interrupted or exc_type is None
                       else self.watchdog.check_settling())
        if interrupted:
            logger.warning("interrupted: stopping the run's processes")
        died = learner_death(exc, self.learners) if failure is None and exc is not None \
            and not interrupted else None
        self.shutdown(timeout_s=10 if failure or died else 60)  # graceful closes may wait on the dead
        if died:
            hint = resume_hint(self.cfg, self.runtime)  # after shutdown: the last line logged
            logger.error("%s", hint)
            failure = f"{died}\n{hint}"
        if failure:
            raise RuntimeError(f"the run stopped: {failure}") from exc

    def _watch(self):
        """Probes of the Mooncake master, the engines (the rollout manager's word on them) and
        the Ray nodes (rl.driver.watchdog)."""
        dog = Watchdog()
        master = self.runtime.transfer.get("master_server_address")
        if master:
            host, _, port = master.rpartition(":")
            dog.watch_port(f"the Mooncake store's master at {master}", host, int(port))
        # the rollout manager watches its engines, and says when the run cannot go on
        dog.watch("the rollout engines", self.rollout.failure_probe())
        dog.watch("a Ray node", ray_nodes_probe())
        return dog.start()


def worker_env(cfg: Config) -> dict[str, str]:
    """The environment of every process Ray starts for the run (and of the engines' servers)."""
    return {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads), "TOKENIZERS_PARALLELISM": "false",
            "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING"),  # Mooncake logs INFO by default
            "PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
            LEVEL_ENV: cfg.log_level}


def _stop_engines(engines: list, timeout_s: float) -> None:
    """Stop each engine's server (its actor is killed after). An engine whose actor is already
    gone (with the manager that owns it, e.g. one a Ctrl-C reached first) is stopped."""
    refs = [e.stop.remote() for e in engines]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            pass
        except Exception as e:
            logger.warning("stopping engine-%d failed: %s", i, first_line(e))


def _reported(what: str, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``, logging what failed instead of raising: a shutdown keeps
    stopping the rest. One line: the run's own error, raised after, carries the details."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        logger.warning("%s failed: %s", what, first_line(e))


def _starts_local_ray(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` starts a new one-node Ray here, by Ray's own rule:
    not when the address, ``RAY_ADDRESS`` or a ``ray start`` on this machine names a cluster."""
    try:
        return canonicalize_bootstrap_address(address) is None
    except Exception:  # an address Ray cannot read: ray.init says why
        return False


def estimate_partition_bytes(cfg: Config) -> int:
    """Upper bound of one learner rank's partition of a step in a store (equal sample counts
    per rank), for the capacity check of the segment each rank lends."""
    per_rank = -(-cfg.rollout.batch_size // cfg.cluster.num_learners)
    return RolloutBatch.estimate_nbytes(per_rank, cfg.rollout.max_prompt_tokens, cfg.rollout.max_new_tokens,
                                        label_bytes=max_label_bytes(cfg.task),
                                        token_advantages=cfg.algo.turn_credit)
