"""The CPU engine and the push checks held to the pinned SGLang release's own code
(``tests/support/sglang_release.py``), in this process:

- the installed SGLang is the pinned release, and its request types refuse what they must;
- the CPU engine serves only routes of the release's HTTP server, with their methods, knows
  every field of its ``GenerateRequest``, and its schema check refuses exactly what the
  release's contract gate refuses;
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


# -- the CPU engine's routes, fields and error bodies against the release's HTTP server --------
# Routes the CPU engine serves that SGLang does not (none): each would be named here, and in
# docs/sglang.md.
ENGINE_ONLY_ROUTES: set[str] = set()


def test_cpu_engine_serves_only_routes_of_the_release():
    """Every route of the engine's app exists in the release's ``http_server`` with the same
    methods (HEAD, which both servers add to every GET route, aside)."""
    from rl.rollout.engines.hf_server import build_app

    app = build_app(SimpleNamespace(tokenizer=None), None, "model")
    served: dict[str, set[str]] = {}
    for route in app.router.routes():
        served.setdefault(route.resource.canonical, set()).add(route.method)
    assert "/generate" in served and "/update_weights_from_distributed" in served
    release = sgl.routes()
    for path, methods in sorted(served.items()):
        if path in ENGINE_ONLY_ROUTES:
            continue
        assert path in release, f"the CPU engine serves {path}, SGLang {SGLANG_VERSION} has no such route"
        assert methods - {"HEAD"} == set(release[path].methods), (
            f"{path}: the CPU engine allows {sorted(methods - {'HEAD'})}, "
            f"SGLang {sorted(release[path].methods)}")


def test_cpu_engine_knows_every_generate_field_of_the_release():
    """The engine's ``/generate`` parser has a JSON type for exactly the release's
    ``GenerateRequest`` fields (a field added by a later pin fails here), and reads, refuses
    or ignores each of them."""
    import msgspec
    from sglang.api.v1.api_types import GenerateRequest

    from rl.rollout.engines import protocol

    release = {f.name for f in msgspec.structs.fields(GenerateRequest)}
    known = set(protocol.FIELDS)
    assert known == release, (f"only in SGLang {SGLANG_VERSION}: {sorted(release - known)}; "
                              f"only in the CPU engine: {sorted(known - release)}")
    handled = [*protocol._READ, *protocol._REFUSED, *protocol._IGNORED]
    assert sorted(handled) == sorted(release), "each field is read, refused or ignored, once"


# JSON values of every kind, for the schema sweep below.
_VALUES = [None, True, 1, -1, 1.5, "s", [], [1], ["a"], [None], [[1]], [True], [None, "a"],
           [1, None], [["a"]], {}, {"a": 1}, {"a": "b"}, {"url": "x"}, [{"url": "x"}]]

_MEDIA = {"image_data", "video_data", "audio_data"}  # MediaRef's own fields: not checked


def test_cpu_engine_schema_check_agrees_with_the_release_gate():
    """For every field of ``GenerateRequest`` and of its ``SamplingParams``, and JSON values
    of every kind, the engine's schema check refuses exactly what SGLang's contract gate
    (``api_contract.generate_contract_error``) refuses."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    from rl.rollout.engines.protocol import FIELDS, ContractError, check_schema
    from rl.rollout.engines.sampling import SAMPLING_FIELDS

    bodies = [{"input_ids": [1], name: v} for name in FIELDS if name != "sampling_params"
              for v in _VALUES if not (name in _MEDIA and "{" in repr(v))]
    bodies += [{"input_ids": [1], "sampling_params": {name: v}} for name in SAMPLING_FIELDS
               for v in _VALUES]
    bodies += [{"input_ids": [1], "sampling_params": v} for v in _VALUES]
    disagree = []
    for body in bodies:
        try:
            check_schema(body)
            ours = None
        except ContractError as e:
            ours = str(e)
        theirs = generate_contract_error(body)
        if (ours is None) != (theirs is None):
            disagree.append((body, theirs, ours))
    assert not disagree, disagree[:5]


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
