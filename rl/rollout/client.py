"""HTTP client for the SGLang server protocol, used for SGLang and the CPU engine alike.

``EngineClient`` is one server: blocking control calls (health, weight updates, pause) and
an async ``generate``. It satisfies ``transfer.weights.WeightReceiver``, so the weight-sync
code drives engines only through it. ``EnginePool`` spreads generate requests over several
servers, least outstanding requests first.
"""

from __future__ import annotations

import asyncio
from typing import Any

import requests


class EngineError(RuntimeError):
    """An engine answered with an error or did not answer."""


class EngineClient:
    def __init__(self, url: str, name: str, num_ranks: int = 1, timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.name = f"{name} ({self.url})"
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self._session: requests.Session | None = None

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
        body: Any = None
        if r.content:
            try:
                body = r.json()
            except ValueError:
                body = r.text
        if r.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            message = body.get("message") or body.get("error") if isinstance(body, dict) else body
            raise EngineError(f"{self.name}{path}: HTTP {r.status_code}: {message}")
        return body

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self._request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def get_model_info(self) -> dict:
        return self._request("GET", "/get_model_info")

    def get_weight_version(self) -> str:
        return str(self._request("GET", "/get_weight_version")["weight_version"])

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop scheduling forward passes (returns once none runs); ``retract`` keeps the
        requests in flight (SGLang's default ``abort`` would end them early)."""
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self._request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        flush_cache: bool, weight_version: str) -> None:
        self._request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                      ok_404=True)  # older SGLang versions lack it

    def get_weights_by_name(self, name: str, truncate_size: int = 1 << 30) -> list:
        return self._request("POST", "/get_weights_by_name",
                             {"name": name, "truncate_size": truncate_size})

    # -- data plane ----------------------------------------------------------------------
    async def agenerate(self, session, payload: dict, timeout_s: float) -> dict:
        import aiohttp

        try:
            async with session.post(self.url + "/generate", json=payload,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    raise EngineError(f"{self.name}/generate: HTTP {r.status}: {body}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineError(f"{self.name}/generate: no answer ({type(e).__name__}: {e})") from None


class EnginePool:
    """Sends each request to the engine with the fewest requests in flight."""

    def __init__(self, clients: list[EngineClient]) -> None:
        if not clients:
            raise ValueError("no engines to send requests to")
        self.clients = clients
        self.inflight = [0] * len(clients)

    async def generate(self, session, payload: dict, timeout_s: float) -> dict:
        i = min(range(len(self.clients)), key=self.inflight.__getitem__)
        self.inflight[i] += 1
        try:
            return await self.clients[i].agenerate(session, payload, timeout_s)
        finally:
            self.inflight[i] -= 1
