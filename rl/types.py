"""Typed messages that cross the rollout -> training seam.

``RolloutBatch`` is what the rollout manager builds and a learner rank trains on; it is
converted to a column dict (``to_columns``) only at the store boundary. ``RolloutRef`` is
the small control-plane message the driver passes around instead of the data.

The per-token fields are flat (``Ragged``: every sample's tokens in one array, plus
offsets): the manager builds them without per-sample arrays, a codec copies each in one go,
and the learner pads a micro-batch with one scatter per field.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Sequence

import numpy as np

from transfer.data.base import Columns, Ragged, StoreRef


@dataclass
class RolloutBatch:
    """Samples of one step (or one learner rank's partition of it). One row per sample."""

    tokens: Ragged
    """int32, per sample [prompt_len + response_len]: prompt ids then the sampled response
    ids, exactly as sampled (never rewritten; the end-of-sequence token is kept when it was
    sampled)."""
    loss_mask: Ragged
    """int8, per sample [response_len]: 1 where the response token is trained on."""
    rollout_logprobs: Ragged
    """float32, per sample [response_len]: the engine's log-probs of the sampled response
    tokens."""
    prompt_len: np.ndarray
    """int32 [N]: prompt length in tokens."""
    response_len: np.ndarray
    """int32 [N]: response length in tokens."""
    rewards: np.ndarray
    """float32 [N]: scalar reward of each sample."""
    advantages: np.ndarray
    """float32 [N]: group-normalised advantage (one value per sample, broadcast over its tokens)."""
    group_id: np.ndarray
    """int64 [N]: index of the prompt (within the run) the sample answers."""
    sample_id: np.ndarray
    """int64 [N]: unique id of the sample within the run."""
    weight_version: np.ndarray
    """int64 [N]: version of the weights that generated the sample: the oldest, when a weight
    sync happened during its generation (``rl.rollout.batch.sample_weight_version``)."""
    finish_reason: list[str]
    """``stop`` (end-of-sequence sampled) or ``length`` (hit max_new_tokens)."""
    label: list[str]
    """The task's label of the prompt (for debugging and evaluation)."""
    token_advantages: Ragged | None = None
    """float32, per sample [response_len]: an advantage per token, in place of ``advantages``
    broadcast over the sample (``algo.turn_credit``: each model turn its own); None (the
    default) leaves it out of the stored columns."""

    def __post_init__(self) -> None:
        # One array per sample is accepted (tests, hand-made batches) and made flat here.
        for name, dtype in (("tokens", np.int32), ("loss_mask", np.int8),
                            ("rollout_logprobs", np.float32), ("token_advantages", np.float32)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Ragged):
                setattr(self, name, Ragged.from_arrays(value, dtype))
        rlen = np.asarray(self.response_len)
        if not (np.array_equal(self.tokens.lengths, np.asarray(self.prompt_len) + rlen)
                and np.array_equal(self.loss_mask.lengths, rlen)
                and np.array_equal(self.rollout_logprobs.lengths, rlen)
                and (self.token_advantages is None or np.array_equal(self.token_advantages.lengths, rlen))):
            raise ValueError("RolloutBatch: tokens must hold prompt_len + response_len ids per "
                             "sample, loss_mask, rollout_logprobs and token_advantages response_len values")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask.values))

    @staticmethod
    def estimate_nbytes(num_samples: int, max_prompt_tokens: int, max_new_tokens: int, *,
                        label_bytes: int, token_advantages: bool = False) -> int:
        """Upper bound of the payload of ``num_samples`` samples (codec alignment included)
        whose labels take at most ``label_bytes`` bytes of UTF-8 each."""
        per_sample = (4 * (max_prompt_tokens + max_new_tokens)  # tokens
                      + 5 * max_new_tokens                         # loss_mask + rollout_logprobs
                      + 3 * 8 + 4 * 4 + 3 * 8                      # offsets, scalar columns
                      + 2 * 8 + len("length") + label_bytes)       # strings: offsets, bytes
        buffers = 17  # each aligned, and each offsets array one entry longer than its column
        if token_advantages:
            per_sample += 4 * max_new_tokens + 8
            buffers += 2
        return num_samples * per_sample + buffers * 64 + 6 * 8

    def to_columns(self) -> Columns:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_columns(cls, columns: Columns) -> "RolloutBatch":
        names = {f.name for f in fields(cls)}
        missing = {f.name for f in fields(cls) if f.default is MISSING} - columns.keys()
        if missing:
            raise ValueError(f"rollout columns lack {sorted(missing)}")
        return cls(**{k: columns[k] for k in names & columns.keys()})

    def select(self, idx: Sequence[int]) -> "RolloutBatch":
        """Rows ``idx`` as a new batch (arrays and flat columns copied, lists new lists)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = None if v is None else v.take(idx) if isinstance(v, Ragged) else v[idx] \
                if isinstance(v, np.ndarray) else [v[i] for i in idx.tolist()]
        return RolloutBatch(**out)


@dataclass
class RolloutRef:
    """Control-plane message for one step: where each learner rank finds its partition."""

    step: int
    partitions: list[StoreRef]
    """One ref per learner rank, in rank order."""
    num_samples: int
    num_loss_tokens: int
    """Trained tokens over all partitions (the loss is normalised by this)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Rollout-side metrics of the step (reward mean, generation and put timings ...)."""
    first_sample_id: int = 0
    """The batch's samples have ids ``first_sample_id + i``, i in batch order."""
    weight_versions: list[int] = field(default_factory=list)
    """Weight version that generated sample i (batch order); -1 = the engine's initial weights."""
    prompt_indices: list[int] = field(default_factory=list)
    """The task's index of each prompt of the batch, one per group, in batch order."""
    min_version: int | None = None
    """Set when handed out for training: samples of older weights are dropped (too stale)."""

    def kept(self) -> np.ndarray:
        """Per sample (batch order): is it trained on (not older than ``min_version``)?"""
        return fresh(np.asarray(self.weight_versions, dtype=np.int64), self.min_version)


def fresh(weight_version: np.ndarray, min_version: int | None) -> np.ndarray:
    """The staleness bound, in one place: samples of ``min_version`` or newer are trained on
    (all of them when it is None)."""
    if min_version is None:
        return np.ones(len(weight_version), dtype=bool)
    return weight_version >= min_version
