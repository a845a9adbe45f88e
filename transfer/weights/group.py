"""Side process groups for weight updates, outside the learners' own FSDP world.

The sender (a learner rank) and the engines build one group per update path from a
``TCPStore`` plus a raw ``ProcessGroupGloo``/``ProcessGroupNCCL``. No default world is
needed or touched, so a learner that already runs FSDP over its own world and an engine
that runs none can join the same small group. SGLang builds the engine side of the same
kind of group in ``init_weights_update_group``. Measured with torch 2.13: a gloo group
built this way broadcasts bf16 tensors between a learner with its own default gloo world
and an engine process.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SideGroup:
    pg: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    backend: str

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass  # already torn down by a peer's exit; nothing left to release
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def init_side_group(*, backend: str, master_address: str, master_port: int, rank: int,
                    world_size: int, group_name: str, timeout_s: float) -> SideGroup:
    """Join (rank > 0) or host (rank 0) a side group; blocks until all ranks joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=False)
    prefix = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    else:
        raise ValueError(f"unknown weight-update backend {backend!r}; use 'gloo' or 'nccl'")
    return SideGroup(pg=pg, store=store, rank=rank, world_size=world_size, backend=backend)


def free_port(host: str = "") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
