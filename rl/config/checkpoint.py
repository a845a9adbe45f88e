"""``checkpoint``: when and where to save, and what to resume from (a plain field of the
root config, not a group: there is one kind)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 50
    """Save model, optimizer, step and data position every this many steps (0 = never)."""
    dir: Optional[str] = None
    """Where to save; unset = ``<run output dir>/checkpoints``."""
    resume: Optional[str] = None
    """A checkpoint directory (``.../checkpoints/step_000050``) to resume from."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted)."""
    save_hf: bool = False
    """Also write each checkpoint's policy as a Hugging Face model directory, ``<step dir>/hf``
    (safetensors in ``model.dtype``, the source model's config and tokenizer files), which
    ``transformers`` and ``model=hf model.path=`` load."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last <= 0:
            raise ValueError("checkpoint.every must be >= 0 and checkpoint.keep_last > 0")
        if self.save_hf and not self.every:
            raise ValueError("checkpoint.save_hf=true writes the Hugging Face model beside each "
                             "checkpoint, and checkpoint.every=0 saves none: set checkpoint.every "
                             "(the last step is always saved), or convert an earlier checkpoint "
                             "with python -m rl.learner.export_hf")
        if self.resume is not None and not os.path.exists(
                os.path.join(os.path.expanduser(self.resume), "trainer_state.json")):
            raise ValueError(f"checkpoint.resume={self.resume!r} is not a checkpoint "
                             "(no trainer_state.json there)")
