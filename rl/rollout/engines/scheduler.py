"""The CPU engine's scheduler: concurrent requests decoded together in batches, and SGLang's
pause and continue (``/pause_generation``, ``/continue_generation``).

Requests are queued and run in batches on one worker thread: a batch starts after a quiet
gap; requests that arrive while it decodes join it at a step boundary once enough wait
(SGLang's continuous batching; ``join_share``), up to ``max_batch_size``; each request is
answered as it finishes. While paused no
batch starts and none joins; what a pause does to the running batch depends on its mode
(``hf_engine``'s docstring; SGLang 0.5.23's ``Scheduler.pause_generation``). The scheduler is
the running batch's ``PausePoint``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from functools import partial

from rl.rollout.engines.hf_engine import IN_PLACE, RETRACT, GenRequest, GenState, HFEngine

PAUSE_MODES = (RETRACT, IN_PLACE)
"""SGLang's pause modes served (``hf_engine`` says what each does to a running batch). Both
hold queued requests until continue; they differ in what ``/flush_cache`` counts as busy
(SGLang: ``is_fully_idle(ignore_waiting=paused)``, where ``retract`` has moved every running
request back to the waiting queue). SGLang's default, ``abort``, would fail the requests in
flight: not served."""


class BatchScheduler:
    """Collects concurrent requests and decodes them as one batch on a worker thread; the
    batch's ``PausePoint`` (``pause``, ``resume``)."""

    join_share = 8
    """Requests join a running batch of ``rows`` once at least ``rows // join_share`` (and
    one) wait. SGLang admits at every step; on a CPU a prefill pass of a request or two costs
    about half a decode step, so joining a large batch at every step is slower than waiting
    for it to end (``benchmarks/decode_cost.py``'s stream, docs/benchmarks.md). A batch
    drains as it decodes, so a request left waiting joins once few rows remain, or starts the
    next batch."""

    def __init__(self, engine: HFEngine, max_batch_size: int, batch_wait_s: float) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.queue: queue.Queue = queue.Queue()
        self._state = threading.Condition()
        self.paused_mode: str | None = None  # the pause mode while paused
        self._waiting = 0  # requests submitted or retracted, not on the model now
        self._running = 0  # requests in the batch on the model now
        self._held = False  # the running batch waits, paused in place
        self._retracted: list = []  # requests a pause took off the model, first in the next batch
        self.batches_done = 0  # batches that ended (a sign of life for /health_generate)
        self.steps_seen = 0  # step boundaries of running batches (one too)
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
            self.queue.put((GenState(r), f, loop))
        return await asyncio.gather(*futures)

    def pause(self, mode: str) -> None:
        """Hold new batches and return once no forward pass runs, so weights can be swapped
        safely: in ``retract`` mode once the running batch has been retracted (its
        unfinished requests wait, first in line, with their output so far), ``in_place``
        once it waits at its next step boundary. A second pause may change the mode: from
        ``in_place`` to ``retract`` retracts the waiting batch, as SGLang does."""
        with self._state:
            self.paused_mode = mode
            self._state.notify_all()  # a batch held in place sees a new mode
            while self._running and not (mode == IN_PLACE and self._held):
                self._state.wait()

    def resume(self) -> None:
        with self._state:
            self.paused_mode = None
            self._state.notify_all()

    def pause_mode(self) -> str | None:
        """The mode the running batch pauses in, at its next step boundary (``PausePoint``)."""
        with self._state:
            self.steps_seen += 1
            return self.paused_mode

    def hold(self) -> None:
        """The running batch waits here while paused in place (``PausePoint``)."""
        with self._state:
            self._held = True
            self._state.notify_all()
            while self.paused_mode == IN_PLACE:
                self._state.wait()
            self._held = False

    def running(self) -> int:
        """Requests on the model now (held in place included)."""
        with self._state:
            return self._running

    def waiting(self) -> int:
        """Requests submitted or retracted and not on the model now."""
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
            return self.paused_mode == RETRACT or self._waiting == 0

    def _next_batch(self) -> list:
        """Retracted requests first, then queued ones, up to ``max_batch_size``."""
        with self._state:
            items = self._retracted[:self.max_batch_size]
            del self._retracted[:len(items)]
        if not items:
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
        return items

    def _loop(self) -> None:
        while True:
            items = self._next_batch()
            with self._state:
                while self.paused_mode is not None:  # hold queued requests until continue
                    self._state.wait()
                self._waiting -= len(items)
                self._running = len(items)
            waiters = {id(s): (fut, loop) for s, fut, loop in items}
            error = None
            try:
                self.engine.run([s for s, _, _ in items], self, partial(self._answer, waiters),
                                partial(self._admit, items, waiters))
            except Exception as e:  # the batch fails, the server lives on
                error = e
            retracted = [] if error else [it for it in items
                                          if it[0].finish_reason is None and it[0].error is None]
            with self._state:
                self._running = 0
                self._retracted += retracted
                self._waiting += len(retracted)
                self.batches_done += 1
                self._state.notify_all()
            if error is not None:  # the requests not answered yet fail with the batch
                for fut, loop in waiters.values():
                    _settle(loop, _set_exception, fut, error)

    def _admit(self, items: list, waiters: dict, rows: int) -> list[GenState]:
        """At a step boundary of the running batch, decoding ``rows`` requests: the requests
        waiting now (retracted ones first) join it, up to ``max_batch_size``, unless paused or
        fewer than its ``join_share``-th wait."""
        new = []
        with self._state:
            if self.paused_mode is not None:
                return []
            if len(self._retracted) + self.queue.qsize() < max(1, rows // self.join_share):
                return []
            room = self.max_batch_size - rows
            new = self._retracted[:max(room, 0)]
            del self._retracted[:len(new)]
            while len(new) < room:
                try:
                    new.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._waiting -= len(new)
            self._running += len(new)
        items += new
        waiters.update((id(s), (fut, loop)) for s, fut, loop in new)
        return [s for s, _, _ in new]

    def _answer(self, waiters: dict, state: GenState) -> None:
        """A request finished: it leaves the running batch and is answered now (as SGLang
        answers each request as it finishes), not when its batch ends."""
        fut, loop = waiters.pop(id(state))
        try:
            if state.error is not None:  # it failed alone, joining the batch
                raise state.error
            answer, settle = self.engine.result(state), _set_result
        except Exception as e:  # this request fails, not its batch
            answer, settle = e, _set_exception
        with self._state:
            self._running -= 1
            self._state.notify_all()
        _settle(loop, settle, fut, answer)


def _settle(loop: asyncio.AbstractEventLoop, settle, fut: asyncio.Future, value) -> None:
    """``settle(fut, value)`` on the client's event loop, from the batch's thread."""
    try:
        loop.call_soon_threadsafe(settle, fut, value)
    except RuntimeError:  # that loop has closed: nobody waits for the answer
        pass


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
