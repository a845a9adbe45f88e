"""The fixtures of the tiers, each conftest importing the ones its tier may use: composed
configs need the tiny checkpoint (``tiny_path``) and a tiny chat checkpoint
(``chat_model_path``), which every tier has; the process fixtures, which the unit tier does
not: one local Ray per test module (``ray_local``), one ``ray start --head`` that a module's
runs share (``shared_ray``), two spawned processes that learners run in (``ranks``), and a
registered data backend's overrides with a Mooncake master of the test's own
(``data_path``, parametrized indirectly with a ``BACKENDS`` label); and, autouse where a
tier imports it, the test's own time limit for the runs it starts (``test_deadline``)."""

from __future__ import annotations

import os
import time

import pytest
from pytest_timeout import _get_item_settings  # how the plugin itself reads a test's limit

from rl.config.transfer import BACKENDS, MooncakeTransferConfig
from tests.support.env import REPO, compose
from tests.support.procs import RAY_HEAD_DIR, ray_head
from tests.support.runs import TEST_DEADLINE
from transfer.data.mooncake.master import MooncakeMaster


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


@pytest.fixture(autouse=True)
def test_deadline(request):
    """When this test's pytest-timeout limit falls, as pytest-timeout reads it (a ``timeout``
    marker, ``--timeout``, ``PYTEST_TIMEOUT``, the ini's ``timeout``; 0: none): a run it starts
    (tests/support/runs.py) is stopped and reported before it, not cut off with the test."""
    limit = _get_item_settings(request.node).timeout
    TEST_DEADLINE["at"] = time.monotonic() + float(limit) if limit else None
    yield
    TEST_DEADLINE["at"] = None


@pytest.fixture(scope="module")
def shared_ray():
    """The module's runs (``python train.py`` ...) and its in-process Ray share one
    ``ray_head()``."""
    with ray_head() as address:
        yield address


@pytest.fixture(scope="session")
def ranks():
    """Two spawned processes that learners of the tests run in, one call after another
    (tests/support/ranks.py)."""
    from tests.support.ranks import SpawnedRanks

    pool = SpawnedRanks(size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def ray_local():
    """The test process's own Ray for the module; under ``shared_ray``, a connection to it."""
    import ray

    shared = RAY_HEAD_DIR in os.environ  # set by ray_head() only: never a cluster of the user's
    # "local": a new cluster of the test's own, never one that a `ray start` elsewhere on the
    # machine announced in /tmp/ray (ray.init() with no address joins that one)
    ray.init(address=None if shared else "local", num_cpus=None if shared else 2,
             include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture
def data_path(request, tmp_path):
    """The overrides of a registered data backend (``BACKENDS``), and for Mooncake a master
    of the test's own (to read its keys), else None."""
    overrides = BACKENDS[request.param]
    if not isinstance(compose(*overrides).transfer, MooncakeTransferConfig):
        yield overrides, None
        return
    master = MooncakeMaster("127.0.0.1", log_path=str(tmp_path / "master.log")).start()
    try:
        yield [*overrides, f"transfer.master_server_address={master.address}",
               f"transfer.metadata_server={master.metadata_server}"], master
    finally:
        master.stop()
