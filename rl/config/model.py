"""``model`` group: which policy the learners train and the engines serve."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from rl.config.checks import positive

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The parameter dtypes ``model.dtype`` accepts, and the bytes of one element."""


@dataclass(kw_only=True)
class TinyModelConfig:
    """Architecture of the built-in tiny Qwen2 model (used when ``model.path`` is unset)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of the MLP."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    max_positions: int = 128
    """Longest sequence (prompt + response) in tokens."""
    init_seed: int = 0
    """Seed of the initial weights; same seed, same weights, same cache entry."""

    def __post_init__(self) -> None:
        positive(self, "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_positions")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny: hidden_size must divide by num_heads and num_heads "
                             "by num_kv_heads")


@dataclass(kw_only=True)
class ModelConfig:
    _group = "model"
    name: str = "tiny"
    """Label of this model choice (shown in logs and W&B)."""
    path: Optional[str] = None
    """Hugging Face checkpoint directory; unset = the built-in tiny model, built and cached in code."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny model (ignored when ``path`` is set)."""
    dtype: str = "float32"
    """Parameter dtype of the learners and of the engines, which sample in it (float32,
    bfloat16, float16; passed to each engine as ``--dtype``)."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (for instruction-tuned checkpoints)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            path = os.path.expanduser(self.path)
            if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
                raise ValueError(f"model.path={self.path!r} is not a Hugging Face checkpoint "
                                 "directory (no config.json there); pass a local path, models "
                                 "are never downloaded at run time")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


SCHEMAS: dict[str, type] = {"base": ModelConfig}
"""Schema of each ``conf/model/*.yaml`` base (``schema/model/<key>``)."""
