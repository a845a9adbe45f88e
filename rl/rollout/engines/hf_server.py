"""The CPU engine as an HTTP server speaking SGLang 0.5.23's protocol for what it serves.

    python -m rl.rollout.engines.hf_server --model-path DIR --port 30000

Routes as in SGLang's ``srt/entrypoints/http_server.py``, with the same fields and answers:
``/generate`` (see ``protocol``), ``/health``, ``/health_generate``, ``/model_info`` (and its
deprecated alias ``/get_model_info``), ``/server_info`` (``/get_server_info``), ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/init_weights_update_group``,
``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``,
``/destroy_weights_update_group``, ``/get_weights_by_name``, ``/weights_checker``. Bad input
is a 400 naming the problem, never a crash, in the body SGLang's server gives that kind of
input:

- a body that is not JSON, not an object, or (control routes) lacks a field or has one of
  the wrong type: FastAPI refuses it before the route runs, and SGLang's
  ``RequestValidationError`` handler answers an ``ErrorResponse``, ``{"object": "error",
  "message": ..., "type": "Bad Request", "param": null, "code": 400}`` (``BodyError``);
- a ``/generate`` body that breaks ``GenerateRequest``'s schema: the contract gate in
  ``generate_request`` answers ``{"error": "<text>"}`` (``protocol.ContractError``);
- a ``/generate`` (or ``/get_weights_by_name``) request refused past that: SGLang's
  ``ValueError``, ``_create_error_response``: ``{"error": {"message": ...}}``
  (``RequestError``);
- a control call the engine refuses: ``{"success": false, "message": ...}``.

Concurrent requests are queued and decoded together in batches.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import os
import queue
import threading
import time
import traceback

import torch
from aiohttp import web

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.log import block_triton
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.protocol import ContractError, answer, parse_generate
from rl.rollout.engines.sampling import RequestError, as_bool, as_int, as_list, as_str

logger = logging.getLogger(__name__)

# Both modes let the running batch finish and hold queued requests; they differ in what
# /flush_cache counts as busy (SGLang: `is_fully_idle(ignore_waiting=paused)`, where
# `retract` has moved every running request back to the waiting queue).
PAUSE_MODES = {"retract", "in_place"}
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")


class BatchScheduler:
    """Collects concurrent requests and runs them as one batch on a worker thread."""

    def __init__(self, engine: HFEngine, max_batch_size: int, batch_wait_s: float) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.queue: queue.Queue = queue.Queue()
        self._state = threading.Condition()
        self.paused_mode: str | None = None  # the pause mode while paused
        self._waiting = 0  # requests submitted and not yet on the model
        self._running = 0  # requests in the batch on the model now
        self.batches_done = 0  # batches that ran to the end (a sign of life for /health_generate)
        self.requests_seen = 0  # requests submitted (for tests: which engine got work)
        self.thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self.thread.start()

    async def submit(self, reqs: list[GenRequest]):
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        with self._state:
            self._waiting += len(reqs)
            self.requests_seen += len(reqs)
        for r, f in zip(reqs, futures):
            self.queue.put((r, f, loop))
        return await asyncio.gather(*futures)

    def pause(self, mode: str) -> None:
        """Hold new batches and return once the running one (if any) has finished: no
        forward pass runs until ``resume``, so weights can be swapped safely. A batch runs
        to completion here, so each answer comes from one weight version; SGLang instead
        retracts running requests (or freezes them in place) and finishes them later."""
        with self._state:
            self.paused_mode = mode
            while self._running:
                self._state.wait()

    def resume(self) -> None:
        with self._state:
            self.paused_mode = None
            self._state.notify_all()

    def running(self) -> int:
        """Requests on the model now."""
        with self._state:
            return self._running

    def waiting(self) -> int:
        """Requests submitted and not yet on the model."""
        with self._state:
            return self._waiting

    def idle(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=paused)`` as it decides a flush: nothing
        running, and nothing queued unless paused in ``retract`` mode (whose queue is what
        it retracted). Paused ``in_place``, SGLang keeps every request in its running
        batch, so any request here counts as running."""
        with self._state:
            if self._running:
                return False
            return self.paused_mode == "retract" or self._waiting == 0

    def _loop(self) -> None:
        while True:
            items = [self.queue.get()]
            # The batch closes after a quiet gap of batch_wait_s, not batch_wait_s after its
            # first request: a burst (a rollout step sends every prompt at once) arrives
            # over longer than one gap when the HTTP loop is slow, and a batch cut in two
            # runs two decode loops one after the other.
            while len(items) < self.max_batch_size:
                try:
                    items.append(self.queue.get(timeout=self.batch_wait_s))
                except queue.Empty:
                    break
            with self._state:
                while self.paused_mode is not None:  # hold queued requests until continue
                    self._state.wait()
                self._waiting -= len(items)
                self._running = len(items)
            try:
                results = self.engine.generate([r for r, _, _ in items])
            except Exception as e:  # the batch fails, the server lives on
                for _, fut, loop in items:
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                continue
            finally:
                with self._state:
                    self._running = 0
                    self.batches_done += 1
                    self._state.notify_all()
            for (_, fut, loop), res in zip(items, results):
                loop.call_soon_threadsafe(_set_result, fut, res)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class BodyError(RequestError):
    """The body cannot be parsed into the route's request type (FastAPI's
    ``RequestValidationError`` on SGLang's server)."""


def _error(status: int, message: str) -> web.Response:
    """SGLang's ``_create_error_response``: a ``ValueError`` past the route's parsing."""
    return web.json_response({"error": {"message": message}}, status=status)


def _invalid_body(message: str) -> web.Response:
    """SGLang's ``RequestValidationError`` handler: an ``ErrorResponse`` (``openai/protocol``)."""
    return web.json_response({"object": "error", "message": message, "type": "Bad Request",
                              "param": None, "code": 400}, status=400)


def _outcome(success: bool, message: str) -> web.Response:
    """The ``{"success", "message"}`` answer of SGLang's control routes."""
    return web.json_response({"success": success, "message": message},
                             status=200 if success else 400)


@web.middleware
async def _errors(request: web.Request, handler):
    """Bad input is a 400 that names the problem, in SGLang's body for its kind (see the
    module's docstring); anything else is a 500 with its message, and the server keeps
    serving."""
    try:
        return await handler(request)
    except BodyError as e:
        return _invalid_body(str(e))
    except ContractError as e:
        return web.json_response({"error": str(e)}, status=400)
    except RequestError as e:
        return _error(400, str(e))
    except web.HTTPException:
        raise
    except Exception as e:
        traceback.print_exc()  # into the engine's log
        return _error(500, f"{type(e).__name__}: {e}")


async def _body(request: web.Request) -> dict:
    """The JSON object the request carries. As on SGLang (FastAPI), a route that takes a
    body refuses a request without one; ``{}`` is a body."""
    raw = await request.read()
    if not raw.strip():
        raise BodyError("the request has no body; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_REQUIRED = object()


def _field(body: dict, name: str, check, default=_REQUIRED):
    """A control route's field: missing or of the wrong type is a ``BodyError``, as
    FastAPI's validation of the route's ``io_struct`` type."""
    if body.get(name) is None:
        if default is _REQUIRED:
            raise BodyError(f"missing field `{name}`")
        return default
    try:
        return check(name, body[name])
    except RequestError as e:
        raise BodyError(str(e)) from None


def _str_list(where, v):
    return as_list(where, v, as_str)


def _shapes(where, v):
    return as_list(where, v, lambda w, s: as_list(w, s, as_int))


WEIGHTS_UNSERVED = "Get parameter by name failed"
"""SGLang's answer (HTTP 400) to a ``/get_weights_by_name`` its model cannot serve."""

HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` default: ``/health_generate`` answers 503 after it."""


def build_app(engine: HFEngine, scheduler: BatchScheduler, model_path: str) -> web.Application:
    tokenizer = engine.tokenizer
    routes = web.RouteTableDef()
    flushing = asyncio.Lock()
    pending_probes: set[asyncio.Future] = set()

    async def run_blocking(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def control(fn, *args, ok: str, **kwargs) -> web.Response:
        """Run an engine call: success answers ``ok``; a refusal answers its message."""
        try:
            await run_blocking(fn, *args, **kwargs)
        except Exception as e:  # SGLang answers every failure as {"success": false, ...}
            return _outcome(False, str(e))
        return _outcome(True, ok)

    @routes.get("/health")
    async def health(_):
        return web.Response(text="")

    @routes.get("/health_generate")
    async def health_generate(_):
        """SGLang's health check: one greedy token is queued, and the answer is 200 as soon as
        the model finishes any batch (a busy engine passes at once), 503 after
        ``HEALTH_CHECK_TIMEOUT_S`` without one."""
        before = scheduler.batches_done
        probe = asyncio.ensure_future(scheduler.submit(
            [GenRequest(input_ids=[0], max_new_tokens=1, temperature=0.0)]))
        pending_probes.add(probe)  # kept until it ends, whenever the answer goes out
        probe.add_done_callback(pending_probes.discard)
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        while scheduler.batches_done == before and not probe.done():
            if time.monotonic() >= deadline:
                return web.Response(status=503)
            await asyncio.sleep(0.05)
        return web.Response(text="")

    def info() -> dict:
        config = engine.model.config
        return {"model_path": model_path, "served_model_name": model_path,
                "tokenizer_path": model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    @routes.get("/model_info")
    @routes.get("/get_model_info")  # deprecated in SGLang; the same answer
    async def model_info(_):
        return web.json_response(info())

    def server_info() -> dict:
        return {"model_path": model_path, "tokenizer_path": model_path,
                "served_model_name": model_path, "context_length": engine.context_len,
                "max_running_requests": scheduler.max_batch_size, "device": str(engine.device),
                "engine": "hf-cpu", "internal_states": [{
                    "paused": scheduler.paused_mode is not None,
                    "weight_update_session": engine.session is not None,
                    "running_requests": scheduler.running(), "waiting_requests": scheduler.waiting(),
                    "requests_seen": scheduler.requests_seen}]}

    @routes.get("/server_info")
    @routes.get("/get_server_info")  # deprecated in SGLang; the same answer
    async def get_server_info(_):
        return web.json_response(server_info())

    @routes.route("GET", "/flush_cache")
    @routes.route("POST", "/flush_cache")
    async def flush_cache(request):
        """Nothing to flush (no prefix cache), but refused exactly when SGLang would be:
        while requests run or wait (see ``BatchScheduler.idle``); ``?timeout=`` waits."""
        try:  # SGLang: ``timeout: float = Query(0.0, ge=0.0)``, checked by FastAPI
            timeout_s = float(request.query.get("timeout", 0.0))
        except ValueError:
            raise BodyError("timeout: a number of seconds >= 0") from None
        if not timeout_s >= 0:
            raise BodyError("timeout: a number of seconds >= 0")
        if flushing.locked():
            return web.Response(text="Another flush_cache is already in progress.", status=400)
        async with flushing:
            deadline = time.monotonic() + timeout_s
            while not scheduler.idle():
                if time.monotonic() >= deadline:
                    message = "Timed out waiting for idle state." if timeout_s else "Flush cache failed.\n"
                    return web.Response(text=message, status=400)
                await asyncio.sleep(0.02)
        return web.Response(text=FLUSHED)

    @routes.post("/pause_generation")
    async def pause(request):
        mode = _field(await _body(request), "mode", as_str, "abort")
        if mode not in PAUSE_MODES | {"abort"}:  # SGLang's ``Literal`` of modes
            raise BodyError(f"mode={mode!r}: one of 'abort', 'in_place', 'retract'")
        if mode not in PAUSE_MODES:  # ``abort`` (SGLang's default) would fail requests: refused
            raise RequestError(f"mode={mode!r}: this engine supports {sorted(PAUSE_MODES)}")
        await run_blocking(scheduler.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @routes.post("/continue_generation")
    async def resume(request):
        await _body(request)
        scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.post("/init_weights_update_group")
    async def init_group(request):
        b = await _body(request)
        args = (_field(b, "master_address", as_str), _field(b, "master_port", as_int),
                _field(b, "rank_offset", as_int), _field(b, "world_size", as_int),
                _field(b, "group_name", as_str, "weight_update_group"),
                _field(b, "backend", as_str, "gloo"))  # SGLang defaults to nccl; CPU: gloo
        return await control(engine.init_weights_update_group, *args,
                             ok="Succeeded to initialize custom process group.")

    @routes.post("/begin_weight_update")
    async def begin(request):
        await _body(request)
        return await control(engine.begin_weight_update, ok="Success")

    @routes.post("/end_weight_update")
    async def end(request):
        await _body(request)
        return await control(engine.end_weight_update, ok="Success")

    @routes.post("/update_weights_from_distributed")
    async def update(request):
        b = await _body(request)
        names, dtypes = _field(b, "names", _str_list), _field(b, "dtypes", _str_list)
        shapes = _field(b, "shapes", _shapes)
        group_name = _field(b, "group_name", as_str, "weight_update_group")
        version = _field(b, "weight_version", as_str, None)
        flush = _field(b, "flush_cache", as_bool, True)
        if _field(b, "abort_all_requests", as_bool, False):
            return _outcome(False, "abort_all_requests=true is not supported by the CPU engine")
        if _field(b, "load_format", as_str, None) is not None:
            return _outcome(False, f"load_format={b['load_format']!r} is not supported by the "
                                   "CPU engine")
        response = await control(engine.update_weights_from_distributed, names, dtypes, shapes,
                                 group_name, version, ok="Succeeded to update parameter online.")
        if response.status == 200 and flush and not scheduler.idle():
            return _outcome(False, FLUSH_REFUSED)  # the weights stay loaded
        return response

    @routes.post("/destroy_weights_update_group")
    async def destroy(request):
        name = _field(await _body(request), "group_name", as_str, "weight_update_group")
        return await control(engine.destroy_weights_update_group, name,
                             ok="Succeeded to destroy custom process group.")

    @routes.route("GET", "/get_weights_by_name")
    @routes.route("POST", "/get_weights_by_name")
    async def weights_by_name(request):
        """SGLang's ``GetWeightsByNameReqInput`` (``name``, ``truncate_size`` rows, default
        100); a name it cannot serve gets SGLang's one answer, whatever the reason (its
        model logs the reason; so does this engine)."""
        b = await _body(request)
        name, size = _field(b, "name", as_str), _field(b, "truncate_size", as_int, 100)
        try:
            values = await run_blocking(engine.get_weights_by_name, name, size)
        except ValueError as e:
            logger.error("get_weights_by_name(%r): %s", name, e)
            raise RequestError(WEIGHTS_UNSERVED) from None
        return web.json_response(values)

    @routes.route("GET", "/weights_checker")
    @routes.route("POST", "/weights_checker")
    async def weights_checker(request):
        """SGLang's ``CheckWeightsReqInput`` (``action``, default ``checksum``;
        ``skip_tensor_list``; ``selector``: this engine has no draft model; a request without
        a body, or with ``null``, takes the defaults). A checksum
        answers SGLang's body: ``ranks`` (one entry per rank) and ``per_engine_checksum``."""
        raw = (await request.read()).strip()
        b = await _body(request) if raw and raw != b"null" else {}
        action = _field(b, "action", as_str, "checksum")
        skip = _field(b, "skip_tensor_list", _str_list, None)
        _field(b, "allow_quant_error", as_bool, False)
        if _field(b, "selector", as_str, "all") not in ("target", "draft", "all"):
            raise BodyError(f"selector={b['selector']!r}: use target, draft or all")
        try:
            info = await run_blocking(engine.check_weights, action, skip)
        except ValueError as e:
            return _outcome(False, str(e))
        body = {"success": True, "message": "Success."}
        if info is not None:
            body["ranks"] = [info]
            body["per_engine_checksum"] = hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()
        return web.json_response(body)

    @routes.route("POST", "/generate")
    @routes.route("PUT", "/generate")
    async def generate(request):
        t0 = time.perf_counter()
        g = parse_generate(await _body(request), tokenizer, engine.vocab_size,
                           engine.context_len)
        results = await scheduler.submit(g.reqs)
        latency = time.perf_counter() - t0
        answers = [answer(g, i, res, latency, tokenizer) for i, res in enumerate(results)]
        return web.json_response(answers[0] if g.single else answers)

    app = web.Application(client_max_size=1 << 30, middlewares=[_errors])
    app.add_routes(routes)
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
    block_triton()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model_path)
    model = load_model(args.model_path, args.dtype, args.device)
    engine = HFEngine(model, tokenizer, eos_token_ids(args.model_path, tokenizer), seed=args.seed,
                      weight_version=args.weight_version, device=args.device)
    scheduler = BatchScheduler(engine, args.max_batch_size, args.batch_wait_ms / 1e3)
    print(f"hf engine: {args.model_path} on {args.host}:{args.port}", flush=True)
    web.run_app(build_app(engine, scheduler, args.model_path), host=args.host, port=args.port,
                print=None, access_log=None)
    gc.freeze()  # exit without collecting every torch object one by one: a second less per stop


if __name__ == "__main__":
    main()
