"""The GPU path held to the pinned SGLang release's own code (``tests/support/sglang_release.py``),
on running CPU engines and spawned ranks:

- the senders' side groups meet SGLang's ``init_custom_process_group`` and its receive
  loop, for both weight paths, several engines and engines of two ranks;
- every request the client sends goes to a route the release's HTTP server has, with the
  method it allows, and its body validates against that route's request type;
- SGLang's own frontend (``sglang.lang``, the release's ``RuntimeEndpoint``) runs a program
  against a CPU engine over HTTP, with requests the release accepts;
- the CPU engine serves the release's sampling fields it claims to, refuses the others by
  name in its one 400, and answers in the release's response schema;
- the CPU engine's ``/get_weights_by_name`` (read by the content check after a push) answers
  what the release's route answers.

The rules checked in-process (routes, fields, the names check): tests/unit/test_sglang_contract.py."""

from __future__ import annotations

import ast
import asyncio
import copy
import hashlib
import json
import typing
from http import HTTPStatus
from types import SimpleNamespace

import msgspec
import pytest
import requests
import torch

from rl.config import HFRolloutConfig
from rl.rollout.client import EngineClient
from rl.rollout.engines.hf_engine import UNCHECKED_BUFFERS
from rl.rollout.engines.launcher import EngineProcess
from rl.rollout.sglang_version import SGLANG_VERSION
from tests.support import sglang_release as sgl
from tests.support.http_app import ThreadedApp
from tests.support.sglang_engine_ranks import SGLangRanks
from transfer.weights.broadcast import BroadcastSync
from transfer.weights.p2p import P2PSync


# -- weight-update groups ------------------------------------------------------------------
def _params(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [("model.embed_tokens.weight", torch.randn(17, 8, generator=g).to(torch.bfloat16)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g)),
            ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g)),
            ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(17, 8, generator=g))]


@pytest.mark.parametrize("path", ["broadcast", "p2p"])
def test_senders_meet_sglangs_own_engine_side(path):
    """SGLang's receiver code joins our sender's group and gets every tensor bit for bit,
    in order; engine ranks are rank_offset + tp_rank."""
    engines = [SGLangRanks("engine-0"), SGLangRanks("engine-1", num_ranks=2), SGLangRanks("engine-2")]
    kw = dict(master_address="127.0.0.1", bucket_bytes=1024, backend="gloo", timeout_s=60)
    if path == "broadcast":
        senders = [BroadcastSync(rank=0, **kw), BroadcastSync(rank=1, **kw)]
    else:
        senders = [P2PSync(rank=r, world_size=2, **kw) for r in range(2)]
    try:
        for s in senders:  # each sender hosts its own group; engines join over their API
            s.connect(engines)
        if path == "p2p":  # the two-rank engine has a sender to itself
            assert senders[0].plan == [[1], [0, 2]]
            assert [e.name for e in senders[1].receivers] == ["engine-0", "engine-2"]
        for version in (1, 2):
            for s in senders:
                s.push(_params(version), version)
        sent = _params(1) + _params(2)
        for e in engines:
            assert e.calls[0] == "init" and e.calls[1] == "begin" and e.calls[-1] == "end"
            assert e.calls.count("begin") == e.calls.count("end") == 2
            assert e.get_weight_version() == "2"
            for rank_got in e.received():  # every rank of every engine
                assert [n for n, _ in rank_got] == [n for n, _ in sent]
                for (_, want), (_, got) in zip(sent, rank_got):
                    assert got.dtype == want.dtype and torch.equal(got, want)
    finally:
        for s in senders:
            s.close()
        for e in engines:
            e.close()


# -- the client's requests against the release's routes and request types ---------------------
class RecordingProxy:
    """Forwards every request to an engine and records (method, path, JSON body)."""

    def __init__(self, target: str) -> None:
        from aiohttp import ClientSession, web

        self.target, self.seen = target, []

        async def forward(request: web.Request) -> web.Response:
            raw = await request.read()
            self.seen.append((request.method, request.path, json.loads(raw) if raw else None))
            async with ClientSession() as s, s.request(request.method, self.target + request.path_qs,
                                                       data=raw, headers=request.headers) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type)

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", forward)
        self.server = ThreadedApp(app)
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def engine(tiny_path, tmp_path_factory):
    proc = EngineProcess(0, HFRolloutConfig(engine_start_timeout_s=120), tiny_path, seed=0,
                         log_dir=str(tmp_path_factory.mktemp("logs")), host="127.0.0.1")
    url = proc.start()
    yield url
    proc.stop()


def _generate(url: str, prompt_ids: list[list[int]], n: int, sampling: dict) -> list[list[dict]]:
    from rl.rollout.fanout import EnginePool, generate_groups
    from rl.rollout.fleet import EngineSet

    return asyncio.run(generate_groups(EnginePool(EngineSet([EngineClient(url, "engine-0")])), prompt_ids, n,
                                       sampling, timeout_s=60))


def test_every_request_the_client_sends_fits_the_release(engine, tiny_path):
    from rl.model import load_model

    proxy = RecordingProxy(engine)
    try:
        client = EngineClient(proxy.url, "engine-0", timeout_s=60)
        assert client.health()
        assert client.health_generate(timeout_s=60) is None  # the fault-tolerance probe
        # generation as the manager sends it, with the rollout config's sampling fields
        rc = HFRolloutConfig(top_p=0.9, top_k=5)
        groups = _generate(proxy.url, [[5, 6, 7], [8, 9]], 3, rc.sampling_params())
        assert [len(g) for g in groups] == [3, 3]
        assert [a["meta_info"]["prompt_tokens"] for g in groups for a in g] == [3] * 3 + [2] * 3
        sent = [b for _, p, b in proxy.seen if p == "/generate"]  # one request per prompt
        assert [(b["input_ids"], b["sampling_params"]["n"]) for b in sent] in \
            ([([5, 6, 7], 3), ([8, 9], 3)], [([8, 9], 3), ([5, 6, 7], 3)])
        # a fully async pause and resume, then a whole weight sync over both paths' calls
        client.pause_generation("retract")
        client.continue_generation()
        sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 14,
                             backend="gloo", timeout_s=60)
        sync.connect([client])
        model = load_model(tiny_path)
        # the coverage check's calls around the first push (rl.driver.weight_checks): the push
        # writes back every tensor the reset made random
        assert client.check_weights("reset_tensors") == {}
        sync.push(model.named_parameters(), 3)
        assert client.get_weight_version() == "3"
        sync.close()
        hashes = client.check_weights("checksum")
        assert list(hashes) == [0] and "model.norm.weight" in hashes[0]
        # the content check after a push (rl.driver.weight_checks) reads a few rows back
        assert client.get_weights_by_name("model.norm.weight") == \
            model.get_parameter("model.norm.weight").tolist()
    finally:
        proxy.close()

    called = {p for _, p, _ in proxy.seen}
    for path in ("/generate", "/health_generate", "/model_info", "/begin_weight_update",
                 "/update_weights_from_distributed", "/end_weight_update", "/flush_cache",
                 "/init_weights_update_group", "/destroy_weights_update_group", "/pause_generation",
                 "/continue_generation", "/get_weights_by_name", "/weights_checker"):
        assert path in called, f"the client never called {path}"
    _check_fits_release(proxy.seen)


def _check_fits_release(seen: list[tuple[str, str, dict | None]]) -> None:
    """Each recorded request goes to a route of the release, with a method it allows, and
    its body validates against the route's request type."""
    from sglang.api.v1.api_types import GenerateRequest

    routes, classes = sgl.routes(), sgl.request_classes()
    for method, path, body in seen:
        route = routes.get(path)
        assert route is not None, f"SGLang {SGLANG_VERSION} has no route {path}"
        assert method in route.methods, f"{method} {path}: SGLang allows {sorted(route.methods)}"
        if path == "/generate":  # the server's contract gate, then its dataclass parse
            GenerateRequest.from_json_value(body)
        elif route.body_type is not None:
            sgl.validate_body(classes[route.body_type], body if body is not None else {})
        else:
            assert not body, f"{path} takes no body, the client sent {body}"


def test_sglangs_frontend_runs_against_the_cpu_engine(engine):
    """The release's own frontend language client (``sglang.lang``, imported from the wheel:
    it needs no GPU) runs a program on the CPU engine: it reads ``/get_model_info``,
    generates through ``/generate`` with its own sampling fields (greedy: the same text as
    a direct request), flushes the cache and reads the server info, every request one the
    release accepts; a feature the engine does not serve (constrained decoding) reaches the
    program as the engine's 400, naming the field."""
    import sglang as sgl_frontend
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    proxy = RecordingProxy(engine)
    try:
        backend = RuntimeEndpoint(proxy.url)
        assert backend.get_model_name() == backend.model_info["model_path"]

        @sgl_frontend.function
        def answer(s, question):
            s += question + sgl_frontend.gen("reply", max_tokens=6, temperature=0, ignore_eos=True)

        state = answer.run(question="ab:", backend=backend)
        direct = requests.post(engine + "/generate", json={
            "text": "ab:", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                               "ignore_eos": True}}, timeout=60).json()
        assert state["reply"] == direct["text"] and state.text() == "ab:" + direct["text"]
        assert state.get_meta_info("reply")["completion_tokens"] == 6
        backend.flush_cache()
        assert backend.get_server_info()["internal_states"][0]["running_requests"] == 0

        @sgl_frontend.function
        def constrained(s):
            s += "n:" + sgl_frontend.gen("n", max_tokens=4, regex="[0-9]+")

        with pytest.warns(UserWarning, match="Error in stream_executor"):  # how it reports one
            error = constrained.run(backend=backend).error()
        assert isinstance(error, RuntimeError) and "does not serve sampling_params.regex" in str(error)
    finally:
        proxy.close()
    called = {p for _, p, _ in proxy.seen}
    assert {"/get_model_info", "/generate", "/flush_cache", "/server_info"} <= called
    _check_fits_release(proxy.seen)


# -- the CPU engine against the release's /generate schema ------------------------------------
# A valid, non-default value for every field of the release's SamplingParams that the engine serves.
SERVED_VALUES = {
    "max_new_tokens": 3, "stop": ["zz"], "stop_token_ids": [7], "temperature": 0.5, "top_p": 0.9,
    "top_k": 5, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "min_new_tokens": 1, "n": 2, "ignore_eos": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
}
# ... and of those it does not: refused by name.
UNSERVED_VALUES = {
    "stop_regex": "z+", "json_schema": '{"type": "string"}', "regex": "a+", "ebnf": 'root ::= "a"',
    "structural_tag": "{}", "repetition_penalty": 1.2, "no_stop_trim": True, "stream_interval": 2,
    "logit_bias": {"5": 1.5}, "sampling_seed": 3, "custom_params": {"x": 1}, "beam_width": 2,
    "watermark": {"enabled": True}, "choice": ["a", "b"],
}


def test_cpu_engine_takes_the_sampling_fields_it_serves_and_refuses_the_others(engine):
    import msgspec
    from sglang.api.v1.api_types import GenerateRequest, GenerateResponse, SamplingParams

    fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert fields == set(SERVED_VALUES) | set(UNSERVED_VALUES), "the pinned release changed SamplingParams"
    for name, value in {**SERVED_VALUES, **UNSERVED_VALUES}.items():
        body = {"input_ids": [5, 6, 7], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, name: value}}
        GenerateRequest.from_json_value(body)  # the release takes it
        r = requests.post(engine + "/generate", json=body, timeout=60)
        if name in UNSERVED_VALUES:
            assert r.status_code == 400, (name, r.text)
            assert f"does not serve sampling_params.{name};" in r.json()["error"]["message"], r.text
            continue
        assert r.status_code == 200, (name, r.text)
        answers = r.json() if isinstance(r.json(), list) else [r.json()]
        assert len(answers) == (2 if name == "n" else 1), name
        for a in answers:
            GenerateResponse.from_json_value(a)
    assert requests.get(engine + "/health_generate", timeout=60).status_code == 200


def test_cpu_engine_answers_in_the_release_schema(engine):
    from sglang.api.v1.api_types import GenerateResponse

    bodies = [{"input_ids": [5, 6], "return_logprob": True, "sampling_params": {"max_new_tokens": 4}},
              {"input_ids": [[5, 6], [7]], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 2, "n": 2}},
              {"text": "ab:", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}]
    for body in bodies:
        r = requests.post(engine + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answers = r.json() if isinstance(r.json(), list) else [r.json()]
        for a in answers:
            resp = GenerateResponse.from_json_value(a)
            meta = resp.meta_info
            assert resp.output_ids and meta.completion_tokens == len(resp.output_ids)
            assert meta.finish_reason is not None and meta.weight_version is not None
            # one span: the answer's tokens all come from the version it names
            assert [(w.version, w.start, w.end) for w in meta.weight_versions] == \
                [(meta.weight_version, 0, len(resp.output_ids))]
            if body.get("return_logprob"):
                assert [e.token_id for e in meta.output_token_logprobs] == list(resp.output_ids)
                assert all(e.logprob is not None and e.logprob <= 0 for e in meta.output_token_logprobs)
    assert len(requests.post(engine + "/generate", json=bodies[1], timeout=60).json()) == 4


class _Response:
    """Stands in for Starlette's responses: keeps the content and the status."""

    def __init__(self, content=None, status_code: int = 200, **_) -> None:
        self.content, self.status_code = content, int(status_code)


def _from_source(module: str, name: str, ns: dict, decorated: str | None = None):
    """The top-level function (or class) ``name`` of a wheel module, executed from its
    source in ``ns`` without decorators; ``decorated`` picks one of several by a decorator's
    text. A function's annotations are left unevaluated (they name FastAPI's types)."""
    import __future__

    nodes = [n for n in sgl._tree(module).body if getattr(n, "name", None) == name
             and (decorated is None or any(decorated in ast.unparse(d) for d in n.decorator_list))]
    assert len(nodes) == 1, f"{module}.{name}: {len(nodes)} definitions"
    node = copy.deepcopy(nodes[0])
    node.decorator_list = []
    flags = 0 if isinstance(node, ast.ClassDef) else __future__.annotations.compiler_flag
    exec(compile(ast.Module(body=[node], type_ignores=[]), sgl.source_path(module), "exec",
                 flags=flags, dont_inherit=True), ns)
    return ns[name]


class WeightsByName:
    """SGLang's answer to ``/get_weights_by_name``, from the wheel's source end to end but for
    the hops between processes (scheduler, TP worker: they pass ``name`` and
    ``truncate_size`` on): the route (``http_server``), the tokenizer manager's method
    (``tokenizer_control_mixin``), the model runner's ``WeightExporter`` and the model's own
    ``get_weights_by_name``, run on a stand-in ``model``."""

    EXPORTER = "sglang.srt.model_executor.model_runner_components.weight_exporter"
    MIXIN = "sglang.srt.managers.tokenizer_control_mixin"

    def __init__(self, model) -> None:
        import logging

        log = logging.getLogger("sglang.get_weights_by_name")
        ns = {"logger": log, "__name__": "sglang_weights_by_name",
              "get_parallel": lambda: SimpleNamespace(num_dp_ranks=1)}
        exporter = SimpleNamespace(get_model=lambda: model, tp_size=1)
        reason = sgl.method(self.EXPORTER, "WeightExporter", "_weight_export_unsupported_reason", ns)
        exporter._weight_export_unsupported_reason = lambda: reason(exporter)
        export = sgl.method(self.EXPORTER, "WeightExporter", "get_weights_by_name", ns)

        async def communicator(obj):  # scheduler -> TP worker -> model runner's exporter
            return [SimpleNamespace(parameter=export(exporter, obj.name, obj.truncate_size))]

        manager = SimpleNamespace(auto_create_handle_loop=lambda: None,
                                  get_weights_by_name_communicator=communicator)
        read = sgl.method(self.MIXIN, "TokenizerControlMixin", "get_weights_by_name", ns)
        manager.get_weights_by_name = lambda obj, request: read(manager, obj, request)
        http = {"ORJSONResponse": _Response, "HTTPStatus": HTTPStatus, "__name__": "sglang_http_subset",
                "_global_state": SimpleNamespace(tokenizer_manager=manager)}
        _from_source(sgl.HTTP_SERVER, "_create_error_response", http)
        self._route = _from_source(sgl.HTTP_SERVER, "get_weights_by_name", http)

    def answer(self, body: dict) -> _Response:
        obj = sgl.validate_body(sgl.request_classes()["GetWeightsByNameReqInput"], body)
        return asyncio.run(self._route(obj, None))


def _as_sglang_llama(model) -> SimpleNamespace:
    """A Hugging Face Qwen2/Llama model's weights as SGLang's ``LlamaForCausalLM`` holds them on
    one rank: ``q/k/v_proj`` stacked into ``qkv_proj``, ``gate/up_proj`` into
    ``gate_up_proj`` (rows in that order), with its ``get_weights_by_name`` from the wheel."""
    import functools

    mapping = ast.literal_eval(sgl.init_assignments("sglang.srt.models.llama", "LlamaForCausalLM")[0]
                               ["stacked_params_mapping"][0])
    hf = dict(model.named_parameters())
    params = {}
    for name, t in hf.items():
        stacked = [(p, w) for p, w, _ in mapping if w in name]
        if not stacked:
            params[name] = t.detach()
        elif stacked[0][1] in (".q_proj", ".gate_proj"):  # the first shard builds the stack
            shards = [w for p, w, _ in mapping if p == stacked[0][0]]
            params[name.replace(stacked[0][1], stacked[0][0])] = torch.cat(
                [hf[name.replace(stacked[0][1], w)].detach() for w in shards])
    standin = SimpleNamespace(config=model.config, stacked_params_mapping=mapping, modules=lambda: [],
                              named_parameters=lambda: iter(params.items()),
                              model=SimpleNamespace(embed_tokens=SimpleNamespace(
                                  weight=hf["model.embed_tokens.weight"])))
    ns = {"torch": torch, "logger": SimpleNamespace(info=lambda *a: None, error=lambda *a: None),
          "get_exception_traceback": lambda: "", "__name__": "sglang_llama"}
    read = sgl.method("sglang.srt.models.llama", "LlamaForCausalLM", "get_weights_by_name", ns)
    standin.get_weights_by_name = functools.partial(read, standin)
    return standin


def test_cpu_engine_serves_weights_by_name_as_the_release(engine, tiny_path):
    """For the same weights, the engine's ``/get_weights_by_name`` answers what SGLang's own
    code answers for a model that serves the route (``LlamaForCausalLM``, whose layout the
    tiny Qwen2 shares): the first ``truncate_size`` rows as float32, stacked parameters
    read by their checkpoint names; and, for a name the model lacks, the same 400. SGLang's
    ``Qwen2ForCausalLM`` defines no ``get_weights_by_name`` and inherits none: on the pinned
    release every name of a Qwen2 model gets that 400."""
    from rl.model import load_model

    model = load_model(tiny_path)
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20, backend="gloo",
                         timeout_s=60)
    sync.connect([EngineClient(engine, "engine-0", timeout_s=60)])
    try:
        sync.push(model.named_parameters(), 11)  # the engine holds exactly `model`
    finally:
        sync.close()
    llama = WeightsByName(_as_sglang_llama(model))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias",
                 "model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
        for body in ({"name": name}, {"name": name, "truncate_size": 3}, {"name": name, "truncate_size": 0}):
            want = llama.answer(body)
            r = requests.post(engine + "/get_weights_by_name", json=body, timeout=60)
            assert want.status_code == r.status_code == 200 and r.json() == want.content, (body, r.text)
    failed = (400, {"error": {"message": "Get parameter by name failed"}})
    r = requests.post(engine + "/get_weights_by_name", json={"name": "model.nope.weight"}, timeout=60)
    want = llama.answer({"name": "model.nope.weight"})
    assert (want.status_code, want.content) == (r.status_code, r.json()) == failed
    assert not sgl.defines(sgl.QWEN2, "Qwen2ForCausalLM", "get_weights_by_name")
    assert sgl.base_names(sgl.QWEN2, "Qwen2ForCausalLM") == ["nn.Module"]
    qwen2 = WeightsByName(SimpleNamespace(modules=lambda: []))  # no get_weights_by_name
    want = qwen2.answer({"name": "model.norm.weight"})
    assert (want.status_code, want.content) == failed


def test_cpu_engine_checks_weights_as_the_release(engine, tiny_path):
    """``/weights_checker`` (the coverage check's route, ``rl.driver.weight_checks``): a checksum
    names the tensors the release's weight checker hashes (its own skip rules), each hashed
    by its CPU ``tensor_hash``, the rank's and the engine's checksums as it folds them, in a
    body its ``ChecksumInfo`` reads; ``reset_tensors`` makes every checked tensor random,
    and a push writes them back; an action the engine does not serve is its 400 shape."""
    from rl.model import load_model

    ns = sgl.module_level("sglang.srt.utils.weight_checker",
                          ["_NON_PERSISTENT_BUFFER_PATTERNS", "_is_non_persistent_buffer_name",
                           "_is_skip_weight_check", "overall_checksum", "_hash_tensor"],
                          {"hashlib": hashlib, "torch": torch, "Dict": dict, "Optional": typing.Optional})
    ns = sgl.module_level("sglang.srt.managers.mm_utils", ["tensor_hash"], ns)
    io = sgl.module_level(sgl.IO_STRUCT, ["ParallelismInfo", "ChecksumInfo"],
                          {"msgspec": msgspec, "Dict": dict, "List": list})
    assert UNCHECKED_BUFFERS == ns["_NON_PERSISTENT_BUFFER_PATTERNS"]
    model = load_model(tiny_path)
    client = EngineClient(engine, "engine-0", timeout_s=60)
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20, backend="gloo",
                         timeout_s=60)
    sync.connect([client])
    try:
        sync.push(model.named_parameters(), 12)  # the engine holds exactly `model`
        for skip in (None, ["mlp", "norm"]):
            body = {"action": "checksum"} | ({} if skip is None else {"skip_tensor_list": skip})
            r = requests.post(engine + "/weights_checker", json=body, timeout=60)
            want = {n: ns["_hash_tensor"](t) for n, t in [*model.named_parameters(), *model.named_buffers()]
                    if not ns["_is_skip_weight_check"](n, t, skip)}
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            [rank] = r.json()["ranks"]
            info = msgspec.convert(rank, io["ChecksumInfo"])
            assert info.checksums == want and len(want) > 10
            assert info.per_gpu_checksum == ns["overall_checksum"](want)
            engine_checksum = hashlib.sha256(info.per_gpu_checksum.encode()).hexdigest()
            assert r.json()["per_engine_checksum"] == engine_checksum
            assert (skip is None) == any("mlp" in n for n in want)
        bare = requests.post(engine + "/weights_checker", timeout=60)  # no body: the defaults
        assert bare.json()["ranks"][0]["checksums"] == client.check_weights("checksum")[0]
        before = client.check_weights("checksum")[0]
        assert client.check_weights("reset_tensors") == {}
        after = client.check_weights("checksum")[0]
        assert after.keys() == before.keys() and all(after[n] != h for n, h in before.items())
        sync.push(model.named_parameters(), 13)
        assert client.check_weights("checksum")[0] == before  # every tensor written back
    finally:
        sync.close()
    r = requests.post(engine + "/weights_checker", json={"action": "snapshot"}, timeout=60)
    assert r.status_code == 400 and r.json()["success"] is False and "snapshot" in r.json()["message"]
