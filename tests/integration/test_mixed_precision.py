"""Mixed precision as the field does it: float32 master weights and optimizer state, bfloat16
compute through FSDP2's ``MixedPrecisionPolicy``, float32 gradient reduction, and the
weights pushed to the engines in their dtype (``model.dtype``)."""

from __future__ import annotations

import os

import torch

from rl.runtime import Runtime
from tests.support.batches import make_batch
from tests.support.env import compose
from transfer.net import free_port

SMALL_LR = 1e-6
"""An AdamW step moves a weight by about the learning rate: 1e-6 is far below half a
bfloat16 step at the tiny model's weights (about 6e-5 at 0.02, 4e-3 at 1.0)."""


class RecordingSync:
    """Stands for the weight path: gathers what the learner hands it, as a sender does."""

    def __init__(self) -> None:
        self.pushed: dict[str, torch.Tensor] = {}

    def push(self, named_params, version: int) -> dict[str, float]:
        from transfer.weights.base import full_tensor

        self.pushed = {n: full_tensor(t).cpu().clone() for n, t in named_params}  # collective
        return {}

    def close(self) -> None:
        pass


def _mixed_worker(rank: int, world: int, port: int, tiny_path: str, out: str, master: str) -> None:
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    cfg = compose(f"cluster.num_learners={world}", "algo.micro_batch_size=3", "model.dtype=bfloat16",
                  f"model.master_dtype={master}", f"algo.lr={SMALL_LR}")
    learner = Learner(cfg, Runtime("mp", os.path.dirname(out), tiny_path), rank, world)
    learner.setup("127.0.0.1", port)
    try:
        reduced = []  # dtypes of the gradients FSDP2 reduce-scatters over the ranks
        scatter = torch.distributed.reduce_scatter_single

        def recording(*args, **kwargs):
            reduced.append(kwargs.get("input", args[1] if len(args) > 1 else None).dtype)
            return scatter(*args, **kwargs)

        torch.distributed.reduce_scatter_single = recording  # FSDP2's DefaultReduceScatter calls it
        compute = []  # dtypes a linear layer sees inside the forward (FSDP2's gathered weight)
        layer = next(m for m in learner.model.modules() if isinstance(m, torch.nn.Linear))
        layer.register_forward_hook(lambda m, i, o: compute.append((m.weight.dtype, o.dtype)))

        def params():
            return {n: full_tensor(p).cpu().clone() for n, p in learner.model.named_parameters()}

        before = params()
        learner.train_batch(make_batch(16).select(range(rank * 16 // world, (rank + 1) * 16 // world)))
        after = params()
        torch.distributed.reduce_scatter_single = scatter
        learner._weight_sync = sync = RecordingSync()
        learner.push_weights(version=1)
        held = {p.dtype for p in learner.model.parameters()}
        grads = {p.grad.dtype for p in learner.model.parameters()}
        optim = {v.dtype for s in learner.optimizer.state.values() for k, v in s.items() if k != "step"}
        if rank == 0:
            torch.save({"before": before, "after": after, "pushed": sync.pushed, "held": held,
                        "grads": grads, "optim": optim, "compute": set(compute),
                        "reduced": set(reduced)}, out)
    finally:
        learner.close()


def _step(ranks, master: str, tiny_path: str, tmp_path) -> dict:
    out = str(tmp_path / f"mixed_{master}.pt")
    ranks.run(_mixed_worker, (2, free_port(), tiny_path, out, master), nprocs=2)
    return torch.load(out, weights_only=False)


def _moved(got: dict, dtype: torch.dtype) -> float:
    """Fraction of the elements whose value, seen in ``dtype``, the step changed."""
    changed = sum(int((got["after"][n].to(dtype) != got["before"][n].to(dtype)).sum()) for n in got["before"])
    return changed / sum(t.numel() for t in got["before"].values())


def test_bfloat16_compute_keeps_float32_master_weights_and_pushes_bfloat16(ranks, tiny_path, tmp_path):
    got = _step(ranks, "float32", tiny_path, tmp_path)
    assert got["held"] == {torch.float32} and got["grads"] == {torch.float32}  # the master weights
    assert got["reduced"] == {torch.float32}  # gradients reduced over the ranks in float32
    assert got["optim"] == {torch.float32}  # AdamW's moments
    assert got["compute"] == {(torch.bfloat16, torch.bfloat16)}  # the forward runs in bfloat16
    assert {t.dtype for t in got["pushed"].values()} == {torch.bfloat16}
    for name, t in got["pushed"].items():  # the engines get the new master weights, rounded
        torch.testing.assert_close(t, got["after"][name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    # An update far below bfloat16's resolution moves nearly every master weight ...
    assert _moved(got, torch.float32) > 0.9
    # ... while the bfloat16 copy of most of them stays where it was
    assert _moved(got, torch.bfloat16) < 0.5


def test_pure_bfloat16_loses_the_same_update(ranks, tiny_path, tmp_path):
    """``model.master_dtype=bfloat16`` (no master copy): the same step leaves most weights
    unchanged, which is what float32 master weights are for."""
    got = _step(ranks, "bfloat16", tiny_path, tmp_path)
    assert got["held"] == {torch.bfloat16} and got["optim"] == {torch.bfloat16}
    assert got["reduced"] == {torch.bfloat16}  # the recording sees what FSDP2 reduces
    assert _moved(got, torch.float32) < 0.5
