"""Exact checkpoints: two FSDP2 learner ranks (gloo) train a few steps and save; fresh
learners load the checkpoint and hold every parameter, every optimizer state tensor and the
LR schedule bit for bit; one more step from the restored state equals one more step from
the original, bit for bit, on the same batch."""

from __future__ import annotations

import os

import numpy as np
import torch

from rl.runtime import Runtime
from tests.support.batches import make_batch
from tests.support.cluster_checks import bits
from tests.support.env import compose
from transfer.net import free_port

WORLD = 2
OVERRIDES = (f"cluster.num_learners={WORLD}", "algo.micro_batch_size=3", "num_steps=8",
             # the LR changes every step: a schedule that does not resume shows in the weights
             "algo.lr_schedule=cosine", "algo.warmup_steps=2", "algo.weight_decay=0.01")
TIMING = ("train/tokens_per_s", "perf/")  # metrics that measure time, not the update


def snapshot(learner) -> dict:
    """Whole (unsharded) model and optimizer state and the scheduler's counters (a
    collective: every rank calls it; rank 0 gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sched = {k: v for k, v in learner.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"model": {k: v.clone() for k, v in model_sd.items()},
            "optim": {"state": {k: {n: v.clone() for n, v in s.items()}
                                for k, s in optim_sd.get("state", {}).items()},
                      "param_groups": optim_sd.get("param_groups", [])},
            "scheduler": sched}


def _worker(rank: int, ports: tuple[int, int], tiny_path: str, out_dir: str,
            extra: tuple[str, ...] = ()) -> None:
    from rl.learner.learner import Learner

    cfg = compose(*OVERRIDES, *extra)
    runtime = Runtime("ckpt", out_dir, tiny_path)
    batches = [make_batch(16, seed=s) for s in range(4)]

    def part(batch):  # this rank's half: the same partition for both continuations
        return batch.select(range(rank * len(batch) // WORLD, (rank + 1) * len(batch) // WORLD))

    path = os.path.join(out_dir, "step_000003")
    original = Learner(cfg, runtime, rank, WORLD)
    original.setup("127.0.0.1", ports[0])
    for batch in batches[:3]:
        original.train_batch(part(batch))
    original.save(path)
    saved = snapshot(original)
    next_metrics = original.train_batch(part(batches[3]))
    after = snapshot(original)
    original.close()

    restored = Learner(cfg, runtime, rank, WORLD)  # fresh model, optimizer and schedule
    restored.setup("127.0.0.1", ports[1])
    fresh = snapshot(restored)
    restored.load(path)
    loaded = snapshot(restored)
    restored_metrics = restored.train_batch(part(batches[3]))
    restored_after = snapshot(restored)
    restored.close()
    if rank == 0:
        torch.save({"saved": saved, "after": after, "fresh": fresh, "loaded": loaded,
                    "restored_after": restored_after, "next_metrics": next_metrics,
                    "restored_metrics": restored_metrics}, os.path.join(out_dir, "states.pt"))


def assert_same_state(got: dict, want: dict, what: str) -> None:
    """Every parameter and optimizer state tensor bit for bit, the same param groups and
    scheduler counters."""
    assert got["model"].keys() == want["model"].keys(), what
    for name, t in want["model"].items():
        assert got["model"][name].dtype == t.dtype, (what, name)
        np.testing.assert_array_equal(bits(got["model"][name]), bits(t), err_msg=f"{what}: {name}")
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys(), what
    for name, state in want["optim"]["state"].items():
        assert got["optim"]["state"][name].keys() == state.keys(), (what, name)
        for key, t in state.items():
            np.testing.assert_array_equal(bits(got["optim"]["state"][name][key]), bits(t),
                                          err_msg=f"{what}: optimizer {key} of {name}")
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"], what
    assert got["scheduler"] == want["scheduler"], what


def test_checkpoint_restores_exactly_and_training_continues_bit_for_bit(ranks, tiny_path, tmp_path):
    ranks.run(_worker, ((free_port(), free_port()), tiny_path, str(tmp_path)), nprocs=WORLD)
    s = torch.load(os.path.join(tmp_path, "states.pt"), weights_only=False)
    saved = s["saved"]
    # what is compared is all there: every parameter has AdamW's step, exp_avg, exp_avg_sq
    assert len(saved["model"]) > 0 and saved["optim"]["state"].keys() == saved["model"].keys()
    assert all(st.keys() == {"step", "exp_avg", "exp_avg_sq"} for st in saved["optim"]["state"].values())
    assert saved["scheduler"]["last_epoch"] == 3 and saved["scheduler"]["_step_count"] == 4
    # a fresh learner differs from the checkpoint (the load has something to do)
    assert any(not np.array_equal(bits(s["fresh"]["model"][n]), bits(t)) for n, t in saved["model"].items())
    # (reading a fresh optimizer's state dict initialises it: step 1, zero moments)
    assert all(not st["exp_avg"].any() for st in s["fresh"]["optim"]["state"].values())
    assert any(st["exp_avg"].any() for st in saved["optim"]["state"].values())
    assert s["fresh"]["scheduler"] != saved["scheduler"]

    assert_same_state(s["loaded"], saved, "restored")
    assert_same_state(s["restored_after"], s["after"], "one step after the restore")
    assert any(not np.array_equal(bits(s["after"]["model"][n]), bits(t)) for n, t in saved["model"].items())
    update = {k: v for k, v in s["next_metrics"].items() if not k.startswith(TIMING)}
    assert update and update == {k: v for k, v in s["restored_metrics"].items() if not k.startswith(TIMING)}


def test_checkpoint_with_several_steps_per_rollout_continues_bit_for_bit(ranks, tiny_path, tmp_path):
    """``algo.steps_per_rollout=2``: every rollout is shuffled (seeded by the run's seed and
    the rollout count, which the checkpoint must carry) into two mini-batches, each its own
    optimizer step against behaviour log-probs. The restored learners split and step as the
    original ones did, bit for bit."""
    ranks.run(_worker, ((free_port(), free_port()), tiny_path, str(tmp_path), ("algo.steps_per_rollout=2",)),
              nprocs=WORLD)
    s = torch.load(os.path.join(tmp_path, "states.pt"), weights_only=False)
    saved = s["saved"]
    assert len(saved["model"]) > 0 and saved["optim"]["state"].keys() == saved["model"].keys()
    # two optimizer steps per rollout: AdamW counted 2 per rollout, the schedule 1 per rollout
    assert all(float(st["step"]) == 6 for st in saved["optim"]["state"].values())
    assert saved["scheduler"]["last_epoch"] == 3 and saved["scheduler"]["_step_count"] == 4
    assert any(not np.array_equal(bits(s["fresh"]["model"][n]), bits(t)) for n, t in saved["model"].items())
    assert s["fresh"]["scheduler"] != saved["scheduler"]

    assert_same_state(s["loaded"], saved, "restored")
    assert_same_state(s["restored_after"], s["after"], "one step after the restore")
    assert all(float(st["step"]) == 8 for st in s["after"]["optim"]["state"].values())
    assert any(not np.array_equal(bits(s["after"]["model"][n]), bits(t)) for n, t in saved["model"].items())
    nxt = s["next_metrics"]
    assert nxt["train/optimizer_steps"] == 2 and nxt["perf/old_logp_time"] > 0
    assert nxt["train/approx_kl"] > 0  # the second step's ratio is not 1: the split matters
    update = {k: v for k, v in nxt.items() if not k.startswith(TIMING)}
    assert update == {k: v for k, v in s["restored_metrics"].items() if not k.startswith(TIMING)}
