"""The driver's handle on the rollout manager actor (``rl.rollout.manager``): called like
the plain class, each call waits for its answer unless it says it returns a ref."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import ray

from rl.config import Config
from rl.driver.placement import in_bundle
from rl.log import first_line
from rl.rollout.manager import RolloutManager
from rl.runtime import Runtime

logger = logging.getLogger(__name__)


class RolloutHandle:
    """The rollout manager actor, called like the plain class."""

    def __init__(self, cfg: Config, runtime: Runtime, placement, env: dict[str, str]) -> None:
        """The manager starts in the engines' first bundle (Ray would otherwise place it on
        any node: it writes each batch to the store from the rollout side); ``placement``:
        the engines' placement group, ``env``: their servers' environment."""
        # threaded: a pause, a stop or Ctrl-C's cleanup is served while next_batch waits
        self.actor = ray.remote(RolloutManager).options(
            num_cpus=0, max_concurrency=4, scheduling_strategy=in_bundle(placement, 0)).remote(
                cfg, runtime, placement, env)
        self._ray = ray
        self.timeout_s = cfg.rollout.request_timeout_s + 60

    def start_engines(self):
        """Start the engines; returns a ref to their URLs (``ray.get`` it)."""
        return self.actor.start_engines.remote()

    def set_readers(self, locations: list) -> None:
        """Where each learner rank reads (``RolloutManager.set_readers``)."""
        self._ray.get(self.actor.set_readers.remote(locations))

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

    def evaluate(self) -> dict[str, float]:
        """The evaluation's metrics (``RolloutManager.evaluate``)."""
        return self._ray.get(self.actor.evaluate.remote(), timeout=self.timeout_s)

    # fully async: a stream of batches (see rl.rollout.stream.Stream)
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

    # the engines (rl.rollout.fleet): see rl.driver.weights.WeightPusher
    def prepare_sync(self, unanswered: list[str] | None = None):
        """The engines to push to, dead ones replaced; ``unanswered`` after a failed push
        (``EngineFleet.prepare_sync``)."""
        return self._ray.get(self.actor.prepare_sync.remote(unanswered))

    def end_sync(self, ok: bool) -> list[int]:
        return self._ray.get(self.actor.end_sync.remote(ok))

    def receivers(self) -> list:
        """Every engine as the weight path addresses it (``EngineFleet.receivers``)."""
        return self._ray.get(self.actor.receivers.remote())

    def engine_pids(self) -> list[int | None]:
        return self._ray.get(self.actor.engine_pids.remote())

    def engine_actors(self, timeout_s: float) -> list:
        """The engines' actors (the manager owns them: they die with it)."""
        return self._ray.get(self.actor.engine_actors.remote(), timeout=timeout_s)

    def failure_probe(self):
        """Watchdog probe: the manager's word on whether the engines can still be replaced
        (a death past ``rollout.max_engine_restarts`` ends the run within a second, not at
        the next sync)."""
        actor, ray = self.actor, self._ray

        def probe() -> str | None:
            try:
                return ray.get(actor.engines_failed.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                return None  # busy: asked again in a second
            except ray.exceptions.RayActorError as e:
                return f"the rollout manager is gone ({first_line(e)})"

        return probe
