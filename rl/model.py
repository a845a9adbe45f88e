"""Models and tokenizers: the built-in tiny Qwen2 (built in code) and real checkpoints.

Both go through the same ``transformers`` loading code: the tiny model is built once from
a ``Qwen2Config`` with a character tokenizer, saved as an ordinary Hugging Face checkpoint
under a cache directory keyed by its config, and loaded from there like any other
checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from rl.config import DTYPE_BYTES, ModelConfig, TinyModelConfig

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 :+=-*?.,!")
_TINY_FORMAT = 1  # bump when the tiny model's construction changes
TINY_MARKER = "rl_datapath_tiny.json"


def cache_root() -> str:
    return os.environ.get("RL_DATAPATH_CACHE", os.path.expanduser("~/.cache/rl-datapath"))


def resolve_model_path(cfg: ModelConfig) -> str:
    """The checkpoint directory to load: ``cfg.path``, or the tiny model's cache entry
    (built on first use; later calls with the same config return the same directory)."""
    if cfg.path is not None:
        return os.path.abspath(os.path.expanduser(cfg.path))
    return build_tiny_checkpoint(cfg.tiny)


def build_tiny_checkpoint(tiny: TinyModelConfig) -> str:
    spec = {"format": _TINY_FORMAT, "chars": "".join(CHARS), **vars(tiny)}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = os.path.join(cache_root(), f"tiny-qwen2-{digest}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache_root())
    try:
        tokenizer = build_char_tokenizer()
        model = _build_tiny_model(tiny, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, TINY_MARKER), "w") as f:
            json.dump(spec, f, indent=1)
        try:
            os.rename(tmp, target)  # atomic: readers see a whole checkpoint or none
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_char_tokenizer():
    """A character-level fast tokenizer: one token per character, plus pad/eos/unk."""
    # transformers in the functions (start-up cost, about 0.8 s): the driver imports this
    # module through rl.driver.run before it validates the config
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _build_tiny_model(tiny: TinyModelConfig, tokenizer):
    import torch  # torch and transformers where a model is built: the driver and the rollout
    from transformers import Qwen2Config, Qwen2ForCausalLM  # manager read checkpoints only

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_positions, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, use_sliding_window=False)
    torch.manual_seed(tiny.init_seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


def load_tokenizer(path: str):
    if os.path.exists(os.path.join(path, TINY_MARKER)):
        # AutoTokenizer would pick Qwen2's byte-level tokenizer class from config.json and
        # replace our character pre-tokenizer; load the saved tokenizer.json as it is (and
        # without AutoTokenizer's import of torch: the rollout manager has no other use for it).
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: str = "float32", device: str | torch.device = "cpu"):
    """A causal LM from a checkpoint directory, in ``dtype`` on ``device``, in train mode off."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """End-of-sequence ids: the tokenizer's plus the generation config's (chat models have several)."""
    ids = {tokenizer.eos_token_id}
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def largest_param_bytes(path: str, dtype: str) -> int:
    """Bytes of the largest parameter (embedding or MLP matrix), read from config.json only."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    hidden = int(c.get("hidden_size", 0))
    biggest = max(int(c.get("vocab_size", 0)) * hidden, int(c.get("intermediate_size", 0)) * hidden)
    return biggest * DTYPE_BYTES[dtype]
