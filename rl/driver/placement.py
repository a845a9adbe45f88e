"""Where the run's parts go: the engines' and the learners' placement groups.

One bundle per engine and one per learner rank, each pool packed on the nodes that
advertise its resource (``cluster.engine_resource``, ``cluster.learner_resource``); with
``cluster.colocate`` engine ``i`` and learner rank ``i`` share bundle ``i`` (CPU only).
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.config import Config


class Placement:
    """The placement groups of one run, reserved (``reserve``) and released (``release``)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.engines = None
        self.learners = None

    def reserve(self, timeout_s: float = 60) -> "Placement":
        c = self.cfg.cluster
        if c.colocate:
            self.engines = self.learners = placement_group(
                [bundle(0, c.engine_resource)] * max(c.num_engines, c.num_learners), strategy="PACK")
        else:
            self.engines = placement_group([bundle(c.gpus_per_engine, c.engine_resource)] * c.num_engines,
                                           strategy="PACK")
            self.learners = placement_group(
                [bundle(c.gpus_per_learner, c.learner_resource)] * c.num_learners, strategy="PACK")
        deadline = time.monotonic() + timeout_s
        for pg in self._groups():
            try:
                ray.get(pg.ready(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"Ray could not place bundles {pg.bundle_specs} within {timeout_s:.0f}s: "
                                   f"cluster resources are {ray.cluster_resources()}") from None
        return self

    def release(self) -> None:
        for pg in self._groups():
            remove_placement_group(pg)
        self.engines = self.learners = None

    def _groups(self) -> list:
        return [pg for pg in dict.fromkeys((self.engines, self.learners)) if pg is not None]


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


def bundle(gpus: int, resource: str | None = None) -> dict[str, float]:
    # CPU roles reserve a sliver of a CPU so that many fit on a small machine; a custom
    # node resource (a sliver of it) pins the bundle to the nodes that advertise it.
    spec = {"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 0.01}
    if resource:
        spec[resource] = 0.001
    return spec


def in_bundle(pg, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
