"""``cluster`` group: how many engines and learner ranks, on which devices and nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl.config.checks import positive


@dataclass(kw_only=True)
class ClusterConfig:
    _group = "cluster"
    name: str = "local"
    """Placement label."""
    address: Optional[str] = None
    """Ray cluster to join (``auto`` or host:port); unset = start a local Ray."""
    min_nodes: int = 1
    """Alive Ray nodes the placement needs; fewer is refused before any worker starts."""
    num_engines: int = 2
    """Rollout engine processes."""
    num_learners: int = 2
    """Learner ranks (FSDP2 data-parallel world)."""
    gpus_per_engine: int = 0
    """GPUs per engine (its tensor-parallel size); 0 = CPU engine."""
    gpus_per_learner: int = 0
    """0 = CPU learners with gloo, 1 = one GPU per rank with nccl."""
    num_cpus: Optional[int] = None
    """CPUs a local Ray may use; unset = all."""
    torch_threads: int = 1
    """Intra-op threads per CPU worker process (keeps small machines from oversubscribing)."""
    engine_resource: Optional[str] = None
    """Custom Ray node resource that pins engines to nodes (``ray start --resources``)."""
    learner_resource: Optional[str] = None
    """Custom Ray node resource that pins learner ranks to nodes."""
    colocate: bool = False
    """Engines and learner ranks share placement bundles (engine i with rank i) instead of
    separate pools; ``train.py`` on CPU only (GPU time-sharing is not implemented)."""

    def __post_init__(self) -> None:
        positive(self, "num_engines", "num_learners", "torch_threads", "min_nodes")
        if self.gpus_per_engine < 0 or self.gpus_per_learner not in (0, 1):
            raise ValueError("cluster.gpus_per_engine must be >= 0 and cluster.gpus_per_learner 0 or 1")
        if self.colocate and (self.gpus_per_engine or self.gpus_per_learner):
            raise ValueError("cluster.colocate=true with GPUs would need the engines to release GPU "
                             "memory while the learners train, which is not implemented; use "
                             "separate pools (cluster.colocate=false)")


SCHEMAS: dict[str, type] = {"base": ClusterConfig}
"""Schema of each placement (``schema/cluster/<key>``)."""
