"""The CPU engine as an HTTP server speaking SGLang's protocol subset.

    python -m rl.rollout.engines.hf_server --model-path DIR --port 30000

Endpoints (same paths, fields and answers as SGLang): ``/generate`` (``input_ids`` or
``text``, single or batched; ``sampling_params``; ``return_logprob``), ``/health``,
``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/flush_cache``,
``/get_weight_version``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/get_weights_by_name``, ``/pause_generation``,
``/continue_generation``. Concurrent requests are queued and decoded together in batches.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading
import time
import uuid

from aiohttp import web

from rl.rollout.engines.hf_engine import GenRequest, HFEngine

_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "n", "sampling_seed"}

PAUSE_MODES = {"retract", "in_place"}  # both: the running batch finishes, queued ones wait


class BatchScheduler:
    """Collects concurrent requests and runs them as one batch on a worker thread."""

    def __init__(self, engine: HFEngine, max_batch_size: int, batch_wait_s: float) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.queue: queue.Queue = queue.Queue()
        self._state = threading.Condition()
        self._paused = False
        self._busy = False  # a batch is on the model now
        self.thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self.thread.start()

    async def submit(self, reqs: list[GenRequest]):
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        for r, f in zip(reqs, futures):
            self.queue.put((r, f, loop))
        return await asyncio.gather(*futures)

    def pause(self) -> None:
        """Hold new batches and return once the running one (if any) has finished: no
        forward pass runs until ``resume``, so weights can be swapped safely. A batch runs
        to completion here, so each answer comes from one weight version; SGLang instead
        retracts running requests and finishes them under the new weights."""
        with self._state:
            self._paused = True
            while self._busy:
                self._state.wait()

    def resume(self) -> None:
        with self._state:
            self._paused = False
            self._state.notify_all()

    def _loop(self) -> None:
        while True:
            items = [self.queue.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(items) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                try:
                    items.append(self.queue.get(timeout=max(remaining, 0)) if remaining > 0
                                 else self.queue.get_nowait())
                except queue.Empty:
                    break
            with self._state:
                while self._paused:  # hold queued requests until continue_generation
                    self._state.wait()
                self._busy = True
            try:
                results = self.engine.generate([r for r, _, _ in items])
            except Exception as e:  # the batch fails, the server lives on
                for _, fut, loop in items:
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                continue
            finally:
                with self._state:
                    self._busy = False
                    self._state.notify_all()
            for (_, fut, loop), res in zip(items, results):
                loop.call_soon_threadsafe(_set_result, fut, res)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _parse_generate(body: dict, tokenizer) -> tuple[list[GenRequest], bool, bool]:
    """-> (requests, batched, return_logprob). Raises ValueError on bad input."""
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the CPU engine")
    if ("input_ids" in body) == ("text" in body):
        raise ValueError("give exactly one of 'input_ids' and 'text'")
    if "input_ids" in body:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    else:
        text = body["text"]
        batched = isinstance(text, list)
        prompts = [tokenizer.encode(t) for t in (text if batched else [text])]
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty prompt")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts):
        raise ValueError("sampling_params list and prompts differ in length")
    reqs = []
    for p, s in zip(prompts, sps):
        unknown = set(s) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unsupported sampling_params {sorted(unknown)}")
        if s.get("n", 1) != 1:
            raise ValueError("sampling_params.n must be 1 (send one request per sample)")
        reqs.append(GenRequest(
            input_ids=[int(t) for t in p], max_new_tokens=int(s.get("max_new_tokens", 128)),
            temperature=float(s.get("temperature", 1.0)), top_p=float(s.get("top_p", 1.0)),
            top_k=int(s.get("top_k", -1)), stop_token_ids=list(s.get("stop_token_ids") or []),
            ignore_eos=bool(s.get("ignore_eos", False))))
        if reqs[-1].max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be > 0")
    return reqs, batched, bool(body.get("return_logprob", False))


def build_app(engine: HFEngine, scheduler: BatchScheduler, model_path: str) -> web.Application:
    tokenizer = engine.tokenizer
    routes = web.RouteTableDef()

    async def run_blocking(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def call(request: web.Request, fn, *keys: str, optional: dict | None = None):
        try:
            body = await request.json()
            args = [body[k] for k in keys]
            extra = {k: body.get(k, v) for k, v in (optional or {}).items()}
        except (ValueError, KeyError) as e:
            return _error(400, f"bad request: {e!r}")
        try:
            await run_blocking(fn, *args, **extra)
        except Exception as e:
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"},
                                     status=400)
        return web.json_response({"success": True, "message": "ok"})

    @routes.get("/health")
    async def health(_):
        return web.Response(text="")

    @routes.get("/health_generate")
    async def health_generate(_):
        await scheduler.submit([GenRequest(input_ids=[engine.pad_id], max_new_tokens=1)])
        return web.Response(text="")

    @routes.get("/get_model_info")
    async def model_info(_):
        return web.json_response({"model_path": model_path, "tokenizer_path": model_path,
                                  "is_generation": True, "weight_version": engine.weight_version})

    @routes.get("/get_server_info")
    async def server_info(_):
        return web.json_response({"model_path": model_path, "engine": "hf-cpu",
                                  "max_batch_size": scheduler.max_batch_size,
                                  "weight_version": engine.weight_version})

    @routes.get("/get_weight_version")
    async def weight_version(_):
        return web.json_response({"weight_version": engine.weight_version})

    @routes.route("*", "/flush_cache")
    async def flush_cache(_):
        return web.Response(text="Cache flushed.")  # no prefix cache to flush

    @routes.post("/pause_generation")
    async def pause(request):
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:  # ``abort`` (SGLang's default) would fail requests: refused
            return _error(400, f"mode={mode!r}: this engine supports {sorted(PAUSE_MODES)}")
        await run_blocking(scheduler.pause)
        return web.json_response({"success": True, "message": "paused"})

    @routes.post("/continue_generation")
    async def resume(_):
        scheduler.resume()
        return web.json_response({"success": True, "message": "continued"})

    @routes.post("/init_weights_update_group")
    async def init_group(request):
        return await call(request, engine.init_weights_update_group, "master_address",
                          "master_port", "rank_offset", "world_size",
                          optional={"group_name": "weight_update_group", "backend": "gloo"})

    @routes.post("/update_weights_from_distributed")
    async def update(request):
        return await call(request, engine.update_weights_from_distributed, "names", "dtypes",
                          "shapes", optional={"group_name": "weight_update_group",
                                              "weight_version": None})

    @routes.post("/destroy_weights_update_group")
    async def destroy(request):
        return await call(request, engine.destroy_weights_update_group,
                          optional={"group_name": "weight_update_group"})

    @routes.route("*", "/get_weights_by_name")
    async def weights_by_name(request):
        try:
            body = await request.json()
            values = await run_blocking(engine.get_weights_by_name, body["name"],
                                        int(body.get("truncate_size", 100)))
        except (ValueError, KeyError) as e:
            return _error(400, str(e))
        return web.json_response(values)

    @routes.post("/generate")
    async def generate(request):
        try:
            reqs, batched, want_logprob = _parse_generate(await request.json(), tokenizer)
        except (ValueError, TypeError, KeyError) as e:
            return _error(400, str(e))
        results = await scheduler.submit(reqs)
        answers = []
        for req, res in zip(reqs, results):
            meta = {"id": uuid.uuid4().hex, "finish_reason": res.finish_reason,
                    "prompt_tokens": len(req.input_ids), "completion_tokens": len(res.output_ids),
                    "weight_version": res.weight_version}
            if want_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(res.logprobs, res.output_ids)]
            answers.append({"text": tokenizer.decode(res.output_ids, skip_special_tokens=True),
                            "output_ids": res.output_ids, "meta_info": meta})
        return web.json_response(answers if batched else answers[0])

    app = web.Application(client_max_size=1 << 30)
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

    import torch

    from rl.model import eos_token_ids, load_model, load_tokenizer

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


if __name__ == "__main__":
    main()
