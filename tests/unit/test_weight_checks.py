"""The names check before the first push (``rl.rollout.weight_names``) and the probes of the
content check after the first pushes (``rl.driver.weight_checks``), on an in-process model; the
checks against an engine over HTTP are in tests/integration/test_weight_checks.py, and
tests/unit/test_sglang_contract.py holds the names rules to the release's own loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl.rollout.weight_names import PushedModel, check_push_names
from rl.driver.weight_checks import pick_probes, pushed_model

QWEN2 = ["Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    from rl.model import load_model

    return load_model(tiny_path)


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


# -- content --------------------------------------------------------------------------------
def test_probes_are_a_few_small_parameters_from_both_ends(tiny):
    shapes = pushed_model(SimpleNamespace(model=tiny))[1]
    assert pick_probes(shapes) == {"model.layers.0.self_attn.q_proj.bias": 8192,
                                   "model.norm.weight": 8192,
                                   "model.layers.1.self_attn.v_proj.weight": 128}


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
