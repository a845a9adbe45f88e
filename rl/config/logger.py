"""``logger`` group: where metrics go (console lines, Weights & Biases)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass(kw_only=True)
class LoggerConfig:
    _group = "logger"
    name: str = MISSING
    """``wandb`` or ``console``."""
    wandb: bool = False
    """Send metrics to Weights & Biases (online with WANDB_API_KEY, else offline)."""
    project: str = "rl-datapath"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team); unset = the key's default."""
    console_every: int = 1
    """Print one compact line every this many steps."""


SCHEMAS: dict[str, type] = {"base": LoggerConfig}
"""Schema of each logger (``schema/logger/<key>``)."""
