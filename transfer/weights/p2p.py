"""``weights=p2p``: every learner rank sends directly to the engines it owns.

A plan assigns each engine to one learner rank (balanced by bytes received, so round robin
when engines are alike). Each learner rank with engines opens its own small side group
(itself plus its engines' ranks) and, per bucket, asks its engines to receive and
broadcasts to them. All ranks gather each sharded parameter together (FSDP2), then every
owning rank sends at the same time: no byte passes through a rank that does not own the
destination, and the busiest sender carries ceil(E/R) copies of the model instead of E.
"""

from __future__ import annotations

from typing import Sequence

import torch

from transfer.weights.base import WeightReceiver
from transfer.weights.broadcast import BroadcastSync


def plan_p2p(num_senders: int, receivers: Sequence[WeightReceiver]) -> list[list[int]]:
    """Engine indices per sender rank: each engine goes to the sender with the fewest
    receiving ranks so far (ties to the lowest rank), largest engines first."""
    if num_senders <= 0:
        raise ValueError("weights=p2p needs at least one learner rank")
    if not receivers:
        raise ValueError("weights=p2p needs at least one engine to send to")
    load = [0] * num_senders
    plan: list[list[int]] = [[] for _ in range(num_senders)]
    for i in sorted(range(len(receivers)), key=lambda i: -receivers[i].num_ranks):
        r = min(range(num_senders), key=lambda r: (load[r], r))
        plan[r].append(i)
        load[r] += receivers[i].num_ranks
    return [sorted(p) for p in plan]


def format_plan(plan: list[list[int]], receivers: Sequence[WeightReceiver]) -> str:
    return "; ".join(f"learner {r} -> " + (", ".join(receivers[i].name for i in p) or "(none)")
                     for r, p in enumerate(plan))


class P2PSync(BroadcastSync):
    """Same protocol calls as ``BroadcastSync``; each rank runs it on its own engines."""

    def __init__(self, *, rank: int, world_size: int, master_address: str, bucket_bytes: int,
                 backend: str, timeout_s: float, device: torch.device | str = "cpu") -> None:
        super().__init__(rank=rank, master_address=master_address, bucket_bytes=bucket_bytes,
                         backend=backend, timeout_s=timeout_s, device=device)
        self.world_size = world_size
        self.group_name = f"rl-weights-p2p-{rank}"
        self.plan: list[list[int]] = []

    def connect(self, receivers: Sequence[WeightReceiver]) -> None:
        self.plan = plan_p2p(self.world_size, receivers)
        mine = [receivers[i] for i in self.plan[self.rank]]
        if not mine:
            return  # more learner ranks than engines: this rank only helps gather
        self._open_group(mine)

    def reconnect(self, receivers: Sequence[WeightReceiver], replaced: Sequence[int]) -> None:
        """Only the senders of replaced engines form their groups again (the plan depends on
        the engines' sizes, which a replacement keeps); the others keep theirs."""
        mine = self.plan[self.rank]
        if any(i in mine for i in replaced) or self.broken:
            self._reopen_group([receivers[i] for i in mine],
                               gone=[k for k, i in enumerate(mine) if i in replaced])
