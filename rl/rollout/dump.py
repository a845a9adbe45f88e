"""``rollout.dump_every``: a step's samples as JSON lines, to read what the policy wrote and
how it was scored and masked (slime's ``--save-debug-rollout-data``, verl's
``rollout_data_dir``). One file per dumped batch, ``<output_dir>/rollouts/step_<step>.jsonl``,
one line per sample in the batch's order. ``step`` is the batch's number: the step of
``metrics.jsonl`` in ``train.py`` and one-step ``train_async.py``; in fully async, the
ledger's ``batch`` (``samples.jsonl``: its ``trained_at_step`` is the step, and samples
dropped as too stale are dumped as generated, though never trained)."""

from __future__ import annotations

import json
import os

from rl.rollout.functions import Sample
from rl.tasks import Prompt
from rl.types import RolloutBatch


def dump_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "rollouts", f"step_{step:06d}.jsonl")


def dump_samples(path: str, step: int, prompts: list[Prompt], groups: list[list[Sample]],
                 batch: RolloutBatch, tokenizer) -> None:
    """Write ``batch``'s samples (built from ``prompts`` and ``groups``, in order): the
    prompt, the response as text and as token ids, the loss mask as the batch holds it (a
    dropped zero-std group's is all 0), the engine's log-probs,
    what the reward scored, the reward and advantage (and each token's, with
    ``algo.turn_credit``), and the sample's id and weight version."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        i = 0
        for prompt, group in zip(prompts, groups):
            for s in group:
                f.write(json.dumps({
                    "step": step, "sample_id": int(batch.sample_id[i]), "prompt_index": prompt.index,
                    "prompt": prompt.text, "label": prompt.label,
                    "response": tokenizer.decode(s.response_ids, skip_special_tokens=True),
                    "scored_text": s.text,
                    "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i]),
                    "finished": s.finished, "weight_version": int(batch.weight_version[i]),
                    "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
                    "loss_mask": batch.loss_mask[i].tolist(), "logprobs": [round(x, 6) for x in s.logprobs],
                    **({} if batch.token_advantages is None else
                       {"token_advantages": [round(float(x), 6) for x in batch.token_advantages[i]]}),
                }) + "\n")
                i += 1
    os.replace(tmp, path)  # a reader never sees half a file
