"""The names check before the first push and the content check after the first pushes
(``rl.driver.weight_checks``), the learners' side on an in-process model and the engines' side on a
real CPU engine over HTTP (or a server that answers as SGLang does for a Qwen2 model).
``tests/integration/test_sglang_contract.py`` holds the route to the release's own."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rl.config import HFRolloutConfig
from rl.rollout.client import EngineClient
from rl.rollout.engines.launcher import EngineProcess
from rl.driver.weight_checks import CONTENT_CHECKS, ContentCheck, CoverageCheck, check_names, pushed_model
from tests.support.http_app import ThreadedApp
from transfer.weights.broadcast import BroadcastSync

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


def test_check_names_asks_each_engine_its_architecture(tiny, engine):
    check = check_names(Learners(tiny), [engine], "float32")
    assert isinstance(check, ContentCheck) and engine.model_info()["architectures"] == QWEN2
    wrapped = torch.nn.Module()
    wrapped._orig_mod = tiny  # what torch.compile's wrapper holds
    wrapped.config = tiny.config
    with pytest.raises(ValueError, match=r"(?s)engine-0 \(http.*27 name\(s\) carry '_orig_mod.', inserted "
                                         r"by torch.compile \(first: '_orig_mod.model.embed_tokens.weight'"):
        check_names(Learners(wrapped), [engine], "float32")


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
    with caplog.at_level(logging.WARNING, logger="rl.driver.weight_checks"):
        check.after_push(Learners(tiny), [sglang, engine], version=0)
        check.after_push(Learners(tiny), [sglang, engine], version=1)
    assert [r["name"] for r in seen] == [seen[0]["name"], "model.embed_tokens.weight"]  # then left alone
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and sglang.name in warnings[0] and "not checked" in warnings[0]


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


def test_the_first_push_must_write_every_engine_tensor(tiny, engine, caplog):
    """``CoverageCheck``: a push of every parameter passes (and is done twice); a push that
    leaves one out is an error naming the engine and the tensor, and saying what to do."""
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20, backend="gloo",
                         timeout_s=60)
    sync.connect([engine])
    pushes = []

    def push(leave_out=()):
        pushes.append(1)
        sync.push(((n, p) for n, p in tiny.named_parameters() if n not in leave_out), len(pushes))
        return {"pushed": len(pushes)}

    try:
        with caplog.at_level(logging.INFO, logger="rl.driver.weight_checks"):
            assert CoverageCheck().run(push, lambda: [engine]) == {"pushed": 2}
        assert any("writes every tensor of 1 engine(s) (27 tensors" in r.getMessage() for r in caplog.records)
        with pytest.raises(RuntimeError) as e:
            CoverageCheck().run(lambda: push(leave_out={"model.norm.weight"}), lambda: [engine])
        assert "engine-0 (http" in str(e.value) and "(rank 0): 1 of 27 tensors" in str(e.value)
        assert "['model.norm.weight']" in str(e.value) and "restart the engines" in str(e.value)
        push()  # the engine holds the model again
    finally:
        sync.close()


@pytest.fixture
def old_sglang():
    """Servers answering ``/weights_checker`` as a release without the route (404) and as
    one without the ``checksum`` action (400 "Unsupported action"); the actions asked."""
    from aiohttp import web

    asked = []

    async def no_checksum(request):
        action = (await request.json())["action"]
        asked.append(action)
        if action == "checksum":
            return web.json_response({"success": False, "message": f"Unsupported {action=}"}, status=400)
        return web.json_response({"success": True, "message": "Success."})

    app = web.Application()
    app.router.add_post("/weights_checker", no_checksum)
    without_action, without_route = ThreadedApp(app), ThreadedApp(web.Application())
    yield (EngineClient(without_action.url, "engine-6", timeout_s=10),
           EngineClient(without_route.url, "engine-7", timeout_s=10), asked)
    without_action.close()
    without_route.close()


def test_an_engine_that_cannot_answer_checksums_is_not_reset_and_is_named(old_sglang, caplog):
    """The read-only checksum comes first: an engine that cannot answer it keeps its weights
    (no reset) and is named in a warning; the push still runs."""
    without_action, without_route, asked = old_sglang
    with caplog.at_level(logging.WARNING, logger="rl.driver.weight_checks"):
        assert CoverageCheck().run(lambda: {"pushed": 1}, lambda: [without_action, without_route]) == \
            {"pushed": 1}
    assert asked == ["checksum"]  # never reset
    assert [r.getMessage() for r in caplog.records] == [
        f"{c.name} cannot answer /weights_checker checksums: which of its parameters a push writes "
        "is not checked" for c in (without_action, without_route)]


def test_an_engine_replaced_during_the_check_leaves_it(tiny, engine, caplog):
    """Rollout fault tolerance may replace an engine inside the push: one whose URL changed
    leaves the check (its replacement loaded the checkpoint) instead of failing the run."""
    replaced = EngineClient("http://127.0.0.1:9", engine.name, timeout_s=10)
    calls = []

    def push():
        calls.append(1)
        return {}

    with caplog.at_level(logging.INFO, logger="rl.driver.weight_checks"):
        CoverageCheck().run(push, lambda: [engine] if not calls else [replaced])
    assert len(calls) == 2 and any("writes every tensor of 0 engine(s)" in r.getMessage()
                                   for r in caplog.records)
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20, backend="gloo",
                         timeout_s=60)
    sync.connect([engine])
    try:
        sync.push(tiny.named_parameters(), 1)  # the reset left the engine random: restore it
    finally:
        sync.close()
