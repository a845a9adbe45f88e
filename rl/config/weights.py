"""``weights`` group: the weight path from the learners to the engines (after each update).

Values and their checks only. Each sender (``transfer/weights/broadcast.py``, ``p2p.py``)
builds from plain values and describes its own plan; ``rl.backends`` joins a schema here to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from rl.config.checks import parse_size, positive


@dataclass(kw_only=True)
class WeightsConfig:
    _group = "weights"
    name: str = MISSING
    """Weight path to the engines."""
    bucket_bytes: Any = "512mb"
    """Largest bucket per update call, in bytes or as '512mb'."""
    backend: str = "auto"
    """Side-group backend: ``gloo``, ``nccl``, or ``auto`` (nccl when learners use GPUs)."""
    timeout_s: float = 120.0
    """Bound on every group operation and engine call of a sync."""
    check_coverage: bool = True
    """At the first push, check that it writes every engine parameter (``rl/driver/weight_checks.py``;
    costs one push more)."""

    def __post_init__(self) -> None:
        self.bucket_bytes = parse_size(self.bucket_bytes, "weights.bucket_bytes")
        if self.bucket_bytes <= 0:
            raise ValueError("weights.bucket_bytes must be > 0")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"weights.backend={self.backend!r}: use auto, gloo or nccl")
        positive(self, "timeout_s")

    def resolved_backend(self, on_gpu: bool) -> str:
        """The side-group backend on learners with (``on_gpu``) or without GPUs."""
        return ("nccl" if on_gpu else "gloo") if self.backend == "auto" else self.backend


@dataclass(kw_only=True)
class BroadcastWeightsConfig(WeightsConfig):
    name: str = "broadcast"


@dataclass(kw_only=True)
class P2PWeightsConfig(WeightsConfig):
    name: str = "p2p"


SCHEMAS: dict[str, type] = {"broadcast": BroadcastWeightsConfig, "p2p": P2PWeightsConfig}
"""Schema of each weight path (``schema/weights/<key>``)."""
