"""Distributed checkpoints of the learner (model + optimizer + LR schedule).

Model and optimizer state go through ``torch.distributed.checkpoint`` (each rank writes its
own shards, and a different world size can load them); the LR scheduler, step and the
rollout manager's data position are small and written as JSON/pickle-free files by rank 0
and the driver (``trainer_state.json``).
"""

from __future__ import annotations

import json
import os
import shutil

TRAINER_STATE = "trainer_state.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def save_learner(path: str, model, optimizer, scheduler) -> None:
    # torch in the functions (start-up cost): the driver imports this module, via rl.driver.run, for
    # the trainer state and must not load torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "learner"))
    if dist.get_rank() == 0:
        with open(os.path.join(path, "scheduler.json"), "w") as f:
            # LambdaLR's state holds its lambda; the counters are all a resume needs.
            json.dump({k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}, f)
    dist.barrier()


def load_learner(path: str, model, optimizer, scheduler) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, "learner"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    with open(os.path.join(path, "scheduler.json")) as f:
        state = json.load(f)
    state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)  # keep this run's lambdas
    scheduler.load_state_dict(state)


def write_trainer_state(path: str, state: dict) -> None:
    """Written last: a directory with trainer_state.json is a complete checkpoint."""
    tmp = os.path.join(path, TRAINER_STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(path, TRAINER_STATE))


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root)
                  if d.startswith("step_") and os.path.exists(os.path.join(root, d, TRAINER_STATE)))
    for d in done[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


