"""The client on releases older than the pin, told apart by the server's answers alone.

The server here answers as SGLang 0.5.8-0.5.20 does (per docs/sglang.md's table, read from
those releases' sources): no ``/begin_weight_update`` or ``/end_weight_update`` (404),
``/model_info`` with ``weight_version``, ``/get_weight_version`` 404, and ``/flush_cache``
refused (400) while requests wait. One before 0.5.6 lacks ``/model_info`` too.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from rl.rollout.client import EngineClient
from rl.driver.weight_checks import ContentCheck
from tests.support.http_app import ThreadedApp


class OldServer:
    def __init__(self, *, has_model_info: bool = True, flush_refusals: int = 0,
                 server_info: dict | None = None) -> None:
        from aiohttp import web

        self.seen: list[str] = []
        self.refusals_left = flush_refusals

        async def model_info(request):
            self.seen.append(request.path)
            return web.json_response({"model_path": "m", "weight_version": "7"})

        async def flush(request):
            self.seen.append(request.path)
            if self.refusals_left != 0:
                self.refusals_left -= 1
                return web.Response(status=400, text="Flush cache failed.\n")
            return web.Response(text="Cache flushed.\n")

        async def other(request):  # every route the release lacks
            self.seen.append(request.path)
            return web.Response(status=404, text='{"detail":"Not Found"}')

        async def info(request):
            self.seen.append(request.path)
            return web.json_response(server_info)

        app = web.Application()
        if server_info is not None:
            app.router.add_get("/server_info", info)
        if has_model_info:
            app.router.add_get("/model_info", model_info)
        app.router.add_get("/get_model_info", model_info)
        app.router.add_route("*", "/flush_cache", flush)
        app.router.add_route("*", "/{tail:.*}", other)
        self.server = ThreadedApp(app)
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def old_server(request):
    server = OldServer(**getattr(request, "param", {}))
    yield server
    server.close()


@pytest.mark.parametrize("old_server", [{"flush_refusals": 2}], indirect=True)
def test_a_release_without_sessions_is_driven_without_them(old_server):
    c = EngineClient(old_server.url, "engine-0", timeout_s=30)
    c.begin_weight_update()  # 404: an older release, learned once
    c.begin_weight_update()
    c.end_weight_update()  # no /end_weight_update, then the flush, retried past two 400s
    assert old_server.seen.count("/begin_weight_update") == 1
    assert "/end_weight_update" not in old_server.seen
    assert old_server.seen.count("/flush_cache") == 3
    assert c.get_weight_version() == "7" and "/get_weight_version" not in old_server.seen


@pytest.mark.parametrize("old_server", [{"flush_refusals": -1}], indirect=True)
def test_a_flush_refused_for_good_is_reported_not_fatal(old_server, caplog):
    c = EngineClient(old_server.url, "engine-0", timeout_s=1)
    c.begin_weight_update()
    with caplog.at_level(logging.WARNING, logger="rl.rollout.client"):
        c.end_weight_update()
    assert old_server.seen.count("/flush_cache") >= 3  # retried for about a second
    assert "/flush_cache still refused" in caplog.text
    in_place = EngineClient(old_server.url, "engine-0", timeout_s=1, flush_after_update=False)
    before = old_server.seen.count("/flush_cache")
    in_place.end_weight_update()
    assert old_server.seen.count("/flush_cache") == before  # paused in place: no flush at all


@pytest.mark.parametrize("old_server", [{"has_model_info": False}], indirect=True)
def test_the_version_comes_from_the_deprecated_alias_when_model_info_is_missing(old_server):
    c = EngineClient(old_server.url, "engine-0", timeout_s=30)
    assert c.get_weight_version() == "7"
    assert c.get_weight_version() == "7"
    assert old_server.seen == ["/model_info", "/get_model_info", "/get_model_info"]


@pytest.mark.parametrize("old_server,num_ranks,problem", [
    ({"server_info": {"tp_size": 2, "pp_size": 1, "dp_size": 1}}, 2, None),
    ({"server_info": {"tp_size": 2, "pp_size": 1, "dp_size": 1}}, 1, "tp_size=2"),
    ({"server_info": {"tp_size": 1, "pp_size": 2, "dp_size": 1}}, 1, "pp_size=2"),
    ({"server_info": {"tp_size": 1, "pp_size": 1, "dp_size": 2}}, 1, "dp_size=2"),
    ({}, 1, None),  # no /server_info: nothing to check
], indirect=["old_server"])
def test_engine_layout_must_match_the_ranks_the_sender_plans(old_server, num_ranks, problem):
    c = EngineClient(old_server.url, "engine-0", num_ranks=num_ranks, timeout_s=30)
    if problem is None:
        c.check_update_ranks()
    else:
        with pytest.raises(RuntimeError, match=problem):
            c.check_update_ranks()


def test_a_server_without_the_weight_read_back_is_named_in_a_warning_not_failed(old_server, caplog):
    """The content check after a push (``rl.driver.weight_checks``) on a server that answers
    ``/get_weights_by_name`` with 404: the engine is checked by version only, and said so."""
    c = EngineClient(old_server.url, "engine-0", timeout_s=30)
    learners = SimpleNamespace(run=lambda fn, *a, **kw: {"model.norm.weight": np.zeros(4, np.float32)})
    check = ContentCheck({"model.norm.weight": [4]}, "float32")
    with caplog.at_level(logging.WARNING, logger="rl.driver.weight_checks"):
        check.after_push(learners, [c], version=1)
        check.after_push(learners, [c], version=2)
    assert old_server.seen.count("/get_weights_by_name") == 1
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "engine-0" in caplog.records[0].getMessage() and "HTTP 404" in caplog.records[0].getMessage()
