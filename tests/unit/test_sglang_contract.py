"""The CPU engine and the push checks held to the pinned SGLang release's own code
(``tests/support/sglang_release.py``), in this process:

- the installed SGLang is the pinned release, and its request types refuse what they must;
- the CPU engine serves only routes of the release's HTTP server, with methods it allows,
  and only fields of its ``GenerateRequest`` and ``SamplingParams``; whatever ``/generate``
  body the engine accepts, the release's contract gate accepts;
- the names check before the first push places every name where the release's own
  ``Qwen2ForCausalLM`` loader loads it.

Against running engines and SGLang's own receiver code: tests/integration/test_sglang_contract.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl.rollout.sglang_version import SGLANG_VERSION
from tests.support import sglang_release as sgl


def test_the_pinned_wheel_is_installed():
    assert sgl.check_pinned() == SGLANG_VERSION


def test_release_refuses_what_the_validation_refuses():
    """The request checks (tests/integration/test_sglang_contract.py) can fail: SGLang's own
    types refuse a wrong type, a missing field, a typo, an unknown sampling key, an unknown
    pause mode, a read-back without a name."""
    from sglang.api.v1.api_types import GenerateRequest, JsonContractError

    c = sgl.request_classes()
    bad = [(c["InitWeightsUpdateGroupReqInput"], {"master_address": "h", "master_port": "x",
                                                   "rank_offset": 1, "world_size": 2}),
           (c["UpdateWeightsFromDistributedReqInput"], {"names": ["a"], "dtypes": ["float32"]}),
           (c["UpdateWeightsFromDistributedReqInput"], {"names": [], "dtypes": [], "shapes": [],
                                                         "flush_cahce": False}),
           (c["PauseGenerationReqInput"], {"mode": "pause"}),
           (c["GetWeightsByNameReqInput"], {"truncate_size": 4}),
           (c["GetWeightsByNameReqInput"], {"name": "x", "truncate_size": "all"}),
           (c["GetWeightsByNameReqInput"], {"name": "x", "max_rows": 4})]
    for cls, body in bad:
        with pytest.raises(ValueError):
            sgl.validate_body(cls, body)
    with pytest.raises(JsonContractError, match="max_tokens"):
        GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert "/get_weight_version" not in sgl.routes()  # removed in 0.5.21


# -- the CPU engine's routes and fields against the release's HTTP server ---------------------
def test_cpu_engine_serves_only_routes_of_the_release():
    """Every route of the engine's app exists in the release's ``http_server`` and allows the
    method the engine serves it with."""
    from rl.rollout.engines.hf_server import build_app

    app = build_app(SimpleNamespace(tokenizer=None), None, "model")
    served: dict[str, set[str]] = {}
    for route in app.router.routes():
        served.setdefault(route.resource.canonical, set()).add(route.method)
    assert "/generate" in served and "/update_weights_from_distributed" in served
    release = sgl.routes()
    for path, methods in sorted(served.items()):
        assert path in release, f"the CPU engine serves {path}, SGLang {SGLANG_VERSION} has no such route"
        assert methods - {"HEAD"} <= set(release[path].methods), (
            f"{path}: the CPU engine allows {sorted(methods - {'HEAD'})}, "
            f"SGLang {sorted(release[path].methods)}")


def test_cpu_engine_serves_only_generate_fields_of_the_release():
    import msgspec
    from sglang.api.v1.api_types import GenerateRequest, SamplingParams

    from rl.rollout.engines import protocol, sampling

    for ours, theirs in ((protocol.FIELDS, GenerateRequest), (sampling.SERVED, SamplingParams)):
        release = {f.name for f in msgspec.structs.fields(theirs)}
        assert set(ours) <= release, f"not in SGLang {SGLANG_VERSION}: {sorted(set(ours) - release)}"


# JSON values of every kind, for the sweep below.
_VALUES = [None, True, False, 0, 1, -1, 1.5, "", "s", [], [1], ["a"], [None], [[1]], [[1], [2]],
           {}, {"a": 1}]


def test_what_the_cpu_engine_accepts_the_release_accepts():
    """For every served field of ``GenerateRequest`` and of its ``SamplingParams``, and JSON
    values of every kind: a body the engine's parser accepts passes the release's contract
    gate (``api_contract.generate_contract_error``). The converse is not claimed: the engine
    refuses what it does not serve."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    from rl.rollout.engines.protocol import FIELDS, parse_generate
    from rl.rollout.engines.sampling import SERVED, RequestError

    tokenizer = SimpleNamespace(encode=lambda text: [1] * len(text))
    bodies = [{"input_ids": [1], name: v} for name in FIELDS for v in _VALUES]
    bodies += [{"text": "ab", name: v} for name in FIELDS for v in _VALUES]
    bodies += [{"input_ids": [1], "sampling_params": {name: v}} for name in SERVED for v in _VALUES]
    accepted = 0
    for body in bodies:
        try:
            parse_generate(body, tokenizer, vocab_size=8, context_len=None)
        except RequestError:
            continue
        accepted += 1
        assert generate_contract_error(body) is None, body
    assert accepted > 50


def test_a_null_max_new_tokens_runs_to_the_context_length():
    """As SGLang's scheduler (1 << 30, capped at the room the context leaves); left out, the
    default of 128."""
    from rl.rollout.engines.protocol import parse_generate

    tokenizer = SimpleNamespace(encode=lambda text: [1] * len(text))
    null = parse_generate({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": None}},
                          tokenizer, vocab_size=8, context_len=1000)
    default = parse_generate({"input_ids": [1] * 10}, tokenizer, vocab_size=8, context_len=1000)
    assert [r.max_new_tokens for r in null.reqs + default.reqs] == [989, 128]
    longer = parse_generate({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": None,
                                                                       "min_new_tokens": 200}},
                            tokenizer, vocab_size=8, context_len=1000)  # no 128 bound on it
    assert [(r.min_new_tokens, r.max_new_tokens) for r in longer.reqs] == [(200, 989)]


# -- the names a push sends, against the release's Qwen2 loader ----------------------------------
# Names beside the tiny model's own: wrapped, already stacked (SGLang's mapping rewrites
# `qkv_proj` into `qkqkv_proj`), skipped silently (a bias SGLang's layer lacks, rotary caches,
# layers the engine does not hold, vision towers) and plain wrong.
ODD_NAMES = ["_orig_mod.model.norm.weight", "module.model.norm.weight",
             "model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight",
             "model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight",
             "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
             "model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.rotary_emb.inv_freq",
             "model.layers.2.mlp.down_proj.weight", "model.vision_tower.blocks.0.weight",
             "model.layers.0.attn.q.weight", "model.final_norm.weight", "lm_head.bias"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_names_check_follows_the_release_qwen2_loader(tiny_path, tied):
    """SGLang's own ``Qwen2ForCausalLM._legacy_load_weights`` (run from the wheel's source on
    a model with the parameters its ``__init__`` builds) loads exactly the names
    ``load_target`` places, where it places them; the tiny model's names fill every
    parameter; and ``check_push_names`` refuses a push with any name it drops."""
    from rl.model import load_model
    from rl.rollout.weight_names import PushedModel, check_push_names, load_target, qwen2_params

    layers = 2
    ours = qwen2_params(layers, tied)
    release = sgl.model_param_names(sgl.QWEN2, "Qwen2ForCausalLM", layers, tied)
    assert sorted(release) == sorted(ours), "SGLang's Qwen2 parameters changed: update weight_names"
    pushed = [n for n, _ in load_model(tiny_path).named_parameters()]
    loaded, warned = sgl.Qwen2Loader(release, layers, tied).load(pushed + ODD_NAMES)
    for name in pushed + ODD_NAMES:
        assert load_target(name, ours, layers) == loaded.get(name), name
    filled = {loaded[n] for n in pushed if n in loaded}
    assert filled == {(p, s) for p, shards in ours.items() for s in shards}  # every shard, by SGLang
    assert any("qkqkv_proj" in w for w in warned) and not any("rotary" in w for w in warned)

    def check(names: list[str]) -> str:
        return check_push_names(PushedModel(names, layers, tied), ["Qwen2ForCausalLM"], "engine-0")

    assert "fill every parameter" in check(pushed)  # tied: lm_head.weight is the embedding's tensor
    for odd in ODD_NAMES:
        if odd not in loaded:
            with pytest.raises(ValueError, match="engine-0"):
                check(pushed + [odd])
