"""``model`` group: which policy the learners train and the engines serve."""

from __future__ import annotations

import json
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
    """Fields shared by every model choice; ``model=tiny`` and ``model=hf`` below add their
    own checks."""

    _group = "model"
    name: str = "tiny"
    """Label of this model choice (shown in logs and W&B)."""
    path: Optional[str] = None
    """Hugging Face checkpoint directory (``model=hf``); unset = the built-in tiny model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny model (ignored when ``path`` is set)."""
    dtype: str = "float32"
    """The engines' dtype (passed to each as ``--dtype``; the weights are pushed in it) and
    the learner's compute dtype: float32 or bfloat16 (float16 would need loss scaling)."""
    master_dtype: str = "float32"
    """The learner's parameter and optimizer-state dtype (the master weights). Narrower
    ``dtype``: FSDP2 mixed precision computes in ``dtype`` and reduces gradients in float32,
    so that updates smaller than a bfloat16 step still move the master weights."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (for instruction-tuned checkpoints)."""

    def __post_init__(self) -> None:
        for key in ("dtype", "master_dtype"):
            if getattr(self, key) not in DTYPE_BYTES:
                raise ValueError(f"model.{key}={getattr(self, key)!r}: use float32, bfloat16 or float16")
        if self.dtype == "float16":
            # fp16 gradients underflow without a loss scaler, which this learner does not run
            raise ValueError("model.dtype=float16: the learner computes in model.dtype, and float16 "
                             "training needs loss scaling, which it does not do; use "
                             "model.dtype=bfloat16 (same memory, float32's range)")
        if self.master_dtype not in ("float32", self.dtype):
            raise ValueError(f"model.master_dtype={self.master_dtype} with model.dtype={self.dtype}: "
                             f"the master weights are float32 (mixed precision) or the compute dtype "
                             f"itself; set model.master_dtype=float32")
        if self.path is not None:
            check_checkpoint(self.path, self.chat_template)

    @property
    def mixed_precision(self) -> bool:
        """The learner computes in a narrower dtype than it keeps its weights in."""
        return self.dtype != self.master_dtype


@dataclass(kw_only=True)
class TinyChoiceConfig(ModelConfig):
    """``model=tiny``: the built-in model, built in code; no checkpoint path."""

    def __post_init__(self) -> None:
        if self.path is not None:
            raise ValueError(f"model.path={self.path!r} is set on model=tiny (the default), which "
                             f"would train the built-in tiny model in float32: select the checkpoint "
                             f"with model=hf model.path={self.path} (bfloat16 engines, float32 master "
                             f"weights), or experiment=qwen2_5_gsm8k for the real-model preset")
        if self.chat_template:
            raise ValueError("model.chat_template=true: the built-in tiny model's tokenizer has no "
                             "chat template; use it with model=hf model.path=<an instruct checkpoint>")
        super().__post_init__()


@dataclass(kw_only=True)
class HFModelConfig(ModelConfig):
    """``model=hf``: a local Hugging Face checkpoint, required."""

    name: str = "hf"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.path is None:
            raise ValueError("model=hf needs model.path=/path/to/checkpoint (a local Hugging Face "
                             "directory with config.json; models are never downloaded at run time)")
        super().__post_init__()


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where ``transformers`` saves a tokenizer's chat template besides tokenizer_config.json."""


def check_checkpoint(path: str, chat_template: bool) -> None:
    """The directory is a checkpoint, and holds a chat template when one is asked for."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"model.path={path!r} is not a Hugging Face checkpoint directory (no "
                         "config.json there); pass a local path, models are never downloaded at run time")
    if chat_template and not has_chat_template(path):
        raise ValueError(f"model.chat_template=true, but the checkpoint at {path} has no chat template "
                         f"(none in tokenizer_config.json, no {' or '.join(CHAT_TEMPLATE_FILES)}): "
                         f"use an instruct checkpoint or set model.chat_template=false")


def has_chat_template(path: str) -> bool:
    if any(os.path.exists(os.path.join(path, f)) for f in CHAT_TEMPLATE_FILES):
        return True
    if os.path.isdir(os.path.join(path, "additional_chat_templates")):
        return True
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(config):
        return False
    with open(config) as f:
        return bool(json.load(f).get("chat_template"))


SCHEMAS: dict[str, type] = {"tiny": TinyChoiceConfig, "hf": HFModelConfig}
"""Schema of each ``conf/model/*.yaml`` (``schema/model/<key>``)."""
