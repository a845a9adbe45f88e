"""HTTP client for the SGLang server protocol, used for SGLang and the CPU engine alike.

``EngineClient`` is one server: blocking control calls (health, weight updates, pause) and
an async ``generate``. It satisfies ``transfer.weights.WeightReceiver``, so the weight-sync
code drives engines only through it; ``rl.rollout.fanout`` spreads requests over several.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import requests

logger = logging.getLogger(__name__)

FLUSH_RETRY_S = 10.0
"""How long ``/flush_cache`` is retried after a weight update while the engine refuses it."""


class EngineError(RuntimeError):
    """An engine answered with an error (``status`` is its HTTP status) or did not answer
    (``status`` is None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def parse_body(text: str) -> Any:
    """An answer's body: its JSON, else its text (SGLang answers some routes in plain text),
    None when empty."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def error_message(body: Any) -> Any:
    """The message of an error answer, in any of SGLang's shapes: ``{success, message}``,
    ``{error: text}``, ``{error: {message}}``, ``{object: error, message, code}``, plain text."""
    if not isinstance(body, dict):
        return body
    err = body.get("error")
    return body.get("message") or (err.get("message") if isinstance(err, dict) else err) or body


class EngineClient:
    def __init__(self, url: str, name: str, num_ranks: int = 1, timeout_s: float = 120.0,
                 flush_after_update: bool = True) -> None:
        self.url = url.rstrip("/")
        self.name = f"{name} ({self.url})"
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self.flush_after_update = flush_after_update
        """False when engines pause ``in_place`` around syncs: SGLang refuses the flush then."""
        self._session: requests.Session | None = None
        # Features told apart by the server's answers (404 = an older release), never by a
        # version string: None until the first call finds out.
        self._has_sessions: bool | None = None
        self._has_model_info: bool | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}

    def __repr__(self) -> str:
        return f"EngineClient({self.name})"

    # -- blocking control plane ------------------------------------------------------------
    def _request(self, method: str, path: str, payload: dict | None = None,
                 timeout_s: float | None = None, ok_404: bool = False) -> Any:
        if self._session is None:
            self._session = requests.Session()
        try:
            r = self._session.request(method, self.url + path, json=payload,
                                      timeout=timeout_s or self.timeout_s)
        except requests.RequestException as e:
            raise EngineError(f"{self.name}{path}: no answer ({type(e).__name__}: {e})") from None
        if r.status_code == 404 and ok_404:
            return None
        body = parse_body(r.text)
        if r.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise EngineError(f"{self.name}{path}: HTTP {r.status_code}: {error_message(body)}",
                              r.status_code)
        return body

    def health(self, timeout_s: float = 30.0) -> bool:
        """``GET /health`` answered 200. SGLang answers 503 while loading and may run a
        one-token generation and sleep 1 s before answering, so give it time."""
        try:
            self._request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def health_generate(self, timeout_s: float) -> str | None:
        """``GET /health_generate``: the server generates one token (SGLang: a real request
        through its scheduler) and answers 200. None when it did, else why not."""
        try:
            self._request("GET", "/health_generate", timeout_s=timeout_s)
            return None
        except EngineError as e:
            return str(e)

    def model_info(self) -> dict:
        """``GET /model_info`` (SGLang 0.5.6 and later, with ``weight_version``); a server
        without it may still have the older ``/get_model_info``."""
        if self._has_model_info is not False:
            info = self._request("GET", "/model_info", ok_404=True)
            self._has_model_info = info is not None
            if info is not None:
                return info
        return self._request("GET", "/get_model_info")

    def get_weight_version(self) -> str:
        """The weight version the engine serves, from ``/model_info``. ``/get_weight_version``
        answers 404 from 0.5.8 and is removed in 0.5.21; it is asked only when the model info
        carries no version (releases older than those read for docs/sglang.md)."""
        info = self.model_info()
        if "weight_version" in info:
            return str(info["weight_version"])
        return str(self._request("GET", "/get_weight_version")["weight_version"])

    def flush_cache(self, timeout_s: float = FLUSH_RETRY_S) -> bool:
        """``POST /flush_cache``, retried while the engine refuses (HTTP 400: requests still
        running or queued) until ``timeout_s``; returns whether it flushed."""
        deadline = time.monotonic() + min(timeout_s, self.timeout_s)
        while True:
            try:
                self._request("POST", "/flush_cache")
                return True
            except EngineError as e:
                if e.status != 400 or time.monotonic() >= deadline:
                    if e.status == 400:
                        return False
                    raise
            time.sleep(0.2)

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop scheduling forward passes (returns once none runs); ``retract`` keeps the
        requests in flight (SGLang's default ``abort`` would end them early)."""
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    # -- weight updates (transfer.weights.WeightReceiver) --------------------------------------
    def check_update_ranks(self) -> None:
        """The engine's parallel layout must match the ranks the sender plans for: SGLang
        joins a weight-update group as ``rank_offset + tp_rank``, so tensor parallelism of
        ``num_ranks`` and no pipeline or data parallelism (``/server_info``'s ``tp_size``,
        ``pp_size``, ``dp_size``; a server that reports none of them is taken as is)."""
        info = self._request("GET", "/server_info", ok_404=True) or {}
        tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
        if pp != 1 or dp != 1:
            raise EngineError(f"{self.name} runs pp_size={pp}, dp_size={dp}: the weight path sends to "
                              f"tensor-parallel ranks only; start engines without --pp-size/--dp-size")
        if "tp_size" in info and tp != self.num_ranks:
            raise EngineError(f"{self.name} runs tp_size={tp}, but the sender plans for {self.num_ranks} "
                              f"rank(s) per engine (cluster.gpus_per_engine)")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self._request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session (0.5.21+ refuses updates outside one). A 404
        means an older server, whose updates need no session; learned once, at first use."""
        if self._has_sessions is False:
            return
        self._has_sessions = self._request("POST", "/begin_weight_update", {}, ok_404=True) is not None

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str) -> None:
        """Receive one bucket. Never ``flush_cache=True`` here: on 0.5.6-0.5.21 a refused
        flush inside an update kills the engine (``assert flush_cache_success``; requests
        waiting or running, docs/sglang.md); ``end_weight_update`` flushes once, after the
        session."""
        self._request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": False, "weight_version": weight_version})

    def end_weight_update(self) -> None:
        """Close the session, then flush the prefix cache the old weights filled (unless the
        engine is paused in place, where SGLang refuses any flush while requests sit in the
        running batch). A flush still refused after ``FLUSH_RETRY_S`` (SGLang before 0.5.21
        refuses it while retracted requests wait) is reported, not fatal: the weights are
        loaded; only cached prefixes may still hold old-weight KV."""
        if self._has_sessions:
            self._request("POST", "/end_weight_update", {})
        if self.flush_after_update and not self.flush_cache():
            logger.warning("%s: /flush_cache still refused after %.0fs (requests queued); cached "
                           "prefixes may hold KV of the previous weights", self.name, FLUSH_RETRY_S)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                      ok_404=True)  # older SGLang versions lack it

    def get_weights_by_name(self, name: str, truncate_size: int = 1 << 30) -> list:
        """``/get_weights_by_name``: the parameter's first ``truncate_size`` rows (entries of
        a vector) as float32 values; all of it by default (SGLang's default is 100). SGLang
        0.5.23 serves it only for models that define ``get_weights_by_name`` (Llama does,
        Qwen2 does not): otherwise, as for an unknown name, ``EngineError`` with status 400
        and "Get parameter by name failed"."""
        return self._request("POST", "/get_weights_by_name",
                             {"name": name, "truncate_size": truncate_size})

    def check_weights(self, action: str, skip: list[str] | None = None) -> dict[int, dict[str, str]] | None:
        """SGLang's ``/weights_checker`` on the target model (``selector``: a draft model of
        speculative decoding is left alone): ``checksum`` answers ``{rank: {tensor: hash}}``;
        ``reset_tensors`` fills every tensor with random values and answers ``{}``. Tensors
        whose name contains an entry of ``skip`` are left out of both. None from an engine
        that cannot: no route (404), or a release without the action (400)."""
        try:
            body = self._request("POST", "/weights_checker",
                                 {"action": action, "selector": "target", "skip_tensor_list": skip},
                                 ok_404=True)
        except EngineError as e:
            if e.status == 400 and "Unsupported" in str(e):
                return None
            raise
        if body is None:
            return None
        ranks = {}
        for r in body.get("ranks") or []:
            info = r["parallelism_info"]  # a list of roles in 0.5.23, one object before
            ranks[(info[0] if isinstance(info, list) else info)["rank"]] = r["checksums"]
        return ranks

    # -- data plane ----------------------------------------------------------------------
    async def agenerate(self, session, payload: dict, timeout_s: float) -> list[dict]:
        """One ``/generate`` of one prompt; one answer per sample (SGLang answers a list when
        ``sampling_params.n`` > 1 and one object when it is 1)."""
        # start-up cost: the driver imports this module for its blocking calls and never needs
        # aiohttp (0.15 s)
        import aiohttp

        try:
            async with session.post(self.url + "/generate", json=payload,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                body = parse_body(await r.text())
                if r.status != 200:
                    raise EngineError(f"{self.name}/generate: HTTP {r.status}: {error_message(body)}",
                                      r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineError(f"{self.name}/generate: no answer ({type(e).__name__}: {e})") from None
        n = payload.get("sampling_params", {}).get("n", 1)
        group = body if isinstance(body, list) else [body]
        if len(group) != n:
            raise EngineError(f"{self.name}/generate: {len(group)} answers to a request of n={n}")
        return group
