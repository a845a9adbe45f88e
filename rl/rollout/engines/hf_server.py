"""The CPU engine as an HTTP server: SGLang 0.5.23's routes, for what its users send.

    python -m rl.rollout.engines.hf_server --model-path DIR --port 30000

Served, with SGLang's semantics (``srt/entrypoints/http_server.py``), the routes and fields
that ``rl.rollout.client.EngineClient`` and SGLang's own frontend (``sglang.lang``'s
``RuntimeEndpoint``) send: ``POST /generate`` (``protocol``), ``GET /health``,
``/health_generate``, ``/model_info`` (and the alias ``/get_model_info`` the frontend asks),
``/server_info``; ``POST /flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``,
``/end_weight_update``, ``/destroy_weights_update_group``, ``/get_weights_by_name``,
``/weights_checker``. Any other route is a 404 (the client reads a 404 as an older SGLang
without the route), another method a 405.

Bad input of any kind (not JSON, a field of the wrong type, missing or out of range, a
field or query parameter the engine does not serve, a prompt too long) gets one answer:
HTTP 400 with ``{"error": {"message": ...}}`` naming the problem. That is the body SGLang
gives a ``/generate`` it refuses (``_create_error_response``), the one our client and
SGLang's frontend read on every route. A control call the engine cannot carry out (no open
session, an unknown group) answers SGLang's ``{"success": false, "message"}`` with 400; a
flush refused while requests run answers 400 in plain text, as SGLang's. Concurrent
requests are queued and decoded together in batches.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import os
import time
import traceback

import torch
from aiohttp import web

from rl.log import setup_worker_logging
from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.protocol import answer, parse_generate
from rl.rollout.engines.scheduler import PAUSE_MODES, BatchScheduler
from rl.rollout.engines.sampling import (REQUIRED, RequestError, as_bool, as_int, as_str, list_of,
                                         read_fields)

logger = logging.getLogger(__name__)

WEIGHTS_UNSERVED = "Get parameter by name failed"
"""SGLang's message for a ``/get_weights_by_name`` it cannot serve; ``rl.driver.weight_checks``
tells an unserved route by it."""

HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` default: ``/health_generate`` answers 503 after it."""


def _outcome(success: bool, message: str) -> web.Response:
    """The ``{"success", "message"}`` answer of SGLang's control routes."""
    return web.json_response({"success": success, "message": message},
                             status=200 if success else 400)


@web.middleware
async def _errors(request: web.Request, handler):
    """Bad input is the one 400 (see the module's docstring); anything else a 500 with its
    message, and the server keeps serving."""
    try:
        if request.query_string:
            raise RequestError(f"the CPU engine does not serve query parameters "
                               f"({request.query_string})")
        return await handler(request)
    except RequestError as e:
        return web.json_response({"error": {"message": str(e)}}, status=400)
    except web.HTTPException:
        raise
    except Exception as e:
        traceback.print_exc()  # into the engine's log
        return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=500)


async def _json(request: web.Request):
    """The request's JSON body; None when it has none."""
    raw = await request.read()
    try:
        return json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {e}") from None


async def _fields(request: web.Request, spec: dict[str, tuple], optional: bool = False) -> dict:
    """The request's JSON body read against ``spec`` (``sampling.read_fields``). As on SGLang,
    whose control routes declare a required body (FastAPI refuses a request without one),
    a missing body is refused unless the route's is ``optional``."""
    body = await _json(request)
    if body is None and not optional:
        raise RequestError(f"{request.path} needs a JSON body (an object, {{}} for no fields)")
    return read_fields("", body, spec)


_GROUP = (as_str, "weight_update_group")
_INIT = {"master_address": (as_str, REQUIRED), "master_port": (as_int, REQUIRED),
         "rank_offset": (as_int, REQUIRED), "world_size": (as_int, REQUIRED),
         "group_name": _GROUP, "backend": (as_str, "gloo")}  # SGLang defaults to nccl
_UPDATE = {"names": (list_of(as_str), REQUIRED), "dtypes": (list_of(as_str), REQUIRED),
           "shapes": (list_of(list_of(as_int)), REQUIRED), "group_name": _GROUP,
           "weight_version": (as_str, None), "flush_cache": (as_bool, True)}
_CHECK = {"action": (as_str, "checksum"), "skip_tensor_list": (list_of(as_str), None),
          "selector": (as_str, "all")}  # one target model, no draft


class Routes:
    """One handler per route, over one engine and the scheduler that batches its requests."""

    def __init__(self, engine: HFEngine, scheduler: BatchScheduler, model_path: str) -> None:
        self.engine, self.scheduler, self.model_path = engine, scheduler, model_path
        self._probes: set[asyncio.Future] = set()  # /health_generate's, kept until they end

    def table(self) -> list[tuple[str, str, object]]:
        return [("GET", "/health", self.health), ("GET", "/health_generate", self.health_generate),
                ("GET", "/model_info", self.model_info), ("GET", "/get_model_info", self.model_info),
                ("GET", "/server_info", self.server_info), ("POST", "/flush_cache", self.flush_cache),
                ("POST", "/pause_generation", self.pause), ("POST", "/continue_generation", self.resume),
                ("POST", "/init_weights_update_group", self.init_group),
                ("POST", "/begin_weight_update", self.begin),
                ("POST", "/update_weights_from_distributed", self.update),
                ("POST", "/end_weight_update", self.end),
                ("POST", "/destroy_weights_update_group", self.destroy),
                ("POST", "/get_weights_by_name", self.weights_by_name),
                ("POST", "/weights_checker", self.check_weights), ("POST", "/generate", self.generate)]

    @staticmethod
    async def _run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _control(self, fn, *args, ok: str) -> web.Response:
        """Run an engine call: success answers ``ok``; a refusal answers its message."""
        try:
            await self._run(fn, *args)
        except Exception as e:  # SGLang answers every failure as {"success": false, ...}
            return _outcome(False, str(e))
        return _outcome(True, ok)

    async def health(self, _) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, _) -> web.Response:
        """SGLang's health check: one greedy token is queued, and the answer is 200 as soon as
        the model decodes a step or finishes a batch (a busy engine passes at once, even while
        the probe waits to join its batch), 503 after ``HEALTH_CHECK_TIMEOUT_S`` without one."""
        before = self.scheduler.batches_done, self.scheduler.steps_seen
        probe = asyncio.ensure_future(self.scheduler.submit(
            [GenRequest(input_ids=[0], max_new_tokens=1, temperature=0.0)]))
        self._probes.add(probe)
        probe.add_done_callback(self._probes.discard)
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        while (self.scheduler.batches_done, self.scheduler.steps_seen) == before and not probe.done():
            if time.monotonic() >= deadline:
                return web.Response(status=503)
            await asyncio.sleep(0.05)
        return web.Response(text="")

    async def model_info(self, _) -> web.Response:
        config = self.engine.model.config
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "weight_version": self.engine.weight_version,
            "architectures": getattr(config, "architectures", None)})

    async def server_info(self, _) -> web.Response:
        s = self.scheduler
        return web.json_response({
            "model_path": self.model_path, "context_length": self.engine.context_len,
            "internal_states": [{
                "paused": s.paused_mode is not None, "running_requests": s.running(),
                "waiting_requests": s.waiting(), "requests_seen": s.requests_seen,
                "weight_update_session": self.engine.session is not None}]})

    async def flush_cache(self, request) -> web.Response:
        """Nothing to flush (no prefix cache), but refused exactly when SGLang would be:
        while requests run or wait (see ``BatchScheduler.idle``)."""
        await _fields(request, {}, optional=True)  # SGLang's route takes no body
        if not self.scheduler.idle():  # SGLang answers plain text here
            return web.Response(text="Flush cache failed: requests are running or queued.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    async def pause(self, request) -> web.Response:
        mode = (await _fields(request, {"mode": (as_str, "abort")}))["mode"]
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r}: the CPU engine serves {', '.join(PAUSE_MODES)}")
        await self._run(self.scheduler.pause, mode)
        return web.json_response({"message": "Generation paused.", "status": "ok"})  # SGLang's shape

    async def resume(self, request) -> web.Response:
        await _fields(request, {})
        self.scheduler.resume()
        return web.json_response({"message": "Generation continued.", "status": "ok"})

    async def init_group(self, request) -> web.Response:
        f = await _fields(request, _INIT)
        return await self._control(self.engine.init_weights_update_group, *f.values(),
                                   ok="Succeeded to initialize custom process group.")

    async def begin(self, request) -> web.Response:
        await _fields(request, {})
        return await self._control(self.engine.begin_weight_update, ok="Success")

    async def end(self, request) -> web.Response:
        await _fields(request, {})
        return await self._control(self.engine.end_weight_update, ok="Success")

    async def update(self, request) -> web.Response:
        f = await _fields(request, _UPDATE)
        response = await self._control(
            self.engine.update_weights_from_distributed, f["names"], f["dtypes"], f["shapes"],
            f["group_name"], f["weight_version"], ok="Succeeded to update parameter online.")
        if response.status == 200 and f["flush_cache"] and not self.scheduler.idle():
            return _outcome(False, "Weights were updated, but the cache was not flushed: "
                                   "requests are running or queued")  # the weights stay loaded
        return response

    async def destroy(self, request) -> web.Response:
        name = (await _fields(request, {"group_name": _GROUP}))["group_name"]
        return await self._control(self.engine.destroy_weights_update_group, name,
                                   ok="Succeeded to destroy custom process group.")

    async def weights_by_name(self, request) -> web.Response:
        """The first ``truncate_size`` rows (default 100); a name the model lacks gets
        SGLang's one answer (the reason goes to the log, as SGLang's)."""
        f = await _fields(request, {"name": (as_str, REQUIRED), "truncate_size": (as_int, 100)})
        try:
            values = await self._run(self.engine.get_weights_by_name, f["name"], f["truncate_size"])
        except ValueError as e:
            logger.error("get_weights_by_name(%r): %s", f["name"], e)
            raise RequestError(WEIGHTS_UNSERVED) from None
        return web.json_response(values)

    async def check_weights(self, request) -> web.Response:
        """SGLang's ``/weights_checker`` (``checksum`` or ``reset_tensors``); a checksum
        answers SGLang's body: ``ranks`` (one entry per rank) and ``per_engine_checksum``."""
        f = await _fields(request, _CHECK, optional=True)  # SGLang's body is optional here
        if f["selector"] not in ("target", "all"):
            raise RequestError(f"selector={f['selector']!r}: the CPU engine has no draft model; "
                               "it serves target and all")
        try:
            info = await self._run(self.engine.check_weights, f["action"], f["skip_tensor_list"])
        except ValueError as e:
            return _outcome(False, str(e))
        body = {"success": True, "message": "Success."}
        if info is not None:
            body["ranks"] = [info]
            body["per_engine_checksum"] = hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()
        return web.json_response(body)

    async def generate(self, request) -> web.Response:
        t0 = time.perf_counter()
        engine = self.engine
        g = parse_generate(await _json(request), engine.tokenizer, engine.vocab_size, engine.context_len)
        results = await self.scheduler.submit(g.reqs)
        latency = time.perf_counter() - t0
        answers = [answer(g, i, res, latency, engine.tokenizer) for i, res in enumerate(results)]
        return web.json_response(answers[0] if g.single else answers)


def build_app(engine: HFEngine, scheduler: BatchScheduler, model_path: str) -> web.Application:
    app = web.Application(client_max_size=1 << 30, middlewares=[_errors])
    for method, path, handler in Routes(engine, scheduler, model_path).table():
        app.router.add_route(method, path, handler)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args(argv)
    setup_worker_logging()  # the run's format and level (RL_LOG_LEVEL); no triton either

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model_path)
    model = load_model(args.model_path, args.dtype, args.device)
    engine = HFEngine(model, tokenizer, eos_token_ids(args.model_path, tokenizer), seed=args.seed,
                      weight_version=args.weight_version, device=args.device)
    scheduler = BatchScheduler(engine, args.max_batch_size, args.batch_wait_ms / 1e3)
    logger.info("serving %s on %s:%d", args.model_path, args.host, args.port)
    web.run_app(build_app(engine, scheduler, args.model_path), host=args.host, port=args.port,
                print=None, access_log=None)
    gc.freeze()  # exit without collecting every torch object one by one: a second less per stop


if __name__ == "__main__":
    main()
