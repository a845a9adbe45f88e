"""A peer that dies in the middle of a weight broadcast: the sender aborts the side group at
once, names the engine, forms the group again with its replacement at the next sync, and the
next push reaches every engine. Real gloo groups between real processes; what only NCCL on
GPUs can show is listed in docs/sglang.md."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from tests.support.side_group_peer import PeerReceiver
from transfer.net import free_port
from transfer.weights.broadcast import BroadcastSync, UpdateFailed
from transfer.weights.group import ASYNC_ERROR_HANDLING, CLEAN_UP_ONLY, init_side_group

TENSORS = 6


def _params(version: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", torch.full((4096,), version * 100.0 + i)) for i in range(TENSORS)]


def _replace(peers: list[PeerReceiver], error: UpdateFailed) -> list[int]:
    """What the rollout side does after a failed push (rl/rollout/fleet.py): stop every engine that died
    or gave no answer, start a new one in its place; returns their positions."""
    gone = [i for i, p in enumerate(peers) if not p.process.is_alive() or p.name in error.unanswered]
    for i in gone:
        peers[i].stop()
        peers[i] = PeerReceiver(peers[i].name)
        peers[i].get_weight_version()  # up and answering before anything is timed
    return gone


def test_a_peer_dying_mid_broadcast_is_aborted_and_the_group_formed_again_with_its_replacement():
    # engine-1 dies after the first push, three tensors into the second one's only bucket
    peers = [PeerReceiver("engine-0"), PeerReceiver("engine-1", die_after=TENSORS + 3)]
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20, backend="gloo",
                         timeout_s=60)
    try:
        sync.connect(peers)
        sync.push(_params(1), 1)
        assert [p.get_weight_version() for p in peers] == ["1", "1"]

        t0 = time.monotonic()
        with pytest.raises(UpdateFailed) as e:
            sync.push(_params(2), 2)
        assert time.monotonic() - t0 < 20, "the failure waited for the group's timeout"
        assert "engine-1" in str(e.value)
        assert sync.broken and sync.group.aborted

        gone = _replace(peers, e.value)
        assert 1 in gone
        t0 = time.monotonic()
        sync.reconnect(peers, gone)
        assert time.monotonic() - t0 < 20, "leaving the aborted group waited for its timeout"
        assert not sync.broken and not sync.group.aborted

        sync.push(_params(3), 3)
        for p in peers:
            assert p.get_weight_version() == "3"
            for name, t in _params(3):
                assert p.weight(name) == t.tolist(), (p.name, name)
    finally:
        sync.close()
        for p in peers:
            p.stop()


def _group_built_under(monkeypatch, backend: str) -> str | None:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` as the process group's constructor would read it, for
    a one-rank side group of ``backend`` (built as gloo here: this machine may have no GPU)."""
    seen: dict[str, str | None] = {}
    build = c10d._new_process_group_helper

    def record(world_size, rank, ranks, _backend, store, **kwargs):
        seen["env"] = os.environ.get(ASYNC_ERROR_HANDLING)
        return build(world_size, rank, ranks, c10d.Backend("gloo"), store, **kwargs)

    monkeypatch.setattr(c10d, "_new_process_group_helper", record)
    group = init_side_group(backend=backend, master_address="127.0.0.1", master_port=free_port(),
                            rank=0, world_size=1, group_name=f"env-check-{backend}", timeout_s=10)
    group.destroy()
    return seen["env"]


@pytest.mark.parametrize("before", [None, "3"])
def test_an_nccl_side_group_is_built_so_that_a_peer_death_does_not_end_the_process(monkeypatch, before):
    """ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING in its constructor; its default
    (3) makes the watchdog end the process on a failed or timed-out collective."""
    if before is None:
        monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(ASYNC_ERROR_HANDLING, before)
    assert _group_built_under(monkeypatch, "nccl") == CLEAN_UP_ONLY
    assert os.environ.get(ASYNC_ERROR_HANDLING) == before  # the learners' own groups keep theirs
    assert _group_built_under(monkeypatch, "gloo") == before
