"""``weights`` group: the weight path from the learners to the engines (after each update).

Each schema builds its ``WeightSync`` sender and describes which learner rank sends to which
engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from rl.config.checks import parse_size, positive

if TYPE_CHECKING:
    from transfer.weights.base import WeightSync


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

    def __post_init__(self) -> None:
        self.bucket_bytes = parse_size(self.bucket_bytes, "weights.bucket_bytes")
        if self.bucket_bytes <= 0:
            raise ValueError("weights.bucket_bytes must be > 0")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"weights.backend={self.backend!r}: use auto, gloo or nccl")
        positive(self, "timeout_s")

    def describe_plan(self, num_learners: int, receivers: list) -> str:
        """Which learner rank sends to which engine (printed at start, saved in the run dir)."""
        return "learner 0 -> " + ", ".join(r.name for r in receivers)

    def resolved_backend(self, on_gpu: bool) -> str:
        return ("nccl" if on_gpu else "gloo") if self.backend == "auto" else self.backend

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        raise NotImplementedError


@dataclass(kw_only=True)
class BroadcastWeightsConfig(WeightsConfig):
    name: str = "broadcast"

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.broadcast import BroadcastSync

        return BroadcastSync(rank=rank, master_address=master_address,
                             bucket_bytes=self.bucket_bytes,
                             backend=self.resolved_backend(on_gpu), timeout_s=self.timeout_s,
                             device=device)


@dataclass(kw_only=True)
class P2PWeightsConfig(WeightsConfig):
    name: str = "p2p"

    def describe_plan(self, num_learners: int, receivers: list) -> str:
        from transfer.weights.p2p import format_plan, plan_p2p

        return format_plan(plan_p2p(num_learners, receivers), receivers)

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.p2p import P2PSync

        return P2PSync(rank=rank, world_size=world_size, master_address=master_address,
                       bucket_bytes=self.bucket_bytes, backend=self.resolved_backend(on_gpu),
                       timeout_s=self.timeout_s, device=device)


SCHEMAS: dict[str, type] = {"broadcast": BroadcastWeightsConfig, "p2p": P2PWeightsConfig}
"""Schema of each weight path (``schema/weights/<key>``)."""
