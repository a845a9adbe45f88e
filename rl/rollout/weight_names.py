"""Which pushed parameter names an engine's loader loads, checked before the first push.

SGLang hands every received bucket to the model's ``load_weights``. For the architecture this
project supports on SGLang, ``Qwen2ForCausalLM`` (the built-in tiny model, Qwen2 and Qwen2.5
checkpoints), that is ``_legacy_load_weights`` in ``sglang/srt/models/qwen2.py`` of the
pinned release (the default; ``SGLANG_ENABLE_WEIGHT_LOADER_V2=1`` selects another loader,
not modelled here): ``q_proj``/``k_proj``/``v_proj`` fill the shards of ``qkv_proj``,
``gate_proj``/``up_proj`` those of ``gate_up_proj``, every other name is looked up as is;
rotary caches, ``projector`` weights, layers the engine does not hold and biases it lacks
are skipped silently, and any other name only logs a warning ("Parameter ... not found in
params_dict"), while the update still succeeds. A name it cannot place leaves the engine on
its old weights while the run trains on, which ``check_push_names`` refuses at start.
``load_target`` follows that loader line by line; ``tests/unit/test_sglang_contract.py`` runs
the wheel's own loader and its model's parameter names against it.

Other architectures: only names that can never match anything are refused, those carrying
a prefix that a wrapper module inserts (``torch.compile``, FSDP1, activation checkpointing,
DDP).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WRAPPER_PREFIXES = {
    "_orig_mod.": "torch.compile", "_fsdp_wrapped_module.": "FSDP1 (FullyShardedDataParallel)",
    "_checkpoint_wrapped_module.": "activation checkpointing (checkpoint_wrapper)",
    "module.": "DistributedDataParallel",
}
"""Name components that wrappers insert, and who inserts them; no engine model has them."""

QWEN2 = "Qwen2ForCausalLM"

STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
"""SGLang's ``stacked_params_mapping`` for Qwen2: (its parameter, the pushed name's part, shard)."""

_QWEN2_LAYER = {  # a decoder layer's parameters in SGLang's Qwen2 and the shards each holds
    "self_attn.qkv_proj.weight": ("q", "k", "v"), "self_attn.qkv_proj.bias": ("q", "k", "v"),
    "self_attn.o_proj.weight": (None,), "mlp.gate_up_proj.weight": (0, 1),
    "mlp.down_proj.weight": (None,), "input_layernorm.weight": (None,),
    "post_attention_layernorm.weight": (None,),
}
_SKIPPED = ("rotary_emb.inv_freq", "projector", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class PushedModel:
    """What the learners will push, as the names check needs it."""

    names: list[str]
    """Parameter names, in push order."""
    num_layers: int
    """Decoder layers (``config.num_hidden_layers``)."""
    tied_embeddings: bool
    """``config.tie_word_embeddings``: the output layer is the input embedding."""


def qwen2_params(num_layers: int, tied_embeddings: bool) -> dict[str, tuple]:
    """SGLang's ``Qwen2ForCausalLM`` parameters on one rank (no tensor or pipeline
    parallelism, unquantised), each with the shards its loader fills (None: the whole).
    Tied, ``lm_head`` is the embedding module and has no parameter of its own."""
    params: dict[str, tuple] = {"model.embed_tokens.weight": (None,)}
    for i in range(num_layers):
        params.update({f"model.layers.{i}.{k}": v for k, v in _QWEN2_LAYER.items()})
    params["model.norm.weight"] = (None,)
    if not tied_embeddings:
        params["lm_head.weight"] = (None,)
    return params


def load_target(name: str, params: dict[str, tuple], num_layers: int) -> tuple[str, object] | None:
    """Where SGLang's Qwen2 loader puts a pushed tensor: (its parameter, shard), or None
    when it drops it. The same steps as ``_legacy_load_weights``, in its order (the name is
    rewritten as the stacked mapping is walked, as there)."""
    layer = re.search(r"layers\.(\d+)\.", name)  # SGLang's get_layer_id
    if layer is not None and not 0 <= int(layer.group(1)) < num_layers:
        return None
    if any(s in name for s in _SKIPPED):
        return None
    if name.startswith("model.vision_tower") and name not in params:
        return None
    for param, part, shard in STACKED:
        if part not in name:
            continue
        name = name.replace(part, param)
        if name in params:
            return name, shard
    return (name, None) if name in params else None


def wrapper_prefix(name: str) -> str | None:
    """The wrapper component ``name`` carries (``module.`` only in front), or None."""
    parts = name.split(".")
    for prefix in WRAPPER_PREFIXES:
        # DDP wraps the whole model only; the others can wrap any submodule
        found = parts[0] == "module" if prefix == "module." else prefix[:-1] in parts
        if found:
            return prefix
    return None


def check_push_names(model: PushedModel, architectures: list[str] | None, engine: str) -> str:
    """Refuse, naming ``engine`` and each parameter, names its loader would not load, and (for
    Qwen2) engine parameters no name fills; returns what was checked, for the log."""
    wrapped: dict[str, list[str]] = {}
    for name in model.names:
        if (prefix := wrapper_prefix(name)) is not None:
            wrapped.setdefault(prefix, []).append(name)
    problems = [f"{len(names)} name(s) carry {p!r}, inserted by {WRAPPER_PREFIXES[p]} (first: "
                f"{names[0]!r}): push the wrapped module's own names (strip the prefix)"
                for p, names in wrapped.items()]
    arch = (architectures or [None])[0]
    if arch == QWEN2 and not problems:  # (with wrapped names, every parameter would look unfilled)
        problems += _qwen2_problems(model)
        checked = (f"{len(model.names)} names fill every parameter of SGLang's {QWEN2} loader "
                   f"({model.num_layers} layers)")
    else:
        checked = f"names checked for wrapper prefixes only (no loader rules here for {arch})"
    if problems:
        shown = "\n  - ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError(
            f"{engine} ({arch}) would not load what the learners push: its loader logs a warning "
            f"for a name it cannot place and keeps its old weights, and the run would train "
            f"against them:\n  - {shown}{more}")
    return checked


def _qwen2_problems(model: PushedModel) -> list[str]:
    params = qwen2_params(model.num_layers, model.tied_embeddings)
    filled: set[tuple[str, object]] = set()
    problems = []
    for name in model.names:
        target = load_target(name, params, model.num_layers)
        if target is not None:
            filled.add(target)
        elif not (model.tied_embeddings and name == "lm_head.weight"):
            # (tied: the loader drops lm_head.weight, and loads the same tensor as the embedding)
            problems.append(f"{name!r} matches no parameter of {QWEN2} (SGLang: \"Parameter ... "
                            f"not found in params_dict\", or skipped)")
    for param, shards in params.items():
        for shard in shards:
            if (param, shard) not in filled:
                part = next((p for q, p, s in STACKED if q in param and s == shard), None)
                what = f"{param!r}" + (f" (its {part} shard)" if part else "")
                problems.append(f"engine parameter {what} is filled by no pushed name: it would "
                                f"keep the checkpoint's values")
    return problems
