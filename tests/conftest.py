"""Shared fixtures: composed configs, the tiny checkpoint, a tiny chat checkpoint, one local
Ray per test module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "conf")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
if REPO not in sys.path:
    sys.path.insert(0, REPO)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # pytest started as a background job
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the runs it starts get Ctrl-C again


def compose(*overrides: str):
    """The typed config that ``python train.py <overrides>`` would run with."""
    from rl.config import compose as compose_config

    return compose_config(*overrides)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from rl.config import ModelConfig
    from rl.model import resolve_model_path

    return resolve_model_path(ModelConfig())


CHAT_TEMPLATE = ("{{ '<|system|>answer briefly.<|end|>' }}{% for m in messages %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template whose rendering is plain to read: ``<|system|>answer briefly.<|end|>
<|user|>PROMPT<|end|><|assistant|>`` (one line)."""


def build_chat_checkpoint(path: str) -> str:
    """A tiny instruction-style Hugging Face checkpoint in ``path``, built in code: a Llama
    model, the project's character tokenizer with four added role tokens and ``CHAT_TEMPLATE``.

    Llama, not Qwen2: transformers 5 loads every ``qwen2`` checkpoint with its own byte-level
    ``Qwen2Tokenizer`` (it distrusts the saved class), which drops the character tokenizer's
    spaces; for ``llama`` it keeps the saved ``tokenizer.json``, as for a real checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl.config import TinyModelConfig
    from rl.model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny = TinyModelConfig()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads, max_position_embeddings=tiny.max_positions,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_model_path(tmp_path_factory) -> str:
    return build_chat_checkpoint(str(tmp_path_factory.mktemp("chat-llama")))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def pids_with(fragment: str) -> list[int]:
    """PIDs of live processes whose command line contains ``fragment``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if fragment in cmd and state != "Z":
            out.append(int(pid))
    return out


@contextmanager
def running(script: str, *overrides: str):
    """A training run in the background (SIGINT acts as Ctrl-C); killed if the test leaves
    it running."""
    proc = subprocess.Popen([sys.executable, script, *overrides], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_until(proc: subprocess.Popen, prefix: str, timeout_s: float = 240) -> str:
    """The run's output up to and including the first line starting with ``prefix``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith(prefix):
            return "".join(lines)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no line {prefix!r} in the output:\n" + "".join(lines[-50:]))
