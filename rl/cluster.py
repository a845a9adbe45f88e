"""Ray at the edge: start Ray, place and start engines, the rollout manager and the
learner ranks, and stop all of them (also on error and Ctrl-C).

The roles (``EngineProcess``, ``RolloutManager``, ``Learner``) are plain classes; this is
the only module that turns them into Ray actors. ``Cluster`` hides the fan-out: the entry
points call ``cluster.rollout.generate(step)`` or ``cluster.learners.train(ref)`` and get
one answer back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import contextmanager
from typing import Any

import ray
from ray._private.services import canonicalize_bootstrap_address
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.backends import data_path, weight_path
from rl.config import Config
from rl.faults import (EngineFaults, EngineUpdateFailed, LearnerDied, death_reason, first_line,
                       learner_death, pid_and_node)
from rl.learner.learner import Learner
from rl.log import LEVEL_ENV, WORKER_SETUP_HOOK
from rl.nodes import check_nodes, node_environments
from rl.rollout.client import EngineClient
from rl.rollout.engines.launcher import EngineProcess
from rl.rollout.manager import RolloutManager
from rl.run import resume_hint
from rl.runtime import Runtime
from rl.types import RolloutBatch
from rl.watchdog import Watchdog, ray_nodes_probe
from rl.weight_checks import ContentCheck, CoverageCheck, check_names

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Cluster:
    """``batches_held``: rollout batches the store holds at once (1 for train.py; generation
    running ahead holds more), for the store's capacity check."""

    def __init__(self, cfg: Config, runtime: Runtime, batches_held: int = 1) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.batches_held = batches_held
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.rollout: RolloutHandle | None = None
        self.learners: LearnerGroup | None = None
        self.store: Any = None  # the driver's own store client (for remove)
        self._pgs: list[Any] = []
        self._started_ray = False
        self._stop_services = None
        self.watchdog = None  # set by __enter__: the entry points' runs watch their dependencies
        self.faults = EngineFaults(self)
        self.content_check: ContentCheck | None = None  # set by start()
        self.coverage_check: CoverageCheck | None = None  # set by start()

    # -- start -------------------------------------------------------------------------
    def start(self) -> "Cluster":
        cfg = self.cfg
        data = data_path(cfg.transfer)
        env = {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads), "TOKENIZERS_PARALLELISM": "false",
               "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING"),  # Mooncake logs INFO by default
               "PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
               LEVEL_ENV: cfg.log_level}
        if not ray.is_initialized():
            if _starts_local_ray(cfg.cluster.address):  # a one-node Ray of our own: check first
                data.check_environment(1, estimate_step_bytes(cfg), self.batches_held)
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
            self.runtime, num_nodes, estimate_step_bytes(cfg), self.batches_held)
        self.runtime = dataclasses.replace(self.runtime, transfer=services)
        c = cfg.cluster
        logger.info("placement: %s", describe_placement(cfg))
        if c.colocate:  # one pool: engine i and learner rank i share bundle i (CPU only)
            engine_pg = learner_pg = placement_group(
                [_bundle(0, c.engine_resource)] * max(c.num_engines, c.num_learners), strategy="PACK")
            self._pgs = [engine_pg]
        else:
            engine_pg = placement_group([_bundle(c.gpus_per_engine, c.engine_resource)] * c.num_engines,
                                        strategy="PACK")
            learner_pg = placement_group([_bundle(c.gpus_per_learner, c.learner_resource)] * c.num_learners,
                                         strategy="PACK")
            self._pgs = [engine_pg, learner_pg]
        _wait_ready(self._pgs, timeout_s=60)
        self.store = data.build(self.runtime)
        engines_started = self._launch_engines(engine_pg, env)
        # the learner ranks set up while the engines start: both load the model (on GPUs, each
        # takes tens of seconds), and neither needs the other until the weight plan below
        self.learners = LearnerGroup(cfg, self.runtime, learner_pg)
        self._wait_for_engines(engines_started)
        # the manager on the rollout side (it writes each batch to the store from there), in
        # the first engine's bundle: Ray would otherwise place it on any node
        self.rollout = RolloutHandle(cfg, self.runtime, self.engine_urls, _in_bundle(engine_pg, 0))
        self.learners.wait_set_up()
        plan = weight_path(cfg.weights).describe_plan(c.num_learners, self.engine_clients())
        logger.info("%s plan: %s", cfg.weights.name, plan)
        with open(os.path.join(self.runtime.output_dir, "weights_plan.txt"), "w") as f:
            f.write(f"weights={cfg.weights.name}: {plan}\n")
        # before the first push: names an engine's loader would drop are refused here
        self.content_check = check_names(self.learners, self.engine_clients(), cfg.model.dtype)
        self.coverage_check = CoverageCheck() if cfg.weights.check_coverage else None
        self.learners.connect_engines(self.engine_clients())
        return self

    def engine_actor(self, i: int):
        """Engine ``i``'s actor (not yet started), on bundle ``i`` of the engines' placement."""
        c = self.cfg.cluster
        return ray.remote(EngineProcess).options(
            num_cpus=0, num_gpus=c.gpus_per_engine or None,
            scheduling_strategy=_in_bundle(self._engine_pg, i)).remote(
                i, self.cfg.rollout, self.runtime.model_path, self.cfg.seed, self.runtime.log_dir,
                None, self._env, c.gpus_per_engine, self.cfg.model.dtype)

    def _launch_engines(self, pg, env: dict[str, str]) -> list:
        """Start every engine; returns the refs of their URLs (``_wait_for_engines``)."""
        c = self.cfg.cluster
        self._engine_pg, self._env = pg, env
        self.engines = [self.engine_actor(i) for i in range(c.num_engines)]
        logger.info("starting %d %s engine(s); logs in %s", c.num_engines, self.cfg.rollout.name,
                    self.runtime.log_dir)
        return [e.start.remote() for e in self.engines]

    def _wait_for_engines(self, started: list) -> None:
        self.engine_urls = ray.get(started, timeout=self.cfg.rollout.engine_start_timeout_s + 60)
        logger.info("engines up: %s", ", ".join(self.engine_urls))
        for client in self.engine_clients():  # before any learner plans a weight-update group
            client.check_update_ranks()

    def engine_clients(self) -> list:
        rc = self.cfg.rollout
        # Engines paused in place keep their running batch, and SGLang refuses any flush
        # while it holds requests: no flush after a sync then (docs/sglang.md).
        in_place = rc.fully_async and rc.pause_mode == "in_place"
        return [EngineClient(u, f"engine-{i}", num_ranks=max(1, self.cfg.cluster.gpus_per_engine),
                             timeout_s=self.cfg.weights.timeout_s, flush_after_update=not in_place)
                for i, u in enumerate(self.engine_urls)]

    # -- weights, and engine faults (rollout.fault_tolerance) ------------------------------
    def push_weights(self, version: int) -> dict[str, float]:
        """The learners' weights to every engine, as ``version``; with fault tolerance, dead
        engines are replaced first, and on a death during the push (``rl.faults``)."""
        def push() -> dict[str, float]:
            if not self.cfg.rollout.fault_tolerance:
                return self.learners.push_weights(version=version)
            return self.faults.push_weights(version)

        if self.coverage_check is not None:  # the first push, twice (rl.weight_checks)
            check, self.coverage_check = self.coverage_check, None
            metrics = check.run(push, self.engine_clients)
        else:
            metrics = push()
        if self.content_check is not None:  # the first pushes are read back (rl.weight_checks)
            self.content_check.after_push(self.learners, self.engine_clients(), version)
        return metrics

    # -- stop --------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 60) -> None:
        """Stop everything this run started; safe to call after a partial start.
        ``timeout_s``: bound on each graceful close (short when something already died)."""
        if not ray.is_initialized():
            return
        # The learners, the manager and the driver's store close at once: a Mooncake client's
        # close waits out threads that sleep 1 s between checks (1-2 s each), and three in a
        # row added about 3 s to every Mooncake run.
        closing = [(type(p).__name__, p.start_close()) for p in (self.learners, self.rollout)
                   if p is not None]
        if self.store is not None:
            _reported(f"{type(self.store).__name__}.close", self.store.close)
        deadline = time.monotonic() + timeout_s
        for name, refs in closing:
            _reported(f"{name}.close", ray.get, refs, timeout=max(0.0, deadline - time.monotonic()))
        _reported("stopping the engines", ray.get, [e.stop.remote() for e in self.engines],
                  timeout=min(30, timeout_s))
        for a in self.engines + (self.learners.actors if self.learners else []) + \
                ([self.rollout.actor] if self.rollout else []):
            ray.kill(a)  # engine servers die with their actor (PR_SET_PDEATHSIG)
        for pg in self._pgs:
            ray.util.remove_placement_group(pg)
        if self._stop_services is not None:
            self._stop_services()
        if self._started_ray:
            ray.shutdown()

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
        failure = None
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not (
            self.watchdog is not None and self.watchdog.fired)
        if self.watchdog is not None:
            self._stop_watchdog()
            # an actor error can arrive before the next probe: look once more. Not after the
            # user's Ctrl-C: it reached every process of the terminal's group, and what it
            # stopped is no failure of the run's.
            failure = self.watchdog.failure if interrupted or exc_type is None else self.watchdog.check_now()
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
        """Probes of the Mooncake master, each engine server and the Ray nodes (rl.watchdog)."""
        dog = Watchdog()
        master = self.runtime.transfer.get("master_server_address")
        if master:
            host, _, port = master.rpartition(":")
            dog.watch_port(f"the Mooncake store's master at {master}", host, int(port))
        if self.cfg.rollout.fault_tolerance:  # the rollout manager watches them, and says
            dog.watch("the rollout engines", self.faults.probe())  # when they cannot be replaced
        else:
            for i, url in enumerate(self.engine_urls):
                dog.watch_url(f"engine-{i} ({url})", url)
        dog.watch("a Ray node", ray_nodes_probe())
        return dog.start()


class RolloutHandle:
    """The rollout manager actor, called like the plain class."""

    def __init__(self, cfg: Config, runtime: Runtime, engine_urls: list[str], placement=None) -> None:
        # threaded: a pause, a stop or Ctrl-C's cleanup is served while next_batch waits
        self.actor = ray.remote(RolloutManager).options(
            num_cpus=0, max_concurrency=4, scheduling_strategy=placement).remote(cfg, runtime, engine_urls)
        self._ray = ray
        self.timeout_s = cfg.rollout.request_timeout_s + 60

    def generate(self, step: int):
        return self._ray.get(self.actor.generate.remote(step))

    def generate_async(self, step: int):
        """Start generating batch ``step``; returns a handle for ``wait``/``wait_idle``."""
        return self.actor.generate.remote(step)

    def wait(self, handle):
        """The ``RolloutRef`` behind a handle from ``generate_async``."""
        return self._ray.get(handle)

    def wait_idle(self, handle) -> None:
        """Block until that generation has finished (without fetching its ref)."""
        if handle is not None:
            self._ray.wait([handle], num_returns=1)

    def discard(self, handle, store) -> None:
        """Wait for an unconsumed generation and remove its data (a run ending early);
        failures are reported, not raised: this runs while another error unwinds."""
        if handle is None:
            return
        try:
            store.remove(self._ray.get(handle, timeout=300).partitions)
        except Exception as e:
            logger.warning("could not discard an unconsumed rollout batch: %s", e)

    @contextmanager
    def paused(self):
        """Engines run no forward pass inside the block (requests in flight wait)."""
        self._ray.get(self.actor.pause.remote())
        try:
            yield
        finally:
            self._ray.get(self.actor.resume.remote())

    # fully async: a stream of batches (see rl.rollout.manager.Stream)
    def start_stream(self, first_step: int) -> None:
        self._ray.get(self.actor.start_stream.remote(first_step))

    def next_batch(self, step: int):
        """The next queued batch, stale samples marked for dropping (waits for one)."""
        return self._ray.get(self.actor.next_batch.remote(step))

    def release(self, ref, step: int) -> None:
        self._ray.get(self.actor.release.remote(ref, step))

    def resume_position(self) -> dict:
        """Data position for a checkpoint taken now (before the oldest batch not yet taken)."""
        return self._ray.get(self.actor.resume_position.remote())

    def stop_stream(self, timeout_s: float | None = None) -> list[dict] | None:
        """Stop generating and remove what nobody took; returns the per-batch sample ledger,
        or None (reported, not raised: this also runs while another error unwinds)."""
        try:
            return self._ray.get(self.actor.stop_stream.remote(), timeout=timeout_s or self.timeout_s)
        except Exception as e:
            logger.warning("could not stop the rollout stream cleanly: %s", e)
            return None

    def state_dict(self) -> dict:
        return self._ray.get(self.actor.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        self._ray.get(self.actor.load_state_dict.remote(state))

    def start_close(self) -> list:
        """Ask the manager to close; returns the ref to wait on (``Cluster.shutdown``)."""
        return [self.actor.close.remote()]

    # engine faults: see Cluster.push_weights
    def begin_sync(self) -> dict[int, str]:
        return self._ray.get(self.actor.begin_sync.remote())

    def check_engines(self, stuck: dict[int, str]) -> dict[int, str]:
        return self._ray.get(self.actor.check_engines.remote(stuck))

    def replace_engines(self, urls: dict[int, str]) -> int:
        return self._ray.get(self.actor.replace_engines.remote(urls))

    def end_sync(self, ok: bool) -> list[int]:
        return self._ray.get(self.actor.end_sync.remote(ok))


class LearnerGroup:
    """All learner ranks as one object: each call fans out and returns rank 0's answer.
    When a call fails and some rank's actor is gone, it raises ``LearnerDied`` naming that
    rank (the first error to arrive is often a surviving rank's broken collective)."""

    def __init__(self, cfg: Config, runtime: Runtime, pg) -> None:
        n = cfg.cluster.num_learners
        cls = ray.remote(Learner)
        self.actors = [cls.options(num_cpus=0, num_gpus=cfg.cluster.gpus_per_learner or None,
                                   scheduling_strategy=_in_bundle(pg, r)).remote(cfg, runtime, r, n)
                       for r in range(n)]
        self._ray = ray
        self.dead: dict[int, str] = {}
        """Ranks found dead, with why (filled when a call fails)."""
        # Each rank sets up (process group, model, store client) from here on, while the
        # caller goes on; ``wait_set_up`` waits. A rank runs its calls in order, and Ray
        # hands every rank rank 0's rendezvous address once rank 0 has answered.
        self._where = [a.__ray_call__.remote(pid_and_node) for a in self.actors]
        rendezvous = self.actors[0].address.remote()
        self._setting_up = [a.__ray_call__.remote(_set_up, rendezvous) for a in self.actors]
        self.where: list[tuple[int, str]] = [(0, "?")] * n
        """(pid, node IP) of each rank, to name a dead one (known after ``wait_set_up``)."""

    def wait_set_up(self) -> None:
        self.where = self._ray.get(self._where)
        logger.info("learner ranks: %s", ", ".join(f"{r} (pid {pid} on {node})"
                                                   for r, (pid, node) in enumerate(self.where)))
        self._gather(self._setting_up)

    def _all(self, method: str, *args, timeout: float | None = None) -> list:
        return self._gather([getattr(a, method).remote(*args) for a in self.actors], timeout)

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
        return self._gather([a.__ray_call__.remote(fn, *args) for a in actors])[0]

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
        refs = [getattr(a, method).remote(*args) for a in self.actors]
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
            refs.append(actor.close.remote())
        return refs


def _set_up(learner, rendezvous: tuple[str, int]) -> None:
    """One rank's setup, run in its actor (``LearnerGroup``); the store client is open before
    the first put."""
    learner.setup(*rendezvous)
    learner.connect_store()


def _reported(what: str, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``, logging what failed instead of raising: a shutdown keeps
    stopping the rest."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        logger.warning("%s failed: %s", what, e)


def _starts_local_ray(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` starts a new one-node Ray here, by Ray's own rule:
    not when the address, ``RAY_ADDRESS`` or a ``ray start`` on this machine names a cluster."""
    try:
        return canonicalize_bootstrap_address(address) is None
    except Exception:  # an address Ray cannot read: ray.init says why
        return False


def estimate_step_bytes(cfg: Config) -> int:
    """Upper bound of one step's rollout batch in a store, for capacity checks."""
    return RolloutBatch.estimate_nbytes(cfg.rollout.batch_size, cfg.rollout.max_prompt_tokens,
                                        cfg.rollout.max_new_tokens)


def describe_placement(cfg: Config) -> str:
    """The placement this config asks Ray for (printed at start)."""
    c = cfg.cluster

    def pool(n: int, what: str, gpus: int, resource: str | None) -> str:
        where = f"on nodes with resource '{resource}'" if resource else "anywhere"
        size = f"{n * gpus} GPUs" if gpus else "CPU only"
        return f"{n} {what} x {gpus} GPU {where} ({size})"

    rollout = pool(c.num_engines, f"{cfg.rollout.name} engines", c.gpus_per_engine, c.engine_resource)
    training = pool(c.num_learners, "learner ranks", c.gpus_per_learner, c.learner_resource)
    shared = " (colocated: engine i and learner rank i share a bundle)" if c.colocate else ""
    return f"rollout: {rollout}; training: {training}{shared}"


def _bundle(gpus: int, resource: str | None = None) -> dict[str, float]:
    # CPU roles reserve a sliver of a CPU so that many fit on a small machine; a custom
    # node resource (a sliver of it) pins the bundle to the nodes that advertise it.
    bundle = {"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 0.01}
    if resource:
        bundle[resource] = 0.001
    return bundle


def _in_bundle(pg, index: int):
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _wait_ready(pgs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pg in pgs:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            ray.get(pg.ready(), timeout=remaining)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray could not place bundles {pg.bundle_specs} within {timeout_s:.0f}s: "
                               f"cluster resources are {ray.cluster_resources()}") from None
