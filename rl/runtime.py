"""Facts discovered at run time (ids, directories, addresses), kept apart from the config."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Runtime:
    run_id: str
    """Unique name of this run; prefixes store keys and names the W&B run."""
    output_dir: str
    """Absolute directory for metrics.jsonl, logs and checkpoints."""
    model_path: str
    """Resolved checkpoint directory (the tiny model's cache entry when model.path is unset)."""
    transfer: dict[str, str] = field(default_factory=dict)
    """What the rollout-data backend resolved on the driver (e.g. the Mooncake master address)."""

    @staticmethod
    def new_run_id(name: str | None) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return f"{name}-{stamp}-{os.getpid()}" if name else f"run-{stamp}-{os.getpid()}"

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_dir, "logs")


def node_ip() -> str:
    """This process's node address as Ray sees it (127.0.0.1 outside Ray)."""
    try:  # ray here (start-up cost): the driver imports this module before it validates the config
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
