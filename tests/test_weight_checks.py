"""The names check before the first push and the content check after the first pushes
(``rl.rollout.weight_names``, ``rl.weight_checks``), with the learners' side run on an
in-process model and the engines' side on a real CPU engine over HTTP (or a server that
answers as SGLang does for a Qwen2 model). ``tests/test_sglang_contract.py`` holds the rules
here to the release's own loader and route."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rl.config import HFRolloutConfig
from rl.rollout.client import EngineClient
from rl.rollout.engines.launcher import EngineProcess
from rl.rollout.weight_names import PushedModel, check_push_names
from rl.weight_checks import CONTENT_CHECKS, ContentCheck, check_names, pick_probes, pushed_model
from tests.http_app import ThreadedApp

QWEN2 = ["Qwen2ForCausalLM"]


class Learners:
    """``LearnerGroup.run`` on one in-process learner holding ``model`` (rank 0)."""

    def __init__(self, model) -> None:
        self.learner = SimpleNamespace(model=model, rank=0)
        self.calls = 0

    def run(self, fn, *args, rank0_only: bool = False):
        self.calls += 1
        return fn(self.learner, *args)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    from rl.model import load_model

    return load_model(tiny_path)


@pytest.fixture(scope="module")
def engine(tiny_path, tmp_path_factory):
    proc = EngineProcess(0, HFRolloutConfig(engine_start_timeout_s=120), tiny_path, seed=0,
                         log_dir=str(tmp_path_factory.mktemp("logs")), host="127.0.0.1")
    url = proc.start()
    yield EngineClient(url, "engine-0", timeout_s=60)
    proc.stop()


def _names(tiny) -> PushedModel:
    return pushed_model(SimpleNamespace(model=tiny))[0]


def _renamed(model: PushedModel, names: list[str]) -> PushedModel:
    return PushedModel(names, model.num_layers, model.tied_embeddings)


# -- names ----------------------------------------------------------------------------------
def test_the_tiny_models_names_fill_every_parameter_of_sglangs_qwen2(tiny):
    model = _names(tiny)
    assert (model.num_layers, model.tied_embeddings) == (2, False)
    assert check_push_names(model, QWEN2, "engine-0") == \
        f"{len(model.names)} names fill every parameter of SGLang's Qwen2ForCausalLM loader (2 layers)"


@pytest.mark.parametrize("wrapped,wrapper", [
    ("_orig_mod.{}", "torch.compile"), ("module.{}", "DistributedDataParallel"),
    ("model.layers.0._fsdp_wrapped_module.{}", "FSDP1"),
    ("model.layers.0._checkpoint_wrapped_module.{}", "activation checkpointing")])
@pytest.mark.parametrize("architectures", [QWEN2, ["LlamaForCausalLM"], None])
def test_a_wrapped_name_is_refused_naming_engine_parameter_and_wrapper(tiny, wrapped, wrapper,
                                                                       architectures):
    model = _names(tiny)
    bad = wrapped.format(model.names[3])
    with pytest.raises(ValueError) as e:
        check_push_names(_renamed(model, model.names[:3] + [bad] + model.names[4:]), architectures,
                         "engine-1 (http://h:1)")
    assert "engine-1 (http://h:1)" in str(e.value) and repr(bad) in str(e.value)
    assert wrapper in str(e.value) and "keeps its old weights" in str(e.value)


def test_a_name_the_loader_cannot_place_and_a_parameter_left_unfilled_are_refused(tiny):
    model = _names(tiny)
    renamed = [n.replace("layers.1.mlp.up_proj", "layers.1.mlp.upproj") for n in model.names]
    with pytest.raises(ValueError) as e:
        check_push_names(_renamed(model, renamed), QWEN2, "engine-0")
    message = str(e.value)
    assert "'model.layers.1.mlp.upproj.weight' matches no parameter" in message
    assert ("'model.layers.1.mlp.gate_up_proj.weight' (its up_proj shard) is filled by no pushed "
            "name") in message
    missing = [n for n in model.names if n != "model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"qkv_proj.bias' \(its k_proj shard\)"):
        check_push_names(_renamed(model, missing), QWEN2, "engine-0")
    stacked = [n.replace("q_proj", "qkv_proj") for n in model.names]  # SGLang's own names
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.qkv_proj.weight' matches no parameter"):
        check_push_names(_renamed(model, stacked), QWEN2, "engine-0")


def test_tied_embeddings_need_no_lm_head_and_take_one():
    layer = [f"model.layers.0.{p}" for p in (
        "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
        "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]
    names = ["model.embed_tokens.weight", *layer, "model.norm.weight"]
    check_push_names(PushedModel(names, 1, True), QWEN2, "engine-0")
    check_push_names(PushedModel(names + ["lm_head.weight"], 1, True), QWEN2, "engine-0")
    with pytest.raises(ValueError, match="'lm_head.weight' is filled by no pushed name"):
        check_push_names(PushedModel(names, 1, False), QWEN2, "engine-0")


def test_other_architectures_are_checked_for_wrappers_only():
    model = PushedModel(["model.anything.weight"], 1, False)
    assert "wrapper prefixes only" in check_push_names(model, ["LlamaForCausalLM"], "engine-0")


def test_check_names_asks_each_engine_its_architecture(tiny, engine):
    check = check_names(Learners(tiny), [engine], "float32")
    assert isinstance(check, ContentCheck) and engine.model_info()["architectures"] == QWEN2
    wrapped = torch.nn.Module()
    wrapped._orig_mod = tiny  # what torch.compile's wrapper holds
    wrapped.config = tiny.config
    with pytest.raises(ValueError, match=r"(?s)engine-0 \(http.*27 name\(s\) carry '_orig_mod.', inserted "
                                         r"by torch.compile \(first: '_orig_mod.model.embed_tokens.weight'"):
        check_names(Learners(wrapped), [engine], "float32")


# -- content --------------------------------------------------------------------------------
def test_probes_are_a_few_small_parameters_from_both_ends(tiny):
    shapes = pushed_model(SimpleNamespace(model=tiny))[1]
    assert pick_probes(shapes) == {"model.layers.0.self_attn.q_proj.bias": 8192,
                                   "model.norm.weight": 8192,
                                   "model.layers.1.self_attn.v_proj.weight": 128}


def test_the_first_pushes_are_read_back_and_a_difference_names_engine_and_parameter(tiny, engine):
    """The engine holds the checkpoint the learners loaded: equal. A learner value the engine
    does not hold, or values compared in another dtype than the engine's, is an error that
    names the engine, the parameter and the first value that differs; after
    ``CONTENT_CHECKS`` pushes nothing is read any more."""
    shapes = pushed_model(SimpleNamespace(model=tiny))[1]
    learners = Learners(tiny)
    check = ContentCheck(shapes, "float32")
    check.after_push(learners, [engine], version=0)
    assert learners.calls == 1 and check.left == CONTENT_CHECKS - 1

    other = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    other["model.norm.weight"][5] += 1.0
    moved = SimpleNamespace(named_parameters=lambda: iter(other.items()))
    with pytest.raises(RuntimeError) as e:
        ContentCheck(shapes, "float32").after_push(Learners(moved), [engine], version=4)
    message = str(e.value)
    assert f"{engine.name}: parameter 'model.norm.weight' holds other values than the learners pushed " \
           "as version 4: 1 of 64 values read back differ, the first at (5,)" in message
    assert "q_proj" not in message and "v_proj" not in message

    with pytest.raises(RuntimeError, match=r"\(bfloat16\)"):  # the engine runs float32
        ContentCheck(shapes, "bfloat16").after_push(Learners(tiny), [engine], version=0)

    for _ in range(CONTENT_CHECKS):
        check.after_push(learners, [engine], version=1)
    assert learners.calls == CONTENT_CHECKS and check.left == 0


@pytest.fixture
def qwen2_sglang():
    """A server answering ``/get_weights_by_name`` as SGLang 0.5.23 does for a Qwen2 model."""
    from aiohttp import web

    seen = []

    async def unserved(request):
        seen.append(await request.json())
        return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)

    app = web.Application()
    app.router.add_post("/get_weights_by_name", unserved)
    server = ThreadedApp(app)
    yield EngineClient(server.url, "engine-3", timeout_s=10), seen
    server.close()


def test_an_engine_that_cannot_serve_the_route_is_named_in_a_warning(tiny, engine, qwen2_sglang, caplog):
    sglang, seen = qwen2_sglang
    check = ContentCheck(pushed_model(SimpleNamespace(model=tiny))[1], "float32")
    with caplog.at_level(logging.WARNING, logger="rl.weight_checks"):
        check.after_push(Learners(tiny), [sglang, engine], version=0)
        check.after_push(Learners(tiny), [sglang, engine], version=1)
    assert [r["name"] for r in seen] == [seen[0]["name"], "model.embed_tokens.weight"]  # then left alone
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and sglang.name in warnings[0] and "not checked" in warnings[0]


def test_a_tied_output_layer_reads_as_the_embedding():
    """As SGLang's reference ``get_weights_by_name`` answers ``lm_head.weight`` of a model
    with tied embeddings (Qwen2.5 up to 3B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl.model import build_char_tokenizer
    from rl.rollout.engines.hf_engine import HFEngine

    tokenizer = build_char_tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, tie_word_embeddings=True))
    assert "lm_head.weight" not in dict(model.named_parameters())
    engine = HFEngine(model, tokenizer, [tokenizer.eos_token_id])
    embed = model.model.embed_tokens.weight[:3].tolist()
    assert engine.get_weights_by_name("lm_head.weight", 3) == embed
    with pytest.raises(ValueError, match="no parameter"):
        engine.get_weights_by_name("lm_head.bias")


def test_a_name_the_engine_lacks_is_an_error_where_the_route_is_served(tiny, engine):
    """SGLang answers an unknown name on a model that serves the route (Llama) with the same
    400 as a model without it (Qwen2): the reference parameter tells the two apart."""
    from aiohttp import web

    async def only_the_embedding(request):
        body = await request.json()
        if body["name"] == "model.embed_tokens.weight":
            return web.json_response([[0.0]])
        return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)

    app = web.Application()
    app.router.add_post("/get_weights_by_name", only_the_embedding)
    server = ThreadedApp(app)
    try:
        renamed = EngineClient(server.url, "engine-5", timeout_s=10)
        check = ContentCheck(pushed_model(SimpleNamespace(model=tiny))[1], "float32")
        with pytest.raises(RuntimeError) as e:
            check.after_push(Learners(tiny), [renamed], version=1)
        assert f"{renamed.name}: parameter '" in str(e.value)
        assert "Get parameter by name failed" in str(e.value)
        assert "engine-5" not in check.unserved
    finally:
        server.close()
