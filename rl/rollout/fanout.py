"""The HTTP fan-out: one step's requests spread over the engines in service.

``run_groups`` runs every prompt group of a step at once (the rollout function's calls);
``generate_groups`` sends one request per prompt, all in flight at once; ``EnginePool``
sends each to the live engine with the fewest requests in flight and, with rollout fault
tolerance, sends a request again when its engine dies. Which engine is in service is the
fleet's to say (``rl.rollout.fleet.EngineSet``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Awaitable, Callable

from rl.rollout.client import EngineError
from rl.rollout.fleet import EngineSet

logger = logging.getLogger(__name__)


class Stopped(Exception):
    """The generation was abandoned because the stream is stopping."""


class EnginePool:
    """Sends each request to the live engine with the fewest requests in flight.

    With ``retry`` (rollout fault tolerance), an engine found dead is taken out of service
    (``EngineSet.mark_down``, by the request that saw it die or by ``rl.rollout.health``) and
    every request in flight on it is sent again to a live engine: a request's answer is taken
    from exactly one engine. Without it, the first failure is raised."""

    POLL_S = 0.1
    """How often a request in flight looks whether its engine was taken out of service."""

    def __init__(self, engines: EngineSet, retry: bool = False) -> None:
        self.engines = engines
        self.retry = retry
        self.inflight = [0] * len(engines.clients)
        self._busy_s = [0.0] * len(engines.clients)
        self._busy_since: list[float | None] = [None] * len(engines.clients)
        self._counting = threading.Lock()
        """Guards the counters above: in fully async mode the stream's thread and an
        evaluation on the actor's own thread send requests through this pool at once."""
        self.retried = 0
        """Requests sent again because their engine died (a request of ``n`` samples is one)."""

    async def _pick(self) -> int:
        engines = self.engines
        while not engines.live() and engines.holding:
            await asyncio.sleep(self.POLL_S)
        live = engines.live()
        if not live:
            raise EngineError("every engine is down: " + "; ".join(
                f"{c.name}: {engines.down_reason.get(i, engines.state[i])}"
                for i, c in enumerate(engines.clients)))
        return min(live, key=self.inflight.__getitem__)

    def busy_seconds(self) -> float:
        """Seconds engines had at least one request in flight, summed over engines, since
        the pool was made (an engine with none is idle: ``rollout/engine_busy_s``)."""
        with self._counting:
            now = time.monotonic()
            return sum(b + (now - t if t is not None else 0.0)
                       for b, t in zip(self._busy_s, self._busy_since))

    async def generate(self, session, payload: dict, timeout_s: float) -> list[dict]:
        while True:
            i = await self._pick()
            with self._counting:
                if self.inflight[i] == 0:
                    self._busy_since[i] = time.monotonic()
                self.inflight[i] += 1
            try:
                if not self.retry:
                    return await self.engines.clients[i].agenerate(session, payload, timeout_s)
                answer = await self._on(i, session, payload, timeout_s)
            finally:
                with self._counting:
                    self.inflight[i] -= 1
                    if self.inflight[i] == 0:
                        self._busy_s[i] += time.monotonic() - self._busy_since[i]
                        self._busy_since[i] = None
            if answer is not None:
                return answer
            with self._counting:
                self.retried += 1

    async def _on(self, i: int, session, payload: dict, timeout_s: float) -> list[dict] | None:
        """The request's answer from engine ``i``, or None when that engine was found dead
        before answering (the request was cancelled there)."""
        task = asyncio.ensure_future(self.engines.clients[i].agenerate(session, payload, timeout_s))
        try:
            while not task.done():
                await asyncio.wait([task], timeout=self.POLL_S)
                if self.engines.state[i] != "live" and not task.done():
                    return None
            return task.result()
        except EngineError as e:
            if e.status is not None:  # the engine answered: a refused request is no death
                raise
            self.engines.mark_down(i, str(e))
            return None
        finally:
            task.cancel()


# Module-level coroutines: an ``async def`` method would turn the Ray actor into an asyncio
# actor, whose running event loop forbids ``asyncio.run`` in ``generate``.
async def run_groups(run: Callable[[Any, int], Awaitable[list]], count: int, n: int, label: str = "",
                     stop: threading.Event | None = None) -> list[list]:
    """``await run(session, i)`` for every group ``i < count`` (``n`` samples each), all in
    flight at once on one aiohttp session; their results in group order. ``stop`` set by
    another thread cancels every group and raises ``Stopped``."""
    import aiohttp  # start-up cost: the driver imports this module to make the actor (0.15 s)

    total, done = count * n, 0
    t0 = last_print = time.perf_counter()

    async def one(session, i: int) -> list:
        nonlocal done, last_print
        group = await run(session, i)
        done += n
        now = time.perf_counter()
        if now - last_print > 5.0:  # long generations (real models) show progress
            last_print = now
            logger.info("%s: %d/%d samples, %.0fs", label, done, total, now - t0)
        return group

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.ensure_future(one(session, i)) for i in range(count)]
        everything = asyncio.gather(*tasks)
        try:
            while stop is not None and not everything.done():
                await asyncio.wait([everything], timeout=0.1)
                if stop.is_set():
                    raise Stopped
            return await everything
        finally:  # one failed group ends the gather but not its siblings: cancel each
            for t in tasks:
                t.cancel()


async def generate_groups(pool: EnginePool, prompt_ids: list[list[int]], n: int, sampling: dict,
                          timeout_s: float, label: str = "",
                          stop: threading.Event | None = None) -> list[list[dict]]:
    """``n`` raw SGLang answers per prompt, one request per prompt (``sampling_params.n``),
    all in flight at once (``run_groups``); answers grouped by prompt. Training batches go
    through the rollout function (``rl.rollout.functions``), whose default sends the same
    requests; the SGLang contract tests send these.

    One request per prompt rather than per sample: 64 x 8 separate requests spent most of a
    default step's generation in HTTP and batching overhead (docs/benchmarks.md). SGLang
    expands ``n`` into ``n`` scheduler requests with their own ids
    (``tokenizer_manager._handle_batch_request``), so retract, pause and the abort on a
    dropped connection still act on each sample, and each answer carries its own weight
    versions (``rl.rollout.batch.sample_weight_version``); a request per prompt (not one per
    batch) keeps SGLang's prefix warm-up of each prompt concurrent, where a batch with
    ``n > 1`` runs them one by one."""
    params = {**sampling, "n": n}

    async def one(session, i: int) -> list[dict]:
        return await pool.generate(session, {"input_ids": prompt_ids[i], "sampling_params": params,
                                             "return_logprob": True}, timeout_s)

    return await run_groups(one, len(prompt_ids), n, label, stop)
