"""The weight seam: push the learner's parameters into the rollout engines.

Two protocols meet here.

``WeightReceiver`` is the engine side, the subset of SGLang's public weight-update API
that a sender needs (the HTTP client in ``rl.rollout.client`` satisfies it, for SGLang and
for the CPU engine alike)::

    r.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                group_name, backend)      # once: joins the sender's side group
    r.begin_weight_update()                                # per push: open a session
    r.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                      weight_version)      # per bucket: receive a broadcast
    r.end_weight_update()                                  # close the session, flush the cache
    r.get_weight_version()                                 # what the engine now serves
    r.destroy_weights_update_group(group_name)             # at exit

Engine ranks in a group are ``rank_offset + tp_rank``; the sender is rank 0 and broadcasts
each tensor of a bucket in the order of ``names`` (SGLang receives them in that order).

``WeightSync`` is the learner side. Every learner rank calls every method in the same
order, because gathering sharded (FSDP2) parameters is a collective::

    sync.connect(receivers)             # once, after engines are up
    sync.push(named_params, version)    # after every optimizer step
    sync.close()                        # at exit (also on error)
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class WeightReceiver(Protocol):
    name: str
    """Human-readable engine name used in errors (e.g. ``engine-1 (http://10.0.0.2:30001)``)."""
    num_ranks: int
    """Ranks this engine occupies in an update group (its tensor-parallel size)."""

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None: ...

    def begin_weight_update(self) -> None: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str) -> None: ...

    def end_weight_update(self) -> None: ...

    def get_weight_version(self) -> str: ...

    def destroy_weights_update_group(self, group_name: str) -> None: ...


@runtime_checkable
class WeightSync(Protocol):
    def connect(self, receivers: Sequence[WeightReceiver]) -> None: ...

    def reconnect(self, receivers: Sequence[WeightReceiver], replaced: Sequence[int]) -> None:
        """Engines ``replaced`` (indices into ``receivers``) were started again: form the
        update groups they belong to anew, with every engine of those groups."""
        ...

    def push(self, named_params: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Send every parameter to the engines; return metrics (``weights/bytes`` ...)."""
        ...

    def close(self) -> None: ...


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter; a collective for DTensors."""
    # start-up cost: 0.6 s that the CPU engine, which imports this package, never needs
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into buckets of at most ``bucket_bytes`` (one tensor may
    exceed it on its own only if it is larger than the bound; callers reject that early)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang's API expects)."""
    return str(dtype).removeprefix("torch.")
